"""Granite 3 (GraniteForCausalLM), Granite 3 MoE (GraniteMoeForCausalLM, and with a
shared expert GraniteMoeSharedForCausalLM) and Granite 4's attention-only models
(GraniteMoeHybridForCausalLM; its Mamba2 layers are test_granite4_hybrid_hf.py's) against
`transformers`: Llama's layout scaled by four scalars (the embeddings, each sublayer's
residual branch, the attention's scale and the logits), the MoE's experts stacked in
input_linear / output_linear under Mixtral's routing, Granite 4's MLP a fused shared_mlp
(a shared expert beside its experts), with or without rotary embeddings. Logits and
log-prob gradients (layer list and scanned), greedy generation through the sampler,
export, PEFT adapters (the routed experts' too), and what other classes refuse."""

import json
import pathlib

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_peft_round_trip, greedy_tokens,
                                 hf_logits, perturb, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              embedding_multiplier=12.0, residual_multiplier=0.22,
              attention_multiplier=0.0625, logits_scaling=8.0)
VARIANTS = {
    "untied": {},
    # Granite 3's small models: tied embeddings, scaled logits through the shared table;
    # biases on all four attention projections.
    "tied": dict(tie_word_embeddings=True, attention_bias=True, logits_scaling=6.0),
    # granite-3.x-*-a*m: 4 experts of width 32, 2 a token.
    "moe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                attention_bias=True),
    # Granite MoE Shared: the experts and a shared_mlp beside them.
    "shared": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                   shared_intermediate_size=40),
    # granite-4.0-micro / -1b / -350m: attention layers alone, the MLP its shared_mlp.
    "g4": dict(layer_types=["attention"] * 3, position_embedding_type="rope",
               num_local_experts=0, shared_intermediate_size=80, tie_word_embeddings=True),
    # Experts beside the shared_mlp, and no position embedding at all.
    "g4_moe": dict(layer_types=["attention"] * 3, position_embedding_type=None,
                   num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                   shared_intermediate_size=48),
}
CLASSES = {"untied": "GraniteForCausalLM", "tied": "GraniteForCausalLM",
           "moe": "GraniteMoeForCausalLM", "shared": "GraniteMoeSharedForCausalLM",
           "g4": "GraniteMoeHybridForCausalLM",
           "g4_moe": "GraniteMoeHybridForCausalLM"}
MODEL_TYPES = {"GraniteForCausalLM": "granite", "GraniteMoeForCausalLM": "granitemoe",
               "GraniteMoeSharedForCausalLM": "granitemoeshared",
               "GraniteMoeHybridForCausalLM": "granitemoehybrid"}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(variant, **extra):
  cls = getattr(transformers, CLASSES[variant])
  cfg = cls.config_class(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  return perturb(cls(cfg).float().eval())


def _logits(model, tokens=TOKENS):
  return np.asarray(_jitted_logits(model, tokens))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_four_scalars(saved):
  cfg = models.from_pretrained(saved["untied"][0]).cfg
  assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier,
          cfg.logits_scaling) == (12.0, 0.22, 0.0625, 8.0)
  assert cfg.attention_scale == 0.0625 and not cfg.qkv_bias and not cfg.tie_embeddings
  tied = models.from_pretrained(saved["tied"][0]).cfg
  assert tied.tie_embeddings and tied.qkv_bias and tied.attn_out_bias
  moe = models.from_pretrained(saved["moe"][0]).cfg
  assert (moe.num_experts, moe.num_experts_per_tok, moe.ffn_dim, moe.norm_topk_prob,
          moe.logits_scaling) == (4, 2, 32, True, 8.0)
  shared = models.from_pretrained(saved["shared"][0]).cfg
  assert (shared.num_experts, shared.ffn_dim, shared.shared_expert_dim,
          shared.shared_expert_gate) == (4, 32, 40, False)
  g4 = models.from_pretrained(saved["g4"][0]).cfg
  assert (g4.num_experts, g4.ffn_dim, g4.rope_layers) == (0, 80, ())
  g4_moe = models.from_pretrained(saved["g4_moe"][0]).cfg
  assert (g4_moe.num_experts, g4_moe.ffn_dim, g4_moe.shared_expert_dim,
          g4_moe.shared_expert_gate, g4_moe.nope_layers) == (4, 32, 48, False, (True,) * 3)
  # transformers' defaults: each 1.0, the attention's scale too (not 1 / sqrt(head_dim)).
  bare = {k: v for k, v in COMMON.items() if not k.endswith(("multiplier", "scaling"))}
  plain = models.hf_config_to_model_config(
      {**bare, "architectures": ["GraniteForCausalLM"], "model_type": "granite"})
  assert plain.attention_scale == 1.0 and plain.logits_scaling == 1.0
  with pytest.raises(ValueError, match="logits_scaling must be a positive number, got 0.0"):
    models.hf_config_to_model_config({**bare, "architectures": ["GraniteForCausalLM"],
                                      "logits_scaling": 0})


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  folder, hf = saved[variant]
  want = hf_logits(hf, TOKENS)
  np.testing.assert_allclose(_logits(models.from_pretrained(folder, scan_layers=scan)), want,
                             atol=1e-4, rtol=0)
  assert np.abs(want).max() > 1


