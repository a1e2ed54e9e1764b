"""The sampler's routing record (`Sampler(record_routing=True)`): each row's experts, for
every token it fed, are those one cache-free forward of the row's sequence chooses: with
and without continuous batching, for next turns continued in their slots, scanned, on a
mesh; what it refuses."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.sampling import Sampler

CFG = models.get_preset("tiny", num_layers=3, dense_layers=1, dense_ffn_dim=48, ffn_dim=32,
                        num_experts=6, num_experts_per_tok=2, init_std=0.2,
                        attention_chunk=16, decode_chunk=16)
MAX_LEN = 64
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 36)), [5, 9, 2, 7, 1, 3],
           list(range(40, 57)), [3, 3, 3, 8], [7] * 9, [1, 2]]


@pytest.fixture(scope="module")
def model():
  return models.create_model(CFG, seed=0)


@pytest.fixture(scope="module")
def sampler(model):
  return Sampler(model, max_len=MAX_LEN, record_routing=True)


@functools.partial(jax.jit, static_argnums=0)
def _routing(graphdef, state, tokens):
  return nnx.merge(graphdef, state).hidden_states(tokens, return_routing=True)[1]


def _check_rows(model, prompts, out, rows=None):
  """Each row's record equals a cache-free forward's over its prompt and all it drew
  but the last."""
  graphdef, state = nnx.split(model)
  for i in (range(len(prompts)) if rows is None else rows):
    n = int(out.lengths[i])
    seq = list(prompts[i]) + out.tokens[i, :n - 1].tolist()
    want = np.asarray(_routing(graphdef, state, np.asarray([seq], np.int32)))[0]
    got = out.routing[i]
    assert got.dtype == np.uint8 and got.shape == (len(seq), CFG.mixture_layers, 2), i
    np.testing.assert_array_equal(got, want, err_msg=f"row {i}")


def test_a_call_records_what_the_whole_forward_routes(model, sampler):
  """One call (identical prompts prefilled once, rows of every length): each row's
  prompt and generated tokens, their experts in every mixture layer; on_finish gets
  the same."""
  finished = {}
  out = sampler.generate(PROMPTS, max_new_tokens=9, temperature=1.0, seed=3,
                         stop_token_ids=(4,),
                         on_finish=lambda i, t, lp, r, routing: finished.setdefault(i, routing))
  assert out.stats["prefill_rows"] < len(PROMPTS) + 1
  _check_rows(model, PROMPTS, out)
  for i in range(len(PROMPTS)):
    np.testing.assert_array_equal(finished[i], out.routing[i])


def test_continuous_batching_records_every_row(model, sampler):
  """Four slots over eight prompts: rows refilled into freed slots record their own
  prompt's experts over what the slot's last row left."""
  out = sampler.generate(PROMPTS, max_new_tokens=7, temperature=1.0, seed=5, slots=3,
                         stop_token_ids=(4,))
  assert out.stats["inserts"] >= 1
  _check_rows(model, PROMPTS, out)


def test_next_turns_continued_in_their_slots_record_their_whole_transcript(model, sampler):
  """A finished row's transcript with an answer after it comes back between rounds and
  goes on in its slot (only the answer is fed): its record covers the whole transcript,
  the first turn's tokens included."""
  finished, added = {}, []

  def next_turns(live):
    if added or len(finished) < 3:
      return None
    added.extend(PROMPTS[i] + finished[i].tolist() + [9, 8, 7] for i in sorted(finished)[:3])
    return list(added)

  out = sampler.generate(PROMPTS, max_new_tokens=6, temperature=1.0, seed=9, slots=4,
                         between_rounds=next_turns, max_prompt_len=MAX_LEN - 8,
                         on_finish=lambda i, t, *_, **__: finished.setdefault(i, t.copy()))
  assert out.stats["continued"] >= 1
  _check_rows(model, PROMPTS + added, out)


def test_scanned_layers_and_a_mesh_record_what_one_device_does(model, sampler):
  kw = dict(max_new_tokens=6, temperature=1.0, seed=1, stop_token_ids=(4,))
  want = sampler.generate(PROMPTS, slots=3, **kw)
  for other in (Sampler(models.relayout(model, scan_layers=True), max_len=MAX_LEN,
                        record_routing=True),
                Sampler(model, mesh=models.make_mesh((1, 4, 2, 1)), max_len=MAX_LEN,
                        record_routing=True)):
    got = other.generate(PROMPTS, slots=4, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    for a, b in zip(got.routing, want.routing):
      np.testing.assert_array_equal(a, b)


def test_resumed_rows_record_their_whole_sequence(model, sampler):
  """A generation paused (keep_cache) and resumed twice for some of its rows: each
  segment's record is the row's whole sequence so far, and the last equals one
  uninterrupted call's record (the same tokens: the same keys)."""
  kw = dict(temperature=1.0, seed=4)
  whole = sampler.generate(PROMPTS, max_new_tokens=12, **kw)
  first = sampler.generate(PROMPTS, max_new_tokens=4, keep_cache=True, reserve_tokens=12, **kw)
  _check_rows(model, PROMPTS, first)
  rows = [i for i in range(len(PROMPTS)) if first.resume_state.open[i]][:5]
  assert len(rows) >= 3
  state, tokens = first.resume_state, {i: first.tokens[i, :first.lengths[i]].tolist()
                                       for i in rows}
  for _ in range(2):
    out = sampler.resume(state, rows, max_new_tokens=4)
    state = out.resume_state
    for k, i in enumerate(rows):
      tokens[i] += out.tokens[k, :out.lengths[k]].tolist()
      want = whole.routing[i][:len(PROMPTS[i]) + len(tokens[i]) - 1]
      np.testing.assert_array_equal(out.routing[k], want)
  for i in rows:
    if len(tokens[i]) == whole.lengths[i]:
      np.testing.assert_array_equal(tokens[i], whole.tokens[i, :whole.lengths[i]])


def test_what_recording_refuses(model, sampler):
  dense = models.create_model(models.get_preset("tiny"), seed=0)
  with pytest.raises(ValueError, match="record_routing=True records a mixture's experts"):
    Sampler(dense, max_len=MAX_LEN, record_routing=True)
  assert Sampler(model, max_len=MAX_LEN).generate(PROMPTS[:1], max_new_tokens=2).routing is None
