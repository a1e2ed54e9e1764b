"""Qwen3.5 (Qwen3_5ForCausalLM, and the text model of Qwen3_5ForConditionalGeneration),
Qwen3.5-MoE and Qwen3-Next against `transformers`: three Gated DeltaNet layers to each full-attention layer, the
full layers' output gated by q_proj's second half. Logits (layer list and scanned, and
over packed sequences), gradients, greedy generation through the sampler's recurrent
state, continuous batching and resumed rows, export, LoRA, a mesh, and refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from posttrain.sampling import Sampler
from tests.models.parity import (assert_close_to_scale, check_next_turns_continue_from_their_slots,
                                 check_on_a_mesh, check_packed_rows_run_apart,
                                 check_reward_model_round_trip,
                                 check_slots_and_resume_draw_one_calls_samples, greedy_tokens,
                                 hf_logits, perturb, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

TEXT = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, max_position_embeddings=64, initializer_range=0.3,
            pad_token_id=0, bos_token_id=2, eos_token_id=1)
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(**extra):
  torch.manual_seed(0)
  cfg = transformers.Qwen3_5TextConfig(**{**TEXT, **extra})
  return perturb(transformers.Qwen3_5ForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("qwen3_5") / "model")
  hf = _hf_model()
  hf.save_pretrained(folder)
  return folder, hf


def test_config_reads_every_feature(saved):
  cfg = models.from_pretrained(saved[0]).cfg
  assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
  assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
          cfg.linear_value_head_dim, cfg.linear_conv_kernel) == (2, 4, 8, 12, 4)
  assert cfg.attn_output_gate and cfg.norm_unit_offset and cfg.qk_norm and not cfg.qkv_bias
  assert cfg.rope.partial_rotary_factor == 0.25 and cfg.rope.rotary_dim(16) == 4
  m = models.from_pretrained(saved[0])
  assert [type(b).__name__ for b in m.linear_layers] == ["Block"] * 3 and len(m.layers) == 1
  assert m.cfg.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(m)))


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, scan):
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=5e-4, rtol=0)
  assert np.abs(want).max() > 3


def test_each_part_moves_the_logits(saved):
  """The output gates (the attention's and the delta rule's), the convolution, the decay
  and the write rate each matter: zeroing one moves the logits."""
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  for part in [("layers", 0, "attn", "q_gate"), ("linear_layers", 1, "linear_attn", "z_proj"),
               ("linear_layers", 0, "linear_attn", "k_conv"),
               ("linear_layers", 2, "linear_attn", "A_log"),
               ("linear_layers", 2, "linear_attn", "b_proj")]:
    m = models.from_pretrained(folder)
    node = m
    for key in part:
      node = node[key] if isinstance(key, int) else getattr(node, key)
    node.value = jnp.zeros_like(node[...])
    assert np.abs(np.asarray(_jitted_logits(m, TOKENS)) - want).max() > 1e-3, part


def test_packed_sequences_are_run_apart(saved):
  """Two sequences packed in one row (segment ids, positions restarting) give each the
  logits it has alone: the recurrent state and the convolution restart at the seam."""
  check_packed_rows_run_apart(models.from_pretrained(saved[0]), TOKENS)


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for the delta rule's projections, taps, decay,
  norm and output, and the gated attention's."""
  folder, hf_model = saved
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  lin, hf_lin = grads["linear_layers"][1]["linear_attn"], hf_model.model.layers[1].linear_attn
  qkv = hf_lin.in_proj_qkv.weight.grad.numpy()  # rows [q (16); k (16); v (48)]
  conv = hf_lin.conv1d.weight.grad.numpy()[:, 0]  # [80, 4]
  pairs = [(np.asarray(lin["q_proj"][...]).reshape(48, 16).T, qkv[:16]),
           (np.asarray(lin["v_proj"][...]).reshape(48, 48).T, qkv[32:]),
           (np.asarray(lin["k_conv"][...]).reshape(16, 4), conv[16:32]),
           (np.asarray(lin["z_proj"][...]).reshape(48, 48).T, hf_lin.in_proj_z.weight.grad),
           (np.asarray(lin["a_proj"][...]).T, hf_lin.in_proj_a.weight.grad),
           (np.asarray(lin["b_proj"][...]).T, hf_lin.in_proj_b.weight.grad),
           (lin["A_log"][...], hf_lin.A_log.grad), (lin["dt_bias"][...], hf_lin.dt_bias.grad),
           (lin["norm"][...], hf_lin.norm.weight.grad),
           (np.asarray(lin["o_proj"][...]).reshape(48, 48).T, hf_lin.out_proj.weight.grad)]
  attn, hf_attn = grads["layers"][0]["attn"], hf_model.model.layers[3].self_attn
  q_rows = hf_attn.q_proj.weight.grad.numpy().reshape(4, 2, 16, 48)
  pairs += [(np.asarray(attn["q_proj"][...]).transpose(1, 2, 0), q_rows[:, 0]),
            (np.asarray(attn["q_gate"][...]).transpose(1, 2, 0), q_rows[:, 1])]
  for ours, theirs in pairs:
    assert_close_to_scale(ours, np.asarray(theirs), rel=2e-3)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  """Prompts of different lengths prefilled in one right-padded block (padding leaves
  the state alone), then decoded a token at a time from the recurrent state."""
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, scan)):
    assert got == want, i