def test_each_scalar_moves_the_logits(saved):
  """Setting any one of the four back to Llama's value changes the logits by far more
  than the tolerance."""
  model = models.from_pretrained(saved["tied"][0])
  base = _logits(model)
  for name, plain in (("embedding_multiplier", 1.0), ("residual_multiplier", 1.0),
                      ("attention_multiplier", None), ("logits_scaling", 1.0)):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.Transformer(
        model.cfg.replace(**{name: plain}), rngs=nnx.Rngs(0))))
    assert np.abs(_logits(nnx.merge(graphdef, nnx.state(model))) - base).max() > 1e-2, name


def test_log_prob_gradients_match_transformers(saved):
  """Through all four scalars, the tied table's gradient taking both its uses."""
  folder, hf = saved["tied"]
  grads = target_logprob_grads(hf, models.from_pretrained(folder), TOKENS)
  # Row 0 aside: transformers' table takes no lookup gradient at its padding_idx.
  pairs = [(grads["embed"][1:], hf.model.embed_tokens.weight.grad[1:]),
           (grads["final_norm"]["scale"][...], hf.model.norm.weight.grad)]
  for i in range(COMMON["num_hidden_layers"]):
    layer, theirs = grads["layers"][i], hf.model.layers[i]
    pairs += [(np.asarray(layer["attn"]["q_proj"][...]).reshape(64, 64).T,
               theirs.self_attn.q_proj.weight.grad),
              (np.asarray(layer["attn"]["o_bias"][...]), theirs.self_attn.o_proj.bias.grad),
              (np.asarray(layer["mlp"]["down_proj"][...]).T, theirs.mlp.down_proj.weight.grad),
              (layer["input_norm"]["scale"][...], theirs.input_layernorm.weight.grad)]
  for ours, theirs in pairs:
    assert_close_to_scale(ours, np.asarray(theirs))


