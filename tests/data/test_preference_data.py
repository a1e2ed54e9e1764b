"""Preference pair files: both TRL formats, the shared prompt, masks, hostile rows."""

import json

import grain
import numpy as np
import pytest

from posttrain.data import ByteTokenizer
from posttrain.data.preference import PreferenceData, encode_pair, parse_pair
from tests.data.test_sft import _assert_same

TOK = ByteTokenizer()
END = TOK.special_ids["<|end|>"]


def _write(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def _trained(tokens, mask):
  return [int(t) for t, m in zip(tokens, mask) if m]


def test_explicit_and_implicit_prompts_give_the_same_pair():
  user = {"role": "user", "content": "2+2?"}
  explicit = parse_pair(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}), "f:1")
  implicit = parse_pair(json.dumps({
      "chosen": [user, {"role": "assistant", "content": "4"}],
      "rejected": [user, {"role": "assistant", "content": "5"}]}), "f:2")
  assert explicit == implicit
  pair = encode_pair(*explicit, TOK)
  ids, mask = TOK.encode_chat([user, {"role": "assistant", "content": "4"}])
  first = mask.index(1)
  np.testing.assert_array_equal(pair["prompt_tokens"], ids[:first])
  assert _trained(pair["chosen_tokens"], pair["chosen_mask"]) == TOK.encode("4") + [END]
  assert _trained(pair["rejected_tokens"], pair["rejected_mask"]) == TOK.encode("5") + [END]


def test_multi_turn_pairs_split_at_the_last_shared_user_turn_and_train_only_answers():
  turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
           {"role": "user", "content": "2+2?"}]
  prompt, chosen, rejected = parse_pair(json.dumps({
      "chosen": turns + [{"role": "assistant", "content": "calc"},
                         {"role": "tool", "content": "4"},
                         {"role": "assistant", "content": "4"}],
      "rejected": turns + [{"role": "assistant", "content": "5"}]}), "f:1")
  assert prompt == [dict(t, weight=1) for t in turns]
  pair = encode_pair(prompt, chosen, rejected, TOK)
  # The earlier assistant turn is context; the tool turn inside the answer is untrained.
  assert TOK.encode("hello")[0] in pair["prompt_tokens"].tolist()
  assert _trained(pair["chosen_tokens"], pair["chosen_mask"]) == (
      TOK.encode("calc") + [END] + TOK.encode("4") + [END])
  # Answers sharing their first assistant turn keep it in each answer, not in the prompt.
  p2, c2, r2 = parse_pair(json.dumps({
      "chosen": turns + [{"role": "assistant", "content": "x"}],
      "rejected": turns + [{"role": "assistant", "content": "x"}]}), "f:2")
  assert p2 == prompt and c2 == r2
  data_identical = encode_pair(p2, c2, r2, TOK)
  np.testing.assert_array_equal(data_identical["chosen_tokens"], data_identical["rejected_tokens"])


@pytest.mark.parametrize("row, message", [
    ("{oops", "not valid JSON"),
    ({"prompt": "q", "chosen": "a"}, "a pair needs 'chosen' and 'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]},
     "'rejected' must be assistant turns"),
    ({"prompt": "q", "chosen": [{"role": "tool", "content": "t"},
                                {"role": "assistant", "content": "a"}], "rejected": "b"},
     "starting with an assistant turn"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a", "weight": 0}],
      "rejected": "b"}, "'chosen' has no assistant message to train on"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
     "must share their first turns"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "chosen": "b", "rejected": "c"}, "prompt must not end with an assistant turn"),
    ({"prompt": "q", "chosen": "a", "rejected": 3}, "'rejected' must be a non-empty list"),
    ('{"prompt": "q", "chosen": "a", "rejected": "b", "margin": NaN}',
     "'margin' must be a finite number"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "1"},
     "'margin' must be a finite number"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": True},
     "'margin' must be a finite number"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "domain": 3},
     "'domain' must be a non-empty string"),
])
def test_hostile_pairs_fail_naming_file_and_line(tmp_path, row, message):
  path = _write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
  with pytest.raises(ValueError, match=f"^{tmp_path / 'p.jsonl'}:2: ") as e:
    PreferenceData.from_files(path, TOK, row_len=64)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_long_pairs_are_cut_or_dropped_and_the_stream_covers_each_epoch(tmp_path, caplog):
  rows = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(5)]
  rows += [{"prompt": "q", "chosen": "a" * 80, "rejected": "b"},       # cut
           {"prompt": "p" * 80, "chosen": "a", "rejected": "b"},       # dropped
           {"prompt": "q", "chosen": "same", "rejected": "same"}]
  data = PreferenceData.from_files(_write(tmp_path / "p.jsonl", rows), TOK, row_len=64)
  assert (len(data), data.dropped, data.truncated, data.identical) == (7, 1, 1, 1)
  assert "preference data: dropped 1 of 8 rows" in caplog.text
  ds = data.dataset(seed=3)
  for epoch in range(2):
    seen = sorted(tuple(ds[epoch * 7 + i]["chosen_tokens"].tolist()) for i in range(7))
    assert seen == sorted(tuple(p["chosen_tokens"].tolist()) for p in data.examples)


def test_a_rows_margin_and_domain_travel_with_its_pair(tmp_path):
  rows = [{"prompt": "q", "chosen": "a", "rejected": "b", "margin": 1.5, "domain": "x/y"},
          {"prompt": "q", "chosen": "c", "rejected": "d"}]
  data = PreferenceData.from_files(_write(tmp_path / "p.jsonl", rows), TOK, row_len=64)
  assert data.examples[0]["margin"] == 1.5 and "margin" not in data.examples[1]
  assert data.examples[0]["domain"] == "x/y" and "domain" not in data.examples[1]


def test_pairs_come_back_from_the_cache_as_the_row_by_row_pairs_and_stream(tmp_path):
  rows = [{"prompt": f"q{i}", "chosen": "a" * (i + 1), "rejected": "b" * (7 - i)}
          for i in range(7)]
  rows[1].update(margin=2.0, domain="math")
  rows[2].update(domain="code")
  rows[4].update(margin=0.0)  # a zero margin is still there
  rows[5].update(chosen="same", rejected="same", domain="math")
  path = _write(tmp_path / "p.jsonl", rows)
  want = [PreferenceData.encode_line(json.dumps(r), f"{path}:{n}", TOK)[0]
          for n, r in enumerate(rows, 1)]
  first = PreferenceData.from_files(path, TOK, row_len=64, cache_dir=str(tmp_path / "c"))
  again = PreferenceData.from_files(path, TOK, row_len=64, cache_dir=str(tmp_path / "c"))
  assert not again.arrays["chosen_tokens"].flags.writeable  # memory-mapped from the entry
  old = grain.MapDataset.range(len(want)).shuffle(seed=2).repeat().map(lambda i: want[int(i)])
  for data in (first, again):
    assert data.identical == 1 and len(data) == 7
    for got, expected in zip(data.examples, want):
      _assert_same(got, expected)
    ds = data.dataset(seed=2)
    for i in range(2 * len(want)):
      _assert_same(ds[i], old[i])
  assert [("margin" in p, "domain" in p) for p in again.examples] == [
      ("margin" in r, "domain" in r) for r in rows]
  assert again.examples[1]["domain"] == again.examples[5]["domain"] == "math"
