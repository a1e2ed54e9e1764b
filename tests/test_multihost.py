"""Multi-process runs on one machine: two processes of 4 fake CPU devices each join one
8-device mesh through a localhost coordinator (`posttrain.distributed`), then the real
launcher trains, checkpoints from both processes and resumes."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from posttrain import distributed
from tests.test_trainer import OVERRIDES
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV_KEYS = (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
             distributed.ENV_PROCESS_ID)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(port: int, process_id: int) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS}
  env.update({"XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu",
              distributed.ENV_COORDINATOR: f"localhost:{port}",
              distributed.ENV_NUM_PROCESSES: "2", distributed.ENV_PROCESS_ID: str(process_id)})
  return env


def _run_two(args: list[str], timeout: float) -> list[tuple[int, str]]:
  """Runs `python *args` as processes 0 and 1 of one run; [(returncode, output)]."""
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(port, i),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [(p.returncode, out) for p, out in zip(procs, outs)]


@pytest.fixture
def clean_env(monkeypatch):
  for key in _ENV_KEYS:
    monkeypatch.delenv(key, raising=False)
  return monkeypatch


# ----------------------------------------------------------------------------------------
# Deciding the layout (in-process, nothing is initialised)
# ----------------------------------------------------------------------------------------


def test_single_process_initialises_nothing_and_is_idempotent(clean_env):
  clean_env.setattr(distributed, "detected_cluster", lambda: None)
  first = distributed.maybe_initialize()
  assert first == distributed.maybe_initialize()
  assert (first.num_processes, first.process_id, first.source) == (1, 0, "single")
  assert first.local_devices == first.global_devices == jax.device_count()
  assert not jax.distributed.is_initialized()
  # An explicit one-process layout is a single process too.
  assert distributed.maybe_initialize(num_processes=1).source == "single"


@pytest.mark.parametrize("env, args, message", [
    ({"JAX_NUM_PROCESSES": "two"}, {}, "JAX_NUM_PROCESSES='two' is not an integer"),
    ({"JAX_PROCESS_ID": "1.5"}, {}, "JAX_PROCESS_ID='1.5' is not an integer"),
    ({}, {"num_processes": 2, "process_id": 0}, "num_processes=2 also needs coordinator"),
    ({"JAX_NUM_PROCESSES": "4", "JAX_COORDINATOR_ADDRESS": "h:1"}, {},
     "num_processes=4 also needs process_id"),
    ({}, {"coordinator": "h:1", "num_processes": 2, "process_id": 2},
     "process_id=2 is out of range for num_processes=2"),
    ({}, {"coordinator": "10.0.0.2", "num_processes": 2, "process_id": 0},
     "coordinator address='10.0.0.2' must be host:port"),
    ({}, {"coordinator": "h:99999", "num_processes": 2, "process_id": 0}, "must be host:port"),
    ({}, {"num_processes": 0}, "num_processes=0 must be >= 1"),
    ({}, {"num_processes": 1, "process_id": 3}, "process_id=3 is out of range"),
    ({}, {"process_id": 1}, "process_id=1 given but num_processes is not"),
])
def test_bad_layouts_are_one_line_errors_naming_the_value(clean_env, env, args, message):
  clean_env.setattr(distributed, "detected_cluster", lambda: None)
  for k, v in env.items():
    clean_env.setenv(k, v)
  called = []
  clean_env.setattr(jax.distributed, "initialize", lambda **kw: called.append(kw))
  with pytest.raises(ValueError, match=message.replace("(", r"\(")) as info:
    distributed.maybe_initialize(**args)
  assert "\n" not in str(info.value) and not called


def test_arguments_win_over_environment_and_switch_off_cluster_detection(clean_env):
  clean_env.setenv("JAX_COORDINATOR_ADDRESS", "env-host:1")
  clean_env.setenv("JAX_NUM_PROCESSES", "8")
  clean_env.setenv("JAX_PROCESS_ID", "7")
  calls = []
  clean_env.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  clean_env.setitem(distributed._joined, "coordinator", None)
  layout = distributed.maybe_initialize("flag-host:2", 4, 3, timeout_s=7)
  assert calls == [{"coordinator_address": "flag-host:2", "num_processes": 4, "process_id": 3,
                    "cluster_detection_method": "deactivate", "initialization_timeout": 7}]
  assert layout.coordinator == "flag-host:2" and layout.source == "arguments"


def test_environment_layout_is_used_when_no_arguments(clean_env):
  clean_env.setenv("JAX_COORDINATOR_ADDRESS", "env-host:1")
  clean_env.setenv("JAX_NUM_PROCESSES", "8")
  clean_env.setenv("JAX_PROCESS_ID", "7")
  calls = []
  clean_env.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  clean_env.setitem(distributed._joined, "coordinator", None)
  assert distributed.maybe_initialize().source == "environment"
  assert calls[0]["num_processes"] == 8 and calls[0]["process_id"] == 7
  assert calls[0]["coordinator_address"] == "env-host:1"


def test_slurm_job_is_detected_through_jax_and_initialised_without_arguments(clean_env):
  for key, value in {"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": "node[001-002]",
                     "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}.items():
    clean_env.setenv(key, value)
  assert distributed.detected_cluster() == ("slurm", 2)
  calls = []
  clean_env.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  clean_env.setitem(distributed._joined, "coordinator", None)
  assert distributed.maybe_initialize().source == "slurm"
  assert calls == [{"initialization_timeout": 300}]  # JAX fills in the rest.
  # A one-task job is a single process: nothing to join.
  clean_env.setenv("SLURM_NTASKS", "1")
  calls.clear()
  assert distributed.maybe_initialize().source == "single" and not calls


def test_join_failure_is_a_connection_error_naming_the_process(clean_env):
  def fail(**_):
    raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out\nmore detail")
  clean_env.setattr(jax.distributed, "initialize", fail)
  with pytest.raises(ConnectionError, match=r"process 1 of 2 at h:5 within 3 s: DEADLINE"):
    distributed.maybe_initialize("h:5", 2, 1, timeout_s=3)


def test_allgather_json_in_one_process_returns_the_object():
  obj = {"3": {"value": 0.5, "components": {"a": 1.0}, "verdict": "ünïcode ✓"}}
  assert distributed.allgather_json(obj, "test/1") == [obj]


def test_launcher_reports_a_bad_layout_in_one_line(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS}
  env.update({"JAX_PLATFORMS": "cpu"})
  proc = subprocess.run([sys.executable, "-m", "launch.train", "--config=configs/default.py",
                         f"--workdir={tmp_path}", "--num_processes=2", "--process_id=1"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 2
  assert "error: num_processes=2 also needs coordinator address" in proc.stderr
  assert "Traceback" not in proc.stderr + proc.stdout


# ----------------------------------------------------------------------------------------
# Two real processes
# ----------------------------------------------------------------------------------------

_PSUM = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from posttrain import distributed, models
layout = distributed.maybe_initialize()
assert distributed.maybe_initialize() == distributed.ProcessLayout(**{**layout.__dict__,
                                                                     "source": "already"})
mesh = models.make_mesh((1, -1, 1, 1))
x = jax.device_put(np.arange(24.0).reshape(8, 3), NamedSharding(mesh, P("fsdp")))
total = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh, P()))(x)
print("LAYOUT", layout.process_id, layout.num_processes, layout.local_devices,
      layout.global_devices, dict(mesh.shape)["fsdp"], float(total), flush=True)
"""


