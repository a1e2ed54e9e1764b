"""Sliding-window layers' ring-buffer KV cache against whole rows, in the sampler on CPU.

    python -m benchmarks.sliding_cache [--lengths=4096,16384] [--rows=8] [--prompts=2]
        [--reps=5] [--scan=False] [--quick]

A sliding-window layer (Gemma 2/3, Mistral) reads only its last `sliding_window` keys, so
its cache keeps a ring of window + extend_chunk - 1 slots (`models.sliding_cache_slots`,
position p in slot p % slots) instead of one slot per position. Two arms of the same
model and weights, each its own `Sampler(model, max_len=length, extend_chunk=...)`:

  ring         the default extend_chunk (512): rings of 1,024 slots (window 512)
  whole rows   extend_chunk = max_len: every layer keeps max_len slots, as the caches
               did before the ring buffer; a ring no row has wrapped reads as a plain
               cache (blocks before the window skipped), so this arm decodes as that
               code did

The model is Gemma 3's layers (`gemma3_1b` with sandwich norms, GeGLU, soft caps, its own
local rotary table) shrunk to run on CPU: D 256, 4 heads, 1 kv head, head_dim 64, F 512,
V 1024, 12 layers (five sliding, window 512, to one full), float32, chunked attention,
scan_layers (--scan=False: the layer list), random weights. Per cache length, `rows` rows
(--prompts distinct random prompts, each repeated in a block as a GRPO group lays them
out, so the prefill, not measured, runs that many rows) of length - 64 (reps + 1) tokens:
`generate(max_new_tokens=1, keep_cache=True, reserve_tokens=64 (reps + 1))`, greedy, then
reps + 1 `resume(..., max_new_tokens=64)` segments per arm, the arms interleaved, each
continuing from the state the last returned; the first segment warms up and is not
timed. Decoding thus runs at the last 64 (reps + 1) positions of the cache.

Printed: the kept cache's bytes (its arrays' nbytes), the median decode ms per token
(a resume's wall time / 64), XLA's temporaries and argument bytes of the compiled decode
loop (`Sampler.compile`'s `memory_analysis`), the prefill's seconds (one run, compiled
before), and the ring's ratios to whole rows. Both arms decode the same tokens (asserted:
the same math, the keys in other slots).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

from posttrain import models
from posttrain.sampling import Sampler

SEGMENT = 64  # new tokens per resume call (one timed sample)
WINDOW = 512
MIB = 1 << 20


def gemma_config(scan: bool = True) -> models.ModelConfig:
  """Gemma 3 1B's layer kinds and features at CPU widths (12 layers: 10 sliding, 2 full)."""
  layers = 12
  return models.get_preset("gemma3_1b").replace(
      vocab_size=1024, d_model=256, num_layers=layers, num_heads=4, num_kv_heads=1,
      head_dim=64, ffn_dim=512, query_pre_attn_scalar=64.0, dtype="float32",
      param_dtype="float32", remat="none", attention_impl="chunked", scan_layers=scan,
      sliding_window=WINDOW,
      layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(layers)))


