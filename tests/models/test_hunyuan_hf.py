"""Hunyuan dense (HunYuanDenseV1ForCausalLM) against `transformers`: Llama with the
rotated q and k normed per head (`qk_norm_after_rope`), its "dynamic" rope with an alpha
read as the stretched base. Logits (layer list and scanned), the norms' order, greedy
generation, export and the reward model (HunYuanDenseV1ForSequenceClassification)."""

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits,
                                 check_reward_model_round_trip, greedy_tokens, hf_logits,
                                 perturb, save_families)

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
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls=None, **extra):
  cfg = transformers.HunYuanDenseV1Config(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb((cls or transformers.HunYuanDenseV1ForCausalLM)(cfg).float().eval())


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


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved["alpha"], PROMPTS, 10, False)):
    assert got == want, i


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.HunYuanDenseV1ForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "hunyuan_v1_dense"


def test_reward_model_round_trip(tmp_path):
  check_reward_model_round_trip(
      _hf_model("default", transformers.HunYuanDenseV1ForSequenceClassification,
                num_labels=1),
      transformers.HunYuanDenseV1ForSequenceClassification, tmp_path)
