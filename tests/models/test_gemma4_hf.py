"""Gemma 4 (Gemma4ForCausalLM, and Gemma4ForConditionalGeneration's language model) against
`transformers`: sliding layers beside full layers of their own widths (global_head_dim,
num_global_key_value_heads) in a stack of their own, values from the keys' projection
(attention_k_eq_v), value norms, layer scalars, proportional RoPE on the full layers, and
the 26B-A4B's experts beside each layer's dense MLP; the E2B / E4B's per-layer embeddings
and layers attending over an earlier layer's keys and values. Logits (layer list and
scanned), greedy generation through the cache, a data x tensor mesh, export both ways,
PEFT adapters and the refusals."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models import transformer as T
from tests.models.parity import (check_export_round_trip, check_logits, check_on_a_mesh,
                                 check_peft_round_trip, greedy_tokens, hf_logits, perturb,
                                 save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

KINDS = (["sliding_attention"] * 2 + ["full_attention"]) * 2
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12, global_head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, sliding_window=5, hidden_size_per_layer_input=0,
              layer_types=KINDS)
VARIANTS = {
    # the full layers wider than the sliding ones, each with its v_proj; a soft cap
    "dense": dict(final_logit_softcapping=30.0),
    # the 31B's layout: the full layers' values from their keys, one key/value head
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    # the 26B-A4B's: 6 experts beside each layer's dense MLP, 2 a token
    "moe": dict(attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
                num_experts=6, top_k_experts=2, moe_intermediate_size=24),
    # the E2B / E4B's: per-layer embeddings of 8 (a table past the vocabulary), the last
    # two layers (one of each kind) reading layers 3's and 2's keys and values, their MLPs
    # twice as wide
    "ple": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                num_kv_shared_layers=2, use_double_wide_mlp=True),
    # three layers sharing, the full layers' values from their keys
    "ple_k_eq_v": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=97,
                       num_kv_shared_layers=3, attention_k_eq_v=True,
                       num_global_key_value_heads=1),
}
# The E2B / E4B's layers run as a list (scan_layers=False).
LISTED = ("ple", "ple_k_eq_v")
RUNS = [(v, scan) for v in VARIANTS for scan in (False, True) if not (scan and v in LISTED)]
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]


def _spread(model):
  """Moves what transformers initialises to one (the layer scalars, the routers' scales)
  and draws the routers' weights wide, so that each of them moves the logits."""
  with torch.no_grad():
    for name, buf in model.named_buffers():
      if name.endswith("layer_scalar"):
        buf.copy_(torch.rand_like(buf) + 0.5)
    for name, p in model.named_parameters():
      if name.endswith("router.proj.weight"):
        p.normal_(0.0, 0.5)
      if name.endswith(("router.scale", "router.per_expert_scale")):
        p.add_(torch.randn_like(p) * 0.3)
  return model


def _hf_model(variant):
  torch.manual_seed(0)
  cfg = transformers.Gemma4TextConfig(**{**COMMON, **VARIANTS[variant]})
  return _spread(perturb(transformers.Gemma4ForCausalLM(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_full_layers_widths(saved):
  cfg = models.from_pretrained(saved["moe"][0]).cfg
  assert (cfg.head_dim, cfg.num_kv_heads, cfg.global_head_dim, cfg.global_kv_heads) == (
      12, 2, 16, 1)
  assert (cfg.k_eq_v, cfg.v_norm, cfg.layer_scale, cfg.moe_input_norms) == (
      True, True, True, True)
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.ffn_dim, cfg.shared_expert_dim) == (
      6, 2, 24, 80)
  assert (cfg.rope.type, cfg.rope.partial_rotary_factor, cfg.rope.theta) == (
      "proportional", 0.25, 1_000_000.0)
  assert (cfg.rope_local.type, cfg.rope_local.theta) == ("default", 10_000.0)
  assert [name for name, _ in T.layer_stacks(cfg)] == ["layers", "global_layers"]
  assert T.layer_path(cfg, 2) == ("global_layers", 0)
  # The published files' form (global_head_dim, num_global_key_value_heads) reads the same
  # as transformers 5's per_layer_config.
  published = json.loads(open(f"{saved['moe'][0]}/config.json").read())
  published.pop("per_layer_config")
  published.update(global_head_dim=16, num_global_key_value_heads=1)
  assert models.hf_config_to_model_config(published) == cfg
  # Without attention_k_eq_v the published form gives the full layers the sliding
  # layers' key/value heads, as transformers does (0: the same).
  plain = models.hf_config_to_model_config({**published, "attention_k_eq_v": False})
  assert (plain.global_head_dim, plain.global_kv_heads, plain.k_eq_v) == (16, 0, False)
  assert plain.global_config().num_kv_heads == 2


def test_the_parameters_are_counted(saved):
  for variant in VARIANTS:
    model = models.from_pretrained(saved[variant][0])
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == model.cfg.num_params, variant
    assert n == sum(p.numel() for p in saved[variant][1].parameters()) + 6, variant


@pytest.mark.parametrize("variant,scan", RUNS,
                         ids=[f"{v}-{'scanned' if s else 'layers'}" for v, s in RUNS])
def test_logits_match_transformers(saved, variant, scan):
  check_logits(*saved[variant], TOKENS, scan)


def test_the_layers_sharing_keys_and_values(saved):
  """Layers 4 (sliding) and 5 (full) attend over layers 3's and 2's keys and values: no
  projections of their own, no cache; with their own keys (each its producer's weights)
  the logits move."""
  folder, hf = saved["ple"]
  model = models.from_pretrained(folder)
  cfg = model.cfg
  assert (cfg.per_layer_dim, cfg.per_layer_vocab, cfg.kv_shared_layers,
          cfg.kv_shared_wide_mlp) == (8, 128, 2, True)
  assert [cfg.kv_producer(i) for i in range(6)] == [None] * 4 + [3, 2]
  assert dict(T.layer_stacks(cfg)) == {"layers": (0, 1, 3), "global_layers": (2,),
                                       "shared_layers": (4,), "shared_global_layers": (5,)}
  assert not hasattr(model.shared_layers[0].attn, "k_proj")
  assert model.shared_layers[0].mlp.up_proj.shape == (48, 160)  # twice 80
  assert [c is None for c in T.init_cache(cfg, 2, 48)] == [False] * 4 + [True] * 2
  with pytest.raises(ValueError, match="run with scan_layers=False"):
    models.from_pretrained(folder, scan_layers=True)


def test_each_of_gemma4s_pieces_moves_the_logits(saved):
  """Read without the value norms, the layer scalars, or with the full layers rotated by
  a partial rotary embedding (the first features) instead of the proportional one, the
  logits move by far more than the tolerance."""
  folder, hf = saved["k_eq_v"]
  model = models.from_pretrained(folder)
  want = hf_logits(hf, TOKENS)
  state = nnx.state(model)
  for change in (dict(v_norm=False),
                 dict(rope=dataclasses.replace(model.cfg.rope, type="default"))):
    other = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda c=change: models.Transformer(
        model.cfg.replace(**c), rngs=nnx.Rngs(0)))), state)
    assert np.abs(np.asarray(other(TOKENS)) - want).max() > 1e-2, change
  unscaled = nnx.merge(nnx.graphdef(model), nnx.state(model))
  for stack in ("layers", "global_layers"):
    for block in getattr(unscaled, stack):
      block.layer_scale[...] = np.ones((1,), np.float32)
  assert np.abs(np.asarray(unscaled(TOKENS)) - want).max() > 1e-2


