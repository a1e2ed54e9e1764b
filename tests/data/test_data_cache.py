"""Housekeeping of the tokenized-data cache: what `columns.prune` removes and keeps."""

import hashlib
import json
import os
import shutil
import time

import pytest

from posttrain.data import ByteTokenizer, columns
from posttrain.data.sft import SFTData

HOUR = 3600.0
DAY = 24 * HOUR


class CountingTokenizer(ByteTokenizer):
  calls = 0

  def encode(self, text):
    CountingTokenizer.calls += 1
    return super().encode(text)


def _write(path, count, seed=0):
  rows = [{"prompt": f"q{seed}-{i}", "completion": "a" * (i + 1)} for i in range(count)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _load(path, cache, row_len=64):
  """(data, whether it was tokenized rather than read from the cache)."""
  CountingTokenizer.calls = 0
  data = SFTData.from_files(path, CountingTokenizer(), row_len=row_len, cache_dir=str(cache))
  return data, CountingTokenizer.calls > 0


def _names(directory):
  return set(os.listdir(directory))


def _new_entry(cache, before, path, row_len=64):
  assert _load(path, cache, row_len)[1]
  (name,) = _names(cache) - before
  return name


def _edit_meta(entry, edit):
  meta = json.loads((entry / "meta.json").read_text())
  edit(meta)
  (entry / "meta.json").write_text(json.dumps(meta))


def _age(path, seconds):
  t = time.time() - seconds
  os.utime(path, (t, t))


def test_an_edited_files_entry_goes_when_its_new_one_is_written_and_others_stay(
    tmp_path, caplog):
  caplog.set_level("INFO", logger="posttrain")
  cache = tmp_path / "cache"
  edited, other = tmp_path / "edited.jsonl", tmp_path / "other.jsonl"
  _write(edited, 4)
  _write(other, 3, seed=1)
  young_file = tmp_path / "young.jsonl"
  _write(young_file, 2, seed=2)
  old = _new_entry(cache, set(), str(edited))
  kept = _new_entry(cache, {old}, str(other))
  kept_32 = _new_entry(cache, {old, kept}, str(other), row_len=32)
  young = _new_entry(cache, {old, kept, kept_32}, str(young_file))
  for name in (old, kept, kept_32):
    _age(cache / name / "meta.json", 2 * DAY)

  for path, count in ((edited, 5), (young_file, 3)):  # a row appended to each
    _write(path, count)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
  caplog.clear()
  data, tokenized = _load(str(edited), cache)
  assert tokenized and len(data) == 5 and data.sources[-1] == f"{edited}:5"
  # The day-old entry of the edited file goes; the young one of an edited file stays
  # (another host's copy of the files may be what it was written from).
  assert old not in _names(cache) and {kept, kept_32, young} < _names(cache)
  assert len(_names(cache)) == 4  # the new entry, no moved-aside leftovers
  assert f"SFT data cache: removed 1 stale entries (0.0 MiB) from {cache}" in caplog.text
  fresh = SFTData.from_files(str(edited), ByteTokenizer(), row_len=64)
  assert list(data.sources) == list(fresh.sources)
  for x, y in zip(data.examples, fresh.examples):
    assert {k: v.tolist() for k, v in x.items()} == {k: v.tolist() for k, v in y.items()}
  assert not _load(str(edited), cache)[1]
  assert not _load(str(other), cache)[1] and not _load(str(other), cache, row_len=32)[1]


def test_the_entry_of_a_deleted_file_is_removed(tmp_path):
  cache = tmp_path / "cache"
  gone, stays = tmp_path / "gone.jsonl", tmp_path / "stays.jsonl"
  _write(gone, 3)
  _write(stays, 3, seed=1)
  gone_entry = _new_entry(cache, set(), str(gone))
  stays_entry = _new_entry(cache, {gone_entry}, str(stays))
  gone.unlink()
  assert columns.prune(str(cache)) == []  # written less than a day ago
  assert columns.prune(str(cache), now=time.time() + 2 * DAY) == [str(cache / gone_entry)]
  assert _names(cache) == {stays_entry}


def test_old_formats_go_entries_it_cannot_judge_stay(tmp_path):
  cache = tmp_path / "cache"
  path = _write(tmp_path / "f.jsonl", 3)
  entries = {}
  for row_len in (20, 24, 28, 32, 36, 40):
    entries[row_len] = _new_entry(cache, set(entries.values()), path, row_len)
  old, no_stats, garbled, newer, foreign, fine = (cache / entries[n] for n in sorted(entries))
  _edit_meta(old, lambda m: m.update(version=0))
  _edit_meta(no_stats, lambda m: m.pop("file_stats"))  # written before entries had them
  (garbled / "meta.json").write_text('{"version": 1, "fi')
  _edit_meta(newer, lambda m: m.update(version=columns.FORMAT_VERSION + 1))
  (foreign / "meta.json").write_text(json.dumps({"version": 0}))  # not one of ours
  # Even with its file changed, only the old format goes.
  os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))
  _edit_meta(fine, lambda m: m.update(file_stats=columns.file_stats([path])))
  assert columns.prune(str(cache)) == [str(old)]
  assert _names(cache) == {p.name for p in (no_stats, garbled, newer, foreign, fine)}


