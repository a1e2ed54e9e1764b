"""The pool: replacing dead or hung workers, weak-isolation policy, queueing, shutdown."""
import logging
import os
import signal
import socket
import sys
import tempfile
import time

import pytest

from posttrain.sandbox import (
    ExecRequest,
    Sandbox,
    SandboxConfig,
    SandboxUnavailableError,
    Status,
)
from posttrain.sandbox.pool import LocalBackend
from tests.sandbox.conftest import pid_alive, stray_processes

SLEEP = "import time\ntime.sleep({})\nprint('done')"


def host_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))


def test_a_worker_killed_from_outside_is_replaced():
    with Sandbox(SandboxConfig(concurrency=2)) as sb:
        victim = sb._backend.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        results = sb.run_many([ExecRequest(code=f"print({i})") for i in range(8)])
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
        assert victim not in sb._backend.worker_pids()
        assert len(sb._backend.worker_pids()) == 2 and stray_processes(sb) == []


def test_a_run_in_flight_on_a_killed_worker_is_retried_and_others_are_kept():
    with Sandbox(SandboxConfig(concurrency=2)) as sb:
        futures = [sb.submit(ExecRequest(code=SLEEP.format(0.6), timeout_s=10))
                   for _ in range(4)]
        time.sleep(0.3)  # both workers are now busy with the first two runs
        os.kill(sb._backend.worker_pids()[0], signal.SIGKILL)
        results = [f.result(timeout=30) for f in futures]
        assert [r.status for r in results] == ["ok"] * 4, results
        assert stray_processes(sb) == []


def test_a_hung_worker_is_reclaimed_at_the_deadline():
    with Sandbox(SandboxConfig(concurrency=1, grace_s=0.5)) as sb:
        worker = sb._backend.worker_pids()[0]
        future = sb.submit(ExecRequest(code=SLEEP.format(0.5), timeout_s=1.0))
        time.sleep(0.2)
        os.kill(worker, signal.SIGSTOP)  # the worker can no longer answer
        res = future.result(timeout=30)
        assert res.status == Status.TIMEOUT and "replaced" in res.detail
        assert not pid_alive(worker)
        assert sb.run(ExecRequest(code="print('fresh')")).stdout == "fresh\n"
        assert stray_processes(sb) == []


def test_weaker_isolation_than_configured_is_refused():
    config = SandboxConfig(concurrency=1)
    with pytest.raises(SandboxUnavailableError) as info:
        LocalBackend(config, _refuse=("net",))
    message = str(info.value)
    assert "net_ns" in message and "allow_weak_isolation" in message and "\n" not in message


def test_allowed_weak_isolation_warns_and_is_really_weaker(caplog):
    config = SandboxConfig(concurrency=1, allow_weak_isolation=True)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    with caplog.at_level(logging.WARNING, logger="posttrain.sandbox"):
        backend = LocalBackend(config, _refuse=("net",))
    assert "net_ns" in caplog.text
    with Sandbox(config, backend=backend) as sb:
        assert sb.capabilities["net_ns"].startswith("failed")  # a string that says why
        code = ("import socket, sys\n"
                "socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2)\n"
                "print('connected')\n")
        # Without a network namespace the loopback test of test_hostile would catch it.
        res = sb.run(ExecRequest(code=code, argv=[str(server.getsockname()[1])]))
        assert res.stdout == "connected\n", res
    server.close()


def test_without_a_pid_namespace_descendants_are_still_killed():
    config = SandboxConfig(concurrency=1, namespaces=("user", "net", "mount", "ipc", "uts"))
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(60)\n"
            "    os._exit(0)\n"
            "time.sleep(0.2)\n"
            "print('main done')\n")
    with Sandbox(config) as sb:
        assert sb.capabilities["pid_ns"] == "not requested"
        assert sb.run(ExecRequest(code=code)).stdout == "main done\n"
        assert stray_processes(sb) == []
        bomb = ExecRequest(code=":(){ :|:& };:", language="bash", timeout_s=1.0)
        assert sb.run(bomb).status in ("timeout", "runtime_error", "ok", "killed")
        assert stray_processes(sb) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="slot uids are only used when root")