GENERATED = [("k_eq_v", False), ("k_eq_v", True), ("moe", False), ("moe", True),
             ("ple", False), ("ple_k_eq_v", False)]


@pytest.mark.parametrize("variant,scan", GENERATED,
                         ids=[f"{v}-{'scanned' if s else 'layers'}" for v, s in GENERATED])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 10, scan)):
    assert got == want, (variant, i)


def test_the_cache_holds_each_kind_at_its_width(saved):
  cfg = models.from_pretrained(saved["k_eq_v"][0], scan_layers=True).cfg
  cache = T.init_cache(cfg, 2, 48)
  assert isinstance(cache, T.LayerKindCaches)
  assert cache.full.k.shape == (2, 2, 1, 48, 16)  # 2 full layers, 1 head of 16
  assert cache.sliding.k.shape == (4, 2, 2, cache.sliding.k.shape[3], 12)
  listed = T.init_cache(cfg.replace(scan_layers=False), 2, 48)
  assert [c.k.shape[1:] for c in listed][1:3] == [(2, 48, 12), (1, 48, 16)]


def test_on_a_data_and_tensor_mesh(saved):
  check_on_a_mesh(*saved["moe"], TOKENS, PROMPTS, atol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.Gemma4ForCausalLM, TOKENS,
                                    tmp_path / "out")
  assert written["model_type"] == "gemma4_text"
  assert written["per_layer_config"]["2"] == {"head_dim": 16, "num_key_value_heads": (
      1 if "k_eq_v" in variant or variant == "moe" else 2)}


