"""Sampler against references: full recomputation without a cache, numpy sampling sets."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.sampling import Sampler, SamplingMode, sample_logits
from posttrain.sampling import sampler as sampler_lib
from sampling_refs import (CFG, MAX_LEN, PROMPTS, full_logits, generated_positions,
                           greedy_by_recomputation, reference_policy, token_logprobs)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# -- greedy and log-probs -----------------------------------------------------------------


def test_greedy_equals_argmax_by_full_recomputation(model, sampler):
  steps = 12
  out = sampler.generate(PROMPTS, max_new_tokens=steps, temperature=0.0)
  expected = greedy_by_recomputation(model, PROMPTS, steps)
  np.testing.assert_array_equal(out.tokens, expected)
  assert out.tokens.shape == (len(PROMPTS), steps)
  np.testing.assert_array_equal(out.lengths, steps)
  assert out.finish_reasons == ["length"] * len(PROMPTS)
  # Greedy log-probs are under the untempered model distribution.
  seqs = [p + out.tokens[i].tolist() for i, p in enumerate(PROMPTS)]
  for i, (p, logits) in enumerate(zip(PROMPTS, full_logits(model, seqs))):
    logp = logits - logits.max(-1, keepdims=True)  # float64, in numpy
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ref = logp[generated_positions(p, steps), out.tokens[i]]
    np.testing.assert_allclose(out.logprobs[i], ref, atol=1e-4)


def test_greedy_rows_all_longer_than_a_decode_block(model, sampler):
  """No short row in the batch: every row's early cache blocks must still be read."""
  prompts = [list(range(20, 56)), list(range(60, 93))]  # 36 and 33 > decode_chunk 16
  out = sampler.generate(prompts, max_new_tokens=10, temperature=0.0)
  np.testing.assert_array_equal(out.tokens, greedy_by_recomputation(model, prompts, 10))


def test_logprobs_equal_model_recomputation_at_temperature_one(model, sampler):
  out = sampler.generate(PROMPTS, max_new_tokens=10, temperature=1.0, seed=7)
  seqs = [p + out.token_lists()[i] for i, p in enumerate(PROMPTS)]
  for i, (p, logp) in enumerate(zip(PROMPTS, token_logprobs(model, seqs))):
    ref = logp[generated_positions(p, out.lengths[i])]
    np.testing.assert_allclose(out.logprobs[i, :out.lengths[i]], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, None, 0.6), (1.3, 5, 0.9)])
def test_top_k_top_p_stay_in_allowed_set(model, sampler, temperature, top_k, top_p):
  prompts = [PROMPTS[0]] * 24 + [PROMPTS[2]] * 24
  out = sampler.generate(prompts, max_new_tokens=6, temperature=temperature, top_k=top_k,
                         top_p=top_p, seed=11)
  seqs = [p + out.token_lists()[i] for i, p in enumerate(prompts)]
  distinct = set()
  for i, (p, logits) in enumerate(zip(prompts, full_logits(model, seqs))):
    for t, pos in enumerate(generated_positions(p, out.lengths[i])):
      allowed, logp = reference_policy(logits[pos], temperature, top_k, top_p)
      tok = out.tokens[i, t]
      assert allowed[tok], f"row {i} step {t}: token {tok} outside the allowed set"
      np.testing.assert_allclose(out.logprobs[i, t], logp[tok], atol=1e-4)
      if t == 0:
        distinct.add((len(p), int(tok)))
  assert len(distinct) > 2, "sampling collapsed to one token per prompt"


def test_sample_logits_matches_its_distribution_over_many_draws():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(1, 37)).astype(np.float32) * 1.5
  draws = 20_000
  keys = jax.random.split(jax.random.key(0), draws)
  batch = jnp.broadcast_to(jnp.asarray(logits), (draws, 37))
  draw = jax.jit(sample_logits, static_argnums=4)
  for temperature, top_k, top_p in [(1.0, 4, None), (0.8, None, 0.7), (1.5, 9, 0.5),
                                    (1.0, None, None)]:
    mode = SamplingMode(greedy=False, top_k=top_k, top_p=top_p is not None)
    tokens, logp = draw(batch, keys, temperature, top_p or 1.0, mode)
    tokens, logp = np.asarray(tokens), np.asarray(logp)
    allowed, ref_logp = reference_policy(logits[0].astype(np.float64), temperature, top_k,
                                         top_p)
    assert allowed[tokens].all(), f"token outside the allowed set for {temperature, top_k, top_p}"
    np.testing.assert_allclose(logp, ref_logp[tokens], atol=1e-5)
    freq = np.bincount(tokens, minlength=37) / draws
    np.testing.assert_allclose(freq, np.exp(ref_logp), atol=0.015)


def test_greedy_sample_logits_reports_untempered_logprob():
  logits = jnp.asarray([[0.1, 2.0, -1.0, 1.9]], jnp.float32)
  mode = SamplingMode(greedy=True, top_k=None, top_p=False)
  tok, logp = sample_logits(logits, jax.random.split(jax.random.key(0), 1), 1.0, 1.0, mode)
  assert int(tok[0]) == 1
  np.testing.assert_allclose(float(logp[0]), float(jax.nn.log_softmax(logits)[0, 1]),
                             rtol=1e-6)


# -- stopping, seeds, buckets -------------------------------------------------------------


def test_stop_tokens_end_rows_and_later_tokens_are_padding(sampler):
  steps = 12
  free = sampler.generate(PROMPTS, max_new_tokens=steps, temperature=0.0)
  row0 = free.tokens[0].tolist()
  cut = next(j for j in range(2, steps) if row0[j] not in row0[:j])
  stop = row0[cut]
  unused = next(t for t in range(CFG.vocab_size) if t not in free.tokens)
  out = sampler.generate(PROMPTS, max_new_tokens=steps, temperature=0.0,
                         stop_token_ids=(stop, unused))
  for i, row in enumerate(free.tokens.tolist()):
    n = row.index(stop) + 1 if stop in row else steps
    assert out.lengths[i] == n
    assert out.finish_reasons[i] == ("stop" if stop in row else "length")
    np.testing.assert_array_equal(out.tokens[i, :n], row[:n])
    np.testing.assert_array_equal(out.tokens[i, n:], sampler.pad_id)
    np.testing.assert_array_equal(out.logprobs[i, n:], 0.0)
    np.testing.assert_allclose(out.logprobs[i, :n], free.logprobs[i, :n], atol=1e-6)
  assert out.lengths[0] == cut + 1 and out.finish_reasons[0] == "stop"


