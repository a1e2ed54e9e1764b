"""MiniMax-M2 (MiniMaxM2ForCausalLM) against `transformers`: Mixtral's per-expert files,
routed by sigmoid scores plus a correction bias kept beside the gate, q/k norms over every
head's features at once, half of each head rotated. Config reading (transformers 5's keys
and the published files' rotary_dim, use_qk_norm, ...), logits (layer list and scanned),
gradients, greedy generation, export, the published FP8 layout, the preset's size, and
what is refused."""

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import fp8
from tests.models.parity import (assert_close_to_scale, greedy_tokens, hf_logits, perturb,
                                 randomize_correction_biases, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

# 6 query heads over 2 kv heads of 12 features (6 rotated); q's norm spans 72 features,
# k's 24, neither the 40 of the hidden state. 7 experts, 3 a token.
COMMON = dict(vocab_size=97, hidden_size=40, intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, head_dim=12, rotary_dim=6,
              num_local_experts=7, num_experts_per_tok=3, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))
# MiniMax-M2's published config.json (MiniMaxAI/MiniMax-M2), its FP8 files' quantization
# config included.
PUBLISHED = {
    "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1] * 62,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
    "max_position_embeddings": 196_608, "model_type": "minimax_m2",
    "mtp_transformer_layers": 1, "num_attention_heads": 48, "num_experts_per_tok": 8,
    "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
    "num_mtp_modules": 3, "qk_norm_type": "per_layer",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn",
                            "quant_method": "fp8", "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["gate", "e_score_correction_bias",
                                                       "lm_head"]},
    "rms_norm_eps": 1e-06, "rope_theta": 5_000_000, "rotary_dim": 64,
    "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
    "transformers_version": "4.46.1", "use_cache": True, "use_mtp": True,
    "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200_064,
    "torch_dtype": "bfloat16"}


def _hf_model(name="minimax_m2", **extra):
  """Norms off one, correction biases drawn, and head 0 of q and k four times the others
  (so a norm over each head alone would differ from one over all of them)."""
  del name
  cfg = transformers.MiniMaxM2Config(**{**COMMON, **extra})
  torch.manual_seed(0)
  model = transformers.MiniMaxM2ForCausalLM(cfg).float().eval()
  with torch.no_grad():
    for layer in model.model.layers:
      layer.self_attn.q_proj.weight[:12] *= 4
      layer.self_attn.k_proj.weight[:12] *= 4
  return randomize_correction_biases(perturb(model))


