"""Requests, results and configuration of the sandbox; plain data, cheap to import."""
import dataclasses
import enum
import math
import os
import sys
from collections.abc import Mapping, Sequence

LANGUAGES = ("python", "bash")
NAMESPACES = ("user", "net", "pid", "mount", "ipc", "uts")


class Status(str, enum.Enum):
    """How a run ended. Members compare equal to their plain-string values."""

    OK = "ok"
    COMPILE_ERROR = "compile_error"  # python SyntaxError (found before running), bash syntax
    RUNTIME_ERROR = "runtime_error"  # exited with a non-zero status
    TIMEOUT = "timeout"  # wall-clock deadline or CPU-time limit
    MEMORY_LIMIT = "memory_limit"  # an allocation failed under the address-space limit
    OUTPUT_LIMIT = "output_limit"  # stdout + stderr exceeded max_output_bytes
    KILLED = "killed"  # died from a signal it did not get from a limit
    SANDBOX_ERROR = "sandbox_error"  # the sandbox failed, not the code

    def __str__(self) -> str:
        return self.value


class SandboxUnavailableError(RuntimeError):
    """This host cannot give the isolation the configuration asks for."""


def _fail(message: str):
    raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class ExecRequest:
    """One program to run.

    Attributes:
      code: program source in `language`; None to run `argv` as a command instead.
      argv: arguments after the program (sys.argv[1:] / $1...), or the command itself
        (argv[0] looked up in PATH) when `code` is None.
      language: "python" or "bash".
      stdin: bytes fed to standard input.
      files: relative path -> contents, written into the working directory first.
      timeout_s: wall-clock deadline; every process of the run is killed at it.
      memory_mb: address-space limit of each process (the interpreter counts too).
      max_output_bytes: cap on stdout + stderr together.
    """

    code: str | None = None
    argv: Sequence[str] | None = None
    language: str = "python"
    stdin: str | bytes = ""
    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20

    def __post_init__(self):
        if self.language not in LANGUAGES:
            _fail(f"ExecRequest.language must be one of {LANGUAGES}, got {self.language!r}")
        if self.code is not None and not isinstance(self.code, str):
            _fail(f"ExecRequest.code must be a str or None, got {type(self.code).__name__}")
        if self.argv is not None:
            if isinstance(self.argv, (str, bytes)) or not all(
                    isinstance(a, str) and "\0" not in a for a in self.argv):
                _fail(f"ExecRequest.argv must be a sequence of str without NUL, got "
                      f"{self.argv!r:.80}")
            object.__setattr__(self, "argv", tuple(self.argv))
        if self.code is None and not self.argv:
            _fail("ExecRequest needs code, or argv naming a command to run")
        if not isinstance(self.stdin, (str, bytes)):
            _fail(f"ExecRequest.stdin must be str or bytes, got {type(self.stdin).__name__}")
        if not isinstance(self.files, Mapping):
            _fail(f"ExecRequest.files must map paths to contents, got "
                  f"{type(self.files).__name__}")
        for path, data in self.files.items():
            check_relative_path(path)
            if not isinstance(data, (str, bytes)):
                _fail(f"ExecRequest.files[{path!r}] must be str or bytes, got "
                      f"{type(data).__name__}")
        object.__setattr__(self, "files", dict(self.files))
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0):
            _fail(f"ExecRequest.timeout_s must be a positive number of seconds, got "
                  f"{self.timeout_s!r}")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or (
                self.memory_mb < 32):
            _fail(f"ExecRequest.memory_mb must be an int >= 32, got {self.memory_mb!r}")
        if isinstance(self.max_output_bytes, bool) or not isinstance(
                self.max_output_bytes, int) or self.max_output_bytes < 1:
            _fail(f"ExecRequest.max_output_bytes must be a positive int, got "
                  f"{self.max_output_bytes!r}")


def check_relative_path(path) -> None:
    """Raises ValueError unless `path` names a file strictly inside the working directory."""
    if not isinstance(path, str) or not path or "\0" in path:
        _fail(f"file path must be a non-empty str without NUL, got {path!r}")
    parts = path.split("/")
    if (path.startswith("/") or path.endswith("/") or ".." in parts
            or os.path.normpath(path) == "."):
        _fail(f"file path must be relative, name a file and stay inside the working "
              f"directory, got {path!r}")


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """How a run ended, with its (possibly truncated) output.

    `exit_code` is the process's exit status, negative for a signal (as in subprocess),
    and None when no process ran (sandbox_error). `wall_s` runs from start to exit or
    kill; `cpu_s` sums user + system time of every process of the run. `detail` says why
    for limits and sandbox errors.
    """

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A session's working directory as an uncompressed tar archive."""

    archive: bytes


