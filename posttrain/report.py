"""Evaluation reports on disk: report.json, timing.json, report.md and PNG plots.

    report.write(out_dir, report, timing, workdir)

Plots use matplotlib's Agg backend at fixed pixel sizes (`FAMILY_PLOT_PX`,
`CURVES_PLOT_PX`); without matplotlib (`pip install 'posttrain[plots]'`) they are skipped
with a warning and report.md says so.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.metrics import read_metrics

log = logging.getLogger("posttrain")

FAMILY_PLOT = "pass_rate_by_family.png"
CURVES_PLOT = "reward_curves.png"
FAMILY_PLOT_PX = (800, 450)
CURVES_PLOT_PX = (1000, 550)
_DPI = 100


def write(out_dir: str, report: Mapping[str, Any], timing: Mapping[str, Any],
          workdir: str | None = None) -> dict[str, str]:
  """Writes report.json, timing.json, the plots and report.md; returns their paths."""
  from posttrain.evaluation import dumps

  os.makedirs(out_dir, exist_ok=True)
  paths = {"report": os.path.join(out_dir, "report.json"),
           "timing": os.path.join(out_dir, "timing.json"),
           "markdown": os.path.join(out_dir, "report.md")}
  _write_text(paths["report"], dumps(report))
  _write_text(paths["timing"], dumps(_rounded(timing)))
  plots = {}
  try:
    plot_family_pass_rates(report, os.path.join(out_dir, FAMILY_PLOT))
    plots["family"] = FAMILY_PLOT
    rows = read_metrics(workdir) if workdir else []
    if plot_reward_curves(rows, os.path.join(out_dir, CURVES_PLOT)):
      plots["curves"] = CURVES_PLOT
  except ImportError as e:
    log.warning("no plots: %s (pip install 'posttrain[plots]')", e)
  _write_text(paths["markdown"], markdown(report, timing, plots))
  paths.update({k: os.path.join(out_dir, v) for k, v in plots.items()})
  return paths


def _write_text(path: str, text: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as fh:
    fh.write(text)
  os.replace(tmp, path)


def _rounded(x):
  if isinstance(x, float):
    return round(x, 4)
  if isinstance(x, Mapping):
    return {k: _rounded(v) for k, v in x.items()}
  return x


# ----------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------


def _cell(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, bool):
    return "yes" if v else ""
  if isinstance(v, float):
    return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
  return str(v).replace("|", "\\|")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub markdown table."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _pass_header(report) -> tuple[list[str], list[str], list[str]]:
  """Column names, the k of pass@k, and the k of maj@k (none when no task was voted on)."""
  ks = [str(k) for k in report["settings"]["k"]]
  maj_ks = ks if "maj_at_k" in report["overall"] else []
  return (["tasks", "greedy passed", "greedy pass@1"] + [f"pass@{k}" for k in ks]
          + [f"maj@{k}" for k in maj_ks], ks, maj_ks)


def _pass_cells(stats, ks, maj_ks) -> list:
  at_k, maj = stats.get("pass_at_k", {}), stats.get("maj_at_k", {})
  return [stats["tasks"], stats["greedy_passed"], stats["greedy_pass_rate"]] + [
      at_k.get(k) for k in ks] + [maj.get(k) for k in maj_ks]


def markdown(report: Mapping[str, Any], timing: Mapping[str, Any],
             plots: Mapping[str, str] | None = None) -> str:
  """report.md: settings, pass rates by stratum and domain, process, cost, regressions."""
  s = report["settings"]
  head, ks, maj_ks = _pass_header(report)
  o = report["overall"]
  out = [f"# Evaluation of checkpoint {report['step']}", "",
         f"{len(s['domains'])} domains x {s['seeds_per_domain']} held-out seeds "
         f"({s['heldout_seeds'][0]}..{s['heldout_seeds'][1]}, odd: disjoint from the even "
         f"training seeds); greedy pass@1"
         + (f", pass@k from {s['samples']} samples at temperature {s['temperature']}"
            if s["samples"] else "")
         + (", maj@k the expected majority-vote accuracy of k of them" if maj_ks else "")
         + (f" (over {o['maj_tasks']} of {o['tasks']} tasks: code domains give no answer to "
            "vote on)" if maj_ks and o["maj_tasks"] < o["tasks"] else "")
         + f"; max {s['max_new_tokens']} new tokens, {s['max_turns']} turn(s); seed "
           f"{s['seed']}.", "", "## Overall", "",
         table(head + ["mean reward"],
               [_pass_cells(o, ks, maj_ks) + [o["greedy_reward"]]])]
  titles = {"family": "Family", "level": "Level", "prompt_tokens": "Prompt length (tokens)",
            "tool_calls": "Tool calls (greedy)",
            "reasoning_tokens": "Reasoning length (tokens, greedy)"}
  for name, buckets in report["strata"].items():
    out += ["", f"## By {titles.get(name, name).lower()}", "",
            table([titles.get(name, name)] + head,
                  [[b] + _pass_cells(v, ks, maj_ks) for b, v in buckets.items()])]
  doms = report["domains"]
  out += ["", "## Domains", "",
          table(["domain", "level"] + head + ["tool calls/task", "tool-call validity",
                                              "retries/task", "turns/task"],
                [[d, v["level"]] + _pass_cells(v, ks, maj_ks)
                 + [v["process"]["tool_calls_per_task"], v["process"]["tool_call_validity"],
                    v["process"]["retries_per_task"], v["process"]["turns_per_task"]]
                 for d, v in doms.items()])]
  if any(v["process"].get("reasoning_tokens_per_task") for v in doms.values()):
    out += ["", "## Reasoning (greedy)", "",
            table(["domain", "reasoning tokens/task", "never ended"],
                  [[d, v["process"]["reasoning_tokens_per_task"],
                    v["process"]["unclosed_reasoning_rate"]] for d, v in doms.items()])]
  from posttrain.evaluation import INTERMEDIATE_COMPONENTS
  comps = [c for c in INTERMEDIATE_COMPONENTS
           if any(c in v["process"]["components"] for v in doms.values())]
  if comps:
    out += ["", "## Intermediate steps (mean reward components, greedy)", "",
            table(["domain"] + comps,
                  [[d] + [v["process"]["components"].get(c) for c in comps]
                   for d, v in doms.items()])]
  verdicts = sorted({k for v in doms.values() for k in v["process"]["verdicts"]})
  out += ["", "## Verdicts (greedy)", "",
          table(["domain"] + verdicts, [[d] + [v["process"]["verdicts"].get(k, 0)
                                               for k in verdicts] for d, v in doms.items()])]
  statuses = sorted({k for v in doms.values() for k in v["process"]["sandbox_statuses"]})
  if statuses:
    rows = [[d] + [v["process"]["sandbox_statuses"].get(k, 0) for k in statuses]
            for d, v in doms.items() if v["process"]["sandbox_statuses"]]
    out += ["", "## Sandbox statuses (all runs)", "", table(["domain"] + statuses, rows)]
  sandbox = timing.get("sandbox", {})
  out += ["", "## Cost", "",
          table(["domain", "generated tokens/task", "sampled tokens/sample",
                 "sandbox runs/task", "sandbox s/task"],
                [[d, v["cost"]["generated_tokens_per_task"],
                  v["cost"].get("sampled_generated_tokens_per_sample"),
                  v["cost"]["sandbox_runs_per_task"],
                  sandbox.get(d, {}).get("wall_s_per_task")] for d, v in doms.items()]),
          "", "Wall time (s, timing.json; not part of report.json): " + ", ".join(
              f"{k[:-2]} {v:.1f}" for k, v in timing.items() if k.endswith("_s")) + "."]
  reg = report.get("regression")
  if reg:
    pct = f"{100 * reg['confidence']:g}%"
    rows = [["**all**", reg["overall"]["tasks"], reg["overall"]["baseline_pass_rate"],
             reg["overall"]["pass_rate"], reg["overall"]["difference"],
             f"[{reg['overall']['ci_low']:+.3f}, {reg['overall']['ci_high']:+.3f}]",
             _flag(reg["overall"])]]
    rows += [[d, v["tasks"], v["baseline_pass_rate"], v["pass_rate"], v["difference"],
              f"[{v['ci_low']:+.3f}, {v['ci_high']:+.3f}]", _flag(v)]
             for d, v in reg["domains"].items()]
    out += ["", f"## Regression vs checkpoint {reg['baseline_step']}", "",
            (f"{reg['method']}; {pct} intervals for (this - baseline), each domain on its "
             f"own. Regressed: {', '.join(reg['regressed']) or 'none'}."), "",
            table(["domain", "tasks", f"step {reg['baseline_step']}", f"step {report['step']}",
                   "difference", f"{pct} CI", "flag"], rows)]
  plots = plots or {}
  out += ["", "## Plots", ""]
  if not plots:
    out.append("Not drawn: matplotlib is not installed (pip install 'posttrain[plots]').")
  if "family" in plots:
    out.append(f"![greedy pass rate by family]({plots['family']})")
  if "curves" in plots:
    out.append(f"![training reward per domain]({plots['curves']})")
  elif plots:
    out.append("No reward/<domain> rows in metrics.jsonl: no reward curves.")
  return "\n".join(out) + "\n"


def _flag(v) -> str:
  return "REGRESSED" if v["regressed"] else ("improved" if v["improved"] else "")


# ----------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------


def _pyplot():
  import matplotlib
  matplotlib.use("Agg", force=True)
  from matplotlib import pyplot as plt
  return plt


def _figure(plt, px):
  return plt.figure(figsize=(px[0] / _DPI, px[1] / _DPI), dpi=_DPI)


def plot_family_pass_rates(report: Mapping[str, Any], path: str) -> None:
  """Bars per family: greedy pass@1, and when sampled pass@k for each k and maj@n (the
  vote of all n samples; maj@k for smaller k would crowd the bars)."""
  plt = _pyplot()
  fams = report["strata"]["family"]
  names = list(fams)
  series = [("greedy pass@1", [fams[f]["greedy_pass_rate"] or 0.0 for f in names])]
  for k in report["settings"]["k"]:
    series.append((f"pass@{k}", [fams[f].get("pass_at_k", {}).get(str(k)) or 0.0
                                 for f in names]))
  n = str(report["settings"]["samples"])
  if n in report["overall"].get("maj_at_k", {}):
    # NaN, no bar, for families without a vote (code), rather than a misleading 0.
    series.append((f"maj@{n}", [fams[f].get("maj_at_k", {}).get(n, math.nan) for f in names]))
  fig = _figure(plt, FAMILY_PLOT_PX)
  try:
    ax = fig.add_axes((0.08, 0.2, 0.9, 0.7))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
      ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(names))], values,
             width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("pass rate (held-out seeds)")
    ax.set_title(f"Checkpoint {report['step']}: pass rate by family")
    ax.legend(loc="upper right", fontsize="small")
    fig.savefig(path, dpi=_DPI)
  finally:
    plt.close(fig)


def reward_series(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[list, list]]:
  """{name: (steps, values)} of the reward/<domain> (and reward/mean) metrics."""
  series: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
  for row in rows:
    for k, v in row.items():
      if k.startswith("reward/") and isinstance(v, (int, float)) and "step" in row:
        steps, values = series[k[len("reward/"):]]
        steps.append(row["step"])
        values.append(float(v))
  return dict(series)


def plot_reward_curves(rows: Sequence[Mapping[str, Any]], path: str,
                       legend_limit: int = 12) -> bool:
  """Training reward per domain over steps (one colour per family); False if no data."""
  series = reward_series(rows)
  series.pop("mean", None)
  if not series:
    return False
  plt = _pyplot()
  from matplotlib import ticker
  families = sorted({name.split("/", 1)[0] for name in series})
  colours = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
  fig = _figure(plt, CURVES_PLOT_PX)
  try:
    ax = fig.add_axes((0.09, 0.1, 0.64, 0.82))
    labelled = set()
    for name in sorted(series):
      steps, values = series[name]
      fam = name.split("/", 1)[0]
      if len(series) <= legend_limit:
        label = name
      else:  # Too many domains to name: one legend entry per family.
        label = fam if fam not in labelled else None
        labelled.add(fam)
      ax.plot(steps, values, color=colours[fam], lw=1, alpha=0.8, label=label,
              marker="." if len(steps) < 20 else None)
    mean = reward_series(rows).get("mean")
    if mean:
      ax.plot(*mean, color="black", lw=2, label="mean")
    values = [v for _, vs in series.values() for v in vs]
    if 0.0 <= min(values) and max(values) <= 1.0:
      ax.set_ylim(-0.02, 1.02)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("training reward")
    ax.set_title("Training reward per domain (metrics.jsonl)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small")
    fig.savefig(path, dpi=_DPI)
  finally:
    plt.close(fig)
  return True
