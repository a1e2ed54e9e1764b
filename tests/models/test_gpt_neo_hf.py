"""GPT-Neo (GPTNeoForCausalLM: GPT-Neo, the TinyStories models) against `transformers`:
learned positions, global layers beside local ones (a window shorter than the rows),
logits not scaled by 1 / sqrt(head_dim), q, k and v without biases and out_proj with one,
an MLP of no gate, its own tensor names. Logits (layer list and scanned), packed rows,
gradients, greedy generation through the KV cache, export, the reward model, PEFT
adapters, parameter counts, its defaults, older files' mask buffers, what it refuses."""

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_logits, check_packed_rows_run_apart,
                                 check_peft_round_trip, check_reward_model_round_trip,
                                 greedy_tokens, perturb, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, num_heads=4, max_position_embeddings=48,
              window_size=8, initializer_range=0.2, pad_token_id=0, bos_token_id=2,
              eos_token_id=1)
VARIANTS = {
    # GPT-Neo's pattern: global, local, global, local; tied
    "neo": dict(num_layers=4, attention_types=[[["global", "local"], 2]]),
    # another pattern, the exact GELU, a narrower MLP, untied
    "local_first": dict(num_layers=3, attention_types=[[["local", "global"], 1],
                                                       [["local"], 1]],
                        activation_function="gelu", intermediate_size=96,
                        tie_word_embeddings=False),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 24))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="GPTNeoForCausalLM", **extra):
  torch.manual_seed(0)
  cfg = transformers.GPTNeoConfig(**{**COMMON, **VARIANTS[variant], **extra})
  # weights a little smaller than other families': logits unscaled by 1 / sqrt(head_dim)
  return perturb(getattr(transformers, cls)(cfg).float().eval(), scale=0.2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["neo"][0]).cfg
  assert (cfg.learned_positions, cfg.rope_layers, cfg.sliding_window, cfg.sliding_layers,
          cfg.attention_scale, cfg.qkv_bias, cfg.attn_out_bias, cfg.mlp_bias,
          cfg.layer_norm, cfg.norm_bias, cfg.mlp_activation, cfg.ffn_dim,
          cfg.tie_embeddings) == (
      True, (0, 0, 0, 0), 8, (False, True, False, True), 1.0, False, True, True, True,
      True, "gelu_tanh_ungated", 256, True)
  other = models.from_pretrained(saved["local_first"][0]).cfg
  assert (other.sliding_layers, other.mlp_activation, other.ffn_dim,
          other.tie_embeddings) == ((True, False, True), "gelu_ungated", 96, False)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_the_local_window_and_the_scale_matter(saved):
  """Every layer global, or the logits scaled by 1 / sqrt(head_dim), computes other
  logits: the parity above holds both."""
  folder, hf = saved["neo"]
  for overrides in (dict(sliding_window=None, layer_types=()),
                    dict(query_pre_attn_scalar=None)):
    with pytest.raises(AssertionError):
      check_logits(folder, hf, TOKENS, False, overrides=overrides)


def test_packed_rows_read_their_own_positions(saved):
  check_packed_rows_run_apart(models.from_pretrained(saved["neo"][0]), TOKENS)


def test_gradients_match_transformers(saved):
  folder, hf_model = saved["neo"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  assert_close_to_scale(grads["pos_embed"][...],
                        hf_model.transformer.wpe.weight.grad.numpy()[:48])
  for i in range(4):
    layer, hf = grads["layers"][i], hf_model.transformer.h[i]
    attn = hf.attn.attention
    assert_close_to_scale(layer["attn"]["k_proj"][...],
                          attn.k_proj.weight.grad.numpy().T.reshape(64, 4, 16))
    assert_close_to_scale(layer["attn"]["o_bias"][...], attn.out_proj.bias.grad.numpy())
    assert_close_to_scale(layer["mlp"]["up_proj"][...], hf.mlp.c_fc.weight.grad.numpy().T)


@pytest.mark.parametrize("variant,scan", [("neo", False), ("local_first", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Decoding past the window: each local layer's query sees its last 8 keys."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.GPTNeoForCausalLM,
                                    TOKENS, tmp_path / "out")
  kinds = transformers.GPTNeoConfig(**written).attention_layers
  assert kinds == transformers.GPTNeoConfig(**{**COMMON, **VARIANTS[variant]}).attention_layers
  assert (written["model_type"], written["window_size"]) == ("gpt_neo", 8)


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("neo", cls="GPTNeoForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.GPTNeoForSequenceClassification, tmp_path)


def test_peft_adapters_both_ways(saved, tmp_path):
  """PEFT's names: q_proj, k_proj, v_proj and out_proj in attn.attention, c_fc and
  c_proj."""
  folder, hf = saved["neo"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("neo"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                        peft_targets=["q_proj", "k_proj", "v_proj", "out_proj", "c_fc",
                                      "c_proj"])


def test_older_files_mask_buffers_are_not_read(saved, tmp_path):
  """Files saved by older transformers hold each layer's mask buffers
  (attn.attention.bias, masked_bias): read past, never a missing or unknown tensor."""
  import shutil

  from safetensors.numpy import load_file, save_file
  folder, hf = saved["neo"]
  shutil.copytree(folder, tmp_path / "old")
  tensors = load_file(f"{folder}/model.safetensors")
  for i in range(4):
    tensors[f"transformer.h.{i}.attn.attention.bias"] = np.tril(np.ones((1, 1, 48, 48), bool))
    tensors[f"transformer.h.{i}.attn.attention.masked_bias"] = np.array(-1e9, np.float32)
  save_file(tensors, str(tmp_path / "old" / "model.safetensors"), metadata={"format": "pt"})
  check_logits(str(tmp_path / "old"), hf, TOKENS, False)


def test_what_gpt_neo_refuses(saved):
  base = saved["neo"][1].config.to_dict()
  with pytest.raises(ValueError, match="must give 4 layers"):
    models.hf_config_to_model_config({**base, "attention_types": [[["global"], 3]]})
  with pytest.raises(ValueError, match="each global or local"):
    models.hf_config_to_model_config({**base, "attention_types": [[["sparse"], 4]]})
  cfg = models.from_pretrained(saved["neo"][0]).cfg
  with pytest.raises(ValueError, match="whose logits are not scaled"):
    models.hf.model_config_to_hf(cfg.replace(query_pre_attn_scalar=None))


def test_defaults_are_transformers():
  default = transformers.GPTNeoConfig()
  cfg = models.hf_config_to_model_config({"architectures": ["GPTNeoForCausalLM"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.max_position_embeddings, cfg.sliding_window, cfg.norm_eps,
          cfg.tie_embeddings) == (
      default.vocab_size, default.hidden_size, 4 * default.hidden_size, default.num_layers,
      default.num_heads, default.max_position_embeddings, default.window_size,
      default.layer_norm_epsilon, default.tie_word_embeddings)
  assert cfg.sliding_layers == tuple(k == "local" for k in default.attention_layers)
