"""Hostile programs: every one contained, the test process alive, no process left behind."""
import hashlib
import os
import socket
import threading
import time
import uuid

import pytest

import posttrain
from posttrain.sandbox import ExecRequest, Sandbox, SandboxConfig, Status
from tests.sandbox.conftest import pid_alive, stray_processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(posttrain.__file__)))


@pytest.fixture(autouse=True)
def contained(sandbox):
    """After each test: no process of any run is alive and no worker was lost."""
    workers = sandbox._backend.worker_pids()
    yield
    assert stray_processes(sandbox) == []
    assert all(pid_alive(pid) for pid in workers)
    assert sandbox.run(ExecRequest(code="print('still serving')")).stdout == "still serving\n"


def py(code: str, **kwargs) -> ExecRequest:
    return ExecRequest(code=code, **kwargs)


def test_infinite_loop_times_out(sandbox):
    res = sandbox.run(py("while True: pass", timeout_s=1.0))
    assert res.status == Status.TIMEOUT and res.exit_code == -9
    assert 1.0 <= res.wall_s < 5.0


def test_sleeping_past_the_timeout(sandbox):
    res = sandbox.run(py("import time\nprint('before', flush=True)\ntime.sleep(60)",
                         timeout_s=0.5))
    assert res.status == Status.TIMEOUT and res.stdout == "before\n"
    assert res.wall_s < 5.0  # killed at the deadline, not after the 60 s it asked for


def test_process_limit_caps_the_number_of_processes(sandbox):
    code = ("import os, time\n"
            "n = 0\n"
            "for _ in range(500):\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(30)\n"
            "            os._exit(0)\n"
            "        n += 1\n"
            "    except OSError:\n"
            "        break\n"
            "print(n)\n")
    res = sandbox.run(py(code, timeout_s=10))
    assert res.status == "ok", res
    assert 0 < int(res.stdout) < sandbox.config.max_processes


@pytest.mark.parametrize("request_", [
    py("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
       "        pass\n", timeout_s=2.0),
    ExecRequest(code=":(){ :|:& };:", language="bash", timeout_s=2.0),
], ids=["python", "bash"])
def test_fork_bomb_is_contained(sandbox, request_):
    res = sandbox.run(request_)
    assert res.status in ("timeout", "runtime_error", "killed", "ok"), res


def test_setsid_grandchild_does_not_outlive_the_run(sandbox):
    # The grandchild leaves the session and keeps stdout open: the run still ends when
    # the main program does, and the grandchild dies with it.
    code = ("import os, time\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(60)\n"
            "    os._exit(0)\n"
            "os.waitpid(pid, 0)\n"
            "print('parent done')\n")
    res = sandbox.run(py(code, timeout_s=20))
    assert (res.status, res.stdout) == ("ok", "parent done\n")
    assert res.wall_s < 10.0


def test_detached_grandchildren_die_at_the_deadline(sandbox):
    code = "setsid nohup sleep 60 >/dev/null 2>&1 &\nsetsid sleep 61 &\ndisown -a\nsleep 60\n"
    res = sandbox.run(ExecRequest(code=code, language="bash", timeout_s=1.0))
    assert res.status == Status.TIMEOUT


@pytest.mark.parametrize("code", [
    "x = bytearray(4 << 30)",
    "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))",
])
def test_memory_bomb_hits_the_memory_limit(sandbox, code):
    res = sandbox.run(py(code, memory_mb=256, timeout_s=10))
    assert res.status == Status.MEMORY_LIMIT, res
    assert "MemoryError" in res.stderr


def test_memory_spread_over_many_processes_hits_the_limit_of_the_whole_run(sandbox):
    # Each process stays far below the per-process limit; together they are far above.
    code = ("import os, time\n"
            "for _ in range(16):\n"
            "    if os.fork() == 0:\n"
            "        block = bytearray(100 << 20)\n"
            "        time.sleep(30)\n"
            "        os._exit(0)\n"
            "time.sleep(30)\n")
    res = sandbox.run(py(code, memory_mb=512, timeout_s=15))
    assert res.status == Status.MEMORY_LIMIT and res.exit_code == -9, res
    assert res.wall_s < 10.0


