"""A real-size GRPO learner step and rollout on one accelerator, per attention kernel.

    python -m benchmarks.gpu_step [--tiny] [--impls=flash,chunked,reference] [--tuned=SWEEP.json]
        [--flash-arms='gpu_forward=mosaic,gpu_backward=mosaic']
        [--out=F]

Model: a 1.2B Llama-3-style transformer with head_dim 128 (d_model 2048, 16 layers,
16 query / 4 kv heads, ffn 8192, vocab 128256, tied embeddings), bf16 compute, f32
parameters and AdamW state, full rematerialisation. Step: GRPO (kl_coef 0.04) on
`--rows` packed rows of `--row-len` tokens (prompt 1/8, response 7/8 of each
sequence, two sequences per row so segment ids are exercised) in micro-batches of
`--microbatch` rows: reference log-probs, then the update. MFU counts model FLOPs
(6N per trained token + causal attention, 2N per reference token; no recomputation)
over the bf16 rate of one large matmul measured in the same run. Rollout: `--prompts`
prompts of 256 tokens, 512 new tokens each (top-k 50, temperature 1), tokens/s.

`--tiny` runs the same code with a small model and short rows (a CPU dry run).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from posttrain import models
from posttrain.rl import packing, presets
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts
from posttrain.sampling.sampler import Sampler

from benchmarks.train_step import matmul_peak_flops, model_flops

KL_COEF = 0.04


def model_config(tiny: bool, attention_impl: str) -> models.ModelConfig:
  if tiny:
    return models.get_preset("bench", attention_impl=attention_impl, dtype="bfloat16",
                             remat="full", head_dim=64, max_position_embeddings=2048)
  return models.ModelConfig(
      vocab_size=128256, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=4,
      head_dim=128, ffn_dim=8192, tie_embeddings=True, max_position_embeddings=8192,
      rope=models.RopeConfig(theta=500_000.0), dtype="bfloat16", param_dtype="float32",
      remat="full", attention_impl=attention_impl, logprob_chunk=1024)


def best_sweep_options(path: str) -> str | None:
  """The fastest forward + backward arm of a device sweep (`benchmarks.attention
  --accelerator-only --out=PATH`) as ModelConfig.attention_options, or None."""
  try:
    with open(path) as f:
      rows = json.load(f)
  except (OSError, ValueError):
    return None
  timed = [r for r in rows if r.get("benchmark") == "sweep fwd+bwd" and r.get("time_ms")]
  if not timed:
    return None
  return min(timed, key=lambda r: r["time_ms"])["implementation"].removeprefix("flash ")


def matmul_peak(n: int = 8192, reps: int = 10) -> float:
  """bf16 FLOP/s of one large matmul on the default device (median of reps)."""
  return matmul_peak_flops(n, reps, jnp.bfloat16)


def grpo_batch(cfg, rows: int, row_len: int, microbatch: int, seed: int):
  """`rows` rows, each two sequences of row_len / 2 (1/8 prompt), group advantages."""
  rng = np.random.default_rng(seed)
  seq = row_len // 2
  prompt = seq // 8
  n = 2 * rows
  rewards = rng.random((n // 4, 4))
  adv = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)
  trajectories = [dict(prompt_tokens=rng.integers(1, cfg.vocab_size, prompt),
                       response_tokens=rng.integers(1, cfg.vocab_size, seq - prompt),
                       behaviour_logprobs=-rng.uniform(1, 8, seq - prompt),
                       advantages=float(a)) for a in adv.reshape(-1)]
  packed = packing.pack_trajectories(trajectories, row_len, num_rows=rows)
  return packing.split_microbatches(packed, microbatch * row_len,
                                    num_microbatches=rows // microbatch)


def bench_step(cfg, rows, row_len, microbatch, steps, peak: float) -> dict:
  mesh = models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  optimizer = state_lib.make_optimizer(1e-6, warmup=0, total_steps=1000)
  algo = presets.algorithm_config("grpo", kl_coef=KL_COEF, eps_low=0.2, eps_high=0.2)
  model = models.create_model(cfg, mesh=mesh)
  state = state_lib.init_train_state(model, optimizer, mesh=mesh)
  del model
  reference = state_lib.frozen_copy(state.params)
  logprobs = ts.make_compute_logprobs(cfg, mesh=mesh)
  step = ts.make_train_step(cfg, algo, optimizer, mesh=mesh)
  ref_t, upd_t, metrics = [], [], {}
  start = time.perf_counter()
  for i in range(steps + 1):
    batch = grpo_batch(cfg, rows, row_len, microbatch, seed=i)
    t0 = time.perf_counter()
    batch["ref_logprobs"] = logprobs(reference, batch)["logprobs"]
    jax.block_until_ready(batch["ref_logprobs"])
    t1 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready((state.params, metrics))
    t2 = time.perf_counter()
    if i == 0:
      compile_s = t2 - start
    else:
      ref_t.append(t1 - t0)
      upd_t.append(t2 - t1)
  tokens = rows * row_len
  # Two sequences per row, causal: attention sees half of each on average.
  train_flops, fwd_flops = model_flops(cfg, tokens, row_len // 4)
  ref_s, upd_s = float(np.median(ref_t)), float(np.median(upd_t))
  loss = float(metrics.get("loss/policy", jnp.nan)) if hasattr(metrics, "get") else None
  flops_per_s = (train_flops + fwd_flops) / (ref_s + upd_s)
  return dict(ref_s=round(ref_s, 4), update_s=round(upd_s, 4),
              step_s=round(ref_s + upd_s, 4), tokens_per_s=round(tokens / (ref_s + upd_s)),
              model_tflops_per_s=round(flops_per_s / 1e12, 1),
              mfu=round(flops_per_s / peak, 3),
              first_step_s=round(compile_s, 1), loss_policy=loss,
              grad_norm=float(metrics.get("grad_norm", jnp.nan)))


def bench_rollout(cfg, prompts: int, prompt_len: int, new_tokens: int) -> dict:
  model = models.create_model(cfg)
  sampler = Sampler(model, max_len=prompt_len + new_tokens)
  rng = np.random.default_rng(0)
  batch = [rng.integers(1, cfg.vocab_size, prompt_len).tolist() for _ in range(prompts)]
  start = time.perf_counter()
  sampler.generate(batch, max_new_tokens=new_tokens, temperature=1.0, top_k=50, seed=0)
  first = time.perf_counter() - start
  times = []
  for seed in (1, 2):
    start = time.perf_counter()
    out = sampler.generate(batch, max_new_tokens=new_tokens, temperature=1.0, top_k=50,
                           seed=seed)
    times.append(time.perf_counter() - start)
  generated = int(np.asarray(out.lengths).sum())
  seconds = float(np.median(times))
  return dict(prompts=prompts, new_tokens=new_tokens, seconds=round(seconds, 3),
              tokens_per_s=round(generated / seconds), first_call_s=round(first, 1))


def run(quick: bool = False) -> list[dict]:
  """For benchmarks.run: the real-size rows on an accelerator; on CPU one row saying so
  (a 1.2B model step takes minutes there; `--tiny` is the CPU dry run)."""
  if jax.default_backend() == "cpu":
    return [dict(benchmark="grpo step + rollout, 1.2B", note="needs a GPU or TPU; the "
                 "H200 figures are in BENCHMARKS.md (GPU section)")]
  peak = matmul_peak()
  rows = []
  for impl in ("flash",) if quick else ("flash", "reference"):
    cfg = model_config(False, impl)
    rows.append(dict(benchmark="grpo step", attention=impl,
                     **bench_step(cfg, 16, 4096, 4, 2 if quick else 3, peak)))
  rows.append(dict(benchmark="rollout", **bench_rollout(model_config(False, "flash"), 64,
                                                          256, 512)))
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true")
  parser.add_argument("--impls", default="flash,chunked,reference")
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--row-len", type=int, default=4096)
  parser.add_argument("--microbatch", type=int, default=4)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--prompts", type=int, default=64)
  parser.add_argument("--no-rollout", action="store_true")
  parser.add_argument("--rollouts", default="auto:float32",
                      help="decode_chunk:param_dtype variants, e.g. 32:float32,auto:bfloat16")
  parser.add_argument("--tuned", help="a device sweep's JSON (benchmarks.attention --out): "
                      "also time flash with its fastest forward + backward options")
  parser.add_argument("--flash-arms", default="",
                      help="more flash arms, each ModelConfig.attention_options, separated "
                      "by ';' (e.g. 'gpu_forward=mosaic,gpu_backward=mosaic')")
  parser.add_argument("--scan-layers", action="store_true",
                      help="every arm with ModelConfig.scan_layers (one lax.scan over the "
                      "layers: each kernel has one call site)")
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  if args.tiny:
    args.rows, args.row_len, args.microbatch, args.prompts = 4, 256, 2, 4
  rows: list[dict] = []

  def save(row):
    print(json.dumps(row), file=sys.stderr, flush=True)
    rows.append(row)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(rows, f)

  peak = matmul_peak(1024 if args.tiny else 8192)
  save(dict(benchmark="bf16 matmul peak", tflops=round(peak / 1e12, 1),
            device=str(jax.devices()[0].device_kind), jax=jax.__version__))
  config = lambda impl: model_config(args.tiny, impl).replace(  # noqa: E731
      scan_layers=args.scan_layers)
  arms = [(impl, config(impl)) for impl in args.impls.split(",")]
  tuned = best_sweep_options(args.tuned) if args.tuned else None
  extra = ([tuned] if tuned else []) + [a for a in args.flash_arms.split(";") if a.strip()]
  for i, options in enumerate(extra):
    arms.insert(1 + i, (f"flash {options}", config("flash").replace(
        attention_options=options)))
  for name, cfg in arms:
    try:
      res = bench_step(cfg, args.rows, args.row_len, args.microbatch, args.steps, peak)
    except Exception as e:  # pylint: disable=broad-except
      res = dict(note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    save(dict(benchmark="grpo step", attention=name, scan_layers=cfg.scan_layers,
              params=cfg.num_params,
              rows=args.rows, row_len=args.row_len, **res))
  for variant in ([] if args.no_rollout else args.rollouts.split(",")):
    chunk, param_dtype = variant.split(":")
    cfg = config("flash").replace(
        decode_chunk=None if chunk == "auto" else int(chunk), param_dtype=param_dtype)
    try:
      res = bench_rollout(cfg, args.prompts, 256 if not args.tiny else 16,
                          512 if not args.tiny else 16)
    except Exception as e:  # pylint: disable=broad-except
      res = dict(note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    save(dict(benchmark="rollout", params=cfg.num_params, param_dtype=param_dtype,
              decode_chunk=models.decode_chunk_for(cfg), **res))
  print("\n".join(json.dumps(r) for r in rows))


if __name__ == "__main__":
  main()
