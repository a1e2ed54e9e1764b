"""The sandbox worker process: isolates itself once, then forks one child per request.

Started by the pool as `python -I -c BOOTSTRAP` with a scrubbed environment; talks to the
pool over its stdin/stdout with `_protocol` frames. Process tree per slot:

    trainer -> shim (user/net/ipc/uts/mount namespaces) -> worker (pid 1 of a new pid
    namespace, root filesystem pivoted onto a read-only tree) -> one child per request

As pid 1, the worker kills every process of a request with one `kill(-1, SIGKILL)`, which
reaches grandchildren that called setsid(); when the worker itself dies the kernel kills
the whole namespace. Each mechanism is tried in turn and the outcome reported to the pool
in the first frame ("hello"), which decides whether that isolation is strong enough.
Only the standard library is used here.
"""
import atexit
import builtins
import errno
import fcntl
import gc
import importlib
import io
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback
import types

from posttrain.sandbox import _linux
from posttrain.sandbox import _protocol

BOOTSTRAP = ("import sys; sys.path.insert(0, sys.argv[1]); "
             "from posttrain.sandbox._worker import main; main()")

SANDBOX_UID = 1000  # identity of sandboxed code inside its user namespace
# Paths inside the sandbox that are its own, never bound from the host.
PRIVATE_PATHS = ("/sandbox", "/tmp", "/proc", "/dev")
_SETUP_FAILED = 125  # child exit status paired with a message on the error pipe
_DEV_NODES = ("null", "zero", "full", "random", "urandom")
_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "cannot allocate memory",
                 "std::bad_alloc", "out of memory")


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
    layout = _isolate(setup, caps)
    worker = _Worker(setup, caps, layout, ctrl_in, ctrl_out, base_sys_path)
    worker.serve()


# ---------------------------------------------------------------------------- set-up


def _record(caps: dict, name: str, fn, *args) -> bool:
    try:
        fn(*args)
    except OSError as e:
        caps[name] = f"failed: {e}"
        return False
    caps[name] = True
    return True