def test_stop_on_the_first_token_and_max_new_tokens_one(sampler):
  first = sampler.generate(PROMPTS, max_new_tokens=1, temperature=0.0)
  np.testing.assert_array_equal(first.lengths, 1)
  out = sampler.generate(PROMPTS, max_new_tokens=5, temperature=0.0,
                         stop_token_ids=[int(first.tokens[1, 0])])
  assert out.lengths[1] == 1 and out.finish_reasons[1] == "stop"
  np.testing.assert_array_equal(out.tokens[1, 1:], sampler.pad_id)


def test_loop_ends_early_once_every_row_has_stopped(sampler):
  free = sampler.generate(PROMPTS, max_new_tokens=12, temperature=0.0)
  stops = sorted({int(row[min(2, len(row) - 1)]) for row in free.tokens})
  out = sampler.generate(PROMPTS, max_new_tokens=12, temperature=0.0, stop_token_ids=stops)
  expected = [next(j for j, t in enumerate(row) if t in stops) + 1 for row in free.tokens]
  np.testing.assert_array_equal(out.lengths, expected)
  assert out.stats["steps"] == max(expected) <= 3
  assert free.stats["steps"] == 12


def test_identical_prompts_are_prefilled_once(model, sampler):
  a, b, c = PROMPTS[0], PROMPTS[2], PROMPTS[4]
  prompts = [a, b, a, a, c, b]
  greedy = sampler.generate(prompts, max_new_tokens=6, temperature=0.0)
  assert greedy.stats["prefill_rows"] == 4 and greedy.stats["batch"] == 8
  np.testing.assert_array_equal(greedy.tokens, greedy_by_recomputation(model, prompts, 6))
  sampled = sampler.generate(prompts, max_new_tokens=6, temperature=1.0, seed=9)
  seqs = [p + sampled.token_lists()[i] for i, p in enumerate(prompts)]
  for i, (p, logp) in enumerate(zip(prompts, token_logprobs(model, seqs))):
    np.testing.assert_allclose(sampled.logprobs[i], logp[generated_positions(p, 6)], atol=1e-4)
  assert len({tuple(sampled.tokens[i]) for i in (0, 2, 3)}) > 1  # Each row draws its own.


def test_same_seed_same_samples_other_seed_other_samples(sampler):
  kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.95)
  a = sampler.generate(PROMPTS, seed=3, **kw)
  b = sampler.generate(PROMPTS, seed=3, **kw)
  c = sampler.generate(PROMPTS, seed=4, **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert not np.array_equal(a.tokens, c.tokens)


def test_buckets_reuse_programs_and_padding_rows_change_nothing(sampler):
  kw = dict(max_new_tokens=6, temperature=0.0)
  four = sampler.generate(PROMPTS[:4], **kw)
  compiled = sampler.num_compiles
  three = sampler.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1]], **kw)  # Same buckets.
  assert sampler.num_compiles == compiled
  np.testing.assert_array_equal(three.tokens, four.tokens[[0, 3, 1]])
  # Prompts in a shorter length bucket, same cache bucket: one new prefill, the same decode.
  short = sampler.generate([p[:10] for p in PROMPTS[:4]], max_new_tokens=10, temperature=0.0)
  assert sampler.num_compiles == compiled + 1
  assert short.tokens.shape == (4, 10)


def test_update_params_changes_output_without_recompiling(model, sampler):
  other = models.create_model(CFG, seed=1)
  kw = dict(max_new_tokens=8, temperature=0.0)
  before = sampler.generate(PROMPTS, **kw)
  expected = greedy_by_recomputation(other, PROMPTS, 8)
  compiled = sampler.num_compiles
  events = []
  listener = lambda event, *a, **k: events.append(event) if event == COMPILE_EVENT else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    sampler.update_params(nnx.state(other, nnx.Param))  # What a learner holds.
    after = sampler.generate(PROMPTS, **kw)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
    sampler.update_params(model)
  assert sampler.num_compiles == compiled and not events, events
  assert not np.array_equal(before.tokens, after.tokens)
  np.testing.assert_array_equal(after.tokens, expected)
  sampler.update_params(nnx.state(model).to_pure_dict())
  np.testing.assert_array_equal(sampler.generate(PROMPTS, **kw).tokens, before.tokens)


def test_sampler_owns_copies_of_the_weights(model, sampler):
  """A learner donates its params every step; the sampler's weights must survive that."""
  owner = models.create_model(CFG, seed=3)
  expected = greedy_by_recomputation(owner, PROMPTS[:2], 3)
  fresh = Sampler(owner, max_len=MAX_LEN)
  try:
    sampler.update_params(owner)
    jax.tree.map(lambda x: x.delete(), nnx.state(owner))
    for s in (fresh, sampler):
      np.testing.assert_array_equal(
          s.generate(PROMPTS[:2], max_new_tokens=3, temperature=0.0).tokens, expected)
  finally:
    sampler.update_params(model)


def test_update_params_rejects_another_architecture(sampler):
  other = models.create_model(models.get_preset("tiny", num_layers=1))
  with pytest.raises(ValueError, match="do not match"):
    sampler.update_params(other)
  wide = models.create_model(models.get_preset("tiny", ffn_dim=64))
  with pytest.raises(ValueError, match=r"down_proj.*shape \(64, 128\), expected \(384, 128\)"):
    sampler.update_params(wide)


# -- user errors --------------------------------------------------------------------------


