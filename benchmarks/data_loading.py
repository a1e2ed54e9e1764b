"""SFT data loading: the old list of dicts against the columns, uncached and memory-mapped.

    python -m benchmarks.data_loading [--quick] [--rows=100000] [--repeats=3]

Writes a synthetic SFT file (prompt/completion and multi-turn rows of a few hundred bytes,
the byte tokenizer: ~300 tokens a row) and loads it in a fresh process per arm:

  * old: the loader as it was, one dict of small arrays and one "path:line" string a row
    (its loop is kept below, `old_load`);
  * columns: `SFTData.from_files` without a cache: the same parsing and tokenizing into
    flat int32 columns;
  * cache miss: the same, writing the tokenized cache entry;
  * cache hit: `from_files` of the same file again, memory-mapping that entry (just written,
    so in the page cache, as for a restart on the same host).

For each: seconds to load, and the process's resident memory growth (/proc/self/statm)
after the load and after one pass reading every token of every example; "private" is
resident minus shared, the part that is the process's own (a memory-mapped entry's pages
are shared page cache: every process of a host maps the same ones). Medians over
`repeats` processes per arm, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARMS = ("old", "columns", "cache miss", "cache hit")


def write_rows(path: str, rows: int, seed: int = 0) -> None:
  """`rows` SFT rows of a few hundred bytes, both formats."""
  import random
  rng = random.Random(seed)
  words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda"]

  def text(n):
    return " ".join(rng.choice(words) for _ in range(n))

  with open(path, "w", encoding="utf-8") as f:
    for i in range(rows):
      if i % 4:
        row = {"prompt": text(rng.randint(5, 25)), "completion": text(rng.randint(10, 40))}
      else:
        row = {"messages": [{"role": "system", "content": "Answer briefly."},
                            {"role": "user", "content": text(rng.randint(5, 15))},
                            {"role": "assistant", "content": text(rng.randint(5, 20))},
                            {"role": "user", "content": text(rng.randint(3, 10))},
                            {"role": "assistant", "content": text(rng.randint(5, 20))}]}
      f.write(json.dumps(row) + "\n")


def old_load(path: str, tok, row_len: int):
  """The loader before the columns: a list of example dicts and a list of sources."""
  from posttrain.data.sft import SFTData
  examples, sources, dropped, truncated = [], [], 0, 0
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      example, prompt, length = SFTData.encode_line(line, where, tok)
      if prompt + 1 > row_len:
        dropped += 1
        continue
      truncated += length > row_len
      examples.append(example)
      sources.append(where)
  return examples, sources


def _rss_mib() -> tuple[float, float]:
  """(resident, resident minus shared) of this process in MiB."""
  with open("/proc/self/statm") as f:
    _, resident, shared = (int(x) for x in f.read().split()[:3])
  page = os.sysconf("SC_PAGE_SIZE") / 2**20
  return resident * page, (resident - shared) * page


def measure(arm: str, path: str, cache: str, row_len: int = 2048) -> dict:
  """One arm in this process: load seconds and memory growth (`_rss_mib`)."""
  from posttrain.data import ByteTokenizer
  from posttrain.data.sft import SFTData
  tok = ByteTokenizer()
  base, base_private = _rss_mib()
  start = time.perf_counter()
  if arm == "old":
    examples = old_load(path, tok, row_len)[0]
  else:
    data = SFTData.from_files(path, tok, row_len=row_len,
                              cache_dir=None if arm == "columns" else cache)
    examples = data.examples
  seconds = time.perf_counter() - start
  loaded, _ = _rss_mib()
  tokens = 0
  for ex in examples:
    tokens += int(ex["prompt_tokens"].sum()) + int(ex["response_tokens"].sum()) + int(
        ex["response_mask"].sum())
  read, read_private = _rss_mib()
  return {"seconds": seconds, "rss_load": loaded - base, "rss_epoch": read - base,
          "private_epoch": read_private - base_private, "rows": len(examples)}


def run(quick: bool = False, rows: int | None = None, repeats: int | None = None) -> list[dict]:
  rows = rows or (20_000 if quick else 100_000)
  repeats = repeats or (1 if quick else 3)
  results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "sft.jsonl")
    write_rows(path, rows)
    size = os.path.getsize(path)
    for i in range(repeats):
      cache = os.path.join(tmp, f"cache{i}")
      for arm in ARMS:
        cmd = [sys.executable, "-m", "benchmarks.data_loading", f"--measure={arm}",
               f"--file={path}", f"--cache={cache}"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        results[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
    entry = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs)
  base = statistics.median(r["seconds"] for r in results["old"])
  table = []
  for arm, runs in results.items():
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    table.append({"arm": arm, "rows": int(med["rows"]), "file_mib": round(size / 2**20, 1),
                  "load_s": round(med["seconds"], 3),
                  "old_over_arm": round(base / med["seconds"], 1),
                  "rss_after_load_mib": round(med["rss_load"], 1),
                  "rss_after_epoch_mib": round(med["rss_epoch"], 1),
                  "private_after_epoch_mib": round(med["private_epoch"], 1),
                  "cache_entry_mib": round(entry / 2**20, 1) if "cache" in arm else None})
  return table


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--rows", type=int)
  parser.add_argument("--repeats", type=int)
  parser.add_argument("--measure", choices=ARMS, help=argparse.SUPPRESS)
  parser.add_argument("--file", help=argparse.SUPPRESS)
  parser.add_argument("--cache", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.measure:
    print(json.dumps(measure(args.measure, args.file, args.cache)))
    return
  table = run(args.quick, args.rows, args.repeats)
  columns = list(table[0])
  print("| " + " | ".join(columns) + " |")
  print("|" + "---|" * len(columns))
  for row in table:
    print("| " + " | ".join("" if row[c] is None else str(row[c]) for c in columns) + " |")


if __name__ == "__main__":
  main()
