"""Metric sinks: JSONL and TensorBoard under the workdir, plus one progress line per step.

Values may be device scalars: they are fetched in one `jax.device_get` when written, at the
logging cadence, never inside the step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np

log = logging.getLogger("posttrain")


def _scalar(v: Any) -> float | None:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f


class MetricsWriter:
  """Appends {"step": n, **metrics} to DIR/metrics.jsonl and TensorBoard events to DIR/tb."""

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      if tensorboard:
        try:
          from tensorboardX import SummaryWriter
          self._tb = SummaryWriter(os.path.join(workdir, "tb"))
        except ImportError:  # Optional: JSONL is the record of truth.
          log.warning("tensorboardX is not installed; writing metrics.jsonl only")

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    host = jax.device_get(dict(metrics))
    row = {k: _scalar(v) for k, v in host.items()}
    row = {k: v for k, v in row.items() if v is not None}
    if self.enabled:
      with open(self.path, "a") as fh:
        fh.write(json.dumps({"step": int(step), **{k: (v if math.isfinite(v) else str(v))
                                                   for k, v in row.items()}}) + "\n")
      if self._tb is not None:
        for k, v in row.items():
          self._tb.add_scalar(k, v, int(step))
        self._tb.flush()
    return row

  def close(self):
    if self._tb is not None:
      self._tb.close()


class Progress:
  """One line per step: step, reward, pass rate, tokens/s, ETA."""

  def __init__(self, total: int, stage: str, stream=None, start_step: int = 0):
    """`start_step`: the step the stage starts (or resumes) from; the ETA is the time per
    step since then, whichever steps print a line."""
    self.total, self.stage, self.start = total, stage, time.time()
    self.stream = stream or sys.stdout
    self.start_step = start_step

  def line(self, step: int, fields: Mapping[str, float]) -> str:
    elapsed = time.time() - self.start
    eta = elapsed / max(step - self.start_step, 1) * max(self.total - step, 0)
    parts = [f"[{self.stage}] step {step}/{self.total}"]
    parts += [f"{k} {v:.3g}" for k, v in fields.items()]
    parts.append(f"eta {eta:4.0f}s")
    text = " | ".join(parts)
    print(text, file=self.stream, flush=True)
    return text


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """All rows of DIR/metrics.jsonl (a torn last line, from a kill, is ignored)."""
  path = os.path.join(workdir, "metrics.jsonl")
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path) as fh:
    for line in fh:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows
