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
log-probs. "posttrain 64-slot blocks" is the same model with decode_chunk=64 instead of the
CPU default 256: decode attention then copies the heads-major cache out in 64-slot blocks
and skips blocks past the longest row, where the default reads these (96- and 160-slot)
caches in place, in one block. Naive recomputation
reruns the whole causal model over a fixed [batch, prompt + new] buffer for every new token
(jitted, no cache). Figures are medians over warm repeats
(the compiling call excluded), the engines taking turns within each repeat; tokens/s counts
generated tokens per wall second, cpu ms/tok the process CPU time (all threads) per
generated token, the steadier figure on a shared machine.
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
# Decode attention reads the cache in blocks of cfg.decode_chunk slots (256 on CPU, so one
# block for these caches); the "64-slot blocks" row reads it block by block instead.
SMALL_CHUNK = 64
# Pause between engines: XLA's CPU worker threads keep spinning briefly after a call, which
# would otherwise slow whichever engine runs next.
SETTLE_S = 0.5

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
  wall, cpu = time.perf_counter(), time.process_time()
  out = sampler(input_strings=prompts, max_generation_steps=a["new"],
                max_prompt_length=a["prompt_len"], temperature=a["temperature"],
                top_k=a["top_k"], top_p=1.0, seed=seed, eos_tokens=[-1])
  return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
          "tokens": sum(len(t) for t in out.tokens)}


once(0)
print("READY " + jax.__version__, flush=True)
for line in sys.stdin:  # One timed call per seed received, so runs interleave with ours.
  print("RESULT " + json.dumps(once(int(line))), flush=True)
