"""Families transformers runs through a class we read, known by config.json's model_type
(EXAONE 3 / 3.5 / Deep, IQuest-Coder and InternLM3 as Llama, Sarvam-105B as DeepSeek-V3,
Sarvam-30B as GLM-4.5): read from their published config.json (their own class name,
EXAONE's, InternLM3's and Sarvam's own keys) and from their files (EXAONE's and
Sarvam-30B's own tensor names, its q, k and v fused), they compute transformers' logits
and are written back as the class they run as. InternLM3's dynamic NTK rotary embedding,
past its context, through the sampler's KV cache too."""

import json

import numpy as np
import pytest

from posttrain import models
from tests.models.parity import hf_logits, perturb

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, eos_token_id=1)
# model_type -> (transformers' config class, its fields here, the published class name)
FAMILIES = {
    "exaone": ("ExaoneConfig", dict(tie_word_embeddings=True), "ExaoneForCausalLM"),
    "iquestcoder": ("IQuestCoderConfig", dict(head_dim=24), "IQuestCoderForCausalLM"),
    # a context of 8 positions: the 14-token rows pass it, their base scaled by length
    "internlm3": ("InternLM3Config", dict(
        head_dim=24, max_position_embeddings=8,
        rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 50_000.0}),
        "InternLM3ForCausalLM"),
    "sarvam_mla": ("SarvamMLAConfig", dict(
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4), "SarvamMLAForCausalLM"),
    "sarvam_moe": ("SarvamMoEConfig", dict(
        head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, n_group=2,
        topk_group=1), "SarvamMoEForCausalLM"),
}
RUNS_AS = {"exaone": "LlamaForCausalLM", "iquestcoder": "LlamaForCausalLM",
           "internlm3": "LlamaForCausalLM",
           "sarvam_mla": "DeepseekV3ForCausalLM", "sarvam_moe": "Glm4MoeForCausalLM"}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 14))
