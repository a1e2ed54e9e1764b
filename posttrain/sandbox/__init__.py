"""Isolated execution of untrusted, model-written programs.

    from posttrain.sandbox import Sandbox, SandboxConfig, ExecRequest
    with Sandbox(SandboxConfig(concurrency=8)) as sb:
        res = sb.run(ExecRequest(code="print(1)", timeout_s=5))
        assert res.status == "ok" and res.stdout == "1\\n"
        results = sb.run_many([ExecRequest(code=c) for c in programs])  # order preserved
        with sb.open_session() as sess:   # runs sharing a working directory
            sess.run(ExecRequest(code="open('a', 'w').write('x')"))
            snap = sess.snapshot(); ...; sess.restore(snap)

Isolation (no Docker; works as root and as an unprivileged user): each worker enters new
user, network, pid, mount, ipc and uts namespaces once, pivots onto a read-only root that
shows only system dirs and this Python, and forks one child per run. The child gets a
fresh tmpfs working directory (/sandbox) and /tmp, a scrubbed environment, no
capabilities, no_new_privs, and rlimits on CPU, address space, file size, open files and
processes. As root the trainer gives each worker slot its own unprivileged uid. The
worker is pid 1 of its namespace, so every process of a run, setsid() grandchildren
included, is killed when the run ends (its main program exits, or the deadline passes). What the host allowed is in `sb.capabilities`; the
constructor raises SandboxUnavailableError when that is weaker than configured, unless
`SandboxConfig(allow_weak_isolation=True)`.

What a program sees: cwd and HOME /sandbox (holding `files`, and a session's files),
its source at /tmp/main.py (or main.sh), PATH with this Python first, no network but its
own loopback, only its own processes in /proc, uid 1000. In fork mode python programs run
in a copy of the warm interpreter with the site-packages directories on sys.path (no .pth
processing); mode="exec" starts a fresh interpreter instead. memory_mb bounds each
process's address space (the interpreter's ~20 MB included) and, checked every 50 ms,
the memory of all the run's processes together. Sessions keep files between runs, not
processes or interpreter state.

Ray backend (`pip install 'posttrain[ray]'`) for when one host is not enough: start a
cluster (`ray start --head` on one node, `ray start --address=HEAD_IP:6379` on the
others), then `Sandbox(SandboxConfig(backend="ray", ray_address="auto", ray_actors=N))`.
Each of the N actors (spread over the nodes) runs the local pool above on its node;
requests, results and sessions are the same.
"""
import importlib

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: typing is a large import

_EXPORTS = {
    "Backend": "backend", "ExecRequest": "api", "ExecResult": "api", "Sandbox": "sandbox",
    "SandboxConfig": "api", "SandboxUnavailableError": "api", "Session": "sandbox",
    "Snapshot": "api", "Status": "api",
}
__all__ = ["Backend", "ExecRequest", "ExecResult", "Sandbox", "SandboxConfig",
           "SandboxUnavailableError", "Session", "Snapshot", "Status"]

if TYPE_CHECKING:
    from posttrain.sandbox.api import (
        ExecRequest,
        ExecResult,
        SandboxConfig,
        SandboxUnavailableError,
        Snapshot,
        Status,
    )
    from posttrain.sandbox.backend import Backend
    from posttrain.sandbox.sandbox import Sandbox, Session


def __getattr__(name: str):
    # Lazy, so that the sandbox worker (which imports a submodule) stays small: every page
    # it holds is copied on write in each child it forks.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'posttrain.sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(f"posttrain.sandbox.{_EXPORTS[name]}"), name)
