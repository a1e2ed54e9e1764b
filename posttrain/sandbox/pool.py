"""LocalBackend: a pool of pre-forked, isolated, warm worker processes on this host.

One thread per slot owns one worker (see `_worker`), takes requests from a bounded queue,
and enforces each run's deadline from outside: a worker that does not answer by
`timeout_s + grace_s` is killed (its pid namespace with it) and replaced; one that dies
is replaced and the run retried once on the new worker.
"""
import atexit
import concurrent.futures
import dataclasses
import errno
import fcntl
import logging
import os
import queue
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time

import posttrain
from posttrain.sandbox import _protocol
from posttrain.sandbox._isolation import PRIVATE_PATHS
from posttrain.sandbox._worker import BOOTSTRAP
from posttrain.sandbox.api import (
    ExecRequest,
    ExecResult,
    SandboxConfig,
    SandboxUnavailableError,
    Status,
    default_ro_paths,
)
from posttrain.sandbox.backend import Backend, sandbox_error

logger = logging.getLogger("posttrain.sandbox")

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(posttrain.__file__)))
_WORKER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_TRANSFER_BYTES_PER_S = 50e6  # slack added to a deadline for moving files in and out


class _UidLease:
    """An exclusive claim on one uid of [base, base + count), held by an flock."""

    def __init__(self, base: int, count: int):
        lock_dir = os.path.join(tempfile.gettempdir(), "posttrain-sandbox-uids")
        try:
            os.mkdir(lock_dir, 0o700)
        except FileExistsError:
            pass
        info = os.lstat(lock_dir)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise SandboxUnavailableError(f"uid lock directory {lock_dir} is not ours")
        for uid in range(base, base + count):
            fd = os.open(os.path.join(lock_dir, str(uid)),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise SandboxUnavailableError(
            f"all {count} sandbox uids from {base} are in use; raise SandboxConfig.uid_count")

    def release(self) -> None:
        os.close(self._fd)


class _WorkerProcess:
    """The trainer's handle on one worker: its shim process and the control pipes."""

    def __init__(self, config: SandboxConfig, uid: int | None, refuse: tuple[str, ...] = ()):
        ro_paths = list(config.ro_paths or default_ro_paths())
        for path in ro_paths:
            hidden = [p for p in PRIVATE_PATHS if path == p or path.startswith(p + "/")]
            if hidden and "mount" in config.namespaces:
                raise SandboxUnavailableError(
                    f"read-only path {path} lies under {hidden[0]}, which the sandbox "
                    f"replaces with its own; install Python elsewhere or change ro_paths")
        self.host_dir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
        if uid is not None:
            os.chown(self.host_dir, uid, uid)
        # The worker's own stderr goes to a file: a pipe nobody drains could block it.
        self._log = os.path.join(self.host_dir, "worker.log")
        try:
            with open(self._log, "wb") as log:
                self.proc = subprocess.Popen(
                    [config.python, "-S", "-I", "-c", BOOTSTRAP, _PACKAGE_PARENT],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                    env=_WORKER_ENV, close_fds=True, start_new_session=True)
        except OSError as e:
            shutil.rmtree(self.host_dir, ignore_errors=True)
            raise SandboxUnavailableError(f"cannot start {config.python}: {e}") from e
        self._to, self._from = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        self.pid = self._pidfd = None
        setup = {
            "uid": uid, "gid": uid, "namespaces": list(config.namespaces),
            "ro_paths": ro_paths,
            "mode": config.mode, "disk_mb": config.disk_mb,
            "max_processes": config.max_processes, "max_open_files": config.max_open_files,
            "max_file_mb": config.max_file_mb, "env": dict(config.env),
            "python": config.python, "preload": list(config.preload),
            "loopback": config.loopback, "host_dir": self.host_dir, "refuse": list(refuse),
        }
        try:
            _protocol.send(self._to, setup)
            hello = _protocol.recv(self._from, time.monotonic() + config.startup_timeout_s)
        except (_protocol.Closed, _protocol.Deadline, OSError, ValueError) as e:
            reason = self.death_reason()
            self.kill()
            raise SandboxUnavailableError(f"sandbox worker failed to start ({e}): {reason}")
        self.capabilities = hello["capabilities"]
        self.pid = _only_child(self.proc.pid)
        if self.pid is not None:
            self._pidfd = os.pidfd_open(self.pid)  # signals and waits cannot hit a reused pid

    def run(self, message: bytes, deadline: float, max_bytes: int) -> dict:
        _write_all(self._to, message)
        return _protocol.recv(self._from, deadline, max_bytes)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def death_reason(self) -> str:
        try:
            status = self.proc.wait(1.0)  # the shim exits right after its worker
        except subprocess.TimeoutExpired:
            status = None
        try:
            with open(self._log, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
                stderr = f.read()
        except OSError:
            stderr = b""
        tail = stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        return f"worker exit status {status}" + (": " + " | ".join(tail) if tail else "")

    def kill(self) -> None:
        """SIGKILLs the worker (pid 1 of its namespace: every run process dies with it)."""
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self._finish()

    def close(self, timeout_s: float = 2.0) -> None:
        self.proc.stdin.close()  # the worker exits on end of input
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def _finish(self) -> None:
        self.proc.wait()
        if self._pidfd is not None:
            # A pid namespace's init exits only once all its processes have died.
            select.select([self._pidfd], [], [], 10.0)
            os.close(self._pidfd)
            self._pidfd = None
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        shutil.rmtree(self.host_dir, ignore_errors=True)


def _only_child(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if len(children) == 1 else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclasses.dataclass
class _Job:
    request: ExecRequest
    message: bytes
    payload_bytes: int
    future: concurrent.futures.Future


def _encode(request: ExecRequest, workdir: bytes | None, return_workdir: bool) -> bytes:
    def to_bytes(data):
        return data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data

    return _protocol.pack({
        "type": "run", "language": request.language,
        "code": None if request.code is None else to_bytes(request.code),
        "argv": list(request.argv or ()), "stdin": to_bytes(request.stdin),
        "files": {path: to_bytes(data) for path, data in request.files.items()},
        "timeout_s": float(request.timeout_s), "memory_mb": request.memory_mb,
        "max_output_bytes": request.max_output_bytes,
        "workdir": workdir or None, "return_workdir": return_workdir,
    })


def _decode(reply: dict) -> tuple[ExecResult, bytes | None]:
    result = ExecResult(
        status=Status(reply["status"]), exit_code=reply["exit_code"],
        stdout=reply["stdout"].decode("utf-8", "replace"),
        stderr=reply["stderr"].decode("utf-8", "replace"),
        wall_s=float(reply["wall_s"]), cpu_s=float(reply["cpu_s"]),
        detail=reply.get("detail", ""))
    return result, reply.get("workdir")


class LocalBackend(Backend):
    """Pre-forked isolated workers on this host, one run per worker at a time."""

    def __init__(self, config: SandboxConfig, _refuse: tuple[str, ...] = ()):
        """Starts `config.concurrency` workers and checks the isolation they report.

        `_refuse` names namespaces the workers pretend the host refused (tests only).
        """
        self.config = config
        self._refuse = tuple(_refuse)
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self._closed = False
        self._close_lock = threading.Lock()
        self._workers: list[_WorkerProcess | None] = [None] * config.concurrency
        self._leases: list[_UidLease] = []
        trainer_is_root = os.geteuid() == 0
        try:
            for _ in range(config.concurrency if trainer_is_root else 0):
                self._leases.append(_UidLease(config.uid_base, config.uid_count))
        except SandboxUnavailableError:
            for lease in self._leases:
                lease.release()
            raise
        started = [concurrent.futures.Future() for _ in range(config.concurrency)]
        self._threads = [
            threading.Thread(target=self._slot_main, args=(slot, started[slot]),
                             name=f"sandbox-slot-{slot}", daemon=True)
            for slot in range(config.concurrency)]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)
        try:
            reports = [f.result() for f in started]
        except Exception:
            self.close()
            raise
        capabilities = dict(reports[0])
        capabilities.update(backend="local", mode=config.mode, trainer_uid=os.geteuid())
        self.capabilities = capabilities
        if capabilities.get("interpreter") is not True:
            self.close()
            raise SandboxUnavailableError(
                f"sandbox cannot run programs: {capabilities.get('interpreter')}")
        required = config.required_capabilities(trainer_is_root)
        missing = {n: capabilities.get(n, "not reported") for n in required
                   if capabilities.get(n) is not True}
        if missing:
            summary = "; ".join(f"{n}: {why}" for n, why in missing.items())
            if not config.allow_weak_isolation:
                self.close()
                raise SandboxUnavailableError(
                    f"sandbox isolation is weaker than configured ({summary}); pass "
                    f"SandboxConfig(allow_weak_isolation=True) to run untrusted code anyway")
            logger.warning("running untrusted code with weak isolation: %s", summary)

    # ----------------------------------------------------------------- public

    def submit(self, request: ExecRequest, workdir: bytes | None = None,
               return_workdir: bool = False) -> concurrent.futures.Future:
        if not isinstance(request, ExecRequest):
            raise TypeError(f"expected an ExecRequest, got {type(request).__name__}")
        if self._closed:
            raise RuntimeError("the sandbox is closed")
        message = _encode(request, workdir, return_workdir)
        future = concurrent.futures.Future()
        self._queue.put(_Job(request, message, len(message), future))
        return future

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._fail_queued("the sandbox was closed before this request ran")
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self._fail_queued("the sandbox was closed before this request ran")
        for lease in self._leases:
            lease.release()
        self._leases = []
        atexit.unregister(self.close)

    def worker_pids(self) -> list[int]:
        """Host pids of the live workers (for tests and diagnostics)."""
        return [w.pid for w in self._workers if w is not None and w.pid is not None]

    def shim_pids(self) -> list[int]:
        """Host pids of the workers' parent processes (the trainer's direct children)."""
        return [w.proc.pid for w in self._workers if w is not None]

    # --------------------------------------------------------------- internals

    def _fail_queued(self, detail: str) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_result((sandbox_error(detail), None))

    def _spawn(self, slot: int) -> _WorkerProcess:
        uid = self._leases[slot].uid if self._leases else None
        worker = _WorkerProcess(self.config, uid, self._refuse)
        self._workers[slot] = worker
        return worker

    def _slot_main(self, slot: int, started: concurrent.futures.Future) -> None:
        worker = None
        try:
            worker = self._spawn(slot)
            started.set_result(worker.capabilities)
        except BaseException as e:
            started.set_exception(e)
        while True:
            job = self._queue.get()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                worker, outcome = self._serve(slot, worker, job)
            except BaseException as e:  # never leave a caller waiting forever
                worker, outcome = None, (sandbox_error(f"sandbox pool: {e!r}"), None)
            job.future.set_result(outcome)
        if worker is not None:
            worker.close()
        self._workers[slot] = None

    def _serve(self, slot: int, worker: _WorkerProcess | None, job: _Job):
        reason = ""
        for _ in range(2):
            if worker is None or not worker.alive():
                if worker is not None:
                    worker.kill()
                try:
                    worker = self._spawn(slot)
                except SandboxUnavailableError as e:
                    return None, (sandbox_error(str(e)), None)
            grace = self.config.grace_s + job.payload_bytes / _TRANSFER_BYTES_PER_S
            deadline = time.monotonic() + job.request.timeout_s + grace
            max_bytes = 2 * job.request.max_output_bytes + (4 * self.config.disk_mb << 20)
            try:
                return worker, _decode(worker.run(job.message, deadline, max_bytes))
            except _protocol.Deadline:
                worker.kill()
                result = ExecResult(
                    status=Status.TIMEOUT, exit_code=None, stdout="", stderr="",
                    wall_s=job.request.timeout_s, cpu_s=0.0,
                    detail="the worker did not answer by the deadline and was replaced")
                return None, (result, None)
            except (_protocol.Closed, ValueError, KeyError, OSError) as e:
                if isinstance(e, OSError) and e.errno not in (errno.EPIPE, errno.EBADF):
                    raise
                reason = f"{e!r}; {worker.death_reason()}"
                worker.kill()
                worker = None
                logger.warning("sandbox worker died (%s); retrying on a new one", reason)
        return None, (sandbox_error(f"the sandbox worker died twice: {reason}"), None)
