"""Checkpoints: cross-mesh restore, retention, torn and killed saves, preemption."""
import gc
import glob
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from posttrain.checkpoint import (
  CheckpointManager,
  PreemptionFlag,
  install_preemption_handler,
)


def _mesh(shape, devices):
  return Mesh(np.array(devices).reshape(shape), ("fsdp", "tensor"))


def _spec(ndim):
  return P("fsdp", "tensor") if ndim == 2 else P()


def _train_state(step, mesh):
  """A realistic state: sharded params, AdamW state, step, typed PRNG key, bf16 buffer."""
  rng = np.random.default_rng(step)
  params = {
      "embed": rng.standard_normal((12, 20), dtype=np.float32),  # prime-ish dims catch transposes
      "mlp": {"w": rng.standard_normal((20, 12), dtype=np.float32), "b": rng.standard_normal(7, dtype=np.float32)},
  }
  params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, _spec(x.ndim))), params)
  opt_state = optax.adamw(1e-3).init(params)
  opt_state = jax.tree.map(lambda x: x + step if jnp.issubdtype(x.dtype, jnp.floating) else x, opt_state)
  return {
      "params": params,
      "opt_state": opt_state,
      "step": jnp.int32(step),
      "rng": jax.random.split(jax.random.key(step), 3),
      "ema": jnp.asarray(rng.standard_normal((4, 4)), jnp.bfloat16),
  }


def _abstract_on(state, sharding_for):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(x)), state)


def _assert_bitwise_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jnp.issubdtype(w.dtype, jax.dtypes.prng_key):
      assert g.dtype == w.dtype
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(g)).view(np.uint8), np.atleast_1d(np.asarray(w)).view(np.uint8))


def _damage_data_files(directory, step, damage):
  # OCDBT may leave a data file that no manifest points to; damage them all.
  files = glob.glob(os.path.join(directory, str(step), "state", "**", "d", "*"), recursive=True)
  assert files
  for path in files:
    if damage == "truncate":
      os.truncate(path, os.path.getsize(path) // 2)
    else:
      os.remove(path)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 1), None], ids=["2x2_on_4", "4x1_on_4", "1_device"])
def test_save_on_8_devices_restore_bitwise_on_another_mesh(tmp_path, mesh_shape):
  mesh8 = _mesh((2, 4), jax.devices())
  state = _train_state(7, mesh8)
  assert state["params"]["embed"].sharding.num_devices == 8
  with CheckpointManager(tmp_path, save_every=1) as ckpt:
    assert ckpt.save(7, state, {"policy_version": 7})

  if mesh_shape is None:
    sharding_for = lambda x: SingleDeviceSharding(jax.devices()[5])
  else:
    mesh = _mesh(mesh_shape, jax.devices()[:4])
    sharding_for = lambda x: NamedSharding(mesh, _spec(x.ndim))
  with CheckpointManager(tmp_path) as ckpt:
    restored, extras, step = ckpt.restore(_abstract_on(state, sharding_for))
  assert step == 7 and extras == {"policy_version": 7}
  _assert_bitwise_equal(restored, state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(_abstract_on(state, sharding_for))):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


def test_nnx_model_optimizer_and_rngs_round_trip(tmp_path):
  mesh = _mesh((2, 4), jax.devices())
  model = nnx.Linear(4, 12, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  _, state = nnx.split((model, optimizer, nnx.Rngs(dropout=3)))
  state = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, _spec(x.ndim))), state)
  with CheckpointManager(tmp_path) as ckpt:
    ckpt.save(3, state, {}, force=True)
    one = SingleDeviceSharding(jax.devices()[1])
    restored, _, _ = ckpt.restore(_abstract_on(state, lambda x: one))
  _assert_bitwise_equal(restored, state)


def test_extras_round_trip_and_bad_extras_are_named(tmp_path):
  extras = {
      "policy_version": 12,
      "scheduler": {"weights": [0.25, 0.75], "seen": {"arith/1": 3}, "last": None, "done": False},
      "data_iterator": json.dumps({"next_index": 96}),
      "config": {"lr": 1e-5, "mesh": [2, 4], "name": "ppo_tiny"},
  }
  state = {"w": jnp.arange(5.0)}
  with CheckpointManager(tmp_path, save_every=1) as ckpt:
    ckpt.save(1, state, extras)
    with pytest.raises(TypeError, match=r"extras\['scheduler'\]\['seen'\] is a int64"):
      ckpt.save(2, state, {"scheduler": {"seen": np.int64(3)}})
    with pytest.raises(TypeError, match="non-str key 3"):
      ckpt.save(2, state, {3: "x"})
    ckpt.wait()
    assert ckpt.all_steps() == [1]
    _, got, _ = ckpt.restore(jax.eval_shape(lambda: state))
  assert got == extras


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"save_every": 0}, "save_every must be a positive int, got 0"),
        ({"keep_last": -1}, "keep_last must be a positive int, got -1"),
        ({"save_every": 10, "keep_every": 25}, "keep_every=25 must be a multiple of save_every=10"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, kwargs, match):
  with pytest.raises(ValueError, match=match):
    CheckpointManager(tmp_path, **kwargs)


