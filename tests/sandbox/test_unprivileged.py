"""The sandbox also works when the trainer is not root (run here as `nobody`)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

import posttrain

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(posttrain.__file__)))
NOBODY = 65534

# Runs as nobody: probes whether this host lets it create a user namespace, then starts a
# sandbox and reports what hostile programs achieved, as one JSON line.
SCRIPT = r'''
import ctypes, json, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()
if pid == 0:
    os._exit(0 if libc.unshare(0x10000000) == 0 else 1)
report = {"uid": os.getuid(), "userns_allowed": os.waitpid(pid, 0)[1] == 0}
from posttrain.sandbox import ExecRequest, Sandbox, SandboxConfig, SandboxUnavailableError
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
try:
    sb = Sandbox(SandboxConfig(concurrency=2, python=sys.executable))
except SandboxUnavailableError as e:
    report["unavailable"] = str(e)
    print(json.dumps(report))
    sys.exit(0)
with sb:
    report["capabilities"] = dict(sb.capabilities)
    runs = {
        "hello": ExecRequest(code="import os; print('hello', os.getuid())"),
        "net": ExecRequest(code="import socket, sys\n"
                                "socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2)",
                           argv=[str(server.getsockname()[1])]),
        "nproc": ExecRequest(code="import os, time\nn = 0\nfor _ in range(300):\n"
                                  "    try:\n        if os.fork() == 0:\n"
                                  "            time.sleep(30); os._exit(0)\n        n += 1\n"
                                  "    except OSError:\n        break\nprint(n)", timeout_s=10),
        "grandchild": ExecRequest(code="setsid sleep 60 & disown; sleep 60", language="bash",
                                  timeout_s=1),
        # /tmp inside is a private tmpfs; the package's directory is not mounted at all.
        "escape_tmp": ExecRequest(code="import sys\nopen(sys.argv[1], 'w').write('x')",
                                  argv=["/tmp/posttrain-nobody-escape"]),
        "escape_repo": ExecRequest(code="import sys\nopen(sys.argv[1], 'w').write('x')",
                                   argv=[sys.argv[1] + "/posttrain-nobody-escape"]),
        "kill_parent": ExecRequest(code=f"import os\ntry:\n    os.kill({os.getpid()}, 9)\n"
                                        "except OSError:\n    pass\nprint('ok')"),
    }
    results = dict(zip(runs, sb.run_many(list(runs.values()))))
    report["results"] = {k: [r.status, r.stdout, r.stderr[-300:]] for k, r in results.items()}
    shims, workers = sb._backend.shim_pids(), sb._backend.worker_pids()
    below = []
    for shim in shims:
        kids = open(f"/proc/{shim}/task/{shim}/children").read().split()
        below += [int(k) for k in kids]
        for k in kids:
            below += [int(g) for g in open(f"/proc/{k}/task/{k}/children").read().split()]
    report["stray"] = [p for p in below if p not in workers]
report["escaped"] = [p for p in ("/tmp/posttrain-nobody-escape",
                                 sys.argv[1] + "/posttrain-nobody-escape") if os.path.exists(p)]
print(json.dumps(report))
'''


def _python_for_nobody() -> str | None:
    """An interpreter that `nobody` can run with this package importable, if any."""
    for python in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             python, "-c", ("import posttrain.sandbox, os, sys; os.pidfd_open; "
                            "assert os.access(sys.executable, os.X_OK)")],
            env={"PYTHONPATH": PACKAGE_PARENT, "PATH": "/usr/bin:/bin"}, cwd="/",
            capture_output=True)
        if probe.returncode == 0:
            return python
    return None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to become an unprivileged user")
def test_unprivileged_trainer_gets_the_same_isolation_or_a_clear_refusal():
    python = _python_for_nobody()
    if python is None:
        pytest.skip(f"no Python that uid {NOBODY} can run with {PACKAGE_PARENT} importable")
    proc = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         python, "-c", SCRIPT, PACKAGE_PARENT],
        env={"PYTHONPATH": PACKAGE_PARENT, "PATH": "/usr/bin:/bin"}, cwd="/",
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["uid"] == NOBODY
    if not report["userns_allowed"]:
        # The host forbids unprivileged user namespaces: the sandbox must say so.
        assert "user_ns" in report["unavailable"]
        return
    caps = report["capabilities"]
    for name in ("user_ns", "net_ns", "pid_ns", "mount_ns", "readonly_root", "nproc_limit"):
        assert caps[name] is True, (name, caps[name])
    results = report["results"]
    assert results["hello"][:2] == ["ok", "hello 1000\n"]
    assert results["net"][0] == "runtime_error" and "Error" in results["net"][2]
    assert results["nproc"][0] == "ok" and 0 < int(results["nproc"][1]) < 64
    assert results["grandchild"][0] == "timeout"
    assert results["escape_tmp"][0] == "ok" and results["escape_repo"][0] == "runtime_error"
    assert report["escaped"] == []
    assert results["kill_parent"][:2] == ["ok", "ok\n"]
    assert report["stray"] == []
