"""Gemma 2 / Gemma 3 above the model: the sampler's KV-cache decoding (sliding-window
layers, attention and final logit soft caps, the query scale, Gemma 3's local rope),
greedy generation against `transformers`, the RL train step, and the attention kernels.

The models are tiny and random, with weights large enough (init_std 0.3, random norm
scales) that every Gemma feature changes the outputs, which the first test checks: the
comparisons after it cannot pass vacuously. The window (4) is shorter than prompts and
generations, so it cuts both prefill and decode, and decode attention reads the cache in
blocks of 4 slots (blocks before the window skipped). The samplers write at most 4 tokens
a continuing call, so each sliding layer keeps a ring of 8 slots (window + 4 - 1, rounded
up), shorter than the longest prompt and the rows: prefill keeps each row's newest keys
and decode wraps the ring several times.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import ModelConfig, RopeConfig
from posttrain.rl import losses, packing, presets
from posttrain.rl import state as state_lib
from posttrain.rl import train_step as ts
from posttrain.sampling import Sampler
from tests.sampling.sampling_refs import full_logits, greedy_by_recomputation

LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention")
# Untied embeddings: a random tied table makes every token predict itself.
GEMMA2 = ModelConfig(
    vocab_size=97, d_model=40, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=12,
    ffn_dim=56, architecture="Gemma2ForCausalLM", norm_unit_offset=True, sandwich_norms=True,
    embed_scale=True, mlp_activation="gelu_tanh", query_pre_attn_scalar=32.0,
    attn_logit_softcap=2.0, final_logit_softcap=1.5, sliding_window=4,
    layer_types=LAYER_TYPES, init_std=0.3, max_position_embeddings=64, decode_chunk=4,
    attention_chunk=8, logprob_chunk=8)
# Gemma 3: q/k norms, a rotary embedding of the sliding layers' own, no soft caps.
GEMMA3 = GEMMA2.replace(
    architecture="Gemma3ForCausalLM", qk_norm=True, attn_logit_softcap=None,
    final_logit_softcap=None, rope=RopeConfig(theta=1_000_000.0, type="linear", factor=2.0),
    rope_local=RopeConfig(theta=100.0))
CONFIGS = {"gemma2": GEMMA2, "gemma3": GEMMA3}

MAX_LEN = 32
STEPS = 12
# Lengths 6, 1, 13 and 4: a prompt longer than the window, one of a single token.
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33)), [3, 3, 3, 8]]


# -- models and cache-free references -----------------------------------------------------


def _randomize_norms(model, seed):
  """Every norm scale (zero-initialised, (1 + w) in Gemma) drawn at random, so a wrong
  norm offset, a swapped sandwich norm or a missing q/k norm shows in the outputs."""
  rng = np.random.default_rng(seed)
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param) and node.shape and node.get_metadata().get(
        "logical_axes", ())[-1:] in (("norm",), ("head_dim",)) and node[...].ndim == 1:
      node[...] = node[...] + rng.normal(0, 0.3, node.shape).astype(np.float32)
  return model


@functools.cache
def plain_model(name):
  """The layer-list model of a config (random norms), shared by the tests."""
  return _randomize_norms(models.create_model(CONFIGS[name], seed=0), seed=1)


@functools.cache
def model_of(name, scan):
  plain = plain_model(name)
  return models.relayout(plain, scan_layers=True) if scan else plain


RING = 8


@functools.cache
def sampler_of(name, scan, cache_dtype=None, extend_chunk=4):
  """extend_chunk 4: rings of RING slots; 512 (the default): every slot kept, as the
  rows are shorter than a ring of 4 + 511 slots."""
  return Sampler(model_of(name, scan), max_len=MAX_LEN, cache_dtype=cache_dtype,
                 extend_chunk=extend_chunk)


def _with_config(model, cfg):
  """`model`'s weights under another config of the same parameter shapes."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, nnx.state(model))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BxT, positions_BxT=None, segment_ids_BxT=None):
  return nnx.merge(graphdef, state)(tokens_BxT, positions_BxT, segment_ids_BxT)


def _logits(model, *args):
  """model(*args) in one compiled call (an eager call runs op by op, for seconds)."""
  return _forward(*nnx.split(model), *args)


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@functools.cache
def expected_greedy(name):
  return greedy_by_recomputation(plain_model(name), PROMPTS, STEPS)