def test_continuous_batching_and_resume_draw_the_same_samples(saved):
  """Rows that stop early leave their slot's state alone while the others decode (the
  slots' rows, a refilled row, a resumed row all draw what one call draws)."""
  model = models.from_pretrained(saved[0], scan_layers=True)
  check_slots_and_resume_draw_one_calls_samples(model, PROMPTS + [[7, 8, 9], [30, 31]])


@pytest.mark.parametrize("family,cls,model_type,scan", [
    ("saved", "Qwen3_5ForCausalLM", "qwen3_5_text", True),
    ("saved_moe", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", True),
    ("saved_next", "Qwen3NextForCausalLM", "qwen3_next", False)])
def test_export_round_trip_is_exact(request, family, cls, model_type, scan, tmp_path):
  """The files we write hold transformers' names (Qwen3-Next's fused projections written
  back byte for byte) and load back to the same logits and config."""
  folder, hf = request.getfixturevalue(family)
  ours = models.from_pretrained(folder, scan_layers=scan)
  models.save_pretrained(ours, str(tmp_path / "out"))
  from safetensors.numpy import load_file
  theirs, written = load_file(f"{folder}/model.safetensors"), load_file(
      tmp_path / "out" / "model.safetensors")
  assert set(written) == set(theirs)
  if family == "saved_next":
    for name in ("model.layers.0.linear_attn.in_proj_qkvz.weight",
                 "model.layers.2.linear_attn.in_proj_ba.weight"):
      np.testing.assert_array_equal(written[name], theirs[name])
  back = getattr(transformers, cls).from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["model_type"] == model_type
  assert models.hf_config_to_model_config(config) == ours.cfg.replace(scan_layers=False)
  if family == "saved_moe":
    with pytest.raises(ValueError, match="norm_topk_prob=False cannot be written"):
      check_exportable(ours.cfg.replace(norm_topk_prob=False))


def test_vision_language_checkpoint_reads_its_language_model(tmp_path):
  """Qwen3.5 is published as Qwen3_5ForConditionalGeneration: its language model is read
  alone (the vision tower left in the files), with the text model's logits."""
  torch.manual_seed(0)
  vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                out_hidden_size=48, patch_size=4, temporal_patch_size=1)
  cfg = transformers.Qwen3_5Config(text_config=TEXT, vision_config=vision)
  hf = perturb(transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval())
  hf.save_pretrained(str(tmp_path / "vl"))
  ours = models.from_pretrained(str(tmp_path / "vl"))
  assert ours.cfg.architecture == "Qwen3_5ForCausalLM"
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), hf_logits(hf, TOKENS),
                             atol=5e-4, rtol=0)


def test_reward_model_scores_match_transformers(tmp_path):
  torch.manual_seed(0)
  cfg = transformers.Qwen3_5TextConfig(**{**TEXT, "num_labels": 1})
  hf = perturb(transformers.Qwen3_5TextForSequenceClassification(cfg).float().eval())
  check_reward_model_round_trip(hf, transformers.Qwen3_5TextForSequenceClassification, tmp_path)


