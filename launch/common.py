"""Shared by the launchers: user errors (config, files, shapes) as one line, exit code 2."""

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
