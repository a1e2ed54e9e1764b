"""Fixtures for the sandbox tests: a shared pool and a /proc-based process census."""
import os

import pytest

from posttrain.sandbox import Sandbox, SandboxConfig


def descendants(root_pid: int) -> list[int]:
    """Every live (non-zombie) process below `root_pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], [root_pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def stray_processes(sb: Sandbox) -> list[int]:
    """Processes of finished runs still alive: anything below a worker slot but the worker."""
    backend = sb._backend
    workers = set(backend.worker_pids())
    return [pid for shim in backend.shim_pids() for pid in descendants(shim)
            if pid not in workers]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def sandbox():
    """One default-configured pool of 8 workers per test module."""
    with Sandbox(SandboxConfig(concurrency=8)) as sb:
        yield sb
        assert stray_processes(sb) == []
