"""Rows of a data file, as the SFT, preference and task loaders read them.

    for where, row in read_rows("train.parquet"):   # ("train.parquet:1", {...}), ...
        ...

The format follows the file's name:

- ``.jsonl`` (and any other name): JSON lines, one object per line; blank lines skipped.
- ``.json``: JSON lines, or one JSON array of objects (as ``datasets``' ``to_json(lines=
  False)`` and many hand-made files hold them).
- ``.parquet``: Apache Parquet, as Hugging Face datasets and veRL's preprocessing scripts
  write them (needs ``pyarrow``: ``pip install 'posttrain[parquet]'``). Read a batch at a
  time, so a large file is never held whole.
- ``.arrow``: an Arrow stream (or file), as ``datasets`` writes them; and a directory
  ``Dataset.save_to_disk`` wrote stands for its Arrow files, in order (`expand`).
- a ``.gz`` suffix on a JSON name: gzip-compressed.

``where`` names the row for error messages as ``path:N``: N is the line for JSON lines and
the 1-based row for arrays and Parquet. A JSON-lines row comes back as its text (parsed by
the loader, which names the line if it is not JSON); the others as dicts. A Parquet
struct column holds every key of every row, absent ones as null, so null values inside
objects are dropped: a message without ``tool_calls`` reads as one without the key.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

PARQUET_BATCH_ROWS = 1024
_BROKEN = (gzip.BadGzipFile, EOFError, zlib.error, OSError)  # a damaged or truncated .gz


def expand(paths: str | Sequence[str], what: str = "data") -> list[str]:
  """A comma-separated string or a sequence of paths as a list of files: ``~`` expanded,
  empty entries dropped, and each glob (``data/train-*.parquet``, as Hugging Face shards a
  split) replaced by the files it matches, sorted. A glob that matches nothing is a
  FileNotFoundError naming it."""
  if isinstance(paths, str):
    paths = paths.split(",")
  out = []
  for p in paths:
    if not p or not p.strip():
      continue
    p = os.path.expanduser(p.strip())
    if os.path.isdir(p):
      out += saved_dataset_files(p)
    elif glob.has_magic(p):
      matched = sorted(m for m in glob.glob(p) if os.path.isfile(m))
      if not matched:
        raise FileNotFoundError(f"{what} files {p!r}: the pattern matches no file")
      out += matched
    else:
      out.append(p)
  return out


def saved_dataset_files(directory: str) -> list[str]:
  """The Arrow files of a dataset `datasets` saved with ``save_to_disk``, in its order
  (its ``state.json``); a saved DatasetDict is refused, naming its splits."""
  splits = os.path.join(directory, "dataset_dict.json")
  state = os.path.join(directory, "state.json")
  try:
    if os.path.exists(splits):
      with open(splits, encoding="utf-8") as f:
        names = json.load(f).get("splits", [])
      raise ValueError(f"{directory} holds the splits {', '.join(map(str, names))}: give "
                       f"one, e.g. {os.path.join(directory, str(names[0]) if names else '')}")
    if not os.path.exists(state):
      raise ValueError(f"{directory} is a directory but not a dataset saved with "
                       "save_to_disk (no state.json); give its files")
    with open(state, encoding="utf-8") as f:
      files = [os.path.join(directory, d["filename"]) for d in json.load(f)["_data_files"]]
  except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
    raise ValueError(f"{directory}: unreadable saved dataset ({e})") from None
  if not files:
    raise ValueError(f"{directory}: the saved dataset has no data files")
  return files


def shard_stem(path: str) -> str:
  """A file's name without its extensions and Hugging Face's shard suffix:
  ``train-00000-of-00004.parquet`` -> ``train``, ``gsm8k.jsonl.gz`` -> ``gsm8k``."""
  name = os.path.basename(path.rstrip(os.sep))
  if name.lower().endswith(".gz"):
    name = name[:-3]
  name = os.path.splitext(name)[0]
  return re.sub(r"-\d{5}-of-\d{5}$", "", name) or name


def file_format(path: str) -> str:
  """``"parquet"``, ``"json"`` (lines or an array) or ``"jsonl"``, from the name."""
  name = os.path.basename(path).lower()
  if name.endswith(".gz"):
    name = name[:-3]
  if name.endswith((".parquet", ".arrow")):
    if path.lower().endswith(".gz"):
      raise ValueError(f"{path}: Arrow and Parquet files are compressed inside; drop the .gz")
    return "parquet" if name.endswith(".parquet") else "arrow"
  return "json" if name.endswith(".json") else "jsonl"


def read_rows(path: str | os.PathLike) -> Iterator[tuple[str, str | dict]]:
  """Yields ``(where, row)`` for every row of ``path``, in order (see the module doc)."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"data file not found: {path!r}")
  kind = file_format(path)
  if kind in ("parquet", "arrow"):
    yield from _arrow_rows(path, kind)
    return
  with _open_binary(path) as f:
    if kind == "json" and _first_byte(f, path) == b"[":
      try:
        rows = json.loads(_decode(f.read(), path))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a valid JSON array: {e}") from None
      except _BROKEN as e:
        raise ValueError(f"{path}: unreadable: {e}") from None
      for number, row in enumerate(rows, 1):
        yield f"{path}:{number}", _object(row, f"{path}:{number}")
      return
    number = 0
    try:
      for number, line in enumerate(f, 1):
        if line.strip():
          yield f"{path}:{number}", _decode(line, f"{path}:{number}")
    except _BROKEN as e:
      raise ValueError(f"{path}: unreadable: {e}") from None


def _open_binary(path: str):
  return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _decode(data: bytes, where: str) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{where}: not UTF-8 text: {e}") from None


def _first_byte(f, path: str) -> bytes:
  """The first non-space byte of a file (the file is rewound)."""
  try:
    while chunk := f.read(4096):
      if stripped := chunk.lstrip():
        return stripped[:1]
    return b""
  except _BROKEN as e:
    raise ValueError(f"{path}: unreadable: {e}") from None
  finally:
    f.seek(0)


def _object(row: Any, where: str) -> dict:
  if not isinstance(row, dict):
    raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
  return row


def _arrow_rows(path: str, kind: str) -> Iterator[tuple[str, dict]]:
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    raise ImportError(f"{path}: reading {kind.capitalize()} needs pyarrow: pip install "
                      "'posttrain[parquet]'") from None
  try:
    if kind == "parquet":
      batches = pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS)
    else:  # an Arrow stream, as datasets' save_to_disk and cache write them, or a file
      source = pa.memory_map(path)
      try:
        batches = iter(pa.ipc.open_stream(source))
      except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
  except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
    raise ValueError(f"{path}: not a readable {kind.capitalize()} file: "
                     f"{' '.join(str(e).split())}") from None
  number = 0
  while True:
    try:
      batch = next(batches, None)
    except Exception as e:  # noqa: BLE001 - a truncated or damaged file
      raise ValueError(f"{path}: unreadable after row {number}: "
                       f"{' '.join(str(e).split())}") from None
    if batch is None:
      return
    for row in batch.to_pylist():
      number += 1
      yield f"{path}:{number}", drop_nulls(row)


def drop_nulls(value: Any) -> Any:
  """``value`` with the null-valued keys of every object in it removed (lists keep their
  nulls: a null item is the data's, not the schema's)."""
  if isinstance(value, dict):
    return {k: drop_nulls(v) for k, v in value.items() if v is not None}
  if isinstance(value, list):
    return [drop_nulls(v) for v in value]
  return value
