"""Decode throughput: posttrain's Sampler vs naive recomputation vs Tunix's vanilla sampler.

    python -m benchmarks.sampler [--quick]

Same model shape on every side (the peer's Qwen3: 4 layers, d_model 256, ffn 1024, 4 heads,
2 kv heads, head_dim 64, vocab 1024, untied embeddings, q/k norm), random weights, prompts of
32 random tokens, 4 samples per prompt, temperature 0.9 with top-k 50 (the peer's rollout
settings) and no stop token, so every row generates all its tokens. Tunix
(google-tunix 0.1.7, `tunix.generate.sampler.Sampler`, the engine behind its "vanilla"
rollout) runs in its own venv as a subprocess; the venv is created on first use:

    python3 -m venv /tmp/tunix-venv && /tmp/tunix-venv/bin/pip install google-tunix==0.1.7 sentencepiece

Tunix is called with its defaults for log-probs (off); posttrain always returns behaviour
log-probs. Naive recomputation reruns the whole causal model over a fixed [batch, prompt +
new] buffer for every new token (jitted, no cache). Figures are medians over warm repeats
(the compiling call excluded); tokens/s counts generated tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import models
from posttrain.sampling import Sampler, sample_logits, sampling_mode

PROMPT_LEN = 32
TEMPERATURE, TOP_K = 0.9, 50
TUNIX_VENV = "/tmp/tunix-venv"
TUNIX_PACKAGES = ("google-tunix==0.1.7", "sentencepiece")
# (prompts, samples per prompt, new tokens, run naive recomputation)
CASES = ((4, 4, 64, True), (16, 4, 128, False))

_TUNIX_SCRIPT = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3_lib

a = json.loads(sys.argv[1])


class IdTokenizer:
  # Prompts travel as space-separated ids; no BOS, pad 0 (never in a prompt).
  def encode(self, text, **kw): return [int(t) for t in text.split()]
  def decode(self, ids, **kw): return " ".join(str(int(i)) for i in ids)
  def bos_id(self): return None
  def eos_id(self): return 3
  def pad_id(self): return 0


cfg = qwen3_lib.ModelConfig(
    num_layers=a["layers"], vocab_size=a["vocab"], embed_dim=a["d_model"],
    hidden_dim=a["ffn"], num_heads=a["heads"], head_dim=a["head_dim"],
    num_kv_heads=a["kv_heads"], rope_theta=1_000_000, norm_eps=1e-6,
    use_tied_embedding=False)
model = qwen3_lib.Qwen3(cfg, rngs=nnx.Rngs(params=0))
# Cache size as in the peer's GRPO set-up: prompt + new + 32.
sampler = sampler_lib.Sampler(model, IdTokenizer(), sampler_lib.CacheConfig(
    cache_size=a["prompt_len"] + a["new"] + 32, num_layers=a["layers"],
    num_kv_heads=a["kv_heads"], head_dim=a["head_dim"]))
prompts = [" ".join(map(str, p)) for p in a["prompts"]]


def once(seed):
  start = time.perf_counter()
  out = sampler(input_strings=prompts, max_generation_steps=a["new"],
                max_prompt_length=a["prompt_len"], temperature=a["temperature"],
                top_k=a["top_k"], top_p=1.0, seed=seed, eos_tokens=[-1])
  return time.perf_counter() - start, sum(len(t) for t in out.tokens)


once(0)
runs = [once(i + 1) for i in range(a["repeats"])]
print("RESULT " + json.dumps({"seconds": [r[0] for r in runs], "tokens": [r[1] for r in runs],
                              "jax": jax.__version__}))
"""


def bench_config() -> models.ModelConfig:
  return models.get_preset("bench", tie_embeddings=False,
                           rope=models.RopeConfig(theta=1_000_000.0))