# The keys EXAONE's and Sarvam-30B's published config.json name their own way.
PUBLISHED_KEYS = {
    "exaone": {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon",
               "hidden_act": "activation_function"},
    "internlm3": {"attention_bias": "qkv_bias", "mlp_bias": "bias"},
    "sarvam_moe": {"n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts",
                   "attention_bias": "use_qkv_bias"}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """model_type -> (folder as transformers saves it, folder as published, the HF model)."""
  out = {}
  for kind, (config_cls, extra, published) in FAMILIES.items():
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    hf = perturb(transformers.AutoModelForCausalLM.from_config(cfg).float().eval())
    if kind.startswith("sarvam"):  # the router's score correction, away from zero
      for layer in hf.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.data.normal_(0, 0.3)
    saved_dir = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(str(saved_dir / "hf"))
    hf.save_pretrained(str(saved_dir / "published"))
    with open(saved_dir / "published" / "config.json") as f:
      c = json.load(f)
    c["architectures"] = [published]
    keys = PUBLISHED_KEYS.get(kind, {})
    c = {keys.get(k, k): v for k, v in c.items()}
    if kind == "internlm3":  # its files' rope_theta and rope_scaling
      rope = c.pop("rope_parameters")
      c.update(rope_theta=rope["rope_theta"],
               rope_scaling={"rope_type": "dynamic", "factor": rope["factor"]})
    with open(saved_dir / "published" / "config.json", "w") as f:
      json.dump(c, f)
    out[kind] = (str(saved_dir / "hf"), str(saved_dir / "published"), hf)
  return out


def test_the_files_hold_their_own_names(saved):
  from safetensors.numpy import load_file
  names = set(load_file(f"{saved['exaone'][0]}/model.safetensors"))
  assert {"transformer.wte.weight", "transformer.h.0.attn.attention.out_proj.weight",
          "transformer.h.2.mlp.c_fc_1.weight", "transformer.ln_f.weight"} <= names
  names = set(load_file(f"{saved['sarvam_moe'][0]}/model.safetensors"))
  assert {"model.word_embeddings.weight", "model.layers.1.attention.query_key_value.weight",
          "model.layers.1.attention.query_key_value.bias", "model.layers.1.attention.dense.weight",
          "model.layers.1.attention.query_layernorm.weight",
          "model.layers.1.mlp.gate.expert_bias"} <= names


@pytest.mark.parametrize("form", ["hf", "published"])
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_logits_match_transformers(saved, kind, form):
  from flax import nnx
  folder = saved[kind][0 if form == "hf" else 1]
  ours = models.from_pretrained(folder)
  assert ours.cfg.architecture == RUNS_AS[kind]
  got = np.asarray(nnx.jit(lambda m, t: m(t))(ours, TOKENS))
  want = hf_logits(saved[kind][2], TOKENS)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_written_back_as_the_class_it_runs_as(saved, kind, tmp_path):
  ours = models.from_pretrained(saved[kind][1])
  models.save_pretrained(ours, str(tmp_path / "out"))
  with open(tmp_path / "out" / "config.json") as f:
    assert json.load(f)["architectures"] == [RUNS_AS[kind]]
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float()
  assert type(back).__name__ == RUNS_AS[kind]
  np.testing.assert_array_equal(hf_logits(back.eval(), TOKENS),
                                hf_logits(saved[kind][2], TOKENS))


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_defaults_are_the_families_own(kind):
  """A config.json that leaves every size out reads as transformers' defaults for its
  model_type (not the class's)."""
  config_cls, _, published = FAMILIES[kind]
  default = getattr(transformers, config_cls)()
  cfg = models.hf_config_to_model_config({"architectures": [published], "model_type": kind})
  assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads) == (
      default.vocab_size, default.hidden_size, default.num_hidden_layers,
      default.num_attention_heads)
  assert cfg.num_kv_heads == default.num_key_value_heads
  assert cfg.norm_eps == default.rms_norm_eps
  assert cfg.tie_embeddings == default.tie_word_embeddings
  assert cfg.rope.theta == default.rope_parameters["rope_theta"]
  if kind == "sarvam_mla":
    assert cfg.num_experts == default.n_routed_experts
    assert cfg.q_lora_rank == 0 and default.q_lora_rank is None
  elif kind == "sarvam_moe":
    assert (cfg.num_experts, cfg.ffn_dim, cfg.head_dim, cfg.qk_norm, cfg.dense_layers,
            cfg.routed_scaling_factor) == (
        default.n_routed_experts, default.moe_intermediate_size, default.head_dim,
        default.use_qk_norm, default.first_k_dense_replace, default.routed_scaling_factor)
    assert cfg.rope.partial_rotary_factor == default.rope_parameters["partial_rotary_factor"]
  else:
    assert cfg.ffn_dim == default.intermediate_size and cfg.head_dim == default.head_dim


def test_sarvam_deepseek_yarn_reads_as_yarn():
  scaling = {"type": "deepseek_yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
  hf = transformers.SarvamMLAConfig(rope_scaling=dict(scaling), max_position_embeddings=163_840)
  assert hf.rope_parameters["rope_type"] == "yarn"
  cfg = models.hf_config_to_model_config(
      {"architectures": ["SarvamMLAForCausalLM"], "model_type": "sarvam_mla",
       "rope_scaling": scaling, "max_position_embeddings": 163_840})
  assert cfg.rope.type == "yarn"
  for key in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "original_max_position_embeddings"):
    assert getattr(cfg.rope, key) == hf.rope_parameters[key], key


def test_internlm3_generates_past_its_context_as_transformers(saved):
  """Greedy tokens through the sampler's KV cache: the prompts start within the context
  of 8 and decode past it, each step's keys rotated by its own length's base as
  transformers' generate rotates them."""
  from tests.models.parity import greedy_tokens
  folder, _, hf = saved["internlm3"]
  assert models.from_pretrained(folder).cfg.rope.type == "dynamic"
  for i, (got, want) in enumerate(greedy_tokens(folder, hf, [[5, 9, 2, 7, 1, 3], [11]], 12,
                                                scan=False)):
    assert got == want, i


def test_unknown_model_type_is_still_refused():
  with pytest.raises(ValueError, match="unsupported architecture"):
    models.hf_config_to_model_config({"architectures": ["InternLM2ForCausalLM"],
                                      "model_type": "internlm2"})
