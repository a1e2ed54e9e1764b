"""DPO train step (reference log-probs + policy update): posttrain vs Tunix, same run.

    python -m benchmarks.preference [--quick]

Comparison config: models.get_preset("bench") (4 layers, d_model 256, ffn 1024, 4/2 heads
of 64, vocab 1024, tied embeddings; 4.2M parameters) on both sides; 8 random pairs of a
32-token prompt and 64-token chosen and rejected responses (16 sequences, 1,536 tokens
per step); sigmoid DPO with beta 0.1; AdamW at 1e-5. Tunix (google-tunix 0.1.7,
`DPOTrainer` with a reference model) runs as a subprocess from its own venv through
peers/tunix_dpo_cpu.py and draws the same token ids; a step there is one iteration of its
training loop (input preparation with the reference forward, then the update). Our
headline row computes the reference log-probs inside the update program
(`make_preference_step(..., reference_in_step=True)`); "posttrain 2 programs" calls
`make_compute_logprobs` then the step. Tunix venv set-up:

    python3 -m venv /tmp/tunix-venv
    /tmp/tunix-venv/bin/pip install google-tunix==0.1.7 sentencepiece

Figures are medians (and min-max) of warm steps. Our side is timed before and after
Tunix's and the samples pooled; `pack_pairs` runs on the host before each timed step and
is reported apart (pack_ms). MFU is model FLOPs (6N per token for the update, 2N for the
reference, attention included) over the float32 matmul peak measured in the same run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time

import jax
import numpy as np

from benchmarks import train_step as grpo_bench
from posttrain import models
from posttrain.rl import preference
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts

PAIRS, PROMPT_LEN, RESPONSE_LEN = 8, 32, 64
BETA = 0.1
SEQ_LEN = PROMPT_LEN + RESPONSE_LEN
TUNIX_PYTHON = grpo_bench.TUNIX_PYTHON
TUNIX_SCRIPT = pathlib.Path(__file__).resolve().parent / "peers" / "tunix_dpo_cpu.py"


def random_pairs(seed: int, vocab_size: int) -> list[dict[str, np.ndarray]]:
  """PAIRS random pairs; the same draws as the peer's `random_pairs(seed, ...)`."""
  rng = np.random.default_rng(seed)
  prompt, chosen, rejected = (rng.integers(1, vocab_size, (PAIRS, n)).astype(np.int32)
                              for n in (PROMPT_LEN, RESPONSE_LEN, RESPONSE_LEN))
  return [dict(prompt_tokens=p, chosen_tokens=c, rejected_tokens=r)
          for p, c, r in zip(prompt, chosen, rejected)]


def preference_batch(cfg: models.ModelConfig, seed: int) -> dict[str, np.ndarray]:
  """One micro-batch of 16 rows of 96 tokens: each sequence fills a row, nothing padded."""
  return preference.pack_pairs(random_pairs(seed, cfg.vocab_size), SEQ_LEN,
                               rows_per_microbatch=2 * PAIRS)


def posttrain_runner(reference_in_step: bool):
  """Builds the DPO step once; returns `measure(steps) -> (ref_s, update_s, pack_s)` lists.

  With `reference_in_step` the reference forward is part of the update program and ref_s
  is 0; otherwise it is `make_compute_logprobs`'s call, timed apart.
  """
  cfg = models.get_preset("bench")
  mesh = models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  optimizer = state_lib.make_optimizer(1e-5, warmup=0, total_steps=1000)
  model = models.create_model(cfg, mesh=mesh)
  box = {"state": state_lib.init_train_state(model, optimizer, mesh=mesh)}
  reference = state_lib.frozen_copy(box["state"].params)
  compute_logprobs = ts.make_compute_logprobs(cfg, mesh=mesh)
  step = ts.make_preference_step(cfg, preference.PreferenceConfig(beta=BETA), optimizer,
                                 mesh=mesh, reference_in_step=reference_in_step)
  seeds = iter(range(1_000_000))

  def one_step():
    start = time.perf_counter()
    batch = preference_batch(cfg, next(seeds))
    packed = time.perf_counter()
    if reference_in_step:
      box["state"], metrics = step(box["state"], batch, reference)
      jax.block_until_ready((box["state"].params, metrics))
      return 0.0, time.perf_counter() - packed, packed - start
    batch["ref_logprobs"] = compute_logprobs(reference, batch)["logprobs"]
    jax.block_until_ready(batch["ref_logprobs"])
    mid = time.perf_counter()
    box["state"], metrics = step(box["state"], batch)
    jax.block_until_ready((box["state"].params, metrics))
    return mid - packed, time.perf_counter() - mid, packed - start

  one_step()  # Compiles.

  def measure(steps: int):
    return tuple(list(column) for column in zip(*(one_step() for _ in range(steps))))

  return measure