def generated_logprobs(model, prompts, completions, lengths, temperature=1.0):
  """log softmax(logits / T) of each generated token, recomputed without a cache."""
  seqs = [list(p) + list(c[:n]) for p, c, n in zip(prompts, completions, lengths)]
  out = []
  for p, seq, logits, n in zip(prompts, seqs, full_logits(model, seqs), lengths):
    logp = log_softmax(logits / temperature)
    pos = np.arange(len(p) - 1, len(p) - 1 + n)
    out.append(logp[pos, np.asarray(seq)[pos + 1]])
  return out


# -- the features matter ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_the_gemma_features_change_the_outputs(name):
  """Dropping any one feature (a soft cap, the window, the query scale, the local rope)
  from the same weights changes the logits a lot, and the attention-side ones change
  greedy choices: the tests below would see them computed wrongly."""
  cfg, plain = CONFIGS[name], plain_model(name)
  tokens = [list(np.random.default_rng(3).integers(0, cfg.vocab_size, 24))]
  tokens.append(PROMPTS[2] + PROMPTS[0] + PROMPTS[3] + PROMPTS[1])  # 24 too
  base = np.stack(full_logits(plain, tokens))
  variants = {"window": dict(layer_types=("full_attention",) * 3),
              "query scale": dict(query_pre_attn_scalar=None)}
  if name == "gemma2":
    variants.update({"attention cap": dict(attn_logit_softcap=None),
                     "final cap": dict(final_logit_softcap=None)})
    # The cap bites: logits saturate near +-1.5.
    assert np.abs(base).max() > 1.4 and np.abs(base).max() < 1.5
  else:
    variants["local rope"] = dict(rope_local=None)
  for what, change in variants.items():
    other = np.stack(full_logits(_with_config(plain, cfg.replace(**change)), tokens))
    assert np.abs(other - base).max() > 0.3, what
    if what != "final cap":  # a monotone map of the logits keeps the argmax
      assert (other.argmax(-1) != base.argmax(-1)).any(), what


# -- sampler: greedy and log-probs through the KV cache -----------------------------------


