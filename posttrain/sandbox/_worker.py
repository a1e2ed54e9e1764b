"""The sandbox worker process: isolates itself once, then forks one child per request.

Started by the pool as `python -S -I -c BOOTSTRAP` with a scrubbed environment; talks to
the pool over its stdin/stdout with `_protocol` frames. Process tree per slot:

    trainer -> shim (user/net/ipc/uts/mount namespaces) -> worker (pid 1 of a new pid
    namespace, root filesystem pivoted onto a read-only tree) -> one child per request

As pid 1, the worker kills every process of a request with one `kill(-1, SIGKILL)`, which
reaches grandchildren that called setsid(); when the worker itself dies the kernel kills
the whole namespace. Set-up is in `_isolation`; each mechanism is tried in turn and the
outcome reported to the pool in the first frame ("hello"), which decides whether that
isolation is strong enough. Only the standard library is used here.
"""
import errno
import gc
import io
import os
import resource
import select
import signal
import sys
import time
import traceback

from posttrain.sandbox import _isolation, _linux, _program, _protocol

_MEMORY_CHECK_S = 0.05  # how often a running program's total memory is measured
_PAGE = os.sysconf("SC_PAGE_SIZE")

BOOTSTRAP = ("import sys; sys.path.insert(0, sys.argv[1]); "
             "from posttrain.sandbox._worker import main; main()")


def main() -> None:
    ctrl_in, ctrl_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    # Started with -S (site's .pth imports would make every fork dearer): the programs
    # still get the site-packages directories, without .pth processing.
    import site
    base_sys_path = [p for p in sys.path if p != sys.argv[1]]
    base_sys_path += [p for p in site.getsitepackages() if os.path.isdir(p)]
    setup = _protocol.recv(ctrl_in)
    caps = {}
    layout = _isolation.isolate(setup, caps)
    worker = _Worker(setup, caps, layout, ctrl_in, ctrl_out, base_sys_path)
    worker.serve()


