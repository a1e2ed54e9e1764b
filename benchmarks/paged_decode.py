"""Paged vs contiguous KV cache: one decode step's time, and the memory of rows sharing a prompt.

    python -m benchmarks.paged_decode [--quick] [--repeats=30]

1. Time: one decode step (q_len 1) of `kernels.paged_decode_attention` against
   `kernels.decode_attention` on the same keys and values: batch 16, 8 heads, 2 kv heads,
   head_dim 64, f32, a 2048-slot cache per row, rows filled to random lengths (seeded,
   64-2048). The contiguous side holds [16, 2048, 2, 64] and reads it in 512-slot chunks
   (its default); the paged side holds the same slots in one pool of pages of 16 or 64
   slots, every row's pages shuffled through the pool, and gathers about 512 slots a
   block (its default). Lengths and page table are traced arguments of the jitted step;
   the arms run in turn, round by round, after one warm-up call each; figures are
   medians over the rounds. Before timing, the two outputs are checked to agree.
2. Memory: G = 8 rows sampled from one 1024-token prompt, each with a 1024-token
   completion budget (max_len 2048), K and V in f32. Contiguous: every row holds its own
   [2048, 2, 64] cache, prompt included. Paged: the prompt's pages once, shared by the 8
   tables, plus each row's completion pages: allocated for the whole budget, or only the
   pages the completion fills when the completions stop at random lengths (1-1024,
   seeded). Bytes counted from the pages the tables actually name.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels

BATCH, HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 16, 8, 2, 64, 2048
PAGE_SIZES = (16, 64)
GROUP, PROMPT, COMPLETION = 8, 1024, 1024
MiB = 2**20


def _shuffled_table(page_size: int, seed: int) -> np.ndarray:
  """Every row's pages at shuffled places in a pool of BATCH * MAX_LEN / page_size."""
  per_row = MAX_LEN // page_size
  rng = np.random.default_rng(seed)
  return rng.permutation(BATCH * per_row).reshape(BATCH, per_row).astype(np.int32)


def _paged_pool(cache, table):
  """[b, max_len, kvh, d] -> pool [b * pages_per_row, page_size, kvh, d] holding the same
  slots where the table says."""
  b, per_row = table.shape
  page_size = cache.shape[1] // per_row
  pool = np.empty((b * per_row, page_size, *cache.shape[2:]), cache.dtype)
  pool[table] = cache.reshape(b, per_row, page_size, *cache.shape[2:])
  return jnp.asarray(pool)


def _time_rounds(arms: dict, repeats: int) -> dict[str, float]:
  """Median seconds of each arm (a no-argument callable), the arms run in turn."""
  for fn in arms.values():
    jax.block_until_ready(fn())  # warm: compiled, buffers allocated
  times = {name: [] for name in arms}
  for _ in range(repeats):
    for name, fn in arms.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def decode_step_times(repeats: int) -> list[dict]:
  rng = np.random.default_rng(0)
  shape = (BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)
  q = jnp.asarray(rng.standard_normal((BATCH, 1, HEADS, HEAD_DIM), np.float32))
  k = rng.standard_normal(shape, np.float32)
  v = rng.standard_normal(shape, np.float32)
  lengths = jnp.asarray(rng.integers(64, MAX_LEN + 1, BATCH), jnp.int32)
  contiguous = jax.jit(lambda q, k, v, lengths: kernels.decode_attention(
      q, k, v, lengths=lengths))
  paged = jax.jit(lambda q, kp, vp, table, lengths: kernels.paged_decode_attention(
      q, kp, vp, page_table=table, lengths=lengths))
  k_dev, v_dev = jnp.asarray(k), jnp.asarray(v)
  arms = {"contiguous": lambda: contiguous(q, k_dev, v_dev, lengths)}
  for page_size in PAGE_SIZES:
    table = _shuffled_table(page_size, seed=page_size)
    kp, vp = _paged_pool(k, table), _paged_pool(v, table)
    arms[page_size] = (lambda kp=kp, vp=vp, table=jnp.asarray(table):
                       paged(q, kp, vp, table, lengths))
  want = np.asarray(arms["contiguous"]())
  diffs = {p: float(np.max(np.abs(np.asarray(arms[p]()) - want))) for p in PAGE_SIZES}
  for p, diff in diffs.items():
    if diff > 1e-4:
      raise AssertionError(f"page size {p}: paged and contiguous differ by {diff}")
  medians = _time_rounds(arms, repeats)
  base = medians["contiguous"]
  return [{"measure": "decode step, median ms", "page_size": p,
           "contiguous": round(1e3 * base, 3), "paged": round(1e3 * medians[p], 3),
           "paged/contiguous": round(medians[p] / base, 2),
           "note": (f"batch {BATCH}, {HEADS} heads / {KV_HEADS} kv, d {HEAD_DIM}, "
                    f"{MAX_LEN} slots, lengths 64-{MAX_LEN}, {repeats} rounds, "
                    f"max |diff| {diffs[p]:.1e}")}
          for p in PAGE_SIZES]


def shared_prompt_tables(page_size: int, completion_lengths) -> np.ndarray:
  """Tables of GROUP rows sharing the prompt's pages: page ids [GROUP, pages_per_row],
  -1 where a row's completion allocated no page."""
  prompt_pages = -(-PROMPT // page_size)
  per_row = -(-(PROMPT + COMPLETION) // page_size)
  table = np.full((GROUP, per_row), -1, np.int64)
  table[:, :prompt_pages] = np.arange(prompt_pages)  # one copy, in every table
  next_id = prompt_pages
  for row, n in enumerate(completion_lengths):
    used = -(-(PROMPT + n) // page_size) - prompt_pages  # pages its completion fills
    table[row, prompt_pages:prompt_pages + used] = np.arange(next_id, next_id + used)
    next_id += used
  return table


def shared_prompt_memory() -> list[dict]:
  slot_bytes = 2 * KV_HEADS * HEAD_DIM * np.dtype(np.float32).itemsize  # K and V
  contiguous = GROUP * (PROMPT + COMPLETION) * slot_bytes
  sampled = np.random.default_rng(1).integers(1, COMPLETION + 1, GROUP)
  rows = []
  for label, completions in ((f"{COMPLETION} each (full budget)", [COMPLETION] * GROUP),
                             (f"random 1-{COMPLETION}, pages as filled", sampled)):
    for page_size in PAGE_SIZES:
      table = shared_prompt_tables(page_size, completions)
      pages = len(np.unique(table[table >= 0]))
      paged = pages * page_size * slot_bytes
      rows.append({"measure": f"KV MiB, {GROUP} rows sharing a {PROMPT}-token prompt, "
                              f"completions {label}",
                   "page_size": page_size, "contiguous": round(contiguous / MiB, 2),
                   "paged": round(paged / MiB, 2),
                   "paged/contiguous": round(paged / contiguous, 3),
                   "note": f"{pages} pages; contiguous: {GROUP} x {PROMPT + COMPLETION} slots"})
  return rows


def run(quick: bool = False, repeats: int | None = None) -> list[dict]:
  """Time rows (one per page size) then memory rows; ratios paged / contiguous."""
  return decode_step_times(repeats or (10 if quick else 30)) + shared_prompt_memory()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="10 rounds instead of 30")
  parser.add_argument("--repeats", type=int, default=None, help="timed rounds")
  args = parser.parse_args()
  from benchmarks.run import table  # the markdown table BENCHMARKS.md uses

  print(table(run(args.quick, args.repeats)))
  print(f"(jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{len(jax.devices())} device(s))")


if __name__ == "__main__":
  main()
