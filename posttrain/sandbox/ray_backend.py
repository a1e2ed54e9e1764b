"""RayBackend: sandbox actors on a Ray cluster, for when one host's CPUs are not enough.

Each actor owns a `LocalBackend` (the isolated warm-worker pool) on its node, so the
isolation is the same as locally; requests, results and session archives travel through
Ray's object store. Start a cluster first (`ray start --head` on one node, then
`ray start --address=HEAD_IP:6379` on each other node), then:

    Sandbox(SandboxConfig(backend="ray", ray_address="auto", ray_actors=NODES,
                          concurrency=WORKERS_PER_ACTOR))

`ray` is imported only here (`pip install 'posttrain[ray]'`).
"""
import concurrent.futures
import dataclasses
import itertools
import sys
import threading

from posttrain.sandbox.api import ExecRequest, SandboxConfig
from posttrain.sandbox.backend import Backend


class _SandboxActor:
    """Runs on a Ray node: a local pool serving up to `concurrency` runs at once."""

    def __init__(self, config: SandboxConfig):
        from posttrain.sandbox.pool import LocalBackend
        # This node's interpreter (the driver's path need not exist here).
        self._backend = LocalBackend(dataclasses.replace(config, python=sys.executable))

    def capabilities(self) -> dict:
        return dict(self._backend.capabilities)

    def run(self, request: ExecRequest, workdir: bytes | None, return_workdir: bool):
        return self._backend.submit(request, workdir, return_workdir).result()

    def close(self) -> None:
        self._backend.close()


class RayBackend(Backend):
    """Spreads runs round-robin over `config.ray_actors` sandbox actors."""

    def __init__(self, config: SandboxConfig):
        try:
            import ray
        except ImportError as e:
            raise ImportError("SandboxConfig(backend='ray') needs ray: "
                              "pip install 'posttrain[ray]'") from e
        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=config.ray_address, ignore_reinit_error=True,
                     log_to_driver=False)
        local = dataclasses.replace(config, backend="local")
        actor_class = ray.remote(_SandboxActor).options(
            num_cpus=0, max_concurrency=config.concurrency + 2,
            scheduling_strategy="SPREAD")
        self._actors = [actor_class.remote(local) for _ in range(config.ray_actors)]
        reports = ray.get([actor.capabilities.remote() for actor in self._actors])
        self.capabilities = dict(reports[0], backend="ray", actors=len(self._actors))
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, request: ExecRequest, workdir: bytes | None = None,
               return_workdir: bool = False) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the sandbox is closed")
        with self._lock:
            actor = self._actors[next(self._next) % len(self._actors)]
        return actor.run.remote(request, workdir, return_workdir).future()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ray.get([actor.close.remote() for actor in self._actors])
        for actor in self._actors:
            self._ray.kill(actor)
