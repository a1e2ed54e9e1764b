"""SFT data files: both row formats, the loss mask, hostile rows, long rows and the stream."""

import json
import os
import threading

import grain
import numpy as np
import pytest

from posttrain.data import ByteTokenizer
from posttrain.data.sft import SFTData, encode_conversation, parse_row
from posttrain.rl import packing

TOK = ByteTokenizer()
END = TOK.special_ids["<|end|>"]


def _write(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def _trained_text(example):
  ids = example["response_tokens"][example["response_mask"] != 0]
  return [int(i) for i in ids]


def test_both_formats_give_the_conversation_the_chat_template_masks():
  messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}]
  a = parse_row(json.dumps({"messages": messages, "id": 7}), "f:1")
  b = parse_row(json.dumps({"prompt": messages[:2], "completion": "4"}), "f:2")
  assert a == b
  ex = encode_conversation(a, TOK)
  ids, mask = TOK.encode_chat(messages)
  first = mask.index(1)
  np.testing.assert_array_equal(ex["prompt_tokens"], ids[:first])
  np.testing.assert_array_equal(ex["response_tokens"], ids[first:])
  assert _trained_text(ex) == TOK.encode("4") + [END]
  # A plain-string prompt is one user turn.
  c = parse_row(json.dumps({"prompt": "2+2?", "completion": "4"}), "f:3")
  assert c == [{"role": "user", "content": "2+2?", "weight": 1},
               {"role": "assistant", "content": "4", "weight": 1}]


def test_every_assistant_turn_trains_unless_its_weight_is_0_and_trailing_context_goes():
  messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x", "weight": 0},
              {"role": "user", "content": "b"}, {"role": "assistant", "content": "y"},
              {"role": "tool", "content": "t"}, {"role": "assistant", "content": "z"},
              {"role": "user", "content": "thanks"}]
  ex = encode_conversation(parse_row(json.dumps({"messages": messages}), "f:1"), TOK)
  assert _trained_text(ex) == TOK.encode("y") + [END] + TOK.encode("z") + [END]
  # The weight-0 turn is context: it sits in the prompt, before the first trained token.
  assert TOK.encode("x")[0] in ex["prompt_tokens"].tolist()
  # Nothing after the last trained token: the closing user turn is dropped.
  assert ex["response_tokens"][-1] == END and ex["response_mask"][-1] == 1
  # The tool turn between trained turns is kept, untrained.
  tool = TOK.special_ids["<|tool|>"]
  assert ex["response_mask"][ex["response_tokens"].tolist().index(tool)] == 0


def test_reasoning_is_kept_and_trained_in_reasoning_formats(tmp_path):
  """A row's reasoning reaches the chat format: Qwen3 trains on its <think> block."""
  from tests.data.test_reasoning import QWEN3_SPECIALS, _text, _write_tokenizer
  tok = _write_tokenizer(tmp_path, QWEN3_SPECIALS)
  row = {"prompt": "2+2?", "completion": [
      {"role": "assistant", "content": "4", "reasoning_content": "add them", "id": 1}]}
  messages = parse_row(json.dumps(row), "f:1")
  assert messages[1] == {"role": "assistant", "content": "4", "weight": 1,
                         "reasoning_content": "add them"}
  ex = encode_conversation(messages, tok)
  trained = ex["response_tokens"][ex["response_mask"] != 0].tolist()
  assert _text(tok, trained) == "<think>\nadd them\n</think>\n\n4<|im_end|>"


