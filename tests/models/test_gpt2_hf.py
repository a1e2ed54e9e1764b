"""GPT-2 (GPT2LMHeadModel) against `transformers`: a learned absolute position embedding
and no rotary one, LayerNorms with biases, q, k and v in one Conv1D c_attn, biases on
every projection, an MLP of no gate through gelu_new, tied embeddings. Logits (layer list
and scanned), packed rows (positions restarting), gradients through the fused Conv1D and
the position table, greedy generation, export, the reward model, the oldest files'
names, parameter counts, its defaults, and what it refuses."""

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_export_round_trip,
                                 check_fused_qkv_peft, check_logits,
                                 check_packed_rows_run_apart, check_reward_model_round_trip,
                                 greedy_tokens, hf_logits, perturb, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, n_embd=64, n_layer=3, n_head=4, n_positions=48,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
VARIANTS = {
    "gpt2": {},  # GPT-2's layout: tied, gelu_new, an MLP 4 x n_embd wide
    "untied": dict(tie_word_embeddings=False, activation_function="gelu", n_inner=80),
}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _hf_model(variant, cls="GPT2LMHeadModel", **extra):
  torch.manual_seed(0)
  cfg = transformers.GPT2Config(**{**COMMON, **VARIANTS[variant], **extra})
  return perturb(getattr(transformers, cls)(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_configs_read_each_layout(saved):
  cfg = models.from_pretrained(saved["gpt2"][0]).cfg
  assert (cfg.learned_positions, cfg.rope_layers, cfg.max_position_embeddings, cfg.ffn_dim,
          cfg.layer_norm, cfg.norm_bias, cfg.mlp_bias, cfg.qkv_bias, cfg.attn_out_bias,
          cfg.tie_embeddings, cfg.mlp_activation, cfg.num_kv_heads, cfg.head_dim) == (
      True, (0, 0, 0), 48, 256, True, True, True, True, True, True, "gelu_tanh_ungated", 4,
      16)
  untied = models.from_pretrained(saved["untied"][0]).cfg
  assert (untied.tie_embeddings, untied.mlp_activation, untied.ffn_dim) == (
      False, "gelu_ungated", 80)
  for variant, (folder, hf) in saved.items():
    assert models.from_pretrained(folder).cfg.num_params == sum(
        p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_packed_rows_read_their_own_positions(saved):
  """Two sequences packed in a row each read the position table from 0."""
  check_packed_rows_run_apart(models.from_pretrained(saved["gpt2"][0]), TOKENS)


def test_positions_past_the_table_are_nan_not_clamped(saved):
  """A row that reads past the table (48 positions) computes NaN, where a clamped read
  would compute plausible logits; the rows beside it are untouched."""
  model = models.from_pretrained(saved["gpt2"][0])
  positions = np.stack([np.arange(12), np.arange(40, 52)])
  logits = np.asarray(model(TOKENS[:, :12], positions))
  assert np.isfinite(logits[0]).all() and np.isnan(logits[1, 8:]).all()
  from posttrain.sampling import Sampler
  with pytest.raises(ValueError, match="max_len=64 is past this model's learned position "
                     "embedding of 48"):
    Sampler(model, max_len=64)


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for q, k and v (thirds of the Conv1D c_attn's
  output, weight and bias), the MLP's c_fc and the position table."""
  folder, hf_model = saved["gpt2"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  d, n, h = 64, 4, 16
  assert_close_to_scale(grads["pos_embed"][...], hf_model.transformer.wpe.weight.grad.numpy())
  for i in range(COMMON["n_layer"]):
    layer, hf = grads["layers"][i], hf_model.transformer.h[i]
    weight = hf.attn.c_attn.weight.grad.numpy().reshape(d, 3, n, h)  # Conv1D: [in, out]
    bias = hf.attn.c_attn.bias.grad.numpy().reshape(3, n, h)
    for j, name in enumerate("qkv"):
      assert_close_to_scale(layer["attn"][f"{name}_proj"][...], weight[:, j])
      if name != "k":  # (k's bias shifts a query's every score alike: no gradient)
        assert_close_to_scale(layer["attn"][f"{name}_bias"][...], bias[j])
    assert_close_to_scale(layer["mlp"]["up_proj"][...], hf.mlp.c_fc.weight.grad.numpy())


@pytest.mark.parametrize("variant,scan", [("gpt2", False), ("untied", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.GPT2LMHeadModel, TOKENS,
                                    tmp_path / "out")
  assert (written["model_type"], written["n_positions"], written["activation_function"]) == (
      "gpt2", 48, "gelu_new" if variant == "gpt2" else "gelu")
  assert "rope_theta" not in written and "hidden_size" not in written


def test_the_oldest_files_read_alike(saved, tmp_path):
  """GPT-2's first published files: names without the transformer. prefix, each layer's
  attention-mask buffers (attn.bias, attn.masked_bias) beside its tensors."""
  from safetensors.numpy import load_file, save_file
  folder, hf = saved["gpt2"]
  old = tmp_path / "old"
  old.mkdir()
  tensors = {name.removeprefix("transformer."): value
             for name, value in load_file(f"{folder}/model.safetensors").items()}
  for i in range(COMMON["n_layer"]):
    tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((48, 48), np.float32))[None, None]
    tensors[f"h.{i}.attn.masked_bias"] = np.asarray(-1e4, np.float32)
  save_file(tensors, str(old / "model.safetensors"))
  with open(f"{folder}/config.json") as fh:
    (old / "config.json").write_text(fh.read())
  model = models.from_pretrained(str(old))
  np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, t: m(t))(model, TOKENS)),
                             hf_logits(hf, TOKENS), atol=1e-4, rtol=0)


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("gpt2", cls="GPT2ForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.GPT2ForSequenceClassification, tmp_path)


def test_what_gpt2_refuses(saved):
  """Attention options it does not read, a rotary embedding and grouped keys: one-line
  errors."""
  folder, hf = saved["gpt2"]
  base = hf.config.to_dict()
  for key, value in (("scale_attn_by_inverse_layer_idx", True),
                     ("scale_attn_weights", False), ("add_cross_attention", True)):
    with pytest.raises(ValueError, match=f"{key}={str(value).lower()} in a GPT-2"):
      models.hf_config_to_model_config({**base, key: value})
  model = models.from_pretrained(folder)
  for change, match in ((dict(rope_layers=(1, 1, 1)), "no rotary embedding"),
                        (dict(num_kv_heads=2), "a head for each")):
    with pytest.raises(ValueError, match=match):
      models.hf.model_config_to_hf(model.cfg.replace(**change))


def test_a_run_keeps_the_folders_position_table(saved):
  """A run from a GPT-2 folder cannot resize its learned position table: an override
  of max_position_embeddings is not applied (the run warns of it)."""
  from posttrain import experiment
  from tests.test_family_runs import _config
  cfg = experiment.model_config(_config(init_from=saved["gpt2"][0], **{
      "model.overrides.max_position_embeddings": 512}))
  assert cfg.max_position_embeddings == 48


def test_defaults_are_transformers():
  default = transformers.GPT2Config()
  cfg = models.hf_config_to_model_config({"architectures": ["GPT2LMHeadModel"]})
  assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
          cfg.norm_eps, cfg.max_position_embeddings, cfg.tie_embeddings) == (
      default.vocab_size, default.n_embd, 4 * default.n_embd, default.n_layer,
      default.n_head, default.layer_norm_epsilon, default.n_positions,
      default.tie_word_embeddings)


def test_transformers_aliases_of_its_keys_are_read():
  """GPT2Config takes hidden_size, num_attention_heads, num_hidden_layers and
  max_position_embeddings for n_embd, n_head, n_layer and n_positions: a config.json that
  says those reads as transformers reads it (they win where its own names stand too)."""
  aliased = {"architectures": ["GPT2LMHeadModel"], "hidden_size": 64,
             "num_attention_heads": 4, "num_hidden_layers": 3, "max_position_embeddings": 48}
  want = transformers.GPT2Config(**aliased)
  cfg = models.hf_config_to_model_config(aliased)
  assert (cfg.d_model, cfg.num_heads, cfg.num_layers, cfg.max_position_embeddings,
          cfg.ffn_dim) == (want.n_embd, want.n_head, want.n_layer, want.n_positions,
                           4 * want.n_embd)
  both = {**aliased, "n_embd": 32, "n_head": 2}
  assert (transformers.GPT2Config.from_dict(both).n_embd,
          models.hf_config_to_model_config(both).d_model) == (64, 64)


def test_peft_adapters_on_the_fused_projection_are_read(saved, tmp_path):
  """PEFT's one adapter on c_attn read as q, k and v's; ours on c_fc both ways."""
  folder, hf = saved["gpt2"]
  check_fused_qkv_peft(folder, hf, lambda: _hf_model("gpt2"), TOKENS, tmp_path,
                       "c_attn", "c_fc", ["up_proj"])