def test_keep_last_plus_every_kth(tmp_path):
  save_every, keep_last, keep_every, total = 2, 2, 6, 21
  state = {"w": jnp.zeros(3)}
  with CheckpointManager(tmp_path, save_every=save_every, keep_last=keep_last, keep_every=keep_every) as ckpt:
    saved = [s for s in range(1, total + 1) if ckpt.should_save(s) and ckpt.save(s, state, {})]
    ckpt.wait()
    kept = ckpt.all_steps()
  assert saved == list(range(2, total + 1, save_every))
  want = sorted(set(saved[-keep_last:]) | {s for s in saved if s % keep_every == 0})
  assert kept == want == [6, 12, 18, 20]
  on_disk = sorted(int(n) for n in os.listdir(tmp_path) if n.isdigit())
  assert on_disk == want


def test_keep_steps_survive_retention(tmp_path):
  """A pinned step (the trainer's RL start, its KL reference) outlives keep_last."""
  state = {"w": jnp.zeros(3)}
  with CheckpointManager(tmp_path, save_every=1, keep_last=2, keep_steps=(3,),
                         async_save=False) as ckpt:
    for step in range(1, 9):
      ckpt.save(step, state, {})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 7, 8]


def test_state_may_be_donated_as_soon_as_save_returns(tmp_path):
  mesh = _mesh((2, 4), jax.devices())
  state = _train_state(4, mesh)
  want = jax.tree.map(lambda x: x.copy(), state)
  with CheckpointManager(tmp_path, save_every=1) as ckpt:
    ckpt.save(4, state, {})
    for leaf in jax.tree.leaves(state):  # what a donating train_step does to the buffers
      leaf.delete()
    ckpt.wait()
    restored, _, _ = ckpt.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want))
  _assert_bitwise_equal(restored, want)


def test_forced_save_off_cadence_and_twice_at_one_step(tmp_path):
  state = {"w": jnp.ones(3)}
  with CheckpointManager(tmp_path, save_every=100) as ckpt:
    assert not ckpt.should_save(37)
    assert not ckpt.save(37, state, {})
    assert ckpt.save(37, state, {}, force=True)
    assert not ckpt.save(37, state, {}, force=True)  # a preemption save right after a periodic one
    ckpt.wait()
    assert ckpt.all_steps() == [37]


