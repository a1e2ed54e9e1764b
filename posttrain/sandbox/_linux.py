"""Thin ctypes wrappers over the Linux calls Python 3.11 lacks (unshare, mount, capset...).

Only the standard library is imported: this module runs inside the sandbox worker.
"""
import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

NAMESPACE_FLAGS = {
    "user": CLONE_NEWUSER,
    "net": CLONE_NEWNET,
    "pid": CLONE_NEWPID,
    "mount": CLONE_NEWNS,
    "ipc": CLONE_NEWIPC,
    "uts": CLONE_NEWUTS,
}

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

# statvfs f_flag bits -> the mount flags a bind remount must keep (the kernel refuses
# to clear flags that are locked on a mount inherited from a more privileged namespace).
_STATVFS_TO_MS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC,
                  1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                        ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203,
                   "s390x": 217}


def _check(result: int, what: str) -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _b(path):
    return None if path is None else os.fsencode(path)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def mount(source, target, fstype=None, flags: int = 0, data=None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
           f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x})")


def umount(target, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount2({target!r})")


def pivot_root(new_root, put_old) -> None:
    machine = os.uname().machine
    if machine not in _SYS_PIVOT_ROOT:
        raise OSError(f"pivot_root: unknown syscall number on {machine}")
    _check(_libc.syscall(_SYS_PIVOT_ROOT[machine], _b(new_root), _b(put_old)),
           "pivot_root")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    return _check(_libc.prctl(option, arg2, arg3, 0, 0), f"prctl({option})")


def locked_mount_flags(path) -> int:
    """Mount flags of the filesystem holding `path` that a remount has to keep."""
    f_flag = os.statvfs(path).f_flag
    return sum(ms for st, ms in _STATVFS_TO_MS.items() if f_flag & st)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


# Built once so that a forked child empties its capability sets with one foreign call
# (and few copy-on-write page faults).
_CAP_HEADER = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
_CAP_EMPTY = (_CapData * 2)()
_capset = _libc.capset
_prctl = _libc.prctl


def drop_bounding_set() -> None:
    """Empties the bounding and ambient sets: no later execve can grant a capability."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
    except OSError:
        last_cap = 63
    for cap in range(last_cap + 1):
        if _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == -1 and ctypes.get_errno() != 22:
            _check(-1, f"prctl(PR_CAPBSET_DROP, {cap})")  # EINVAL: unknown capability
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def clear_capabilities() -> None:
    """Empties the effective, permitted and inheritable sets of this process."""
    _check(_capset(ctypes.byref(_CAP_HEADER), _CAP_EMPTY), "capset")


def write_id_maps(inside_uid: int, outside_uid: int, inside_gid: int,
                  outside_gid: int) -> None:
    """Maps one uid and gid into the user namespace this process just unshared."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{inside_uid} {outside_uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{inside_gid} {outside_gid} 1")