"""


def bench_config() -> models.ModelConfig:
  return models.get_preset("bench", tie_embeddings=False,
                           rope=models.RopeConfig(theta=1_000_000.0))


def make_prompts(num_prompts: int, samples: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  # Ids from 4 up: 0 is Tunix's pad id, and a prompt token equal to it would be dropped.
  base = rng.integers(4, bench_config().vocab_size, size=(num_prompts, PROMPT_LEN))
  return [row.tolist() for row in base for _ in range(samples)]


def _timed(fn, seed: int) -> dict:
  wall, cpu = time.perf_counter(), time.process_time()
  fn(seed)
  return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def posttrain_runner(model, prompts, new_tokens: int):
  sampler = Sampler(model)

  def once(seed):
    out = sampler.generate(prompts, max_new_tokens=new_tokens, temperature=TEMPERATURE,
                           top_k=TOP_K, seed=seed)
    assert int(out.lengths.sum()) == len(prompts) * new_tokens
  return once


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


def naive_runner(model, prompts, new_tokens: int):
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(prompts, jnp.int32)
  mode = sampling_mode(TEMPERATURE, TOP_K, None, model.cfg.vocab_size)

  def once(seed):
    _naive_generate(graphdef, state, tokens, seed, new_tokens, mode).block_until_ready()
  return once


def ensure_tunix_venv() -> str:
  python = os.path.join(TUNIX_VENV, "bin", "python")
  check = [python, "-c", "import tunix"]
  if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
    return python
  print(f"creating {TUNIX_VENV} with {' '.join(TUNIX_PACKAGES)} ...", file=sys.stderr)
  subprocess.run([sys.executable, "-m", "venv", TUNIX_VENV], check=True)
  subprocess.run([python, "-m", "pip", "install", "-q", *TUNIX_PACKAGES], check=True)
  return python


class TunixRunner:
  """Tunix's sampler in its own venv; each call times one generate there."""

  def __init__(self, cfg: models.ModelConfig, prompts, new_tokens: int):
    args = dict(layers=cfg.num_layers, vocab=cfg.vocab_size, d_model=cfg.d_model,
                ffn=cfg.ffn_dim, heads=cfg.num_heads, head_dim=cfg.head_dim,
                kv_heads=cfg.num_kv_heads, prompt_len=PROMPT_LEN, new=new_tokens,
                temperature=TEMPERATURE, top_k=TOP_K, prompts=prompts)
    self.expected_tokens = len(prompts) * new_tokens
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    self.proc = subprocess.Popen([ensure_tunix_venv(), "-c", _TUNIX_SCRIPT, json.dumps(args)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
    self._read("READY ")

  def _read(self, prefix: str) -> str:
    for line in self.proc.stdout:
      if line.startswith(prefix):
        return line[len(prefix):]
    raise RuntimeError(f"tunix run failed (exit {self.proc.wait()}): "
                       f"{self.proc.stderr.read()[-2000:]}")

  def __call__(self, seed: int) -> dict:
    self.proc.stdin.write(f"{seed}\n")
    self.proc.stdin.flush()
    result = json.loads(self._read("RESULT "))
    if result["tokens"] != self.expected_tokens:
      raise RuntimeError(f"tunix generated {result['tokens']} tokens, expected "
                         f"{self.expected_tokens}")
    return result

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


def run(quick: bool = False) -> list[dict]:
  """One row per (case, engine): medians of wall seconds, tokens/s and CPU ms per token.

  Engines run in turn within each repeat, so a busy machine slows them alike; CPU time
  (process time, all threads) is the steadier figure on a shared machine.
  """
  cfg = bench_config()
  model = models.create_model(cfg, seed=0)
  blocked = models.create_model(cfg.replace(decode_chunk=SMALL_CHUNK), seed=0)
  repeats = 3 if quick else 7
  rows = []
  for num_prompts, samples, new_tokens, with_naive in CASES[:1] if quick else CASES:
    prompts = make_prompts(num_prompts, samples)
    tokens = len(prompts) * new_tokens
    tunix = TunixRunner(cfg, prompts, new_tokens)
    engines = {"tunix": tunix, "posttrain": posttrain_runner(model, prompts, new_tokens),
               "posttrain 64-slot blocks": posttrain_runner(blocked, prompts, new_tokens)}
    if with_naive:
      engines["naive (no cache)"] = naive_runner(model, prompts, new_tokens)
    for name, fn in engines.items():
      if name != "tunix":
        fn(0)  # Compiles.
    runs = {name: [] for name in engines}
    try:
      for seed in range(1, repeats + 1):
        for name, fn in engines.items():
          time.sleep(SETTLE_S)
          runs[name].append(fn(seed) if name == "tunix" else _timed(fn, seed))
    finally:
      tunix.close()
    medians = {name: (float(np.median([r["wall"] for r in rs])),
                      float(np.median([r["cpu"] for r in rs]))) for name, rs in runs.items()}
    for name, (wall, cpu) in medians.items():
      rows.append(dict(case=f"{len(prompts)} seqs x {new_tokens} new", engine=name,
                       median_s=round(wall, 4), tokens_per_s=round(tokens / wall, 1),
                       vs_tunix=round(medians["tunix"][0] / wall, 2),
                       cpu_ms_per_token=round(1000 * cpu / tokens, 3),
                       cpu_vs_tunix=round(medians["tunix"][1] / cpu, 2)))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="first case only, 3 repeats")
  args = parser.parse_args()
  rows = run(args.quick)
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cpus, "
        f"load {os.getloadavg()[0]:.1f}")
  print(f"{'case':<22}{'engine':<26}{'median s':>9}{'tokens/s':>10}{'vs tunix':>9}"
        f"{'cpu ms/tok':>11}{'vs tunix':>9}")
  for r in rows:
    print(f"{r['case']:<22}{r['engine']:<26}{r['median_s']:>9.4f}{r['tokens_per_s']:>10.1f}"
          f"{r['vs_tunix']:>8.2f}x{r['cpu_ms_per_token']:>11.3f}{r['cpu_vs_tunix']:>8.2f}x")


if __name__ == "__main__":
  main()