def test_old_leftovers_go_young_ones_files_and_kept_names_stay(tmp_path):
  cache = tmp_path / "cache"
  path = _write(tmp_path / "f.jsonl", 3)
  entry = _new_entry(cache, set(), path)
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "meta.json").write_text(json.dumps({"key": "k", "version": 0}))  # outdated
  names = {"old_tmp": f".{entry}.tmp-ab12cd", "old_stale": f"{entry}.stale-0a1b2c3d",
           "young_tmp": f".{entry}.tmp-ef34gh", "young_stale": f"{entry}.stale-4e5f6a7b",
           "old_tmp_writing": f".{entry}.tmp-ij56kl", "kept": f".{entry}.tmp-mn78op",
           "not_ours": "notes"}
  for key, name in names.items():
    (cache / name).mkdir()
    (cache / name / "a.npy").write_bytes(b"x" * 1000)
    if key != "old_tmp_writing":
      _age(cache / name / "a.npy", 2 * HOUR)
    if not key.startswith("young"):
      _age(cache / name, 2 * HOUR)
  for name in (f".{entry}.tmp-file", f"{entry}.stale-file"):  # files, not directories
    (cache / name).write_text("x")
    _age(cache / name, 2 * HOUR)
  for name in (f"{entry}.stale-link", "sft-link"):  # links to a directory elsewhere
    os.symlink(outside, cache / name)
    t = time.time() - 2 * HOUR
    os.utime(cache / name, (t, t), follow_symlinks=False)
  os.unlink(path)  # the entry is outdated too, but kept by name
  sizes = {}
  removed = columns.prune(str(cache), keep=(entry, names["kept"]), sizes=sizes)
  assert sorted(removed) == sorted(str(cache / names[k]) for k in ("old_tmp", "old_stale"))
  assert sizes == {p: 1000 for p in removed}
  assert _names(cache) == {entry, f".{entry}.tmp-file", f"{entry}.stale-file",
                           f"{entry}.stale-link", "sft-link"} | {
      names[k] for k in ("young_tmp", "young_stale", "old_tmp_writing", "kept", "not_ours")}
  assert os.listdir(outside) == ["meta.json"]
  # Judged against `now`: an hour on, the young ones are old too.
  later = columns.prune(str(cache), keep=(entry,), now=time.time() + 2 * HOUR)
  assert sorted(later) == sorted(str(cache / names[k]) for k in (
      "young_tmp", "young_stale", "old_tmp_writing", "kept"))