@pytest.mark.parametrize("prompts,kwargs,match", [
    ([], {}, "non-empty list"),
    ([[1, 2], []], {}, "prompt 1"),
    ([[1, CFG.vocab_size]], {}, f"token id {CFG.vocab_size}"),
    ([[1, -3]], {}, "token id -3"),
    ([[1.5, 2]], {}, "int token ids"),
    ([[1] * 60], {"max_new_tokens": 5}, "max_len=64"),
    ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([[1]], {"temperature": -1.0}, "temperature"),
    ([[1]], {"top_p": 0.0}, "top_p"),
    ([[1]], {"top_k": 0}, "top_k"),
    ([[1]], {"stop_token_ids": (CFG.vocab_size + 4,)}, f"{CFG.vocab_size + 4}"),
])
def test_bad_input_raises_one_line_error(sampler, prompts, kwargs, match):
  kwargs = {"max_new_tokens": 4, **kwargs}
  with pytest.raises(ValueError, match=match):
    sampler.generate(prompts, **kwargs)


def test_bad_constructor_arguments(model):
  with pytest.raises(ValueError, match="cache_dtype"):
    Sampler(model, cache_dtype="fp8")
  with pytest.raises(ValueError, match="pad_id"):
    Sampler(model, pad_id=-1)
  small = Sampler(model, max_len=32, batch_buckets=(2,))
  with pytest.raises(ValueError, match="batch of prompts 3"):
    small.generate([[1]] * 3, max_new_tokens=2)


# -- mesh ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (1, 8, 1, 1)])
def test_mesh_greedy_equals_single_device(model, sampler, shape):
  mesh = models.make_mesh(shape)
  meshed = Sampler(model, mesh=mesh, max_len=MAX_LEN)
  kw = dict(max_new_tokens=8, temperature=0.0)
  out = meshed.generate(PROMPTS, **kw)
  single = sampler.generate(PROMPTS, **kw)
  np.testing.assert_array_equal(out.tokens, single.tokens)
  np.testing.assert_allclose(out.logprobs, single.logprobs, atol=1e-5)
  q_proj = meshed._state["layers"][0]["attn"]["q_proj"][...]
  assert len(q_proj.sharding.device_set) == 8
  # Weights from a single-device (train) model are resharded onto the rollout mesh.
  other = models.create_model(CFG, seed=1)
  compiled = meshed.num_compiles
  meshed.update_params(other)
  assert meshed._state["layers"][0]["attn"]["q_proj"][...].sharding == q_proj.sharding
  np.testing.assert_array_equal(meshed.generate(PROMPTS, **kw).tokens,
                                greedy_by_recomputation(other, PROMPTS, 8))
  assert meshed.num_compiles == compiled


# -- int8 cache ---------------------------------------------------------------------------

# Per-slot, per-head absmax int8 keeps each cached k/v within 1/254 of its row's largest entry;
# on this deliberately peaked model that moves a token's log-prob by ~0.02 nats on average.
INT8_MAX_LOGPROB_ERROR = 0.25
INT8_MEAN_LOGPROB_ERROR = 0.05


def test_int8_cache_stays_within_stated_tolerance(model, sampler):
  int8 = Sampler(model, max_len=MAX_LEN, cache_dtype="int8")
  out = int8.generate(PROMPTS, max_new_tokens=12, temperature=1.0, seed=5)
  seqs = [p + out.token_lists()[i] for i, p in enumerate(PROMPTS)]
  errors = np.concatenate([
      np.abs(out.logprobs[i, :out.lengths[i]] - logp[generated_positions(p, out.lengths[i])])
      for i, (p, logp) in enumerate(zip(PROMPTS, token_logprobs(model, seqs)))])
  assert 0 < errors.max() < INT8_MAX_LOGPROB_ERROR, errors.max()  # > 0: it did quantize.
  assert errors.mean() < INT8_MEAN_LOGPROB_ERROR, errors.mean()
  greedy8 = int8.generate(PROMPTS, max_new_tokens=12, temperature=0.0)
  greedy = sampler.generate(PROMPTS, max_new_tokens=12, temperature=0.0)
  assert np.mean(greedy8.tokens == greedy.tokens) >= 0.9


# -- pausing and resuming a generation ----------------------------------------------------


@pytest.mark.parametrize("temperature, top_p", [(0.0, None), (1.0, None), (0.9, 0.95)])
def test_resume_from_the_kept_cache_equals_one_uninterrupted_call(sampler, temperature,
                                                                 top_p):
  """Generating 5 tokens, then resuming twice (4 + 3) from the kept KV cache, draws the
  same tokens with the same behaviour log-probs as one call of 12."""
  kw = dict(temperature=temperature, top_p=top_p, seed=7)
  whole = sampler.generate(PROMPTS, max_new_tokens=12, **kw)
  first = sampler.generate(PROMPTS, max_new_tokens=5, keep_cache=True, reserve_tokens=12, **kw)
  assert first.stats["cache_len"] >= whole.stats["cache_len"]
  rows = list(range(len(PROMPTS)))
  second = sampler.resume(first.resume_state, rows, max_new_tokens=4)
  third = sampler.resume(second.resume_state, rows, max_new_tokens=3)
  assert second.stats["prefill_rows"] == 0
  with pytest.raises(ValueError, match="already resumed"):
    sampler.resume(first.resume_state, rows, max_new_tokens=1)
  tokens = np.concatenate([first.tokens, second.tokens, third.tokens], axis=1)
  logprobs = np.concatenate([first.logprobs, second.logprobs, third.logprobs], axis=1)
  np.testing.assert_array_equal(tokens, whole.tokens)
  np.testing.assert_allclose(logprobs, whole.logprobs, atol=1e-5)
  np.testing.assert_array_equal(second.lengths, 4)


