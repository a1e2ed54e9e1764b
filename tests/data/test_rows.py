"""Data files in every format users have them: JSON lines, JSON arrays, gzip, Parquet."""

import builtins
import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.data import ByteTokenizer
from posttrain.data.preference import PreferenceData, UnpairedData
from posttrain.data.rows import drop_nulls, file_format, read_rows
from posttrain.data.sft import SFTData

TOK = ByteTokenizer()

# Conversations whose messages differ in their keys, as a Parquet struct column makes them
# all carry every key (absent ones null).
SFT_ROWS = [
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]},
    {"messages": [{"role": "system", "content": "terse"},
                  {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "a", "weight": 0},
                  {"role": "user", "content": "again"},
                  {"role": "assistant", "content": "hello"}]},
    {"prompt": "Capital of France?", "completion": "Paris"},
]
PAIRS = [
    {"prompt": "2+2?", "chosen": "4", "rejected": "5", "margin": 1.5},
    {"prompt": "hi", "chosen": "hello", "rejected": "go away"},
]


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n\n" for r in rows))
  return str(path)


def _parquet(path, rows):
  """The rows as one table whose columns are the union of their keys (as datasets writes)."""
  pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path, row_group_size=2)
  return str(path)


def _all_formats(tmp_path, rows):
  gz = tmp_path / "rows.jsonl.gz"
  with gzip.open(gz, "wt", encoding="utf-8") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  array = tmp_path / "rows.json"
  array.write_text("  \n" + json.dumps(rows, indent=1))
  lines = tmp_path / "lines.json"
  lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return {"jsonl": _jsonl(tmp_path / "rows.jsonl", rows), "gz": str(gz), "array": str(array),
          "json_lines": str(lines), "parquet": _parquet(tmp_path / "rows.parquet", rows)}


def _parsed(path):
  return [(where.rsplit(":", 1)[1], json.loads(row) if isinstance(row, str) else row)
          for where, row in read_rows(path)]


def test_every_format_reads_the_same_rows(tmp_path):
  rows = [{"prompt": "a", "answer": 1, "meta": {"k": [1, 2]}}, {"prompt": "b", "answer": 2}]
  paths = _all_formats(tmp_path, rows)
  numbered = list(zip(["1", "2"], rows))
  assert _parsed(paths["gz"]) == _parsed(paths["json_lines"]) == numbered
  assert _parsed(paths["array"]) == numbered
  assert _parsed(paths["jsonl"]) == [("1", rows[0]), ("3", rows[1])]  # lines, blanks skipped
  # Parquet's struct column gives every row every key: the absent ones come back dropped.
  assert _parsed(paths["parquet"]) == numbered


def test_drop_nulls_keeps_list_items_and_falsy_values():
  assert drop_nulls({"a": None, "b": [None, {"c": None, "d": 0}], "e": "", "f": False}) == {
      "b": [None, {"d": 0}], "e": "", "f": False}


def test_a_large_parquet_file_is_read_in_batches_in_order(tmp_path):
  rows = [{"i": i} for i in range(2500)]
  path = _parquet(tmp_path / "big.parquet", rows)
  got = list(read_rows(path))
  assert [r["i"] for _, r in got] == list(range(2500))
  assert got[-1][0] == f"{path}:2500"


@pytest.mark.parametrize("name, kind", [
    ("a.jsonl", "jsonl"), ("a.json", "json"), ("a.JSON.gz", "json"), ("a.jsonl.gz", "jsonl"),
    ("a.parquet", "parquet"), ("a.txt", "jsonl"), ("dir.parquet/a", "jsonl")])
def test_the_format_follows_the_name(name, kind):
  assert file_format(name) == kind


