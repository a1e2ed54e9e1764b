"""OLMoE (OlmoeForCausalLM) against `transformers`: Llama's pre-norm layers with q/k norms
over every head's features at once, every MLP a mixture of experts (softmax top-k, not
renormalised by default) in per-expert files, q, k and v clamped (the normed q and k).
Logits (layer list and scanned), greedy generation through the sampler, export, the
load-balancing loss, and the refusals."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, greedy_tokens, hf_logits, perturb,
                                 save_families, spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, num_experts=6, num_experts_per_tok=2, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "olmoe": {},  # as published: no biases, top-k weights not renormalised
    # biases, renormalised weights, and a clamp that cuts the normed q and k
    "biased_norm": dict(attention_bias=True, norm_topk_prob=True, clip_qkv=0.8),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(variant, **extra):
  cfg = transformers.OlmoeConfig(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return spread_routers(perturb(transformers.OlmoeForCausalLM(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_mixture_and_the_norms(saved):
  cfg = models.from_pretrained(saved["olmoe"][0]).cfg
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.ffn_dim) == (6, 2, 32)
  assert not cfg.norm_topk_prob and not cfg.shared_expert_dim and not cfg.dense_layers
  assert cfg.qk_norm and cfg.qk_norm_heads and not cfg.output_norms
  assert not cfg.qkv_bias and not cfg.attn_out_bias
  biased = models.from_pretrained(saved["biased_norm"][0]).cfg
  assert biased.qkv_bias and biased.attn_out_bias and biased.norm_topk_prob
  assert (biased.clip_qkv, biased.clip_qkv_after_norm) == (0.8, True)
  assert (cfg.clip_qkv, cfg.clip_qkv_after_norm) == (None, False)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  folder, hf = saved[variant]
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-4,
                             rtol=0)
  assert np.abs(want).max() > 3
  # The routing matters: every expert given expert 0's weights moves the logits.
  w = (ours.layers if scan else ours.layers[0]).mlp.up_proj
  w.value = jnp.broadcast_to(w[...][..., :1, :, :], w.shape)
  assert np.abs(np.asarray(_jitted_logits(ours, TOKENS)) - want).max() > 1e-3


# The second variant (scanned) with the slow tests.
@pytest.mark.parametrize("variant,scan", [
    ("olmoe", False), pytest.param("biased_norm", True, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  """save_pretrained writes the folder's per-expert tensors bit for bit and a config
  transformers reads back to the same model."""
  written = check_export_round_trip(*saved[variant], transformers.OlmoeForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["clip_qkv"]) == (
      "olmoe", VARIANTS[variant].get("clip_qkv"))


def test_the_clamp_is_after_the_norms(saved):
  """Clamped before the q/k norms (OLMo 1's, DBRX's order) the logits differ."""
  folder, hf = saved["biased_norm"]
  before = models.from_pretrained(folder, clip_qkv_after_norm=False)
  got = np.asarray(_jitted_logits(before, TOKENS))
  assert np.abs(got - hf_logits(hf, TOKENS)).max() > 1e-2


def test_load_balancing_loss_matches_transformers_aux_loss(tmp_path):
  """The train step's router loss is transformers' aux_loss; a config.json that trains
  with it (output_router_logits) sets router_aux_loss_coef, and export keeps it."""
  hf = _hf_model("olmoe", output_router_logits=True, router_aux_loss_coef=0.02)
  hf.save_pretrained(tmp_path / "a")
  ours = models.from_pretrained(str(tmp_path / "a"))
  assert ours.cfg.router_aux_loss_coef == 0.02
  with torch.no_grad():
    want = float(hf(torch.as_tensor(TOKENS)).aux_loss)
  got = nnx.jit(lambda m, t: m.hidden_states(t, router_loss=True)[1])(ours, jnp.asarray(TOKENS))
  assert abs(float(got) - want) <= 1e-5 * want
  models.save_pretrained(ours, str(tmp_path / "b"))
  again = json.loads((tmp_path / "b" / "config.json").read_text())
  assert again["output_router_logits"] and again["router_aux_loss_coef"] == 0.02


def test_what_cannot_be_read_or_written_is_refused(saved, tmp_path):
  config = json.loads(open(f"{saved['olmoe'][0]}/config.json").read())
  cfg = models.hf_config_to_model_config(config)
  with pytest.raises(ValueError, match="clip_qkv_after_norm=True needs clip_qkv"):
    cfg.replace(clip_qkv_after_norm=True)
  with pytest.raises(ValueError, match="shared_expert_dim=16 cannot be written as "
                                       "OlmoeForCausalLM"):
    models.hf.check_exportable(cfg.replace(shared_expert_dim=16))
  with pytest.raises(ValueError, match="qk_norm_heads=False cannot be written as "
                                       "OlmoeForCausalLM"):
    models.hf.check_exportable(cfg.replace(qk_norm_heads=False))
  # transformers sizes OLMoE's q/k norms from hidden_size: heads must split it evenly
  with pytest.raises(ValueError, match="head_dim=32 cannot be written as OlmoeForCausalLM, "
                                       "whose heads split d_model=64 evenly"):
    models.hf.check_exportable(cfg.replace(head_dim=32))


def test_the_preset_is_a_config_transformers_reads():
  """olmoe_1b_7b: 6.9B parameters, and written as a config.json transformers reads it and
  the reader maps it back to the preset (training-only fields aside)."""
  preset = models.get_preset("olmoe_1b_7b")
  assert abs(preset.num_params / 1e9 - 6.92) < 0.01
  written = json.loads(json.dumps(models.hf.model_config_to_hf(preset)))
  hf = transformers.OlmoeConfig(**{k: v for k, v in written.items()
                                   if k not in ("architectures", "model_type")})
  assert (hf.num_experts, hf.num_experts_per_tok, hf.intermediate_size) == (64, 8, 1024)
  back = models.hf_config_to_model_config(written)
  assert back == preset.replace(remat=back.remat, scan_layers=back.scan_layers)
