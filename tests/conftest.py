"""Test set-up: 8 fake CPU devices, strict rank promotion.

XLA_FLAGS must be set before jax is imported anywhere, so this file sets it at import.
"""
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole run, shared by the xdist workers and the
# processes tests launch: many tests compile the same programs (the tiny models' steps on
# the same meshes), and a hit loads the executable instead of compiling it again. The
# process that creates the directory (the xdist controller, or the only process) removes
# it at the end; set POSTTRAIN_TEST_COMPILE_CACHE to a directory to keep one across runs,
# or to "off". The size cap turns on JAX's file lock, so no reader ever sees an entry
# half written by another process or thread.
_CACHE_ENV = "POSTTRAIN_TEST_COMPILE_CACHE"
_OWN_CACHE = None
if _CACHE_ENV not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix="posttrain-test-jax-cache-")
  os.environ[_CACHE_ENV] = _OWN_CACHE  # inherited by the xdist workers
if os.environ[_CACHE_ENV] != "off":
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[_CACHE_ENV])
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