def test_the_cache_key_is_what_it_was(tmp_path):
  path = _write(tmp_path / "f.jsonl", 3)
  st = os.stat(path)
  tok = ByteTokenizer()
  text = json.dumps([4, "SFT", 64, [[os.path.abspath(path), st.st_size, st.st_mtime_ns]],
                     tok.fingerprint])
  key = hashlib.sha256(text.encode()).hexdigest()
  assert columns.cache_key("SFT", 64, [path], tok.fingerprint) == key
  SFTData.from_files(path, tok, row_len=64, cache_dir=str(tmp_path / "cache"))
  (entry,) = (tmp_path / "cache").iterdir()
  meta = json.loads((entry / "meta.json").read_text())
  assert entry.name == f"sft-{key[:32]}" and meta["key"] == key
  assert meta["file_stats"] == [[os.path.abspath(path), st.st_size, st.st_mtime_ns]]


def test_errors_are_skipped_not_raised(tmp_path, monkeypatch, caplog):
  cache = tmp_path / "cache"
  paths = [_write(tmp_path / f"{i}.jsonl", 3, seed=i) for i in range(3)]
  entries = []
  for path in paths:
    entries.append(_new_entry(cache, set(entries), path))
  leftover = cache / f".{entries[0]}.tmp-ab12cd"
  leftover.mkdir()
  _age(leftover, 2 * HOUR)
  for path, entry in zip(paths, entries):
    os.unlink(path)
    _age(cache / entry / "meta.json", 2 * DAY)
  real_remove, real_rmtree, real_scandir = columns._remove, shutil.rmtree, os.scandir

  def remove(entry):
    if entry.endswith(entries[0]):
      raise PermissionError(13, "Permission denied", entry)
    if entry.endswith(entries[1]):  # another process removed it first
      real_rmtree(entry)
    return real_remove(entry)

  def rmtree(path, *args, **kwargs):
    if path == str(leftover):
      raise PermissionError(13, "Permission denied", path)
    return real_rmtree(path, *args, **kwargs)

  monkeypatch.setattr(columns, "_remove", remove)
  monkeypatch.setattr(columns.shutil, "rmtree", rmtree)
  assert columns.prune(str(cache)) == [str(cache / entries[2])]
  assert _names(cache) >= {entries[0], leftover.name}

  def scandir(path="."):
    if os.fspath(path) == str(cache):
      raise PermissionError(13, "Permission denied", path)
    return real_scandir(path)

  monkeypatch.setattr(columns.os, "scandir", scandir)
  assert columns.prune(str(cache)) == []
  assert columns.prune(str(tmp_path / "missing")) == []
  # A load whose prune fails warns and goes on.
  monkeypatch.undo()

  def failing_prune(*args, **kwargs):
    raise OSError("disk on fire")

  monkeypatch.setattr(columns, "prune", failing_prune)
  data, tokenized = _load(_write(tmp_path / "new.jsonl", 4), cache)
  assert tokenized and len(data) == 4
  assert "SFT data cache: could not prune" in caplog.text and "disk on fire" in caplog.text


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions")
def test_real_permission_errors_are_skipped(tmp_path):
  cache = tmp_path / "cache"
  path = _write(tmp_path / "f.jsonl", 3)
  entry = _new_entry(cache, set(), path)
  os.unlink(path)
  os.chmod(cache, 0o500)  # listable, nothing in it can be moved
  try:
    assert columns.prune(str(cache)) == [] and _names(cache) == {entry}
    os.chmod(cache, 0)
    assert columns.prune(str(cache)) == []
  finally:
    os.chmod(cache, 0o700)


def test_a_hit_does_not_prune(tmp_path, monkeypatch):
  cache = tmp_path / "cache"
  path = _write(tmp_path / "f.jsonl", 3)
  assert _load(path, cache)[1]

  def prune(*args, **kwargs):
    pytest.fail("a cache hit pruned")

  monkeypatch.setattr(columns, "prune", prune)
  assert not _load(path, cache)[1]
