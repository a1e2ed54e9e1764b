"""LFM2 (Lfm2ForCausalLM: gated short convolutions in layer_types' "conv" layers, attention
with per-head q/k norms in the others, a SwiGLU feed_forward beside each) against
`transformers`: the config (the MLP's auto-adjusted width, the published files' keys),
logits in both layouts with and without conv_bias, gradients, greedy generation and the
window a prompt leaves, slots, resumed rows and next turns, a mesh, export, PEFT adapters
on the convolutions' in_proj / out_proj beside the attention's out_proj, and refusals."""

import json

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from tests.models.parity import (assert_close_to_scale, check_export_files,
                                 check_next_turns_continue_from_their_slots, check_on_a_mesh,
                                 check_packed_rows_run_apart, check_peft_round_trip,
                                 check_slots_and_resume_draw_one_calls_samples, greedy_tokens,
                                 hf_logits, perturb, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

# head_dim 8 (not hidden / heads = 16); the MLP's width auto-adjusted: 2/3 of 120, x1.5,
# rounded up to 16 = 128.
CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=120, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              layer_types=["conv", "full_attention", "conv", "full_attention"],
              conv_L_cache=3, block_multiple_of=16, block_ffn_dim_multiplier=1.5,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, rope_parameters={"rope_type": "default",
                                                               "rope_theta": 1e4})
# conv_bias puts biases on the convolutions' in_proj, taps and out_proj.
FAMILIES = {"plain": dict(), "biased": dict(conv_bias=True, tie_word_embeddings=False)}
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(family: str = "plain"):
  torch.manual_seed(0)
  config = transformers.Lfm2Config(**{**CONFIG, **FAMILIES[family]})
  return perturb(transformers.Lfm2ForCausalLM(config).float().eval())


@pytest.fixture(scope="module")
def families(tmp_path_factory):
  return save_families(tmp_path_factory, list(FAMILIES), _hf_model)


@pytest.fixture(scope="module")
def saved(families):
  return families["biased"]


def test_config_reads_the_layers_and_the_mlp_width(families):
  for family, (folder, hf) in families.items():
    cfg = models.from_pretrained(folder).cfg
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert (cfg.linear_mixer, cfg.linear_conv_kernel, cfg.linear_conv_bias) == (
        "short_conv", 3, family == "biased")
    assert (cfg.ffn_dim, cfg.head_dim, cfg.qk_norm, cfg.qk_norm_heads) == (128, 8, True, False)
    assert cfg.ffn_dim == hf.model.layers[0].feed_forward.w1.out_features
    assert (cfg.tie_embeddings, cfg.rope.theta, cfg.norm_eps) == (family == "plain", 1e4, 1e-5)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    assert cfg.lora_rank == 0 and "in_proj" in cfg.replace(lora_rank=2).lora_target_names


@pytest.mark.parametrize("published", [
    dict(block_ff_dim=12_288, intermediate_size=96, tie_embedding=False, full_attn_idxs=[1, 3]),
    dict(intermediate_size=300, block_ffn_dim_multiplier=0.75, block_multiple_of=64,
         full_attn_idxs=None),
    dict(intermediate_size=300, block_auto_adjust_ff_dim=False,
         layer_types=["conv", "conv", "full_attention", "conv"])])
def test_config_keys_are_read_as_transformers_reads_them(published):
  """The published files' block_ff_dim, tie_embedding and full_attn_idxs (no
  layer_types), another multiplier, no adjustment: the same MLP width, layer kinds and
  tying as transformers' Lfm2Config and Lfm2MLP."""
  c = {k: v for k, v in CONFIG.items() if k != "layer_types"}
  theirs = transformers.Lfm2Config(**{**c, **published})
  with torch.device("meta"):
    width = transformers.models.lfm2.modeling_lfm2.Lfm2MLP(theirs).w1.out_features
  cfg = models.hf_config_to_model_config(
      {"architectures": ["Lfm2ForCausalLM"], **c, **published})
  assert cfg.ffn_dim == width
  assert cfg.linear_layers == tuple(t == "conv" for t in theirs.layer_types)
  assert cfg.tie_embeddings == theirs.tie_word_embeddings


@pytest.mark.parametrize("family,scan", [
    ("plain", False), pytest.param("plain", True, marks=pytest.mark.slow), ("biased", False),
    ("biased", True)], ids=["plain-layers", "plain-scanned", "biased-layers", "biased-scanned"])
def test_logits_match_transformers(families, family, scan):
  folder, hf = families[family]
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 1


