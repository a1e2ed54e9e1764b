"""Fixtures of the task tests: a real sandbox, one per test module."""

import pytest


@pytest.fixture(scope="module")
def module_sandbox():
  """A sandbox the code and tool domains use (`execution.set_sandbox`) for one module's
  tests; the module's tests skip where this host cannot make one."""
  try:
    from posttrain.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError
  except ImportError:
    pytest.skip("posttrain.sandbox not available")
  from posttrain.tasks import execution
  try:
    sb = Sandbox(SandboxConfig(concurrency=4))
  except SandboxUnavailableError as e:
    pytest.skip(f"no sandbox on this host: {e}")
  execution.set_sandbox(sb)
  yield sb
  execution.set_sandbox(None)
  sb.close()