@pytest.mark.parametrize("scan,extend_chunk", [(False, 4), (True, 4), (True, 512)],
                         ids=["layers", "scanned", "scanned-whole-rows"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_greedy_equals_argmax_by_full_recomputation(name, scan, extend_chunk):
  """Prefill (windowed attention over the padded prompt block) and decode (the window
  read from the cache block by block, from each sliding layer's ring or from its whole
  row's slots; scanned: each layer's kind picked by lax.cond, with its stack, its rope
  tables by its flag) choose the argmax of the cache-free layer-list model at every
  step, and report its log-probs."""
  sampler = sampler_of(name, scan, extend_chunk=extend_chunk)
  out = sampler.generate(PROMPTS, max_new_tokens=STEPS, temperature=0.0)
  np.testing.assert_array_equal(out.tokens, expected_greedy(name))
  assert out.finish_reasons == ["length"] * len(PROMPTS)
  assert len(np.unique(out.tokens)) > STEPS  # not one token repeated
  ref = generated_logprobs(plain_model(name), PROMPTS, out.tokens, out.lengths)
  np.testing.assert_allclose(out.logprobs, np.stack(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,scan", [
    # The layer lists' decode is the greedy test's too; out of the default run for time.
    pytest.param("gemma2", False, marks=pytest.mark.slow, id="gemma2-layers"),
    pytest.param("gemma2", True, id="gemma2-scanned"),
    pytest.param("gemma3", False, marks=pytest.mark.slow, id="gemma3-layers"),
    pytest.param("gemma3", True, id="gemma3-scanned"),
])
def test_sampled_logprobs_equal_model_recomputation(name, scan):
  """At temperatures 1 and 0.7 the behaviour log-probs are those of softmax(capped
  logits / T) of the cache-free model, for the tokens drawn."""
  sampler = sampler_of(name, scan)
  for temperature in (1.0, 0.7):
    out = sampler.generate(PROMPTS, max_new_tokens=STEPS, temperature=temperature, seed=7)
    ref = generated_logprobs(plain_model(name), PROMPTS, out.tokens, out.lengths,
                             temperature)
    for i in range(len(PROMPTS)):
      n = out.lengths[i]
      np.testing.assert_allclose(out.logprobs[i, :n], ref[i], atol=1e-5, rtol=0,
                                 err_msg=f"T={temperature} row {i}")


# Per-slot, per-head absmax int8: log-probs move a little (as tests/sampling states).
INT8_MAX_LOGPROB_ERROR = 0.25
INT8_MEAN_LOGPROB_ERROR = 0.05


@pytest.mark.parametrize("scan", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["layers", "scanned"])
def test_int8_cache_logprobs_stay_close_to_recomputation(scan):
  """An int8 cache under the windowed, capped decode: the tokens it draws get log-probs
  within the int8 tolerance of the exact model's (and not exactly: it quantized)."""
  out = sampler_of("gemma2", scan, "int8").generate(PROMPTS, max_new_tokens=STEPS,
                                                    temperature=1.0, seed=5)
  ref = generated_logprobs(plain_model("gemma2"), PROMPTS, out.tokens, out.lengths)
  errors = np.concatenate([np.abs(out.logprobs[i, :out.lengths[i]] - ref[i])
                           for i in range(len(PROMPTS))])
  assert 0 < errors.max() < INT8_MAX_LOGPROB_ERROR, errors.max()
  assert errors.mean() < INT8_MEAN_LOGPROB_ERROR, errors.mean()


@pytest.mark.parametrize("name,scan,chunk", [
    pytest.param("gemma2", True, 2, id="gemma2-scanned"),
    pytest.param("gemma2", False, 16, id="gemma2-layers-chunks-of-16"),
    pytest.param("gemma3", False, 2, marks=pytest.mark.slow, id="gemma3-layers"),
])
def test_next_turns_from_the_cache_equal_recomputation(name, scan, chunk):
  """Continuous batching's next turns: a finished row's transcript with an answer after
  it goes on in its slot, its new tokens run in chunks of `chunk` queries against the
  cache the row built (the window reaching back into it), and decodes greedily what the
  cache-free model chooses for the whole transcript. The sliding layers' rings (8
  slots for chunks of 2, 24 for 16, in a 48-slot cache) take refilled prompts longer
  than them (their newest keys) and shorter (the slots after them left to the previous
  row, read as no position)."""
  prompts, steps = PROMPTS * 2, 6
  ended, turns = [], []

  def between_rounds(live):
    more = [prompts[i] + tokens.tolist() + [9, 8, 7, 6, 5] for i, tokens in ended
            if i < len(prompts) and i % 2 == 0]
    ended.clear()
    turns.extend(more)
    return more

  sampler = Sampler(model_of(name, scan), max_len=48, extend_chunk=chunk)
  out = sampler.generate(prompts, max_new_tokens=steps, temperature=0.0, slots=4,
                         between_rounds=between_rounds, max_prompt_len=40,
                         on_finish=lambda i, tokens, *_: ended.append((i, tokens.copy())))
  assert len(turns) == 4 and out.stats["continued"] == len(turns)
  plain = plain_model(name)
  np.testing.assert_array_equal(out.tokens[:len(prompts)],
                                greedy_by_recomputation(plain, prompts, steps))
  np.testing.assert_array_equal(out.tokens[len(prompts):],
                                greedy_by_recomputation(plain, turns, steps))


def _cache_slots(cache):
  """Slots per row of each layer's cache, in layer order."""
  if isinstance(cache, list):
    return [layer.k.shape[-2] for layer in cache]
  if isinstance(cache, models.LayerKindCaches):
    stacks = {False: iter([cache.full.k.shape[-2]] * cache.full.k.shape[0]),
              True: iter([cache.sliding.k.shape[-2]] * cache.sliding.k.shape[0])}
    return [next(stacks[kind == "sliding_attention"]) for kind in LAYER_TYPES]
  return [cache.k.shape[-2]] * cache.k.shape[0]


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_sliding_layers_keep_a_ring_and_resume_from_it(scan):
  """The kept cache holds RING slots for each sliding layer and every slot for the full
  one; generating 5 tokens, then resuming twice (4 + 3) from it, wrapping the rings,
  gives the cache-free model's greedy tokens."""
  sampler = sampler_of("gemma3", scan)
  first = sampler.generate(PROMPTS, max_new_tokens=5, temperature=0.0, keep_cache=True,
                           reserve_tokens=STEPS)
  cache_len = first.stats["cache_len"]
  assert cache_len > 2 * RING
  assert _cache_slots(first.resume_state.cache) == [RING, cache_len, RING]
  rows = list(range(len(PROMPTS)))
  second = sampler.resume(first.resume_state, rows, max_new_tokens=4)
  third = sampler.resume(second.resume_state, rows, max_new_tokens=3)
  tokens = np.concatenate([first.tokens, second.tokens, third.tokens], axis=1)
  np.testing.assert_array_equal(tokens, expected_greedy("gemma3"))


def test_rings_on_a_mesh_with_continuous_batching():
  """On 8 devices over the batch, with 8 slots for 16 rows (each slot refilled with a
  prompt once its row ends), the scanned model's two stacks (rings and full rows) give
  the cache-free model's greedy tokens."""
  sampler = Sampler(model_of("gemma3", True), mesh=models.make_mesh((1, 8, 1, 1)),
                    max_len=MAX_LEN, extend_chunk=4)
  out = sampler.generate(PROMPTS * 4, max_new_tokens=STEPS, temperature=0.0, slots=8)
  assert out.stats["batch"] == 8
  np.testing.assert_array_equal(out.tokens, np.concatenate([expected_greedy("gemma3")] * 4))


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_every_layer_sliding_keeps_only_rings(scan):
  """Mistral's layout (every layer sliding): the cache is RING slots a layer, the
  completions are still as wide as asked, and greedy decoding is the cache-free
  model's."""
  cfg = GEMMA2.replace(layer_types=None)
  plain = _with_config(plain_model("gemma2"), cfg)
  model = models.relayout(plain, scan_layers=True) if scan else plain
  sampler = Sampler(model, max_len=MAX_LEN, extend_chunk=4)
  out = sampler.generate(PROMPTS, max_new_tokens=STEPS, temperature=0.0, keep_cache=True)
  assert _cache_slots(out.resume_state.cache) == [RING] * 3
  assert out.tokens.shape == (len(PROMPTS), STEPS)
  np.testing.assert_array_equal(out.tokens, greedy_by_recomputation(plain, PROMPTS, STEPS))


# -- greedy generation against transformers -----------------------------------------------


def _hf_gemma(transformers, torch, name):
  common = dict(vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                query_pre_attn_scalar=32, sliding_window=4, layer_types=list(LAYER_TYPES),
                max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False,
                pad_token_id=0, bos_token_id=2, eos_token_id=1)
  if name == "gemma2":
    cfg = transformers.Gemma2Config(attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
                                    **common)
    cls = transformers.Gemma2ForCausalLM
  else:
    cfg = transformers.Gemma3TextConfig(
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                            "factor": 2.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        **common)
    cls = transformers.Gemma3ForCausalLM
  torch.manual_seed(0)
  model = cls(cfg).float().eval()
  with torch.no_grad():  # Gemma's norms start at zero ((1 + w) scales): make them matter.
    for param_name, p in model.named_parameters():
      if "norm" in param_name:
        p.add_(torch.randn_like(p) * 0.3)
  return model


@pytest.mark.parametrize("name", [
    "gemma2",
    # Its decode equals the cache-free model's (above), whose logits match transformers'
    # (test_gemma_hf.py); out of the default run for time.
    pytest.param("gemma3", marks=pytest.mark.slow),
])
def test_greedy_generation_matches_transformers(tmp_path, name):
  """A random Gemma saved by `transformers` and loaded by `from_pretrained` generates
  greedily, through the sampler's KV cache, the tokens `generate()` does, for prompts
  longer and shorter than the window."""
  torch = pytest.importorskip("torch", reason="parity tests need torch")
  transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
  hf = _hf_gemma(transformers, torch, name)
  hf.save_pretrained(tmp_path, safe_serialization=True)
  prompts = PROMPTS[:3]
  steps = 10
  want = []
  for p in prompts:  # One prompt at a time: no padding for transformers to handle.
    ids = torch.tensor([p])
    with torch.no_grad():
      out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=steps, eos_token_id=None, pad_token_id=0)
    want.append(out[0, len(p):].tolist())
  want = np.asarray(want)
  assert want.shape == (len(prompts), steps)  # no row stopped early
  assert len(np.unique(want)) > steps
  # Scanned: the layers' kinds mixed in one scan (the layer list decodes what it does,
  # test_greedy_equals_argmax_by_full_recomputation).
  ours = models.from_pretrained(str(tmp_path), decode_chunk=4, scan_layers=True)
  assert ours.cfg.layer_types == LAYER_TYPES and ours.cfg.sliding_window == 4
  got = Sampler(ours, max_len=MAX_LEN).generate(prompts, max_new_tokens=steps,
                                                temperature=0.0)
  np.testing.assert_array_equal(got.tokens, want)
  # Not vacuous: without the window (or the attention cap) the argmax path differs.
  plain = models.from_pretrained(str(tmp_path))
  seqs = [p + w.tolist() for p, w in zip(prompts, want)]
  changes = [dict(layer_types=("full_attention",) * 3)]
  changes += [dict(attn_logit_softcap=None)] if name == "gemma2" else [dict(rope_local=None)]
  for change in changes:
    logits = full_logits(_with_config(plain, plain.cfg.replace(**change)), seqs)
    picked = np.stack([lg[len(p) - 1:-1].argmax(-1) for p, lg in zip(prompts, logits)])
    assert (picked != want).any(), change


# -- the RL train step --------------------------------------------------------------------

ROW_LEN = 24
STEP_TEMPERATURE = 0.7


def _one_device_mesh():
  return models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])


