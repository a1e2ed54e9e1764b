"""`Sandbox`: runs untrusted programs through a backend; `Session`: multi-turn state."""
import concurrent.futures
import threading
from collections.abc import Iterable, Mapping

from posttrain.sandbox.api import ExecRequest, ExecResult, SandboxConfig, Snapshot
from posttrain.sandbox.backend import Backend


class Sandbox:
    """Isolated execution of untrusted code.

    Args:
      config: isolation, limits and pool size; the defaults refuse to run unless this host
        gives user, network, pid, mount, ipc and uts namespaces and a read-only root.
      backend: an already built backend (overrides `config.backend`).

    Raises:
      SandboxUnavailableError: the host cannot isolate as configured.
    """

    def __init__(self, config: SandboxConfig | None = None, backend: Backend | None = None):
        self.config = config or SandboxConfig()
        if backend is None:
            if self.config.backend == "ray":
                from posttrain.sandbox.ray_backend import RayBackend
                backend = RayBackend(self.config)
            else:
                from posttrain.sandbox.pool import LocalBackend
                backend = LocalBackend(self.config)
        self._backend = backend

    @property
    def capabilities(self) -> Mapping[str, object]:
        """Which isolation mechanisms the workers got (True) or why not (a string)."""
        return self._backend.capabilities

    def submit(self, request: ExecRequest) -> concurrent.futures.Future:
        """Queues one run; the future resolves to its ExecResult."""
        inner = self._backend.submit(request)
        outer = concurrent.futures.Future()

        def forward(done: concurrent.futures.Future) -> None:
            error = done.exception()
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(done.result()[0])

        inner.add_done_callback(forward)
        return outer

    def run(self, request: ExecRequest) -> ExecResult:
        """Runs one program; never raises for anything the program does."""
        return self._backend.submit(request).result()[0]

    def run_many(self, requests: Iterable[ExecRequest]) -> list[ExecResult]:
        """Runs programs concurrently through the pool; results in request order."""
        futures = [self._backend.submit(request) for request in requests]
        return [future.result()[0] for future in futures]

    def open_session(self) -> "Session":
        """A working directory shared by successive runs, with snapshot and restore."""
        return Session(self._backend)

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """Runs that share one working directory, for multi-turn tool use.

    Files persist between runs; processes do not (each run's processes end with it). The
    directory travels with each run as a tar archive, so `snapshot` is free and `restore`
    rolls back exactly, for retries and deterministic replay.
    """

    def __init__(self, backend: Backend):
        self._backend = backend
        self._archive = b""
        self._closed = False
        self._lock = threading.Lock()

    def run(self, request: ExecRequest) -> ExecResult:
        """Runs in the session's directory; its files are kept for the next run."""
        with self._lock:  # turns of one session are ordered
            if self._closed:
                raise RuntimeError("the session is closed")
            future = self._backend.submit(request, workdir=self._archive,
                                          return_workdir=True)
            result, archive = future.result()
            if archive is not None:
                self._archive = archive
            return result

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self._archive)

    def restore(self, snapshot: Snapshot) -> None:
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"restore() needs a Snapshot, got {type(snapshot).__name__}")
        with self._lock:
            self._archive = snapshot.archive

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._archive = b""

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
