"""Apertus (ApertusForCausalLM) against `transformers`: Llama with per-head q/k norms and
an MLP of no gate through xIELU, whose two scales each MLP learns (beta and eps fixed).
Logits (layer list and scanned), greedy generation, export, PEFT adapters on the gateless
MLP, what a gradient reaches, and against a numpy xIELU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_peft_round_trip, greedy_tokens, perturb, save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1,
              rope_parameters={"rope_type": "llama3", "rope_theta": 12_000_000.0,
                               "factor": 8.0, "original_max_position_embeddings": 16,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0})
VARIANTS = {"plain": {}, "biased": dict(attention_bias=True, tie_word_embeddings=True)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  cfg = transformers.ApertusConfig(**{**COMMON, **VARIANTS[variant]})
  torch.manual_seed(0)
  model = perturb(transformers.ApertusForCausalLM(cfg).float().eval())
  with torch.no_grad():  # each layer's xIELU scales apart from the others' and their init
    for name, p in model.named_parameters():
      if "act_fn.alpha" in name:
        p.add_(torch.randn_like(p) * 0.5)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_xielu_mlp(saved):
  cfg = models.from_pretrained(saved["biased"][0]).cfg
  assert (cfg.mlp_activation, cfg.qk_norm, cfg.qkv_bias, cfg.attn_out_bias) == (
      "xielu", True, True, True)
  assert (cfg.rope.type, cfg.rope.theta, cfg.rope.factor) == ("llama3", 12_000_000.0, 8.0)
  _, state = models.abstract_model(cfg)
  assert "gate_proj" not in str(jax.tree_util.tree_structure(state))


def test_xielu_against_numpy(saved):
  """One MLP's activation, its scales as the file holds them, equals xIELU in numpy."""
  model = models.from_pretrained(saved["plain"][0])
  mlp = model.layers[1].mlp
  x = np.linspace(-6.0, 4.0, 41, dtype=np.float32)
  ap = np.log1p(np.exp(float(mlp.xielu_alpha_p[...][0])))
  beta, eps = float(mlp.xielu_beta[...]), float(mlp.xielu_eps[...])
  an = beta + np.log1p(np.exp(float(mlp.xielu_alpha_n[...][0])))
  want = np.where(x > 0, ap * x * x + beta * x, (np.expm1(np.minimum(x, eps)) - x) * an + beta * x)
  np.testing.assert_allclose(np.asarray(mlp._xielu(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["plain"], PROMPTS, 10, False)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.ApertusForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["hidden_act"]) == ("apertus", "xielu")


def test_a_gradient_reaches_the_scales_and_not_beta_or_eps(saved):
  model = models.from_pretrained(saved["plain"][0])
  tokens = jnp.asarray(TOKENS)

  def loss(m):
    logp = jax.nn.log_softmax(m(tokens[:, :-1]).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
  mlp = nnx.jit(nnx.grad(loss))(model).layers[0].mlp
  assert float(jnp.abs(mlp.xielu_alpha_p[...]).max()) > 0
  assert float(jnp.abs(mlp.xielu_alpha_n[...]).max()) > 0
  assert float(jnp.abs(mlp.xielu_beta[...])) == 0 and float(jnp.abs(mlp.xielu_eps[...])) == 0


def test_peft_adapters_on_the_gateless_mlp(saved, tmp_path):
  folder, hf = saved["plain"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("plain"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
  with pytest.raises(ValueError, match="gate_proj"):
    models.from_pretrained(folder, lora_rank=4, lora_targets="gate_proj")


def test_refusals(saved):
  cfg = models.from_pretrained(saved["plain"][0]).cfg
  written = models.hf.model_config_to_hf(cfg)
  with pytest.raises(ValueError, match="hidden_act='silu' is not supported"):
    models.hf_config_to_model_config({**written, "hidden_act": "silu"})
  with pytest.raises(ValueError, match="mlp_activation='xielu' cannot be written as "
                                       "LlamaForCausalLM"):
    models.hf.check_exportable(cfg.replace(architecture="LlamaForCausalLM", qk_norm=False))
  with pytest.raises(ValueError, match="has no mixture of experts form"):
    cfg.replace(num_experts=4, num_experts_per_tok=2)