def _random_adapters(model, seed=0):
  """Every adapter's B drawn at random (a fresh adapter's B is zero: it changes nothing)."""
  rng = np.random.default_rng(seed)
  for _, b in nnx.iter_graph(model):
    if isinstance(b, nnx.LoRAParam) and np.all(np.asarray(b[...]) == 0):
      b.value = jnp.asarray(rng.normal(0, 0.1, b.shape), b.dtype)


def test_lora_targets_each_kind_of_layer(saved):
  """Attention targets go on the full-attention layers, Gated DeltaNet targets (by
  default all five of Qwen3.5's) on the linear ones, MLP targets on every layer; both
  layouts draw the same adapters by model layer, and merging them keeps the function."""
  folder, _ = saved
  a = models.from_pretrained(folder, lora_rank=4, seed=3)
  b = models.from_pretrained(folder, lora_rank=4, seed=3, scan_layers=True)
  assert a.cfg.lora_target_names[7:] == ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                         "in_proj_a", "out_proj")
  assert not hasattr(a.linear_layers[0], "attn")
  assert not hasattr(a.layers[0].attn, "out_proj_lora_a")
  lin = a.linear_layers[2].linear_attn
  assert lin.in_proj_qkv_lora_b.shape == (4, 2 * 2 * 8 + 4 * 12)  # [r, q; k; v columns]
  assert lin.in_proj_z_lora_b.shape == (4, 4, 12) and lin.out_proj_lora_a.shape == (4, 12, 4)
  for name in ("in_proj_qkv_lora_a", "out_proj_lora_a"):
    np.testing.assert_array_equal(np.asarray(getattr(lin, name)[...]),
                                  np.asarray(getattr(b.linear_layers.linear_attn, name)[...][2]))
  np.testing.assert_array_equal(np.asarray(a.linear_layers[2].mlp.down_proj_lora_a[...]),
                                np.asarray(b.linear_layers.mlp.down_proj_lora_a[...][2]))
  np.testing.assert_array_equal(np.asarray(a.layers[0].attn.q_proj_lora_a[...]),
                                np.asarray(b.layers.attn.q_proj_lora_a[...][0]))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(a, nnx.LoRAParam)))
  assert count == a.cfg.num_lora_params
  base = np.asarray(_jitted_logits(a, TOKENS))
  _random_adapters(a)
  want = np.asarray(_jitted_logits(a, TOKENS))
  assert np.abs(want - base).max() > 1e-2
  # Merged in float32, the sums round differently: logits of scale 5 within 2e-3.
  np.testing.assert_allclose(np.asarray(_jitted_logits(models.merge_lora(a), TOKENS)), want,
                             atol=2e-3)
  folded = models.fold_lora(a, jax.random.key(1))  # RL after SFT: fresh adapters on top
  assert np.all(np.asarray(folded.linear_layers[0].linear_attn.in_proj_qkv_lora_b[...]) == 0)
  np.testing.assert_allclose(np.asarray(_jitted_logits(folded, TOKENS)), want, atol=2e-3)
  np.testing.assert_allclose(
      np.asarray(_jitted_logits(models.relayout(a, scan_layers=True), TOKENS)), want, atol=1e-4)
  # Each Gated DeltaNet adapter reaches its projections: zeroing one moves the logits.
  for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
    one = models.relayout(a, scan_layers=False)
    node = getattr(one.linear_layers[1].linear_attn, f"{name}_lora_b")
    node.value = jnp.zeros_like(node[...])
    assert np.abs(np.asarray(_jitted_logits(one, TOKENS)) - want).max() > 1e-4, name
  # Named targets: the linear layers' alone, the full layer then has none.
  c = models.from_pretrained(folder, lora_rank=2, lora_targets="in_proj_qkv,out_proj")
  assert not [n for n in vars(c.layers[0].attn) if "lora" in n]
  assert c.cfg.num_lora_params == 3 * 2 * ((48 + 80) + (48 + 48))


