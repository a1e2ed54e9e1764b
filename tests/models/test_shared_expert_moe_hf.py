"""Mixtures with shared experts and leading dense layers against `transformers`:
Qwen2-MoE (softmax routing, a shared expert scaled by sigmoid(x . w)) and GLM-4.5
(Glm4MoeForCausalLM: sigmoid routing with a score-correction bias, expert groups and a
routed scaling factor, shared experts, the first layers dense, half of each head
rotated). Logits (layer list and scanned), gradients, greedy generation, export, the
multi-token-prediction layers left unread, the router against numpy, and the parts a
train step must leave alone."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.transformer import route
from tests.models.parity import (assert_close_to_scale, check_reward_model_round_trip,
                                 greedy_tokens, hf_logits, perturb,
                                 randomize_correction_biases, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              num_experts_per_tok=3, moe_intermediate_size=24)
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(name, cls=None, **extra):
  """qwen2_moe: 8 experts, a 32-wide gated shared expert, layer 0 dense. glm4_moe: 8
  experts in 4 groups of which 2 are searched, scaling 2.5, two shared experts, layer 0
  dense, q/k norms (glm4_moe_plain: no q/k norms, one group, norm_topk_prob off)."""
  if name == "qwen2_moe":
    cfg = transformers.Qwen2MoeConfig(**{**COMMON, **dict(
        num_experts=8, shared_expert_intermediate_size=32, mlp_only_layers=[0],
        norm_topk_prob=False), **extra})
    cls = cls or "Qwen2MoeForCausalLM"
  else:
    plain = name == "glm4_moe_plain"
    cfg = transformers.Glm4MoeConfig(**{**COMMON, **dict(
        head_dim=16, n_routed_experts=8, n_shared_experts=2, n_group=1 if plain else 4,
        topk_group=1 if plain else 2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        use_qk_norm=not plain, norm_topk_prob=not plain, attention_bias=True), **extra})
    cls = cls or "Glm4MoeForCausalLM"
  torch.manual_seed(0)
  return randomize_correction_biases(perturb(getattr(transformers, cls)(cfg).float().eval()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """family -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, ["qwen2_moe", "glm4_moe", "glm4_moe_plain"],
                       _hf_model)


def test_configs_read_every_feature(saved):
  qwen = models.from_pretrained(saved["qwen2_moe"][0]).cfg
  assert (qwen.num_experts, qwen.shared_expert_dim, qwen.shared_expert_gate, qwen.qkv_bias,
          qwen.norm_topk_prob, qwen.dense_layers, qwen.dense_ffn_dim, qwen.ffn_dim) == (
              8, 32, True, True, False, 1, 80, 24)
  assert qwen.router_scoring == "softmax" and not qwen.attn_out_bias
  glm = models.from_pretrained(saved["glm4_moe"][0]).cfg
  assert (glm.router_scoring, glm.router_groups, glm.router_group_topk,
          glm.routed_scaling_factor, glm.shared_expert_dim, glm.shared_expert_gate,
          glm.dense_layers, glm.dense_ffn_dim, glm.qk_norm, glm.qkv_bias) == (
              "sigmoid", 4, 2, 2.5, 48, False, 1, 80, True, True)
  assert glm.rope.partial_rotary_factor == 0.5 and not glm.attn_out_bias
  plain = models.from_pretrained(saved["glm4_moe_plain"][0]).cfg
  assert (plain.qk_norm, plain.router_groups, plain.norm_topk_prob) == (False, 1, False)