def make_prompts(rows: int, distinct: int, length: int, vocab: int) -> list[list[int]]:
  """`rows` prompts of `length` random tokens: `distinct` different ones, each repeated
  rows / distinct times in a block (one prefill row each)."""
  rng = np.random.default_rng(0)
  base = [rng.integers(1, vocab, length).tolist() for _ in range(distinct)]
  return [base[i * distinct // rows] for i in range(rows)]


def measure(cfg: models.ModelConfig, length: int, rows: int = 8, distinct: int = 2,
            reps: int = 5) -> list[dict]:
  """The table's two rows (ring, whole rows) at one cache length."""
  reserve = SEGMENT * (reps + 1)
  prompt_len = length - reserve
  if prompt_len < 1:
    raise ValueError(f"length {length} leaves no room for a prompt before {reserve} "
                     f"reserved tokens")
  model = models.create_model(cfg, seed=0)
  prompts = make_prompts(rows, distinct, prompt_len, cfg.vocab_size)
  arms = {"ring": Sampler(model, max_len=length),
          "whole rows": Sampler(model, max_len=length, extend_chunk=length)}
  del model
  states, info, first = {}, {}, {}
  for name, sampler in arms.items():
    _, decode = sampler.compile(rows, prompt_len, reserve, distinct_prompts=distinct,
                                temperature=0.0)
    compiles = sampler.num_compiles
    memory = decode.memory_analysis()
    start = time.perf_counter()
    out = sampler.generate(prompts, max_new_tokens=1, temperature=0.0, keep_cache=True,
                           reserve_tokens=reserve)
    prefill_s = time.perf_counter() - start
    assert sampler.num_compiles == compiles, "generate compiled other programs than compile"
    assert out.stats["cache_len"] == length, (out.stats, length)
    states[name] = out.resume_state
    first[name] = out.tokens[:, 0]
    leaves = jax.tree.leaves(states[name].cache)
    info[name] = dict(
        slots=models.sliding_cache_slots(cfg, length, sampler.extend_chunk),
        cache=sum(x.nbytes for x in leaves),
        temp=memory.temp_size_in_bytes if memory else None,
        args=memory.argument_size_in_bytes if memory else None,
        prefill=prefill_s)
  assert np.array_equal(first["ring"], first["whole rows"]), "prefill tokens differ"

  times = {name: [] for name in arms}
  tokens = {name: [] for name in arms}
  for rep in range(reps + 1):  # the first segment warms up
    for name, sampler in arms.items():
      start = time.perf_counter()
      out = sampler.resume(states[name], range(rows), max_new_tokens=SEGMENT)
      elapsed = time.perf_counter() - start
      states[name] = out.resume_state
      assert (out.lengths == SEGMENT).all(), out.lengths
      tokens[name].append(out.tokens)
      if rep:
        times[name].append(elapsed / SEGMENT)
  for rep, (ring, whole) in enumerate(zip(tokens["ring"], tokens["whole rows"])):
    if not np.array_equal(ring, whole):
      raise AssertionError(f"segment {rep} at length {length}: the arms' greedy tokens "
                           f"differ in {int((ring != whole).sum())} of {ring.size}")
  del states

  ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
  base = info["whole rows"]
  out = []
  for name in arms:
    i = info[name]
    row = {"length": length, "arm": name, "sliding slots": i["slots"],
           "cache MiB": round(i["cache"] / MIB, 1),
           "decode ms/token (median)": round(ms[name], 2)}
    if i["temp"] is not None:
      row["decode temp MiB"] = round(i["temp"] / MIB, 1)
      row["decode args MiB"] = round(i["args"] / MIB, 1)
    row["prefill s (1 run)"] = round(i["prefill"], 1)
    row["cache / whole"] = round(i["cache"] / base["cache"], 3)
    row["time / whole"] = round(ms[name] / ms["whole rows"], 2)
    out.append(row)
  return out


def run(quick: bool = False, lengths=(4096, 16384), rows: int = 8, distinct: int = 2,
        reps: int = 5, scan: bool = True) -> list[dict]:
  """The table's rows (`benchmarks.run` calls run(quick): one length, 2048, 3 repeats)."""
  if quick:
    lengths, reps = (2048,), 3
  cfg = gemma_config(scan)
  out = []
  for length in lengths:
    out += measure(cfg, int(length), rows, distinct, reps)
  return out


def _lengths(text: str) -> list[int]:
  try:
    values = [int(x) for x in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"expected comma-separated integers, got {text!r}") from None
  if not values or any(v < 1024 for v in values):
    raise argparse.ArgumentTypeError(f"lengths must be at least 1024, got {text!r}")
  return values


def _bool(text: str) -> bool:
  if text.lower() in ("1", "true", "yes"):
    return True
  if text.lower() in ("0", "false", "no"):
    return False
  raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def _head() -> str:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                        capture_output=True, text=True, check=False)
  return proc.stdout.strip() or "unknown"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", type=_lengths, default=[4096, 16384])
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--prompts", type=int, default=2,
                      help="distinct prompts among the rows (each prefilled once)")
  parser.add_argument("--reps", type=int, default=5, help="timed resume segments per arm")
  parser.add_argument("--scan", type=_bool, default=True)
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  if args.rows % args.prompts or args.reps < 1:
    parser.error("--rows must be a multiple of --prompts, and --reps at least 1")
  if args.quick:
    args.lengths, args.reps = [2048], 3
  cfg = gemma_config(args.scan)
  command = " ".join(["python -m benchmarks.sliding_cache",
                      *(sys.argv[1:] if argv is None else argv)])
  print(f"`{command}` at {_head()}, jax {jax.__version__} on "
        f"{jax.devices()[0].platform} ({os.cpu_count()} cores)")
  print(f"{cfg.num_layers} layers ({cfg.sliding_layers.count(True)} sliding, window "
        f"{cfg.sliding_window}), D {cfg.d_model}, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} kv, head_dim {cfg.head_dim}, F {cfg.ffn_dim}, V "
        f"{cfg.vocab_size}, {cfg.dtype}, scan_layers {cfg.scan_layers}; {args.rows} rows "
        f"({args.prompts} prompts), greedy; decode: median of {args.reps} resumes of "
        f"{SEGMENT} tokens, arms interleaved, in the last {SEGMENT * (args.reps + 1)} "
        f"positions:\n", flush=True)
  start = time.perf_counter()
  rows = run(False, args.lengths, args.rows, args.prompts, args.reps, args.scan)
  print("| " + " | ".join(rows[0]) + " |")
  print("|" + "---|" * len(rows[0]))
  for row in rows:
    print("| " + " | ".join(f"{v:,}" if isinstance(v, (int, float)) else str(v)
                            for v in row.values()) + " |")
  print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
