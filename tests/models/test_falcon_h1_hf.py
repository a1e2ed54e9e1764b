"""Falcon-H1 (FalconH1ForCausalLM: attention and a Mamba2 mixer side by side in every layer,
then a Llama MLP, all scaled by muP multipliers) against `transformers`: the config's
multipliers, logits in both layouts with the Mamba2 output's norm after the gate, before
it or absent, gradients, greedy generation and the cache a prompt leaves, slots and
resumed rows, export, PEFT adapters on the attention, the Mamba2 and the MLP, and
refusals."""

import json

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from tests.models.parity import (assert_close_to_scale, check_export_files, check_mamba2_cache,
                                 check_next_turns_continue_from_their_slots, check_on_a_mesh,
                                 check_packed_rows_run_apart, check_peft_round_trip,
                                 check_slots_and_resume_draw_one_calls_samples, greedy_tokens,
                                 hf_logits, mamba2_hf_model, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

# Every multiplier away from one, each its own value, so a misplaced one moves the logits;
# the Mamba2 inner width (mamba_d_ssm 96: 6 heads of 16) is not mamba_expand x hidden.
CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, mamba_d_ssm=96, mamba_n_heads=6,
              mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=False,
              embedding_multiplier=2.5, lm_head_multiplier=0.25, key_multiplier=0.7,
              attention_in_multiplier=1.3, attention_out_multiplier=0.8,
              ssm_in_multiplier=1.25, ssm_out_multiplier=0.6, mlp_multipliers=[0.9, 0.55],
              ssm_multipliers=[0.35, 0.25, 0.4, 0.5, 1.5], rope_theta=1e5)
# Where the Mamba2 output's norm sits: transformers' mamba_rms_norm /
# mamba_norm_before_gate, and ours (`ModelConfig.linear_norm`).
NORMS = {"after_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
         "before_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
         "none": dict(mamba_rms_norm=False, tie_word_embeddings=True, attention_bias=True)}
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(norm: str = "after_gate"):
  config = transformers.FalconH1Config(**{**CONFIG, **NORMS[norm]})
  return mamba2_hf_model(transformers.FalconH1ForCausalLM, config)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
  return save_families(tmp_path_factory, list(NORMS), _hf_model)


@pytest.fixture(scope="module")
def saved(families):
  return families["after_gate"]


def test_config_reads_the_mixers_and_the_multipliers(families):
  for norm, (folder, hf) in families.items():
    cfg = models.from_pretrained(folder).cfg
    assert cfg.parallel_mixer and cfg.linear_norm == norm and cfg.layer_types == ()
    assert (cfg.linear_mixer, cfg.linear_num_key_heads, cfg.linear_key_head_dim,
            cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_chunk,
            cfg.linear_conv_bias) == ("mamba2", 2, 8, 6, 16, 8, True)
    assert (cfg.attention_in_multiplier, cfg.attention_out_multiplier,
            cfg.ssm_in_multiplier, cfg.ssm_out_multiplier, cfg.mlp_gate_multiplier,
            cfg.mlp_down_multiplier) == (1.3, 0.8, 1.25, 0.6, 0.9, 0.55)
    assert cfg.ssm_multipliers == (0.35, 0.25, 0.4, 0.5, 1.5)
    assert cfg.attention_scale == pytest.approx(0.7 / 4.0)  # key_multiplier / sqrt(16)
    assert (cfg.key_multiplier, cfg.lm_head_multiplier, cfg.embedding_multiplier) == (
        0.7, 0.25, 2.5)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    assert (cfg.qkv_bias, cfg.attn_out_bias, cfg.tie_embeddings) == ((norm == "none",) * 3)
  # mamba_d_ssm null: the Mamba2's width is mamba_expand x hidden_size, as transformers
  # reads it (heads of 64 // 4).
  config = json.loads(open(f"{families['after_gate'][0]}/config.json").read())
  cfg = models.hf_config_to_model_config({**config, "mamba_d_ssm": None, "mamba_expand": 1,
                                          "mamba_n_heads": 4, "mamba_d_head": "auto"})
  want = transformers.FalconH1Config(**{**CONFIG, "mamba_d_ssm": None, "mamba_expand": 1,
                                        "mamba_n_heads": 4})
  assert (cfg.linear_num_value_heads, cfg.linear_value_head_dim) == (4, want.mamba_d_head) == (
      4, 16)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_logits_match_transformers(families, norm, scan):
  folder, hf = families[norm]
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 1


