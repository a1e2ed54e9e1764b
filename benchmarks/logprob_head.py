"""The log-prob head under FSDP: the vocabulary split over the devices against the
projection gathered whole, compiled for a TPU slice on this host (libtpu, no TPU).

    python -m benchmarks.logprob_head [--topology=v5e:4x4] [--preset=llama3_8b]
        [--rows=16] [--row_len=2048]

The head is `chunked_logprobs`: per-token log-probs and entropies of one micro-batch's
hidden states [rows, row_len, D] against the output projection [D, V], stored as the
rules store it (D over fsdp, V over tensor), differentiated in the hidden states and,
for a full fine-tune, in the projection (LoRA leaves it frozen). Two arms, each compiled
in this one run for the whole slice as pure FSDP:

  gathered   no sharding context: every device projects its own rows through all of
             [D, V] (what the head did before `ShardingContext.vocab_parallel_head`)
  split      the vocabulary over fsdp, each chunk's rows gathered over fsdp

Printed per device: XLA's temporaries and the bytes the program all-gathers, with the
split / gathered ratios. Compiled, not run: the figures are XLA:TPU's buffer assignment.
"""
from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from posttrain import aot, models

MIB = 1 << 20


def _all_gather_bytes(hlo: str) -> int:
  size = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "pred": 1}
  total = 0
  for line in hlo.splitlines():
    if re.search(r" all-gather(-start)?\(", line):
      for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]\{", line.split(" all-gather")[0]):
        total += size.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def compile_head(mesh: Mesh, cfg: models.ModelConfig, rows: int, row_len: int, *,
                 split: bool, trained: bool):
  ctx = models.ShardingContext(mesh if split else None)
  sharding = models.ShardingContext(mesh)
  dt = jnp.dtype(cfg.dtype)
  h = jax.ShapeDtypeStruct((rows, row_len, cfg.d_model), dt, sharding=sharding.sharding(
      ("batch", "length", None), (rows, row_len, cfg.d_model)))
  w = jax.ShapeDtypeStruct((cfg.d_model, cfg.vocab_size), jnp.dtype(cfg.param_dtype),
                           sharding=sharding.sharding(("embed", "vocab"),
                                                      (cfg.d_model, cfg.vocab_size)))
  targets = jax.ShapeDtypeStruct((rows, row_len), jnp.int32, sharding=sharding.sharding(
      ("batch", "length"), (rows, row_len)))

  def objective(h, w, targets):
    logp, ent = models.chunked_logprobs(h, w, targets, chunk=cfg.logprob_chunk,
                                        return_entropy=True, compute_dtype=dt, ctx=ctx)
    return jnp.mean(logp) + 0.01 * jnp.mean(ent)

  fn = jax.grad(objective, argnums=(0, 1) if trained else 0)
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(h, w, targets).compile()


def measure(topology: str = "v5e:4x4", preset: str = "llama3_8b", rows: int = 16,
            row_len: int = 2048) -> list[dict]:
  """One row per (projection, arm): XLA's per-device temporaries and all-gathered bytes."""
  mesh = models.make_mesh((1, -1, 1, 1), devices=aot.tpu_devices(topology))
  cfg = models.get_preset(preset).replace(dtype="bfloat16", param_dtype="bfloat16")
  out = []
  for trained in (True, False):
    temps = {}
    for split in (False, True):
      compiled = compile_head(mesh, cfg, rows, row_len, split=split, trained=trained)
      temps[split] = compiled.memory_analysis().temp_size_in_bytes
      out.append({
          "projection": "trained" if trained else "frozen (LoRA)",
          "arm": "split" if split else "gathered",
          "temporaries MiB": round(temps[split] / MIB, 1),
          "all-gathered MiB": round(_all_gather_bytes(compiled.as_text()) / MIB, 1),
          "temporaries split / gathered": (round(temps[True] / temps[False], 2)
                                           if split else ""),
      })
  return out


def run(quick: bool) -> list[dict]:
  """benchmarks.run's entry: the 8B head on a v5e-16 (a v5e-4 and 8 rows when quick)."""
  return measure("v5e:2x2", rows=8) if quick else measure()


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:4x4")
  parser.add_argument("--preset", default="llama3_8b")
  parser.add_argument("--rows", type=int, default=16, help="rows of one micro-batch")
  parser.add_argument("--row_len", type=int, default=2048)
  args = parser.parse_args(argv)
  cfg = models.get_preset(args.preset)
  print(f"{args.preset} head (D {cfg.d_model}, V {cfg.vocab_size}, chunk "
        f"{cfg.logprob_chunk}), {args.rows} x {args.row_len} tokens, pure fsdp on "
        f"{args.topology}; per device:")
  rows = measure(args.topology, args.preset, args.rows, args.row_len)
  print("| " + " | ".join(rows[0]) + " |")
  print("|" + "---|" * len(rows[0]))
  for row in rows:
    print("| " + " | ".join(f"{v:,}" if isinstance(v, float) else str(v)
                            for v in row.values()) + " |")


if __name__ == "__main__":
  main()