def test_resume_continues_only_the_rows_asked_and_stopped_rows_stay_stopped(sampler):
  free = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0.0)
  stop = int(free.tokens[0, 2])  # row 0 stops within the first segment
  first = sampler.generate(PROMPTS, max_new_tokens=4, temperature=0.0, stop_token_ids=[stop],
                           keep_cache=True, reserve_tokens=10)
  assert first.finish_reasons[0] == "stop"
  with pytest.raises(ValueError, match="rows that did not stop"):
    sampler.resume(first.resume_state, [0, 1], max_new_tokens=2)
  open_rows = [i for i, r in enumerate(first.finish_reasons) if r == "length"][1:3]
  more = sampler.resume(first.resume_state, open_rows, max_new_tokens=6)
  assert more.tokens.shape == (2, 6)
  for k, i in enumerate(open_rows):
    n = int(more.lengths[k])
    joined = first.tokens[i].tolist() + more.tokens[k, :n].tolist()
    want = free.tokens[i, :4 + n].tolist()
    if stop in free.tokens[i, 4:].tolist():  # the resumed row stops where the free one
      want = free.tokens[i, :free.tokens[i, 4:].tolist().index(stop) + 5].tolist()
    assert joined == want and more.finish_reasons[k] == ("stop" if joined[-1] == stop
                                                         else "length")
  with pytest.raises(ValueError, match="exceeds the .* tokens left in the reserved cache"):
    sampler.resume(more.resume_state, open_rows[:1], max_new_tokens=50)


def test_resume_refuses_a_cache_filled_by_other_weights(model, sampler):
  first = sampler.generate(PROMPTS, max_new_tokens=3, temperature=0.0, keep_cache=True,
                           reserve_tokens=6)
  sampler.update_params(model)  # the same values, but new weights as far as it knows
  with pytest.raises(ValueError, match="weights changed since this generation paused"):
    sampler.resume(first.resume_state, [0], max_new_tokens=3)


def test_compile_builds_the_programs_generate_then_runs(model):
  """`compile` makes exactly the programs a generate of those shapes uses (no new
  compile after it): the weights gather, prefill and decode, grouped prompts sharing one
  prefill row each."""
  mesh = models.make_mesh((1, 2, 1, 1), devices=jax.devices()[:2])
  sampler = Sampler(model, mesh=mesh, max_len=MAX_LEN)
  prompts = [p[:9] for p in PROMPTS[:2] for _ in range(4)]  # 2 groups of 4
  prefill, decode = sampler.compile(8, 9, 5, distinct_prompts=2, temperature=1.0, top_k=7)
  assert sampler.num_compiles == 3
  assert prefill.memory_analysis() is not None and decode.memory_analysis() is not None
  out = sampler.generate(prompts, max_new_tokens=5, temperature=1.0, top_k=7, seed=3)
  assert sampler.num_compiles == 3 and out.tokens.shape == (8, 5)
  with pytest.raises(ValueError, match="must be positive and fit max_len"):
    sampler.compile(8, MAX_LEN, 1)
  # Continuous batching: the fill of the first 4 slots, the decode loop and the smallest
  # refill; a generate of those shapes compiles nothing else but refills of other sizes
  # (and the few-row copies of finished rows off the devices).
  fill, decode, refill = sampler.compile(16, 9, 5, distinct_prompts=4, temperature=1.0,
                                         top_k=7, slots=4)
  assert all(p.memory_analysis() is not None for p in (fill, decode, refill))
  before = set(sampler._programs)
  out = sampler.generate(prompts * 2, max_new_tokens=5, temperature=1.0, top_k=7, seed=3,
                         slots=4)
  assert out.stats["inserts"] >= 1
  assert {key[0] for key in set(sampler._programs) - before} <= {"refill", "take_rows"}
  assert {key[0] for key in before} >= {"fill", "decode_slots", "refill"}
  # Later turns (prompts up to max_prompt_len): also the widest call that continues them
  # in their slots, as many rows as the smallest refill.
  *_, refill, extend = sampler.compile(16, 9, 5, distinct_prompts=4, temperature=1.0,
                                       top_k=7, slots=4, max_prompt_len=MAX_LEN - 2)
  assert extend.memory_analysis() is not None
  assert ("extend", 2, 64, 4, 64, sampler_lib.sampling_mode(1.0, 7, None, CFG.vocab_size)
          ) in sampler._programs


def test_prefill_gathers_prompt_long_caches_not_the_whole_cache():
  """Rows gather their prompt's cache at the prompt's length and extend it: gathering
  the whole cache_len cache of the distinct prompts made XLA copy it across the batch
  axis (5.5 MB of temporaries here, 7.9 GiB a device for Qwen2.5 7B on a v5e-256)."""
  abstract = nnx.eval_shape(lambda: models.Transformer(CFG, rngs=nnx.Rngs(0)))
  mesh = models.make_mesh((1, 8, 1, 1), devices=jax.devices()[:8])
  sampler = Sampler(abstract, mesh=mesh, max_len=2048)
  prefill, _ = sampler.compile(64, 16, 2000, distinct_prompts=8, temperature=1.0)
  memory = prefill.memory_analysis()
  # The output: each device's 8 rows of a 2,048-slot cache (16.8 MB).
  assert memory.output_size_in_bytes >= 8 * CFG.num_layers * 2 * CFG.num_kv_heads * 2048 * (
      CFG.head_dim * 4)
  assert memory.temp_size_in_bytes < memory.output_size_in_bytes / 8
  # 8 prompts x 8 samples, side by side: each row's prompt is on its own device, so
  # the rows repeat their prompts' caches in place and the prompts' keys fill slots
  # 0..15 by a slice: nothing crosses devices (a gather by row and a scatter by
  # position each all-gathered the prompts' caches over the batch axis).
  assert "all-gather" not in prefill.as_text()


def test_grouping_of_rows_onto_prefilled_prompts():
  grouping = sampler_lib._grouping
  assert grouping(np.repeat(np.arange(3), 4), 4, 16) == 4  # 3 of 4 prompt rows used
  assert grouping(np.arange(6), 8, 8) == 1  # every prompt distinct: rows are prompts
  assert grouping(np.tile(np.arange(3), 4), 4, 16) is None  # interleaved samples
  assert grouping(np.repeat(np.arange(3), 4), 4, 24) is None  # 6 a prompt, 4 given
  assert grouping(np.repeat(np.arange(3), 4), 3, 16) is None  # buckets do not divide


