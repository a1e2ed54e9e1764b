"""Isolation of a sandbox worker, done once when it starts (see `_worker`).

Runs in the shim process the pool starts: enters the namespaces, switches to the slot's
uid, assembles a read-only root, then forks the worker, which becomes pid 1 of the new
pid namespace, pivots into that root and reports which mechanisms the host allowed.
Only the standard library is used here.
"""
import fcntl
import importlib
import os
import signal
import socket
import struct

from posttrain.sandbox import _linux

SANDBOX_UID = 1000  # identity of sandboxed code inside its user namespace
# Paths inside the sandbox that are its own, never bound from the host.
PRIVATE_PATHS = ("/sandbox", "/tmp", "/proc", "/dev")
_DEV_NODES = ("null", "zero", "full", "random", "urandom")


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


def isolate(setup: dict, caps: dict) -> dict:
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
    # Armed last: a uid change clears it. The pool's slot thread that started us lives
    # as long as the slot, so this ends the shim (and with it the worker) on shutdown.
    _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
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
        usable = False
        try:
            if child_uid:
                os.setgroups([])
                os.setresgid(child_uid[1], child_uid[1], child_uid[1])
                os.setresuid(child_uid[0], child_uid[0], child_uid[0])
            usable = os.access(python, os.X_OK) and os.access(stdlib, os.R_OK | os.X_OK)
        finally:
            os._exit(0 if usable else 1)
    if os.waitpid(pid, 0)[1] == 0:
        return True
    return (f"failed: the sandbox's uid cannot run {python} or read {stdlib}; use the "
            f"mount namespace or a Python installed where every user can read it")
