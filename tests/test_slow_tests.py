"""tests/slow_tests.txt names tests that exist: a renamed or deleted test would otherwise
leave a stale line, and its renamed self back in the default run unnoticed."""
import pathlib
import re

from tests.conftest import _measured_slow

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_measured_slow_test_exists():
  missing = []
  for nodeid in sorted(_measured_slow()):
    path, _, rest = nodeid.partition("::")
    name = rest.split("[")[0].split("::")[-1]  # function, or Class::method, less params
    source = ROOT / path
    if not source.is_file() or not re.search(rf"\bdef {re.escape(name)}\(",
                                             source.read_text()):
      missing.append(nodeid)
  assert not missing, f"tests/slow_tests.txt names tests that do not exist: {missing[:5]}"
  assert len(_measured_slow()) > 100  # the file was read, not an empty set