def test_every_worker_slot_runs_as_its_own_unprivileged_uid():
    with Sandbox(SandboxConfig(concurrency=3)) as a, Sandbox(SandboxConfig(concurrency=2)) as b:
        uids = [host_uid(pid) for sb in (a, b) for pid in sb._backend.worker_pids()]
        assert len(set(uids)) == 5 and 0 not in uids


def test_a_small_queue_applies_backpressure_without_deadlock():
    with Sandbox(SandboxConfig(concurrency=2, queue_size=1)) as sb:
        results = sb.run_many([ExecRequest(code=f"print({i})") for i in range(12)])
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(12)]


def test_close_ends_queued_runs_and_every_process():
    sb = Sandbox(SandboxConfig(concurrency=1, queue_size=16))
    pids = sb._backend.worker_pids() + sb._backend.shim_pids()
    futures = [sb.submit(ExecRequest(code=SLEEP.format(0.3))) for _ in range(5)]
    time.sleep(0.1)
    sb.close()
    results = [f.result(timeout=10) for f in futures]
    assert results[0].status == "ok"
    assert all(r.status == Status.SANDBOX_ERROR and "closed" in r.detail
               for r in results[1:])
    assert not any(pid_alive(pid) for pid in pids)


def _world_can_run(path: str) -> bool:
    path = os.path.realpath(path)
    parts = path.split("/")
    dirs = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return all(os.stat(d).st_mode & 0o001 for d in dirs) and bool(
        os.stat(path).st_mode & 0o005 == 0o005)


@pytest.mark.skipif(os.geteuid() != 0 or _world_can_run(sys.executable),
                    reason="needs root and an interpreter other users cannot reach")
def test_an_interpreter_out_of_the_sandboxs_reach_is_a_clear_error():
    # Without the mount namespace the slot uid sees the host's files as they are.
    config = SandboxConfig(concurrency=1, namespaces=("user", "net", "pid"),
                           allow_weak_isolation=True)
    with pytest.raises(SandboxUnavailableError, match="cannot run .* or read"):
        Sandbox(config)


def test_a_read_only_path_the_sandbox_would_hide_is_a_clear_error():
    with pytest.raises(SandboxUnavailableError, match="/tmp/venv lies under /tmp"):
        Sandbox(SandboxConfig(concurrency=1, ro_paths=("/usr", "/tmp/venv")))


def test_a_worker_that_cannot_start_is_a_clear_error():
    with pytest.raises(SandboxUnavailableError, match="No module named 'no_such_module_xyz'"):
        Sandbox(SandboxConfig(concurrency=1, preload=("no_such_module_xyz",)))


@pytest.mark.skipif(os.geteuid() != 0, reason="slot uids are only used when root")
def test_running_out_of_slot_uids_is_a_clear_error_and_releases_the_rest():
    base = 2_100_000_000  # a range no other test uses
    with Sandbox(SandboxConfig(concurrency=2, uid_base=base, uid_count=3)):
        with pytest.raises(SandboxUnavailableError, match="uid_count"):
            Sandbox(SandboxConfig(concurrency=2, uid_base=base, uid_count=3))
        # The one uid the failed sandbox took was given back.
        with Sandbox(SandboxConfig(concurrency=1, uid_base=base, uid_count=3)) as sb:
            assert sb.run(ExecRequest(code="print(1)")).ok


def test_an_interpreter_that_cannot_be_started_is_a_clear_error_and_leaves_nothing(
        tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where workers' dirs go
    with pytest.raises(SandboxUnavailableError, match="cannot start"):
        Sandbox(SandboxConfig(concurrency=2, python=str(tmp_path / "no-python")))
    assert [p for p in os.listdir(scratch) if p != "posttrain-sandbox-uids"] == []