def test_two_processes_form_one_eight_device_mesh():
  results = _run_two(["-c", _PSUM], timeout=240)
  expected = float(np.sum(np.arange(24.0) ** 2))
  for pid, (code, out) in enumerate(results):
    assert code == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("LAYOUT"))
    assert line.split()[1:] == [str(pid), "2", "4", "8", "8", str(expected)]


# The trainer tests' tiny run, with the counts the assertions below rely on pinned.
_PINNED = {"sft.steps": 2, "train.rl_steps": 2, "checkpoint.every": 1,
           "checkpoint.async_save": False, "train.log_every": 1}


def _train_args(workdir, **extra):
  flags = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **_PINNED, **extra}.items()]
  return ["-m", "launch.train", f"--config={ROOT}/configs/default.py", f"--workdir={workdir}",
          *flags]


@pytest.mark.slow
def test_two_process_training_checkpoints_from_both_and_resumes(tmp_path):
  cache = {"compile_cache_dir": tmp_path / "cache"}  # process 0 writes, both read
  first = _run_two(_train_args(tmp_path, **cache), timeout=900)
  for code, out in first:
    assert code == 0, out[-3000:]
  ckpts = tmp_path / "checkpoints"
  newest = max(int(d) for d in os.listdir(ckpts) if d.isdigit())
  assert newest == 4  # 2 SFT + 2 RL steps
  # Both processes wrote their own shards (one OCDBT tree and metadata file each).
  state_dir = ckpts / str(newest) / "state"
  assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(state_dir))
  assert set(os.listdir(state_dir / "array_metadatas")) == {"process_0", "process_1"}
  rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "reward/mean" in r] == [3, 4]  # Process 0 only, once.
  # Each process loaded and packed half of each SFT batch; together they trained on the
  # same demonstrations as one process with all 8 devices: the same nll, step by step.
  for pid, (_, out) in enumerate(first):
    assert f"SFT data: process {pid} of 2 loads 4 of the 8 demonstrations" in out
  from configs import default
  from posttrain import planner, trainer
  single = planner.override(default.get_config(), {**OVERRIDES, **_PINNED, "train.rl_steps": 0})
  trainer.train(single, str(tmp_path / "single"))
  want = [json.loads(ln) for ln in (tmp_path / "single" / "metrics.jsonl").read_text()
          .splitlines()]
  nll = lambda rs: [r["sft/nll"] for r in rs if "sft/nll" in r]  # noqa: E731
  assert len(nll(rows)) == 2 and nll(rows) == pytest.approx(nll(want), rel=1e-5, abs=1e-6)
  # Each process scored half the samples; the rewards were exchanged, not recomputed.
  assert [r["rollout/scored_fraction"] for r in rows if "reward/mean" in r] == [0.5, 0.5]

  assert os.listdir(tmp_path / "cache")
  export = {"export_hf": tmp_path / "hf"}
  second = _run_two(_train_args(tmp_path, **cache, **export, **{"train.rl_steps": 3}),
                    timeout=900)
  for code, out in second:
    assert code == 0, out[-3000:]
    assert "resumed from checkpoint 4 (stage rl, sft step 2, preference step 0, rl step 2)" in out
    assert "'rl_steps': 3" in out
  rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  rl_rows = [r for r in rows if "reward/mean" in r]
  assert [r["step"] for r in rl_rows] == [3, 4, 5]
  assert all(np.isfinite(r["grad_norm"]) for r in rl_rows)
  # The export gathers the parameters both processes hold: the final checkpoint's.
  from flax import nnx

  from posttrain import experiment, models
  from posttrain.checkpoint import CheckpointManager
  mesh = models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  abstract = experiment.abstract_checkpoint(trainer.model_config(single),
                                            experiment.optimizer_like(single), mesh, ())
  state, _, step = CheckpointManager(str(tmp_path / "checkpoints"),
                                     read_only=True).restore(abstract)
  assert step == 5
  exported = nnx.to_pure_dict(nnx.state(models.from_pretrained(str(tmp_path / "hf")),
                                        nnx.Param))
  saved = nnx.to_pure_dict(state["params"])
  flat = lambda d: dict(jax.tree_util.tree_flatten_with_path(d)[0])  # noqa: E731
  assert flat(exported).keys() == flat(saved).keys()
  for key, value in flat(saved).items():
    np.testing.assert_array_equal(np.asarray(flat(exported)[key]), np.asarray(value))

  # The export and eval launchers join the processes the same way: each restores its own
  # shards of the checkpoint, process 0 writes.
  run_flags = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **_PINNED}.items()]
  common = [f"--config={ROOT}/configs/default.py", f"--workdir={tmp_path}", *run_flags]
  for code, out in _run_two(["-m", "launch.export", *common, f"--out={tmp_path / 'hf2'}"],
                            timeout=600):
    assert code == 0, out[-3000:]
    assert "wrote checkpoint 5 as" in out
  again = nnx.to_pure_dict(nnx.state(models.from_pretrained(str(tmp_path / "hf2")),
                                     nnx.Param))
  for key, value in flat(saved).items():
    np.testing.assert_array_equal(np.asarray(flat(again)[key]), np.asarray(value))
  results = _run_two(["-m", "launch.eval", *common, "--samples=0"], timeout=600)
  for code, out in results:
    assert code == 0, out[-3000:]
  summaries = [next(ln[ln.index("step 5:"):] for ln in out.splitlines() if "step 5:" in ln)
               for _, out in results]
  assert summaries[0] == summaries[1]  # one SPMD evaluation, the same on both hosts
  report = json.loads((tmp_path / "eval" / "step_5" / "report.json").read_text())
  from posttrain import evaluation
  single_report, _ = evaluation.evaluate_checkpoint(single, str(tmp_path), step=5, write=False)
  assert report["overall"]["tasks"] == single_report["overall"]["tasks"] > 0
  # Task by task (seed, pass, reward, tokens generated, finish reason): what one process
  # over the same 8 devices finds.
  assert report["tasks"] == json.loads(evaluation.dumps(single_report))["tasks"]