class _Worker:
    def __init__(self, setup, caps, layout, ctrl_in, ctrl_out, base_sys_path):
        self.setup = setup
        self.caps = caps
        self.layout = layout
        self.ctrl_in, self.ctrl_out = ctrl_in, ctrl_out
        self.base_sys_path = base_sys_path
        self.pid_ns = caps.get("pid_ns") is True
        self.child_uid = layout["child_uid"]
        if layout["root_built"]:
            self.workdir, self.tmpdir = "/sandbox", "/tmp"
        else:
            self.workdir = os.path.join(setup["host_dir"], "sandbox")
            self.tmpdir = os.path.join(setup["host_dir"], "tmp")
        python_bin = os.path.dirname(setup["python"])
        self.env = {
            "PATH": f"{python_bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": self.workdir, "TMPDIR": self.tmpdir, "PYTHONPATH": self.workdir,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "USER": "sandbox", "LOGNAME": "sandbox",
        }
        self.env.update(setup["env"])
        # Set up once here rather than in every child: fewer pages copied on write there.
        os.environ.clear()
        os.environ.update(self.env)
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(
            io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8")
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
            errors="backslashreplace", line_buffering=True)
        self._scratch_ready = False
        self._proc_dir = layout["proc_fd"]
        if self.pid_ns and caps.get("proc") is True:
            self._proc_dir = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # RLIMIT_NPROC counts the shim and the worker when they share the sandbox's uid.
        self.nproc_base = 0 if self.child_uid else 2 if layout["userns"] else None

    def serve(self) -> None:
        hello = {"type": "hello", "capabilities": self.caps, "workdir": self.workdir}
        _protocol.send(self.ctrl_out, hello)
        gc.collect()
        gc.freeze()  # keeps the children's copy-on-write pages shared
        while True:
            try:
                request = _protocol.recv(self.ctrl_in)
            except (_protocol.Closed, OSError):
                self._kill_all()
                os._exit(0)
            try:
                reply = self.handle(request)
            except Exception as e:  # a bug here must not take the slot down silently
                self._kill_all()
                reply = {"status": "sandbox_error", "exit_code": None, "wall_s": 0.0,
                         "cpu_s": 0.0, "stdout": b"", "stderr": b"",
                         "detail": "worker: " + "".join(
                             traceback.format_exception_only(type(e), e)).strip()}
            _protocol.send(self.ctrl_out, reply)

    # ------------------------------------------------------------- one request

    def handle(self, req: dict) -> dict:
        lang = req["language"]
        program = None
        code_obj = None
        self._reset_scratch()  # first: the parser would quote the last run's main.py
        if req.get("code") is not None:
            source = req["code"].decode("utf-8", "surrogateescape")
            program = os.path.join(self.tmpdir, "main.py" if lang == "python" else "main.sh")
            if lang == "python":
                try:
                    code_obj = compile(source, program, "exec", dont_inherit=True)
                except (SyntaxError, ValueError, OverflowError, RecursionError,
                        MemoryError) as e:
                    message = "".join(traceback.format_exception_only(type(e), e))
                    return {"status": "compile_error", "exit_code": 1, "wall_s": 0.0,
                            "cpu_s": 0.0, "stdout": b"", "stderr": message.encode(),
                            "detail": ""}
        stdin = os.memfd_create("stdin", os.MFD_CLOEXEC)
        os.write(stdin, req.get("stdin") or b"")
        os.lseek(stdin, 0, os.SEEK_SET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            os.close(err_r)
            os.close(status_r)
            self._child(req, program, code_obj, stdin, out_w, err_w, status_w)
        for fd in (stdin, out_w, err_w, status_w):
            os.close(fd)
        outcome = self._supervise(pid, req, start, out_r, err_r)
        setup_error = os.read(status_r, 65536)
        os.close(status_r)
        usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        reply = _program.classify(outcome, setup_error.decode("utf-8", "replace"), lang)
        reply["cpu_s"] = (usage1.ru_utime - usage0.ru_utime
                          + usage1.ru_stime - usage0.ru_stime)
        if req.get("return_workdir"):
            reply["workdir"] = _program.archive(self.workdir)
        return reply

    def _reset_scratch(self) -> None:
        """Empties the working directory and /tmp: deletes a few files, else remounts."""
        disk = self.setup["disk_mb"]
        if self.layout["root_built"] and self._scratch_ready and all(
                _small_and_cleared(path) for path in (self.workdir, self.tmpdir)):
            return
        self._scratch_ready = True
        if self.layout["root_built"]:
            owner = ""
            if self.child_uid:
                owner = f",uid={self.child_uid[0]},gid={self.child_uid[1]}"
            for path, mode in ((self.workdir, "0755"), (self.tmpdir, "1777")):
                try:
                    _linux.umount(path, _linux.MNT_DETACH)
                except OSError:
                    pass  # first request: nothing mounted yet
                _linux.mount("tmpfs", path, "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV,
                             f"size={disk}m,nr_inodes={disk * 256},mode={mode}{owner}")
        else:
            import shutil
            for path in (self.workdir, self.tmpdir):
                shutil.rmtree(path, ignore_errors=True)
                os.makedirs(path, mode=0o777 if path == self.tmpdir else 0o755)
                if self.child_uid:
                    os.chown(path, *self.child_uid)

    def _supervise(self, pid: int, req: dict, start: float, out_r: int, err_r: int) -> dict:
        """Collects output until the child exits, the deadline passes or output overflows."""
        deadline = start + req["timeout_s"]
        limit = req["max_output_bytes"]
        buffers = {out_r: bytearray(), err_r: bytearray()}
        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        for fd in (out_r, err_r, pidfd):
            poller.register(fd, select.POLLIN)
        open_fds = {out_r, err_r}
        wait_status = None
        timed_out = overflow = over_memory = False
        memory_limit = req["memory_mb"] << 20
        next_check = start + _MEMORY_CHECK_S
        while wait_status is None:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                timed_out = True
                break
            if self._proc_dir is not None and now >= next_check:
                # RLIMIT_AS bounds each process; this bounds all of them together.
                next_check = now + _MEMORY_CHECK_S
                if self._run_memory(memory_limit) > memory_limit:
                    over_memory = True
                    break
            wait = left if self._proc_dir is None else min(left, next_check - now)
            for fd, _ in poller.poll(wait * 1000):
                if fd == pidfd:
                    wait_status = os.waitpid(pid, 0)[1]
                    break
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                    continue
                buffers[fd] += chunk
                if len(buffers[out_r]) + len(buffers[err_r]) > limit:
                    overflow = True
                    break
            if overflow:
                break
        wall = time.monotonic() - start
        # The main program has ended (or must): nothing it started may outlive it.
        self._kill_all()
        if wait_status is None:
            try:
                wait_status = os.waitpid(pid, 0)[1]
            except ChildProcessError:
                wait_status = self._reaped.get(pid, 9)
        os.close(pidfd)
        for fd in open_fds:  # every writer is dead: drain to EOF
            os.set_blocking(fd, False)  # all the same, never wait on a writer we missed
            while len(buffers[out_r]) + len(buffers[err_r]) <= limit:
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                buffers[fd] += chunk
        if len(buffers[out_r]) + len(buffers[err_r]) > limit:
            overflow = True
        stdout = bytes(buffers[out_r][:limit])
        stderr = bytes(buffers[err_r][:max(0, limit - len(stdout))])
        os.close(out_r)
        os.close(err_r)
        return {"wait_status": wait_status, "timed_out": timed_out, "overflow": overflow,
                "over_memory": over_memory,
                "wall_s": wall, "stdout": stdout, "stderr": stderr,
                "memory_mb": req["memory_mb"], "timeout_s": req["timeout_s"],
                "max_output_bytes": limit}

    def _run_pids(self) -> list[int]:
        if self.pid_ns:  # our own /proc: only the run's processes and us (pid 1)
            return [int(p) for p in os.listdir(self._proc_dir) if p.isdigit() and p != "1"]
        return _descendants(os.getpid(), self._proc_dir)

    def _run_memory(self, limit: int) -> int:
        """Bytes of memory the run's processes hold: resident, or if that is over the
        limit, proportional (copy-on-write pages shared with siblings counted once)."""
        pids = self._run_pids()
        resident = sum(_read_proc(self._proc_dir, pid, "statm", 1) for pid in pids)
        if resident * _PAGE <= limit:
            return resident * _PAGE
        return sum(_read_proc(self._proc_dir, pid, "smaps_rollup", "Pss:") for pid in pids
                   ) << 10

    def _kill_all(self) -> None:
        """SIGKILLs and reaps every process started for the current request."""
        self._reaped = {}
        if self.pid_ns:
            while True:
                try:
                    os.kill(-1, signal.SIGKILL)  # as pid 1: everyone in the namespace
                except ProcessLookupError:
                    pass
                try:
                    pid, status = os.waitpid(-1, 0)
                    self._reaped[pid] = status
                except ChildProcessError:
                    return
        while True:
            victims = _descendants(os.getpid(), self.layout["proc_fd"])
            for victim in victims:
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                pid, status = os.waitpid(-1, 0 if victims else os.WNOHANG)
                if pid:
                    self._reaped[pid] = status
                elif not victims:
                    return
            except ChildProcessError:
                if not victims:
                    return

    # --------------------------------------------------------------- the child

    def _child(self, req, program, code_obj, stdin, out_w, err_w, status_w):
        """Never returns: drops privileges, applies limits and runs the program."""
        try:
            os.setsid()
            os.dup2(stdin, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            if self.child_uid:
                os.setgroups([])
                os.setresgid(self.child_uid[1], self.child_uid[1], self.child_uid[1])
                os.setresuid(self.child_uid[0], self.child_uid[0], self.child_uid[0])
            _linux.clear_capabilities()
            _linux.prctl(_linux.PR_SET_DUMPABLE, 1)
            if not self.pid_ns:
                _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
            os.chdir(self.workdir)
            if req.get("workdir"):
                _program.extract(req["workdir"], self.workdir)
            for rel, data in req.get("files", {}).items():
                _program.write_file(self.workdir, rel, data)
            if program is not None:
                with open(program, "wb") as f:
                    f.write(req["code"])
            timeout = req["timeout_s"]
            cpu = int(timeout) + 1
            memory = req["memory_mb"] << 20
            limits = {
                resource.RLIMIT_CPU: (cpu, cpu + 1),
                resource.RLIMIT_AS: (memory, memory),
                resource.RLIMIT_FSIZE: (self.setup["max_file_mb"] << 20,) * 2,
                resource.RLIMIT_NOFILE: (self.setup["max_open_files"],) * 2,
                resource.RLIMIT_CORE: (0, 0),
            }
            if self.nproc_base is not None:
                nproc = self.setup["max_processes"] + self.nproc_base
                limits[resource.RLIMIT_NPROC] = (nproc, nproc)
            for which, value in limits.items():
                resource.setrlimit(which, value)
            os.closerange(3, status_w)
            os.closerange(status_w + 1, 1 << 16)
            if code_obj is not None and self.setup["mode"] == "fork":
                os.close(status_w)
                _program.run_python(code_obj, program, req.get("argv") or [],
                                    self.workdir, self.base_sys_path)
            argv = _program.command(req, program, self.setup["python"])
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            try:
                os.execvpe(argv[0], argv, self.env)
            except OSError as e:
                # Like a shell: a missing command is the program's failure, not ours.
                os.write(2, f"{argv[0]}: {e.strerror}\n".encode())
                os._exit(127 if e.errno == errno.ENOENT else 126)
        except BaseException as e:
            try:
                os.write(status_w, f"sandbox set-up failed in child: {e!r}".encode())
            finally:
                os._exit(_program.SETUP_FAILED)


def _small_and_cleared(path: str, max_inodes: int = 32) -> bool:
    """Deletes everything in a tmpfs holding few inodes; False if a remount is cheaper."""
    info = os.statvfs(path)
    if info.f_files - info.f_ffree > max_inodes:
        return False
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    import shutil
                    shutil.rmtree(entry.path)  # fd-based: never follows a symlink out
                else:
                    os.unlink(entry.path)
    except OSError:
        return False
    return True


def _descendants(root_pid: int, proc_fd: int) -> list[int]:
    """Every live process below `root_pid`, from the parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir(proc_fd):
        if not entry.isdigit():
            continue
        try:
            fd = os.open(f"{entry}/stat", os.O_RDONLY, dir_fd=proc_fd)
            try:
                stat = os.read(fd, 4096)
            finally:
                os.close(fd)
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root_pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _read_proc(proc_dir: int, pid: int, name: str, field) -> int:
    """A number from /proc/PID/NAME: the `field`-th word, or the line starting `field`."""
    try:
        fd = os.open(f"{pid}/{name}", os.O_RDONLY, dir_fd=proc_dir)
        try:
            text = os.read(fd, 8192).decode()
        finally:
            os.close(fd)
    except OSError:
        return 0  # the process is gone
    if isinstance(field, int):
        return int(text.split()[field])
    for line in text.splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0