@pytest.mark.parametrize("line, message", [
    ("{not json", "f:3: not valid JSON"),
    ("[1, 2]", "f:3: a row must be a JSON object"),
    ('{"txt": "hi"}', "f:3: a row needs 'messages', 'prompt' and 'completion', or 'text'"),
    ('{"prompt": "hi"}', "a row needs 'messages', 'prompt' and 'completion', or 'text'"),
    ('{"text": "  "}', "'text' must be a non-empty string"),
    ('{"text": 3}', "'text' must be a non-empty string"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0] has role 'robot'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0] content must be a string"),
    ('{"messages": [{"role": "user", "content": "a"}]}', "no assistant message to train on"),
    ('{"messages": [{"role": "user", "content": "a"}, '
     '{"role": "assistant", "content": "b", "weight": 0}]}', "no assistant message to train on"),
    ('{"messages": [{"role": "user", "content": "a", "weight": 0}]}',
     "weight is for assistant messages"),
    ('{"messages": [{"role": "assistant", "content": "a", "weight": 0.5}]}',
     "weight must be 0 or 1"),
    ('{"prompt": "a", "completion": [{"role": "user", "content": "b"}]}',
     "'completion' holds ['user'] messages"),
    ('{"prompt": "a", "completion": "b", "messages": []}', "not both"),
    ('{"messages": [{"role": "user", "content": "a", "thinking": "t"}, '
     '{"role": "assistant", "content": "b"}]}',
     "messages[0] thinking must be an assistant message's string"),
    ('{"messages": [{"role": "user", "content": "a"}, '
     '{"role": "assistant", "content": "b", "reasoning_content": 3}]}',
     "messages[1] reasoning_content must be an assistant message's string"),
    # The byte tokenizer's format has no reasoning: an error, not a silent drop.
    ('{"messages": [{"role": "user", "content": "a"}, '
     '{"role": "assistant", "content": "b", "reasoning_content": "r"}]}',
     "the plain chat format has no reasoning"),
])
def test_hostile_rows_fail_naming_file_and_line(tmp_path, line, message):
  good = {"prompt": "q", "completion": "a"}
  path = _write(tmp_path / "f", [good, "", line])  # line 3 (a blank line is skipped)
  with pytest.raises(ValueError, match="^" + str(tmp_path / "f") + ":3: ") as e:
    SFTData.from_files(path, TOK, row_len=64)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_text_rows_train_on_every_token_after_the_first(tmp_path, qwen3):
  """TRL's language-modeling rows: bos (where the format opens with one), the text and eos,
  all trained on but the first token; beside conversations in the same file."""
  path = _write(tmp_path / "t.jsonl", [{"text": "hello world"}, {"prompt": "q",
                                                                  "completion": "a"}])
  data = SFTData.from_files(path, TOK, row_len=64)
  ex = data.example(0)
  ids = list(TOK.chat.bos) + TOK.encode("hello world") + [TOK.eos_id]
  assert ex["prompt_tokens"].tolist() == ids[:1]
  assert ex["response_tokens"].tolist() == ids[1:] and ex["response_mask"].all()
  assert len(data) == 2
  # Qwen's format has no bos: the text's first token is the context.
  q = SFTData.from_files(path, qwen3, row_len=64).example(0)
  assert q["prompt_tokens"].tolist() == qwen3.encode("hello world")[:1]
  assert q["response_tokens"].tolist()[-1] == qwen3.eos_id


def test_missing_and_empty_files_are_one_line_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="SFT data file not found"):
    SFTData.from_files(str(tmp_path / "nope.jsonl"), TOK, row_len=64)
  with pytest.raises(ValueError, match="holds no rows"):
    SFTData.from_files(_write(tmp_path / "e", ["", "  "]), TOK, row_len=64)
  with pytest.raises(ValueError, match="no SFT data files"):
    SFTData.from_files(" , ", TOK, row_len=64)


def test_rows_too_long_are_cut_or_dropped_and_counted(tmp_path, caplog):
  rows = [{"prompt": "q" * 10, "completion": "a" * 100},    # longer than the row: cut
          {"prompt": "p" * 70, "completion": "a"},           # prompt beyond the row: dropped
          {"prompt": "q", "completion": "a"}]
  data = SFTData.from_files(_write(tmp_path / "f", rows), TOK, row_len=64)
  assert (len(data), data.dropped, data.truncated) == (2, 1, 1)
  assert data.sources == [f"{tmp_path / 'f'}:1", f"{tmp_path / 'f'}:3"]
  assert "dropped 1 of 3 rows" in caplog.text and f"{tmp_path / 'f'}:2" in caplog.text
  packed = packing.pack_trajectories(data.examples, 64, truncate=True)
  assert packed["tokens"].shape[1] == 64 and packed["loss_mask"].sum() > 0
  with pytest.raises(ValueError, match=r"every SFT row's first trained token lies beyond "
                     r"row_len=4 \(first: .*:1\)"):
    SFTData.from_files(_write(tmp_path / "g", rows), TOK, row_len=4)


