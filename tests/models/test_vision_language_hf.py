"""Vision-language folders whose language model is read alone, for text post-training:
Qwen3-VL (as Qwen3) and Qwen3-VL-MoE (as Qwen3-MoE), GLM-4.1V (as GLM-4), GLM-4.5V (as
GLM-4.5) and Kimi K2.5 (as DeepSeek-V3). On text their multimodal rotary embeddings' three position axes are equal, where
each is its family's 1D one: logits and greedy generation equal transformers'
vision-language model's on text; the vision tower stays in the files."""

import json
import shutil

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import perturb, randomize_correction_biases, spread_routers

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  text = transformers.Qwen3VLTextConfig(
      vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
      initializer_range=0.3, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                               "mrope_section": [4, 2, 2],
                                               "mrope_interleaved": True})
  vision = transformers.Qwen3VLVisionConfig(
      depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
      patch_size=4, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
      num_position_embeddings=16)
  cfg = transformers.Qwen3VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                   tie_word_embeddings=False)
  torch.manual_seed(0)
  hf = perturb(transformers.Qwen3VLForConditionalGeneration(cfg).float().eval())
  folder = tmp_path_factory.mktemp("qwen3_vl") / "model"
  hf.save_pretrained(folder)
  return str(folder), hf


def test_the_language_model_is_read_as_qwen3(saved):
  cfg = models.from_pretrained(saved[0]).cfg
  assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm
  assert (cfg.d_model, cfg.num_layers, cfg.head_dim, cfg.rope.theta) == (64, 2, 16, 1e6)
  assert not cfg.tie_embeddings


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers_on_text(saved, scan):
  folder, hf = saved
  with torch.no_grad():
    want = hf(input_ids=torch.as_tensor(TOKENS)).logits.numpy()
  got = nnx.jit(lambda m, t: m(t))(models.from_pretrained(folder, scan_layers=scan), TOKENS)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3


def test_greedy_generation_matches_transformers(saved):
  from posttrain.sampling import Sampler
  folder, hf = saved
  out = Sampler(models.from_pretrained(folder), max_len=48, extend_chunk=4).generate(
      PROMPTS, max_new_tokens=12, temperature=0.0)
  for i, prompt in enumerate(PROMPTS):
    with torch.no_grad():
      want = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.tokens[i].tolist() == want, i


def test_export_writes_the_language_model_as_qwen3(saved, tmp_path):
  folder, hf = saved
  ours = models.from_pretrained(folder)
  models.save_pretrained(ours, str(tmp_path / "out"))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["architectures"] == ["Qwen3ForCausalLM"]
  back = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  with torch.no_grad():
    np.testing.assert_allclose(back(torch.as_tensor(TOKENS)).logits.numpy(),
                               hf(input_ids=torch.as_tensor(TOKENS)).logits.numpy(),
                               atol=1e-4, rtol=0)


def test_a_mixture_folder_reads_as_qwen3_moe(tmp_path):
  """Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration, 30B-A3B / 235B-A22B): its files hold
  each layer's experts stacked (gate_up_proj [E, D, 2F], down_proj [E, F, D]) and its
  router always renormalises; read as a Qwen3-MoE, the logits are transformers' on text,
  and the export is a Qwen3-MoE folder of per-expert tensors transformers reads back."""
  text = transformers.Qwen3VLMoeTextConfig(
      vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
      initializer_range=0.3, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2],
                       "mrope_interleaved": True})
  vision = transformers.Qwen3VLMoeVisionConfig(
      depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
      patch_size=4, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
      num_position_embeddings=16)
  cfg = transformers.Qwen3VLMoeConfig(text_config=text.to_dict(),
                                      vision_config=vision.to_dict(), tie_word_embeddings=False)
  torch.manual_seed(0)
  hf = spread_routers(perturb(
      transformers.Qwen3VLMoeForConditionalGeneration(cfg).float().eval()))
  hf.save_pretrained(tmp_path / "vlm")
  with torch.no_grad():
    want = hf(input_ids=torch.as_tensor(TOKENS)).logits.numpy()
  from safetensors.numpy import load_file, save_file
  names = ("gate_up_proj", "down_proj")
  saved = load_file(str(tmp_path / "vlm" / "model.safetensors"))
  # transformers 5 saves its layout in memory, [E, 2F, D]; the published files hold
  # [E, D, 2F] (which it transposes on reading). Both read alike.
  assert saved["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 48, 64)
  shutil.copytree(tmp_path / "vlm", tmp_path / "published")
  save_file({k: np.ascontiguousarray(v.transpose(0, 2, 1)) if k.endswith(names) else v
             for k, v in saved.items()}, str(tmp_path / "published" / "model.safetensors"))
  for folder in ("vlm", "published"):
    ours = models.from_pretrained(str(tmp_path / folder))
    assert ours.cfg.architecture == "Qwen3MoeForCausalLM" and ours.cfg.norm_topk_prob
    assert (ours.cfg.num_experts, ours.cfg.num_experts_per_tok, ours.cfg.ffn_dim) == (6, 2, 24)
    got = np.asarray(nnx.jit(lambda m, t: m(t))(ours, TOKENS))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=folder)
  with torch.no_grad():  # transformers reads the published layout to the same model
    published = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(
        str(tmp_path / "published")).float().eval()
    np.testing.assert_allclose(published(input_ids=torch.as_tensor(TOKENS)).logits.numpy(),
                               want, atol=1e-5, rtol=0)
  models.save_pretrained(ours, str(tmp_path / "out"))
  back = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  with torch.no_grad():
    np.testing.assert_allclose(back(torch.as_tensor(TOKENS)).logits.numpy(), want, atol=1e-4,
                               rtol=0)