def make_prompts(num_prompts: int, samples: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  # Ids from 4 up: 0 is Tunix's pad id, and a prompt token equal to it would be dropped.
  base = rng.integers(4, bench_config().vocab_size, size=(num_prompts, PROMPT_LEN))
  return [row.tolist() for row in base for _ in range(samples)]


def _median_rate(fn, repeats: int, tokens: int) -> tuple[float, float]:
  fn(0)  # Compiles.
  seconds = []
  for i in range(repeats):
    start = time.perf_counter()
    fn(i + 1)
    seconds.append(time.perf_counter() - start)
  median = float(np.median(seconds))
  return median, tokens / median


def time_posttrain(model, prompts, new_tokens: int, repeats: int):
  sampler = Sampler(model)

  def once(seed):
    out = sampler.generate(prompts, max_new_tokens=new_tokens, temperature=TEMPERATURE,
                           top_k=TOP_K, seed=seed)
    assert int(out.lengths.sum()) == len(prompts) * new_tokens
  return _median_rate(once, repeats, len(prompts) * new_tokens)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _naive_generate(graphdef, state, prompts_BxP, seed, new_tokens: int, mode):
  """Every step reruns the causal trunk over the whole fixed-size buffer (no cache)."""
  model = nnx.merge(graphdef, state)
  batch, prompt_len = prompts_BxP.shape
  buf = jnp.pad(prompts_BxP, ((0, 0), (0, new_tokens)))
  key = jax.random.key(seed)

  def step(t, buf):
    h = model.hidden_states(buf)
    h_last = jax.lax.dynamic_index_in_dim(h, prompt_len + t - 1, axis=1, keepdims=False)
    logits = jnp.einsum("BD,DV->BV", h_last, model.unembed())
    keys = jax.random.split(jax.random.fold_in(key, t), batch)
    tok, _ = sample_logits(logits, keys, TEMPERATURE, 1.0, mode)
    return jax.lax.dynamic_update_slice_in_dim(buf, tok[:, None], prompt_len + t, axis=1)

  return jax.lax.fori_loop(0, new_tokens, step, buf)


def time_naive(model, prompts, new_tokens: int, repeats: int):
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(prompts, jnp.int32)
  mode = sampling_mode(TEMPERATURE, TOP_K, None, model.cfg.vocab_size)

  def once(seed):
    _naive_generate(graphdef, state, tokens, seed, new_tokens, mode).block_until_ready()
  return _median_rate(once, repeats, len(prompts) * new_tokens)


def ensure_tunix_venv() -> str:
  python = os.path.join(TUNIX_VENV, "bin", "python")
  check = [python, "-c", "import tunix"]
  if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
    return python
  print(f"creating {TUNIX_VENV} with {' '.join(TUNIX_PACKAGES)} ...", file=sys.stderr)
  subprocess.run([sys.executable, "-m", "venv", TUNIX_VENV], check=True)
  subprocess.run([python, "-m", "pip", "install", "-q", *TUNIX_PACKAGES], check=True)
  return python


def time_tunix(cfg: models.ModelConfig, prompts, new_tokens: int, repeats: int):
  args = dict(layers=cfg.num_layers, vocab=cfg.vocab_size, d_model=cfg.d_model,
              ffn=cfg.ffn_dim, heads=cfg.num_heads, head_dim=cfg.head_dim,
              kv_heads=cfg.num_kv_heads, prompt_len=PROMPT_LEN, new=new_tokens,
              temperature=TEMPERATURE, top_k=TOP_K, prompts=prompts, repeats=repeats)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  proc = subprocess.run([ensure_tunix_venv(), "-c", _TUNIX_SCRIPT, json.dumps(args)],
                        capture_output=True, text=True, env=env)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise RuntimeError(f"tunix run failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
  result = json.loads(lines[-1][len("RESULT "):])
  if set(result["tokens"]) != {len(prompts) * new_tokens}:
    raise RuntimeError(f"tunix generated {result['tokens']} tokens, expected "
                       f"{len(prompts) * new_tokens} per run")
  median = float(np.median(result["seconds"]))
  return median, len(prompts) * new_tokens / median


def run(quick: bool = False) -> list[dict]:
  """One row per (case, engine): median seconds per generate call and tokens/s."""
  cfg = bench_config()
  model = models.create_model(cfg, seed=0)
  repeats = 3 if quick else 5
  rows = []
  for num_prompts, samples, new_tokens, with_naive in CASES[:1] if quick else CASES:
    prompts = make_prompts(num_prompts, samples)
    case = f"{len(prompts)} seqs x {new_tokens} new"
    timings = {"tunix": time_tunix(cfg, prompts, new_tokens, repeats),
               "posttrain": time_posttrain(model, prompts, new_tokens, repeats)}
    if with_naive:
      timings["naive (no cache)"] = time_naive(model, prompts, new_tokens, max(2, repeats - 2))
    tunix_rate = timings["tunix"][1]
    for engine, (seconds, rate) in timings.items():
      rows.append(dict(case=case, engine=engine, median_s=round(seconds, 4),
                       tokens_per_s=round(rate, 1), vs_tunix=round(rate / tunix_rate, 2)))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="first case only, 3 repeats")
  args = parser.parse_args()
  rows = run(args.quick)
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cpus, "
        f"load {os.getloadavg()[0]:.1f}")
  print(f"{'case':<22}{'engine':<20}{'median s':>10}{'tokens/s':>12}{'vs tunix':>10}")
  for r in rows:
    print(f"{r['case']:<22}{r['engine']:<20}{r['median_s']:>10.4f}{r['tokens_per_s']:>12.1f}"
          f"{r['vs_tunix']:>9.2f}x")


if __name__ == "__main__":
  main()
