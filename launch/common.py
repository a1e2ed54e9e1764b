"""Shared by the launchers: user errors (config, files, shapes) as one line, exit code 2;
the flags of a run over several processes (one per host)."""

import sys

from absl import flags


def fail(e: BaseException):
  """Prints `error: <the message's telling line>` and exits 2."""
  if isinstance(e, AttributeError) and e.args and isinstance(e.args[0], KeyError):
    e = e.args[0]  # how a locked ConfigDict refuses a field it does not have
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  if isinstance(e, KeyError):
    msg = f"unknown config key {e.args[0] if e.args else e}"
  else:
    msg = next((ln for ln in lines if "No such file" in ln), lines[-1] if lines else repr(e))
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(2)


def parse_flags(argv):
  """absl flag parsing with config errors (unknown key, bad value) as one line."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - config_flags raises several kinds.
    fail(e.__cause__ or e)


def define_process_flags():
  """--coordinator_address, --num_processes, --process_id, for a launcher that runs as one
  process per host: the same command on every host with these, the environment variables
  JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or nothing on a TPU pod
  slice or SLURM job (detected; see posttrain/distributed.py)."""
  return (flags.DEFINE_string("coordinator_address", None,
                              "host:port of process 0 (default $JAX_COORDINATOR_ADDRESS)."),
          flags.DEFINE_integer("num_processes", None,
                               "Processes in the run (default $JAX_NUM_PROCESSES)."),
          flags.DEFINE_integer("process_id", None,
                               "This process's index (default $JAX_PROCESS_ID)."))


def join_processes(process_flags):
  """Joins the run's other processes (a no-op for one process). Call it before anything
  touches the devices: the mesh then spans every host's devices."""
  from posttrain import distributed
  coordinator, num_processes, process_id = process_flags
  return distributed.maybe_initialize(coordinator.value, num_processes.value,
                                      process_id.value)