def test_lora_target_names_follow_the_family(saved, saved_next):
  """Qwen3-Next's targets are its fused modules' names, Qwen3.5's its own; the other
  family's names, and Gated DeltaNet names on a model without such layers, are refused."""
  with pytest.raises(ValueError, match="not projections of Qwen3NextForCausalLM"):
    models.from_pretrained(saved_next[0], lora_rank=2, lora_targets="q_proj,in_proj_qkv")
  with pytest.raises(ValueError, match="those are in_proj_qkv,in_proj_z"):
    models.from_pretrained(saved[0], lora_rank=2, lora_targets="in_proj_qkvz")
  cfg = models.from_pretrained(saved[0]).cfg
  with pytest.raises(ValueError, match="no linear_attention layers"):
    cfg.replace(layer_types=(), lora_rank=2, lora_targets="q_proj,out_proj")
  # Qwen3-Next's default leaves the MLP names out (its PEFT files cannot hold them).
  assert models.from_pretrained(saved_next[0], lora_rank=2).cfg.lora_target_names == (
      "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj")


def test_on_a_mesh(saved):
  """The delta rule's heads (and their recurrent state) split over "tensor", the batch
  over "data": the same logits, and the sampler's greedy tokens are transformers'."""
  m = check_on_a_mesh(*saved, TOKENS, PROMPTS, atol=5e-4)
  assert m.linear_layers.linear_attn.v_proj[...].sharding.spec[2] == "tensor"


def test_configs_that_cannot_be_written_are_refused(saved):
  cfg = models.from_pretrained(saved[0]).cfg
  with pytest.raises(ValueError, match="linear_attention layers=True cannot be written"):
    check_exportable(cfg.replace(architecture="Qwen3ForCausalLM",
                                        attn_output_gate=False))
  with pytest.raises(ValueError, match="attn_output_gate=False cannot be written"):
    check_exportable(cfg.replace(attn_output_gate=False))


@pytest.mark.parametrize("change,match", [
    (dict(linear_num_key_heads=0), "set linear_num_key_heads"),
    (dict(linear_num_value_heads=3), "not a multiple of linear_num_key_heads"),
    (dict(sliding_window=8, layer_types=("linear_attention", "sliding_attention") * 2),
     "sliding_attention layers with linear_attention"),
    (dict(layer_types=("linear_attention",) * 4), "no full_attention layer"),
    (dict(linear_conv_kernel=0), "linear_conv_kernel=0"),
    (dict(layer_types=(), qk_norm=False, num_kv_heads=4, kv_lora_rank=8, qk_rope_head_dim=4,
          v_head_dim=16, rope=dict(partial_rotary_factor=0.25)),
     "attn_output_gate with multi-head latent attention"),
])
def test_bad_linear_attention_configs_are_refused(saved, change, match):
  cfg = models.from_pretrained(saved[0]).cfg
  with pytest.raises(ValueError, match=match):
    cfg.replace(**change)


def test_planner_counts_the_recurrent_state(saved):
  """The planner's cache bytes are the cache the sampler builds: a KV cache for the full
  layer, a fixed-size state for each linear one (whatever max_len)."""
  from jax.sharding import AbstractMesh

  from posttrain import planner
  cfg = models.from_pretrained(saved[0]).cfg
  mesh = AbstractMesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "sequence"))
  for max_len in (64, 256):
    built = sum(x.size * x.dtype.itemsize
                for x in jax.tree.leaves(models.init_cache(cfg, 4, max_len)))
    assert planner.kv_cache_bytes(cfg, batch=4, max_len=max_len, mesh=mesh) == built
  one_kv = planner.kv_cache_bytes(cfg, batch=4, max_len=256, mesh=mesh) - planner.kv_cache_bytes(
      cfg, batch=4, max_len=64, mesh=mesh)
  assert one_kv == 4 * 2 * 2 * 16 * (256 - 64) * 4  # k and v of the one full layer
  # An int8 cache quantises the full layer's keys and values alone.
  cache = models.init_cache(cfg.replace(scan_layers=True), 2, 16, jnp.int8)
  assert cache.full.k.dtype == jnp.int8 and cache.linear.state.dtype == jnp.float32
  assert cache.linear.q_conv.dtype == jnp.float32  # the compute dtype here


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=32)


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
  """Qwen3.5-MoE: the same layers, every MLP a mixture of 4 experts (top 2, renormalised)
  beside a gated shared expert."""
  folder = str(tmp_path_factory.mktemp("qwen3_5_moe") / "model")
  torch.manual_seed(0)
  text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
  cfg = transformers.Qwen3_5MoeTextConfig(**text, **MOE)
  hf = perturb(transformers.Qwen3_5MoeForCausalLM(cfg).float().eval())
  hf.save_pretrained(folder)
  return folder, hf