def _config(folder):
  return json.loads(pathlib.Path(folder, "config.json").read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(folder with the files transformers wrote, the HF model)."""
  return save_families(tmp_path_factory, ["minimax_m2"], _hf_model)["minimax_m2"]


def test_config_reads_every_minimax_m2_feature(saved):
  folder, hf = saved
  m = models.from_pretrained(folder)
  cfg = m.cfg
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.ffn_dim, cfg.router_scoring,
          cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.router_groups,
          cfg.shared_expert_dim, cfg.dense_layers) == (7, 3, 24, "sigmoid", True, 1.0, 1, 0, 0)
  assert (cfg.qk_norm, cfg.qk_norm_heads, cfg.qkv_bias, cfg.attn_out_bias,
          cfg.tie_embeddings) == (True, True, False, False, False)
  assert cfg.rope.partial_rotary_factor == 0.5 and cfg.rope.rotary_dim(12) == 6
  assert cfg.rope.theta == 5_000_000.0 and cfg.norm_eps == 1e-6
  bias = hf.model.layers[1].mlp.e_score_correction_bias.numpy()
  assert np.abs(bias).min() > 0
  np.testing.assert_array_equal(np.asarray(m.layers[1].mlp.score_correction_bias[...]), bias)
  q_norm = hf.model.layers[0].self_attn.q_norm.weight.detach().numpy()
  assert q_norm.shape == (72,)
  np.testing.assert_array_equal(np.asarray(m.layers[0].attn.q_norm.scale[...]),
                                q_norm.reshape(6, 12))


@pytest.mark.parametrize("keys", [
    {"rotary_dim": 6}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                            "partial_rotary_factor": 0.5}},
    {"rotary_dim": 4, "partial_rotary_factor": 0.5}, {}],
    ids=["published", "transformers5", "factor_over_rotary_dim", "neither"])
def test_rotated_features_are_read_as_transformers_reads_them(saved, keys):
  """The published files' rotary_dim, transformers 5's rope_parameters, a top-level
  partial_rotary_factor (ranked above rotary_dim), or neither (every feature)."""
  config = _config(saved[0])
  for key in ("rotary_dim", "rope_parameters", "partial_rotary_factor"):
    config.pop(key, None)
  config.update(keys)
  want = transformers.MiniMaxM2Config.from_dict(config).rope_parameters
  rope = models.hf_config_to_model_config(config).rope
  assert rope.partial_rotary_factor == want.get("partial_rotary_factor", 1.0)
  assert rope.theta == want["rope_theta"]


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, scan):
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  got = np.asarray(_jitted_logits(models.from_pretrained(folder, scan_layers=scan), TOKENS))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3


def test_each_part_moves_the_logits(saved):
  """The correction bias and the partial rotation matter here: without either the logits
  move (so the parity above is not blind to them)."""
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  m = models.from_pretrained(folder)
  bias = m.layers[1].mlp.score_correction_bias
  bias.value = bias[...] * 0
  full_rotation = models.from_pretrained(folder, rope=models.RopeConfig(theta=5_000_000.0))
  for changed in (m, full_rotation):
    assert np.abs(np.asarray(_jitted_logits(changed, TOKENS)) - want).max() > 1e-3


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for the router (through the chosen experts' scores),
  the experts, the q and k norms and the input norm; the correction bias gets none."""
  folder, hf_model = saved
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  f = COMMON["intermediate_size"]
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    experts = hf.mlp.experts
    gate_up = experts.gate_up_proj.grad.numpy()  # [E, 2F, D]: w1 rows, then w3's
    pairs = [(np.asarray(layer["mlp"]["router"][...]).T, hf.mlp.gate.weight.grad),
             (np.asarray(layer["mlp"]["gate_proj"][...]).transpose(0, 2, 1), gate_up[:, :f]),
             (np.asarray(layer["mlp"]["up_proj"][...]).transpose(0, 2, 1), gate_up[:, f:]),
             (np.asarray(layer["mlp"]["down_proj"][...]).transpose(0, 2, 1),
              experts.down_proj.grad),
             (np.asarray(layer["attn"]["q_norm"]["scale"][...]).reshape(-1),
              hf.self_attn.q_norm.weight.grad),
             (np.asarray(layer["attn"]["k_norm"]["scale"][...]).reshape(-1),
              hf.self_attn.k_norm.weight.grad),
             (layer["input_norm"]["scale"][...], hf.input_layernorm.weight.grad)]
    for ours, theirs in pairs:
      assert_close_to_scale(ours, np.asarray(theirs))
    assert not np.any(np.asarray(layer["mlp"]["score_correction_bias"][...]))


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, scan)):
    assert got == want, i


def test_export_round_trip_is_exact(saved, tmp_path):
  """From the scanned layout: the names transformers wrote (per expert, the correction
  bias beside the gate), each tensor as it was, loadable by transformers with the same
  logits, and a config.json that reads back to ours, with the published files' keys."""
  from safetensors.numpy import load_file
  folder, hf = saved
  ours = models.from_pretrained(folder, scan_layers=True)
  models.save_pretrained(ours, str(tmp_path / "out"))
  before, after = (load_file(f"{f}/model.safetensors") for f in (folder, tmp_path / "out"))
  assert set(after) == set(before)
  assert "model.layers.2.block_sparse_moe.e_score_correction_bias" in after
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)
  back = transformers.MiniMaxM2ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == "minimax_m2" and written["rotary_dim"] == 6
  assert (written["scoring_func"], written["use_routing_bias"], written["use_qk_norm"],
          written["qk_norm_type"]) == ("sigmoid", True, True, "per_layer")
  assert models.hf_config_to_model_config(written) == ours.cfg.replace(scan_layers=False)