def test_grouped_prefill_samples_what_the_gathering_one_does(model, monkeypatch):
  """Rows repeating their prompt's cache in place (a GRPO group side by side) sample
  exactly what rows gathering it by index do, on a mesh that splits the batch."""
  mesh = models.make_mesh((1, 4, 1, 1), devices=jax.devices()[:4])
  prompts = [p[:9] for p in PROMPTS[:3] for _ in range(4)]
  outs = []
  for grouped in (True, False):
    if not grouped:
      monkeypatch.setattr(sampler_lib, "_grouping", lambda *args: None)
    sampler = Sampler(model, mesh=mesh, max_len=MAX_LEN)
    outs.append(sampler.generate(prompts, max_new_tokens=6, temperature=1.0, seed=3))
    keys = [k for k in sampler._programs if k[0] == "prefill"]
    assert [k[-1] for k in keys] == [4 if grouped else None]
  np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
  np.testing.assert_allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-6)


def test_decode_reads_weights_gathered_once_per_call(model):
  """Weights gathered once per generate call over the batch axes (in the compute dtype,
  freed after it) sample exactly what the FSDP-sharded weights do. (That XLA:TPU then
  gathers no weights inside the decode loop is checked by a TPU compile test.)"""
  mesh = models.make_mesh((1, 4, 1, 1), devices=jax.devices()[:4])
  prompts = [p[:9] for p in PROMPTS[:2] for _ in range(4)]
  outs = {}
  for gather in (True, False):
    sampler = Sampler(model, mesh=mesh, max_len=MAX_LEN, gather_weights=gather)
    outs[gather] = sampler.generate(prompts, max_new_tokens=6, temperature=1.0, seed=5)
    if gather:  # the gathered copy: no batch axis in its shardings, the compute dtype
      weights = jax.tree.leaves(sampler._weights())
      assert all("fsdp" not in str(w.sharding.spec) for w in weights)
      assert {w.dtype for w in weights} == {jnp.dtype(CFG.dtype)}
  np.testing.assert_array_equal(outs[True].tokens, outs[False].tokens)
  np.testing.assert_allclose(outs[True].logprobs, outs[False].logprobs, atol=1e-5)
  # Nothing to gather or cast (one device on the batch axes, float32 weights and compute):
  # no copy; bfloat16 compute still reads a bfloat16 copy.
  one = models.make_mesh((1, 1, 2, 1), devices=jax.devices()[:2])
  sampler = Sampler(model, mesh=one, max_len=MAX_LEN)
  assert not sampler.gather_weights and sampler._weights() is sampler._state
  bf16 = nnx.eval_shape(lambda: models.Transformer(CFG.replace(dtype="bfloat16"),
                                                   rngs=nnx.Rngs(0)))
  assert Sampler(bf16, mesh=one, max_len=MAX_LEN).gather_weights


def test_a_sampler_of_an_abstract_model_only_compiles():
  abstract = nnx.eval_shape(lambda: models.Transformer(CFG, rngs=nnx.Rngs(0)))
  mesh = models.make_mesh((1, 2, 1, 1), devices=jax.devices()[:2])
  sampler = Sampler(abstract, mesh=mesh, max_len=MAX_LEN)
  prefill, decode = sampler.compile(4, 8, 4, temperature=0.0)
  assert decode.memory_analysis().argument_size_in_bytes > 0
  with pytest.raises(ValueError, match="abstract model .* needs a mesh"):
    Sampler(abstract, max_len=MAX_LEN)


# -- a model whose layers are scanned -----------------------------------------------------


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_scanned_layers_sample_what_the_layer_list_samples(model, sampler, cache_dtype):
  """scan_layers: the stacked KV cache is prefilled, copied to each row, decoded and
  kept for a resume; the draws are the layer list's, token for token."""
  scanned = models.relayout(model, scan_layers=True)
  plain = sampler if cache_dtype is None else Sampler(model, max_len=MAX_LEN,
                                                      cache_dtype=cache_dtype)
  ours = Sampler(scanned, max_len=MAX_LEN, cache_dtype=cache_dtype)
  prompts = [p for p in PROMPTS for _ in range(2)]  # each prompt's cache serves two rows
  kw = dict(temperature=1.0, seed=3)
  whole = plain.generate(prompts, max_new_tokens=9, **kw)
  first = ours.generate(prompts, max_new_tokens=5, keep_cache=True, reserve_tokens=9, **kw)
  assert isinstance(first.resume_state.cache, models.KVCache)
  rows = list(range(len(prompts)))
  second = ours.resume(first.resume_state, rows, max_new_tokens=4)
  np.testing.assert_array_equal(np.concatenate([first.tokens, second.tokens], 1), whole.tokens)
  np.testing.assert_allclose(np.concatenate([first.logprobs, second.logprobs], 1),
                             whole.logprobs, atol=1e-5)


def test_lora_model_samples_what_its_merged_weights_sample(model):
  """The sampler runs the adapters unmerged (the learner's exact function, so behaviour
  log-probs match it): the draws are those of the adapters folded into the weights."""
  from flax import nnx
  adapted = models.with_lora(model, 4, jax.random.key(0))
  rng = np.random.default_rng(1)
  for _, v in nnx.iter_graph(adapted):
    if isinstance(v, nnx.LoRAParam):
      v[...] = v[...] + rng.normal(0, 0.3, v.shape).astype(np.float32)
  merged = models.merge_lora(adapted)
  kw = dict(max_new_tokens=6, temperature=1.0, seed=5)
  ours = Sampler(adapted, max_len=MAX_LEN).generate(PROMPTS, **kw)
  want = Sampler(merged, max_len=MAX_LEN).generate(PROMPTS, **kw)
  base = Sampler(model, max_len=MAX_LEN).generate(PROMPTS, **kw)
  assert not np.array_equal(base.tokens, want.tokens)
  np.testing.assert_array_equal(ours.tokens, want.tokens)
  np.testing.assert_allclose(ours.logprobs, want.logprobs, atol=1e-4)


# -- continuous batching ------------------------------------------------------------------

# Rows of every prompt length of PROMPTS, a GRPO group of a repeated prompt among them.
MANY = PROMPTS * 2 + [[7, 7, 2]] * 3 + PROMPTS[::-1]


def _stops_for(out, cut: int = 3):
  """Stop ids that end the rows of `out` (a stop-free call) at uneven lengths."""
  return sorted({int(row[min(cut + i % 5, len(row) - 1)]) for i, row in enumerate(out.tokens)
                 if i % 3})