def test_moe_router_loss_spans_both_kinds_of_layer(saved_moe):
  """The load-balancing loss covers the linear layers' mixtures too: transformers' aux
  loss over every layer, in both layouts."""
  folder, hf = saved_moe
  with torch.no_grad():
    want = float(hf(torch.tensor(TOKENS), output_router_logits=True).aux_loss)
  for scan in (False, True):
    m = models.from_pretrained(folder, scan_layers=scan)
    got = float(nnx.jit(lambda m, t: m.hidden_states(t, router_loss=True)[1])(m, TOKENS))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_next_turns_continue_from_the_state_their_slot_holds(saved):
  """A transcript that extends a row just ended goes on in that row's slot from the
  state it left, the answer written in chunks of 4: the same samples as prefilling each
  turn whole."""
  check_next_turns_continue_from_their_slots(
      models.from_pretrained(saved[0], scan_layers=True),
      [[5, 9, 2, 7, 1, 3], [11, 12], list(range(20, 30)), [40, 41, 42]])


NEXT = dict(TEXT, **MOE, norm_topk_prob=False)


@pytest.fixture(scope="module")
def saved_next(tmp_path_factory):
  """Qwen3-Next: Qwen3.5-MoE's layers with the Gated DeltaNet projections fused per key
  head (in_proj_qkvz, in_proj_ba); top-k weights left unnormalised here."""
  folder = str(tmp_path_factory.mktemp("qwen3_next") / "model")
  torch.manual_seed(0)
  hf = perturb(transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**NEXT))
               .float().eval())
  hf.save_pretrained(folder)
  return folder, hf


@pytest.mark.parametrize("family,scan", [
    ("saved_moe", False), pytest.param("saved_moe", True, marks=pytest.mark.slow),
    pytest.param("saved_next", False, marks=pytest.mark.slow), ("saved_next", True)])
def test_mixture_logits_and_generation_match_transformers(request, family, scan):
  """Qwen3.5-MoE (top-k renormalised) and Qwen3-Next (here not): every layer's mixture
  of 4 experts, top 2, beside a 32-wide gated shared expert."""
  folder, hf = request.getfixturevalue(family)
  ours = models.from_pretrained(folder, scan_layers=scan)
  cfg = ours.cfg
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.ffn_dim, cfg.shared_expert_dim,
          cfg.shared_expert_gate, cfg.norm_topk_prob) == (4, 2, 24, 32, True,
                                                          family == "saved_moe")
  assert cfg.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(ours)))
  want = hf_logits(hf, TOKENS)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-3, rtol=0)
  assert np.abs(want).max() > 3
  for i, (got, want) in enumerate(greedy_tokens(folder, hf, PROMPTS, 8, scan)):
    assert got == want, i


@pytest.mark.slow  # Qwen3.5's reward model runs by default; the trunks' parity above
def test_qwen3_next_reward_model_scores_match_transformers(tmp_path):
  torch.manual_seed(0)
  cfg = transformers.Qwen3NextConfig(**{**NEXT, "num_labels": 1})
  hf = perturb(transformers.Qwen3NextForSequenceClassification(cfg).float().eval())
  check_reward_model_round_trip(hf, transformers.Qwen3NextForSequenceClassification, tmp_path)


@pytest.mark.parametrize("family,cls", [("saved", "Qwen3_5ForCausalLM"),
                                        ("saved_moe", "Qwen3_5MoeForCausalLM"),
                                        ("saved_next", "Qwen3NextForCausalLM")])
