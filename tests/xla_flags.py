"""XLA flags of the test run: conftest sets them, and tests that launch processes pass them on.

Tests compile hundreds of small programs and run each for milliseconds, so compiling is
most of the suite's time. With LLVM's cheap passes test files run 1.29-1.48x faster
(BENCHMARKS.md, "Test suite"). They change no result (no fast-math either way) and
nothing compiled for TPU (the AOT tests' programs are the same byte for byte).
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` fake CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
