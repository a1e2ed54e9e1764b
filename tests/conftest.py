"""Test set-up: 8 fake CPU devices, strict rank promotion.

XLA_FLAGS must be set before jax is imported anywhere, so this file sets it at import,
with a compilation cache shared by the whole run.
"""
import os
import tempfile

from tests.xla_flags import FAST_COMPILE  # plain Python: imports no jax

# XLA takes a flag's last value: the caller's XLA_FLAGS override the fast compile (as
# benchmarks/suite_flags.py does), never the 8 devices.
os.environ["XLA_FLAGS"] = " ".join(
    [FAST_COMPILE, os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, its xdist workers and the processes
# tests launch (they inherit the environment): most tests compile the same tiny models'
# programs, and a warm cache loads them instead (`launch.train` restarts 2.27x faster,
# BENCHMARKS.md). Keyed by the program, flags and versions, so a stale entry never
# applies; a run's own --config.compile_cache_dir still takes precedence.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"posttrain-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# Files whose tests launch processes and run the longest: first, so the xdist workers do
# not end the run waiting on one of them (the scheduler hands out tests in this order).
LONGEST_FIRST = ("tests/test_multihost.py", "tests/test_trainer.py", "tests/test_placement.py")
# Tests marked slow by measurement (tests/slow_tests.txt: node ids, how it was made in its
# header), beside the ones marked in their files: the default run stays near 15 minutes on
# 2 cores, and `-m slow` runs them.
SLOW_TESTS = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def _measured_slow() -> set[str]:
  with open(SLOW_TESTS) as f:
    return {line.strip() for line in f if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before the -m selection deselects the slow ones
def pytest_collection_modifyitems(items):
  slow = _measured_slow()
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
  rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory):
  """A small BPE tokenizer with Qwen3's ChatML and <think> tokens (an HFTokenizer)."""
  from tests.data.test_reasoning import QWEN3_SPECIALS, _write_tokenizer
  return _write_tokenizer(tmp_path_factory.mktemp("qwen3"), QWEN3_SPECIALS)


@pytest.fixture(scope="session")
def harmony(tmp_path_factory):
  """A small BPE tokenizer with gpt-oss's harmony tokens (an HFTokenizer)."""
  from tests.data.test_reasoning import HARMONY_SPECIALS, _write_tokenizer
  return _write_tokenizer(tmp_path_factory.mktemp("harmony"), HARMONY_SPECIALS)


@pytest.fixture(scope="session")
def deepseek(tmp_path_factory):
  """A small BPE tokenizer with DeepSeek-R1's tokens (and the ChatML and Llama 3 ones its
  distills' vocabularies also hold)."""
  from tests.data.test_reasoning import R1_SPECIALS, _write_tokenizer
  return _write_tokenizer(tmp_path_factory.mktemp("r1"), R1_SPECIALS)


@pytest.fixture
def scored(monkeypatch):
  """The samples rollouts score, in order (the worker's `_score` spied on)."""
  from posttrain.rollout import worker as worker_lib
  seen = []
  score = worker_lib._score

  def spy(task, sample):
    seen.append(sample)
    return score(task, sample)

  monkeypatch.setattr(worker_lib, "_score", spy)
  return seen
