"""Jamba (JambaForCausalLM: Mamba 1 layers with weighted norms on dt, B and C, attention
without a position embedding every attn_layer_period-th layer, and a mixture of experts in
place of the MLP every expert_layer_period-th layer) against `transformers`: logits in
both layouts, gradients, greedy generation, export both ways, the reward model, PEFT
adapters and refusals."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from tests.models.parity import (assert_close_to_scale, check_export_files,
                                 check_export_round_trip, check_on_a_mesh,
                                 check_peft_round_trip,
                                 check_reward_model_round_trip,
                                 check_slots_and_resume_draw_one_calls_samples,
                                 greedy_tokens, hf_logits, perturb, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

# Layers: Mamba, Mamba + experts, attention, Mamba + experts.
CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, num_experts=4,
              num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
              attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_dt_rank=4,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(cls=None, **changes):
  """A fresh transformers Jamba (seed 0, float32, eval), its norms (dt, B and C's too)
  and biases moved off their initial values and its A (per channel and state) and D
  drawn."""
  torch.manual_seed(0)
  cls = cls or transformers.JambaForCausalLM
  model = perturb(cls(transformers.JambaConfig(**{**CONFIG, **changes})).float().eval())
  with torch.no_grad():
    for layer in model.model.layers:
      if hasattr(layer, "mamba"):
        layer.mamba.A_log.uniform_(-1.0, 1.5)
        layer.mamba.D.normal_(1.0, 0.5)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, ["jamba"], lambda _: _hf_model())["jamba"]


def test_config_reads_the_pattern(saved):
  m = models.from_pretrained(saved[0])
  cfg = m.cfg
  assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention",
                             "linear_attention")
  assert cfg.mixture_flags == (False, True, False, True) and cfg.moe_layer_step == 2
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.ffn_dim,
          cfg.dense_ffn_dim) == (4, 2, False, 48, 48)
  assert cfg.rope_layers == (0,) * 4 and not cfg.split_layers
  assert (cfg.linear_mixer, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
          cfg.linear_dt_rank, cfg.linear_bcdt_norm, cfg.linear_bcdt_norm_eps) == (
      "mamba1", 64, 8, 4, "weighted", 1e-6)
  assert cfg.num_params == sum(p.numel() for p in saved[1].parameters())


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, scan):
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=3e-4, rtol=0)
  assert np.abs(want).max() > 1


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for a Mamba layer's in_proj and dt norm, the
  attention's q_proj, a mixture's router and one expert's down_proj, a dense MLP's
  up_proj, each through the scanned layers under full remat."""
  folder, hf_model = saved
  grads = target_logprob_grads(
      hf_model, models.from_pretrained(folder, scan_layers=True, remat="full"), TOKENS)
  layers = hf_model.model.layers
  mixture = jax.tree.map(lambda a: a[0], grads["linear_layers"])  # layer 1 (experts)
  dense = jax.tree.map(lambda a: a[0], grads["linear_dense_layers"])  # layer 0
  attn = jax.tree.map(lambda a: a[0], grads["dense_layers"])  # layer 2
  mamba = mixture["linear_attn"]
  experts = layers[1].feed_forward.experts
  pairs = [(np.asarray(mamba["v_proj"][...]).reshape(32, 64).T,
            layers[1].mamba.in_proj.weight.grad[:64]),
           (np.asarray(mamba["dt_norm"][...]), layers[1].mamba.dt_layernorm.weight.grad),
           (np.asarray(mixture["mlp"]["router"][...]).T,
            layers[1].feed_forward.router.weight.grad),
           (np.asarray(mixture["mlp"]["down_proj"][...])[3].T, experts.down_proj.grad[3]),
           (np.asarray(dense["mlp"]["up_proj"][...]).T, layers[0].feed_forward.up_proj.weight.grad),
           (np.asarray(attn["attn"]["q_proj"][...]).reshape(32, -1).T,
            layers[2].self_attn.q_proj.weight.grad)]
  for ours, want in pairs:
    assert_close_to_scale(ours, np.asarray(want), rel=2e-3)


def test_greedy_generation_matches_transformers(saved):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, False)):
    assert got == want, i


