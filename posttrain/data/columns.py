"""Tokenized examples as flat columns, and a directory cache of them, memory-mapped.

Each token field of the examples (`prompt_tokens`, ...) is one flat int32 array with int64
offsets: example i's field is `flat[offsets[i]:offsets[i + 1]]`, a view. An optional
per-example scalar is a value array with a presence mask (strings as int32 codes into a
table). Where each example came from is a (file index, line number) pair. So a million
rows cost a few arrays, not a million dicts, and they load with `np.load(mmap_mode="r")`.

A cache entry is a directory of one .npy file per array and a `meta.json` (format version,
counts, tables, file list). It is written into a temporary sibling and renamed into
place, so a reader sees a whole entry or none; processes racing to write the same entry
each rename their own and the first one stays. An entry that does not read back whole is
a miss (`CacheEntryError`), never a crash.

Each entry records its files' paths, sizes and modification times (`file_stats`). When a
load writes a new entry it prunes the directory (`prune`): entries a day old whose files
have since changed or gone, entries of an older format, and temporary or moved-aside
directories left for an hour by a killed process. None of these can be read again.
"""

from __future__ import annotations

import array
import fnmatch
import hashlib
import json
import operator
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

# Bump when the layout below or the way rows become tokens changes: older entries then
# sit under other keys and are never read.
# 2: chat formats render reasoning, Qwen's tool turns and gpt-oss's earlier turns anew.
# 3: a row's "tools" and its messages' "tool_calls" are rendered (they were ignored).
# 4: ChatML tokenizers whose templates write XML tool calls (Qwen3.5, Qwen3-Coder) are
#    rendered by their own templates, and a template-rendered assistant message's tool
#    calls are trained (only its content was).
FORMAT_VERSION = 4


class CacheEntryError(ValueError):
  """A cache entry that exists but does not read back whole (partial, corrupt, stale)."""


def array_names(token_fields: Iterable[str], scalars: Mapping[str, type]) -> list[str]:
  """The arrays (and .npy files) holding examples with these fields."""
  names = []
  for field in token_fields:
    names += [field, f"{field}.offsets"]
  for name in scalars:
    names += [name, f"{name}.present"]
  return names + ["source_file", "source_line"]


class ColumnBuilder:
  """Collects examples one at a time into the flat arrays (`finish`).

  Tokens are appended to growable C arrays (`array.array`, which reallocates in place
  where it can and leaves its spare capacity untouched), so the peak is about the tokens
  themselves, not a list of per-row arrays joined at the end."""

  def __init__(self, token_fields: Sequence[str], scalars: Mapping[str, type]):
    self.token_fields, self.scalars = tuple(token_fields), dict(scalars)
    self._tokens = {f: array.array("i") for f in self.token_fields}
    self._lengths = {f: array.array("q") for f in self.token_fields}
    self._values = {n: array.array("d" if kind is float else "i")
                    for n, kind in self.scalars.items()}
    self._present = {n: bytearray() for n in self.scalars}
    self._codes: dict[str, dict[str, int]] = {n: {} for n, kind in self.scalars.items()
                                              if kind is str}
    self._file, self._line = array.array("i"), array.array("q")

  def __len__(self) -> int:
    return len(self._line)

  def add(self, example: Mapping[str, Any], file_index: int, line: int) -> None:
    for field in self.token_fields:
      tokens = np.asarray(example[field], np.int32)
      self._tokens[field].frombytes(tokens.tobytes())
      self._lengths[field].append(len(tokens))
    for name, kind in self.scalars.items():
      present = name in example
      self._present[name].append(present)
      if kind is str:
        value = self._codes[name].setdefault(example[name], len(self._codes[name])
                                             ) if present else -1
      else:
        value = kind(example[name]) if present else 0
      self._values[name].append(value)
    self._file.append(file_index)
    self._line.append(line)

  def finish(self) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """(arrays by `array_names`, string tables of the str scalars); the builder is spent."""
    arrays = {}
    for field in self.token_fields:
      arrays[field] = np.frombuffer(self._tokens[field], np.int32)  # no copy
      offsets = np.zeros(len(self) + 1, np.int64)
      np.cumsum(np.frombuffer(self._lengths[field], np.int64), out=offsets[1:])
      arrays[f"{field}.offsets"] = offsets
    for name, kind in self.scalars.items():
      arrays[name] = np.array(self._values[name], np.float64 if kind is float else np.int32)
      arrays[f"{name}.present"] = np.frombuffer(bytes(self._present[name]), np.bool_).copy()
    arrays["source_file"] = np.array(self._file, np.int32)
    arrays["source_line"] = np.array(self._line, np.int64)
    for a in arrays.values():
      a.flags.writeable = False  # examples are views: writing one would change the data
    return arrays, {n: list(codes) for n, codes in self._codes.items()}