def test_several_files_and_the_stream_visits_every_row_once_an_epoch(tmp_path):
  a = _write(tmp_path / "a.jsonl", [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(4)])
  b = _write(tmp_path / "b.jsonl", [{"prompt": f"r{i}", "completion": f"b{i}"} for i in range(3)])
  data = SFTData.from_files(f"{a}, {b}", TOK, row_len=64)
  assert len(data) == 7 and data.sources[4] == f"{b}:1"
  assert data.trained_tokens == sum(len(TOK.encode(f"a{i}")) + 1 for i in range(4)) + sum(
      len(TOK.encode(f"b{i}")) + 1 for i in range(3))

  def key(ex):
    return tuple(ex["response_tokens"].tolist())

  ds = data.dataset(seed=1)
  epochs = [[key(ds[e * 7 + i]) for i in range(7)] for e in range(3)]
  every = sorted(key(ex) for ex in data.examples)
  for epoch in epochs:
    assert sorted(epoch) == every
  assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # reshuffled every epoch
  assert all(ds[i]["advantages"] == 1.0 for i in range(3))
  # Two shards interleaved are the unsharded stream.
  s0, s1 = data.dataset(seed=1, shard=(0, 2)), data.dataset(seed=1, shard=(1, 2))
  assert [key(x) for i in range(5) for x in (s0[i], s1[i])] == [key(ds[i]) for i in range(10)]
  # The iterator resumes where it stopped.
  it = iter(ds.to_iter_dataset())
  [next(it) for _ in range(9)]
  state = it.get_state()
  rest = [key(next(it)) for _ in range(6)]
  again = iter(data.dataset(seed=1).to_iter_dataset())
  again.set_state(state)
  assert [key(next(again)) for _ in range(6)] == rest