def test_published_fp8_files_load_as_their_dequantized_weights(saved, tmp_path):
  """The published layout: attention projections and experts' w1 / w2 / w3 float8 beside
  NAME_scale_inv, the gate, correction bias, norms, embeddings and lm_head not; its
  quantization_config says fmt float8_e4m3fn."""
  from safetensors.numpy import load_file
  from safetensors.torch import save_file
  folder, _ = saved
  block = (16, 32)
  plain, quantized = {}, {}
  for name, w in load_file(f"{folder}/model.safetensors").items():
    if name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
      w8, scale_inv = fp8.quantize(w, block)
      quantized[name] = torch.from_numpy(w8.astype(np.float32)).to(torch.float8_e4m3fn)
      quantized[name + "_scale_inv"] = torch.from_numpy(scale_inv)
      w = fp8.dequantize(w8, scale_inv, block)
    else:
      quantized[name] = torch.from_numpy(np.array(w))
    plain[name] = torch.from_numpy(np.array(w))
  config = _config(folder)
  for sub, tensors in (("plain", plain), ("fp8", quantized)):
    (tmp_path / sub).mkdir()
    save_file(tensors, str(tmp_path / sub / "model.safetensors"), metadata={"format": "pt"})
    quant = {**PUBLISHED["quantization_config"], "weight_block_size": list(block)}
    (tmp_path / sub / "config.json").write_text(json.dumps(
        {**config, "quantization_config": quant} if sub == "fp8" else config))
  hf = transformers.MiniMaxM2ForCausalLM.from_pretrained(str(tmp_path / "plain")).float()
  ours = models.from_pretrained(str(tmp_path / "fp8"))
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)),
                             hf_logits(hf.eval(), TOKENS), atol=1e-4, rtol=0)


def test_preset_is_the_published_config_and_size():
  """229B parameters as published (228.7B: the released tensors' shapes summed, their FP8
  scales aside); 10B active as published counts it, without the embedding table and
  lm_head (9.80B; 11.03B with them)."""
  preset = models.get_preset("minimax_m2")
  read = models.hf_config_to_model_config(PUBLISHED, remat=preset.remat,
                                          scan_layers=preset.scan_layers)
  assert read == preset
  assert preset.num_params == 228_689_764_864
  assert abs(preset.num_params / 229e9 - 1) < 0.01
  embeddings = 2 * preset.vocab_size * preset.d_model
  assert preset.num_active_params == 11_030_553_088
  assert abs((preset.num_active_params - embeddings) / 10e9 - 1) < 0.02
  _, state = models.abstract_model(preset)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == preset.num_params
  models.hf.check_exportable(preset)


@pytest.mark.parametrize("change,match", [
    ({"use_qk_norm": False}, "use_qk_norm=False in a MiniMax-M2 config.json"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head'"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"use_routing_bias": False}, "use_routing_bias=False"),
    ({"shared_intermediate_size": 64}, "shared_intermediate_size=64"),
    ({"attn_type_list": [1, 0, 1]}, r"attn_type_list with \[0\] \(lightning attention"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"architectures": ["MiniMaxM2ForSequenceClassification"]}, "unsupported architecture"),
])
def test_configs_we_cannot_run_are_refused(saved, tmp_path, change, match):
  config = _config(saved[0])
  (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
  with pytest.raises(ValueError, match=match):
    models.from_pretrained(str(tmp_path))


def test_configs_that_cannot_be_written_are_refused():
  cfg = models.get_preset("minimax_m2").replace(num_layers=2)
  name = "MiniMaxM2ForCausalLM"
  cases = [
      (dict(qk_norm_heads=False), f"qk_norm_heads=False cannot be written as {name}"),
      (dict(qk_norm=False, qk_norm_heads=False), f"qk_norm=False cannot be written as {name}"),
      (dict(router_scoring="softmax"), f"router_scoring='softmax' cannot be written as {name}"),
      (dict(router_groups=8, router_group_topk=4), "router_groups=8 cannot be written"),
      (dict(routed_scaling_factor=2.5), "routed_scaling_factor=2.5 cannot be written"),
      (dict(shared_expert_dim=1536), "shared_expert_dim=1536 cannot be written"),
      (dict(dense_layers=1, dense_ffn_dim=64), "dense_layers=1 cannot be written"),
      (dict(qkv_bias=True), f"{name} has no q/k/v biases"),
      (dict(norm_topk_prob=False), "always renormalises the top-k router weights"),
      (dict(sliding_window=8), r"\['sliding_window'\] cannot be written"),
      (dict(architecture="MiniMaxM2ForSequenceClassification", lm_head=False,
            value_head=True), "MiniMaxM2ForSequenceClassification'? cannot be written"),
      (dict(architecture="Glm4MoeForCausalLM"), "qk_norm_heads=True cannot be written"),
  ]
  for change, match in cases:
    with pytest.raises(ValueError, match=match):
      models.hf.check_exportable(cfg.replace(**change))
