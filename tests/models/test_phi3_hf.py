"""Phi-3 / Phi-4 (Phi3ForCausalLM) against `transformers`: q, k and v in one fused
projection and gate and up in another (our parameters are slices of them), a partial
rotary embedding (Phi-4-mini rotates 3/4 of each head), LongRoPE with its short and
long factors, and a window over every layer. Logits (layer list and scanned, below and
past LongRoPE's original context), gradients, greedy generation through the sampler,
export, the reward model, LoRA, and what other classes refuse."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_reward_model_round_trip,
                                 greedy_tokens, hf_logits, perturb, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
ORIGINAL = 12  # LongRoPE's original context here: the 20-token rows pass it
VARIANTS = {
    "plain": {},
    # Phi-4-mini's layout: 3/4 of each head rotates (6 frequencies of 16 features), under
    # LongRoPE.
    "longrope": dict(partial_rotary_factor=0.75, original_max_position_embeddings=ORIGINAL,
                     rope_scaling={"type": "longrope",
                                   "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                   "long_factor": [2.0 + 0.5 * i for i in range(6)]}),
    "window": dict(sliding_window=5),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(variant, cls="Phi3ForCausalLM", **extra):
  cfg = transformers.Phi3Config(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb(getattr(transformers, cls)(cfg).float().eval(), biases=False)


def _hf_logits(model, tokens=TOKENS):
  return hf_logits(model, tokens)


def _logits(model, tokens=TOKENS, **kw):
  if kw:
    return np.asarray(model(jnp.asarray(tokens), **{k: jnp.asarray(v) for k, v in kw.items()}))
  return np.asarray(_jitted_logits(model, jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_every_phi3_feature(saved):
  cfg = models.from_pretrained(saved["longrope"][0]).cfg
  rope = cfg.rope
  assert (rope.type, rope.partial_rotary_factor, rope.original_max_position_embeddings) == (
      "longrope", 0.75, ORIGINAL)
  assert rope.short_factor == pytest.approx([1.0 + 0.1 * i for i in range(6)])
  assert rope.long_factor == pytest.approx([2.0 + 0.5 * i for i in range(6)])
  assert rope.factor == 64 / ORIGINAL  # transformers' default: the contexts' ratio
  assert not cfg.qkv_bias and cfg.sliding_window is None
  assert models.from_pretrained(saved["window"][0]).cfg.sliding_window == 5
  plain = models.from_pretrained(saved["plain"][0]).cfg.rope
  assert (plain.type, plain.partial_rotary_factor) == ("default", 1.0)
  # Phi-3's first files named LongRoPE "su" (and "yarn"): read as longrope, as
  # transformers' Phi3Config renames them.
  with open(f"{saved['longrope'][0]}/config.json") as fh:
    published = json.load(fh)
  for legacy in ("su", "yarn"):
    published["rope_scaling"] = dict(published.get("rope_scaling") or
                                     published["rope_parameters"], type=legacy)
    published.pop("rope_parameters", None)
    published["rope_scaling"].pop("rope_type", None)
    assert models.hf_config_to_model_config(published).rope == rope


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  """The 20-token rows pass LongRoPE's original context (the long factors); their first
  10 tokens alone do not (the short ones)."""
  folder, hf = saved[variant]
  model = models.from_pretrained(folder, scan_layers=scan)
  for tokens in (TOKENS, TOKENS[:, :10]):
    want = _hf_logits(hf, tokens)
    np.testing.assert_allclose(_logits(model, tokens), want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3  # the logits are not all near zero


def test_longrope_factors_and_partial_rotation_move_the_logits(saved):
  """The long factors move the logits of the 20-token rows alone, the short ones those of
  the 10-token rows alone, and rotating the whole head moves both: the parity test sees
  each of them."""
  model = models.from_pretrained(saved["longrope"][0])
  state = nnx.state(model)
  rope = model.cfg.rope
  cases = ((dict(long_factor=rope.short_factor), (True, False)),
           (dict(short_factor=rope.long_factor), (False, True)),
           (dict(partial_rotary_factor=1.0, short_factor=rope.short_factor + (1.0,) * 2,
                 long_factor=rope.long_factor + (1.0,) * 2), (True, True)))
  for change, moves in cases:
    other = nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
        model.cfg.replace(rope=models.RopeConfig(**{**rope.__dict__, **change})),
        rngs=nnx.Rngs(0))))
    for tokens, expected in zip((TOKENS, TOKENS[:, :10]), moves):
      moved = np.abs(_logits(nnx.merge(other, state), tokens) - _logits(model, tokens)).max()
      assert (moved > 1e-2) if expected else (moved == 0), (change, tokens.shape)


def test_longrope_picks_factors_per_sequence(saved):
  """Each sequence, a row or a packed segment, takes the long factors when its own
  positions pass the original context: a short row batched with a long one, and two
  packed sequences, give what transformers computes for each alone."""
  folder, hf = saved["longrope"]
  model = models.from_pretrained(folder)
  short, long = TOKENS[0, :8], TOKENS[1]
  # A short row padded beside a long one.
  batch = np.zeros((2, 20), np.int64)
  batch[0, :8], batch[1] = short, long
  segments = np.zeros((2, 20), np.int32)
  segments[0, :8], segments[1] = 1, 1
  positions = np.tile(np.arange(20, dtype=np.int32), (2, 1))
  got = _logits(model, batch, positions_BxT=positions, segment_ids_BxT=segments)
  np.testing.assert_allclose(got[0, :8], _hf_logits(hf, short[None])[0], atol=1e-4, rtol=0)
  np.testing.assert_allclose(got[1], _hf_logits(hf, long[None])[0], atol=1e-4, rtol=0)
  # One row packing a 6-token sequence and a 14-token one (past the context).
  first, second = TOKENS[0, :6], TOKENS[1, :14]
  packed = np.concatenate([first, second])[None]
  segments = np.array([[1] * 6 + [2] * 14], np.int32)
  positions = np.array([list(range(6)) + list(range(14))], np.int32)
  got = _logits(model, packed, positions_BxT=positions, segment_ids_BxT=segments)
  np.testing.assert_allclose(got[0, :6], _hf_logits(hf, first[None])[0], atol=1e-4, rtol=0)
  np.testing.assert_allclose(got[0, 6:], _hf_logits(hf, second[None])[0], atol=1e-4, rtol=0)


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for q, k, v (slices of the fused qkv_proj) and gate,
  up (of gate_up_proj), against torch autograd."""
  folder, hf_model = saved["longrope"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  d, n, k, h, f = 64, 4, 2, 16, 96
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    qkv = hf.self_attn.qkv_proj.weight.grad.numpy()  # [(n + 2k) h, d]
    gate_up = hf.mlp.gate_up_proj.weight.grad.numpy()  # [2f, d]
    pairs = [(layer["attn"]["q_proj"], qkv[:n * h].T.reshape(d, n, h)),
             (layer["attn"]["k_proj"], qkv[n * h:(n + k) * h].T.reshape(d, k, h)),
             (layer["attn"]["v_proj"], qkv[(n + k) * h:].T.reshape(d, k, h)),
             (layer["mlp"]["gate_proj"], gate_up[:f].T),
             (layer["mlp"]["up_proj"], gate_up[f:].T)]
    for ours, want in pairs:
      assert_close_to_scale(ours[...], want)


@pytest.mark.parametrize("variant,scan", [("longrope", False), ("longrope", True),
                                          ("window", False), ("plain", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Through the sampler's KV cache the greedy tokens are transformers' generate()'s:
  under LongRoPE, the 13-token prompt starts past the original context (long factors
  throughout) and the short prompts decode below it; from the token that passes it a
  row keeps its short-rotated cache (where transformers recomputes the whole row), so
  those rows are compared up to there."""
  pairs = greedy_tokens(*saved[variant], PROMPTS, 12, scan)
  for i, (prompt, (got, want)) in enumerate(zip(PROMPTS, pairs)):
    # Token j is computed at position len(prompt) + j - 1.
    same = 12 if variant != "longrope" or len(prompt) > ORIGINAL else ORIGINAL - len(prompt) + 1
    assert got[:same] == want[:same], (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  """save_pretrained fuses q, k, v and gate, up again: transformers loads the files and
  computes the same logits, and reads the same rotary embedding."""
  folder, hf_model = saved[variant]
  ours = models.from_pretrained(folder)
  models.save_pretrained(ours, str(tmp_path / "out"))
  back = transformers.Phi3ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  for tokens in (TOKENS, TOKENS[:, :10]):
    np.testing.assert_array_equal(_hf_logits(back, tokens), _hf_logits(hf_model, tokens))
  with open(tmp_path / "out" / "config.json") as fh:
    written = json.load(fh)
  assert written["model_type"] == "phi3"
  assert models.hf_config_to_model_config(written) == ours.cfg


def test_reward_model_scores_match_transformers(tmp_path):
  """Phi3ForSequenceClassification: each row's score at its last real token, in and out."""
  hf = _hf_model("longrope", cls="Phi3ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.Phi3ForSequenceClassification, tmp_path)


def test_lora_exports_merged_and_refuses_peft_files(saved, tmp_path):
  """Adapters on q/k/v and gate/up train as on any model and export merged into the
  fused tensors; PEFT's Phi-3 adapter files (one A shared by the fused q, k and v) are
  refused by name."""
  model = models.from_pretrained(saved["plain"][0], lora_rank=2)
  graphdef, state = nnx.split(model)
  state = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.3 if "lora_b" in jax.tree_util.keystr(path) else x, state)
  model = nnx.merge(graphdef, state)
  want = _logits(model)
  assert np.abs(want - _hf_logits(saved["plain"][1])).max() > 1e-2  # the adapters act
  models.save_pretrained(model, str(tmp_path / "merged"))
  back = transformers.Phi3ForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
  # float32 sums in another order through the merged (larger) weights
  np.testing.assert_allclose(_hf_logits(back), want, atol=5e-4, rtol=0)
  with pytest.raises(ValueError, match="fused qkv_proj / gate_up_proj"):
    models.save_lora_adapter(model, str(tmp_path / "adapter"))


def test_what_other_classes_refuse():
  tiny = models.get_preset("tiny")
  longrope = models.RopeConfig(type="longrope", short_factor=(1.0,) * 16,
                               long_factor=(2.0,) * 16, original_max_position_embeddings=64)
  for rope, what in ((longrope, "LongRoPE"),
                    (models.RopeConfig(partial_rotary_factor=0.5), "a partial rotary")):
    with pytest.raises(ValueError, match=f"{what}.* cannot be written as LlamaForCausalLM; "
                                         "Phi3ForCausalLM"):
      models.hf.check_exportable(tiny.replace(rope=rope))
  phi3 = tiny.replace(architecture="Phi3ForCausalLM")
  models.hf.check_exportable(phi3.replace(rope=longrope))
  with pytest.raises(ValueError, match="head_dim=16 cannot be written as Phi3ForCausalLM"):
    models.hf.check_exportable(phi3.replace(head_dim=16))
  with pytest.raises(ValueError, match="qkv_bias=True cannot be written as Phi3ForCausalLM"):
    models.hf.check_exportable(phi3.replace(qkv_bias=True))
  with pytest.raises(ValueError, match="rope type 'linear' cannot be written as Phi3"):
    models.hf.check_exportable(phi3.replace(rope=models.RopeConfig(type="linear",
                                                                   factor=2.0)))
  with pytest.raises(ValueError, match="rope type 'longrope' is read for Phi3ForCausalLM"):
    models.hf_config_to_model_config(dict(
        COMMON, architectures=["LlamaForCausalLM"],
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                      "long_factor": [1.0] * 8}))


def test_bad_rope_settings_name_the_problem():
  with pytest.raises(ValueError, match="partial_rotary_factor must be in"):
    models.RopeConfig(partial_rotary_factor=0.0)
  with pytest.raises(ValueError, match="longrope needs short_factor and long_factor"):
    models.RopeConfig(type="longrope", short_factor=(1.0,), original_max_position_embeddings=8)
  with pytest.raises(ValueError, match="longrope needs original_max_position_embeddings"):
    models.RopeConfig(type="longrope", short_factor=(1.0,), long_factor=(1.0,))
  cfg = models.get_preset("tiny").replace(  # head_dim 32: 16 frequencies, not 4
      rope=models.RopeConfig(type="longrope", short_factor=(1.0,) * 4, long_factor=(1.0,) * 4,
                             original_max_position_embeddings=64))
  with pytest.raises(ValueError, match=r"one entry per rotated frequency \(16\), got 4"):
    models.Transformer(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rotates 1 features"):
    models.RopeConfig(partial_rotary_factor=0.05).rotary_dim(32)


def test_parameter_count_is_transformers_count():
  with torch.device("meta"):
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON))
  cfg = models.hf_config_to_model_config({**hf.config.to_dict(),
                                          "architectures": ["Phi3ForCausalLM"]})
  assert cfg.num_params == sum(p.numel() for p in hf.parameters())