def test_parameters_sit_in_dense_layers_then_layers(saved):
  m = models.from_pretrained(saved["glm4_moe"][0])
  assert len(m.dense_layers) == 1 and len(m.layers) == 2
  assert m.dense_layers[0].mlp.gate_proj.shape == (48, 80)
  assert m.layers[0].mlp.gate_proj.shape == (8, 48, 24)
  assert m.layers[0].mlp.shared.gate_proj.shape == (48, 48)
  hf = saved["glm4_moe"][1]
  np.testing.assert_array_equal(np.asarray(m.layers[1].mlp.score_correction_bias[...]),
                                hf.model.layers[2].mlp.gate.e_score_correction_bias.numpy())
  assert m.cfg.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(m)))


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe", "glm4_moe_plain"])
@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, family, scan):
  folder, hf = saved[family]
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe"])
def test_each_part_moves_the_logits(saved, family):
  """The shared expert, its gate, the correction bias and the dense layer each matter:
  zeroing one moves the logits (so the parity above is not blind to it)."""
  folder, hf = saved[family]
  want = hf_logits(hf, TOKENS)
  parts = [("layers", 0, "mlp", "shared", "down_proj"), ("dense_layers", 0, "mlp", "up_proj")]
  parts.append(("layers", 0, "mlp", "shared_gate") if family == "qwen2_moe" else
               ("layers", 1, "mlp", "score_correction_bias"))
  for part in parts:
    m = models.from_pretrained(folder)
    node = m
    for key in part:
      node = node[key] if isinstance(key, int) else getattr(node, key)
    node.value = jnp.zeros_like(node[...]) + (0.5 if part[-1] == "shared_gate" else 0.0)
    assert np.abs(np.asarray(_jitted_logits(m, TOKENS)) - want).max() > 1e-3, part


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe"])
def test_gradients_match_transformers(saved, family):
  """d(sum of the targets' log-probs) for the router (through the chosen experts'
  scores), the experts, the shared expert (and its gate), the dense layer's MLP and the
  attention; the correction bias gets none."""
  folder, hf_model = saved[family]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  dense, hf_dense = grads["dense_layers"][0], hf_model.model.layers[0]
  pairs = [(np.asarray(dense["mlp"]["down_proj"][...]).T, hf_dense.mlp.down_proj.weight.grad),
           (np.asarray(dense["attn"]["q_proj"][...]).reshape(48, -1).T,
            hf_dense.self_attn.q_proj.weight.grad)]
  shared_name = "shared_expert" if family == "qwen2_moe" else "shared_experts"
  for j in range(2):
    layer, hf = grads["layers"][j], hf_model.model.layers[j + 1]
    experts = hf.mlp.experts
    gate_up = experts.gate_up_proj.grad.numpy()  # [E, 2F, D]
    pairs += [(np.asarray(layer["mlp"]["router"][...]).T, hf.mlp.gate.weight.grad),
              (np.asarray(layer["mlp"]["gate_proj"][...]).transpose(0, 2, 1), gate_up[:, :24]),
              (np.asarray(layer["mlp"]["down_proj"][...]).transpose(0, 2, 1),
               experts.down_proj.grad),
              (np.asarray(layer["mlp"]["shared"]["up_proj"][...]).T,
               getattr(hf.mlp, shared_name).up_proj.weight.grad)]
    if family == "qwen2_moe":
      pairs.append((layer["mlp"]["shared_gate"][...], hf.mlp.shared_expert_gate.weight.grad[0]))
    else:
      assert not np.any(np.asarray(layer["mlp"]["score_correction_bias"][...]))
  for ours, theirs in pairs:
    assert_close_to_scale(ours, np.asarray(theirs))


