"""The sandbox that code and tool domains run programs in (injectable, created lazily).

    from posttrain.tasks.execution import set_sandbox
    set_sandbox(Sandbox(SandboxConfig(concurrency=16)))   # before scoring starts

Without ``set_sandbox`` the first use builds ``Sandbox(SandboxConfig())`` and closes it at
interpreter exit. Anything with ``run(ExecRequest)`` and ``run_many([ExecRequest])`` works,
so tests can inject a fake.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

_lock = threading.Lock()
_sandbox: Any = None
_owned = False


def set_sandbox(sandbox: Any) -> None:
    """Uses ``sandbox`` for every code/tool domain from now on (None: back to the default)."""
    global _sandbox, _owned
    if sandbox is not None and not (hasattr(sandbox, "run") and hasattr(sandbox, "run_many")):
        raise TypeError(f"sandbox must have run() and run_many(), got {type(sandbox).__name__}")
    with _lock:
        if _owned and _sandbox is not None and _sandbox is not sandbox:
            _sandbox.close()
        _sandbox, _owned = sandbox, False


def get_sandbox() -> Any:
    """The injected sandbox, or a default one built on first use."""
    global _sandbox, _owned
    with _lock:
        if _sandbox is None:
            from posttrain.sandbox import Sandbox, SandboxConfig

            _sandbox, _owned = Sandbox(SandboxConfig()), True
            atexit.register(_close_default)
        return _sandbox


def _close_default() -> None:
    global _sandbox, _owned
    with _lock:
        if _owned and _sandbox is not None:
            _sandbox.close()
        _sandbox, _owned = None, False