def check_arrays(arrays: Mapping[str, np.ndarray], token_fields: Sequence[str],
                 scalars: Mapping[str, type], count: int, strings: Mapping[str, list],
                 files: int) -> None:
  """Raises CacheEntryError unless the arrays hold `count` whole examples."""
  def need(ok, what):
    if not ok:
      raise CacheEntryError(what)

  for field in token_fields:
    flat, offsets = arrays[field], arrays[f"{field}.offsets"]
    need(flat.dtype == np.int32 and flat.ndim == 1, f"{field} is not a flat int32 array")
    need(offsets.dtype == np.int64 and offsets.shape == (count + 1,),
         f"{field}.offsets does not have {count + 1} int64 entries")
    need(offsets[0] == 0 and offsets[-1] == len(flat), f"{field}.offsets do not span it")
  for name, kind in scalars.items():
    need(arrays[name].shape == (count,) and arrays[f"{name}.present"].shape == (count,),
         f"{name} does not have {count} entries")
    if kind is str:
      need(int(arrays[name].max(initial=-1)) < len(strings[name]), f"{name} codes overflow")
  need(arrays["source_file"].shape == (count,) and arrays["source_line"].shape == (count,),
       f"sources do not have {count} entries")
  need(int(arrays["source_file"].max(initial=0)) < files, "source_file overflows the files")


def file_stats(files: Sequence[str]) -> list[list]:
  """[absolute path, size, modification time in ns] of each file: what a key depends on."""
  stats = []
  for path in files:
    st = os.stat(path)
    stats.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
  return stats


def cache_key(kind: str, row_len: int, files: Sequence[str], fingerprint: str) -> str:
  """sha256 of what decides an entry's contents: the format, the data kind, row_len, each
  file's absolute path, size and modification time, and the tokenizer."""
  text = json.dumps([FORMAT_VERSION, kind, int(row_len), file_stats(files), fingerprint])
  return hashlib.sha256(text.encode()).hexdigest()


def read_entry(entry: str, names: Sequence[str]) -> tuple[dict[str, np.ndarray], dict]:
  """(arrays memory-mapped read-only, meta) of a cache entry; FileNotFoundError when there
  is none, CacheEntryError when it does not read back whole."""
  if not os.path.isdir(entry):
    raise FileNotFoundError(entry)
  try:
    with open(os.path.join(entry, "meta.json"), encoding="utf-8") as f:
      meta = json.load(f)
    if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
      raise CacheEntryError(f"format version is not {FORMAT_VERSION}")
    arrays = {n: np.asarray(np.load(os.path.join(entry, f"{n}.npy"), mmap_mode="r"))
              for n in names}
  except CacheEntryError:
    raise
  except (OSError, ValueError, EOFError) as e:
    raise CacheEntryError(" ".join(str(e).split()) or type(e).__name__) from None
  return arrays, meta


def write_entry(entry: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], *,
                replace: bool = False) -> None:
  """Writes an entry atomically (a temporary sibling, renamed). When another process put
  the entry there first, keeps theirs; with `replace`, first moves an existing (broken)
  entry aside. Raises OSError when the directory cannot be written."""
  parent = os.path.dirname(entry)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(entry)}.tmp-", dir=parent)
  try:
    for name, a in arrays.items():
      with open(os.path.join(tmp, f"{name}.npy"), "wb") as f:
        np.save(f, a)
        f.flush()
        os.fsync(f.fileno())  # whole files before the rename makes them visible
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
      json.dump(dict(meta), f)
    if replace:
      _remove(entry)
    try:
      os.replace(tmp, entry)
    except OSError:
      if not os.path.isdir(entry):
        raise
      # Another process renamed its copy in first: the same contents, keep theirs.
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _remove(entry: str) -> bool:
  """Moves an entry aside, then deletes it: readers holding its files keep them, and a
  reader never sees it half deleted. False when there was none."""
  stale = f"{entry}.stale-{uuid.uuid4().hex[:8]}"
  try:
    os.replace(entry, stale)
  except FileNotFoundError:
    return False
  shutil.rmtree(stale, ignore_errors=True)
  return True