@pytest.mark.parametrize("family,scan", [("qwen2_moe", False), ("glm4_moe", True)])
def test_greedy_generation_matches_transformers(saved, family, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[family], PROMPTS, 10, scan)):
    assert got == want, i


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe"])
def test_export_round_trip_is_exact(saved, family, tmp_path):
  """The files we write hold the names transformers wrote (per expert, the shared
  expert's, the correction bias) and load back to the same logits and config."""
  folder, hf = saved[family]
  ours = models.from_pretrained(folder, scan_layers=family == "glm4_moe")
  models.save_pretrained(ours, str(tmp_path / "out"))
  from safetensors.numpy import load_file
  assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(
      load_file(f"{folder}/model.safetensors"))
  back = getattr(transformers, type(hf).__name__).from_pretrained(
      str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["model_type"] == family
  assert models.hf_config_to_model_config(written) == ours.cfg.replace(scan_layers=False)


def test_prediction_layers_in_the_files_are_not_read(saved, tmp_path):
  """GLM-4.5's published files hold a multi-token-prediction layer after the last one
  (model.layers.<num_hidden_layers>.*): left unread. Any other stray tensor is refused."""
  import shutil

  from safetensors.numpy import load_file, save_file
  folder, hf = saved["glm4_moe"]
  shutil.copytree(folder, tmp_path / "mtp")
  tensors = load_file(tmp_path / "mtp" / "model.safetensors")
  tensors["model.layers.3.eh_proj.weight"] = np.ones((48, 96), np.float32)
  tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = np.ones((24, 48), np.float32)
  save_file(tensors, tmp_path / "mtp" / "model.safetensors")
  config = json.loads((tmp_path / "mtp" / "config.json").read_text())
  config["num_nextn_predict_layers"] = 1
  (tmp_path / "mtp" / "config.json").write_text(json.dumps(config))
  got = _jitted_logits(models.from_pretrained(str(tmp_path / "mtp")), TOKENS)
  np.testing.assert_allclose(np.asarray(got), hf_logits(hf, TOKENS), atol=1e-4, rtol=0)
  tensors["model.layers.4.eh_proj.weight"] = np.ones((48, 96), np.float32)
  save_file(tensors, tmp_path / "mtp" / "model.safetensors")
  with pytest.raises(ValueError, match="has unexpected tensors.*model.layers.4.eh_proj"):
    models.from_pretrained(str(tmp_path / "mtp"))


def test_reward_model_scores_match_transformers(tmp_path):
  hf = _hf_model("qwen2_moe", cls="Qwen2MoeForSequenceClassification", num_labels=1)
  check_reward_model_round_trip(hf, transformers.Qwen2MoeForSequenceClassification, tmp_path)


def test_glm4_moe_reward_model_is_not_written(saved):
  """transformers has no Glm4MoeForSequenceClassification: a reward model on GLM-4.5 trains
  but its export is refused by name."""
  cfg = models.from_pretrained(saved["glm4_moe"][0]).cfg
  with pytest.raises(ValueError, match="Glm4MoeForSequenceClassification'? cannot be "
                                       "written"):
    models.hf.check_exportable(cfg.replace(architecture="Glm4MoeForSequenceClassification",
                                           lm_head=False, value_head=True))


def _numpy_sigmoid_route(x, w, correction, k, groups, group_topk, normalize, scale):
  """DeepSeek-V3's / GLM-4.5's router, one token at a time, in float64."""
  scores = 1.0 / (1.0 + np.exp(-(x @ w)))
  out_w, out_e = [], []
  for s in scores:
    choice = s + correction
    per = len(s) // groups
    group_scores = [np.sort(choice[g * per:(g + 1) * per])[-2:].sum() for g in range(groups)]
    keep = np.argsort(group_scores)[::-1][:group_topk]
    masked = np.full_like(choice, -np.inf)
    for g in keep:
      masked[g * per:(g + 1) * per] = choice[g * per:(g + 1) * per]
    experts = np.argsort(masked)[::-1][:k]
    weights = s[experts]
    if normalize:
      weights = weights / weights.sum()
    out_w.append(weights * scale)
    out_e.append(experts)
  return np.array(out_w), np.array(out_e)


@pytest.mark.parametrize("groups,group_topk,normalize", [(1, 1, True), (4, 2, True),
                                                         (8, 3, False)])
def test_sigmoid_routing_matches_numpy(groups, group_topk, normalize):
  rng = np.random.default_rng(1)
  x, w = rng.normal(size=(64, 16)), rng.normal(size=(16, 16)) * 0.5
  correction = rng.normal(size=16) * 0.3
  weights, experts = route(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 4,
                           normalize, scoring="sigmoid",
                           correction_E=jnp.asarray(correction, jnp.float32), groups=groups,
                           group_topk=group_topk, scale=2.5)
  want_w, want_e = _numpy_sigmoid_route(x, w, correction, 4, groups, group_topk, normalize, 2.5)
  order = np.argsort(np.asarray(experts), axis=1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                np.sort(want_e, axis=1))
  np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                             np.take_along_axis(want_w, np.argsort(want_e, axis=1), 1),
                             rtol=1e-5)
  if groups > 1:  # every chosen expert lies in one of the group_topk chosen groups
    assert all(len(set(e // (16 // groups))) <= group_topk for e in np.asarray(experts))


def test_a_train_step_leaves_the_correction_bias_alone(saved):
  """The correction bias takes no gradient and no weight decay: an AdamW step with
  decay changes the router and not the bias; the load-balancing loss counts the mixture
  layers alone (the dense layer has no router)."""
  import optax

  from posttrain.rl.state import make_optimizer
  m = models.from_pretrained(saved["glm4_moe"][0], scan_layers=True)
  graphdef, state = nnx.split(m)

  def loss(state):
    h, aux = nnx.merge(graphdef, state).hidden_states(jnp.asarray(TOKENS), router_loss=True)
    return jnp.mean(h ** 2) + aux

  grads = jax.jit(jax.grad(loss))(state)
  assert not np.any(np.asarray(grads["layers"]["mlp"]["score_correction_bias"][...]))
  opt = make_optimizer(1e-2, warmup=0, total_steps=10, weight_decay=0.1)
  new = jax.jit(lambda g, s: optax.apply_updates(s, opt.update(g, opt.init(s), s)[0]))(
      grads, state)
  np.testing.assert_array_equal(np.asarray(new["layers"]["mlp"]["score_correction_bias"][...]),
                                np.asarray(state["layers"]["mlp"]["score_correction_bias"][...]))
  assert np.abs(np.asarray(new["layers"]["mlp"]["router"][...])
                - np.asarray(state["layers"]["mlp"]["router"][...])).max() > 1e-4
  _, aux = nnx.jit(lambda m, t: m.hidden_states(t, router_loss=True))(m, jnp.asarray(TOKENS))
  assert 1.0 < float(aux) < 8.0  # E * sum(f * P) over the two mixture layers' tokens


def test_lora_and_relayout_span_both_stacks(saved, tmp_path):
  """Adapters go on the dense layers' attention too; the list and scanned layouts hold
  the same draws (by model layer), and relayout carries both stacks."""
  folder, _ = saved["qwen2_moe"]
  a = models.from_pretrained(folder, lora_rank=4, seed=3)
  b = models.from_pretrained(folder, lora_rank=4, seed=3, scan_layers=True)
  np.testing.assert_array_equal(np.asarray(a.dense_layers[0].attn.q_proj_lora_a[...]),
                                np.asarray(b.dense_layers.attn.q_proj_lora_a[...][0]))
  np.testing.assert_array_equal(np.asarray(a.layers[1].attn.v_proj_lora_a[...]),
                                np.asarray(b.layers.attn.v_proj_lora_a[...][1]))
  # A trained adapter (B nonzero) on the dense layer, in both layouts.
  a.dense_layers[0].attn.q_proj_lora_b.value = a.dense_layers[0].attn.q_proj_lora_b[...] + 0.5
  b.dense_layers.attn.q_proj_lora_b.value = b.dense_layers.attn.q_proj_lora_b[...] + 0.5
  want = np.asarray(_jitted_logits(a, TOKENS))
  np.testing.assert_allclose(np.asarray(_jitted_logits(b, TOKENS)), want, atol=1e-4)
  np.testing.assert_allclose(
      np.asarray(_jitted_logits(models.relayout(a, scan_layers=True), TOKENS)), want, atol=1e-4)
  merged = models.merge_lora(b)
  np.testing.assert_allclose(np.asarray(_jitted_logits(merged, TOKENS)), want, atol=1e-4)
  models.save_lora_adapter(a, str(tmp_path / "adapter"))
  back = models.from_pretrained(folder, adapter=str(tmp_path / "adapter"))
  np.testing.assert_allclose(np.asarray(_jitted_logits(back, TOKENS)), want, atol=1e-4)


def test_on_a_mesh(saved):
  """Experts' F split over "tensor", the shared expert and dense layer split like a dense
  MLP: the same logits as transformers."""
  folder, hf = saved["glm4_moe"]
  mesh = models.make_mesh((1, 2, 2, 1), devices=jax.devices()[:4])
  m = models.from_pretrained(folder, mesh=mesh, scan_layers=True)
  got = jax.jit(lambda t: m(t, ctx=models.ShardingContext(mesh)))(TOKENS)
  np.testing.assert_allclose(np.asarray(got), hf_logits(hf, TOKENS), atol=1e-4, rtol=0)


def test_configs_that_cannot_be_written_are_refused(saved):
  glm = models.from_pretrained(saved["glm4_moe"][0]).cfg
  qwen = models.from_pretrained(saved["qwen2_moe"][0]).cfg
  cases = [
      (glm.replace(architecture="Qwen3MoeForCausalLM", qk_norm=True, shared_expert_dim=0,
                   qkv_bias=False,
                   rope=models.RopeConfig()),
       "router_scoring='sigmoid' cannot be written as Qwen3MoeForCausalLM"),
      (qwen.replace(architecture="MixtralForCausalLM", qkv_bias=False, norm_topk_prob=True),
       "shared_expert_gate=True cannot be written as MixtralForCausalLM"),
      (qwen.replace(shared_expert_gate=False), "shared_expert_gate=False cannot be written"),
      (glm.replace(shared_expert_dim=30), "shared_expert_dim=30 cannot be written"),
  ]
  for cfg, match in cases:
    with pytest.raises(ValueError, match=match):
      models.hf.check_exportable(cfg)


@pytest.mark.parametrize("change,match", [
    (dict(shared_expert_dim=8, num_experts=0, num_experts_per_tok=0),
     "shared_expert_dim describe a mixture"),
    (dict(router_groups=8, router_group_topk=2), "the chosen groups >= num_experts_per_tok"),
    (dict(router_scoring="sigmoid", router_groups=3), "router_groups=3 must divide"),
    (dict(router_scoring="sigmoid", router_groups=4, router_group_topk=1),
     "the chosen groups >= num_experts_per_tok"),
    (dict(router_scoring="softmax_topk"), "router_scoring='softmax_topk'"),
    (dict(shared_expert_gate=True), "shared_expert_gate=True needs a shared expert"),
    (dict(dense_layers=2, dense_ffn_dim=8), "leaves no mixture layer"),
    (dict(dense_layers=1), "set both"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be a positive number"),
])
def test_bad_mixture_configs_are_refused(change, match):
  base = dict(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
              head_dim=8, ffn_dim=8, num_experts=8, num_experts_per_tok=3)
  with pytest.raises(ValueError, match=match):
    models.ModelConfig(**{**base, **change})


def test_lora_adapts_the_dense_mlps_and_shared_experts_as_peft_does(saved, tmp_path):
  """MLP targets on a mixture wrap the MLPs it has as modules (the dense layer's, each
  layer's shared expert), never the routed experts: Qwen2-MoE's PEFT files load in PEFT
  over transformers' model with our logits and read back. GLM-4.5 takes them only named
  (by default its adapters are attention's), and its PEFT files with them are refused by
  name (PEFT puts those names on its fused experts)."""
  peft = pytest.importorskip("peft", reason="adapter tests need peft")
  from tests.models.test_qwen3_5_hf import _random_adapters
  folder, _ = saved["qwen2_moe"]
  ours = models.from_pretrained(folder, lora_rank=3, lora_alpha=5.0, seed=2)
  assert ours.cfg.lora_target_names[4:] == ("gate_proj", "up_proj", "down_proj")
  assert hasattr(ours.dense_layers[0].mlp, "up_proj_lora_a")
  assert hasattr(ours.layers[0].mlp.shared, "up_proj_lora_a")
  assert not [n for n in vars(ours.layers[0].mlp) if "lora" in n]  # the experts: none
  assert ours.cfg.num_lora_params == sum(
      x.size for x in jax.tree.leaves(nnx.state(ours, nnx.LoRAParam)))
  _random_adapters(ours)
  want = np.asarray(_jitted_logits(ours, TOKENS))
  np.testing.assert_allclose(np.asarray(_jitted_logits(models.merge_lora(ours), TOKENS)),
                             want, atol=1e-4)
  models.save_lora_adapter(ours, str(tmp_path / "adapter"))
  hf = transformers.Qwen2MoeForCausalLM.from_pretrained(folder).float().eval()
  assert np.abs(hf_logits(hf, TOKENS) - want).max() > 1e-2
  pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
  np.testing.assert_allclose(hf_logits(pm, TOKENS), want, atol=1e-4, rtol=0)
  back = models.from_pretrained(folder, adapter=str(tmp_path / "adapter"), scan_layers=True)
  np.testing.assert_allclose(np.asarray(_jitted_logits(back, TOKENS)), want, atol=1e-4)
  glm = models.from_pretrained(saved["glm4_moe"][0], lora_rank=2)
  assert glm.cfg.lora_target_names == ("q_proj", "k_proj", "v_proj", "o_proj")  # default
  models.save_lora_adapter(glm, str(tmp_path / "glm"))
  glm = models.from_pretrained(saved["glm4_moe"][0], lora_rank=2,
                               lora_targets="q_proj,gate_proj,up_proj,down_proj")
  assert hasattr(glm.dense_layers[0].mlp, "up_proj_lora_a")
  with pytest.raises(ValueError, match="PEFT puts those names on its fused routed experts"):
    models.save_lora_adapter(glm, str(tmp_path / "glm2"))