def test_peft_adapter_files_in_and_out(request, family, cls, tmp_path):
  """A LoRA model's PEFT files (every default target: the Gated DeltaNet projections too,
  Qwen3-Next's B rows regrouped per key head, a mixture's shared expert; the mixtures'
  routed experts, in the linear layers too) load in PEFT
  over transformers' model with our logits, and read back; q_proj's B is written with zero output-gate rows, and a PEFT
  q_proj adapter that moves the gate rows is refused by name."""
  peft = pytest.importorskip("peft", reason="adapter tests need peft")
  folder, _ = request.getfixturevalue(family)
  if family == "saved_next":  # PEFT puts MLP names on its fused experts: refused by name
    named = models.from_pretrained(folder, lora_rank=3, lora_targets="q_proj,up_proj")
    assert hasattr(named.layers[0].mlp.shared, "up_proj_lora_a")
    with pytest.raises(ValueError, match="PEFT puts those names on its fused routed"):
      models.save_lora_adapter(named, str(tmp_path))
  ours = models.from_pretrained(folder, lora_rank=3, lora_alpha=5.0, seed=2)
  # The mixtures' routed experts too: PEFT's target_parameters on the stacked experts.
  experts = {"saved": (), "saved_moe": ("experts_gate_up_proj", "experts_down_proj"),
             "saved_next": ("experts_down_proj",)}[family]
  if experts:
    ours = models.with_lora(ours, 3, jax.random.key(2), lora_alpha=5.0,
                            lora_targets=",".join(ours.cfg.lora_target_names + experts))
  _random_adapters(ours)
  want = np.asarray(_jitted_logits(ours, TOKENS))
  adapter = str(tmp_path / "adapter")
  models.save_lora_adapter(ours, adapter)
  with open(f"{adapter}/adapter_config.json") as fh:
    config = json.load(fh)
  assert config["target_modules"] == [t for t in ours.cfg.lora_target_names
                                      if t not in experts]
  assert config.get("target_parameters", []) == [
      "mlp.experts." + t[len("experts_"):] for t in experts]
  hf = getattr(transformers, cls).from_pretrained(folder).float().eval()
  assert np.abs(hf_logits(hf, TOKENS) - want).max() > 1e-2  # the adapters matter
  pm = peft.PeftModel.from_pretrained(hf, adapter).eval()
  np.testing.assert_allclose(hf_logits(pm, TOKENS), want, atol=1e-3, rtol=0)
  back = models.from_pretrained(folder, adapter=adapter, scan_layers=True)
  assert back.cfg.lora_target_names == ours.cfg.lora_target_names
  np.testing.assert_allclose(np.asarray(_jitted_logits(back, TOKENS)), want, atol=1e-4)
  if family == "saved_moe":
    assert hasattr(ours.layers[0].mlp.shared, "down_proj_lora_b")
  if family != "saved":
    return
  from safetensors.numpy import load_file, save_file
  tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
  name = next(k for k in tensors if "q_proj.lora_B" in k)
  tensors[name] = tensors[name] + 0.1
  save_file(tensors, str(tmp_path / "adapter" / "adapter_model.safetensors"))
  with pytest.raises(ValueError, match="changes the attention's output gate"):
    models.from_pretrained(folder, adapter=adapter)


def test_peft_target_modules_on_gated_deltanet_layers(saved, tmp_path):
  """PEFT's target_modules, read for the layers that have each module: a name on every
  linear layer is read, on some of them refused, as is a name neither kind of layer has."""
  from safetensors.numpy import save_file
  folder, _ = saved
  adapter = tmp_path / "adapter"
  adapter.mkdir()
  a, b = np.zeros((2, 48), np.float32), np.zeros((48, 2), np.float32)
  tensors = {f"base_model.model.model.layers.{i}.linear_attn.in_proj_z.lora_{x}.weight": w
             for i in range(3) for x, w in (("A", a), ("B", b))}
  tensors.update({"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight": a,
                  "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight":
                  np.zeros((128, 2), np.float32)})  # queries, then gate rows
  save_file(tensors, str(adapter / "adapter_model.safetensors"))

  def write(targets):
    with open(adapter / "adapter_config.json", "w") as fh:
      json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": targets}, fh)

  write(["q_proj", "in_proj_z"])
  m = models.from_pretrained(folder, adapter=str(adapter))
  assert m.cfg.lora_target_names == ("q_proj", "in_proj_z")
  assert not hasattr(m.linear_layers[0].linear_attn, "out_proj_lora_a")
  write(["model.layers.3.self_attn.q_proj", "model.layers.0.linear_attn.in_proj_z"])
  with pytest.raises(ValueError, match=r"wrap \['in_proj_z'\] in only some layers"):
    models.from_pretrained(folder, adapter=str(adapter))
  write(["q_proj", "in_proj_qkvz"])
  with pytest.raises(ValueError, match=r"target_modules \['in_proj_qkvz'\] are not supported"):
    models.from_pretrained(folder, adapter=str(adapter))