# About three minutes on two cores (two processes, each compiling both meshes' programs):
# runs with -m slow. Disaggregated placement runs in one process in tests/test_placement.py.
@pytest.mark.slow
def test_two_process_disaggregated_training_runs_rollouts_and_updates(tmp_path):
  """Each host gives 2 of its 4 devices to the rollout mesh; weights cross meshes device to
  device (each host's train devices stage its rollout devices' shards) and rewards through
  the coordination service, so the rollout thread and the learner never issue a collective
  over every device. On CPU they also take turns on the devices: two programs spanning
  both processes, dispatched in opposite orders on the two hosts, deadlock there (it hung
  about once in 15 runs under load before)."""
  results = _run_two(_train_args(tmp_path, **{"placement.mode": "disaggregated",
                                               "placement.rollout_devices": 4,
                                               "placement.segment_tokens": 3}), timeout=900)
  for code, out in results:
    assert code == 0, out[-3000:]
    assert "'rl_steps': 2" in out
    assert "weight sync train mesh -> rollout mesh across 2 processes: device path" in out
    assert "the learner and the rollouts take turns on the devices" in out
  rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  rl_rows = [r for r in rows if "reward/mean" in r]
  assert [r["step"] for r in rl_rows] == [3, 4]
  # Weights swap only between batches on several hosts: every continued segment resumes
  # from its kept cache, on both hosts alike (mismatched programs would hang or fail).
  assert all(r["rollout/resumed_fraction"] == 1.0 for r in rl_rows), rl_rows
  assert all(r["timing/weight_sync_s"] > 0 and np.isfinite(r["grad_norm"]) for r in rl_rows)


