"""Unpaired (KTO) feedback files: TRL's unpaired rows, pairs split in two, hostile rows."""

import json

import grain
import numpy as np
import pytest

from posttrain.data import ByteTokenizer
from posttrain.data.preference import UnpairedData, encode_pair, parse_pair
from tests.data.test_sft import _assert_same

TOK = ByteTokenizer()
END = TOK.special_ids["<|end|>"]


def _write(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def _encode(row, where="f:1"):
  return [x for x, _, _ in UnpairedData.encode_lines(json.dumps(row), where, TOK)]


def test_string_and_message_rows_match_and_encode_as_the_pairs_chosen_answer():
  turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
           {"role": "user", "content": "2+2?"}]
  answer = [{"role": "assistant", "content": "calc"}, {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4"}]
  (short,) = _encode({"prompt": "2+2?", "completion": "4", "label": True})
  (long,) = _encode({"prompt": [turns[2]], "completion": [{"role": "assistant",
                                                           "content": "4"}], "label": True})
  _assert_same(short, long)
  assert list(short) == ["prompt_tokens", "completion_tokens", "completion_mask", "label"]
  assert short["label"] == 1.0
  (example,) = _encode({"prompt": turns, "completion": answer, "label": False})
  pair = encode_pair(*parse_pair(json.dumps({"prompt": turns, "chosen": answer,
                                             "rejected": "5"}), "f:1"), TOK)
  np.testing.assert_array_equal(example["prompt_tokens"], pair["prompt_tokens"])
  np.testing.assert_array_equal(example["completion_tokens"], pair["chosen_tokens"])
  np.testing.assert_array_equal(example["completion_mask"], pair["chosen_mask"])
  assert example["label"] == 0.0
  # The earlier assistant turn is context; the tool turn inside the answer is untrained.
  assert [int(t) for t, m in zip(example["completion_tokens"], example["completion_mask"])
          if m] == TOK.encode("calc") + [END] + TOK.encode("4") + [END]


def test_a_pair_row_becomes_a_desirable_and_an_undesirable_example(tmp_path):
  user = {"role": "user", "content": "2+2?"}
  pairs = [{"prompt": "2+2?", "chosen": "4", "rejected": "5", "margin": 3, "domain": "m"},
           {"chosen": [user, {"role": "assistant", "content": "4"}],
            "rejected": [user, {"role": "assistant", "content": "5"}], "domain": "m"}]
  by_hand = [{"prompt": "2+2?", "completion": "4", "label": True, "domain": "m"},
             {"prompt": "2+2?", "completion": "5", "label": False, "domain": "m"}]
  data = UnpairedData.from_files(_write(tmp_path / "p.jsonl", pairs), TOK, row_len=64)
  hand = UnpairedData.from_files(_write(tmp_path / "u.jsonl", by_hand), TOK, row_len=64)
  assert len(data) == 4 and len(hand) == 2
  assert list(data.sources) == [f"{tmp_path / 'p.jsonl'}:{n}" for n in (1, 1, 2, 2)]
  for i in range(4):
    _assert_same(data.examples[i], hand.examples[i % 2])
  assert [data.item(x)["label"] for x in data.examples] == [True, False, True, False]
  assert (data.desirable, data.undesirable) == (2, 2)
  with pytest.raises(ValueError, match="^f:1: a pair row is two examples"):
    UnpairedData.encode_line(json.dumps(pairs[0]), "f:1", TOK)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "completion": "a"}, "needs a 'label'"),
    ({"prompt": "q", "completion": "a", "label": 1}, "'label' must be true or false, got 1"),
    ({"prompt": "q", "completion": "a", "label": "true"}, "'label' must be true or false"),
    ({"prompt": "q", "completion": "a", "label": None}, "'label' must be true or false"),
    ({"prompt": "q", "label": True}, "a row needs 'prompt', 'completion' and 'label'"),
    ({"completion": "a", "label": True}, "a row needs 'prompt', 'completion' and 'label'"),
    ({"prompt": "q", "completion": "a", "chosen": "a", "rejected": "b", "label": True},
     "not both"),
    ({"prompt": "q", "completion": "a", "rejected": "b", "label": True}, "not both"),
    ({"prompt": "q", "chosen": "a"}, "a pair needs 'chosen' and 'rejected'"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "completion": "b", "label": True}, "prompt must not end with an assistant turn"),
    ({"prompt": "q", "completion": [{"role": "user", "content": "a"}], "label": True},
     "'completion' must be assistant turns"),
    ({"prompt": "q", "completion": [{"role": "assistant", "content": "a", "weight": 0}],
      "label": False}, "'completion' has no assistant message to train on"),
    ("[1, 2]", "a row must be a JSON object"),
    ("{oops", "not valid JSON"),
    ({"prompt": "q", "completion": "a", "label": True, "domain": ""},
     "'domain' must be a non-empty string"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "domain": 3},
     "'domain' must be a non-empty string"),
])
def test_hostile_rows_fail_naming_file_and_line(tmp_path, row, message):
  path = _write(tmp_path / "u.jsonl", [{"prompt": "q", "completion": "a", "label": True}, row])
  with pytest.raises(ValueError, match=f"^{tmp_path / 'u.jsonl'}:2: ") as e:
    UnpairedData.from_files(path, TOK, row_len=64)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_long_rows_are_cut_or_dropped_and_the_stream_covers_each_epoch(tmp_path, caplog):
  rows = [{"prompt": f"q{i}", "completion": f"a{i}", "label": i % 2 == 0} for i in range(5)]
  rows += [{"prompt": "q", "completion": "a" * 80, "label": True},      # cut
           {"prompt": "p" * 80, "completion": "a", "label": False},     # dropped
           {"prompt": "p" * 80, "chosen": "a", "rejected": "b"}]        # both halves dropped
  path = _write(tmp_path / "u.jsonl", rows)
  data = UnpairedData.from_files(path, TOK, row_len=64)
  assert (len(data), data.dropped, data.truncated) == (6, 3, 1)
  assert (data.desirable, data.undesirable) == (4, 2)
  assert "unpaired data: dropped 3 of 9 rows" in caplog.text and f"{path}:7" in caplog.text
  assert "1 of 6 rows are longer than row_len=64" in caplog.text
  ds = data.dataset(seed=3).to_iter_dataset()
  it = iter(ds)
  want = sorted((tuple(x["completion_tokens"].tolist()), x["label"] == 1.0)
                for x in data.examples)
  for _ in range(2):
    epoch = [next(it) for _ in range(6)]
    assert all(type(x["label"]) is bool for x in epoch)
    assert sorted((tuple(x["completion_tokens"].tolist()), x["label"]) for x in epoch) == want


