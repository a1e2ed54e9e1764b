"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM) against `transformers`: no input
norms (each sublayer's output normed before its residual add), q/k norms over every
head's features at once, a bias on all four attention projections, and OLMo 3's sliding
layers with a rotary embedding of their own. Logits (layer list, scanned, on a mesh that
splits the heads), gradients, greedy generation through the sampler, export, the
published config form, the reward model, and what other classes refuse.

The tiny random models' norm scales and biases are moved off their initial values so
that every feature moves the logits, which a test checks."""

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

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, attention_bias=True, pad_token_id=0, bos_token_id=2,
              eos_token_id=1)
FAMILIES = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # Three sliding layers to one full one (transformers' default layout), a window
    # shorter than the rows, and a scaled rotary embedding on the full layer alone.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(sliding_window=4, rope_scaling={"rope_type": "linear", "factor": 2.0})),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(family, cls=None, **extra):
  config_class, model_class, fields = FAMILIES[family]
  cfg = getattr(transformers, config_class)(**{**COMMON, **fields, **extra})
  torch.manual_seed(0)
  return perturb(getattr(transformers, cls or model_class)(cfg).float().eval())


def _hf_logits(model, tokens=TOKENS):
  return hf_logits(model, tokens)


def _logits(model, tokens=TOKENS):
  return np.asarray(_jitted_logits(model, jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """family -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, FAMILIES, _hf_model)


def test_config_reads_every_olmo_feature(saved):
  for family in FAMILIES:
    cfg = models.from_pretrained(saved[family][0]).cfg
    assert (cfg.output_norms, cfg.qk_norm, cfg.qk_norm_heads, cfg.qkv_bias,
            cfg.attn_out_bias, cfg.sandwich_norms) == (True,) * 5 + (False,), family
    assert cfg.norm_eps == 1e-5  # transformers' OLMo default; config.json states it too
  olmo3 = models.from_pretrained(saved["olmo3"][0]).cfg
  assert olmo3.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
  assert olmo3.sliding_window == 4
  assert (olmo3.rope.type, olmo3.rope.factor, olmo3.rope.theta) == ("linear", 2.0, 500_000.0)
  assert (olmo3.rope_local.type, olmo3.rope_local.theta) == ("default", 500_000.0)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(saved, family, scan):
  folder, hf = saved[family]
  want = _hf_logits(hf)
  got = _logits(models.from_pretrained(folder, scan_layers=scan))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3  # the logits are not all near zero


def test_logits_match_on_a_mesh_that_splits_the_heads(saved):
  """The q/k norms span every head: with the heads split over the tensor axis their
  mean of squares is a sum across devices, which the partitioner must insert."""
  folder, hf = saved["olmo3"]
  mesh = models.make_mesh((1, 1, 2, 1), devices=jax.devices()[:2])
  model = models.from_pretrained(folder, mesh=mesh)
  assert model.layers[0].attn.q_norm.scale[...].sharding.spec[0] == "tensor"
  np.testing.assert_allclose(_logits(model), _hf_logits(hf), atol=1e-4, rtol=0)


def test_each_feature_moves_the_logits(saved):
  """Zeroing an output norm or the output bias, norming each head apart, dropping the
  window or the full layer's own rotary embedding each change the logits by far more
  than the parity tolerance: the parity tests see each of them."""
  model = models.from_pretrained(saved["olmo3"][0])
  base = _logits(model)
  graphdef, state = nnx.split(model)

  def changed(fn):
    return _logits(nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fn, state)))

  for name in ("attn_out_norm", "mlp_out_norm", "o_bias"):
    got = changed(lambda path, x: jnp.zeros_like(x) if name in jax.tree_util.keystr(path)
                  else x)
    assert np.abs(got - base).max() > 1e-2, name
  # Scaling one head's query projection: a per-head norm would cancel it, one over
  # every head does not.
  got = changed(lambda path, x: x.at[:, 0].multiply(3.0)
                if "'q_proj'" in jax.tree_util.keystr(path) else x)
  assert np.abs(got - base).max() > 1e-2, "q norm over the heads"
  for change in (dict(layer_types=("full_attention",) * 4), dict(rope_local=None)):
    other = nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
        model.cfg.replace(**change), rngs=nnx.Rngs(0))))
    assert np.abs(_logits(nnx.merge(other, state)) - base).max() > 1e-2, change


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for the q/k norms, both output norms, the output
  bias and the projections, against torch autograd."""
  folder, hf_model = saved["olmo2"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    pairs = [(layer["attn"]["q_norm"]["scale"], hf.self_attn.q_norm.weight.grad),
             (layer["attn"]["k_norm"]["scale"], hf.self_attn.k_norm.weight.grad),
             (layer["attn_out_norm"]["scale"], hf.post_attention_layernorm.weight.grad),
             (layer["mlp_out_norm"]["scale"], hf.post_feedforward_layernorm.weight.grad),
             (layer["attn"]["o_bias"], hf.self_attn.o_proj.bias.grad),
             (layer["attn"]["k_bias"], hf.self_attn.k_proj.bias.grad),
             (layer["mlp"]["down_proj"], hf.mlp.down_proj.weight.grad.T)]
    for ours, theirs in pairs:
      assert_close_to_scale(ours[...], theirs.numpy())
    assert np.abs(hf.self_attn.q_norm.weight.grad.numpy()).max() > 1e-3


@pytest.mark.parametrize("family,scan", [("olmo2", False), ("olmo3", False), ("olmo3", True)])
def test_greedy_generation_matches_transformers(saved, family, scan):
  """Through the sampler's KV cache (OLMo 3's sliding layers keep rings shorter than the
  13-token prompt and the rows) the greedy tokens are transformers' generate()'s."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[family], PROMPTS, 12, scan)):
    assert got == want, (family, i)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_round_trip_is_exact(saved, family, tmp_path):
  """save_pretrained writes the q/k norms flat again: transformers loads the files and
  computes the same logits."""
  folder, hf_model = saved[family]
  models.save_pretrained(models.from_pretrained(folder), str(tmp_path / "out"))
  cls = type(hf_model)
  back = cls.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(_hf_logits(back), _hf_logits(hf_model))
  with open(tmp_path / "out" / "config.json") as fh:
    written = json.load(fh)
  assert written["model_type"] == family
  assert back.config.rope_parameters == hf_model.config.rope_parameters