class _HalfSharding:
  """The device -> index map one process of two would see."""

  def __init__(self, indices):
    self.indices = indices

  def addressable_devices_indices_map(self, shape):
    return {i: index for i, index in enumerate(self.indices)}


def test_process_row_spans_find_an_even_split_and_refuse_anything_else(monkeypatch):
  from jax.sharding import NamedSharding, PartitionSpec as P
  from posttrain import models
  mesh = models.make_mesh((1, -1, 1, 1))
  rows = NamedSharding(mesh, P(None, "fsdp"))
  # One process holds every row, one per device.
  assert distributed.process_row_spans(rows, (1, 8, 16)) == [(i, i + 1) for i in range(8)]
  assert distributed.process_row_spans(NamedSharding(mesh, P()), (1, 8, 16)) == [(0, 8)]
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  full = slice(None)
  half = _HalfSharding([(full, slice(4, 6), full), (full, slice(6, 8), full)])
  assert distributed.process_row_spans(half, (1, 8, 16)) == [(4, 6), (6, 8)]
  # Replicated over the processes (each holds all 8 rows), or overlapping: no split.
  assert distributed.process_row_spans(rows, (1, 8, 16)) is None
  overlap = _HalfSharding([(full, slice(0, 3), full), (full, slice(2, 4), full)])
  assert distributed.process_row_spans(overlap, (1, 8, 16)) is None


