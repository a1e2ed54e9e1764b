"""GLM-4 (Glm4ForCausalLM: GLM-4-0414, GLM-Z1) against `transformers`: gate and up fused,
q/k/v biases, a norm on each sublayer's input and output, and half of each head rotated
by an interleaved rotary embedding, which we hold as rotate-half over q's and k's
reordered features. Logits (layer list and scanned), gradients, greedy generation,
export, the reward model, and what other classes refuse. GLM-4-9B (GlmForCausalLM):
the same layers with Llama's two norms."""

import json

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_peft_round_trip,
                                 check_reward_model_round_trip, greedy_tokens, hf_logits,
                                 perturb, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(name="glm4", cls="Glm4ForCausalLM", **extra):
  del name
  cfg = transformers.Glm4Config(**{**COMMON, **extra})
  torch.manual_seed(0)
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, ["glm4"], _hf_model)["glm4"]


def test_config_reads_every_glm4_feature(saved):
  cfg = models.from_pretrained(saved[0]).cfg
  assert (cfg.sandwich_norms, cfg.qkv_bias, cfg.attn_out_bias, cfg.norm_unit_offset) == (
      True, True, False, False)
  assert cfg.rope.partial_rotary_factor == 0.5 and cfg.rope.rotary_dim(16) == 8
  assert cfg.norm_eps == 1.5625e-07  # transformers' GLM-4 default


