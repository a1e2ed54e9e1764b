"""Request/config validation: bad input fails early with a one-line message naming it."""
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import posttrain
from posttrain.sandbox import ExecRequest, ExecResult, SandboxConfig, Status
from posttrain.sandbox.api import check_relative_path


def test_status_compares_equal_to_plain_strings():
    assert Status.OK == "ok" and Status("timeout") is Status.TIMEOUT
    assert {s.value for s in Status} == {
        "ok", "compile_error", "runtime_error", "timeout", "memory_limit", "output_limit",
        "killed", "sandbox_error"}
    result = ExecResult(Status.OK, 0, "", "", 0.0, 0.0)
    assert result.ok and result.status == "ok" and str(result.status) == "ok"


@pytest.mark.parametrize("kwargs, named", [
    (dict(code="1", language="ruby"), "'ruby'"),
    (dict(code=b"print(1)"), "bytes"),
    (dict(), "code, or argv"),
    (dict(argv="ls -l"), "'ls -l'"),
    (dict(argv=["echo", "a\0b"]), "argv"),
    (dict(code="1", timeout_s=0), "0"),
    (dict(code="1", timeout_s=float("nan")), "nan"),
    (dict(code="1", timeout_s=True), "True"),
    (dict(code="1", memory_mb=8), "8"),
    (dict(code="1", memory_mb=256.0), "256.0"),
    (dict(code="1", max_output_bytes=0), "0"),
    (dict(code="1", stdin=3), "int"),
    (dict(code="1", files={"../x": "a"}), "'../x'"),
    (dict(code="1", files={"/etc/passwd": "a"}), "'/etc/passwd'"),
    (dict(code="1", files={"a/../../b": "a"}), "'a/../../b'"),
    (dict(code="1", files={"": "a"}), "''"),
    (dict(code="1", files={".": "a"}), "'.'"),
    (dict(code="1", files={"a": 3}), "int"),
    (dict(code="1", files=["a"]), "list"),
])
def test_bad_requests_raise_one_line_errors_naming_the_value(kwargs, named):
    with pytest.raises(ValueError) as info:
        ExecRequest(**kwargs)
    message = str(info.value)
    assert named in message and "\n" not in message


@pytest.mark.parametrize("kwargs, named", [
    (dict(concurrency=0), "0"),
    (dict(backend="docker"), "'docker'"),
    (dict(mode="spawn"), "'spawn'"),
    (dict(namespaces=("user", "time")), "'time'"),
    (dict(namespaces="user"), "'user'"),
    (dict(ro_paths=("usr",)), "'usr'"),
    (dict(env={"A=B": "c"}), "'A=B'"),
    (dict(python="python3"), "'python3'"),
    (dict(grace_s=-1), "-1"),
])
def test_bad_configs_raise_one_line_errors_naming_the_value(kwargs, named):
    with pytest.raises(ValueError) as info:
        SandboxConfig(**kwargs)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_request_normalises_argv_and_files():
    req = ExecRequest(code="1", argv=["a", "b"], files={"d/x.txt": "hi"})
    assert req.argv == ("a", "b") and req.files == {"d/x.txt": "hi"}


@settings(deadline=None)  # a loaded shared machine must not make this flaky
@given(st.lists(st.sampled_from(["a", "b", ".", "..", "", "c.txt"]), min_size=1,
                max_size=5))
def test_relative_path_check_accepts_exactly_paths_inside(parts):
    path = "/".join(parts)
    inside = (parts[0] != "" and parts[-1] != "" and ".." not in parts
              and any(p not in ("", ".") for p in parts))
    if inside:
        check_relative_path(path)
    else:
        with pytest.raises(ValueError):
            check_relative_path(path)


def test_importing_the_package_is_cheap():
    code = ("import sys, posttrain.sandbox as s; s.ExecRequest; "
            "print(sorted(m for m in ('jax', 'numpy', 'threading', 'subprocess') "
            "if m in sys.modules))")
    package_parent = os.path.dirname(os.path.dirname(posttrain.__file__))
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True,
                         text=True, check=True, cwd=package_parent).stdout
    assert out.strip() == "[]"