def test_assemble_rows_places_each_local_row_at_its_global_index():
  from jax.sharding import NamedSharding, PartitionSpec as P
  from posttrain import models
  mesh = models.make_mesh((1, -1, 1, 1))
  sharding = NamedSharding(mesh, P(None, "fsdp"))
  spans = distributed.process_row_spans(sharding, (2, 8, 3))
  local = {"x": np.arange(48).reshape(2, 8, 3)}
  out = distributed.assemble_rows(local, sharding, spans, 8)
  np.testing.assert_array_equal(np.asarray(out["x"]), local["x"])
  assert out["x"].sharding == sharding
  with pytest.raises(ValueError, match="local part has 7 rows along axis 1"):
    distributed.assemble_rows({"x": np.zeros((2, 7, 3))}, sharding, spans, 8)


_COPY_SCRIPT = r"""
import sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.experimental import multihost_utils
from posttrain import distributed, models
from posttrain.experiment import split_devices

distributed.maybe_initialize()
gathers = []
real_allgather = multihost_utils.process_allgather
def counting_allgather(*args, **kwargs):
  gathers.append(1)
  return real_allgather(*args, **kwargs)
multihost_utils.process_allgather = counting_allgather
whole = np.arange(12 * 24, dtype=np.float32).reshape(12, 24)
for rollout in (4, 2, 6):
  roll, train = split_devices(jax.devices(), rollout)
  src = NamedSharding(models.make_mesh((1, -1, 1, 1), devices=train), P("fsdp", None))
  x = jax.make_array_from_callback(whole.shape, src, lambda index: whole[index])
  rollout_mesh = models.make_mesh((1, -1, 1, 1), devices=roll)
  for spec in (P(), P("fsdp", None), P(None, "fsdp")):
    if spec == P(None, "fsdp") and 24 % len(roll):
      continue
    dst = NamedSharding(rollout_mesh, spec)
    path = distributed.cross_host_path(x.sharding, dst)
    before = len(gathers)
    y = distributed.copy_to(x, dst)
    assert y.sharding == dst, (y.sharding, dst)
    for shard in y.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])
    print(f"copy rollout={rollout} spec={tuple(spec)} path={path} "
          f"gathered={len(gathers) - before}", flush=True)
# Rollout devices on a host that holds none of the source's: only host memory can serve it.
by_process = [[d for d in jax.devices() if d.process_index == p] for p in (0, 1)]
only_first = NamedSharding(models.make_mesh((1, -1, 1, 1), devices=by_process[0]), P())
on_second = NamedSharding(models.make_mesh((1, -1, 1, 1), devices=by_process[1]), P())
print("path without a local source:", distributed.cross_host_path(only_first, on_second))
"""


@pytest.mark.slow
def test_two_process_weight_copy_stays_on_devices_when_each_host_holds_both_meshes():
  """Train mesh -> rollout mesh across 2 processes, never through host memory: with every
  host's train devices a whole multiple of its rollout devices (2+2 and 3+1 per host) each
  shard is laid out on a train device of its own host and copied device to device; with
  more rollout than train devices (1+3) the array is replicated over the train devices and
  each host copies slices of its own replica. Every process's shards equal the source
  array's. A host with rollout devices but no train devices would need host memory."""
  results = _run_two(["-c", _COPY_SCRIPT], timeout=300)
  for code, out in results:
    assert code == 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("copy ")]
    assert len(lines) == 9, out[-3000:]
    for ln in lines:
      rollout = int(ln.split("rollout=")[1].split()[0])
      if rollout in (4, 2):
        assert "path=device gathered=0" in ln, ln
      else:
        assert "path=gathered gathered=0" in ln, ln
    assert "path without a local source: host" in out