def test_continuous_batching_samples_what_one_call_samples(sampler):
  """Rows stream through 3 cache rows (4 after rounding to the batch bucket), a stopped
  row's slot taking the next prompt (into a cache row a longer row used before); every row
  draws what one call over all prompts draws, and on_finish reports each row once, as it
  ends."""
  kw = dict(max_new_tokens=14, temperature=1.0, top_p=0.9, seed=11)
  stops = _stops_for(sampler.generate(MANY, **kw))
  whole = sampler.generate(MANY, stop_token_ids=stops, **kw)
  assert 1 < len(set(whole.lengths.tolist())) and "stop" in whole.finish_reasons
  seen = {}
  out = sampler.generate(MANY, stop_token_ids=stops, slots=3,
                         on_finish=lambda i, t, lp, r: seen.setdefault(i, (t.copy(), r)),
                         **kw)
  np.testing.assert_array_equal(out.lengths, whole.lengths)
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-4)
  assert out.finish_reasons == whole.finish_reasons
  assert sorted(seen) == list(range(len(MANY)))
  for i, (tokens, reason) in seen.items():
    np.testing.assert_array_equal(tokens, whole.tokens[i, :whole.lengths[i]])
    assert reason == whole.finish_reasons[i]
  assert out.stats["batch"] == 4 and out.stats["inserts"] > len(MANY) // 4
  # Static chunks of 4 rows, each keyed from its first row's index, draw the same rows;
  # rows that stop early hand their slot on, so streaming decodes fewer row-steps.
  chunks = [sampler.generate(MANY[i:i + 4], stop_token_ids=stops, row_offset=i, **kw)
            for i in range(0, len(MANY), 4)]
  np.testing.assert_array_equal(np.concatenate([c.tokens for c in chunks]), whole.tokens)
  static_row_steps = sum(c.stats["decode_steps"] * c.stats["batch"] for c in chunks)
  assert out.stats["decode_steps"] * out.stats["batch"] < static_row_steps
  assert out.stats["decoded"] == whole.stats["decoded"] == int((whole.lengths - 1).sum())


def test_continuous_batching_prefills_a_group_once_per_refill(sampler):
  """GRPO rows (4 prompts x 4 samples) through 4 slots, every row as long as the others:
  each refill takes one whole group and prefills its prompt once."""
  groups = [p for p in PROMPTS[:4] for _ in range(4)]
  kw = dict(max_new_tokens=6, temperature=1.0, seed=8)
  out = sampler.generate(groups, slots=4, **kw)
  assert out.stats["inserts"] == 3 and out.stats["prefill_rows"] == 4  # fill + 3 refills
  whole = sampler.generate(groups, **kw)
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-4)


def test_continuous_batching_with_enough_slots_is_one_call(sampler):
  kw = dict(max_new_tokens=6, temperature=1.0, seed=2)
  out = sampler.generate(PROMPTS, slots=len(PROMPTS), **kw)
  np.testing.assert_array_equal(out.tokens, sampler.generate(PROMPTS, **kw).tokens)
  assert "inserts" not in out.stats


def test_continuous_batching_of_scanned_layers_and_an_int8_cache(model):
  """A stacked cache (scan_layers, rows on axis 1), int8 with its scales: rows written
  into their slots decode what one call decodes (the layer list and a float cache are
  the other tests')."""
  ours = Sampler(models.relayout(model, scan_layers=True), max_len=MAX_LEN,
                 cache_dtype="int8")
  kw = dict(max_new_tokens=10, temperature=1.0, seed=4)
  stops = _stops_for(ours.generate(MANY, **kw))
  whole = ours.generate(MANY, stop_token_ids=stops, **kw)
  out = ours.generate(MANY, stop_token_ids=stops, slots=4, **kw)
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-4)


@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (1, 8, 1, 1)])
def test_continuous_batching_on_a_mesh_equals_one_device(model, sampler, shape):
  """Slots spread over the batch axes; a refill hands each device the prompts of its own
  free slots, so on a batch-only mesh writing them moves nothing between devices."""
  meshed = Sampler(model, mesh=models.make_mesh(shape), max_len=MAX_LEN)
  kw = dict(max_new_tokens=8, temperature=1.0, seed=6)
  stops = _stops_for(sampler.generate(MANY, **kw), cut=2)
  single = sampler.generate(MANY, stop_token_ids=stops, **kw)
  out = meshed.generate(MANY, stop_token_ids=stops, slots=5, **kw)
  assert out.stats["batch"] == 8  # slots round up to the batch bucket the mesh divides
  np.testing.assert_array_equal(out.tokens, single.tokens)
  np.testing.assert_allclose(out.logprobs, single.logprobs, atol=1e-4)
  refills = [p for key, p in meshed._programs.items() if key[0] == "refill"]
  assert refills and out.stats["inserts"] >= 2
  if shape == (1, 8, 1, 1):
    for program in refills:
      hlo = program.as_text()
      assert not re.findall(r"(all-gather|all-to-all|collective-permute|all-reduce)\(", hlo)


def test_rounds_cut_short_sample_what_one_call_samples(sampler):
  """Rounds of at most 2 decode steps: between_rounds runs after each with the prompts
  still decoding (started, not finished), and the samples are those of one call."""
  kw = dict(max_new_tokens=12, temperature=1.0, seed=3)
  stops = _stops_for(sampler.generate(MANY, **kw))
  whole = sampler.generate(MANY, stop_token_ids=stops, **kw)
  finished, lives = [], []
  out = sampler.generate(MANY, stop_token_ids=stops, slots=4, round_steps=2,
                         on_finish=lambda i, *_: finished.append(i),
                         between_rounds=lambda live: lives.append((live, len(finished))),
                         **kw)
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-4)
  assert len(lives) >= out.stats["decode_steps"] // 2 and out.stats["weight_swaps"] == 0
  for live, n_done in lives:
    assert len(live) <= 4 and not set(live.tolist()) & set(finished[:n_done])
  assert not lives[-1][0].size  # the last round ends with every row
  # Prompts take slots in order: a later prompt is never first seen in an earlier round.
  first_seen = {}
  for k, (live, _) in enumerate(lives):
    for i in live.tolist():
      first_seen.setdefault(i, k)
  rounds = [first_seen[i] for i in sorted(first_seen)]
  assert rounds == sorted(rounds) and len(first_seen) > 4