def test_a_glm4v_folder_reads_as_glm4(tmp_path):
  """GLM-4.1V / GLM-4.6V-Flash (Glm4vForConditionalGeneration): its language model is
  GLM-4 (sandwich norms, q/k/v biases, half of each head rotated, interleaved), whose
  multimodal rotary embedding is GLM's 1D one on text."""
  text = transformers.Glm4vTextConfig(
      vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      initializer_range=0.3, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                               "partial_rotary_factor": 0.5,
                                               "mrope_section": [2, 1, 1]})
  vision = transformers.Glm4vVisionConfig(depth=1, hidden_size=16, intermediate_size=32,
                                          num_heads=2, out_hidden_size=64, patch_size=4,
                                          spatial_merge_size=2, temporal_patch_size=2,
                                          image_size=16)
  cfg = transformers.Glm4vConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
  torch.manual_seed(0)
  hf = perturb(transformers.Glm4vForConditionalGeneration(cfg).float().eval())
  hf.save_pretrained(tmp_path / "vlm")
  ours = models.from_pretrained(str(tmp_path / "vlm"))
  assert ours.cfg.architecture == "Glm4ForCausalLM" and ours.cfg.qkv_bias
  assert ours.cfg.sandwich_norms and ours.cfg.rope.partial_rotary_factor == 0.5
  with torch.no_grad():
    want = hf(input_ids=torch.as_tensor(TOKENS)).logits.numpy()
  got = np.asarray(nnx.jit(lambda m, t: m(t))(ours, TOKENS))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3
  models.save_pretrained(ours, str(tmp_path / "out"))
  back = transformers.Glm4ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  with torch.no_grad():
    np.testing.assert_allclose(back(torch.as_tensor(TOKENS)).logits.numpy(), want, atol=1e-4,
                               rtol=0)


def test_a_glm4v_moe_folder_reads_as_glm4_5(tmp_path):
  """GLM-4.5V / GLM-4.6V (Glm4vMoeForConditionalGeneration): GLM-4.5's mixture (sigmoid
  routing with a correction bias, a shared expert, a leading dense layer) in per-expert
  files; the logits are transformers' on text."""
  text = transformers.Glm4vMoeTextConfig(
      vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
      initializer_range=0.3, moe_intermediate_size=24, n_routed_experts=6,
      num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
      rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                       "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]})
  vision = transformers.Glm4vMoeVisionConfig(depth=1, hidden_size=16, intermediate_size=32,
                                             num_heads=2, out_hidden_size=64, patch_size=4,
                                             spatial_merge_size=2, temporal_patch_size=2,
                                             image_size=16)
  cfg = transformers.Glm4vMoeConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
  torch.manual_seed(0)
  hf = randomize_correction_biases(spread_routers(perturb(
      transformers.Glm4vMoeForConditionalGeneration(cfg).float().eval())))
  hf.save_pretrained(tmp_path / "vlm")
  # a multi-token-prediction layer after the last one, as GLM-4.5's files hold: not read
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(tmp_path / "vlm" / "model.safetensors"))
  tensors["model.language_model.layers.2.eh_proj.weight"] = np.zeros((64, 128), np.float32)
  save_file(tensors, str(tmp_path / "vlm" / "model.safetensors"))
  config = json.loads((tmp_path / "vlm" / "config.json").read_text())
  config["text_config"]["num_nextn_predict_layers"] = 1
  (tmp_path / "vlm" / "config.json").write_text(json.dumps(config))
  ours = models.from_pretrained(str(tmp_path / "vlm"))
  assert ours.cfg.architecture == "Glm4MoeForCausalLM" and ours.cfg.qkv_bias
  assert (ours.cfg.num_experts, ours.cfg.dense_layers, ours.cfg.shared_expert_dim) == (6, 1, 24)
  with torch.no_grad():
    want = hf(input_ids=torch.as_tensor(TOKENS)).logits.numpy()
  got = np.asarray(nnx.jit(lambda m, t: m(t))(ours, TOKENS))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3