@pytest.mark.slow
def test_each_multiplier_moves_the_logits(saved):
  """A multiplier set back to one changes the logits: none of them is dropped."""
  folder, _ = saved
  ours = models.from_pretrained(folder)
  base = np.asarray(_jitted_logits(ours, TOKENS))
  for change in (dict(key_multiplier=1.0), dict(lm_head_multiplier=1.0),
                 dict(attention_in_multiplier=1.0), dict(attention_out_multiplier=1.0),
                 dict(ssm_in_multiplier=1.0), dict(ssm_out_multiplier=1.0),
                 dict(mlp_gate_multiplier=1.0), dict(mlp_down_multiplier=1.0),
                 *(dict(ssm_multipliers=tuple(1.0 if j == i else m for j, m in
                                              enumerate(ours.cfg.ssm_multipliers)))
                   for i in range(5))):
    other = models.from_pretrained(folder, **change)
    assert np.abs(np.asarray(_jitted_logits(other, TOKENS)) - base).max() > 1e-3, change


def test_packed_sequences_are_run_apart(saved):
  """Two sequences packed in one row (segment ids, positions restarting) give each the
  logits it has alone: the attention, the Mamba2 state and its convolution all restart
  at the seam."""
  check_packed_rows_run_apart(models.from_pretrained(saved[0], scan_layers=True), TOKENS)


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for a layer's Mamba2 in_proj (x's and dt's rows,
  both scaled by the mup vector) and out_proj, its attention's k_proj (scaled by
  key_multiplier) and the MLP's gate_proj (scaled before its activation)."""
  folder, hf_model = saved
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  layer, theirs = grads["layers"][1], hf_model.model.layers[1]
  mamba, attn = layer["linear_attn"], layer["attn"]
  rows = theirs.mamba.in_proj.weight.grad.numpy()  # [z (96); x (96); B (16); C (16); dt (6)]
  pairs = [(np.asarray(mamba["v_proj"][...]).reshape(64, -1).T, rows[96:192]),
           (np.asarray(mamba["a_proj"][...]).T, rows[224:]),
           (np.asarray(mamba["o_proj"][...]).reshape(96, 64).T,
            theirs.mamba.out_proj.weight.grad),
           (np.asarray(mamba["norm"][...]).reshape(-1), theirs.mamba.norm.weight.grad),
           (np.asarray(attn["k_proj"][...]).reshape(64, -1).T,
            theirs.self_attn.k_proj.weight.grad),
           (np.asarray(layer["mlp"]["gate_proj"][...]).T,
            theirs.feed_forward.gate_proj.weight.grad)]
  for ours, want in pairs:
    assert_close_to_scale(ours, np.asarray(want), rel=2e-3)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, scan)):
    assert got == want, i


def test_prefill_leaves_the_cache_transformers_keeps(saved):
  """After a prompt each layer holds a KV cache and a Mamba2 state both, each as
  transformers keeps them (keys unscaled: ours scale the logits by key_multiplier)."""
  folder, hf = saved
  ours = models.from_pretrained(folder)
  _, cache = ours(TOKENS, cache=models.init_cache(ours.cfg, 2, 32), prefill=True)
  with torch.no_grad():
    theirs = hf(torch.tensor(TOKENS), use_cache=True).cache
  check_mamba2_cache([layer.linear for layer in cache], theirs, (0, 1, 2), (2, 6, 16, 8))
  values = theirs.layers[2].values.numpy()  # [B, K, T, H]
  np.testing.assert_allclose(np.asarray(cache[2].full.v)[:, :, :20], values,
                             atol=1e-5 * np.abs(values).max(), rtol=0)


@pytest.mark.parametrize("scan", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["layers", "scanned"])
def test_slots_and_resumed_rows_draw_what_one_call_draws(saved, scan):
  check_slots_and_resume_draw_one_calls_samples(
      models.from_pretrained(saved[0], scan_layers=scan), PROMPTS)


def test_next_turns_continue_from_the_state_their_slot_holds(saved):
  """A transcript that extends a row just ended goes on in that row's slot from the KV
  cache and Mamba2 state it left, the answer written in chunks of 4 (rows padded past
  their count feed nothing to the state): the same samples as prefilling each turn
  whole."""
  check_next_turns_continue_from_their_slots(
      models.from_pretrained(saved[0], scan_layers=True),
      [[5, 9, 2, 7, 1, 3], [11, 12], list(range(20, 30)), [40, 41, 42]], answer=3)


