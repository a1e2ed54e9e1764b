"""GRPO learner step (reference log-probs + policy update): posttrain vs Tunix, same run.

    python -m benchmarks.train_step [--quick]

Comparison config (models.get_preset("bench"), the peer's): 4 layers, d_model 256, ffn 1024,
4/2 heads, vocab 1024; 16 sequences of 32 prompt + 64 response tokens; GRPO with
kl_coef 0.04 (Tunix's beta), eps 0.2, AdamW. Tunix (google-tunix 0.1.7, GRPOLearner) runs
as a subprocess from its own venv through ../shared/peers/tunix_grpo_cpu.py; its
`get_ref_per_token_logps` and `update_actor` phases are the counterparts of our
`compute_logprobs` and `train_step`. Our headline row runs both in one program
(`make_train_step(..., reference_in_step=True)`, the trainer's choice for a single update
per batch); "posttrain 2 programs" runs them as two calls. Tunix venv set-up:

    python3 -m venv /tmp/tunix-venv
    /tmp/tunix-venv/bin/pip install google-tunix==0.1.7 sentencepiece

Figures are medians of warm steps (the first, compiling, step excluded). MFU is model
FLOPs (6N per trained token + attention, 2N per reference token; no rematerialisation
counted) over this machine's float32 matmul peak: the best of a large jnp matmul timed before
and after the comparison. Our side is timed before and after Tunix's and the samples pooled.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from posttrain import models
from posttrain.rl import packing, presets
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts

PROMPT_LEN, RESPONSE_LEN, NUM_SEQS, GROUP = 32, 64, 16, 4
KL_COEF = 0.04
TUNIX_PYTHON = "/tmp/tunix-venv/bin/python"
TUNIX_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "shared/peers/tunix_grpo_cpu.py"


def matmul_peak_flops(n: int = 2048, reps: int = 5, dtype=jnp.float32) -> float:
  """FLOP/s of one large jitted matmul on the default device (median of reps)."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / float(np.median(times))


def model_flops(cfg: models.ModelConfig, tokens: int, seq_len: int) -> tuple[float, float]:
  """(training FLOPs, forward FLOPs) for `tokens` tokens in sequences of `seq_len`."""
  matmul_params = cfg.num_params - cfg.vocab_size * cfg.d_model * (
      1 if cfg.tie_embeddings else 2) + cfg.vocab_size * cfg.d_model  # Embedding gather: free.
  attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len  # Per token, fwd.
  forward = tokens * (2 * matmul_params + attention)
  return 3 * forward, forward


