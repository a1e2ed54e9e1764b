"""What a worker's child does with a program, and how its ending is classified.

Only the standard library is used here (it runs inside the sandbox worker).
"""
import atexit
import builtins
import io
import os
import signal
import sys
import types

SETUP_FAILED = 125  # child exit status paired with a message on the error pipe
_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "cannot allocate memory",
                 "std::bad_alloc", "out of memory")


def command(req: dict, program: str | None, python: str) -> list[str]:
    args = list(req.get("argv") or [])
    if program is None:
        return args
    if req["language"] == "python":
        return [python, program, *args]
    return ["bash", program, *args]


def run_python(code_obj, program: str, argv: list[str], workdir: str,
               base_sys_path: list[str]) -> None:
    """Runs compiled code in this forked interpreter as `python program argv...` would."""
    atexit._clear()
    module = types.ModuleType("__main__")
    module.__file__ = program
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    sys.argv = [program, *argv]
    sys.path[:] = [os.path.dirname(program), workdir, *base_sys_path]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 0
    try:
        exec(code_obj, module.__dict__)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:
        e.__traceback__ = e.__traceback__.tb_next  # hide this runner's frame
        sys.excepthook(type(e), e, e.__traceback__)
        code = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:
        sys.excepthook(type(e), e, e.__traceback__)
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 120  # what CPython exits with when flushing stdout fails
    os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def write_file(root: str, rel: str, data: bytes) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def archive(root: str) -> bytes:
    """The working directory as an uncompressed tar, entries in sorted order."""
    import tarfile  # only sessions need it; imported once per worker, after the fork
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                path = os.path.join(dirpath, name)
                if not (os.path.islink(path) or os.path.isfile(path) or
                        os.path.isdir(path)):
                    continue  # fifos and sockets do not survive a snapshot
                tar.add(path, arcname=os.path.relpath(path, root), recursive=False)
    return buffer.getvalue()


def extract(archive: bytes, root: str) -> None:
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r") as tar:
        if hasattr(tarfile, "tar_filter"):
            tar.extractall(root, filter="tar")
        else:
            tar.extractall(root)


def classify(outcome: dict, setup_error: str, language: str) -> dict:
    status_word = outcome["wait_status"]
    exit_code = os.waitstatus_to_exitcode(status_word)
    stderr_text = outcome["stderr"][-4096:].decode("utf-8", "replace")
    memory_sign = any(sign in stderr_text for sign in _MEMORY_SIGNS)
    detail = ""
    if setup_error and exit_code == SETUP_FAILED:
        status, detail = "sandbox_error", setup_error
    elif outcome["timed_out"]:
        status = "timeout"
        detail = f"killed after the {outcome['timeout_s']:g} s deadline"
    elif outcome["overflow"]:
        status = "output_limit"
        detail = f"output exceeded {outcome['max_output_bytes']} bytes"
    elif outcome["over_memory"]:
        status = "memory_limit"
        detail = f"its processes together held more than {outcome['memory_mb']} MB"
    elif exit_code == -signal.SIGXCPU:
        status, detail = "timeout", "CPU time limit exceeded"
    elif memory_sign and exit_code != 0:
        status, detail = "memory_limit", f"memory limit of {outcome['memory_mb']} MB"
    elif exit_code == 0:
        status = "ok"
    elif exit_code < 0:
        status = "killed"
        detail = f"terminated by {signal.Signals(-exit_code).name}"
    elif language == "bash" and exit_code == 2 and "syntax error" in stderr_text:
        status = "compile_error"
    else:
        status = "runtime_error"
    return {"status": status, "exit_code": exit_code, "wall_s": outcome["wall_s"],
            "stdout": outcome["stdout"], "stderr": outcome["stderr"], "detail": detail}