def _packed_batch(seed, rows=6):
  """Random trajectories packed several to a row (segments of their own, positions
  restarting, some longer than the window), as one micro-batch."""
  rng = np.random.default_rng(seed)
  trajectories = []
  for _ in range(11):
    response = rng.integers(1, GEMMA2.vocab_size, rng.integers(3, 9))
    trajectories.append(dict(
        prompt_tokens=rng.integers(1, GEMMA2.vocab_size, rng.integers(2, 6)),
        response_tokens=response, response_mask=rng.random(len(response)) < 0.9,
        behaviour_logprobs=-rng.uniform(1.0, 6.0, len(response)),
        advantages=rng.normal(), rewards=rng.normal()))
  batch = packing.pack_trajectories(trajectories, ROW_LEN, num_rows=rows)
  assert (batch["segment_ids"].max(1) > 1).sum() >= 3  # several sequences per row
  return packing.split_microbatches(batch, ROW_LEN * rows, num_microbatches=1)


def _reference_token_logprobs(model, mb, temperature):
  """log softmax(model(tokens) / T) at the targets: the capped logits, then T."""
  logits = model(mb["tokens"], mb["positions"], mb["segment_ids"])
  logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  return jnp.take_along_axis(logp, mb["targets"][..., None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jitted_reference_logprobs(graphdef, state, mb, temperature):
  return _reference_token_logprobs(nnx.merge(graphdef, state), mb, temperature)


def _first_micro_batch(batch):
  return {k: jnp.asarray(v[0]) for k, v in batch.items()}


@functools.cache
def _compute_logprobs(cfg, temperature):
  return ts.make_compute_logprobs(cfg, mesh=_one_device_mesh(), temperature=temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_logprobs_are_those_of_the_capped_logits(temperature):
  """The learner's log-probs over packed rows (each segment windowed on its own) are
  log softmax(model(tokens) / T): the soft-capped logits, then the temperature."""
  cfg, model = GEMMA2, plain_model("gemma2")
  batch = _packed_batch(0)
  logprobs = _compute_logprobs(cfg, temperature)(nnx.state(model, nnx.Param),
                                                 batch)["logprobs"]
  mb = _first_micro_batch(batch)
  want = np.asarray(_jitted_reference_logprobs(*nnx.split(model), mb, temperature))
  np.testing.assert_allclose(logprobs[0], want, atol=2e-5, rtol=0)
  if temperature != 1:  # Capping after the temperature would give other log-probs.
    raw = np.asarray(_logits(_with_config(model, cfg.replace(final_logit_softcap=None)),
                             mb["tokens"], mb["positions"], mb["segment_ids"]), np.float64)
    wrong = np.take_along_axis(log_softmax(1.5 * np.tanh(raw / temperature / 1.5)),
                               np.asarray(mb["targets"])[..., None], -1)[..., 0]
    mask = np.asarray(mb["loss_mask"]) != 0
    assert np.abs(wrong - want)[mask].max() > 0.05


def _params_delta(new, old):
  return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                      nnx.to_pure_dict(new), nnx.to_pure_dict(old))


@functools.cache
def grpo_step_of(layout):
  """(batch, SGD(1) parameter change, metrics) of one GRPO step (the preset: KL to a
  reference, sequence-mean loss) at temperature 0.7 from the Gemma 2 weights, as a layer
  list ("layers") or scanned and rematerialised ("scanned"), with old and reference
  log-probs near the current ones (ratios in and out of the clip range)."""
  plain = plain_model("gemma2")
  model = plain if layout == "layers" else models.relayout(
      _with_config(plain, plain.cfg.replace(remat="full")), scan_layers=True)
  mesh, cfg = _one_device_mesh(), model.cfg
  optimizer = optax.sgd(1.0)  # the update is minus the gradient itself
  init = state_lib.init_train_state(model, optimizer, mesh=mesh)
  batch = _packed_batch(1)
  current = np.asarray(_compute_logprobs(GEMMA2, STEP_TEMPERATURE)(
      nnx.state(plain, nnx.Param), batch)["logprobs"])
  rng = np.random.default_rng(2)
  for key in ("old_logprobs", "ref_logprobs"):
    batch[key] = current + rng.normal(0, 0.3, current.shape).astype(np.float32)
  step = ts.make_train_step(cfg, presets.algorithm_config("grpo"), optimizer, mesh=mesh,
                            temperature=STEP_TEMPERATURE)
  new, metrics = step(state_lib.frozen_copy(init), batch)
  return batch, _params_delta(new.params, init.params), jax.tree.map(np.asarray, metrics)


def test_grpo_step_is_the_gradient_of_the_loss_on_the_capped_logits():
  """The step's loss and its SGD(1) update equal the GRPO loss (KL term included) on
  log-probs from the full soft-capped logits at T = 0.7, differentiated by jax.grad."""
  model = plain_model("gemma2")
  batch, delta, metrics = grpo_step_of("layers")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss_cfg = losses.LossConfig.from_config(presets.algorithm_config("grpo"))
  mb = _first_micro_batch(batch)

  def reference_loss(p):
    logp = _reference_token_logprobs(nnx.merge(graphdef, p, rest), mb, STEP_TEMPERATURE)
    denominator = losses.loss_denominator(loss_cfg, mb)
    return losses.rl_loss(loss_cfg, logp, mb, denominator=denominator)[0]

  want_loss, want_grad = jax.jit(jax.value_and_grad(reference_loss))(params)
  np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-5)
  # Ratios left the clip range and the KL term is on: both are part of what is compared.
  assert metrics["clip_fraction/low"] + metrics["clip_fraction/high"] > 0
  assert metrics["loss/kl"] > 0
  grad = jax.tree.map(np.asarray, nnx.to_pure_dict(want_grad))
  for (path, d), g in zip(jax.tree_util.tree_leaves_with_path(delta), jax.tree.leaves(grad),
                          strict=True):
    scale = np.abs(g).max()
    assert scale > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(-d, g, atol=1e-5 * scale, rtol=1e-4,
                               err_msg=jax.tree_util.keystr(path))


def test_scanned_layers_give_the_layer_lists_grpo_step():
  """scan_layers with layers of both kinds (each layer's kind picked by lax.cond inside
  the scan, rematerialised): the same GRPO loss, metrics and update as the layer list."""
  _, want, want_metrics = grpo_step_of("layers")
  _, got, metrics = grpo_step_of("scanned")
  want, got = dict(want), dict(got)
  for name in ("loss", "loss/policy", "loss/kl", "kl", "entropy", "grad_norm"):
    np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-5, err_msg=name)
  stacked, layers = got.pop("layers"), want.pop("layers")
  for i in range(GEMMA2.num_layers):
    for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(stacked),
                            jax.tree.leaves(layers[i]), strict=True):
      np.testing.assert_allclose(b[i], a, rtol=1e-5, atol=1e-5 * np.abs(a).max(),
                                 err_msg=f"layer {i}{jax.tree_util.keystr(path)}")
  for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                          strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max(),
                               err_msg=jax.tree_util.keystr(path))