@pytest.mark.parametrize("name, content, message", [
    ("bad.json", b"[{\"a\": 1}, ", "not a valid JSON array"),
    ("bad.json", b"[{\"a\": 1}, 3]", ":2: a row must be a JSON object, got int"),
    ("bad.jsonl.gz", b"not gzip at all", "unreadable"),
    ("bad.parquet", b"PAR1 this is not parquet", "not a readable Parquet file"),
    ("bad.jsonl", b"{\"a\": 1}\n\xff\xfe\n", ":2: not UTF-8 text"),
    ("bad.parquet.gz", b"x", "drop the .gz"),
])
def test_broken_files_fail_in_one_line_naming_the_file(tmp_path, name, content, message):
  path = tmp_path / name
  path.write_bytes(content)
  with pytest.raises(ValueError, match=message) as e:
    list(read_rows(path))
  assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_missing_file_and_missing_pyarrow(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match="nope.parquet"):
    list(read_rows(tmp_path / "nope.parquet"))
  path = _parquet(tmp_path / "rows.parquet", [{"a": 1}])
  real_import = builtins.__import__

  def no_pyarrow(name, *args, **kwargs):
    if name.startswith("pyarrow"):
      raise ImportError("No module named 'pyarrow'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_pyarrow)
  with pytest.raises(ImportError, match=r"pip install 'posttrain\[parquet\]'"):
    list(read_rows(path))


def _examples(data):
  return [data.example(i) for i in range(len(data))]


def _assert_same_examples(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert sorted(x) == sorted(y)
    for key in x:
      if isinstance(x[key], np.ndarray):
        np.testing.assert_array_equal(x[key], y[key], err_msg=key)
      else:
        assert x[key] == y[key], key


@pytest.mark.parametrize("cls, rows", [(SFTData, SFT_ROWS), (PreferenceData, PAIRS),
                                       (UnpairedData, PAIRS)])
def test_sft_and_preference_data_load_the_same_examples_from_every_format(tmp_path, cls, rows):
  paths = _all_formats(tmp_path, rows)
  want = _examples(cls.from_files(paths["json_lines"], TOK, row_len=256))
  for kind in ("gz", "array", "parquet"):
    data = cls.from_files(paths[kind], TOK, row_len=256, cache_dir=str(tmp_path / "cache"))
    _assert_same_examples(_examples(data), want)
    again = cls.from_files(paths[kind], TOK, row_len=256, cache_dir=str(tmp_path / "cache"))
    _assert_same_examples(_examples(again), want)  # memory-mapped from the cache


def test_a_bad_parquet_row_names_its_row(tmp_path):
  rows = SFT_ROWS + [{"messages": [{"role": "user", "content": "no answer"}]}]
  path = _parquet(tmp_path / "chat.parquet", rows)
  with pytest.raises(ValueError, match=r"chat\.parquet:4: no assistant message"):
    SFTData.from_files(path, TOK, row_len=256)


def test_globs_expand_to_sorted_files_and_shards_share_a_stem(tmp_path):
  from posttrain.data.rows import expand, shard_stem
  for i in (1, 0, 2):
    _parquet(tmp_path / f"train-0000{i}-of-00003.parquet", [{"i": i}])
  (tmp_path / "notes.txt").write_text("x")
  files = expand(f" {tmp_path}/train-*.parquet , ,{tmp_path}/notes.txt")
  assert [p.rsplit("/", 1)[1] for p in files] == [
      "train-00000-of-00003.parquet", "train-00001-of-00003.parquet",
      "train-00002-of-00003.parquet", "notes.txt"]
  assert {shard_stem(p) for p in files[:3]} == {"train"}
  assert shard_stem("a/gsm8k.jsonl.gz") == "gsm8k" and shard_stem("x-1-of-2.json") == "x-1-of-2"
  with pytest.raises(FileNotFoundError, match=r"'.*/test-\*\.parquet': the pattern matches"):
    expand(f"{tmp_path}/test-*.parquet")
  # SFT data from a sharded split: every shard's rows, in shard order.
  rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)]
  for i, row in enumerate(rows):
    _parquet(tmp_path / f"sft-0000{i}-of-00003.parquet", [row])
  data = SFTData.from_files(f"{tmp_path}/sft-*.parquet", TOK, row_len=64)
  want = SFTData.from_files(_jsonl(tmp_path / "sft.jsonl", rows), TOK, row_len=64)
  _assert_same_examples(_examples(data), _examples(want))


def _save_to_disk(directory, shards):
  """A dataset as `datasets`' save_to_disk writes one (5.x): Arrow streams named in
  state.json, beside dataset_info.json."""
  directory.mkdir(parents=True)
  files = []
  for k, rows in enumerate(shards):
    name = f"data-{k:05d}-of-{len(shards):05d}.arrow"
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(directory / name), "wb") as sink:
      with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    files.append({"filename": name})
  (directory / "state.json").write_text(json.dumps({"_data_files": files, "_split": None}))
  (directory / "dataset_info.json").write_text("{}")
  return directory


def test_a_saved_dataset_directory_reads_as_its_arrow_files(tmp_path):
  from posttrain.data.rows import expand, shard_stem
  rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)]
  saved = _save_to_disk(tmp_path / "sft" / "train", [rows[:2], rows[2:]])
  files = expand(str(saved))
  assert [f.rsplit("/", 1)[1] for f in files] == ["data-00000-of-00002.arrow",
                                                   "data-00001-of-00002.arrow"]
  assert [r for f in files for _, r in read_rows(f)] == rows
  assert shard_stem(str(saved) + "/") == "train"
  data = SFTData.from_files(str(saved), TOK, row_len=64)
  want = SFTData.from_files(_jsonl(tmp_path / "sft.jsonl", rows), TOK, row_len=64)
  _assert_same_examples(_examples(data), _examples(want))
  # An Arrow file (not a stream) reads too.
  table = pa.Table.from_pylist(rows)
  with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink:
    with pa.ipc.new_file(sink, table.schema) as writer:
      writer.write_table(table)
  assert [r for _, r in read_rows(tmp_path / "file.arrow")] == rows


def test_saved_dataset_mistakes_are_one_line_errors(tmp_path):
  from posttrain.data.rows import expand
  (tmp_path / "dd").mkdir()
  (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
  with pytest.raises(ValueError, match=r"holds the splits train, test: give one, e\.g\. .*dd/"
                                       r"train"):
    expand(str(tmp_path / "dd"))
  (tmp_path / "plain").mkdir()
  with pytest.raises(ValueError, match="not a dataset saved with save_to_disk"):
    expand(str(tmp_path / "plain"))
  saved = _save_to_disk(tmp_path / "cut", [[{"a": i} for i in range(50)]])
  arrow = saved / "data-00000-of-00001.arrow"
  arrow.write_bytes(arrow.read_bytes()[:-200])
  with pytest.raises(ValueError, match=r"cut/data-00000-of-00001\.arrow: unreadable"):
    list(read_rows(arrow))
