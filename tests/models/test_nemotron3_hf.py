"""Nemotron 3 (NemotronHForCausalLM with moe layers: single-sublayer layers, each a norm
and one of Mamba2, attention without a position embedding, an MLP of squared ReLU, or a
mixture of sigmoid-routed experts without a gate beside a shared expert, optionally in a
latent of their own) against `transformers`: logits in both layouts, gradients, greedy
generation, export both ways, PEFT adapters on the shared experts, the router loss and
the scanned training of a pattern of many runs, and refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from posttrain.models.transformer import ordered_layers, route
from tests.models.parity import (assert_close_to_scale, check_peft_round_trip,
                                 check_slots_and_resume_draw_one_calls_samples,
                                 greedy_tokens, hf_logits, mamba2_hf_model,
                                 randomize_correction_biases, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# Mixtures after Mamba2 and attention layers, and an MLP alone (its own width).
PATTERN = "ME*EM-E"
CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96,
              layers_block_type=[KINDS[c] for c in PATTERN],
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, mamba_num_heads=8, mamba_head_dim=16,
              n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
              time_step_min=0.01, layer_norm_epsilon=1e-5, n_routed_experts=8,
              num_experts_per_tok=3, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1,
              routed_scaling_factor=2.5, norm_topk_prob=True)
# The experts in a latent of 24 (Nemotron 3 Super's layout), no MLP layer.
LATENT = dict(CONFIG, layers_block_type=[KINDS[c] for c in "MEM*E"], moe_latent_size=24)
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(name="plain"):
  config = transformers.NemotronHConfig(**(CONFIG if name == "plain" else LATENT))
  return randomize_correction_biases(
      mamba2_hf_model(transformers.NemotronHForCausalLM, config))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
  return save_families(tmp_path_factory, ["plain", "latent"], _hf_model)


@pytest.fixture(scope="module")
def saved(families):
  return families["plain"]


def test_config_reads_the_mixtures(families):
  for name, pattern in (("plain", PATTERN), ("latent", "MEM*E")):
    folder, hf = families[name]
    m = models.from_pretrained(folder)
    cfg = m.cfg
    assert cfg.layer_types == tuple(KINDS[c] for c in pattern)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.ffn_dim, cfg.shared_expert_dim,
            cfg.router_scoring, cfg.router_groups, cfg.router_group_topk,
            cfg.routed_scaling_factor, cfg.mlp_activation) == (
                8, 3, 32, 40, "sigmoid", 2, 1, 2.5, "relu2")
    assert cfg.moe_latent_dim == (24 if name == "latent" else 0)
    assert cfg.dense_ffn_dim == (96 if "-" in pattern else 0)
    # Every parameter, and the routers' correction biases (transformers' buffers).
    counted = sum(p.numel() for p in hf.parameters()) + sum(
        b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert cfg.num_params == counted
    moe = m.moe_layers[0].mlp
    assert not hasattr(moe, "gate_proj") and not hasattr(moe.shared, "gate_proj")
    assert moe.up_proj.shape == (8, cfg.moe_latent_dim or 64, 32)
    assert not hasattr(m.moe_layers[0], "attn") and not hasattr(m.linear_layers[0], "mlp")
  mlp = models.from_pretrained(families["plain"][0]).mlp_layers[0].mlp
  assert mlp.up_proj.shape == (64, 96)  # an MLP alone: intermediate_size, not the experts'


@pytest.mark.parametrize("name", ["plain", "latent"])
@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(families, name, scan):
  folder, hf = families[name]
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=2e-4, rtol=0)
  assert np.abs(want).max() > 1


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned_remat"])
def test_gradients_match_transformers(families, scan):
  """d(sum of the targets' log-probs) for a mixture layer's router, one expert's up and
  down projections, the shared expert and the latent projections, and its norm;
  scanned, through the training scan's rematerialised layers."""
  folder, hf_model = families["latent"]
  extra = dict(scan_layers=True, remat="full") if scan else {}
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder, **extra), TOKENS)
  if scan:
    grads = {k: {j: jax.tree.map(lambda a, j=j: a[j], v)
                 for j in range(jax.tree.leaves(v)[0].shape[0])}
             if k in ("linear_layers", "layers", "moe_layers") else v
             for k, v in grads.items()}
  ours, theirs = grads["moe_layers"][1], hf_model.model.layers[4]  # the last layer, "E"
  moe, mixer = ours["mlp"], theirs.mixer
  experts = mixer.experts
  pairs = [(np.asarray(moe["router"][...]).T, mixer.gate.weight.grad),
           (np.asarray(moe["up_proj"][...]).transpose(0, 2, 1), experts.up_proj.grad),
           (np.asarray(moe["down_proj"][...]).transpose(0, 2, 1), experts.down_proj.grad),
           (np.asarray(moe["shared"]["up_proj"][...]).T, mixer.shared_experts.up_proj.weight.grad),
           (np.asarray(moe["latent_in"][...]).T, mixer.fc1_latent_proj.weight.grad),
           (np.asarray(moe["latent_out"][...]).T, mixer.fc2_latent_proj.weight.grad),
           (np.asarray(ours["input_norm"]["scale"][...]), theirs.norm.weight.grad)]
  for got, want in pairs:
    assert np.abs(np.asarray(want)).max() > 0
    assert_close_to_scale(got, np.asarray(want), rel=2e-3)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, scan)):
    assert got == want, i


