"""benchmarks.run on fake benchmark modules: tables, failures, missing modules, the page."""

import math
import sys
import types

import pytest

from benchmarks import run as runner


def _module(name, run=None, doc="Fake benchmark: side by side.\n\nMore text."):
  mod = types.ModuleType(f"benchmarks.{name}")
  mod.__doc__ = doc
  if run is not None:
    mod.run = run
  return mod


@pytest.fixture
def fakes(monkeypatch):
  calls = []

  def good(quick):
    calls.append(("good", quick))
    return [{"case": "a", "ours_s": 0.5, "theirs_s": 1.25, "speedup": 2.5},
            {"case": "b|c", "ours_s": 12345.6, "note": "extra column", "ok": True}]

  def broken(quick):
    calls.append(("broken", quick))
    raise RuntimeError("tunix run failed (exit 1):\n  Traceback ...")

  monkeypatch.setitem(sys.modules, "benchmarks.fake_good", _module("fake_good", good))
  monkeypatch.setitem(sys.modules, "benchmarks.fake_broken", _module("fake_broken", broken))
  monkeypatch.setitem(sys.modules, "benchmarks.fake_norun", _module("fake_norun"))
  monkeypatch.setitem(sys.modules, "benchmarks.fake_bad_rows",
                      _module("fake_bad_rows", lambda quick: {"not": "a list"}))
  return calls


def test_run_all_tables_failures_and_missing_modules(fakes):
  tunix = []
  out = runner.run_all(["fake_good", "fake_broken", "fake_missing_xyz", "fake_norun",
                        "fake_bad_rows"], quick=True, peak_fn=lambda: 123.456,
                       tunix_fn=lambda: tunix.append(1))
  assert fakes == [("good", True), ("broken", True)]
  assert tunix == []  # No Tunix benchmark selected: no venv set-up.
  status = {r["name"]: (r["status"], r["error"]) for r in out["results"]}
  assert status["fake_good"] == ("ok", None)
  assert status["fake_broken"][0] == "failed" and "tunix run failed" in status["fake_broken"][1]
  assert "\n" not in status["fake_broken"][1]
  assert status["fake_missing_xyz"] == ("missing",
                                        "benchmarks/fake_missing_xyz.py does not exist yet")
  assert status["fake_norun"] == ("failed", "the module has no run(quick) function")
  assert "not a list of dicts" in status["fake_bad_rows"][1]
  assert out["machine"]["matmul_gflops"] == 123.5 and out["machine"]["cores"] >= 1

  page = runner.render(out)
  assert "python -m benchmarks.run --quick --only=fake_good,fake_broken," in page
  assert "| case | ours_s | theirs_s | speedup | note | ok |" in page
  assert "| a | 0.5 | 1.25 | 2.5 |  |  |" in page
  assert "| b\\|c | 12,346 |  |  | extra column | True |" in page
  assert "Reproduce: `python -m benchmarks.fake_good --quick`" in page
  assert "Fake benchmark: side by side." in page and "More text" not in page
  assert "**failed**: RuntimeError: tunix run failed (exit 1): Traceback ..." in page
  assert "**missing**: benchmarks/fake_missing_xyz.py does not exist yet" in page
  assert "| 123.5 |" in page  # Measured matmul peak in the machine table.


def test_tunix_venv_is_prepared_before_a_tunix_benchmark(monkeypatch):
  order = []
  monkeypatch.setitem(sys.modules, "benchmarks.sampler",
                      _module("sampler", lambda quick: order.append("run") or [{"x": 1}]))
  monkeypatch.setitem(sys.modules, "benchmarks.train_step",
                      _module("train_step", lambda quick: order.append("run2") or []))

  def tunix():
    order.append("venv")
    raise OSError("no network")

  out = runner.run_all(["sampler", "train_step"], quick=False, peak_fn=lambda: 1.0,
                       tunix_fn=tunix)
  assert order == ["venv", "run", "run2"]
  assert [r["status"] for r in out["results"]] == ["ok", "ok"]
  assert "(no rows)" in runner.render(out)


def test_main_writes_the_page_and_rejects_unknown_names(fakes, monkeypatch, tmp_path, capsys):
  monkeypatch.setattr(runner, "discover", lambda: ["fake_good", "fake_broken"])
  monkeypatch.setattr(runner, "matmul_peak_gflops", lambda: 1.0)
  output = tmp_path / "BENCHMARKS.md"
  code = runner.main(["--only=fake_good", f"--output={output}"])
  assert code == 0 and "| a | 0.5 |" in output.read_text()
  assert runner.main(["--only=fake_good,fake_broken", f"--output={output}"]) == 1
  assert "**failed**" in output.read_text()
  with pytest.raises(SystemExit):
    runner.main(["--only=nope", f"--output={output}"])
  assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_rewriting_the_page_keeps_the_accelerator_figures(fakes, monkeypatch, tmp_path):
  """A CPU re-run cannot measure the GPU tables, so it carries them over verbatim."""
  monkeypatch.setattr(runner, "discover", lambda: ["fake_good"])
  monkeypatch.setattr(runner, "matmul_peak_gflops", lambda: 1.0)
  output = tmp_path / "BENCHMARKS.md"
  block = f"{runner.KEPT_BEGIN}\n## GPU\n\n| flash | 331 TFLOP/s |\n{runner.KEPT_END}"
  output.write_text(f"# Old page\n\nstale table\n\n{block}\n")
  assert runner.main(["--only=fake_good", f"--output={output}"]) == 0
  text = output.read_text()
  assert "stale table" not in text and "| a | 0.5 |" in text
  assert text.count(block) == 1
  assert runner.main(["--only=fake_good", f"--output={output}"]) == 0  # idempotent
  assert output.read_text().count(block) == 1


def test_discover_lists_known_benchmarks_first_then_the_rest():
  names = runner.discover()
  assert names[:len(runner.KNOWN)] == list(runner.KNOWN)
  assert "run" not in names and "__init__" not in names
  assert set(names) >= {"sampler", "tasks"}  # Present in this checkout.


def test_matmul_peak_is_a_positive_rate():
  assert math.isfinite(g := runner.matmul_peak_gflops(n=128, reps=2)) and g > 0


def test_cells():
  assert runner._cell(float("nan")) == "nan" and runner._cell(None) == ""
  assert runner._cell(0.000123456) == "0.0001235" and runner._cell(3) == "3"