def test_packed_sequences_are_run_apart(saved):
  """Two sequences packed in one row (segment ids, positions restarting) give each the
  logits it has alone: the attention and the convolution's window restart at the seam."""
  check_packed_rows_run_apart(models.from_pretrained(saved[0], scan_layers=True), TOKENS)


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for a convolution's in_proj (B's and x's rows, and
  their bias), its taps and out_proj, the attention's q_proj and out_proj, and the MLP's
  w1 and w2."""
  folder, hf_model = saved
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  conv, theirs = grads["linear_layers"][1]["linear_attn"], hf_model.model.layers[2].conv
  rows, bias = theirs.in_proj.weight.grad.numpy(), theirs.in_proj.bias.grad.numpy()
  attn, hf_attn = grads["layers"][0]["attn"], hf_model.model.layers[1].self_attn
  mlp, hf_mlp = grads["layers"][0]["mlp"], hf_model.model.layers[1].feed_forward
  pairs = [(np.asarray(conv["b_proj"][...]).T, rows[:64]),
           (np.asarray(conv["x_proj"][...]).T, rows[128:]),
           (np.asarray(conv["c_bias"][...]), bias[64:128]),
           (np.asarray(conv["conv"][...]), theirs.conv.weight.grad[:, 0]),
           (np.asarray(conv["conv_bias"][...]), theirs.conv.bias.grad),
           (np.asarray(conv["o_proj"][...]).T, theirs.out_proj.weight.grad),
           (np.asarray(attn["q_proj"][...]).reshape(64, -1).T, hf_attn.q_proj.weight.grad),
           (np.asarray(attn["o_proj"][...]).reshape(-1, 64).T, hf_attn.out_proj.weight.grad),
           (np.asarray(attn["k_norm"]["scale"][...]), hf_attn.k_layernorm.weight.grad),
           (np.asarray(mlp["gate_proj"][...]).T, hf_mlp.w1.weight.grad),
           (np.asarray(mlp["down_proj"][...]).T, hf_mlp.w2.weight.grad)]
  for ours, want in pairs:
    assert_close_to_scale(ours, np.asarray(want), rel=1e-4)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, scan)):
    assert got == want, i


def test_prefill_leaves_the_window_transformers_keeps(saved):
  """After a prompt each convolution's cache holds the last two values of B * x that
  transformers keeps (it keeps three, the oldest unused), and nothing else."""
  folder, hf = saved
  ours = models.from_pretrained(folder)
  _, cache = nnx.jit(lambda m, t, c: m(t, cache=c, prefill=True))(
      ours, TOKENS, models.init_cache(ours.cfg, 2, 32))
  with torch.no_grad():
    theirs = hf(torch.tensor(TOKENS), use_cache=True).cache
  for i in (0, 2):
    want = theirs.get_conv_state(i).numpy()[..., 1:].transpose(0, 2, 1)  # [B, 2, D]
    window = np.asarray(cache[i].v_conv)
    assert window.shape == (2, 2, 64, 1)
    np.testing.assert_allclose(window[..., 0], want, atol=1e-5 * np.abs(want).max(), rtol=0)
    assert cache[i].q_conv.size == cache[i].k_conv.size == cache[i].state.size == 0


@pytest.mark.parametrize("scan", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["layers", "scanned"])
def test_slots_and_resumed_rows_draw_what_one_call_draws(saved, scan):
  check_slots_and_resume_draw_one_calls_samples(
      models.from_pretrained(saved[0], scan_layers=scan), PROMPTS)


def test_next_turns_continue_from_the_window_their_slot_holds(saved):
  """A transcript that extends a row just ended goes on in that row's slot from the KV
  cache and convolution window it left, the answer written in chunks of 4 (rows padded
  past their count feed nothing to the window): the same samples as prefilling each turn
  whole."""
  check_next_turns_continue_from_their_slots(
      models.from_pretrained(saved[0], scan_layers=True),
      [[5, 9, 2, 7, 1, 3], [11, 12], list(range(20, 30)), [40, 41, 42]], answer=3)


def test_on_a_mesh(saved):
  """The attention's heads and the convolutions' channels (and their windows) split over
  "tensor", the batch over "data": the same logits, and the sampler's greedy tokens are
  transformers'."""
  m = check_on_a_mesh(*saved, TOKENS, PROMPTS, atol=2e-4)
  assert m.linear_layers.linear_attn.x_proj[...].sharding.spec[2] == "tensor"
  assert m.layers.attn.q_proj[...].sharding.spec[2] == "tensor"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_round_trip_is_exact(families, family, tmp_path):
  folder, hf = families[family]
  ours = models.from_pretrained(folder, scan_layers=True)
  config = check_export_files(folder, ours, tmp_path / "out")
  back = transformers.Lfm2ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  assert config["model_type"] == "lfm2" and config["intermediate_size"] == 128
  assert config["layer_types"] == CONFIG["layer_types"]
  assert models.hf_config_to_model_config(config) == ours.cfg.replace(scan_layers=False)