def default_ro_paths() -> tuple[str, ...]:
    """Host paths visible (read-only) inside the sandbox: system dirs and this Python."""
    import sysconfig  # here: on Python 3.12 it imports threading, which the package avoids
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
    for prefix in (sys.base_prefix, sys.prefix, sysconfig.get_paths()["purelib"],
                   sysconfig.get_paths()["platlib"]):
        if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
            paths.append(prefix)
    return tuple(paths)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """How the sandbox isolates and how many runs it serves at once.

    Attributes:
      concurrency: worker processes, i.e. runs in flight at once.
      queue_size: requests waiting for a worker before `run` blocks the caller.
      backend: "local" (pre-forked workers on this host) or "ray" (see the package doc).
      mode: "fork" runs python by forking a warm interpreter; "exec" starts a fresh one
        per run (slower; bash and argv commands are always exec'd).
      namespaces: Linux namespaces each worker enters.
      allow_weak_isolation: run even when the host refuses part of the isolation
        (logs a warning); otherwise the constructor raises SandboxUnavailableError.
      uid_base, uid_count: when the trainer is root, each worker runs as its own uid from
        this range (taken under a lock file, so concurrent sandboxes never share one).
      max_processes, max_open_files, max_file_mb: per-run RLIMIT_NPROC / NOFILE / FSIZE.
      disk_mb: size of the tmpfs holding the working directory (and of /tmp).
      ro_paths: host paths mounted read-only inside; None for system dirs + this Python.
      env: extra environment variables for the sandboxed programs.
      python: interpreter of the workers and of python programs.
      preload: modules imported once in each warm worker (e.g. "numpy").
      loopback: bring up `lo` inside the private network namespace.
      startup_timeout_s: how long a worker may take to start.
      grace_s: how long past a run's deadline the pool waits before it reclaims the worker.
      ray_address, ray_actors: where and how many sandbox actors for backend="ray".
    """

    concurrency: int = 8
    queue_size: int = 256
    backend: str = "local"
    mode: str = "fork"
    namespaces: tuple[str, ...] = NAMESPACES
    allow_weak_isolation: bool = False
    uid_base: int = 2_000_000_000  # above systemd's dynamic and container uid ranges
    uid_count: int = 1024
    max_processes: int = 64
    max_open_files: int = 256
    max_file_mb: int = 64
    disk_mb: int = 256
    ro_paths: tuple[str, ...] | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    python: str = sys.executable
    preload: tuple[str, ...] = ()
    loopback: bool = True
    startup_timeout_s: float = 30.0
    grace_s: float = 2.0
    ray_address: str | None = None
    ray_actors: int = 1

    def __post_init__(self):
        for name in ("concurrency", "queue_size", "max_processes", "max_open_files",
                     "max_file_mb", "disk_mb", "uid_count", "ray_actors"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(f"SandboxConfig.{name} must be a positive int, got {value!r}")
        if self.backend not in ("local", "ray"):
            _fail(f"SandboxConfig.backend must be 'local' or 'ray', got {self.backend!r}")
        if self.mode not in ("fork", "exec"):
            _fail(f"SandboxConfig.mode must be 'fork' or 'exec', got {self.mode!r}")
        unknown = [n for n in self.namespaces if n not in NAMESPACES]
        if isinstance(self.namespaces, str) or unknown:
            _fail(f"SandboxConfig.namespaces must be a subset of {NAMESPACES}, got "
                  f"{self.namespaces!r}")
        object.__setattr__(self, "namespaces", tuple(self.namespaces))
        if not 0 < self.uid_base < 2**31 - self.uid_count:
            _fail(f"SandboxConfig.uid_base must be a positive uid, got {self.uid_base!r}")
        for name in ("startup_timeout_s", "grace_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                _fail(f"SandboxConfig.{name} must be a positive number, got {value!r}")
        if self.ro_paths is not None:
            bad = [p for p in self.ro_paths if not (isinstance(p, str) and p.startswith("/"))]
            if isinstance(self.ro_paths, str) or bad:
                _fail(f"SandboxConfig.ro_paths must be absolute paths, got {self.ro_paths!r}")
            object.__setattr__(self, "ro_paths", tuple(self.ro_paths))
        for key, value in self.env.items():
            if not (isinstance(key, str) and isinstance(value, str)) or "=" in key:
                _fail(f"SandboxConfig.env must map names to str values, got {key!r}")
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "preload", tuple(self.preload))
        if not os.path.isabs(self.python):
            _fail(f"SandboxConfig.python must be an absolute path, got {self.python!r}")

    def required_capabilities(self, trainer_is_root: bool) -> tuple[str, ...]:
        """The mechanisms a worker must report before untrusted code may run."""
        required = [f"{n}_ns" for n in self.namespaces]
        if "mount" in self.namespaces:
            required.append("readonly_root")
        required += ["nproc_limit", "no_new_privs"]
        if trainer_is_root:
            required.append("distinct_uid")
        return tuple(required)