# -- attention kernels --------------------------------------------------------------------


def _kernel_inputs():
  """Two rows of 32: packed segments (one longer than the window) and padding."""
  rng = np.random.default_rng(4)
  tokens = rng.integers(0, GEMMA2.vocab_size, (2, 32)).astype(np.int32)
  segments = np.array([[1] * 13 + [2] * 11 + [3] * 6 + [0] * 2,
                       [1] * 27 + [0] * 5], np.int32)
  positions = np.array([list(range(13)) + list(range(11)) + list(range(6)) + [0, 0],
                        list(range(27)) + [0] * 5], np.int32)
  weights = rng.normal(size=(2, 32, GEMMA2.vocab_size)).astype(np.float32)
  return tuple(map(jnp.asarray, (tokens, positions, segments, weights)))


@functools.cache
def _logits_and_grad(attention_impl, options="", scan=False):
  cfg = GEMMA2.replace(attention_impl=attention_impl, attention_options=options)
  model = _with_config(plain_model("gemma2"), cfg)
  if scan:  # the kernels inside the scan's lax.cond, rematerialised
    model = models.relayout(_with_config(model, cfg.replace(remat="full")), scan_layers=True)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens, positions, segments, weights = _kernel_inputs()
  keep = (segments > 0)[..., None]

  def loss(p):
    logits = nnx.merge(graphdef, p, rest)(tokens, positions, segments)
    return jnp.sum(jnp.where(keep, logits * weights, 0.0)), logits

  (_, logits), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  grad = jax.tree.map(np.asarray, nnx.to_pure_dict(grad))
  if scan:  # back to the layer list's tree
    stacked = grad.pop("layers")
    grad["layers"] = {i: jax.tree.map(lambda x, i=i: x[i], stacked)
                      for i in range(cfg.num_layers)}
  return np.asarray(logits), grad