@pytest.mark.parametrize("code, stream", [
    ("import os\nchunk = b'x' * (1 << 16)\nfor _ in range(1 << 14):\n    os.write(1, chunk)",
     "stdout"),
    ("import sys\nwhile True:\n    sys.stderr.write('y' * 4096)", "stderr"),
])
def test_a_gigabyte_of_output_hits_the_output_limit(sandbox, code, stream):
    res = sandbox.run(py(code, timeout_s=20, max_output_bytes=1 << 20))
    assert res.status == Status.OUTPUT_LIMIT, res.detail
    assert len(getattr(res, stream)) == 1 << 20
    assert res.wall_s < 10.0


def test_writing_outside_the_working_directory_leaves_no_file(sandbox, tmp_path):
    name = f"posttrain-escape-{uuid.uuid4().hex}"
    targets = [str(tmp_path / name), f"/tmp/{name}", os.path.join(REPO, name),
               f"/etc/{name}", f"/usr/{name}", f"/root/{name}", f"/{name}",
               os.path.join(os.path.dirname(posttrain.__file__), name)]
    code = ("import sys\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        open(path, 'w').write('escaped')\n"
            "        print('wrote', path)\n"
            "    except OSError as e:\n"
            "        print('refused', path, type(e).__name__)\n")
    res = sandbox.run(py(code, argv=targets))
    assert res.status == "ok", res
    bash = sandbox.run(ExecRequest(code='for p in "$@"; do touch "$p"; done', argv=targets,
                                   language="bash"))
    assert bash.status == "runtime_error"
    for path in targets:
        assert not os.path.exists(path), path


def test_a_nested_user_namespace_cannot_remount_the_root_writable(sandbox):
    name = f"posttrain-escape-{uuid.uuid4().hex}"
    code = ("import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "uid, gid = os.getuid(), os.getgid()\n"
            "assert libc.unshare(0x10000000 | 0x00020000) == 0, 'unshare'\n"
            "open('/proc/self/setgroups', 'w').write('deny')\n"
            "open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')\n"
            "open('/proc/self/gid_map', 'w').write(f'0 {gid} 1')\n"
            "MS_REMOUNT, MS_BIND = 32, 4096\n"
            "for target in (b'/usr', b'/'):\n"
            "    rc = libc.mount(None, target, None, MS_REMOUNT | MS_BIND, None)\n"
            "    print(target, rc, os.strerror(ctypes.get_errno()))\n"
            f"for path in ('/usr/{name}', '/{name}'):\n"
            "    try:\n"
            "        open(path, 'w').write('x')\n"
            "        print('wrote', path)\n"
            "    except OSError as e:\n"
            "        print('refused', path, e)\n")
    res = sandbox.run(py(code))
    assert "wrote" not in res.stdout, res
    assert not os.path.exists(f"/usr/{name}") and not os.path.exists(f"/{name}")


@pytest.fixture
def loopback_server():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


def test_cannot_connect_to_a_server_on_the_host(sandbox, loopback_server):
    port, accepted = loopback_server
    host_ip = socket.gethostbyname(socket.gethostname())
    # The server is reachable from outside the sandbox.
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    deadline = time.monotonic() + 5
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(accepted) == 1
    code = ("import socket, sys\n"
            "for host in sys.argv[2:]:\n"
            "    try:\n"
            "        socket.create_connection((host, int(sys.argv[1])), timeout=2)\n"
            "        print('connected', host)\n"
            "    except OSError as e:\n"
            "        print('blocked', host, type(e).__name__)\n")
    before = len(accepted)
    res = sandbox.run(py(code, argv=[str(port), "127.0.0.1", "localhost", host_ip],
                         timeout_s=10))
    assert res.status == "ok" and "connected" not in res.stdout, res
    assert res.stdout.count("blocked") == 3
    assert len(accepted) == before


