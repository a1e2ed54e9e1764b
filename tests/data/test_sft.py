"""SFT data files: both row formats, the loss mask, hostile rows, long rows and the stream."""

import json

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


@pytest.mark.parametrize("line, message", [
    ("{not json", "f:3: not valid JSON"),
    ("[1, 2]", "f:3: a row must be a JSON object"),
    ('{"text": "hi"}', "f:3: a row needs 'messages', or 'prompt' and 'completion'"),
    ('{"prompt": "hi"}', "a row needs 'messages', or 'prompt' and 'completion'"),
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
])
def test_hostile_rows_fail_naming_file_and_line(tmp_path, line, message):
  good = {"prompt": "q", "completion": "a"}
  path = _write(tmp_path / "f", [good, "", line])  # line 3 (a blank line is skipped)
  with pytest.raises(ValueError, match="^" + str(tmp_path / "f") + ":3: ") as e:
    SFTData.from_files(path, TOK, row_len=64)
  assert message in str(e.value) and "\n" not in str(e.value)


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
