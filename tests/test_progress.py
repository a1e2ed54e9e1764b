"""The progress line's ETA: time per step since the stage started or resumed, whichever
steps print a line."""

import io

from posttrain import metrics


def test_eta_counts_steps_not_lines(monkeypatch):
  now = [100.0]
  monkeypatch.setattr(metrics.time, "time", lambda: now[0])
  out = io.StringIO()
  progress = metrics.Progress(300, "rm", stream=out, start_step=100)  # resumed at 100
  now[0] += 20.0  # 10 steps of 2 s
  line = progress.line(110, {"loss": 0.5})
  assert line == "[rm] step 110/300 | loss 0.5 | eta  380s"  # 190 steps left at 2 s
  now[0] += 20.0
  assert progress.line(120, {}).endswith("eta  360s")
  assert out.getvalue().count("\n") == 2