def test_weights_swapped_between_rounds_reach_the_rows_that_follow(model, sampler):
  """`update_params` between two rounds: rows that ended before it drew what the old
  weights draw, rows prefilled after it what the new weights draw (the keys are the
  prompt's and token's, so each equals one call under its weights), and rows that span
  the swap continue under the new weights from their cache (their log-probs are those
  of the distribution that drew each token)."""
  other = models.create_model(CFG, seed=99)
  kw = dict(max_new_tokens=10, temperature=1.0, seed=5)
  old = sampler.generate(MANY, **kw)
  new = Sampler(other, max_len=MAX_LEN).generate(MANY, **kw)
  assert not np.array_equal(old.tokens, new.tokens)
  ours = Sampler(model, max_len=MAX_LEN)
  before, at_swap = set(), {}

  def swap(live):
    if not at_swap:
      at_swap.update(live=set(live.tolist()), done=set(before))
      ours.update_params(other)

  out = ours.generate(MANY, slots=4, round_steps=3, between_rounds=swap,
                      on_finish=lambda i, *_: None if at_swap else before.add(i), **kw)
  assert out.stats["weight_swaps"] == 1 and at_swap["live"]
  after = set(range(len(MANY))) - at_swap["live"] - at_swap["done"]
  assert after
  for i in at_swap["done"]:
    np.testing.assert_array_equal(out.tokens[i], old.tokens[i])
  for i in after:
    np.testing.assert_array_equal(out.tokens[i], new.tokens[i])
    np.testing.assert_allclose(out.logprobs[i], new.logprobs[i], atol=1e-4)
  # A row that spans the swap: its first 3 tokens came from the old weights.
  spans = sorted(at_swap["live"])
  for i in spans:
    np.testing.assert_array_equal(out.tokens[i, :3], old.tokens[i, :3])
  assert any(not np.array_equal(out.tokens[i], old.tokens[i]) for i in spans)


def test_prompts_returned_between_rounds_run_as_next_turns(sampler):
  """Prompts between_rounds returns (two finished rows' transcripts with an answer after
  them, and one that leaves 3 tokens of room in max_len) take the indices after the
  prompts and draw what one call of each with that row index draws, no further than
  max_len; the first prompts' rows are unchanged."""
  kw = dict(max_new_tokens=8, temperature=1.0, seed=12)
  finished, added = {}, []

  def next_turns(live):
    if added or len(finished) < 2:
      return None
    added.extend([MANY[i] + finished[i].tolist() + [9, 9] for i in sorted(finished)[:2]]
                 + [[4] * (MAX_LEN - 3)])
    return added

  out = sampler.generate(MANY, slots=4, between_rounds=next_turns, max_prompt_len=MAX_LEN - 3,
                         on_finish=lambda i, t, *_: finished.setdefault(i, t.copy()), **kw)
  n = len(MANY)
  assert len(added) == 3 and len(out.lengths) == len(out.finish_reasons) == n + 3
  assert out.stats["continued"] + out.stats["rewritten"] == 3  # none refilled
  assert sorted(finished) == list(range(n + 3))
  whole = sampler.generate(MANY, **kw)
  np.testing.assert_array_equal(out.tokens[:n], whole.tokens)
  for k, prompt in enumerate(added):
    one = sampler.generate([prompt], row_offset=n + k, **{
        **kw, "max_new_tokens": min(8, MAX_LEN - len(prompt))})
    assert out.lengths[n + k] == one.lengths[0]
    np.testing.assert_array_equal(out.tokens[n + k, :one.lengths[0]],
                                  one.tokens[0, :one.lengths[0]])
    np.testing.assert_allclose(out.logprobs[n + k, :one.lengths[0]],
                               one.logprobs[0, :one.lengths[0]], atol=1e-4)
  assert out.lengths[-1] <= 3


def _next_turns_run(sampler, *, slots: int, reuse: bool, swap=None, **kw):
  """MANY through `slots` slots; each even prompt's row, once ended, comes back in the
  same round as its transcript with an answer of 1-4 tokens (prompt 4's: 20, more than
  one chunk). With `swap`, the weights are swapped in the round the first turns come
  back. Returns (completions, the next turns in index order, how many came back in the
  swap's round, the prompt each turn continues)."""
  turns, ended, at_swap, sources = [], [], [], []

  def between_rounds(live):
    more = [(i, MANY[i] + t.tolist() + [9] * (20 if i == 4 else 1 + i % 4))
            for i, t in ended if i < len(MANY) and i % 2 == 0]
    more = [(i, p) for i, p in more if len(p) < MAX_LEN - 1]
    ended.clear()
    if more and swap is not None and not turns:
      sampler.update_params(swap)
      at_swap.append(len(more))
    sources.extend(i for i, _ in more)
    turns.extend(p for _, p in more)
    return [p for _, p in more]

  out = sampler.generate(MANY, slots=slots, between_rounds=between_rounds,
                         max_prompt_len=MAX_LEN - 2, reuse_cache=reuse,
                         on_finish=lambda i, t, *_: ended.append((i, t.copy())), **kw)
  return out, turns, sum(at_swap), sources