def test_published_olmo3_config_form_is_read_as_transformers_reads_it():
  """The published files state rope_theta and a YaRN rope_scaling (no layer_types):
  transformers gives the scaling to the full layers alone, and the sliding layers base
  500k whatever rope_theta says; the layout is three sliding layers to a full one."""
  published = dict(COMMON, architectures=["Olmo3ForCausalLM"], model_type="olmo3",
                   num_hidden_layers=8, rope_theta=250_000.0, sliding_window=4096,
                   rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                 "original_max_position_embeddings": 8192,
                                 "attention_factor": 1.2, "beta_fast": 32, "beta_slow": 1})
  cfg = models.hf_config_to_model_config(published)
  theirs = transformers.Olmo3Config(**{k: v for k, v in published.items()
                                       if k != "architectures"})
  assert cfg.layer_types == tuple(theirs.layer_types)
  full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters[
      "sliding_attention"]
  assert (cfg.rope.type, cfg.rope.theta, cfg.rope.factor, cfg.rope.attention_factor) == (
      full["rope_type"], full["rope_theta"], full["factor"], full["attention_factor"])
  assert (cfg.rope_local.type, cfg.rope_local.theta) == (local["rope_type"],
                                                         local["rope_theta"])
  # Written back per layer type, it reads the same in both.
  out = models.hf.model_config_to_hf(cfg)
  assert models.hf_config_to_model_config(out) == cfg
  again = transformers.Olmo3Config(**{k: v for k, v in out.items() if k != "architectures"})
  assert again.rope_parameters["sliding_attention"]["rope_theta"] == local["rope_theta"]
  assert again.rope_parameters["full_attention"]["rope_type"] == "yarn"


def test_olmo2_without_attention_bias_has_none(tmp_path):
  """attention_bias=false (the published OLMo 2 files): no q/k/v or output bias, in or
  out."""
  hf = _hf_model("olmo2", attention_bias=False)
  hf.save_pretrained(str(tmp_path / "a"))
  ours = models.from_pretrained(str(tmp_path / "a"))
  assert not ours.cfg.qkv_bias and not ours.cfg.attn_out_bias
  np.testing.assert_allclose(_logits(ours), _hf_logits(hf), atol=1e-4, rtol=0)
  models.save_pretrained(ours, str(tmp_path / "b"))
  back = transformers.Olmo2ForCausalLM.from_pretrained(str(tmp_path / "b")).float().eval()
  np.testing.assert_array_equal(_hf_logits(back), _hf_logits(hf))


def test_reward_model_scores_match_transformers(tmp_path):
  """Olmo2ForSequenceClassification: each row's score at its last real token, in and out."""
  hf = _hf_model("olmo2", cls="Olmo2ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.Olmo2ForSequenceClassification, tmp_path)


def test_what_other_classes_refuse():
  """Only OLMo classes hold output norms or q/k norms over the heads, and an OLMo class
  holds nothing else; the config refuses contradictory norm options."""
  tiny = models.get_preset("tiny")
  with pytest.raises(ValueError, match="output_norms=True cannot be written as "
                                       "LlamaForCausalLM"):
    models.hf.check_exportable(tiny.replace(output_norms=True))
  qwen3 = tiny.replace(architecture="Qwen3ForCausalLM", qk_norm=True)
  with pytest.raises(ValueError, match="qk_norm_heads=True cannot be written as "
                                       "Qwen3ForCausalLM"):
    models.hf.check_exportable(qwen3.replace(qk_norm_heads=True))
  olmo = tiny.replace(architecture="Olmo2ForCausalLM", qk_norm=True, qk_norm_heads=True,
                      output_norms=True)
  models.hf.check_exportable(olmo)
  for change, match in ((dict(output_norms=False), "output_norms=False"),
                        (dict(qk_norm_heads=False), "qk_norm_heads=False"),
                        (dict(qk_norm=False, qk_norm_heads=False), "qk_norm=False"),
                        (dict(qkv_bias=True), "attn_out_bias=False"),
                        (dict(sliding_window=8), r"\['sliding_window'\] cannot be written")):
    with pytest.raises(ValueError, match=match):
      models.hf.check_exportable(olmo.replace(**change))
  with pytest.raises(ValueError, match="qk_norm_heads=True needs qk_norm=True"):
    tiny.replace(qk_norm_heads=True)
  with pytest.raises(ValueError, match="output_norms and sandwich_norms"):
    tiny.replace(output_norms=True, sandwich_norms=True)


def test_parameter_count_is_transformers_count():
  """num_params counts the q/k norms over every head (transformers' count on the meta
  device)."""
  with torch.device("meta"):
    hf = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**COMMON))
  cfg = models.hf_config_to_model_config({**hf.config.to_dict(),
                                          "architectures": ["Olmo3ForCausalLM"]})
  assert cfg.num_params == sum(p.numel() for p in hf.parameters())
