"""Trajectory packing: exact round trip, layout invariants, padding waste, micro-batches."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.rl import packing


def _trajectories(rng, n, max_prompt=9, max_response=13, scalar_advantage=True):
  out = []
  for _ in range(n):
    p = int(rng.integers(1, max_prompt + 1))
    r = int(rng.integers(0, max_response + 1))
    out.append({
        "prompt_tokens": rng.integers(1, 1000, p),
        "response_tokens": rng.integers(1, 1000, r),
        "response_mask": rng.random(r) < 0.8,
        "behaviour_logprobs": -rng.random(r).astype(np.float32),
        "advantages": (float(rng.normal()) if scalar_advantage
                       else rng.normal(size=r).astype(np.float32)),
        "rewards": float(rng.normal()),
    })
  return out


def _check_round_trip(trajectories, batch, row_len):
  # Layout invariants over whole rows.
  batch = {k: v.reshape(-1, row_len) for k, v in batch.items()}
  seg, pos, seq_ids = batch["segment_ids"], batch["positions"], batch["seq_ids"]
  for row in range(seg.shape[0]):
    ids = seg[row]
    used = ids > 0
    k = ids.max()
    # Segments are 1..k, contiguous and in order, padding only at the end.
    assert list(ids[used]) == sorted(ids[used]) and set(ids[used]) == set(range(1, k + 1))
    assert not used[np.argmin(used):].any() if not used.all() else True
    assert np.all(pos[row][~used] == 0) and np.all(seq_ids[row][~used] == -1)
    assert not batch["loss_mask"][row][~used].any()

  sequences = packing.unpack(batch)
  assert len(sequences) == len(trajectories)
  for i, (traj, seq) in enumerate(zip(trajectories, sequences)):
    rows = np.flatnonzero((seq_ids == i).any(axis=1))
    assert len(rows) == 1, f"sequence {i} crosses rows {rows}"
    prompt, response = np.asarray(traj["prompt_tokens"]), np.asarray(traj["response_tokens"])
    p, r = len(prompt), len(response)
    np.testing.assert_array_equal(seq["tokens"], np.concatenate([prompt, response]))
    np.testing.assert_array_equal(seq["positions"], np.arange(p + r))
    np.testing.assert_array_equal(seq["targets"][:-1], seq["tokens"][1:])
    assert seq["targets"][-1] == 0
    # Response token j is the target of position p - 1 + j.
    np.testing.assert_array_equal(seq["loss_mask"][p - 1 : p - 1 + r], traj["response_mask"])
    assert not seq["loss_mask"][: p - 1].any() and not seq["loss_mask"][-1]
    np.testing.assert_array_equal(seq["behaviour_logprobs"][p - 1 : p - 1 + r],
                                  traj["behaviour_logprobs"])
    np.testing.assert_allclose(seq["advantages"][p - 1 : p - 1 + r],
                               np.broadcast_to(np.float32(traj["advantages"]), (r,)))
    trained = np.flatnonzero(seq["loss_mask"])
    want_rewards = np.zeros(p + r, np.float32)
    if len(trained):
      want_rewards[trained[-1]] = traj["rewards"]
    np.testing.assert_array_equal(seq["rewards"], want_rewards)


@pytest.mark.parametrize("scalar_advantage", [True, False])
def test_round_trip_and_layout(scalar_advantage):
  rng = np.random.default_rng(0)
  trajectories = _trajectories(rng, 37, scalar_advantage=scalar_advantage)
  batch = packing.pack_trajectories(trajectories, row_len=23)
  assert set(batch) == set(packing.BATCH_KEYS)
  assert all(v.shape == batch["tokens"].shape for v in batch.values())
  assert batch["tokens"].dtype == np.int32 and batch["loss_mask"].dtype == bool
  assert batch["advantages"].dtype == np.float32
  _check_round_trip(trajectories, batch, 23)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 8)), min_size=1, max_size=20),
       st.integers(14, 20))
def test_round_trip_property(lengths, row_len):
  rng = np.random.default_rng(len(lengths))
  trajectories = [{
      "prompt_tokens": rng.integers(1, 50, p),
      "response_tokens": rng.integers(1, 50, r),
      "response_mask": rng.random(r) < 0.5,
      "behaviour_logprobs": -rng.random(r).astype(np.float32),
      "advantages": rng.normal(size=r).astype(np.float32),
      "rewards": 1.0,
  } for p, r in lengths]
  batch = packing.pack_trajectories(trajectories, row_len=row_len)
  _check_round_trip(trajectories, batch, row_len)
  # First-fit-decreasing never needs more rows than twice the optimum bound, plus one.
  total = sum(p + r for p, r in lengths)
  assert batch["tokens"].shape[0] <= 2 * -(-total // row_len) + 1


def test_padding_is_small_on_a_realistic_length_distribution():
  rng = np.random.default_rng(1)
  # Prompts of 30-300 tokens, long-tailed responses capped at 1536: GRPO on reasoning tasks.
  trajectories = [{
      "prompt_tokens": np.ones(int(rng.integers(30, 300)), np.int32),
      "response_tokens": np.ones(int(min(rng.lognormal(5.5, 0.8), 1536)), np.int32),
  } for _ in range(512)]
  row_len = 2048
  batch = packing.pack_trajectories(trajectories, row_len=row_len)
  fraction = packing.padding_fraction(batch)
  lengths = [len(t["prompt_tokens"]) + len(t["response_tokens"]) for t in trajectories]
  one_per_row = 1 - sum(lengths) / (len(lengths) * max(lengths))
  assert fraction < 0.02, fraction
  assert one_per_row > 0.5  # what padding every sequence to the longest would waste
  assert batch["tokens"].shape[0] <= -(-sum(lengths) // row_len) + 1  # within a row of the bound


def test_first_fit_decreasing_places_longest_first():
  bins = packing.first_fit_decreasing([2, 5, 4, 3, 6], capacity=8)
  # 6 -> bin 0; 5 -> bin 1; 4 -> bin 2; 3 -> bin 1 (5+3); 2 -> bin 0 (6+2).
  np.testing.assert_array_equal(bins, [0, 1, 2, 1, 0])


def test_too_long_sequence_errors_or_truncates():
  trajectories = [{"prompt_tokens": [1, 2, 3], "response_tokens": [4, 5, 6, 7, 8],
                   "behaviour_logprobs": [-1.0, -2.0, -3.0, -4.0, -5.0], "rewards": 2.0},
                  {"prompt_tokens": [9], "response_tokens": [10]}]
  with pytest.raises(ValueError) as info:
    packing.pack_trajectories(trajectories, row_len=6)
  assert str(info.value) == ("trajectory 0 has 8 tokens (prompt 3 + response 5) > row_len 6; "
                             "raise row_len or pass truncate=True")
  batch = packing.pack_trajectories(trajectories, row_len=6, truncate=True)
  seq = packing.unpack(batch)[0]
  np.testing.assert_array_equal(seq["tokens"], [1, 2, 3, 4, 5, 6])
  np.testing.assert_array_equal(seq["targets"], [2, 3, 4, 5, 6, 0])
  # Targets 4, 5, 6 are kept; the last position's target (7) was cut.
  np.testing.assert_array_equal(seq["loss_mask"], [0, 0, 1, 1, 1, 0])
  np.testing.assert_array_equal(seq["behaviour_logprobs"], [0, 0, -1, -2, -3, 0])
  np.testing.assert_array_equal(seq["rewards"], [0, 0, 0, 0, 2, 0])
  with pytest.raises(ValueError, match="prompt of 6 tokens leaves no response token in row_len 6"):
    packing.pack_trajectories([{"prompt_tokens": np.ones(6), "response_tokens": [1]}], 6,
                              truncate=True)


@pytest.mark.parametrize("traj,message", [
    ({"prompt_tokens": [], "response_tokens": [1]}, "trajectory 0: empty prompt_tokens"),
    ({"prompt_tokens": [1]}, "trajectory 0: missing 'response_tokens'"),
    ({"prompt_tokens": [1], "response_tokens": [1], "logprobs": [0.0]},
     r"trajectory 0: unknown key\(s\) \['logprobs'\]"),
    ({"prompt_tokens": [1], "response_tokens": [1, 2], "behaviour_logprobs": [0.0]},
     r"trajectory 0: behaviour_logprobs has shape \(1,\), response_tokens has 2 tokens"),
])
def test_bad_trajectories_are_one_line_errors(traj, message):
  with pytest.raises(ValueError, match=message) as info:
    packing.pack_trajectories([traj], row_len=8)
  assert "\n" not in str(info.value)


def test_static_row_count():
  trajectories = _trajectories(np.random.default_rng(2), 5)
  batch = packing.pack_trajectories(trajectories, row_len=32, num_rows=9)
  assert batch["tokens"].shape == (9, 32)
  _check_round_trip(trajectories, batch, 32)
  with pytest.raises(ValueError, match=r"trajectories need \d+ rows of 8 tokens, but num_rows=1"):
    packing.pack_trajectories(_trajectories(np.random.default_rng(2), 5, 4, 4), 8, num_rows=1)


def test_microbatches_by_token_budget_with_static_count():
  trajectories = _trajectories(np.random.default_rng(3), 41)
  batch = packing.pack_trajectories(trajectories, row_len=23)
  num_rows = batch["tokens"].shape[0]
  budget = 3 * 23 + 10  # three rows fit
  micro = packing.split_microbatches(batch, budget, num_microbatches=-(-num_rows // 3) + 2)
  assert micro["tokens"].shape == (-(-num_rows // 3) + 2, 3, 23)
  flat = {k: v.reshape(-1, 23) for k, v in micro.items()}
  for key in batch:
    np.testing.assert_array_equal(flat[key][:num_rows], batch[key])
  assert not flat["loss_mask"][num_rows:].any() and np.all(flat["seq_ids"][num_rows:] == -1)
  assert np.all(flat["segment_ids"][num_rows:] == 0)
  _check_round_trip(trajectories, micro, 23)  # unpack accepts the micro-batched layout

  default = packing.split_microbatches(batch, budget)
  assert default["tokens"].shape[0] == -(-num_rows // 3)
  with pytest.raises(ValueError, match="token_budget 22 is smaller than one row of 23 tokens"):
    packing.split_microbatches(batch, 22)
  message = rf"{num_rows} rows need \d+ micro-batches of 3 rows, but num_microbatches=1"
  with pytest.raises(ValueError, match=message):
    packing.split_microbatches(batch, budget, num_microbatches=1)


def test_learner_arrays_ride_along():
  trajectories = _trajectories(np.random.default_rng(4), 6)
  batch = packing.pack_trajectories(trajectories, row_len=32)
  shape = batch["tokens"].shape
  batch["old_logprobs"] = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  micro = packing.split_microbatches(batch, 64)
  seqs = packing.unpack(micro)
  for i, seq in enumerate(seqs):
    where = batch["seq_ids"] == i
    np.testing.assert_array_equal(seq["old_logprobs"], batch["old_logprobs"][where])


def test_routing_rides_with_its_tokens_into_rows_and_microbatches():
  """Each trajectory's recorded experts land on its input tokens' positions in its row
  (the last token, never fed, and padding take experts 0..k-1), through truncation and
  the split into micro-batches; every trajectory or none has routing."""
  rng = np.random.default_rng(0)
  trajectories = _trajectories(rng, 7)
  for t in trajectories:
    fed = len(t["prompt_tokens"]) + len(t["response_tokens"]) - 1
    t["routing"] = rng.integers(0, 8, (fed, 3, 2)).astype(np.int16)
  row_len = 24
  batch = packing.pack_trajectories(trajectories, row_len, truncate=True)
  routing = batch["routing"]
  assert routing.shape == batch["tokens"].shape + (3, 2) and routing.dtype == np.int16
  default = np.arange(2, dtype=np.int16)
  for i, t in enumerate(trajectories):
    rows, cols = np.nonzero(batch["seq_ids"] == i)
    got = routing[rows, cols]
    fed = min(len(t["routing"]), len(cols))
    np.testing.assert_array_equal(got[:fed], t["routing"][:fed])
    np.testing.assert_array_equal(got[fed:], np.broadcast_to(default, got[fed:].shape))
  np.testing.assert_array_equal(routing[batch["seq_ids"] < 0],
                                np.broadcast_to(default, routing[batch["seq_ids"] < 0].shape))
  split = packing.split_microbatches(batch, 2 * row_len, num_microbatches=4)
  assert split["routing"].shape == (4, 2, row_len, 3, 2)
  n = len(batch["tokens"])
  np.testing.assert_array_equal(split["routing"].reshape(-1, row_len, 3, 2)[:n], routing)
  np.testing.assert_array_equal(split["routing"].reshape(-1, row_len, 3, 2)[n:],
                                np.broadcast_to(default, (8 - n, row_len, 3, 2)))
  with pytest.raises(ValueError, match="trajectory 0 has no routing; trajectory 1 has"):
    packing.pack_trajectories([{**trajectories[0], "routing": None}] + trajectories[1:],
                              row_len, truncate=True)
  with pytest.raises(ValueError, match=r"trajectory 0: routing must be integer experts"):
    packing.pack_trajectories([{**trajectories[0], "routing": np.zeros((99, 3, 2), int)}],
                              row_len, truncate=True)
