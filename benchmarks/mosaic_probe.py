"""JAX's bundled Mosaic GPU attention (`attention_mgpu`) beside cuDNN and our flash
kernels, on a Hopper GPU: forward and forward + backward TFLOP/s, causal and not.

The bundled kernel stages through float16 shared memory, applies no softmax scale and
has no causal backward, so this runs float16 inputs and reports its outputs' distance
from cuDNN's only as a sanity note. 16 heads, head_dim 128, batch x length = 32k.

  python -m benchmarks.mosaic_probe --out probe.json     (on a GPU)
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import kernels
from benchmarks.attention import _fwd_and_bwd, _time_or_error


def _implementations(causal: bool) -> dict:
  from jax.experimental.pallas.ops.gpu import attention_mgpu  # GPU-only import
  impls = {
      "jax cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn"),
      "flash (default)": lambda q, k, v: kernels.flash_attention(q, k, v, causal=causal),
      "flash triton-fwd": lambda q, k, v: kernels.flash_attention(
          q, k, v, causal=causal, gpu_forward="triton"),
  }
  for block_kv in (128, 64):
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=causal,
        block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    impls[f"jax attention_mgpu, block_kv {block_kv}"] = (
        lambda q, k, v, config=config: attention_mgpu.attention(q, k, v, config))
  return impls


def run(lengths=(8192, 16384), repeats: int = 5, tokens: int = 32768) -> list[dict]:
  rows = []
  for length in lengths:
    batch = max(1, tokens // length)
    keys = jax.random.split(jax.random.key(length), 4)
    q, k, v, do = (jax.random.normal(key, (batch, length, 16, 128), jnp.float16)
                   for key in keys)
    for causal in (True, False):
      flops = 4 * batch * 16 * length**2 * 128 / (2 if causal else 1)
      first = None
      for name, attention in _implementations(causal).items():
        fwd, both = _fwd_and_bwd(attention)
        row = dict(length=length, batch=batch, causal=causal, implementation=name)
        for mode, fn, n in (("fwd", fwd, flops), ("fwd+bwd", both, 3.5 * flops)):
          seconds = _time_or_error(fn, (q, k, v, do), repeats)
          row[mode] = (round(n / seconds / 1e12, 1) if isinstance(seconds, float)
                       else seconds)
        try:
          out = fwd(q, k, v, do).astype(jnp.float32)
          first = out if first is None else first
          row["distance_from_cudnn"] = float(jnp.linalg.norm(out - first)
                                             / jnp.linalg.norm(first))
        except Exception:  # pylint: disable=broad-except
          pass  # the timing column already says why
        print(row, flush=True)
        rows.append(row)
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", help="JSON file for the rows")
  args = parser.parse_args(argv)
  rows = run()
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