def prune(directory: str, *, keep: Iterable[str] = (), tmp_age_s: float = 3600.0,
          stale_age_s: float = 86400.0, now: float | None = None,
          sizes: dict[str, int] | None = None) -> list[str]:
  """Removes from the top level of `directory` what no load can read again; returns the
  paths removed.

  That is entries whose files changed (size or modification time) or went away since they
  were written, per their meta's `file_stats`, once the entry is `stale_age_s` old (hosts
  that share a cache directory but each read their own copy of the files, copied at
  different times, see each other's entries as changed: the grace keeps a run's entries
  through its restarts); entries of an older format; and temporary
  (`.*.tmp-*`) or moved-aside (`*.stale-*`) directories not modified for `tmp_age_s`
  seconds before `now` (a live writer's are younger). Never the names in `keep`, entries
  without `file_stats` or with an unreadable meta.json, entries of a newer format, nor
  anything but directories. An entry is moved aside before it is deleted, so a reader
  sees it whole or not at all. What cannot be judged or removed (permissions, another
  process removing it first) is skipped. With `sizes`, each removed path's bytes go there.
  """
  now = time.time() if now is None else now
  keep = set(keep)
  try:
    with os.scandir(directory) as it:
      items = list(it)
  except OSError:
    return []
  removed = []
  for item in items:
    try:
      if item.name in keep or not item.is_dir(follow_symlinks=False):
        continue
      if any(fnmatch.fnmatchcase(item.name, p) for p in (".*.tmp-*", "*.stale-*")):
        if now - _last_modified(item.path) < tmp_age_s:
          continue
        size = _bytes(item.path)
        shutil.rmtree(item.path)
      elif _outdated(item.path, written_before=now - stale_age_s):
        size = _bytes(item.path)
        if not _remove(item.path):
          continue
      else:
        continue
    except OSError:
      continue
    removed.append(item.path)
    if sizes is not None:
      sizes[item.path] = size
  return removed


def _outdated(entry: str, written_before: float) -> bool:
  """Whether an entry is of an older format, or was written before `written_before` and its
  files changed since; False when that cannot be told (no entry, an unreadable meta, no
  `file_stats`)."""
  meta_path = os.path.join(entry, "meta.json")
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
    written = os.stat(meta_path).st_mtime
  except (OSError, ValueError):
    return False
  if not isinstance(meta, dict) or "key" not in meta:  # not one of ours
    return False
  version = meta.get("version")
  if type(version) is int and version < FORMAT_VERSION:
    return True
  stats = meta.get("file_stats")
  if version != FORMAT_VERSION or not isinstance(stats, list) or not all(
      isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) for s in stats):
    return False
  if written >= written_before:
    return False
  for path, size, mtime_ns in stats:
    try:
      st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
      return True
    if [st.st_size, st.st_mtime_ns] != [size, mtime_ns]:
      return True
  return False


def _last_modified(path: str) -> float:
  """The newest modification time of a directory and what it holds (a slow writer's
  file keeps changing after the directory stops)."""
  newest = os.stat(path, follow_symlinks=False).st_mtime
  with os.scandir(path) as it:
    for child in it:
      newest = max(newest, child.stat(follow_symlinks=False).st_mtime)
  return newest


def _bytes(path: str) -> int:
  total = 0
  for root, _, names in os.walk(path):
    total += sum(os.lstat(os.path.join(root, n)).st_size for n in names)
  return total


class LazySequence(Sequence):
  """A read-only sequence whose items are computed on access (`get(i)`); a slice is a list.
  Equal to any sequence with equal items."""

  def __init__(self, length: int, get: Callable[[int], Any]):
    self._length, self._get = length, get

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self._get(i) for i in range(*index.indices(self._length))]
    i = operator.index(index)
    if i < 0:
      i += self._length
    if not 0 <= i < self._length:
      raise IndexError(f"index {index} out of range for {self._length} items")
    return self._get(i)

  def __eq__(self, other) -> bool:
    if not isinstance(other, Sequence) or isinstance(other, str):
      return NotImplemented
    return len(self) == len(other) and all(a == b for a, b in zip(self, other))

  __hash__ = None

  def __repr__(self) -> str:
    return f"<{self._length} items>"
