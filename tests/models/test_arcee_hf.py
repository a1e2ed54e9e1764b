"""Arcee AFM (ArceeForCausalLM) against `transformers`: Llama with an MLP of no gate,
down(relu(up(x))^2). Logits (layer list and scanned), greedy generation, export, the
reward model (ArceeForSequenceClassification) and a LoRA step on the gateless MLP."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, perturb,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {"plain": {}, "biased": dict(attention_bias=True, tie_word_embeddings=True)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls=None, **extra):
  cfg = transformers.ArceeConfig(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb((cls or transformers.ArceeForCausalLM)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_gateless_mlp(saved):
  cfg = models.from_pretrained(saved["biased"][0]).cfg
  assert (cfg.mlp_activation, cfg.qkv_bias, cfg.attn_out_bias, cfg.tie_embeddings) == (
      "relu2", True, True, True)
  _, state = models.abstract_model(cfg)
  assert "gate_proj" not in str(jax.tree_util.tree_structure(state))


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["plain"], PROMPTS, 10, False)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.ArceeForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["hidden_act"]) == ("arcee", "relu2")


def test_reward_model_round_trip(tmp_path):
  check_reward_model_round_trip(
      _hf_model("plain", transformers.ArceeForSequenceClassification, num_labels=1),
      transformers.ArceeForSequenceClassification, tmp_path)


def test_lora_on_the_gateless_mlp_trains_only_the_adapters(saved):
  """LoRA on up_proj and down_proj (there is no gate_proj): a step moves the adapters
  and leaves the base where it was; gate_proj as a target is refused."""
  model = models.from_pretrained(saved["plain"][0], lora_rank=4,
                                 lora_targets="up_proj,down_proj")
  tokens = jnp.asarray(TOKENS)

  def loss(m):
    logp = jax.nn.log_softmax(m(tokens[:, :-1]).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
  grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))(model)
  leaves = jax.tree.leaves(grads)
  assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)
  assert max(float(jnp.abs(g).max()) for g in leaves) > 0
  with pytest.raises(ValueError, match="gate_proj"):
    models.from_pretrained(saved["plain"][0], lora_rank=4, lora_targets="gate_proj")
  json.dumps(models.hf.model_config_to_hf(model.cfg))  # the config stays writable
