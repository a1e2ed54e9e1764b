"""Hunyuan dense (HunYuanDenseV1ForCausalLM) and MoE (HunYuanMoEV1ForCausalLM) against
`transformers`: Llama with the rotated q and k normed per head (`qk_norm_after_rope`),
its "dynamic" rope with an alpha read as the stretched base; the MoE's softmax top-k
beside an ungated shared MLP. Logits (layer list and scanned), the norms' order, greedy
generation, export and the reward model (HunYuanDenseV1ForSequenceClassification)."""

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, hf_logits,
                                 perturb, save_families, spread_routers)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "default": dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    # the published files' NTK alpha (Hunyuan-7B's 1000), with biases
    "alpha": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10_000.0,
                                   "alpha": 1000.0, "factor": 1.0}, attention_bias=True),
    # Hunyuan-A13B's layout: 6 experts, the top 2 a token (given per layer), a shared MLP
    "moe": dict(intermediate_size=40, num_experts=6, moe_topk=[2, 2]),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant):
  torch.manual_seed(0)
  if variant == "moe":
    cfg = transformers.HunYuanMoEV1Config(**{**COMMON, **VARIANTS[variant]})
    return spread_routers(perturb(transformers.HunYuanMoEV1ForCausalLM(cfg).float().eval()))
  cfg = transformers.HunYuanDenseV1Config(**{**COMMON, **VARIANTS[variant]})
  return perturb(transformers.HunYuanDenseV1ForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_norms_and_the_stretched_base(saved):
  cfg = models.from_pretrained(saved["alpha"][0]).cfg
  assert (cfg.qk_norm, cfg.qk_norm_after_rope, cfg.qkv_bias, cfg.attn_out_bias) == (
      True, True, True, True)
  assert cfg.rope.type == "default"
  np.testing.assert_allclose(cfg.rope.theta, 10_000.0 * 1000.0 ** (12 / 10), rtol=1e-12)
  bad = {**models.hf.model_config_to_hf(cfg),
         "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0}}
  with pytest.raises(ValueError, match="rope type 'dynamic' without an alpha"):
    models.hf_config_to_model_config(bad)
  with pytest.raises(ValueError, match="use_cla=true"):
    models.hf_config_to_model_config({**models.hf.model_config_to_hf(cfg), "use_cla": True})


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_the_norms_apply_after_the_rotation(saved):
  """Normed before the rotation (Qwen3's order) the logits move by far more than the
  tolerance: the per-feature scales do not commute with the rotation."""
  folder, hf = saved["default"]
  model = models.from_pretrained(folder)
  before = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
      model.cfg.replace(qk_norm_after_rope=False), rngs=nnx.Rngs(0)))), nnx.state(model))
  assert np.abs(np.asarray(before(TOKENS)) - hf_logits(hf, TOKENS)).max() > 1e-2


@pytest.mark.parametrize("variant", ["alpha", "moe"])
def test_greedy_generation_matches_transformers(saved, variant):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 10, False)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  moe = variant == "moe"
  cls = transformers.HunYuanMoEV1ForCausalLM if moe else transformers.HunYuanDenseV1ForCausalLM
  written = check_export_round_trip(*saved[variant], cls, TOKENS, tmp_path / "out")
  assert written["model_type"] == ("hunyuan_v1_moe" if moe else "hunyuan_v1_dense")


def test_the_mixture_config(saved):
  cfg = models.from_pretrained(saved["moe"][0]).cfg
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.ffn_dim, cfg.shared_expert_dim,
          cfg.shared_expert_gate, cfg.norm_topk_prob, cfg.router_scoring) == (
      6, 2, 40, 40, False, True, "softmax")
  written = models.hf.model_config_to_hf(cfg)
  with pytest.raises(ValueError, match=r"moe_topk=\[2, 3\] in a HunYuanMoEV1ForCausalLM "
                                       "config.json: layers that differ"):
    models.hf_config_to_model_config({**written, "moe_topk": [2, 3]})
  with pytest.raises(ValueError, match="shared_expert_dim=0 cannot be written as "
                                       "HunYuanMoEV1ForCausalLM"):
    models.hf.check_exportable(cfg.replace(shared_expert_dim=0))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_reward_model_round_trip(tmp_path, moe):
  if moe:
    cls = transformers.HunYuanMoEV1ForSequenceClassification
    cfg = transformers.HunYuanMoEV1Config(**{**COMMON, **VARIANTS["moe"], "num_labels": 1})
  else:
    cls = transformers.HunYuanDenseV1ForSequenceClassification
    cfg = transformers.HunYuanDenseV1Config(**{**COMMON, **VARIANTS["default"],
                                               "num_labels": 1})
  torch.manual_seed(0)
  check_reward_model_round_trip(perturb(cls(cfg).float().eval()), cls, tmp_path)
