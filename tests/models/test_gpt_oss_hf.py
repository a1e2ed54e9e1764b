"""gpt-oss (GptOssForCausalLM) against `transformers`: attention sinks, biases on every
attention projection, a biased router, experts with biases and a clamped SwiGLU stored
stacked (gate and up interleaved), sliding-window layers alternating with full ones, YaRN.
Logits (layer list and scanned), gradients, greedy generation through the sampler (the
sinks in decode attention, the sliding layers' rings), export, and MXFP4 checkpoints
(D 64 and F 32: MXFP4 packs blocks of 32 values).

The tiny random model's weights are large (initializer_range 0.3, random biases and norm
scales) so that every feature moves the logits, which the first test checks."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import mxfp4
from tests.models.parity import (assert_close_to_scale, check_reward_model_round_trip,
                                 greedy_tokens, hf_logits, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_config(**extra):
  return transformers.GptOssConfig(
      vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=4,
      num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
      initializer_range=0.3, tie_word_embeddings=False, pad_token_id=0, bos_token_id=2,
      eos_token_id=1, **extra)


@pytest.fixture(scope="module")
def hf_model():
  torch.manual_seed(0)
  model = transformers.GptOssForCausalLM(_hf_config()).float().eval()
  with torch.no_grad():  # biases (zero at init) and norm scales that matter
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(torch.randn_like(p) * 0.3)
  return model


@pytest.fixture(scope="module")
def folder(hf_model, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("gpt_oss") / "model")
  hf_model.save_pretrained(path)
  return path


def _hf_logits(model, tokens=TOKENS):
  return hf_logits(model, tokens)


def _logits(model, tokens=TOKENS):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(tokens)))


def test_config_reads_every_gpt_oss_feature(folder):
  cfg = models.from_pretrained(folder).cfg
  assert (cfg.attention_sinks, cfg.qkv_bias, cfg.attn_out_bias, cfg.router_bias,
          cfg.expert_bias) == (True,) * 5
  assert (cfg.mlp_activation, cfg.swiglu_limit, cfg.swiglu_alpha) == ("clamped_swiglu", 7.0,
                                                                      1.702)
  assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
  assert cfg.sliding_window == 4 and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
  assert (cfg.rope.type, cfg.rope.theta, cfg.rope.factor, cfg.rope.truncate) == (
      "yarn", 150_000.0, 32.0, False)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(hf_model, folder, scan):
  want = _hf_logits(hf_model)
  got = _logits(models.from_pretrained(folder, scan_layers=scan))
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
  assert np.abs(want).max() > 3  # the logits are not all near zero


def test_each_feature_moves_the_logits(folder):
  """Zeroing the sinks, a bias, or dropping the clamp or the window changes the logits
  by far more than the parity tolerance: the test above sees each of them."""
  model = models.from_pretrained(folder)
  base = _logits(model)
  state = nnx.state(model)

  def with_zeroed(name):
    changed = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if name in jax.tree_util.keystr(path) else x, state)
    return _logits(nnx.merge(nnx.graphdef(model), changed))

  for name in ("sinks", "o_bias", "router_bias", "gate_bias", "up_bias", "down_bias",
               "q_bias"):
    assert np.abs(with_zeroed(name) - base).max() > 1e-2, name
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
      model.cfg.replace(swiglu_limit=1e6), rngs=nnx.Rngs(0))))
  assert np.abs(_logits(nnx.merge(graphdef, state)) - base).max() > 1e-2, "clamp"
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
      model.cfg.replace(layer_types=("full_attention",) * 4), rngs=nnx.Rngs(0))))
  assert np.abs(_logits(nnx.merge(graphdef, state)) - base).max() > 1e-2, "window"


def test_gradients_match_transformers(hf_model, folder):
  """d(sum of the targets' log-probs) for the sinks, the router's and experts' biases,
  the interleaved gate_up projection and the output bias, against torch autograd."""
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  for i in range(4):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    pairs = [(layer["attn"]["sinks"], hf.self_attn.sinks.grad),
             (layer["attn"]["o_bias"], hf.self_attn.o_proj.bias.grad),
             (layer["mlp"]["router_bias"], hf.mlp.router.bias.grad),
             (layer["mlp"]["down_bias"], hf.mlp.experts.down_proj_bias.grad),
             (layer["mlp"]["gate_bias"], hf.mlp.experts.gate_up_proj_bias.grad[..., ::2]),
             (layer["mlp"]["up_bias"], hf.mlp.experts.gate_up_proj_bias.grad[..., 1::2]),
             (layer["mlp"]["gate_proj"], hf.mlp.experts.gate_up_proj.grad[..., ::2]),
             (layer["mlp"]["down_proj"], hf.mlp.experts.down_proj.grad)]
    for ours, theirs in pairs:  # at most 1.6e-4 of the scale measured
      assert_close_to_scale(ours[...], theirs.numpy())
    assert np.abs(hf.self_attn.sinks.grad.numpy()).max() > 1e-3


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(hf_model, folder, scan):
  """Through the sampler's KV cache (sinks in decode attention; the sliding layers keep
  rings of 8 slots, shorter than the 13-token prompt and the rows) the greedy tokens are
  transformers' generate()'s."""
  for i, (got, want) in enumerate(greedy_tokens(folder, hf_model, PROMPTS, 12, scan)):
    assert got == want, i


def test_export_round_trip_is_exact(hf_model, folder, tmp_path):
  """save_pretrained writes gate_up_proj interleaved again: transformers loads it and
  computes the same logits; the files hold the same tensors as the original's."""
  model = models.from_pretrained(folder)
  models.save_pretrained(model, str(tmp_path / "out"))
  back = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(_hf_logits(back), _hf_logits(hf_model))
  with open(tmp_path / "out" / "config.json") as fh:
    assert json.load(fh)["model_type"] == "gpt_oss"


