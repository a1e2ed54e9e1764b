"""Ordinary programs: status, exit code, output, files, bash, concurrency, sessions."""
import os
import time

import pytest

from posttrain.sandbox import ExecRequest, Sandbox, SandboxConfig, Snapshot, Status
from tests.sandbox.conftest import stray_processes


def py(code: str, **kwargs) -> ExecRequest:
    return ExecRequest(code=code, **kwargs)


def test_capabilities_report_every_configured_mechanism(sandbox):
    caps = sandbox.capabilities
    for name in ("user_ns", "net_ns", "pid_ns", "mount_ns", "ipc_ns", "uts_ns",
                 "readonly_root", "nproc_limit", "no_new_privs"):
        assert caps[name] is True, (name, caps[name])
    assert caps["backend"] == "local"
    if os.geteuid() == 0:
        assert caps["distinct_uid"] is True


@pytest.mark.parametrize("code, status, exit_code, stdout", [
    ("print('hello')", "ok", 0, "hello\n"),
    ("import sys; print('x'); sys.exit(3)", "runtime_error", 3, "x\n"),
    ("raise SystemExit('bye')", "runtime_error", 1, ""),
    ("raise SystemExit(None)", "ok", 0, ""),
    ("import os; os._exit(7)", "runtime_error", 7, ""),
    ("print('é', end='')", "ok", 0, "é"),
    ("import sys; sys.stdout.write('no newline'); sys.stderr.write('e')", "ok", 0,
     "no newline"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed", -9, ""),
    ("import os; os.abort()", "killed", -6, ""),
])
def test_python_status_exit_code_and_stdout(sandbox, code, status, exit_code, stdout):
    res = sandbox.run(py(code))
    assert (res.status, res.exit_code, res.stdout) == (status, exit_code, stdout), res


def test_uncaught_exception_gives_the_usual_traceback(sandbox):
    res = sandbox.run(py("def f():\n    return 1 / 0\nf()\n"))
    assert res.status == Status.RUNTIME_ERROR and res.exit_code == 1
    lines = res.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "ZeroDivisionError: division by zero"
    assert "return 1 / 0" in res.stderr and "_worker" not in res.stderr


@pytest.mark.parametrize("code", ["print(", "def f(:\n  pass", "x = = 1", "\tprint(1)",
                                  "print('a\0b')"])
def test_python_syntax_errors_are_compile_errors(sandbox, code):
    res = sandbox.run(py(code))
    assert res.status == Status.COMPILE_ERROR and res.exit_code == 1, res
    assert "Error" in res.stderr.splitlines()[-1]


def test_compile_error_quotes_this_program_not_the_previous_one(sandbox):
    sandbox.run(py("print('previous program')"))
    res = sandbox.run(py("x = (\n"))
    assert "previous program" not in res.stderr and "x = (" in res.stderr


def test_stdin_argv_files_and_environment(sandbox):
    code = ("import sys, os\n"
            "print(sys.stdin.read().upper())\n"
            "print(sys.argv[1:])\n"
            "print(open('data/in.txt').read(), open('bin.dat', 'rb').read())\n"
            "print(os.getcwd(), os.environ['HOME'])\n"
            "import helper; print(helper.VALUE)\n")
    res = sandbox.run(py(code, stdin="abc", argv=["-x", "y z"],
                         files={"data/in.txt": "text", "bin.dat": b"\x00\xff",
                                "helper.py": "VALUE = 42\n"}))
    assert res.status == "ok", res
    assert res.stdout.splitlines() == ["ABC", "['-x', 'y z']", "text b'\\x00\\xff'",
                                       "/sandbox /sandbox", "42"]


def test_multiprocessing_works_inside(sandbox):
    code = ("import multiprocessing as mp\n"
            "def square(x):\n"
            "    return x * x\n"
            "if __name__ == '__main__':\n"
            "    with mp.Pool(4) as pool:\n"
            "        print(sum(pool.map(square, range(100))))\n")
    res = sandbox.run(py(code, timeout_s=20))
    assert (res.status, res.stdout) == ("ok", "328350\n"), res


def test_cpu_and_wall_time_are_measured(sandbox):
    res = sandbox.run(py("import time\nt = time.process_time()\n"
                         "while time.process_time() - t < 0.2: pass\n"))
    assert res.status == "ok"
    assert 0.15 < res.cpu_s < 2.0 and res.wall_s >= res.cpu_s * 0.5


@pytest.mark.parametrize("code, argv, status, exit_code, stdout", [
    ("echo \"hi $1\"", ["there"], "ok", 0, "hi there\n"),
    ("exit 4", None, "runtime_error", 4, ""),
    ("if then fi", None, "compile_error", 2, ""),
    ("echo out; echo err >&2; false", None, "runtime_error", 1, "out\n"),
    ("read x; echo \"got $x\"", None, "ok", 0, "got line\n"),
    ("cat data.txt | tr a-z A-Z", None, "ok", 0, "SHOUT"),
    ("python3 -c 'print(6 * 7)'", None, "ok", 0, "42\n"),
    ("kill -9 $$", None, "killed", -9, ""),
])
def test_bash_programs(sandbox, code, argv, status, exit_code, stdout):
    res = sandbox.run(ExecRequest(code=code, argv=argv, language="bash", stdin="line\n",
                                  files={"data.txt": "shout"}))
    assert (res.status, res.exit_code, res.stdout) == (status, exit_code, stdout), res


def test_argv_commands_run_without_code(sandbox):
    res = sandbox.run(ExecRequest(argv=["echo", "a b", "c"]))
    assert (res.status, res.stdout) == ("ok", "a b c\n")
    missing = sandbox.run(ExecRequest(argv=["no-such-command-xyz"]))
    assert (missing.status, missing.exit_code) == ("runtime_error", 127)
    assert "no-such-command-xyz" in missing.stderr


def test_concurrent_runs_do_not_interfere(sandbox):
    # Each run writes a token to its working dir and /tmp, waits so that the runs
    # overlap, then lists both: a shared directory would show the other tokens.
    code = ("import os, sys, time\n"
            "token = sys.argv[1]\n"
            "open(token, 'w').write(token)\n"
            "open('/tmp/' + token, 'w').write(token)\n"
            "time.sleep(0.3)\n"
            "print(token, sorted(os.listdir('.')), sorted(os.listdir('/tmp')))\n")
    tokens = [f"t{i}" for i in range(24)]
    start = time.monotonic()
    results = sandbox.run_many([py(code, argv=[t]) for t in tokens])
    elapsed = time.monotonic() - start
    for token, res in zip(tokens, results):
        assert res.status == "ok", res
        assert res.stdout.split(" ", 1)[0] == token  # order preserved
        assert res.stdout.strip() == f"{token} ['{token}'] ['main.py', '{token}']"
    assert elapsed < 24 * 0.3  # ran concurrently, not one after another
    assert stray_processes(sandbox) == []


def test_submit_returns_a_future_of_the_result(sandbox):
    futures = [sandbox.submit(py(f"print({i})")) for i in range(5)]
    assert [f.result().stdout for f in futures] == [f"{i}\n" for i in range(5)]


def test_sessions_share_files_across_runs_and_roll_back(sandbox):
    with sandbox.open_session() as sess:
        assert sess.run(py("open('notes.txt', 'w').write('v1')")).ok
        first = sess.snapshot()
        assert isinstance(first, Snapshot)
        res = sess.run(ExecRequest(code="cat notes.txt; echo v2 > notes.txt; mkdir -p d; "
                                        "echo x > d/y", language="bash"))
        assert res.stdout == "v1"
        assert sess.run(py("print(open('notes.txt').read().strip(), "
                           "open('d/y').read().strip())")).stdout == "v2 x\n"
        sess.restore(first)
        assert sess.run(py("import os; print(open('notes.txt').read(), "
                           "os.path.exists('d'))")).stdout == "v1 False\n"
        # The same snapshot replays identically in a fresh session.
        with sandbox.open_session() as other:
            other.restore(first)
            assert other.run(py("print(open('notes.txt').read())")).stdout == "v1\n"
        with pytest.raises(TypeError):
            sess.restore(b"not a snapshot")
    with pytest.raises(RuntimeError):
        sess.run(py("print(1)"))


def test_sessions_keep_files_not_processes(sandbox):
    with sandbox.open_session() as sess:
        sess.run(ExecRequest(code="(sleep 30; echo late > late.txt) & echo started",
                             language="bash"))
        assert stray_processes(sandbox) == []
        res = sess.run(ExecRequest(code="ls; echo done", language="bash"))
        assert res.stdout == "done\n"


def test_session_state_survives_a_timeout(sandbox):
    with sandbox.open_session() as sess:
        res = sess.run(py("open('partial', 'w').write('1')\nwhile True: pass",
                          timeout_s=0.5))
        assert res.status == "timeout"
        assert sess.run(py("print(open('partial').read())")).stdout == "1\n"


def test_workers_start_fresh_interpreters_in_exec_mode():
    with Sandbox(SandboxConfig(concurrency=2, mode="exec")) as sb:
        assert sb.run(py("import sys; print(sys.argv[1:])", argv=["a"])).stdout == "['a']\n"
        assert sb.run(py("print(")).status == "compile_error"
        assert sb.run(py("import sys; sys.exit(5)")).exit_code == 5
        assert sb.run(py("while True: pass", timeout_s=0.5)).status == "timeout"
        assert stray_processes(sb) == []


def test_preloaded_modules_are_importable_in_fork_mode():
    with Sandbox(SandboxConfig(concurrency=1, preload=("json",))) as sb:
        assert sb.run(py("import json; print(json.dumps([1]))")).stdout == "[1]\n"


def test_closed_sandbox_refuses_new_work():
    sb = Sandbox(SandboxConfig(concurrency=1))
    sb.close()
    sb.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        sb.run(py("print(1)"))