@pytest.mark.parametrize("attention_impl,options,scan", [
    # Blocks of 8 keys: the window crosses block edges.
    pytest.param("chunked", "", False, id="chunked"),
    pytest.param("flash", "", False, id="flash"),  # Pallas interpret mode on CPU
    # Two blocks a row, some skipped by the window.
    pytest.param("flash", "backend=gpu,block_q=16,block_kv=16", False,
                 marks=pytest.mark.slow, id="flash-blocks16"),
    pytest.param("flash", "", True, marks=pytest.mark.slow, id="flash-scanned"),
])
def test_attention_kernels_equal_the_reference(attention_impl, options, scan):
  """Chunked and flash attention with the sliding window, the attention soft cap and
  the query scale, over packed segments, give the reference kernel's logits and
  parameter gradients."""
  want_logits, want_grad = _logits_and_grad("reference")
  logits, grad = _logits_and_grad(attention_impl, options, scan)
  keep = np.asarray(_kernel_inputs()[2]) > 0
  np.testing.assert_allclose(logits[keep], want_logits[keep], atol=1e-4, rtol=0)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grad), jax.tree.leaves(want_grad),
                          strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4 * max(np.abs(w).max(), 1.0), rtol=1e-4,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("attention_impl,options,scan", [
    pytest.param("ring", "", False, id="ring-chunked"),
    pytest.param("ring", "interpret=true", True, marks=pytest.mark.slow, id="ring-flash-scanned"),
    pytest.param("flash", "", True, marks=pytest.mark.slow, id="flash-sharded-scanned"),
])
def test_sequence_parallel_attention_on_a_mesh_equals_one_device(attention_impl, options,
                                                                  scan):
  """Ring attention over a sequence axis of 4 (the window spans two devices' chunks), and
  flash attention inside shard_map, give the one-device reference's logits."""
  cfg = GEMMA2.replace(sliding_window=12, scan_layers=scan)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 64)))
  reference = models.create_model(cfg, seed=0)
  want = np.asarray(_logits(reference, tokens))
  mesh = models.make_mesh((1, 1, 2, 4))
  model = models.create_model(cfg.replace(attention_impl=attention_impl,
                                          attention_options=options), seed=0, mesh=mesh)
  ctx = models.ShardingContext(mesh)
  with jax.set_mesh(mesh):
    got = np.asarray(nnx.jit(lambda m, t: m(t, ctx=ctx))(model, tokens))
  np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, np.abs(want).max()), rtol=0)