def test_reward_model_scores_match_transformers(tmp_path):
  """GptOssForSequenceClassification: each row's score at its last real token, in and out."""
  torch.manual_seed(1)
  hf = transformers.GptOssForSequenceClassification(_hf_config(num_labels=1)).float().eval()
  check_reward_model_round_trip(hf, transformers.GptOssForSequenceClassification, tmp_path)


def _write_mxfp4(src: str, dst: str) -> dict:
  """src's checkpoint with every expert projection stored as MXFP4 (NAME_blocks and
  NAME_scales, as the published gpt-oss files), and transformers' dequantization of
  them: {NAME: array}."""
  from safetensors.numpy import load_file, save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  tensors = load_file(os.path.join(src, "model.safetensors"))
  dequantized = {}
  for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
    blocks, scales = mxfp4.quantize(tensors.pop(name))
    tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    dequantized[name] = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
  os.makedirs(dst)
  save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(src, "config.json")) as fh:
    config = json.load(fh)
  config["quantization_config"] = {"quant_method": "mxfp4",
                                   "modules_to_not_convert": ["model.layers.*.self_attn",
                                                              "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}
  with open(os.path.join(dst, "config.json"), "w") as fh:
    json.dump(config, fh)
  return dequantized


def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(folder, tmp_path):
  """A published-style MXFP4 folder (the experts as blocks and scales) loads with the
  expert weights transformers' own dequantization gives: the same model as a plain
  folder holding those weights, logits and all."""
  from safetensors.numpy import load_file, save_file
  dequantized = _write_mxfp4(folder, str(tmp_path / "mxfp4"))
  plain = load_file(os.path.join(folder, "model.safetensors"))
  assert any(np.abs(plain[n] - w).max() > 1e-3 for n, w in dequantized.items())  # lossy
  plain.update(dequantized)
  os.makedirs(tmp_path / "plain")
  save_file(plain, str(tmp_path / "plain" / "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(folder, "config.json")) as fh, \
       open(tmp_path / "plain" / "config.json", "w") as out:
    out.write(fh.read())
  quantized = models.from_pretrained(str(tmp_path / "mxfp4"))
  reference = models.from_pretrained(str(tmp_path / "plain"))
  for a, b in zip(jax.tree.leaves(nnx.state(quantized)), jax.tree.leaves(nnx.state(reference))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gpt_oss_20b_preset_counts_the_published_parameters():
  """transformers' count on the meta device for gpt-oss-20b's config, 20,914,757,184."""
  cfg = models.get_preset("gpt_oss_20b")
  assert cfg.num_params == 20_914_757_184
  with torch.device("meta"):
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(num_hidden_layers=24,
                                                                  num_local_experts=32))
  assert sum(p.numel() for p in hf.parameters()) == cfg.num_params
  read = {**hf.config.to_dict(), "architectures": ["GptOssForCausalLM"]}
  assert models.hf_config_to_model_config(read).replace(
      dtype="bfloat16", param_dtype="bfloat16", remat=cfg.remat, scan_layers=True,
      max_position_embeddings=cfg.max_position_embeddings) == cfg


@pytest.mark.parametrize("rope", [models.RopeConfig(theta=10_000.0),
                                  models.get_preset("gpt_oss_20b").rope])
def test_config_round_trips_through_transformers(rope):
  """config.json states the rope even when it is the default kind: without it, both
  transformers and our reader take a gpt-oss config for YaRN x32."""
  cfg = models.get_preset("gpt_oss_20b").replace(rope=rope, num_layers=2,
                                                 layer_types=("sliding_attention",
                                                              "full_attention"))
  out = models.hf.model_config_to_hf(cfg)
  assert models.hf_config_to_model_config(out).rope == rope
  hf = transformers.GptOssConfig(**{k: v for k, v in out.items() if k != "architectures"})
  assert hf.rope_parameters["rope_type"] == rope.type
  assert hf.rope_parameters["rope_theta"] == rope.theta


def test_other_families_refuse_gpt_oss_features():
  """A Llama or Mixtral class cannot hold sinks, the output bias or biased experts."""
  base = models.get_preset("tiny")
  for change in (dict(attention_sinks=True), dict(attn_out_bias=True),
                 dict(mlp_activation="clamped_swiglu")):
    with pytest.raises(ValueError, match="cannot be written as LlamaForCausalLM"):
      models.hf.check_exportable(base.replace(**change))
  with pytest.raises(ValueError, match="router_bias / expert_bias need a mixture"):
    base.replace(router_bias=True)