def test_peft_adapters_round_trip(saved, tmp_path):
  """Adapters on the attention (its out_proj: our o_proj), the convolutions' in_proj and
  out_proj and the MLP (w1, w2), ours into PEFT and PEFT's into ours. PEFT's "out_proj"
  wraps the attention's and the convolutions' both; ours are written apart."""
  folder, hf = saved
  ours, back = check_peft_round_trip(
      folder, hf, lambda: _hf_model("biased"), TOKENS, tmp_path,
      ["q_proj", "o_proj", "in_proj", "out_proj", "gate_proj", "down_proj"],
      peft_targets=["q_proj", "out_proj", "in_proj", "w1", "w2"])
  assert back.cfg.lora_target_names == ("q_proj", "o_proj", "gate_proj", "down_proj",
                                        "in_proj", "out_proj")
  written = json.loads((ours / "adapter_config.json").read_text())["target_modules"]
  assert written == ["self_attn.q_proj", "self_attn.out_proj", "feed_forward.w1",
                     "feed_forward.w2", "conv.in_proj", "conv.out_proj"]
  import peft
  for modules, kinds in ((["self_attn.out_proj"], ("o_proj",)),
                         (["conv.out_proj", "w3"], ("up_proj", "out_proj"))):
    config = peft.LoraConfig(r=2, lora_alpha=3, target_modules=modules, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    folder_of = tmp_path / "_".join(modules)
    peft.get_peft_model(_hf_model("biased"), config).save_pretrained(str(folder_of))
    assert models.from_pretrained(folder, adapter=str(folder_of)).cfg.lora_target_names == kinds


def test_what_lfm2_refuses(saved):
  folder, _ = saved
  config = json.loads(open(f"{folder}/config.json").read())
  with pytest.raises(ValueError, match=r"layer_types=\['conv', 'sliding_attention'.*in an "
                                       "Lfm2ForCausalLM config.json"):
    models.hf_config_to_model_config(
        {**config, "layer_types": ["conv", "sliding_attention", "conv", "full_attention"]})
  with pytest.raises(ValueError, match="full_attention or conv for each of the 4 layers"):
    models.hf_config_to_model_config({**config, "layer_types": ["conv", "full_attention"]})
  with pytest.raises(ValueError, match="unsupported architecture"):
    models.hf_config_to_model_config({**config, "architectures": ["Lfm3ForCausalLM"]})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="linear_mixer='short_conv' layers cannot be written "
                                       "as LlamaForCausalLM: Lfm2ForCausalLM holds them"):
    check_exportable(cfg.replace(architecture="LlamaForCausalLM", qk_norm=False))
  with pytest.raises(ValueError, match="qk_norm=False cannot be written as Lfm2ForCausalLM"):
    check_exportable(cfg.replace(qk_norm=False))
  with pytest.raises(ValueError, match="qkv_bias=True cannot be written as Lfm2ForCausalLM"):
    check_exportable(cfg.replace(qkv_bias=True))
  with pytest.raises(ValueError, match="a partial rotary embedding cannot be written as "
                                       "Lfm2ForCausalLM"):
    check_exportable(cfg.replace(rope=models.RopeConfig(partial_rotary_factor=0.5)))
  mamba = cfg.replace(linear_mixer="mamba2", linear_num_key_heads=1, linear_key_head_dim=8,
                      linear_num_value_heads=4, linear_value_head_dim=16)
  with pytest.raises(ValueError, match="linear_mixer='mamba2' layers cannot be written as "
                                       "Lfm2ForCausalLM"):
    check_exportable(mamba)
  with pytest.raises(ValueError, match="linear_mixer='short_conv' layers cannot be written as "
                                       "BambaForCausalLM"):
    check_exportable(cfg.replace(architecture="BambaForCausalLM", qk_norm=False))
  with pytest.raises(ValueError, match="linear_num_value_heads describe Gated DeltaNet / "
                                       "Mamba2 heads; linear_mixer='short_conv' has none"):
    cfg.replace(linear_num_value_heads=4)
  with pytest.raises(ValueError, match="linear_dt_min are Mamba2's"):
    cfg.replace(linear_dt_min=0.001)
  with pytest.raises(ValueError, match="lora_targets \\['in_proj_qkv'\\] are not projections "
                                       "of Lfm2ForCausalLM's short_conv layers"):
    cfg.replace(lora_rank=2, lora_targets="in_proj_qkv")