def bench_tunix(steps: int, python: str, script: pathlib.Path):
  """Tunix's warm (ref_s, update_s) lists from the peer script, or None (says why)."""
  if not (os.path.exists(python) and script.exists()):
    print(f"Tunix side skipped: {python} or {script} is missing (see the module docstring)")
    return None
  cfg = models.get_preset("bench")
  out = pathlib.Path(f"/tmp/tunix_dpo_{os.getpid()}.json")
  cmd = [python, str(script), "--steps", str(steps + 1), "--beta", str(BETA),
         "--layers", str(cfg.num_layers), "--d_model", str(cfg.d_model),
         "--ffn", str(cfg.ffn_dim), "--heads", str(cfg.num_heads),
         "--kv_heads", str(cfg.num_kv_heads), "--head_dim", str(cfg.head_dim),
         "--vocab", str(cfg.vocab_size), "--tied", str(int(cfg.tie_embeddings)),
         "--pairs", str(PAIRS), "--prompt_len", str(PROMPT_LEN),
         "--response_len", str(RESPONSE_LEN), "--json_out", str(out)]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
  if proc.returncode or not out.exists():
    print(f"Tunix side failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return None
  result = json.loads(out.read_text())
  out.unlink()
  if result["params"] != cfg.num_params:
    print(f"Tunix side dropped: its model has {result['params']} parameters, ours "
          f"{cfg.num_params}")
    return None
  ref_s = result["prepare_inputs_s"][1:]
  return ref_s, list(np.subtract(result["step_s"][1:], ref_s))


def _row(framework: str, ref_s, update_s, pack_s=None) -> dict:
  step_s = np.add(ref_s, update_s)
  row = grpo_bench.summary(framework, ref_s, update_s)
  row.update(step_min_s=float(step_s.min()), step_max_s=float(step_s.max()))
  if pack_s is not None:
    row["pack_ms"] = 1e3 * grpo_bench.median(pack_s)
  return row


def run(quick: bool, tunix_python: str = TUNIX_PYTHON,
        tunix_script: pathlib.Path = TUNIX_SCRIPT) -> list[dict]:
  """Both sides on the comparison config; one dict per framework.

  Ours is measured before and after Tunix's run and the samples pooled, so a load change
  on a shared machine during the run does not favour either side.
  """
  cfg = models.get_preset("bench")
  steps = 3 if quick else 10
  reps = 3 if quick else 5
  peak = grpo_bench.matmul_peak_flops(reps=reps)
  measure = posttrain_runner(reference_in_step=True)
  measure_two = posttrain_runner(reference_in_step=False)
  one_a, two_a = measure(-(-steps // 2)), measure_two(-(-steps // 2))
  tunix = bench_tunix(steps, tunix_python, tunix_script)
  one_b, two_b = measure(steps // 2), measure_two(steps // 2)
  peak = max(peak, grpo_bench.matmul_peak_flops(reps=reps))
  results = [_row("posttrain", *(a + b for a, b in zip(one_a, one_b))),
             _row("posttrain 2 programs", *(a + b for a, b in zip(two_a, two_b)))]
  if tunix is not None:
    results.append(_row("tunix 0.1.7 DPOTrainer", *tunix))
  tokens = 2 * PAIRS * SEQ_LEN
  train_flops, forward_flops = grpo_bench.model_flops(cfg, tokens, SEQ_LEN)
  for result in results:
    result.update(tokens_per_s=tokens / result["step_s"],
                  mfu=(train_flops + forward_flops) / result["step_s"] / peak,
                  peak_gflops=peak / 1e9, load_avg=os.getloadavg()[0])
    if tunix is not None:
      result["speedup_vs_tunix"] = results[-1]["step_s"] / result["step_s"]
  return results


COLUMNS = ("framework", "ref_logprobs_s", "update_s", "step_s", "step_min_s", "step_max_s",
           "pack_ms", "tokens_per_s", "mfu", "speedup_vs_tunix", "steps", "load_avg")


def main() -> None:
  grpo_bench.cli(run, __doc__.splitlines()[0], TUNIX_SCRIPT, COLUMNS)


if __name__ == "__main__":
  main()