def grpo_batch(cfg: models.ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """16 rows of 32 prompt + 64 response tokens with group-normalised advantages."""
  rng = np.random.default_rng(seed)
  rewards = rng.random((NUM_SEQS // GROUP, GROUP))
  advantages = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1,
                                                                          keepdims=True) + 1e-6)
  trajectories = [dict(prompt_tokens=rng.integers(1, cfg.vocab_size, PROMPT_LEN),
                       response_tokens=rng.integers(1, cfg.vocab_size, RESPONSE_LEN),
                       behaviour_logprobs=-rng.uniform(1, 8, RESPONSE_LEN),
                       advantages=float(a)) for a in advantages.reshape(-1)]
  rows = packing.pack_trajectories(trajectories, PROMPT_LEN + RESPONSE_LEN)
  return packing.split_microbatches(rows, NUM_SEQS * (PROMPT_LEN + RESPONSE_LEN))


def median(xs) -> float:
  return float(np.median(xs))


def posttrain_runner(reference_in_step: bool = False):
  """Builds the GRPO learner once; returns `measure(steps) -> (ref_s list, update_s list)`.

  With `reference_in_step` the reference pass runs inside the update program (what the
  trainer does for a single update per batch); its time is then part of the update and
  ref_s is 0.
  """
  cfg = models.get_preset("bench")
  mesh = models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  optimizer = state_lib.make_optimizer(1e-5, warmup=0, total_steps=1000)
  algo = presets.algorithm_config("grpo", kl_coef=KL_COEF, eps_low=0.2, eps_high=0.2)
  model = models.create_model(cfg, mesh=mesh)
  box = {"state": state_lib.init_train_state(model, optimizer, mesh=mesh)}
  reference = state_lib.frozen_copy(box["state"].params)
  compute_logprobs = ts.make_compute_logprobs(cfg, mesh=mesh)
  train_step = ts.make_train_step(cfg, algo, optimizer, mesh=mesh,
                                  reference_in_step=reference_in_step)
  seeds = iter(range(1_000_000))

  def one_step():
    batch = grpo_batch(cfg, seed=next(seeds))
    start = time.perf_counter()
    if reference_in_step:
      box["state"], metrics = train_step(box["state"], batch, reference)
      jax.block_until_ready((box["state"].params, metrics))
      return 0.0, time.perf_counter() - start
    batch["ref_logprobs"] = compute_logprobs(reference, batch)["logprobs"]
    jax.block_until_ready(batch["ref_logprobs"])
    mid = time.perf_counter()
    box["state"], metrics = train_step(box["state"], batch)
    jax.block_until_ready((box["state"].params, metrics))
    return mid - start, time.perf_counter() - mid

  one_step()  # Compiles.

  def measure(steps: int):
    times = [one_step() for _ in range(steps)]
    return [t[0] for t in times], [t[1] for t in times]

  return measure


def bench_tunix(steps: int, python: str, script: pathlib.Path):
  """Tunix's warm (ref_s list, update_s list) from the peer script, or None."""
  if not (os.path.exists(python) and script.exists()):
    print(f"Tunix side skipped: {python} or {script} is missing (see the module docstring)")
    return None
  out = pathlib.Path(f"/tmp/tunix_grpo_{os.getpid()}.json")
  cmd = [python, str(script), "--steps", str(steps + 1), "--beta", str(KL_COEF),
         "--group", str(GROUP), "--batch", str(NUM_SEQS // GROUP),
         "--prompt_len", str(PROMPT_LEN), "--gen_len", str(RESPONSE_LEN),
         "--json_out", str(out)]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
  if proc.returncode or not out.exists():
    print(f"Tunix side failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return None
  result = json.loads(out.read_text())
  out.unlink()
  phases = result["phase_s"]
  ref_s = phases["get_ref_per_token_logps"][1:]
  update_s = phases["update_actor"][1:]
  return ref_s, update_s


def summary(framework: str, ref_s, update_s) -> dict:
  return dict(framework=framework, ref_logprobs_s=median(ref_s), update_s=median(update_s),
              step_s=median(np.add(ref_s, update_s)), steps=len(update_s))


def run(quick: bool, tunix_python: str = TUNIX_PYTHON,
        tunix_script: pathlib.Path = TUNIX_SCRIPT) -> list[dict]:
  """Both sides on the comparison config; one dict per framework.

  Ours is measured before and after Tunix's run and the samples pooled, so a load change
  on a shared machine during the run does not favour either side.
  """
  cfg = models.get_preset("bench")
  steps = 3 if quick else 8
  peak = matmul_peak_flops(reps=3 if quick else 5)
  measure = posttrain_runner(reference_in_step=True)
  measure_two = posttrain_runner(reference_in_step=False)
  fused_a, two_a = measure(-(-steps // 2)), measure_two(-(-steps // 2))
  tunix = bench_tunix(steps, tunix_python, tunix_script)
  fused_b, two_b = measure(steps // 2), measure_two(steps // 2)
  peak = max(peak, matmul_peak_flops(reps=3 if quick else 5))
  results = [summary("posttrain", *(a + b for a, b in zip(fused_a, fused_b))),
             summary("posttrain 2 programs", *(a + b for a, b in zip(two_a, two_b)))]
  if tunix is not None:
    results.append(summary("tunix 0.1.7", *tunix))
  seq_len = PROMPT_LEN + RESPONSE_LEN
  tokens = NUM_SEQS * seq_len
  train_flops, forward_flops = model_flops(cfg, tokens, seq_len)
  for result in results:
    result.update(
        tokens_per_s=tokens / result["step_s"],
        response_tokens_per_s=NUM_SEQS * RESPONSE_LEN / result["step_s"],
        mfu=(train_flops + forward_flops) / result["step_s"] / peak,
        update_mfu=train_flops / result["update_s"] / peak,
        peak_gflops=peak / 1e9, load_avg=os.getloadavg()[0])
  if tunix is not None:
    for result in results:
      result["speedup_vs_tunix"] = results[-1]["step_s"] / result["step_s"]
  return results


COLUMNS = ("framework", "ref_logprobs_s", "update_s", "step_s", "tokens_per_s",
           "response_tokens_per_s", "mfu", "update_mfu", "speedup_vs_tunix", "steps",
           "load_avg")


def print_table(rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> None:
  print(f"float32 matmul peak: {rows[0]['peak_gflops']:.1f} GFLOP/s")
  print(" | ".join(f"{c:>14}" for c in columns))
  for row in rows:
    cells = []
    for c in columns:
      value = row.get(c, "")
      cells.append(f"{value:>14.4g}" if isinstance(value, float) else f"{value!s:>14}")
    print(" | ".join(cells))


def cli(run_fn, description: str, tunix_script: pathlib.Path,
        columns: tuple[str, ...] = COLUMNS) -> None:
  """The command line of a benchmark against a Tunix peer script: --quick, the venv's
  python and the script; prints `run_fn(quick, python, script)`'s table."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true", help="fewer steps and matmul reps")
  parser.add_argument("--tunix_python", default=TUNIX_PYTHON)
  parser.add_argument("--tunix_script", default=str(tunix_script))
  args = parser.parse_args()
  print_table(run_fn(args.quick, args.tunix_python, pathlib.Path(args.tunix_script)), columns)


def main() -> None:
  cli(run, __doc__.splitlines()[0], TUNIX_SCRIPT)


if __name__ == "__main__":
  main()