@pytest.mark.parametrize("layout", ["saved", "published"])
def test_a_kimi_k2_5_folder_reads_as_deepseek_v3(layout, tmp_path):
  """Kimi K2.5 / K2.6 (Kimi_K25ForConditionalGeneration): Kimi K2's DeepSeek-V3 (latent
  attention, sigmoid group routing with a correction bias, a shared expert, a leading
  dense layer); the logits are transformers' on text. transformers 5 saves the language
  model's layers as language_model.model.blocks.N (its renaming of the vision tower's
  blocks, reversed); the published files name them language_model.model.layers.N, the
  architecture KimiK25ForConditionalGeneration and the text model kimi_k2. Both read.
  Its config's tie_word_embeddings (on by default) ties the output to the embedding."""
  text = transformers.DeepseekV3Config(
      vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
      n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=12,
      qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
      num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=64,
      initializer_range=0.3)
  vision = transformers.Kimi_K25VisionConfig(patch_size=4, pos_emb_height=4, pos_emb_width=4,
                                             num_attention_heads=2, num_hidden_layers=1,
                                             hidden_size=16, intermediate_size=32)
  tied = layout == "saved"
  cfg = transformers.Kimi_K25Config(text_config=text, vision_config=vision,
                                    projection_hidden_size=16, tie_word_embeddings=tied)
  torch.manual_seed(0)
  hf = randomize_correction_biases(spread_routers(perturb(
      transformers.Kimi_K25ForConditionalGeneration(cfg).float().eval())))
  hf.save_pretrained(tmp_path / "vlm")
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(tmp_path / "vlm" / "model.safetensors"))
  assert any(n.startswith("language_model.model.blocks.") for n in tensors)
  if layout == "published":
    tensors = {n.replace("language_model.model.blocks.", "language_model.model.layers."): x
               for n, x in tensors.items()}
    save_file(tensors, str(tmp_path / "vlm" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "vlm" / "config.json").read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    config["text_config"]["model_type"] = "kimi_k2"
    (tmp_path / "vlm" / "config.json").write_text(json.dumps(config))
    # transformers reads the published layout too, to the same logits
    back = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(
        str(tmp_path / "vlm")).float().eval()
    with torch.no_grad():
      np.testing.assert_array_equal(back(input_ids=torch.as_tensor(TOKENS)).logits.numpy(),
                                    hf(input_ids=torch.as_tensor(TOKENS)).logits.numpy())
  ours = models.from_pretrained(str(tmp_path / "vlm"))
  assert ours.cfg.architecture == "DeepseekV3ForCausalLM"
  assert (ours.cfg.kv_lora_rank, ours.cfg.router_groups, ours.cfg.dense_layers,
          ours.cfg.tie_embeddings) == (16, 4, 1, tied)
  with torch.no_grad():
    want = hf(input_ids=torch.as_tensor(TOKENS)).logits.numpy()
  got = np.asarray(nnx.jit(lambda m, t: m(t))(ours, TOKENS))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3
  config = json.loads((tmp_path / "vlm" / "config.json").read_text())
  config.pop("tie_word_embeddings")
  assert models.hf_config_to_model_config(config).tie_embeddings


@pytest.mark.slow
def test_a_run_starts_from_a_vision_language_folder(tmp_path):
  """A GRPO run with `init_from` a Qwen3-VL folder: the language model trains (SFT and RL
  steps with rollouts) and exports as a Qwen3 folder transformers computes our logits
  with."""
  from posttrain import trainer
  from posttrain.export import export_checkpoint
  from posttrain.metrics import read_metrics
  from tests.test_family_runs import _config
  text = transformers.Qwen3VLTextConfig(
      vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
      rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                       "mrope_section": [2, 1, 1], "mrope_interleaved": True})
  vision = transformers.Qwen3VLVisionConfig(
      depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
      patch_size=4, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
      num_position_embeddings=16)
  cfg = transformers.Qwen3VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                   tie_word_embeddings=True)
  torch.manual_seed(0)
  transformers.Qwen3VLForConditionalGeneration(cfg).float().save_pretrained(tmp_path / "vlm")
  config = _config(init_from=str(tmp_path / "vlm"))
  trainer.train(config, str(tmp_path / "run"))
  rl = [r for r in read_metrics(str(tmp_path / "run")) if "reward/mean" in r]
  assert len(rl) == 2 and all(np.isfinite(r["loss"]) for r in rl)
  out = str(tmp_path / "export")
  assert export_checkpoint(config, str(tmp_path / "run"), out)["architecture"] == (
      "Qwen3ForCausalLM")
  theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  tokens = np.random.default_rng(0).integers(0, 272, (2, 24))
  with torch.no_grad():
    want = theirs(torch.as_tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(models.from_pretrained(out)(tokens)), want,
                             atol=1e-4, rtol=0)
