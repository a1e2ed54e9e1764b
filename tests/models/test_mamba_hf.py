"""Mamba 1 (MambaForCausalLM: the state-spaces mamba models) and FalconMamba
(FalconMambaForCausalLM: Falcon-Mamba-7B, its weightless RMS norms on dt, B and C) against
`transformers`: logits in both layouts, gradients, greedy generation through the
sampler's recurrent state, the cache a prompt leaves, export both ways, PEFT adapters
and refusals."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from tests.models.parity import (assert_close_to_scale, check_export_files,
                                 check_export_round_trip, check_peft_round_trip,
                                 check_slots_and_resume_draw_one_calls_samples,
                                 greedy_tokens, hf_logits, perturb, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

CONFIG = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, state_size=8, expand=2,
              conv_kernel=4, time_step_rank=4, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, layer_norm_epsilon=1e-5,
              tie_word_embeddings=False)
CLASSES = {"mamba": ("MambaForCausalLM", "MambaConfig"),
           "falcon_mamba": ("FalconMambaForCausalLM", "FalconMambaConfig")}
FAMILIES = list(CLASSES)
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(family, **changes):
  """A fresh transformers model of `family` (seed 0, float32, eval), its norms and biases
  moved off their initial values and its A (per channel and state entry) and D drawn."""
  model_cls, config_cls = (getattr(transformers, n) for n in CLASSES[family])
  torch.manual_seed(0)
  model = perturb(model_cls(config_cls(**{**CONFIG, **changes})).float().eval())
  with torch.no_grad():
    for layer in model.backbone.layers:
      layer.mixer.A_log.uniform_(-1.0, 1.5)
      layer.mixer.D.normal_(1.0, 0.5)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, FAMILIES, _hf_model)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_reads_the_mixers_alone(saved, family):
  m = models.from_pretrained(saved[family][0])
  cfg = m.cfg
  assert cfg.architecture == CLASSES[family][0]
  assert cfg.layer_types == ("linear_attention",) * 3 and cfg.ffn_dim == 0
  assert (cfg.linear_mixer, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
          cfg.linear_key_head_dim, cfg.linear_dt_rank, cfg.linear_conv_bias) == (
      "mamba1", 64, 1, 8, 4, True)
  assert cfg.linear_bcdt_norm == ("weightless" if family == "falcon_mamba" else "none")
  assert cfg.residual_fp32
  assert cfg.num_params == sum(p.numel() for p in saved[family][1].parameters())
  assert not hasattr(m.linear_layers[0], "mlp") and not hasattr(m.linear_layers[0], "attn")
  # time_step_rank "auto" is ceil(hidden_size / 16); tied embeddings by default.
  config = json.loads(open(f"{saved[family][0]}/config.json").read())
  auto = models.hf_config_to_model_config({**config, "time_step_rank": "auto",
                                           "hidden_size": 40, "tie_word_embeddings": None})
  assert auto.linear_dt_rank == 3 and auto.tie_embeddings


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, family, scan):
  folder, hf = saved[family]
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 1


def test_falcon_mamba_norms_move_the_logits(saved):
  """FalconMamba's norms on dt, B and C: off, the same weights give other logits."""
  folder, hf = saved["falcon_mamba"]
  bare = models.from_pretrained(folder, linear_bcdt_norm="none")
  assert np.abs(np.asarray(_jitted_logits(bare, TOKENS)) - hf_logits(hf, TOKENS)).max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_transformers(saved, family):
  """d(sum of the targets' log-probs) for a layer's in_proj (its x and gate rows),
  x_proj (its dt and C rows), dt_proj, A_log, out_proj and norm, scanned and
  rematerialised."""
  folder, hf_model = saved[family]
  ours = models.from_pretrained(folder, scan_layers=True, remat="full")
  grads = target_logprob_grads(hf_model, ours, TOKENS)
  mamba = jax.tree.map(lambda a: a[1], grads["linear_layers"])
  theirs = hf_model.backbone.layers[1]
  in_rows = theirs.mixer.in_proj.weight.grad.numpy()  # [x (64); z (64)]
  x_rows = theirs.mixer.x_proj.weight.grad.numpy()  # [dt (4); B (8); C (8)]
  lin = mamba["linear_attn"]
  pairs = [(np.asarray(lin["v_proj"][...]).reshape(32, 64).T, in_rows[:64]),
           (np.asarray(lin["z_proj"][...]).reshape(32, 64).T, in_rows[64:]),
           (np.asarray(lin["x_dt"][...]).T, x_rows[:4]),
           (np.asarray(lin["x_c"][...]).T, x_rows[12:]),
           (np.asarray(lin["dt_proj"][...]).T, theirs.mixer.dt_proj.weight.grad),
           (np.asarray(lin["dt_bias"][...]), theirs.mixer.dt_proj.bias.grad),
           (np.asarray(lin["A_log"][...]), theirs.mixer.A_log.grad),
           (np.asarray(lin["o_proj"][...]).reshape(64, 32).T, theirs.mixer.out_proj.weight.grad),
           (np.asarray(mamba["input_norm"]["scale"][...]), theirs.norm.weight.grad)]
  for got, want in pairs:
    assert_close_to_scale(got, np.asarray(want), rel=2e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(saved, family):
  for i, (got, want) in enumerate(greedy_tokens(*saved[family], PROMPTS, 10, False)):
    assert got == want, i


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_prefill_leaves_the_cache_transformers_keeps(saved, scan):
  """After a prompt, each layer's cache is transformers' recurrent state [B, E, N] and
  the last three of x's inputs to the convolution (transformers keeps four)."""
  folder, hf = saved["mamba"]
  ours = models.from_pretrained(folder, scan_layers=scan)
  _, cache = nnx.jit(lambda m, t, c: m(t, cache=c, prefill=True))(
      ours, TOKENS, models.init_cache(ours.cfg, 2, 32))
  if scan:
    cache = [jax.tree.map(lambda a, j=j: a[j], cache.linear) for j in range(3)]
  with torch.no_grad():
    theirs = hf(torch.tensor(TOKENS), use_cache=True).past_key_values
  for i in range(3):
    want = theirs.get_recurrent_state(i).numpy()
    state = np.asarray(cache[i].state)
    assert state.shape == (2, 64, 1, 8)
    np.testing.assert_allclose(state[:, :, 0], want, atol=1e-4 * np.abs(want).max(), rtol=0)
    want = theirs.get_conv_state(i).numpy()[..., 1:].transpose(0, 2, 1)
    np.testing.assert_allclose(np.asarray(cache[i].v_conv)[..., 0], want,
                               atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_is_exact(saved, family, tmp_path):
  """Written from either layout: the folder's tensors bit for bit, a config.json that
  reads back the same and that transformers loads to the same logits."""
  folder, hf = saved[family]
  config = check_export_round_trip(folder, hf, getattr(transformers, CLASSES[family][0]),
                                   TOKENS, tmp_path / "out")
  assert config["model_type"] == family and config["time_step_rank"] == 4
  check_export_files(folder, models.from_pretrained(folder, scan_layers=True),
                     tmp_path / "scanned")


def test_what_mamba_refuses(saved):
  folder, _ = saved["mamba"]
  config = json.loads(open(f"{folder}/config.json").read())
  with pytest.raises(ValueError, match="use_bias=true"):
    models.hf_config_to_model_config({**config, "use_bias": True})
  with pytest.raises(ValueError, match="hidden_act='gelu'"):
    models.hf_config_to_model_config({**config, "hidden_act": "gelu"})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="linear_bcdt_norm='weightless' cannot be written as "
                                       "MambaForCausalLM"):
    check_exportable(cfg.replace(linear_bcdt_norm="weightless"))
  with pytest.raises(ValueError, match="linear_bcdt_norm='on'; expected"):
    cfg.replace(linear_bcdt_norm="on")
  with pytest.raises(ValueError, match="linear_dt_max are Mamba2's"):
    cfg.replace(linear_dt_max=2.0)
  with pytest.raises(ValueError, match="d_inner.* cannot be written"):
    check_exportable(cfg.replace(linear_num_value_heads=48))
  with pytest.raises(ValueError, match="linear_mixer='mamba1' cannot be written as "
                                       "Mamba2ForCausalLM"):
    check_exportable(cfg.replace(architecture="Mamba2ForCausalLM"))
  with pytest.raises(ValueError, match="linear_dt_rank >= 1"):
    cfg.replace(linear_dt_rank=0)
  with pytest.raises(ValueError, match="linear_value_head_dim=2 must be 1"):
    cfg.replace(linear_value_head_dim=2)
  with pytest.raises(ValueError, match="linear_dt_rank are Mamba 1's"):
    cfg.replace(linear_mixer="mamba2", linear_num_key_heads=1, linear_value_head_dim=8,
                linear_num_value_heads=8)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapters_round_trip(saved, family, tmp_path):
  """Adapters on in_proj (x and the gate), ours into PEFT and PEFT's into ours (the trunk
  named backbone.*); in_proj is the default target, out_proj (which PEFT refuses on
  Mamba models) trains only when named."""
  folder, hf = saved[family]
  check_peft_round_trip(folder, hf, lambda: _hf_model(family), TOKENS, tmp_path, ["in_proj"])
  assert models.from_pretrained(folder, lora_rank=2).cfg.lora_target_names == ("in_proj",)
  named = models.from_pretrained(folder, lora_rank=2, lora_targets="in_proj,out_proj")
  with pytest.raises(ValueError, match="PEFT refuses adapters on a Mamba layer's out_proj"):
    models.save_lora_adapter(named, str(tmp_path / "out_proj"))


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["layers", "scanned"])
def test_slots_and_resumed_rows_draw_what_one_call_draws(saved, scan):
  """Continuous batching's refilled slots and resumed rows carry each layer's recurrent
  state and convolution window, token for token."""
  check_slots_and_resume_draw_one_calls_samples(
      models.from_pretrained(saved["falcon_mamba"][0], scan_layers=scan), PROMPTS)