def _rows(count, seed=0):
  """Rows of both formats and varied lengths: the third too long to train (dropped at
  row_len 64), the sixth longer than the row (cut)."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(count):
    answer = "x" * int(rng.integers(1, 30))
    if i % 3:
      rows.append({"prompt": f"q{i}", "completion": answer})
    else:
      rows.append({"messages": [{"role": "user", "content": f"u{i}"},
                                {"role": "assistant", "content": "a", "weight": 0},
                                {"role": "user", "content": "more"},
                                {"role": "assistant", "content": answer}]})
  rows[2] = {"prompt": "p" * 70, "completion": "a"}
  if count > 5:
    rows[5] = {"prompt": "q", "completion": "a" * 90}
  return rows


def _row_by_row(paths, row_len):
  """The examples as the loader made them before its columns: one encode_line per row."""
  out = []
  for path in paths:
    for number, line in enumerate(open(path), 1):
      if line.strip():
        example, prompt, _ = SFTData.encode_line(line, f"{path}:{number}", TOK)
        if prompt + 1 <= row_len:
          out.append(example)
  return out


def _assert_same(got, want):
  assert list(got) == list(want)  # the keys, in order
  for key, value in want.items():
    if isinstance(value, np.ndarray):
      assert got[key].dtype == value.dtype, key
      np.testing.assert_array_equal(got[key], value, err_msg=key)
    else:
      assert type(got[key]) is type(value) and got[key] == value, key


class CountingTokenizer(ByteTokenizer):
  calls = 0

  def encode(self, text):
    CountingTokenizer.calls += 1
    return super().encode(text)


@pytest.mark.parametrize("cached", [False, True])
def test_columns_give_the_row_by_row_examples_and_the_same_stream(tmp_path, cached):
  a = _write(tmp_path / "a.jsonl", _rows(11)[:6] + [""] + _rows(11)[6:])
  b = _write(tmp_path / "b.jsonl", _rows(5, seed=1))
  cache = str(tmp_path / "cache") if cached else None
  data = SFTData.from_files([a, b], TOK, row_len=64, cache_dir=cache)
  if cached:  # the second load reads the entry the first wrote
    data = SFTData.from_files([a, b], TOK, row_len=64, cache_dir=cache)
    assert not data.arrays["prompt_tokens"].flags.writeable
  want = _row_by_row([a, b], 64)
  assert len(data) == len(data.examples) == len(want) == 14
  for got, expected in zip(data.examples, want):
    _assert_same(got, expected)
  _assert_same(data.examples[-1], want[-1])
  assert [len(x["prompt_tokens"]) for x in data.examples[3:6]] == [
      len(x["prompt_tokens"]) for x in want[3:6]]
  with pytest.raises(IndexError):
    data.examples[len(want)]
  assert data.sources[2] == f"{a}:4" and data.sources[-1] == f"{b}:5" and len(data.sources) == 14
  assert (data.dropped, data.truncated) == (2, 1)
  assert data.trained_tokens == sum(int(x["response_mask"].sum()) for x in want)
  # The stream the list of dicts gave, element for element, sharded or not.
  old = grain.MapDataset.range(len(want)).shuffle(seed=4).repeat().map(
      lambda i: {**want[int(i)], "advantages": np.float32(1.0)})
  ds, shard = data.dataset(seed=4), data.dataset(seed=4, shard=(1, 3))
  for i in range(3 * len(want)):
    _assert_same(ds[i], old[i])
  for i in range(len(want)):
    _assert_same(shard[i], old[3 * i + 1])


def test_a_second_load_memory_maps_the_cache_without_tokenizing(tmp_path, caplog):
  caplog.set_level("INFO", logger="posttrain")
  path = _write(tmp_path / "f.jsonl", _rows(9))
  CountingTokenizer.calls = 0
  first = SFTData.from_files(path, CountingTokenizer(), row_len=64, cache_dir=str(tmp_path))
  assert CountingTokenizer.calls > 0 and "cache miss" in caplog.text
  (entry,) = [p for p in tmp_path.iterdir() if p.name.startswith("sft-")]
  assert (entry / "meta.json").exists() and (entry / "response_mask.offsets.npy").exists()
  CountingTokenizer.calls = 0
  caplog.clear()
  again = SFTData.from_files(path, CountingTokenizer(), row_len=64, cache_dir=str(tmp_path))
  assert CountingTokenizer.calls == 0
  assert f"cache hit, 8 rows memory-mapped from {entry}" in caplog.text
  assert "dropped 1 of 9 rows" in caplog.text  # the warnings come back with the entry
  assert (again.dropped, again.truncated, again.trained_tokens) == (
      first.dropped, first.truncated, first.trained_tokens)
  assert again.sources == first.sources == _row_sources(path, skip={3})
  for x, y in zip(again.examples, first.examples):
    _assert_same(x, y)
  # A tokenizer without a fingerprint is never cached.
  plain = type("Plain", (CountingTokenizer,), {"fingerprint": None})()
  CountingTokenizer.calls = 0
  SFTData.from_files(path, plain, row_len=64, cache_dir=str(tmp_path))
  assert CountingTokenizer.calls > 0 and len(list(tmp_path.glob("sft-*"))) == 1


def _row_sources(path, skip):
  count = len(open(path).read().splitlines())
  return [f"{path}:{n}" for n in range(1, count + 1) if n not in skip]


def test_a_changed_file_row_len_or_tokenizer_is_a_new_entry(tmp_path):
  path = tmp_path / "f.jsonl"
  _write(path, _rows(6))
  cache = str(tmp_path / "cache")

  def load(tok=None, row_len=64):
    CountingTokenizer.calls = 0
    data = SFTData.from_files(str(path), tok or CountingTokenizer(), row_len=row_len,
                              cache_dir=cache)
    return data, CountingTokenizer.calls > 0

  assert load()[1] and not load()[1]
  st = os.stat(path)
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # touched: unchanged bytes
  assert load()[1] and not load()[1]
  _write(path, _rows(6) + [{"prompt": "new", "completion": "row"}])
  data, tokenized = load()
  assert tokenized and len(data) == 6 and data.sources[-1] == f"{path}:7"
  assert load(row_len=32)[1] and not load(row_len=32)[1]
  other = type("OtherTokenizer", (CountingTokenizer,), {})()
  assert load(other)[1] and not load(other)[1]
  assert len(os.listdir(cache)) == 5


@pytest.mark.parametrize("damage", ["delete_npy", "truncate_npy", "garble_meta",
                                    "old_version", "meta_not_an_object"])
def test_a_broken_entry_is_rebuilt_not_a_crash(tmp_path, caplog, damage):
  path = _write(tmp_path / "f.jsonl", _rows(7))
  cache = tmp_path / "cache"
  SFTData.from_files(path, CountingTokenizer(), row_len=64, cache_dir=str(cache))
  (entry,) = cache.iterdir()
  if damage == "delete_npy":
    (entry / "response_tokens.npy").unlink()
  elif damage == "truncate_npy":
    npy = entry / "prompt_tokens.npy"
    npy.write_bytes(npy.read_bytes()[:100])
  elif damage == "garble_meta":
    (entry / "meta.json").write_text('{"version": 1, "cou')
  else:
    meta = json.loads((entry / "meta.json").read_text())
    meta = {**meta, "version": 0} if damage == "old_version" else [meta]
    (entry / "meta.json").write_text(json.dumps(meta))
  CountingTokenizer.calls = 0
  again = SFTData.from_files(path, CountingTokenizer(), row_len=64, cache_dir=str(cache))
  assert CountingTokenizer.calls > 0
  assert f"cache entry {entry} is unreadable" in caplog.text
  assert len(again) == 6
  for x, y in zip(again.examples, _row_by_row([path], 64)):
    _assert_same(x, y)
  assert [p.name for p in cache.iterdir()] == [entry.name]  # rewritten in place, no litter
  CountingTokenizer.calls = 0
  SFTData.from_files(path, CountingTokenizer(), row_len=64, cache_dir=str(cache))
  assert CountingTokenizer.calls == 0


def test_an_unwritable_cache_warns_and_the_data_still_load(tmp_path, caplog):
  path = _write(tmp_path / "f.jsonl", _rows(4))
  (tmp_path / "file").write_text("")  # a file where the cache's parent should be
  data = SFTData.from_files(path, TOK, row_len=64, cache_dir=str(tmp_path / "file" / "cache"))
  assert len(data) == 3 and caplog.text.count("could not cache the tokenized rows") == 1
  for x, y in zip(data.examples, _row_by_row([path], 64)):
    _assert_same(x, y)


def test_processes_racing_to_write_one_entry_all_load_it(tmp_path, monkeypatch, caplog):
  """The hosts of a job share a cache: each misses, tokenizes and writes the same entry;
  the first rename stays, the others keep theirs out of the way, nobody fails."""
  caplog.set_level("INFO", logger="posttrain")
  path = _write(tmp_path / "f.jsonl", _rows(8))
  cache = tmp_path / "cache"
  racers = 4
  barrier = threading.Barrier(racers)
  tokenize = SFTData._tokenize.__func__

  def tokenize_then_wait(cls, *args):
    data = tokenize(cls, *args)
    barrier.wait(timeout=30)  # every racer has missed before any writes
    return data

  monkeypatch.setattr(SFTData, "_tokenize", classmethod(tokenize_then_wait))
  loaded = [None] * racers

  def load(i):
    loaded[i] = SFTData.from_files(path, TOK, row_len=64, cache_dir=str(cache))

  threads = [threading.Thread(target=load, args=(i,)) for i in range(racers)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  entries = list(cache.iterdir())  # one entry, no temporary directories left
  assert len(entries) == 1 and entries[0].name.startswith("sft-")
  assert caplog.text.count("cache miss, cached in") == racers
  assert "could not cache" not in caplog.text
  want = _row_by_row([path], 64)
  for data in loaded:
    for x, y in zip(data.examples, want):
      _assert_same(x, y)