@pytest.mark.parametrize("variant,scan", [("untied", False), ("tied", True), ("moe", True),
                                          ("shared", False), ("g4", False), ("g4_moe", True)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Through the sampler's KV cache and its own logits head (the scaled projection)."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  folder, hf = saved[variant]
  ours = models.from_pretrained(folder)
  models.save_pretrained(ours, str(tmp_path / "out"))
  back = getattr(transformers, CLASSES[variant]).from_pretrained(
      str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == MODEL_TYPES[CLASSES[variant]]
  assert written["logits_scaling"] == (
      VARIANTS[variant].get("logits_scaling", 8.0))
  assert models.hf_config_to_model_config(written) == ours.cfg


def test_peft_adapters_round_trip(saved, tmp_path):
  folder, hf = saved["untied"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("untied"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def test_moe_peft_adapters_on_the_routed_experts_round_trip(saved, tmp_path):
  """PEFT's target_parameters on transformers' stacked experts (gate_up_proj [E, 2F, D],
  down_proj [E, D, F] in memory, the files' input_linear / output_linear)."""
  folder, hf = saved["moe"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("moe"), TOKENS, tmp_path,
                        ["q_proj", "v_proj"],
                        target_parameters=["block_sparse_moe.experts.gate_up_proj",
                                           "block_sparse_moe.experts.down_proj"])


def test_granite4_peft_adapters_on_the_attention_and_experts_round_trip(saved, tmp_path):
  folder, hf = saved["g4_moe"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("g4_moe"), TOKENS, tmp_path,
                        ["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["block_sparse_moe.experts.gate_up_proj",
                                           "block_sparse_moe.experts.down_proj"])
  # By default the adapters go where PEFT's files can hold them: the attention.
  default = models.from_pretrained(folder, lora_rank=2)
  assert default.cfg.lora_target_names == ("q_proj", "k_proj", "v_proj", "o_proj")
  models.save_lora_adapter(default, str(tmp_path / "default"))
  with pytest.raises(ValueError, match="PEFT wraps its shared_mlp's fused input_linear"):
    models.save_lora_adapter(models.from_pretrained(folder, lora_rank=2,
                                                    lora_targets="q_proj,gate_proj"),
                             str(tmp_path / "mlp"))


def test_what_granite4_cannot_hold_is_refused(saved):
  """Layer kinds other than attention and mamba (its Mamba2 layers: test_granite4_hybrid_
  hf.py), Mamba2 layers alone, layers both rotary and NoPE, experts without the
  shared_mlp: one-line errors."""
  config = json.loads(pathlib.Path(saved["g4"][0], "config.json").read_text())
  with pytest.raises(ValueError, match=r"layer_types=\['mamba', 'moe', 'attention'\] in a "
                                       r"GraniteMoeHybridForCausalLM config.json"):
    models.hf_config_to_model_config({**config, "layer_types": ["mamba", "moe", "attention"]})
  with pytest.raises(ValueError, match="layer_types has no full_attention layer"):
    models.hf_config_to_model_config({**config, "layer_types": ["mamba"] * 3})
  moe = models.from_pretrained(saved["g4_moe"][0]).cfg
  with pytest.raises(ValueError, match="shared_expert_dim=0 cannot be written as "
                                       "GraniteMoeHybridForCausalLM"):
    models.hf.check_exportable(moe.replace(shared_expert_dim=0))
  with pytest.raises(ValueError, match="rope_layers with rotary and NoPE layers both"):
    models.hf.check_exportable(models.from_pretrained(saved["g4"][0]).cfg.replace(
        rope_layers=(1, 0, 1)))


def test_what_other_classes_refuse():
  tiny = models.get_preset("tiny")
  for name, value in (("embedding_multiplier", 12.0), ("residual_multiplier", 0.22),
                      ("attention_multiplier", 0.0625), ("logits_scaling", 8.0)):
    with pytest.raises(ValueError, match=f"\\['{name}'\\] cannot be written as "
                                         "LlamaForCausalLM; GraniteForCausalLM and "
                                         "GraniteMoeForCausalLM hold them"):
      models.hf.check_exportable(tiny.replace(**{name: value}))
  models.hf.check_exportable(tiny.replace(architecture="GraniteForCausalLM",
                                          logits_scaling=8.0))
  moe = tiny.replace(architecture="GraniteMoeForCausalLM", num_experts=4,
                     num_experts_per_tok=2, norm_topk_prob=True)
  models.hf.check_exportable(moe)
  with pytest.raises(ValueError, match="norm_topk_prob=False cannot be written as "
                                       "GraniteMoeForCausalLM"):
    models.hf.check_exportable(moe.replace(norm_topk_prob=False))
  with pytest.raises(ValueError, match="shared_expert_dim=16 cannot be written as "
                                       "GraniteMoeForCausalLM"):
    models.hf.check_exportable(moe.replace(shared_expert_dim=16))
  with pytest.raises(ValueError, match="a mixture of experts is written as one of"):
    models.hf.check_exportable(tiny.replace(architecture="GraniteMoeForCausalLM"))
  for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
    with pytest.raises(ValueError, match=f"{name} must be a positive number, got 0"):
      tiny.replace(**{name: 0})
  with pytest.raises(ValueError, match="attention_multiplier sets the attention's scale "
                                       "itself"):
    tiny.replace(attention_multiplier=0.1, query_pre_attn_scalar=64.0)


def test_the_preset_is_granite_3_3_8b():
  """8.17B parameters as published (the table tied), and a config.json transformers
  reads back into the same scalars."""
  cfg = models.get_preset("granite3_8b")
  assert abs(cfg.num_params / 1e9 - 8.17) < 0.01
  hf = transformers.GraniteConfig(**{k: v for k, v in models.hf.model_config_to_hf(cfg).items()
                                     if k not in ("architectures", "torch_dtype")})
  assert (hf.embedding_multiplier, hf.residual_multiplier, hf.attention_multiplier,
          hf.logits_scaling) == (12.0, 0.22, 0.0078125, 16.0)
  assert models.hf_config_to_model_config(
      models.hf.model_config_to_hf(cfg)) == cfg.replace(remat="none", scan_layers=False)