def _userns_allowed(uid: int, gid: int) -> bool:
    """Whether `uid` may create a user namespace here (probed in a throwaway child)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            _linux.unshare(_linux.CLONE_NEWUSER)
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


def _isolate(setup: dict, caps: dict) -> dict:
    """Runs in the shim: namespaces, uid, root filesystem; forks and returns in the worker."""
    for name in setup["preload"]:
        importlib.import_module(name)  # before any uid change: the prefix may be private
    want = set(setup["namespaces"])
    is_root = os.geteuid() == 0
    slot = (setup["uid"], setup["gid"])
    userns = "user" in want
    mount = "mount" in want
    for name in _linux.NAMESPACE_FLAGS:
        if name not in want:
            caps[f"{name}_ns"] = "not requested"
    if userns and is_root and not _userns_allowed(*slot):
        caps["user_ns"] = "failed: the host refuses unshare(CLONE_NEWUSER) to the slot uid"
        userns = False
    layout = {"root_built": False, "child_uid": None, "userns": False}
    if mount and is_root:
        # Assemble the read-only root as real root: the prefix may sit in an unreadable
        # home, and mounts made here are locked read-only for the user namespace below.
        if _record(caps, "mount_ns", _linux.unshare, _linux.CLONE_NEWNS):
            _linux.mount(None, "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
            layout["root_built"] = _build_root(setup, caps)
    if userns:
        if is_root:
            os.setgroups([])
            os.setresgid(slot[1], slot[1], slot[1])
            os.setresuid(slot[0], slot[0], slot[0])
        # A uid change leaves the process non-dumpable, which makes /proc/self/uid_map
        # root-owned and unwritable by the new uid.
        _linux.prctl(_linux.PR_SET_DUMPABLE, 1)
        outside_uid, outside_gid = os.geteuid(), os.getegid()  # unmapped after unshare
        flags = _linux.CLONE_NEWUSER | (_linux.CLONE_NEWNS if mount else 0)
        if _record(caps, "user_ns", _linux.unshare, flags):
            layout["userns"] = True
            _linux.write_id_maps(SANDBOX_UID, outside_uid, SANDBOX_UID, outside_gid)
            if mount and not is_root:
                caps["mount_ns"] = True
                _linux.mount(None, "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
                layout["root_built"] = _build_root(setup, caps)
    elif is_root:
        layout["child_uid"] = slot  # real root without a user namespace: children drop
    if mount and not (is_root or layout["userns"]):
        caps["mount_ns"] = "failed: needs root or a user namespace"
    for name in sorted(want - {"user", "mount"}):
        # One call per namespace so that the report names exactly what the host refused.
        if name in setup.get("refuse", ()):
            caps[f"{name}_ns"] = "failed: refused by the pool's test hook"
            continue
        _record(caps, f"{name}_ns", _linux.unshare, _linux.NAMESPACE_FLAGS[name])
    # RLIMIT_NPROC is ignored for the global root user; it is counted per user namespace,
    # or per uid, so it needs either a user namespace or a uid of the sandbox's own.
    caps["nproc_limit"] = (True if layout["userns"] or layout["child_uid"] else
                           "failed: needs root or a user namespace")
    caps["distinct_uid"] = (True if is_root and (layout["userns"] or layout["child_uid"])
                            else "failed: only root can switch to a slot uid")
    shim = os.getpid()
    pid = os.fork()
    if pid:
        _shim_wait(pid)
    _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if caps.get("pid_ns") is not True and os.getppid() != shim:
        os._exit(1)  # the shim died before the death signal was armed
    _finish_worker_setup(setup, caps, layout)
    return layout


def _shim_wait(pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _mount_points_under(path: str) -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == path or mp.startswith(path + "/"):
                points.append(mp)
    return points


def _bind_readonly(source: str, target: str) -> None:
    _linux.mount(source, target, None, _linux.MS_BIND | _linux.MS_REC)
    for mp in _mount_points_under(target):
        flags = _linux.MS_REMOUNT | _linux.MS_BIND | _linux.MS_RDONLY
        try:
            _linux.mount(None, mp, None, flags | _linux.locked_mount_flags(mp))
        except OSError:
            _linux.umount(mp, _linux.MNT_DETACH)  # cannot be made read-only: hide it


def _new_root(setup: dict) -> str:
    # Inside the pool's private host directory: mounting there hides no host path.
    return os.path.join(setup["host_dir"], "root")


def _build_root(setup: dict, caps: dict) -> bool:
    """Assembles a read-only root: host paths bound read-only, minimal /dev."""
    new_root = _new_root(setup)
    try:
        os.makedirs(new_root, exist_ok=True)
        _linux.mount("tmpfs", new_root, "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV,
                     "size=1m,nr_inodes=4096,mode=0755")
        for path in setup["ro_paths"]:
            path = os.path.normpath(path)
            target = new_root + path
            if not os.path.lexists(path) or os.path.lexists(target):
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.islink(path) and os.path.dirname(path) == "/":
                os.symlink(os.readlink(path), target)  # /bin -> usr/bin on merged-/usr
            elif os.path.isdir(path):
                os.mkdir(target)
                _bind_readonly(path, target)
            else:
                open(target, "w").close()
                _bind_readonly(path, target)
        for name in ("proc", "sandbox", "tmp", "dev"):
            os.makedirs(new_root + "/" + name, exist_ok=True)
        dev = new_root + "/dev"
        _linux.mount("tmpfs", dev, "tmpfs", _linux.MS_NOSUID, "size=64k,mode=0755")
        for node in _DEV_NODES:
            open(f"{dev}/{node}", "w").close()
            _linux.mount(f"/dev/{node}", f"{dev}/{node}", None, _linux.MS_BIND)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
                             ("shm", "/tmp")):
            os.symlink(target, f"{dev}/{name}")
        ro = _linux.MS_REMOUNT | _linux.MS_BIND | _linux.MS_RDONLY | _linux.MS_NOSUID
        _linux.mount(None, dev, None, ro)
        _linux.mount(None, new_root, None, ro | _linux.MS_NODEV)
    except OSError as e:
        caps["readonly_root"] = f"failed: {e}"
        return False
    return True


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, ifreq))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))  # SIOCSIFFLAGS


def _finish_worker_setup(setup: dict, caps: dict, layout: dict) -> None:
    """Runs as the worker: /proc of the new pid namespace, pivot into the new root."""
    # Without a pid namespace the worker finds a run's processes in the host's /proc,
    # which the new root does not show: keep a handle on it (children never inherit it).
    layout["proc_fd"] = None
    if caps.get("pid_ns") is not True:
        layout["proc_fd"] = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    new_root = _new_root(setup)
    if layout["root_built"]:
        try:
            # A bind of the tree onto itself is not locked, so pivot_root accepts it.
            _linux.mount(new_root, new_root, None, _linux.MS_BIND | _linux.MS_REC)
            if caps.get("pid_ns") is True:
                _record(caps, "proc", _linux.mount, "proc", new_root + "/proc", "proc",
                        _linux.MS_NOSUID | _linux.MS_NODEV | _linux.MS_NOEXEC)
            os.chdir(new_root)
            _linux.pivot_root(".", ".")
            _linux.umount(".", _linux.MNT_DETACH)
            os.chdir("/")
            caps["readonly_root"] = True
        except OSError as e:
            caps["readonly_root"] = f"failed: {e}"
            layout["root_built"] = False
    elif "readonly_root" not in caps:
        caps["readonly_root"] = "failed: no mount namespace"
    if caps.get("net_ns") is True and setup["loopback"]:
        _record(caps, "loopback", _loopback_up)
    if caps.get("pid_ns") is not True:
        _linux.prctl(_linux.PR_SET_CHILD_SUBREAPER, 1)
    # Non-dumpable: code running as the same uid cannot ptrace or read /proc/1/mem.
    _linux.prctl(_linux.PR_SET_DUMPABLE, 0)
    # Inherited by every child, so done once here: no execve in a child can gain
    # privileges (setuid bits, file capabilities) or capabilities from the bounding set.
    _record(caps, "no_new_privs", _linux.prctl, _linux.PR_SET_NO_NEW_PRIVS, 1)
    _record(caps, "bounding_set_dropped", _linux.drop_bounding_set)
    # Default disposition: pid 1 then never receives it from processes of its namespace.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    caps["interpreter"] = _interpreter_usable(setup["python"], layout["child_uid"])


def _interpreter_usable(python: str, child_uid) -> bool | str:
    """Whether sandboxed code can run `python` and read its standard library.

    Without a mount namespace it sees the host's files with its own uid, and an
    interpreter under a private home (e.g. /root/.pyenv) is out of its reach.
    """
    stdlib = os.path.dirname(os.__file__)
    pid = os.fork()
    if pid == 0:
        if child_uid:
            os.setgroups([])
            os.setresgid(child_uid[1], child_uid[1], child_uid[1])
            os.setresuid(child_uid[0], child_uid[0], child_uid[0])
        usable = os.access(python, os.X_OK) and os.access(stdlib, os.R_OK | os.X_OK)
        os._exit(0 if usable else 1)
    if os.waitpid(pid, 0)[1] == 0:
        return True
    return (f"failed: the sandbox's uid cannot run {python} or read {stdlib}; use the "
            f"mount namespace or a Python installed where every user can read it")


# --------------------------------------------------------------------------- serving


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
        reply = _classify(outcome, setup_error.decode("utf-8", "replace"), lang)
        reply["cpu_s"] = (usage1.ru_utime - usage0.ru_utime
                          + usage1.ru_stime - usage0.ru_stime)
        if req.get("return_workdir"):
            reply["workdir"] = _archive(self.workdir)
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
        timed_out = overflow = False
        while wait_status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for fd, _ in poller.poll(left * 1000):
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
        for fd in list(open_fds):  # every writer is dead: drain to EOF
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
                "wall_s": wall, "stdout": stdout, "stderr": stderr,
                "memory_mb": req["memory_mb"], "timeout_s": req["timeout_s"],
                "max_output_bytes": limit}

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
                _extract(req["workdir"], self.workdir)
            for rel, data in req.get("files", {}).items():
                _write_file(self.workdir, rel, data)
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
                _run_python(code_obj, program, req.get("argv") or [], self.workdir,
                            self.base_sys_path)
            argv = _command(req, program, self.setup["python"])
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
                os._exit(_SETUP_FAILED)


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


def _command(req: dict, program: str | None, python: str) -> list[str]:
    args = list(req.get("argv") or [])
    if program is None:
        return args
    if req["language"] == "python":
        return [python, program, *args]
    return ["bash", program, *args]


def _run_python(code_obj, program: str, argv: list[str], workdir: str,
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
    gc.unfreeze()
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


def _write_file(root: str, rel: str, data: bytes) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _archive(root: str) -> bytes:
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


def _extract(archive: bytes, root: str) -> None:
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r") as tar:
        if hasattr(tarfile, "tar_filter"):
            tar.extractall(root, filter="tar")
        else:
            tar.extractall(root)


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


def _classify(outcome: dict, setup_error: str, language: str) -> dict:
    status_word = outcome["wait_status"]
    exit_code = os.waitstatus_to_exitcode(status_word)
    stderr_text = outcome["stderr"][-4096:].decode("utf-8", "replace")
    memory_sign = any(sign in stderr_text for sign in _MEMORY_SIGNS)
    detail = ""
    if setup_error and exit_code == _SETUP_FAILED:
        status, detail = "sandbox_error", setup_error
    elif outcome["timed_out"]:
        status = "timeout"
        detail = f"killed after the {outcome['timeout_s']:g} s deadline"
    elif outcome["overflow"]:
        status = "output_limit"
        detail = f"output exceeded {outcome['max_output_bytes']} bytes"
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