def test_latest_step_ignores_unfinished_saves(tmp_path):
  big = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32))}
  with CheckpointManager(tmp_path, save_every=1) as ckpt:
    assert ckpt.latest_step() is None
    ckpt.save(1, big, {})
    ckpt.wait()
    ckpt.save(2, big, {})
    latest = ckpt.latest_step()  # the async write of step 2 is (almost surely) still running
    assert latest == 1 or (latest == 2 and (tmp_path / "2").is_dir())
    ckpt.wait()
    assert ckpt.latest_step() == 2

  # A save killed half way (or still running in the writer) leaves a tmp folder:
  # never listed, never restored; a reader leaves it alone, the next writer removes it.
  os.rename(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp")
  with CheckpointManager(tmp_path, read_only=True) as reader:
    assert reader.latest_step() == 1
    assert reader.restore(jax.eval_shape(lambda: big))[2] == 1
    with pytest.raises(ValueError, match="opened read_only"):
      reader.save(4, big, {}, force=True)
  assert (tmp_path / "3.orbax-checkpoint-tmp").is_dir()
  with CheckpointManager(tmp_path) as writer:
    assert writer.latest_step() == 1
    for _ in range(100):  # Orbax removes it in a background thread
      if not (tmp_path / "3.orbax-checkpoint-tmp").exists():
        break
      time.sleep(0.05)
  assert not (tmp_path / "3.orbax-checkpoint-tmp").exists()


# A failed read leaves TensorStore callbacks aimed at Orbax's closed event loop (harmless).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_torn_latest_checkpoint_is_skipped_with_warning(tmp_path, caplog, damage):
  mesh = _mesh((2, 4), jax.devices())
  states = {s: _train_state(s, mesh) for s in (1, 2, 3)}
  with CheckpointManager(tmp_path, save_every=1, keep_last=None) as ckpt:
    for s, state in states.items():
      ckpt.save(s, state, {"step": s})
  _damage_data_files(tmp_path, 3, damage)

  abstract = jax.eval_shape(lambda: states[1])
  with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"), CheckpointManager(tmp_path, save_every=1) as ckpt:
    restored, extras, step = ckpt.restore(abstract)
    assert (step, extras) == (2, {"step": 2})
    _assert_bitwise_equal(restored, states[2])
    assert ckpt.latest_step() == 2
    # The run continues and saves step 3 again where the torn one was.
    assert ckpt.save(3, states[3], {"step": 3}, force=True)
    ckpt.wait()
    assert ckpt.restore(abstract)[2] == 3
  assert any("step 3" in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
  assert (tmp_path / "3.unreadable").is_dir()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_nothing_readable_raises_and_wrong_tree_is_not_torn(tmp_path):
  state = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((64, 64), dtype=np.float32))}
  abstract = jax.eval_shape(lambda: state)
  with CheckpointManager(tmp_path) as ckpt:
    assert ckpt.restore(abstract) is None  # empty directory: start from scratch
    ckpt.save(1, state, {}, force=True)
    ckpt.wait()
    with pytest.raises(ValueError, match="abstract_state does not match checkpoint step 1"):
      ckpt.restore({"w": abstract["w"], "extra": abstract["w"]})
    with pytest.raises(ValueError, match="abstract_state does not match checkpoint step 1"):
      ckpt.restore({"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)})
    with pytest.raises(ValueError, match=r"step=5 is not a complete checkpoint .* have \[1\]"):
      ckpt.restore(abstract, step=5)
  assert (tmp_path / "1").is_dir()  # a caller mistake never moves a checkpoint aside

  _damage_data_files(tmp_path, 1, "delete")
  with CheckpointManager(tmp_path) as ckpt, pytest.raises(RuntimeError, match="no readable checkpoint .* step 1: "):
    ckpt.restore(abstract)


def _python(code, *args):
  return subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
  )


def _wait_for_line(proc, prefix):
  for line in proc.stdout:
    if line.startswith(prefix):
      return line
  raise AssertionError(f"child exited before printing {prefix!r}: {proc.stderr.read()[-2000:]}")


_SAVE_LOOP = """
import sys, itertools, numpy as np
from posttrain.checkpoint import CheckpointManager
ckpt = CheckpointManager(sys.argv[1], save_every=1, keep_last=2)
for step in itertools.count(1):
  w = np.random.default_rng(step).standard_normal((1024, 1024), dtype=np.float32)
  ckpt.save(step, {"w": w}, {"step": step})  # waits for the previous save, then writes async
  if step == 1:
    ckpt.wait()
    print("first saved", flush=True)
"""


def test_kill_9_during_save_loop_leaves_a_restorable_directory(tmp_path):
  child = _python(_SAVE_LOOP, tmp_path)
  try:
    _wait_for_line(child, "first saved")
    time.sleep(1.0)  # more saves start; the kill lands in the middle of one
  finally:
    child.send_signal(signal.SIGKILL)
    child.communicate()
  assert child.returncode == -signal.SIGKILL

  abstract = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  with CheckpointManager(tmp_path, save_every=1) as ckpt:
    restored, extras, step = ckpt.restore(abstract)
  assert step >= 1 and extras == {"step": step}
  want = np.random.default_rng(step).standard_normal((1024, 1024), dtype=np.float32)
  np.testing.assert_array_equal(np.asarray(restored["w"]), want)


_PREEMPTIBLE_LOOP = """
import sys, time, jax.numpy as jnp
from posttrain.checkpoint import CheckpointManager, PreemptionFlag
with PreemptionFlag() as preempted, CheckpointManager(sys.argv[1], save_every=1000) as ckpt:
  state = {"w": jnp.zeros(8)}
  for step in range(1, 100_000):
    state = {"w": state["w"] + 1}
    if step == 3:
      print("ready", flush=True)
    stop = preempted.reached(step)
    if stop or ckpt.should_save(step):
      ckpt.save(step, state, {"step": step}, force=stop)
    if stop:
      print(f"stopped at {step}", flush=True)
      break
    time.sleep(0.01)
"""


def test_sigterm_makes_the_loop_write_a_final_checkpoint_and_exit_0(tmp_path):
  child = _python(_PREEMPTIBLE_LOOP, tmp_path)
  try:
    _wait_for_line(child, "ready")
    child.send_signal(signal.SIGTERM)
    stopped = _wait_for_line(child, "stopped at")
    _, stderr = child.communicate(timeout=60)
  finally:
    if child.poll() is None:
      child.kill()
  assert child.returncode == 0, stderr[-2000:]
  step = int(stopped.split()[-1])
  assert step < 1000  # the save came from the signal, not the cadence
  with CheckpointManager(tmp_path) as ckpt:
    restored, extras, got_step = ckpt.restore({"w": jax.ShapeDtypeStruct((8,), jnp.float32)})
  assert got_step == step and extras == {"step": step}
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.full(8, step, np.float32))


def test_preemption_flag_restores_previous_handlers():
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  with PreemptionFlag() as preempted:
    assert not preempted.is_set() and not preempted.reached(1)
    signal.raise_signal(signal.SIGTERM)
    assert preempted.is_set() and preempted.reached(1)
    signal.raise_signal(signal.SIGTERM)  # repeated SIGTERM stays a request to save, not a kill
    # No collection while the handler runs: a gc callback (hypothesis installs one in the
    # process) would run it and swallow its KeyboardInterrupt as unraisable.
    gc.disable()
    try:
      with pytest.raises(KeyboardInterrupt):  # Ctrl-C once the flag is up aborts
        signal.raise_signal(signal.SIGINT)
    finally:
      gc.enable()
  assert {s: signal.getsignal(s) for s in before} == before

  seen = []
  uninstall = install_preemption_handler(seen.append, [signal.SIGUSR1])
  signal.raise_signal(signal.SIGUSR1)
  uninstall()
  assert seen == [signal.SIGUSR1]
  assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