def test_cannot_reach_an_abstract_unix_socket_on_the_host(sandbox):
    name = f"\0posttrain-test-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(name)
    server.listen(1)
    try:
        code = ("import socket, sys\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                "s.connect('\\0' + sys.argv[1])\n")
        res = sandbox.run(py(code, argv=[name[1:]]))
        assert res.status == "runtime_error" and "ConnectionRefusedError" in res.stderr, res
    finally:
        server.close()


def test_parent_environment_is_not_visible(monkeypatch):
    secret = f"hunter2-{uuid.uuid4().hex}"
    monkeypatch.setenv("POSTTRAIN_SANDBOX_TEST_SECRET", secret)
    # The program gets only the secret's hash, so finding the secret anywhere it can
    # read (its environment, any /proc/*/environ or cmdline) means it leaked.
    code = ("import glob, hashlib, os, sys\n"
            "def leaked(blob):\n"
            "    words = blob.replace(b'=', b'\\0').split(b'\\0')\n"
            "    return any(hashlib.sha256(w).hexdigest() == sys.argv[1] for w in words)\n"
            "hits = [k for k, v in os.environ.items() if leaked(v.encode())]\n"
            "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
            "    try:\n"
            "        if leaked(open(path, 'rb').read()):\n"
            "            hits.append(path)\n"
            "    except OSError:\n"
            "        pass\n"
            "print(hits, 'POSTTRAIN_SANDBOX_TEST_SECRET' in os.environ)\n")
    digest = hashlib.sha256(secret.encode()).hexdigest()
    with Sandbox(SandboxConfig(concurrency=1)) as sb:
        res = sb.run(py(code, argv=[digest]))
        bash = sb.run(ExecRequest(code="env", language="bash"))
        assert stray_processes(sb) == []
    assert res.stdout == "[] False\n", res
    assert "POSTTRAIN_SANDBOX_TEST_SECRET" not in bash.stdout and secret not in bash.stdout


def test_killing_the_parent_and_pid_1_changes_nothing(sandbox):
    me = os.getpid()
    workers = sandbox._backend.worker_pids()
    code = ("import os, signal, sys\n"
            "for pid in (int(sys.argv[1]), os.getppid(), 1):\n"
            "    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGSTOP, signal.SIGKILL):\n"
            "        try:\n"
            "            os.kill(pid, sig)\n"
            "        except OSError as e:\n"
            "            pass\n"
            "try:\n"
            "    os.kill(-1, signal.SIGKILL)  # everyone it may signal: only itself here\n"
            "except ProcessLookupError:\n"
            "    pass\n"
            "print('survived', os.getppid())\n")
    res = sandbox.run(py(code, argv=[str(me)]))
    assert res.status == "ok" and res.stdout.startswith("survived"), res
    assert pid_alive(me)
    assert sandbox._backend.worker_pids() == workers


def test_cannot_see_host_processes_or_read_the_workers_memory(sandbox):
    code = ("import os\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
            "for path in ('/proc/1/mem', '/proc/1/environ'):\n"
            "    try:\n"
            "        open(path, 'rb').read(16)\n"
            "        print('read', path)\n"
            "    except OSError as e:\n"
            "        print('refused', path)\n")
    res = sandbox.run(py(code))
    lines = res.stdout.splitlines()
    assert all(pid < 100 for pid in eval(lines[0])) and os.getpid() not in eval(lines[0])
    assert lines[1:] == ["refused /proc/1/mem", "refused /proc/1/environ"]


def test_deleting_files_of_the_repo_and_the_trainer_fails(sandbox, tmp_path):
    victim = tmp_path / "trainer_state.txt"
    victim.write_text("keep me")
    this_file = os.path.abspath(__file__)
    targets = [str(victim), this_file, os.path.dirname(this_file)]
    code = ("import os, shutil, sys\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)\n"
            "        print('deleted', path)\n"
            "    except OSError as e:\n"
            "        print('refused', path, type(e).__name__)\n")
    res = sandbox.run(py(code, argv=targets))
    bash = sandbox.run(ExecRequest(code='rm -rf "$@"', argv=targets, language="bash"))
    assert "deleted" not in res.stdout, res
    assert bash.status in ("ok", "runtime_error")
    assert victim.read_text() == "keep me" and os.path.exists(this_file)


def test_file_size_limit_stops_a_huge_file(sandbox):
    res = sandbox.run(py("open('big', 'wb').write(b'x' * (100 << 20))", memory_mb=512))
    assert res.status == "runtime_error" and "File too large" in res.stderr, res