def test_on_a_mesh(saved):
  """The attention's heads and the Mamba2's heads and groups (and their state) split over
  "tensor", the batch over "data": the same logits, and the sampler's greedy tokens are
  transformers'."""
  m = check_on_a_mesh(*saved, TOKENS, PROMPTS, atol=2e-4)
  assert m.layers.linear_attn.v_proj[...].sharding.spec[2] == "tensor"
  assert m.layers.attn.q_proj[...].sharding.spec[2] == "tensor"


@pytest.mark.parametrize("norm", list(NORMS))
def test_export_round_trip_is_exact(families, norm, tmp_path):
  folder, hf = families[norm]
  ours = models.from_pretrained(folder, scan_layers=True)
  config = check_export_files(folder, ours, tmp_path / "out")
  back = transformers.FalconH1ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_allclose(hf_logits(back, TOKENS), hf_logits(hf, TOKENS), atol=1e-5,
                             rtol=0)
  assert config["model_type"] == "falcon_h1" and config["mamba_d_ssm"] == 96
  assert config["ssm_multipliers"] == CONFIG["ssm_multipliers"]
  assert (config["key_multiplier"], config["lm_head_multiplier"]) == (0.7, 0.25)
  assert models.hf_config_to_model_config(config) == ours.cfg.replace(scan_layers=False)


def test_peft_adapters_round_trip(saved, tmp_path):
  """Adapters on the attention, the Mamba2 mixers' in_proj and the MLP (feed_forward) of
  the same layers, ours into PEFT and PEFT's into ours. PEFT refuses a Mamba2 out_proj:
  the default targets leave it out, and files with it are refused."""
  folder, hf = saved
  check_peft_round_trip(folder, hf, _hf_model, TOKENS, tmp_path,
                        ["q_proj", "v_proj", "in_proj", "gate_proj", "down_proj"])
  default = models.from_pretrained(folder, lora_rank=2).cfg
  assert "in_proj" in default.lora_target_names
  assert "out_proj" not in default.lora_target_names
  named = models.from_pretrained(folder, lora_rank=2, lora_targets="q_proj,out_proj")
  assert named.cfg.lora_target_names == ("q_proj", "out_proj")
  with pytest.raises(ValueError, match="PEFT refuses adapters on a Mamba layer's out_proj"):
    models.save_lora_adapter(named, str(tmp_path / "out_proj"))


def test_what_falcon_h1_refuses(saved):
  folder, _ = saved
  config = json.loads(open(f"{folder}/config.json").read())
  for key in ("projectors_bias", "mamba_proj_bias"):
    with pytest.raises(ValueError, match=f"{key}=true"):
      models.hf_config_to_model_config({**config, key: True})
  with pytest.raises(ValueError, match="must hold 2 and 5 numbers"):
    models.hf_config_to_model_config({**config, "ssm_multipliers": [1.0, 2.0]})
  with pytest.raises(ValueError, match="key_multiplier must be a finite number"):
    models.hf_config_to_model_config({**config, "key_multiplier": float("nan")})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="parallel_mixer=True cannot be written as "
                                       "LlamaForCausalLM"):
    check_exportable(cfg.replace(architecture="LlamaForCausalLM"))
  plain = models.ModelConfig(vocab_size=97, d_model=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, ffn_dim=96)
  with pytest.raises(ValueError, match="parallel_mixer=False cannot be written as "
                                       "FalconH1ForCausalLM"):
    check_exportable(plain.replace(architecture="FalconH1ForCausalLM"))
  with pytest.raises(ValueError, match=r"\['mlp_gate_multiplier'\] cannot be written as "
                                       "LlamaForCausalLM"):
    check_exportable(plain.replace(mlp_gate_multiplier=0.5))
  with pytest.raises(ValueError, match="residual_multiplier"):
    check_exportable(cfg.replace(residual_multiplier=0.5))
  with pytest.raises(ValueError, match="parallel_mixer=True runs a Mamba2 mixer beside "
                                       "each attention: it needs linear_mixer='mamba2'"):
    cfg.replace(linear_mixer="gated_deltanet", linear_conv_bias=False, ssm_multipliers=(),
                linear_norm="after_gate")
  with pytest.raises(ValueError, match="ssm_in_multiplier scale the mixers of "
                                       "parallel_mixer layers"):
    plain.replace(ssm_in_multiplier=2.0)
  with pytest.raises(ValueError, match="ssm_multipliers must be"):
    cfg.replace(ssm_multipliers=(1.0, 2.0))
  with pytest.raises(ValueError, match="linear_norm='middle'"):
    cfg.replace(linear_norm="middle")
  with pytest.raises(ValueError, match="other than full_attention with parallel_mixer=True"):
    cfg.replace(layer_types=("full_attention", "linear_attention", "full_attention"))