def test_slots_and_resumed_rows_draw_what_one_call_draws(saved):
  """Refilled slots and resumed rows carry the recurrent states and the attention cache
  past the cacheless mixture and MLP layers, token for token (scanned)."""
  check_slots_and_resume_draw_one_calls_samples(
      models.from_pretrained(saved[0], scan_layers=True), PROMPTS)


@pytest.mark.parametrize("name", ["plain", "latent"])
def test_export_round_trip_is_exact(families, name, tmp_path):
  """Written back, the files hold the published tensors (one up_proj and down_proj per
  expert) and the config.json transformers reads as the same model."""
  folder, hf = families[name]
  ours = models.from_pretrained(folder, scan_layers=True)
  models.save_pretrained(ours, str(tmp_path / "out"))
  from safetensors.numpy import load_file
  theirs, written = load_file(f"{folder}/model.safetensors"), load_file(
      tmp_path / "out" / "model.safetensors")
  assert set(written) == set(theirs)
  for key in theirs:
    np.testing.assert_array_equal(written[key], theirs[key], err_msg=key)
  back = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["n_routed_experts"] == 8 and config["moe_shared_expert_intermediate_size"] == 40
  assert models.hf_config_to_model_config(config) == ours.cfg.replace(scan_layers=False)


def test_peft_adapters_round_trip(saved, tmp_path):
  """Adapters on the attention, the Mamba2 in_proj, the MLP's and the shared experts'
  up and down projections (under each mixture's shared_experts), ours into PEFT and
  PEFT's into ours."""
  folder, hf = saved
  check_peft_round_trip(folder, hf, _hf_model, TOKENS, tmp_path,
                        ["q_proj", "in_proj", "up_proj", "down_proj"])
  lora = models.from_pretrained(folder, lora_rank=2, scan_layers=True)
  counted = sum(v.size for _, v in nnx.iter_graph(lora) if isinstance(v, nnx.LoRAParam))
  assert counted == lora.cfg.num_lora_params
  shared = lora.moe_layers.mlp.shared
  assert shared.up_proj_lora_b.shape == (3, 2, 40)  # the shared expert's width, per layer
  assert lora.mlp_layers.mlp.up_proj_lora_b.shape == (1, 2, 96)


@pytest.mark.parametrize("name", ["plain", "latent"])
def test_peft_adapters_on_the_routed_experts_round_trip(families, name, tmp_path):
  """Adapters on every expert's up_proj and down_proj (PEFT's target_parameters
  mixer.experts.up_proj / down_proj; in a latent of 24, its width), beside the
  attention's: ours into PEFT, PEFT's into ours, and merged into the published
  tensors."""
  folder, hf = families[name]
  experts = ["mixer.experts.up_proj", "mixer.experts.down_proj"]
  ours, back = check_peft_round_trip(folder, hf, lambda: _hf_model(name), TOKENS, tmp_path,
                                     ["q_proj"], target_parameters=experts)
  config = json.loads((ours / "adapter_config.json").read_text())
  assert config["target_parameters"] == experts and config["target_modules"] == ["q_proj"]
  assert back.cfg.lora_target_names == ("q_proj", "experts_up_proj", "experts_down_proj")
  width = 24 if name == "latent" else 64
  assert back.moe_layers[0].mlp.experts_up_proj_lora_a.shape == (8, 2, width)
  assert back.moe_layers[0].mlp.experts_down_proj_lora_b.shape == (8, 2, width)
  models.save_pretrained(models.merge_lora(back), str(tmp_path / "merged"))
  merged = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path / "merged"))
  np.testing.assert_allclose(hf_logits(merged.float().eval(), TOKENS),
                             np.asarray(_jitted_logits(back, TOKENS)), atol=1e-4)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_router_loss_counts_the_mixture_layers(saved, scan):
  """The load-balancing loss pools the mixture layers' routing alone: each layer's
  share is what its own router gives its input (from transformers' hidden states), and
  both layouts agree."""
  folder, hf = saved
  ours = models.from_pretrained(folder, scan_layers=scan)
  segments = np.ones_like(TOKENS)
  segments[1, 15:] = 0
  _, loss = nnx.jit(lambda m, t, s: m.hidden_states(t, segment_ids_BxT=s, router_loss=True))(
      ours, TOKENS, segments)
  with torch.no_grad():
    out = hf(torch.tensor(TOKENS), output_hidden_states=True)
  stats = []
  plain = models.from_pretrained(folder)
  keep = segments.reshape(-1) > 0
  for i, kind in enumerate(PATTERN):
    if kind != "E":
      continue
    x = out.hidden_states[i].numpy().reshape(-1, 64)
    layer = plain.moe_layers[sum(c == "E" for c in PATTERN[:i])]
    normed = np.asarray(layer.input_norm(jnp.asarray(x)))
    w, e, probs = route(
        jnp.asarray(normed), layer.mlp.router[...], 3, True, return_probs=True,
        scoring="sigmoid", correction_E=layer.mlp.score_correction_bias[...], groups=2,
        group_topk=1, scale=2.5)
    stats.append((np.eye(8)[np.asarray(e)][keep].sum((0, 1)), np.asarray(probs)[keep].sum(0)))
  assigned, probs = (sum(s[j] for s in stats) for j in (0, 1))
  n = 3 * keep.sum()
  want = 8 * np.sum((assigned / n) * (probs / n))
  np.testing.assert_allclose(float(loss), want, rtol=1e-4)


