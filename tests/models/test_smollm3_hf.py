"""SmolLM3 (SmolLM3ForCausalLM) against `transformers`: Llama with NoPE layers (every
fourth layer's q and k go unrotated), and with use_sliding_window a window on those
layers, biases on all four attention projections. Logits (layer list and scanned),
greedy generation through the sampler, export, the reward model, and what other classes
refuse."""

import json

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_reward_model_round_trip, greedy_tokens, hf_logits, perturb,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "nope": {},
    # The NoPE layer slides over 4 keys, shorter than the rows; biases everywhere.
    "window": dict(use_sliding_window=True, sliding_window=4, attention_bias=True),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(variant, cls="SmolLM3ForCausalLM", **extra):
  cfg = transformers.SmolLM3Config(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb(getattr(transformers, cls)(cfg).float().eval())


def _logits(model, tokens=TOKENS):
  return np.asarray(_jitted_logits(model, tokens))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_nope_layers_and_the_window(saved):
  nope = models.from_pretrained(saved["nope"][0]).cfg
  assert nope.rope_layers == (1, 1, 1, 0) and nope.nope_layers == (False,) * 3 + (True,)
  assert nope.sliding_window is None and not nope.qkv_bias
  window = models.from_pretrained(saved["window"][0]).cfg
  assert window.layer_types == ("full_attention",) * 3 + ("sliding_attention",)
  assert window.sliding_window == 4 and window.qkv_bias and window.attn_out_bias


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  folder, hf = saved[variant]
  want = hf_logits(hf, TOKENS)
  np.testing.assert_allclose(_logits(models.from_pretrained(folder, scan_layers=scan)), want,
                             atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_the_nope_layer_moves_the_logits(saved, scan):
  """Rotating the NoPE layer too changes the logits by far more than the tolerance."""
  model = models.from_pretrained(saved["nope"][0], scan_layers=scan)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
      model.cfg.replace(rope_layers=(1,) * 4), rngs=nnx.Rngs(0))))
  moved = np.abs(_logits(nnx.merge(graphdef, nnx.state(model))) - _logits(model)).max()
  assert moved > 1e-2


@pytest.mark.parametrize("variant,scan", [("nope", False), ("window", False),
                                          ("window", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Through the sampler's KV cache (the NoPE layer's keys cached unrotated; with the
  window, its ring of 8 slots) the greedy tokens are transformers' generate()'s."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  folder, hf = saved[variant]
  ours = models.from_pretrained(folder)
  models.save_pretrained(ours, str(tmp_path / "out"))
  back = transformers.SmolLM3ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == "smollm3" and written["no_rope_layers"] == [1, 1, 1, 0]
  assert models.hf_config_to_model_config(written) == ours.cfg


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("window", cls="SmolLM3ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.SmolLM3ForSequenceClassification, tmp_path)


def test_what_other_classes_refuse():
  tiny = models.get_preset("tiny")
  with pytest.raises(ValueError, match="rope_layers with NoPE layers cannot be written as "
                                       "LlamaForCausalLM; SmolLM3ForCausalLM and "
                                       "Llama4ForCausalLM hold them"):
    models.hf.check_exportable(tiny.replace(rope_layers=(1, 0)))
  models.hf.check_exportable(tiny.replace(rope_layers=(1, 1)))  # all rotary: any class
  with pytest.raises(ValueError, match=r"rope_layers must hold a 1 \(rotary\) or 0 \(NoPE\) "
                                       "for each of the 2 layers"):
    tiny.replace(rope_layers=(1, 0, 1))
  with pytest.raises(ValueError, match="rope_layers must hold"):
    tiny.replace(rope_layers=(1, 2))