@pytest.mark.parametrize("layout", ["layers", "scanned", "mesh", "a slot each"])
def test_next_turns_go_on_in_their_slots_from_the_cache(model, sampler, layout, monkeypatch):
  """A returned transcript that extends a row just ended goes on in that row's slot:
  only its answer (and the turn's last token) is prefilled, in chunks (16 tokens here,
  so the 20-token answer takes two) attending to the cache the turn built. It samples
  what one call over the whole transcript samples, and what prefilling it whole does.
  On a batch-only mesh no cache row moves between devices: the only collectives are
  those of a decode step (the new tokens' keys, the longest length). With a slot for
  every prompt, between_rounds still makes the call run in rounds (32 slots, 14 empty)."""
  ours = {"scanned": Sampler(models.relayout(model, scan_layers=True), max_len=MAX_LEN),
          "mesh": Sampler(model, mesh=models.make_mesh((1, 8, 1, 1)), max_len=MAX_LEN),
          }.get(layout, sampler)
  monkeypatch.setattr(ours, "extend_chunk", 16)
  kw = dict(max_new_tokens=8, temperature=1.0, seed=12)
  slots = {"mesh": 5, "a slot each": 64}.get(layout, 4)
  out, turns, _, sources = _next_turns_run(ours, slots=slots, reuse=True, **kw)
  whole, same_turns, _, _ = _next_turns_run(ours, slots=slots, reuse=False, **kw)
  assert out.stats["batch"] == (32 if layout == "a slot each" else 8 if layout == "mesh"
                                else 4)
  assert turns == same_turns and len(turns) >= 5 and any(
      len(t) - len(MANY[4]) > 20 for t in turns)
  assert out.stats["continued"] == len(turns) and whole.stats["continued"] == 0
  # Each turn reads from the cache its prompt and the tokens before the turn's last.
  n = len(MANY)
  assert out.stats["reused_tokens"] == sum(
      len(MANY[i]) + int(out.lengths[i]) - 1 for i in sources)
  assert out.stats["prefill_rows"] < whole.stats["prefill_rows"]
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-4)
  for k, prompt in enumerate(turns):
    one = sampler.generate([prompt], row_offset=n + k, **{
        **kw, "max_new_tokens": min(8, MAX_LEN - len(prompt))})
    m = int(one.lengths[0])
    assert out.lengths[n + k] == m
    np.testing.assert_array_equal(out.tokens[n + k, :m], one.tokens[0, :m])
    np.testing.assert_allclose(out.logprobs[n + k, :m], one.logprobs[0, :m], atol=1e-4)
  if layout == "mesh":
    extends = [p for key, p in ours._programs.items() if key[0] == "extend"]
    assert extends
    for program in extends:
      moved = [line for line in program.as_text().splitlines()
               if re.search(r"(all-gather|all-to-all|collective-permute|all-reduce)\(", line)]
      # [rows, width 16, kv heads, ...] of the new tokens or scalars; never [.., 64, ..].
      assert moved and not [line for line in moved if re.search(r"\[[^\]]*\b64\b", line)]


def test_held_caches_find_the_longest_held_prefix_of_a_prompt():
  """The slot a next turn goes on in holds a proper prefix of it: the longest such, never
  one that only shares its length and last tokens, nor one the caller cannot use."""
  held = sampler_lib._HeldCaches()
  a = np.arange(20)
  held.add(0, a[:12])
  held.add(1, a[:5])
  held.add(2, np.concatenate([[99], a[1:12]]))  # a[:12]'s length and last 8 tokens
  held.add(3, a[:3])
  assert held.match(a, lambda s: True) == (0, 12)
  assert held.match(a, lambda s: s != 0) == (1, 5)
  assert held.match(a[:12], lambda s: True) == (1, 5)  # a prefix, not the whole prompt
  held.drop(1)
  assert held.match(a[:12], lambda s: True) == (3, 3)
  assert held.match(np.concatenate([[99], a[1:15]]), lambda s: True) == (2, 12)
  assert held.match(np.arange(50, 70), lambda s: True) is None
  held.add(0, a[:2])  # a slot's new row replaces its old sequence
  assert held.match(a, lambda s: s != 3) == (0, 2)


def test_next_turns_after_a_weight_swap_are_prefilled_whole(model):
  """Turns that come back in the round new weights land are prefilled whole under them
  (their slots' caches were built under the old weights): each draws what the new
  weights draw over its whole transcript. Rows that began after the swap go on in their
  slots again."""
  other = models.create_model(CFG, seed=99)
  kw = dict(max_new_tokens=8, temperature=1.0, seed=12)
  ours = Sampler(model, max_len=MAX_LEN)
  out, turns, at_swap, _ = _next_turns_run(ours, slots=4, reuse=True, swap=other, **kw)
  assert out.stats["weight_swaps"] == 1 and at_swap
  new = Sampler(other, max_len=MAX_LEN)
  n = len(MANY)
  for k in range(at_swap):
    one = new.generate([turns[k]], row_offset=n + k, **{
        **kw, "max_new_tokens": min(8, MAX_LEN - len(turns[k]))})
    m = int(one.lengths[0])
    np.testing.assert_array_equal(out.tokens[n + k, :m], one.tokens[0, :m])
    np.testing.assert_allclose(out.logprobs[n + k, :m], one.logprobs[0, :m], atol=1e-4)
  assert 0 < out.stats["continued"] <= len(turns) - at_swap
  # The others are written into free slots from their first token, in chunks: no
  # refill (a program per transcript length bucket) ever prefills a later turn.
  assert out.stats["rewritten"] >= at_swap
  assert out.stats["continued"] + out.stats["rewritten"] == len(turns)


def test_prompts_between_rounds_must_fit_max_prompt_len(sampler):
  kw = dict(max_new_tokens=4, slots=2)
  with pytest.raises(ValueError, match="more than max_prompt_len=17"):
    sampler.generate(MANY, between_rounds=lambda live: [[1] * 18], **kw)
  with pytest.raises(ValueError, match="prompt 18 holds token id -1"):
    sampler.generate(MANY, between_rounds=lambda live: [[-1]], **kw)
  with pytest.raises(ValueError, match="max_prompt_len must be an int from the longest"):
    sampler.generate(MANY, max_prompt_len=MAX_LEN, **kw)


@pytest.mark.parametrize("kwargs,match", [
    ({"slots": 0}, "slots must be a positive int"),
    ({"slots": 2, "round_steps": 0}, "round_steps must be a positive int"),
    ({"slots": True}, "slots must be a positive int"),
    ({"slots": 2.5}, "slots must be a positive int"),
    ({"slots": 2, "keep_cache": True}, "keep_cache cannot be combined with slots"),
    ({"row_offset": -1}, "row_offset must be a non-negative int"),
])
def test_continuous_batching_rejects_bad_slots_and_offsets(sampler, kwargs, match):
  with pytest.raises(ValueError, match=match):
    sampler.generate(PROMPTS, max_new_tokens=4, **kwargs)
