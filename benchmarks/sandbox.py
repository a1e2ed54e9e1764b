"""Sandbox throughput and latency per isolation level, side by side, 8 concurrent requests.

    python -m benchmarks.sandbox [--quick]

Each level runs the same trivial program (`print(1)`) from 8 client threads that each
wait for their run before sending the next, so 8 requests are always in flight. Levels:
  - subprocess, no isolation: `python -c` per run through subprocess (the floor of
    starting a fresh interpreter, not a sandbox);
  - exec, all namespaces: the pool, but each run starts a fresh interpreter
    (SandboxConfig(mode="exec")) inside user+net+pid+mount+ipc+uts namespaces;
  - fork, user+net+mount / user+net+pid+mount / all namespaces (the default): each run
    forks the warm interpreter of a pre-started worker in those namespaces (without a
    pid namespace the worker finds a run's processes by scanning /proc).

Columns: runs/s (wall clock, median over repeats), p50/p95 latency of one run as its
client saw it, CPU ms per run (trainer + workers + the runs, from /proc, so other load
on a shared machine does not count), the rate that CPU cost allows on 2 cores, and the
ratio of runs/s to the 500/s goal.
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

from posttrain.sandbox import ExecRequest, Sandbox, SandboxConfig

GOAL_PER_S = 500
CLIENTS = 8
CODE = "print(1)"
_TICKS = os.sysconf("SC_CLK_TCK")

LEVELS = [
    ("subprocess, no isolation", None),
    ("exec, all namespaces", SandboxConfig(concurrency=CLIENTS, mode="exec")),
    # The mount namespace is in every fork level: it is what shows a Python installed
    # under a private home (e.g. /root/.pyenv) to the sandbox's unprivileged uid.
    ("fork, user+net+mount", SandboxConfig(concurrency=CLIENTS,
                                           namespaces=("user", "net", "mount"))),
    ("fork, user+net+pid+mount", SandboxConfig(concurrency=CLIENTS,
                                               namespaces=("user", "net", "pid", "mount"))),
    ("fork, all namespaces (default)", SandboxConfig(concurrency=CLIENTS)),
]


def _cpu_of(pid: int) -> float:
    """utime + stime of a process plus those of its reaped children, in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / _TICKS


def _own_cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def _drive(run_one, runs: int) -> tuple[float, list[float], list[str]]:
    """Runs `run_one` `runs` times from CLIENTS threads; (seconds, latencies, failures).

    `run_one` returns None on success, else what went wrong.
    """
    latencies, failures, lock = [], [], threading.Lock()
    remaining = [runs]

    def client():
        while True:
            with lock:
                if remaining[0] == 0:
                    return
                remaining[0] -= 1
            start = time.perf_counter()
            failure = run_one()
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                if failure is not None:
                    failures.append(failure)
    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, latencies, failures


def _measure(name: str, config: SandboxConfig | None, runs: int, repeats: int) -> dict:
    rates, latencies, cpu_per_run, failures = [], [], [], []
    if config is None:
        def run_one():
            out = subprocess.run([sys.executable, "-c", CODE], capture_output=True)
            return None if out.stdout == b"1\n" else f"exit {out.returncode}"

        def cpu():
            return _own_cpu()
        sb = None
    else:
        sb = Sandbox(config)
        request = ExecRequest(code=CODE)

        def run_one():
            res = sb.run(request)
            return None if res.stdout == "1\n" else f"{res.status} {res.detail}".strip()

        def cpu():
            return _own_cpu() + sum(_cpu_of(pid) for pid in sb._backend.worker_pids())
        _drive(run_one, CLIENTS * 4)  # warm-up
    try:
        for _ in range(repeats):
            cpu0 = cpu()
            seconds, lat, failed = _drive(run_one, runs)
            cpu_per_run.append((cpu() - cpu0) / runs)
            rates.append(runs / seconds)
            latencies += lat
            failures += failed
    finally:
        if sb is not None:
            sb.close()
    latencies.sort()
    cpu_ms = statistics.median(cpu_per_run) * 1e3
    rate = statistics.median(rates)
    return {
        "case": name, "runs_per_s": rate,
        "p50_ms": latencies[len(latencies) // 2] * 1e3,
        "p95_ms": latencies[int(len(latencies) * 0.95)] * 1e3,
        "cpu_ms_per_run": cpu_ms, "two_core_bound_per_s": 2e3 / cpu_ms,
        "ratio": rate / GOAL_PER_S, "failures": len(failures), "runs": runs * repeats,
        "failure_kinds": sorted(set(failures)),
    }


def run(quick: bool) -> list[dict]:
    runs, repeats = (200, 1) if quick else (1200, 3)
    rows = []
    for name, config in LEVELS:
        # A fresh interpreter per run is ~40 ms of CPU: fewer runs keep the total short.
        level_runs = runs // 8 if config is None or config.mode == "exec" else runs
        rows.append(_measure(name, config, level_runs, repeats))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"sandbox: trivial python program, {CLIENTS} concurrent requests, "
          f"{os.cpu_count()} CPUs (ratio = runs/s / {GOAL_PER_S} goal)")
    print(f"{'level':>32} | {'runs/s':>7} | {'p50 ms':>7} | {'p95 ms':>7} | "
          f"{'CPU ms/run':>10} | {'2-core bound/s':>14} | {'ratio':>5} | failed")
    for r in rows:
        print(f"{r['case']:>32} | {r['runs_per_s']:>7.0f} | {r['p50_ms']:>7.1f} | "
              f"{r['p95_ms']:>7.1f} | {r['cpu_ms_per_run']:>10.2f} | "
              f"{r['two_core_bound_per_s']:>14.0f} | {r['ratio']:>5.2f} | "
              f"{r['failures']}/{r['runs']} {'; '.join(r['failure_kinds'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs, one repeat")
    args = parser.parse_args()
    print_table(run(args.quick))


if __name__ == "__main__":
    main()