def test_the_vision_language_folder_reads_its_language_model(tmp_path):
  """Gemma4ForConditionalGeneration (how Gemma 4 is published): its language model, read
  alone, gives transformers' logits of text."""
  text = transformers.Gemma4TextConfig(**{**COMMON, **VARIANTS["k_eq_v"]})
  vision = transformers.Gemma4VisionConfig(hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           num_key_value_heads=2, head_dim=8)
  cfg = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict())
  torch.manual_seed(0)
  hf = _spread(perturb(transformers.Gemma4ForConditionalGeneration(cfg).float().eval()))
  hf.save_pretrained(str(tmp_path / "vl"))
  model = models.from_pretrained(str(tmp_path / "vl"))
  assert model.cfg.architecture == "Gemma4ForCausalLM"
  with torch.no_grad():
    want = hf(input_ids=torch.tensor(TOKENS)).logits.numpy()
  np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, t: m(t))(model, TOKENS)), want,
                             atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["k_eq_v", "ple_k_eq_v"])
def test_peft_adapters_both_ways(saved, tmp_path, variant):
  """The full layers have no v_proj (values from the keys), the layers sharing keys and
  values neither k_proj nor v_proj: PEFT adapts them where they are, and so do ours."""
  folder, hf = saved[variant]
  _, back = check_peft_round_trip(
      folder, hf, lambda: _hf_model(variant), TOKENS, tmp_path,
      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
      scan=variant not in LISTED, atol=2e-4)  # logits up to 8: float32 sums in two orders
  assert not hasattr(back.global_layers[0].attn, "v_proj_lora_a")
  assert hasattr(back.layers[0].attn, "v_proj_lora_a")
  if variant in LISTED:
    attn = back.shared_layers[0].attn
    assert hasattr(attn, "q_proj_lora_a") and not hasattr(attn, "k_proj_lora_a")


def test_presets_are_the_published_shapes():
  big = models.get_preset("gemma4_31b")
  assert round(big.num_params / 1e9, 1) == 30.7
  moe = models.get_preset("gemma4_26b_a4b")
  assert (round(moe.num_params / 1e9, 1), round(moe.num_active_params / 1e9, 1)) == (25.2, 3.8)
  edge = models.get_preset("gemma4_e2b")
  assert round((edge.num_params - 262_144 * 35 * 256) / 1e9, 1) == 2.3  # E2B's "effective"
  for name in ("gemma4_31b", "gemma4_26b_a4b", "gemma4_e2b", "gemma4_e4b"):
    written = models.hf.model_config_to_hf(models.get_preset(name))
    assert models.hf_config_to_model_config(written) == models.get_preset(name).replace(
        remat="none", scan_layers=False)


def test_refusals(saved):
  written = models.hf.model_config_to_hf(models.from_pretrained(saved["dense"][0]).cfg)
  for change, match in (
      (dict(num_kv_shared_layers=6), "kv_shared_layers=6 leaves no layer"),
      (dict(num_kv_shared_layers=4), r"the \['full'\] layers among them have no earlier "
                                     "layer of their kind"),
      (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
      (dict(hidden_activation="silu"), "hidden_activation='silu'"),
      (dict(per_layer_config={"2": {"head_dim": 16}, "5": {"head_dim": 20}}),
       "different widths"),
      (dict(per_layer_config={"0": {"head_dim": 16}}), "sliding layer 0"),
      (dict(per_layer_config={"2": {"sliding_window": 3}}),
       r"overrides \['sliding_window'\]"),
      (dict(rope_parameters={"full_attention": {"rope_type": "default"}}),
       "must hold full_attention and sliding_attention")):
    with pytest.raises(ValueError, match=match):
      models.hf_config_to_model_config({**written, **change})
  cfg = models.from_pretrained(saved["k_eq_v"][0]).cfg
  with pytest.raises(ValueError, match=r"\['global_head_dim', 'global_kv_heads', 'k_eq_v', "
                                       "'v_norm', 'layer_scale', 'proportional rope'\\] "
                                       "cannot be written as Gemma3ForCausalLM"):
    models.hf.check_exportable(cfg.replace(architecture="Gemma3ForCausalLM"))
  with pytest.raises(ValueError, match="v_norm=False cannot be written as Gemma4ForCausalLM"):
    models.hf.check_exportable(cfg.replace(v_norm=False))
  with pytest.raises(ValueError, match="layer_types needs both kinds"):
    cfg.replace(layer_types=("full_attention",) * 6)
  with pytest.raises(ValueError, match="global_kv_heads=3"):
    cfg.replace(global_kv_heads=3)
