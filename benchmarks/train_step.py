"""GRPO learner step (reference log-probs + policy update): posttrain vs Tunix, same run.

    python -m benchmarks.train_step [--quick]

Comparison config (models.get_preset("bench"), the peer's): 4 layers, d_model 256, ffn 1024,
4/2 heads, vocab 1024; 16 sequences of 32 prompt + 64 response tokens; GRPO with
kl_coef 0.04 (Tunix's beta), eps 0.2, AdamW. Tunix (google-tunix 0.1.7, GRPOLearner) runs
as a subprocess from its own venv through ../shared/peers/tunix_grpo_cpu.py; its
`get_ref_per_token_logps` and `update_actor` phases are the counterparts of our
`compute_logprobs` and `train_step`. Tunix venv set-up:

    python3 -m venv /tmp/tunix-venv && /tmp/tunix-venv/bin/pip install google-tunix==0.1.7 sentencepiece

Figures are medians of warm steps (the first, compiling, step excluded). MFU is model
FLOPs (6N per trained token + attention, 2N per reference token; no rematerialisation
counted) over this machine's float32 matmul peak, measured here with a large jnp matmul.
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
from posttrain.rl import train_step as ts

PROMPT_LEN, RESPONSE_LEN, NUM_SEQS, GROUP = 32, 64, 16, 4
KL_COEF = 0.04
TUNIX_PYTHON = "/tmp/tunix-venv/bin/python"
TUNIX_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "shared/peers/tunix_grpo_cpu.py"


def matmul_peak_flops(n: int = 2048, reps: int = 5) -> float:
  """Float32 FLOP/s of one large jitted matmul on the default device (median of reps)."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
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


def _median(xs) -> float:
  return float(np.median(xs))


def bench_posttrain(steps: int) -> dict:
  cfg = models.get_preset("bench")
  mesh = models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  optimizer = ts.make_optimizer(1e-5, warmup=0, total_steps=1000)
  algo = presets.algorithm_config("grpo", kl_coef=KL_COEF, eps_low=0.2, eps_high=0.2)
  state = ts.init_train_state(models.create_model(cfg, mesh=mesh), optimizer, mesh=mesh)
  reference = ts.frozen_copy(state.params)
  compute_logprobs = ts.make_compute_logprobs(cfg, mesh=mesh)
  train_step = ts.make_train_step(cfg, algo, optimizer, mesh=mesh)
  ref_s, update_s = [], []
  for i in range(steps + 1):
    batch = grpo_batch(cfg, seed=i)
    start = time.perf_counter()
    batch["ref_logprobs"] = compute_logprobs(reference, batch)["logprobs"]
    jax.block_until_ready(batch["ref_logprobs"])
    mid = time.perf_counter()
    state, metrics = train_step(state, batch)
    jax.block_until_ready((state.params, metrics))
    end = time.perf_counter()
    if i:  # Step 0 compiles.
      ref_s.append(mid - start)
      update_s.append(end - mid)
  return dict(framework="posttrain", ref_logprobs_s=_median(ref_s), update_s=_median(update_s),
              step_s=_median(np.add(ref_s, update_s)), steps=steps,
              kl=float(metrics["kl"]), loss=float(metrics["loss"]))


def bench_tunix(steps: int, python: str, script: pathlib.Path) -> dict | None:
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
  return dict(framework="tunix 0.1.7", ref_logprobs_s=_median(ref_s),
              update_s=_median(update_s), step_s=_median(np.add(ref_s, update_s)),
              steps=len(update_s), kl=float("nan"), loss=float("nan"))


def run(quick: bool, tunix_python: str = TUNIX_PYTHON,
        tunix_script: pathlib.Path = TUNIX_SCRIPT) -> list[dict]:
  """Both sides on the comparison config; one dict per framework (plus the ratio)."""
  cfg = models.get_preset("bench")
  steps = 3 if quick else 8
  peak = matmul_peak_flops(reps=3 if quick else 5)
  seq_len = PROMPT_LEN + RESPONSE_LEN
  tokens = NUM_SEQS * seq_len
  train_flops, forward_flops = model_flops(cfg, tokens, seq_len)
  rows = []
  for result in (bench_posttrain(steps), bench_tunix(steps, tunix_python, tunix_script)):
    if result is None:
      continue
    result.update(
        tokens_per_s=tokens / result["step_s"],
        response_tokens_per_s=NUM_SEQS * RESPONSE_LEN / result["step_s"],
        mfu=(train_flops + forward_flops) / result["step_s"] / peak,
        update_mfu=train_flops / result["update_s"] / peak,
        peak_gflops=peak / 1e9, load_avg=os.getloadavg()[0])
    rows.append(result)
  if len(rows) == 2:
    rows[0]["speedup_vs_tunix"] = rows[1]["step_s"] / rows[0]["step_s"]
    rows[1]["speedup_vs_tunix"] = 1.0
  return rows


def print_table(rows: list[dict]) -> None:
  columns = ("framework", "ref_logprobs_s", "update_s", "step_s", "tokens_per_s",
             "response_tokens_per_s", "mfu", "update_mfu", "speedup_vs_tunix", "steps",
             "load_avg")
  print(f"float32 matmul peak: {rows[0]['peak_gflops']:.1f} GFLOP/s")
  print(" | ".join(f"{c:>14}" for c in columns))
  for row in rows:
    cells = []
    for c in columns:
      value = row.get(c, "")
      cells.append(f"{value:>14.4g}" if isinstance(value, float) else f"{value!s:>14}")
    print(" | ".join(cells))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer steps and matmul reps")
  parser.add_argument("--tunix_python", default=TUNIX_PYTHON)
  parser.add_argument("--tunix_script", default=str(TUNIX_SCRIPT))
  args = parser.parse_args()
  print_table(run(args.quick, args.tunix_python, pathlib.Path(args.tunix_script)))


if __name__ == "__main__":
  main()