@pytest.mark.slow  # two samplers compiled; the cache's dtypes are checked by default
def test_an_int8_cache_quantises_the_attention_layers_alone(saved):
  """cache_dtype="int8": greedy tokens unchanged (the full layer's keys and values int8,
  the linear layers' state float32: `test_planner_counts_the_recurrent_state`)."""
  model = models.from_pretrained(saved[0], scan_layers=True)
  kwargs = dict(max_new_tokens=8, temperature=0.0)
  plain = Sampler(model, max_len=48).generate(PROMPTS, **kwargs)
  int8 = Sampler(model, max_len=48, cache_dtype="int8").generate(PROMPTS, **kwargs)
  np.testing.assert_array_equal(int8.tokens, plain.tokens)


def test_scanned_runs_of_one_kind_give_the_layer_lists_gradients():
  """A period whose linear layers come in two runs (a linear, a full, two linear, a
  full): the run of two is scanned in the period's body, indexing the kind's stack
  inside the checkpoint; loss and every layer's gradients are the layer list's."""
  cfg = models.get_preset(
      "tiny", num_layers=5, d_model=64, ffn_dim=128, num_heads=4, num_kv_heads=2,
      head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
      linear_value_head_dim=16, linear_chunk=8, attn_output_gate=True, remat="full",
      layer_types=("linear_attention", "full_attention", "linear_attention",
                   "linear_attention", "full_attention"))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 200, (2, 24)), jnp.int32)
  segments = jnp.asarray([[1] * 24, [1] * 10 + [2] * 9 + [0] * 5], jnp.int32)
  layers = models.create_model(cfg, seed=0)
  out = {}
  for scan in (False, True):
    m = models.relayout(layers, scan_layers=True) if scan else layers
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params):
      model = nnx.merge(graphdef, params, rest)
      return model.token_logprobs(tokens, tokens, segment_ids_BxT=segments).sum()

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    out[scan] = value, grads.to_pure_dict()
  np.testing.assert_allclose(float(out[True][0]), float(out[False][0]), rtol=1e-5)
  for name, count in (("linear_layers", 3), ("layers", 2)):
    for k in range(count):
      jax.tree.map(lambda s, l, k=k: np.testing.assert_allclose(
          np.asarray(s[k]), np.asarray(l), rtol=2e-3, atol=1e-5),
          out[True][1][name], out[False][1][name][k])


# About 27 s of compiling a layer list and its scan. Its gradient check runs by default
# in test_scanned_runs_of_one_kind_give_the_layer_lists_gradients.
@pytest.mark.slow
def test_scanned_backward_keeps_no_copy_of_the_weights():
  """A scanned hybrid model takes each layer's weights inside its rematerialised body:
  its backward's temporaries exceed the layer list's by less than half the weights
  (a layer's slice taken outside was a residual: a whole second copy), and the gradients
  are the layer list's."""
  import math
  cfg = models.get_preset(
      "tiny", num_layers=8, d_model=128, ffn_dim=256, num_heads=4, num_kv_heads=2,
      head_dim=32, layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 2,
      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
      linear_value_head_dim=32, linear_chunk=16, attn_output_gate=True, qk_norm=True,
      remat="full", logprob_chunk=32, tie_embeddings=False)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 200, (1, 48)), jnp.int32)
  temps, grads = {}, {}
  layers = models.create_model(cfg, seed=0)
  for scan in (False, True):
    m = models.relayout(layers, scan_layers=True) if scan else layers
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params, tokens):
      return nnx.merge(graphdef, params, rest).token_logprobs(tokens, tokens).sum()

    step = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    temps[scan] = step.memory_analysis().temp_size_in_bytes
    grads[scan] = step(params, tokens)
  weights = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
  assert temps[True] - temps[False] < weights / 2, (temps, weights)
  scanned = grads[True]["linear_layers"]["linear_attn"]["q_proj"][...][1]
  np.testing.assert_allclose(np.asarray(scanned),
                             np.asarray(grads[False]["linear_layers"][1]["linear_attn"]
                                        ["q_proj"][...]), rtol=1e-3, atol=1e-4)