@pytest.mark.parametrize("aux", [0.0, 0.01], ids=["ordered", "router_loss"])
def test_a_pattern_of_many_runs_trains_as_its_layers_do(aux):
  """A pattern of more than eight runs with mixtures (as Nemotron 3 Nano's): scanned
  under full remat its single layers rebuild in order, the mixtures too unless the step
  takes their router statistics; the loss (with the router loss) and every kind's
  gradients are the unscanned model's."""
  pattern = "ME*EM-EM*EME"
  cfg = models.ModelConfig(
      vocab_size=64, d_model=32, num_layers=len(pattern), num_heads=4, num_kv_heads=2,
      head_dim=8, ffn_dim=16, dense_ffn_dim=40, layer_types=tuple(KINDS[c] for c in pattern),
      rope_layers=(0,) * len(pattern), mlp_activation="relu2", linear_mixer="mamba2",
      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
      linear_value_head_dim=16, linear_conv_bias=True, linear_chunk=4, num_experts=8,
      num_experts_per_tok=2, router_scoring="sigmoid", shared_expert_dim=24,
      moe_latent_dim=16, router_aux_loss_coef=aux, remat="full", init_std=0.2)
  ordered = ordered_layers(cfg.replace(scan_layers=True))
  assert ("moe" in ordered) == (aux == 0.0) and ordered["linear"] == 4
  layers = models.create_model(cfg, seed=0)
  scanned = models.relayout(layers, scan_layers=True)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 12))

  def loss(model):
    h, router = model.hidden_states(tokens, router_loss=True)
    logits = jnp.einsum("BTD,DV->BTV", h, model.unembed())
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0]) + aux * router

  (want, theirs), (got, ours) = (jax.jit(nnx.value_and_grad(loss))(m) for m in (layers, scanned))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for stack, path in (("linear_layers", ("linear_attn", "v_proj")), ("layers", ("attn", "q_proj")),
                      ("mlp_layers", ("mlp", "up_proj")), ("moe_layers", ("mlp", "router")),
                      ("moe_layers", ("mlp", "up_proj")), ("moe_layers", ("mlp", "latent_in")),
                      ("moe_layers", ("input_norm", "scale"))):
    for j in range(len(theirs[stack])):
      a, b = theirs[stack][j], ours[stack]
      for k in path:
        a, b = a[k], b[k]
      np.testing.assert_allclose(np.asarray(b[...])[j], np.asarray(a[...]),
                                 atol=1e-5 * np.abs(np.asarray(a[...])).max())


def test_what_nemotron3_refuses(saved):
  folder, _ = saved
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="layer_types has moe layers: set num_experts"):
    cfg.replace(num_experts=0, num_experts_per_tok=0, shared_expert_dim=0,
                router_scoring="softmax", router_groups=1, routed_scaling_factor=1.0,
                dense_ffn_dim=0)
  with pytest.raises(ValueError, match="layer_types with mlp and moe layers and "
                                       "dense_ffn_dim=0"):
    cfg.replace(dense_ffn_dim=0)
  with pytest.raises(ValueError, match="experts have no gate .*; use experts_up_proj"):
    cfg.replace(lora_rank=2, lora_targets="q_proj,experts_gate_up_proj,experts_down_proj")
  with pytest.raises(ValueError, match="expert_bias with mlp_activation='relu2'"):
    cfg.replace(expert_bias=True)
  with pytest.raises(ValueError, match="moe_latent_dim must be an int >= 0"):
    cfg.replace(moe_latent_dim=-1)
  with pytest.raises(ValueError, match="shared_expert_dim=0 cannot be written"):
    check_exportable(cfg.replace(shared_expert_dim=0))
  with pytest.raises(ValueError, match="router_scoring='softmax' cannot be written as "
                                       "NemotronHForCausalLM"):
    check_exportable(cfg.replace(router_scoring="softmax", router_groups=1,
                                 routed_scaling_factor=1.0))