def test_q_and_k_hold_the_rotated_features_evens_then_odds(saved):
  """Our q rows per head: HF's features 0, 2, 4, 6, then 1, 3, 5, 7 (the rotated eight),
  then 8..15 (the rest) in place; v keeps HF's order."""
  folder, hf = saved
  ours = models.from_pretrained(folder)
  q = hf.model.layers[0].self_attn.q_proj.weight.detach().numpy().reshape(4, 16, 64)
  order = [0, 2, 4, 6, 1, 3, 5, 7] + list(range(8, 16))
  np.testing.assert_array_equal(np.asarray(ours.layers[0].attn.q_proj[...]),
                                q[:, order].transpose(2, 0, 1))
  v = hf.model.layers[0].self_attn.v_proj.weight.detach().numpy().reshape(2, 16, 64)
  np.testing.assert_array_equal(np.asarray(ours.layers[0].attn.v_proj[...]),
                                v.transpose(2, 0, 1))


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, scan):
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  got = np.asarray(_jitted_logits(models.from_pretrained(folder, scan_layers=scan), TOKENS))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for q and k (in HF's order again), their biases,
  gate and up (halves of gate_up_proj) and the four norms."""
  folder, hf_model = saved
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  back = np.argsort([0, 2, 4, 6, 1, 3, 5, 7] + list(range(8, 16)))
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    q = np.asarray(layer["attn"]["q_proj"][...]).transpose(1, 2, 0)[:, back].reshape(64, 64)
    k_bias = np.asarray(layer["attn"]["k_bias"][...])[:, back].reshape(-1)
    gate_up = hf.mlp.gate_up_proj.weight.grad.numpy()
    pairs = [(q, hf.self_attn.q_proj.weight.grad.numpy()),
             (k_bias, hf.self_attn.k_proj.bias.grad.numpy()),
             (np.asarray(layer["mlp"]["gate_proj"][...]).T, gate_up[:96]),
             (np.asarray(layer["mlp"]["up_proj"][...]).T, gate_up[96:]),
             (layer["attn_out_norm"]["scale"][...], hf.post_self_attn_layernorm.weight.grad),
             (layer["post_attn_norm"]["scale"][...], hf.post_attention_layernorm.weight.grad),
             (layer["mlp_out_norm"]["scale"][...], hf.post_mlp_layernorm.weight.grad)]
    for ours, theirs in pairs:
      assert_close_to_scale(ours, np.asarray(theirs))


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 12, scan)):
    assert got == want, i


def test_export_round_trip_is_exact(saved, tmp_path):
  """save_pretrained puts q's and k's features back in HF's order and fuses gate and up."""
  folder, hf = saved
  ours = models.from_pretrained(folder)
  models.save_pretrained(ours, str(tmp_path / "out"))
  back = transformers.Glm4ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == "glm4" and written["partial_rotary_factor"] == 0.5
  assert models.hf_config_to_model_config(written) == ours.cfg


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model(cls="Glm4ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.Glm4ForSequenceClassification, tmp_path)


def test_what_other_classes_refuse(saved, tmp_path):
  tiny = models.get_preset("tiny")
  with pytest.raises(ValueError, match="a partial rotary embedding cannot be written as "
                                       "LlamaForCausalLM; Phi3ForCausalLM, Glm4ForCausalLM and "
                                       "Glm4MoeForCausalLM hold it"):
    models.hf.check_exportable(tiny.replace(rope=models.RopeConfig(partial_rotary_factor=0.5)))
  glm = models.from_pretrained(saved[0]).cfg
  with pytest.raises(ValueError, match="sandwich_norms=False cannot be written as Glm4"):
    models.hf.check_exportable(glm.replace(sandwich_norms=False))
  with pytest.raises(ValueError, match="LongRoPE cannot be written as Glm4ForCausalLM"):
    models.hf.check_exportable(glm.replace(rope=models.RopeConfig(
        type="longrope", short_factor=(1.0,) * 8, long_factor=(1.0,) * 8,
        original_max_position_embeddings=8)))
  lora = models.from_pretrained(saved[0], lora_rank=2)
  with pytest.raises(ValueError, match=r"lora_targets \['gate_proj', 'up_proj'\] are not "
                                       "written or read: PEFT wraps its fused gate_up_proj"):
    models.save_lora_adapter(lora, str(tmp_path / "adapter"))


def test_peft_adapter_files_in_and_out(saved, tmp_path):
  """Adapters on the attention and down_proj: ours load in PEFT with our logits (q and
  k's B rows in HF's order, the rotated half's pairs interleaved), and an adapter PEFT
  made loads in ours with PEFT's logits. Its fused gate_up_proj is refused by name."""
  peft = pytest.importorskip("peft", reason="adapter tests need peft")
  folder, hf = saved
  check_peft_round_trip(folder, hf, _hf_model, TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
  fused = peft.get_peft_model(_hf_model(), peft.LoraConfig(
      r=2, target_modules=["gate_up_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"))
  fused.save_pretrained(str(tmp_path / "fused"))
  with pytest.raises(ValueError, match=r"target_modules \['gate_up_proj'\] are not supported"):
    models.from_pretrained(folder, adapter=str(tmp_path / "fused"))


# GLM-4-9B (GlmForCausalLM): GLM-4-0414's layers with Llama's two norms.
@pytest.fixture(scope="module")
def saved_glm(tmp_path_factory):
  def make(_):
    torch.manual_seed(0)
    cfg = transformers.GlmConfig(**COMMON)
    return perturb(transformers.GlmForCausalLM(cfg).float().eval())
  return save_families(tmp_path_factory, ["glm"], make)["glm"]


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_glm_logits_match_transformers(saved_glm, scan):
  folder, hf = saved_glm
  ours = models.from_pretrained(folder, scan_layers=scan)
  assert (ours.cfg.sandwich_norms, ours.cfg.qkv_bias, ours.cfg.architecture) == (
      False, True, "GlmForCausalLM")
  assert ours.cfg.rope.partial_rotary_factor == 0.5
  want = hf_logits(hf, TOKENS)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-4,
                             rtol=0)
  assert np.abs(want).max() > 3


def test_glm_greedy_generation_matches_transformers(saved_glm):
  for i, (got, want) in enumerate(greedy_tokens(*saved_glm, PROMPTS, 12, False)):
    assert got == want, i


def test_glm_export_round_trip_is_exact(saved_glm, tmp_path):
  folder, hf = saved_glm
  ours = models.from_pretrained(folder)
  models.save_pretrained(ours, str(tmp_path / "out"))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == "glm" and written["architectures"] == ["GlmForCausalLM"]
  assert models.hf_config_to_model_config(written) == ours.cfg
  back = transformers.GlmForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  with pytest.raises(ValueError, match="sandwich_norms=True cannot be written as Glm"):
    models.hf.check_exportable(ours.cfg.replace(sandwich_norms=True))


def test_glm_reward_model_scores_match_transformers(tmp_path):
  torch.manual_seed(0)
  hf = perturb(transformers.GlmForSequenceClassification(
      transformers.GlmConfig(**COMMON, num_labels=1)).float().eval())
  check_reward_model_round_trip(hf, transformers.GlmForSequenceClassification, tmp_path)
