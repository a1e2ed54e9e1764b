"""The interface a sandbox backend implements: the local pool or a cluster (Ray) pool."""
import abc
import concurrent.futures
from collections.abc import Mapping

from posttrain.sandbox.api import ExecRequest, ExecResult, Status


class Backend(abc.ABC):
    """Runs requests somewhere isolated; `Sandbox` and its sessions sit on top.

    A session's state is its working directory, carried as a tar archive with each run,
    so any worker of any backend can serve any turn.
    """

    capabilities: Mapping[str, object]

    @abc.abstractmethod
    def submit(self, request: ExecRequest, workdir: bytes | None = None,
               return_workdir: bool = False) -> concurrent.futures.Future:
        """Queues a run (blocking while the queue is full).

        Args:
          request: what to run.
          workdir: a tar archive to unpack into the working directory before the run.
          return_workdir: also return the working directory after the run as a tar.

        Returns:
          A future of `(ExecResult, archive or None)`; it never fails for anything the
          code does.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stops every worker; pending runs end as sandbox_error."""


def sandbox_error(detail: str) -> ExecResult:
    return ExecResult(status=Status.SANDBOX_ERROR, exit_code=None, stdout="", stderr="",
                      wall_s=0.0, cpu_s=0.0, detail=detail)
