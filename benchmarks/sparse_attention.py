"""DeepSeek Sparse Attention's training path: memory and time, forward + backward.

    python -m benchmarks.sparse_attention [--lengths=2048,8192] [--repeats=3]

One row of T tokens, 16 heads of 64 (one key head per query head, as the latent
attention's expanded form has), an indexer of 8 heads of 32, each query choosing 512 keys.
Side by side, the loss and its gradients in q, k and v of:

- `sparse_attention` as the model runs it: queries in blocks of 256 under
  `jax.checkpoint` (the [block, T] scores and probabilities exist a block at a time);
- the same with one block of all T queries (the [T, T] arrays whole, kept for the
  backward pass);
- dense causal attention through kernels' chunked path and the materialising reference,
  for scale (not the same function: every key attends).

Peak memory is the compiled program's (arguments + outputs + temporaries from
`memory_analysis()`), not the process RSS; a program whose peak exceeds half the memory
available is compiled but not run. Times are medians of warm runs on this CPU.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from benchmarks.attention import FIT_FRACTION, _available_bytes, _peak_bytes
from posttrain.models import transformer as tr

HEADS, HEAD_DIM, INDEX_HEADS, INDEX_DIM, TOPK = 16, 64, 8, 32, 512
MiB = 2**20


def _inputs(length: int):
  ks = jax.random.split(jax.random.key(0), 6)
  q, k, v = (jax.random.normal(ks[i], (1, length, HEADS, HEAD_DIM)) for i in range(3))
  iq = jax.random.normal(ks[3], (1, length, INDEX_HEADS, INDEX_DIM))
  iw = jax.random.normal(ks[4], (1, length, INDEX_HEADS))
  ik = jax.random.normal(ks[5], (1, length, INDEX_DIM))
  return q, k, v, iq, iw, ik


def _arms(length: int, iq, iw, ik):
  pos = jnp.arange(length)[None]
  seg = jnp.ones((1, length), jnp.int32)
  scale = HEAD_DIM ** -0.5

  def sparse(block):
    return lambda q, k, v: tr.sparse_attention(q, k, v, iq, iw, ik, pos, pos, seg, seg,
                                               TOPK, scale, block=block)
  return {
      "sparse, blocks of 256": sparse(256),
      "sparse, one block": sparse(length),
      "dense, chunked": lambda q, k, v: kernels.dot_product_attention(
          q, k, v, implementation="chunked", causal=True, chunk_size=512),
      "dense, reference": lambda q, k, v: kernels.reference_attention(q, k, v, causal=True),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--lengths", default="2048,8192")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  budget = FIT_FRACTION * _available_bytes()
  print("| T | implementation | peak MiB | peak / one block | median s |")
  print("|---|---|---|---|---|")
  for length in (int(x) for x in args.lengths.split(",")):
    q, k, v, iq, iw, ik = _inputs(length)
    rows = []
    for name, fn in _arms(length, iq, iw, ik).items():
      loss = jax.jit(jax.value_and_grad(
          lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2)))
      compiled = loss.lower(q, k, v).compile()
      peak = _peak_bytes(compiled)
      seconds = None
      if peak < budget:
        jax.block_until_ready(compiled(q, k, v))
        times = []
        for _ in range(args.repeats):
          start = time.perf_counter()
          jax.block_until_ready(compiled(q, k, v))
          times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
      rows.append((name, peak, seconds))
    whole = dict((n, p) for n, p, _ in rows)["sparse, one block"]
    for name, peak, seconds in rows:
      print(f"| {length} | {name} | {peak / MiB:.1f} | {peak / whole:.2f} | "
            f"{'does not fit' if seconds is None else f'{seconds:.3f}'} |")


if __name__ == "__main__":
  main()