def test_examples_come_back_from_the_cache_as_tokenized(tmp_path, caplog):
  caplog.set_level("INFO", logger="posttrain")
  rows = [{"prompt": f"q{i}", "completion": "a" * (i + 1), "label": i % 3 == 0}
          for i in range(5)]
  rows[1]["domain"] = "math"
  rows.append({"prompt": "q", "chosen": "c", "rejected": "r", "domain": "code"})
  path = _write(tmp_path / "u.jsonl", rows)
  want = [x for n, r in enumerate(rows, 1) for x in _encode(r, f"{path}:{n}")]
  first = UnpairedData.from_files(path, TOK, row_len=64, cache_dir=str(tmp_path / "c"))
  assert "cache miss" in caplog.text
  caplog.clear()
  again = UnpairedData.from_files(path, TOK, row_len=64, cache_dir=str(tmp_path / "c"))
  assert "unpaired data: cache hit, 7 rows memory-mapped" in caplog.text
  assert not again.arrays["completion_tokens"].flags.writeable
  old = grain.MapDataset.range(len(want)).shuffle(seed=2).repeat().map(
      lambda i: {**want[int(i)], "label": want[int(i)]["label"] == 1.0})
  for data in (first, again):
    assert len(data) == 7 and (data.desirable, data.undesirable) == (3, 4)
    for got, expected in zip(data.examples, want):
      _assert_same(got, expected)
    ds = data.dataset(seed=2)
    for i in range(2 * len(want)):
      _assert_same(ds[i], old[i])
  assert [x.get("domain") for x in again.examples] == [
      None, "math", None, None, None, "code", "code"]


def test_summarize_counts_labels():
  rows = [{"prompt": "q", "completion": "a", "label": label}
          for label in (True, False, False, True, False)]
  examples = [_encode(r)[0] for r in rows]
  arrays = {"label": np.array([x["label"] for x in examples])}
  assert UnpairedData.summarize(arrays) == {"desirable": 2, "undesirable": 3}
  assert UnpairedData.summarize({"label": np.zeros(0)}) == {"desirable": 0, "undesirable": 0}