def test_export_round_trip_is_exact(saved, tmp_path):
  """Written from either layout: the folder's tensors bit for bit, a config.json that
  reads back the same and that transformers loads to the same logits."""
  folder, hf = saved
  config = check_export_round_trip(folder, hf, transformers.JambaForCausalLM, TOKENS,
                                   tmp_path / "out")
  check_export_files(folder, models.from_pretrained(folder, scan_layers=True),
                     tmp_path / "scanned")
  period, offset = config["attn_layer_period"], config["attn_layer_offset"]
  assert [i for i in range(4) if i % period == offset] == [2]  # 3, 2: the first that fits
  assert (config["expert_layer_period"], config["expert_layer_offset"]) == (2, 1)
  assert "rope_theta" not in config and config["model_type"] == "jamba"


def test_reward_model_round_trips(tmp_path):
  check_reward_model_round_trip(
      _hf_model(transformers.JambaForSequenceClassification, num_labels=1),
      transformers.JambaForSequenceClassification, tmp_path)


def test_what_jamba_refuses(saved):
  folder, _ = saved
  config = json.loads(open(f"{folder}/config.json").read())
  with pytest.raises(ValueError, match="expert_layer_offset=0 with expert_layer_period=2"):
    models.hf_config_to_model_config({**config, "expert_layer_offset": 0})
  with pytest.raises(ValueError, match="mamba_proj_bias=true"):
    models.hf_config_to_model_config({**config, "mamba_proj_bias": True})
  dense = models.hf_config_to_model_config({**config, "num_experts": 1})
  assert not dense.num_experts and dense.ffn_dim == 48
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="cannot be written as JambaForCausalLM, whose "
                                       "attention layers are every"):
    check_exportable(cfg.replace(layer_types=("full_attention", "linear_attention",
                                              "full_attention", "full_attention")))
  with pytest.raises(ValueError, match="linear_bcdt_norm='weightless'"):
    check_exportable(cfg.replace(linear_bcdt_norm="weightless"))
  with pytest.raises(ValueError, match="norm_topk_prob=True cannot be written"):
    check_exportable(cfg.replace(norm_topk_prob=True))
  with pytest.raises(ValueError, match="head_dim=16 cannot be written as JambaForCausalLM"):
    check_exportable(cfg.replace(head_dim=16))
  with pytest.raises(ValueError, match="rope_layers=.* whose attention has no position"):
    check_exportable(cfg.replace(rope_layers=()))


def test_peft_adapters_round_trip(saved, tmp_path):
  """Adapters on the attention, the Mamba layers' in_proj and the dense MLPs' down_proj,
  ours into PEFT and PEFT's into ours."""
  folder, hf = saved
  check_peft_round_trip(folder, hf, _hf_model, TOKENS, tmp_path,
                        ["q_proj", "v_proj", "down_proj", "in_proj"])


def test_on_a_mesh(saved):
  """The Mamba layers' channels (and their state) and the attention's heads split over
  "tensor", the batch over "data": the same logits, and the sampler's greedy tokens are
  transformers'."""
  m = check_on_a_mesh(*saved, TOKENS, PROMPTS, atol=3e-4)
  assert m.linear_layers.linear_attn.v_proj[...].sharding.spec[2] == "tensor"
  assert m.linear_layers.linear_attn.A_log[...].sharding.spec[1] == "tensor"
  assert m.dense_layers.attn.q_proj[...].sharding.spec[2] == "tensor"


def test_slots_and_resumed_rows_draw_what_one_call_draws(saved):
  """Continuous batching's refilled slots and resumed rows carry the Mamba states and the
  attention cache, token for token."""
  check_slots_and_resume_draw_one_calls_samples(models.from_pretrained(saved[0]), PROMPTS)
