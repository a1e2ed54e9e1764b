"""Smoke test of benchmarks/tasks.py: every table is produced (speed is not asserted)."""

from benchmarks import tasks as bench


def test_quick_run_produces_every_table(capsys):
    rows = bench.run(quick=True)
    cases = {r["case"] for r in rows if r["table"] == "throughput"}
    assert set(bench.NON_CODE) | {"all non-code"} == cases
    assert all(r["per_s"] > 0 for r in rows if r["table"] == "throughput")
    rules = [r["case"].split()[0] for r in rows if r["table"] == "scheduler"]
    assert rules == ["uniform", "learnability", "failure", "bandit"]
    bench.print_table(rows)
    assert "tasks/s" in capsys.readouterr().out
