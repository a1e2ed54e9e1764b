"""Multi-process start-up: one process per host, one global mesh over every device.

    from posttrain import distributed
    layout = distributed.maybe_initialize()   # before anything touches jax devices

Where the process layout comes from, first match wins:

1. arguments (the launcher's --coordinator_address / --num_processes / --process_id);
2. environment variables, the same names on every host:
     JAX_COORDINATOR_ADDRESS   host:port of process 0 (JAX reads this one itself too)
     JAX_NUM_PROCESSES         how many processes take part
     JAX_PROCESS_ID            this process's index in [0, JAX_NUM_PROCESSES)
3. a cluster JAX knows (Cloud TPU pod slice, GKE TPU, SLURM, Open MPI): when it reports
   more than one process, `jax.distributed.initialize()` is called with no arguments and
   fills everything in (on a TPU pod slice: one process per TPU VM host).

One process (no variables, a single TPU VM or GPU host, a laptop) initialises nothing.
With explicit values JAX's cluster detection is switched off, so every local accelerator
stays visible to the one process of its host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

log = logging.getLogger("posttrain")

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
  """Where this process sits in the run.

  Attributes:
    process_id / num_processes: `jax.process_index()` / `jax.process_count()`.
    local_devices / global_devices: devices this process drives / the mesh can span.
    platform: cpu, gpu or tpu.
    coordinator: host:port of process 0, None for a single process.
    source: what decided the layout: single, arguments, environment, a cluster name,
      or already (initialised earlier in this process).
  """

  process_id: int
  num_processes: int
  local_devices: int
  global_devices: int
  platform: str
  coordinator: str | None
  source: str


def _env_int(name: str) -> int | None:
  raw = os.environ.get(name, "").strip()
  if not raw:
    return None
  try:
    return int(raw)
  except ValueError:
    raise ValueError(f"{name}={raw!r} is not an integer") from None


def _check_coordinator(address: str, origin: str) -> str:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{origin}={address!r} must be host:port, e.g. 10.0.0.2:8476")
  return address


def detected_cluster() -> tuple[str, int] | None:
  """(name, process count) of the cluster JAX would auto-detect, or None.

  Uses JAX's own cluster registry (the code `jax.distributed.initialize()` runs with no
  arguments); opt-in methods such as mpi4py are skipped, as JAX skips them.
  """
  try:
    # Private, but the only source of JAX's own detection.
    from jax._src import clusters

    candidates = [c for c in clusters.ClusterEnv._cluster_types if not c.opt_in_only_method]
  except (ImportError, AttributeError):
    return None
  for env in candidates:
    try:
      if env.is_env_present():
        return env.name or env.__name__, int(env.get_process_count())
    except Exception as e:  # noqa: BLE001 - a half-configured cluster is "no cluster".
      log.warning("cluster detection %s failed: %s", env.__name__, e)
  return None


_joined: dict[str, str | None] = {"coordinator": None}


def _layout(source: str) -> ProcessLayout:
  return ProcessLayout(process_id=jax.process_index(), num_processes=jax.process_count(),
                       local_devices=jax.local_device_count(),
                       global_devices=jax.device_count(), platform=jax.default_backend(),
                       coordinator=_joined["coordinator"], source=source)


def _initialize(source: str, timeout_s: int, **kwargs) -> ProcessLayout:
  what = (f"process {kwargs['process_id']} of {kwargs['num_processes']} at "
          f"{kwargs['coordinator_address']}" if "process_id" in kwargs else f"the {source} run")
  try:
    jax.distributed.initialize(initialization_timeout=timeout_s, **kwargs)
    _joined["coordinator"] = kwargs.get("coordinator_address") or os.environ.get(
        ENV_COORDINATOR) or "auto-detected"
  except RuntimeError as e:
    if "must be called before" in str(e):
      raise ValueError("jax.distributed must start before anything touches the devices: "
                       "call posttrain.distributed.maybe_initialize() first") from None
    raise ConnectionError(f"could not start {what} within {timeout_s} s: "
                          f"{str(e).strip().splitlines()[0]}") from None
  except Exception as e:  # noqa: BLE001 - the runtime raises its own error types.
    raise ConnectionError(f"could not start {what} within {timeout_s} s: "
                          f"{str(e).strip().splitlines()[0]}") from None
  return _layout(source)


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, timeout_s: int = 300) -> ProcessLayout:
  """Joins a multi-process run when one was launched; a no-op for a single process.

  Idempotent: a second call returns the layout of the first. Call it before anything
  touches jax devices (`jax.devices()`, a jit, a device_put).

  Args:
    coordinator: host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS).
    num_processes: processes in the run (default: $JAX_NUM_PROCESSES).
    process_id: this process's index (default: $JAX_PROCESS_ID).
    timeout_s: how long to wait for every process to reach the coordinator.

  Returns:
    The ProcessLayout, also logged.

  Raises:
    ValueError: an inconsistent or malformed layout (the message names the value).
    ConnectionError: the processes could not reach each other within `timeout_s`.
  """
  if jax.distributed.is_initialized():
    return _log(_layout("already"))
  source = "arguments"
  if coordinator is None and num_processes is None and process_id is None:
    source = "environment"
  coordinator = coordinator or os.environ.get(ENV_COORDINATOR, "").strip() or None
  num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
  process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes={num_processes} must be >= 1")
  if process_id is not None and process_id < 0:
    raise ValueError(f"process_id={process_id} must be >= 0")
  if coordinator is not None:
    coordinator = _check_coordinator(coordinator, "coordinator address")

  if num_processes == 1:
    if process_id not in (None, 0):
      raise ValueError(f"process_id={process_id} is out of range for num_processes=1")
    return _log(_layout("single"))
  if num_processes is not None:
    missing = [name for name, value in (("coordinator address", coordinator),
                                        ("process_id", process_id)) if value is None]
    if missing:
      raise ValueError(f"num_processes={num_processes} also needs {' and '.join(missing)} "
                       f"(flags, or ${ENV_COORDINATOR} / ${ENV_PROCESS_ID})")
    if process_id >= num_processes:
      raise ValueError(f"process_id={process_id} is out of range for "
                       f"num_processes={num_processes}")
    return _log(_initialize(source, timeout_s, coordinator_address=coordinator,
                            num_processes=num_processes, process_id=process_id,
                            cluster_detection_method="deactivate"))

  cluster = detected_cluster()
  if cluster is not None and cluster[1] > 1:
    # JAX fills in what was not given (an explicit coordinator or id still wins).
    kwargs = {k: v for k, v in (("coordinator_address", coordinator),
                                ("process_id", process_id)) if v is not None}
    return _log(_initialize(cluster[0], timeout_s, **kwargs))
  if process_id not in (None, 0):
    raise ValueError(f"process_id={process_id} given but num_processes is not "
                     f"(flag or ${ENV_NUM_PROCESSES}) and no multi-process cluster was detected")
  return _log(_layout("single"))


def _log(layout: ProcessLayout) -> ProcessLayout:
  log.info("process %d of %d (%s): %d local of %d %s devices%s", layout.process_id,
           layout.num_processes, layout.source, layout.local_devices, layout.global_devices,
           layout.platform, f", coordinator {layout.coordinator}" if layout.coordinator else "")
  return layout


# ----------------------------------------------------------------------------------------
# Host-side exchanges through the coordination service
# ----------------------------------------------------------------------------------------
#
# A disaggregated run issues device programs from two threads (rollouts on the rollout
# mesh, updates on the train mesh). A collective over *every* device, such as
# `multihost_utils.process_allgather` of a host value or a device barrier, issued from one
# thread while the other runs programs would be ordered differently on different hosts
# and hang. Host values therefore travel through the coordination service's key-value
# store, and barriers use it too (`use_coordination_barriers`).

EXCHANGE_TIMEOUT_S = 3600


def _client():
  from jax._src import distributed as jax_distributed  # the client JAX joined with
  return jax_distributed.global_state.client


def allgather_json(obj: Any, tag: str, timeout_s: float = EXCHANGE_TIMEOUT_S) -> list[Any]:
  """`obj` from every process, in process order; one process: `[obj]`.

  `tag` names this exchange: unique within the run and the same on every process.
  """
  client = _client()
  if client is None or jax.process_count() == 1:
    return [obj]
  client.key_value_set(f"{tag}/{jax.process_index()}", json.dumps(obj))
  out = []
  for p in range(jax.process_count()):
    try:
      out.append(json.loads(client.blocking_key_value_get(f"{tag}/{p}",
                                                         int(timeout_s * 1000))))
    except Exception as e:  # noqa: BLE001 - the client raises its runtime's own type.
      raise TimeoutError(f"no answer from process {p} for {tag} within {timeout_s:g} s: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from e
  return out


def delete_key(key: str) -> None:
  """Drops `key` from the store (every process must have read it)."""
  client = _client()
  if client is not None:
    client.key_value_delete(key)


def use_coordination_barriers() -> bool:
  """Makes Orbax synchronise processes through the coordination service instead of a
  collective over every device (its `experimental_orbax_use_distributed_barrier` flag).
  Needs parsed absl flags (the launchers have them); False when they are not."""
  from absl import flags
  import orbax.checkpoint  # noqa: F401 - defines the flag
  name = "experimental_orbax_use_distributed_barrier"
  if name not in flags.FLAGS or not flags.FLAGS.is_parsed():
    return False
  flags.FLAGS[name].value = True
  return True


def put(tree: Any, sharding) -> Any:
  """`jax.device_put(tree, sharding)` for step inputs, safe from any thread.

  With several processes, `device_put` of a host value onto devices of every host first
  checks that all processes passed the same value, with a collective over every device;
  issued from a rollout thread while the learner runs, that collective can hang (see
  above). Host values are laid out from this process's shards instead
  (`jax.make_array_from_callback`, no communication): every process must pass the same
  values, as SPMD requires anyway. Arrays already spread over several hosts are resharded
  with `device_put`. `sharding` is one sharding for every leaf or a matching tree.
  """
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)

  def one(x, s):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda x: one(x, sharding), tree)
  return jax.tree.map(one, tree, sharding)


def process_row_spans(sharding, shape: Sequence[int], axis: int = 1
                      ) -> list[tuple[int, int]] | None:
  """The [start, stop) ranges of `axis` that this process's devices hold under `sharding`,
  in order, when the processes split that axis evenly (each holds 1 / process_count of it,
  as when the batch mesh axes span every host); None when they do not, e.g. when every
  process holds all of it."""
  spans = sorted({index[axis].indices(shape[axis])[:2]
                  for index in sharding.addressable_devices_indices_map(tuple(shape)).values()})
  overlapping = any(a[1] > b[0] for a, b in zip(spans, spans[1:]))
  if overlapping or sum(b - a for a, b in spans) * jax.process_count() != shape[axis]:
    return None
  return spans


def assemble_rows(local: Mapping[str, np.ndarray], sharding, spans: Sequence[tuple[int, int]],
                  rows: int, axis: int = 1) -> dict[str, jax.Array]:
  """Global arrays with `rows` along `axis` from this process's part of them.

  `local[k]` holds, along `axis`, the rows of `spans` (from `process_row_spans`) one after
  the other; every process passes its own part, so each loads and packs only the data its
  devices hold (no communication). The other axes are whole on every process.
  """
  offsets = np.cumsum([0] + [b - a for a, b in spans])

  def one(x):
    x = np.asarray(x)
    if x.shape[axis] != offsets[-1]:
      raise ValueError(f"local part has {x.shape[axis]} rows along axis {axis}; this "
                       f"process holds {int(offsets[-1])}")
    shape = x.shape[:axis] + (rows,) + x.shape[axis + 1:]

    def block(index):
      start, stop, _ = index[axis].indices(rows)
      for (a, b), off in zip(spans, offsets):
        if a <= start and stop <= b:
          local_index = list(index)
          local_index[axis] = slice(int(off) + start - a, int(off) + stop - a)
          return x[tuple(local_index)]
      raise ValueError(f"rows {start}:{stop} are not among this process's rows {spans}")

    return jax.make_array_from_callback(shape, sharding, block)

  return {k: one(v) for k, v in local.items()}


def copy_to(x: jax.Array, sharding) -> jax.Array:
  """A copy of x on `sharding` (never an alias), resharding across meshes.

  With several processes, XLA moves an array between two different device sets that span
  hosts only on TPU, experimentally. `copy_to` keeps such a copy on the devices whenever
  every process that holds devices of `sharding` also holds devices of x (always true of
  `experiment.split_devices`), by one of two routes (`cross_host_path` names the one a pair
  takes):

  - "device": each process's share of x's devices is a whole multiple of its share of
    `sharding`'s (e.g. half and half). One resharding program over x's own devices lays
    out, on devices of each host, the shards that host's devices of `sharding` hold; each
    host then copies them device to device.
  - "gathered": otherwise (e.g. more rollout than train devices on a host). One program
    over x's devices replicates x on all of them; each host then copies its shards' slices
    from one of its own devices. Costs one whole copy of x per source device while it runs.

  A process that holds devices of `sharding` but none of x's would need x through host
  memory: every process gathers it whole and places its shards.
  """
  path = (cross_host_path(x.sharding, sharding) if isinstance(x, jax.Array) else "direct")
  if path == "device":
    staging, source_of = _staging_plan(_ids(x.sharding), sharding)
    staged = jax.device_put(x, staging, may_alias=False)
    local = {s.device.id: s.data for s in staged.addressable_shards}
    targets = list(sharding.addressable_devices)
    shards = jax.device_put([local[source_of[d.id]] for d in targets], targets)
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
  if path == "gathered":
    whole = jax.device_put(x, jax.sharding.NamedSharding(x.sharding.mesh,
                                                         jax.sharding.PartitionSpec()))
    local = whole.addressable_shards[0].data
    index_of = sharding.addressable_devices_indices_map(x.shape)
    targets = list(index_of)
    shards = jax.device_put([local[index_of[d]] for d in targets], targets)
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
  if path == "host":
    from jax.experimental import multihost_utils
    whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])
  return jax.device_put(x, sharding, may_alias=False)


def cross_host_path(src, dst) -> str:
  """How `copy_to` moves an array from sharding `src` to sharding `dst`: "direct" (one
  `jax.device_put`: one process, or the same device set), "device" or "gathered" (on the
  devices, see `copy_to`), or "host" (through host memory)."""
  # Decided from the device sets alone, so every process takes the same path.
  src_processes = {d.process_index for d in src.device_set}
  dst_processes = {d.process_index for d in dst.device_set}
  if len(src_processes | dst_processes) == 1 or src.device_set == dst.device_set:
    return "direct"
  if _staging_plan(_ids(src), dst) is not None:
    return "device"
  if isinstance(src, jax.sharding.NamedSharding) and dst_processes <= src_processes:
    return "gathered"
  return "host"


def _ids(sharding) -> tuple[int, ...]:
  return tuple(sorted(d.id for d in sharding.device_set))


@functools.lru_cache(maxsize=64)
def _staging_plan(src_ids: tuple[int, ...], dst):
  """(staging sharding over exactly the src devices, {dst device id: src device id}) or None.

  The staging mesh is dst's mesh with one more leading axis, over which the shards are
  replicated; position i of dst's mesh is filled, along that axis, by src devices of the
  same process as dst's device i. A src device at position (j, i) then holds the shard dst's
  device i holds, on the same host.
  """
  if not isinstance(dst, jax.sharding.NamedSharding):
    return None
  by_id = {d.id: d for d in jax.devices()}
  src_by_process: dict[int, list[Any]] = {}
  for i in src_ids:
    src_by_process.setdefault(by_id[i].process_index, []).append(by_id[i])
  flat = list(dst.mesh.devices.flat)
  positions: dict[int, list[int]] = {}
  for pos, d in enumerate(flat):
    positions.setdefault(d.process_index, []).append(pos)
  if set(src_by_process) != set(positions):
    return None
  ratios = {len(src_by_process[p]) / len(positions[p]) for p in positions}
  if len(ratios) != 1 or not float(next(iter(ratios))).is_integer():
    return None
  k = int(ratios.pop())
  mirror = np.empty((k, len(flat)), dtype=object)
  for p, pos_list in positions.items():
    devices = src_by_process[p]
    for c, pos in enumerate(pos_list):
      for j in range(k):
        mirror[j, pos] = devices[j * len(pos_list) + c]
  names = tuple(dst.mesh.axis_names)
  extra = "copy"
  while extra in names:
    extra += "_"
  kwargs = {}
  axis_types = getattr(dst.mesh, "axis_types", None)
  if axis_types is not None:
    kwargs["axis_types"] = (jax.sharding.AxisType.Auto, *axis_types)
  mesh = jax.sharding.Mesh(mirror.reshape((k, *dst.mesh.devices.shape)), (extra, *names),
                           **kwargs)
  staging = jax.sharding.NamedSharding(mesh, dst.spec)
  return staging, {flat[pos].id: mirror[0, pos].id for pos in range(len(flat))}
