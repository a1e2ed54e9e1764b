"""The Ray backend serves the same requests, results and sessions (only if ray is here)."""
import importlib.util

import pytest

from posttrain.sandbox import ExecRequest, Sandbox, SandboxConfig

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'posttrain[ray]')")


@pytest.fixture(scope="module")
def ray_sandbox():
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with Sandbox(SandboxConfig(backend="ray", ray_actors=2, concurrency=2)) as sb:
            yield sb
    finally:
        ray.shutdown()


@needs_ray
def test_runs_and_statuses_match_the_local_backend(ray_sandbox):
    assert ray_sandbox.capabilities["backend"] == "ray"
    assert ray_sandbox.capabilities["pid_ns"] is True
    results = ray_sandbox.run_many([
        ExecRequest(code="print('hi')"),
        ExecRequest(code="print("),
        ExecRequest(code="while True: pass", timeout_s=0.5),
        ExecRequest(code="exit 3", language="bash"),
    ])
    assert [r.status for r in results] == ["ok", "compile_error", "timeout", "runtime_error"]
    assert results[0].stdout == "hi\n" and results[3].exit_code == 3


@needs_ray
def test_sessions_work_across_actors(ray_sandbox):
    with ray_sandbox.open_session() as sess:
        for i in range(4):  # round-robin: consecutive turns land on different actors
            sess.run(ExecRequest(code=f"open('f{i}', 'w').write('x')"))
        res = sess.run(ExecRequest(code="import os; print(sorted(os.listdir('.')))"))
        assert res.stdout == "['f0', 'f1', 'f2', 'f3']\n"


def test_missing_ray_gives_an_install_hint(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("no ray")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    from posttrain.sandbox.ray_backend import RayBackend
    with pytest.raises(ImportError, match="posttrain\\[ray\\]"):
        RayBackend(SandboxConfig(backend="ray"))
