"""Granite 4's hybrid models (GraniteMoeHybridForCausalLM with Mamba2 layers: the
granite-4.0-h models) against `transformers`: Mamba2 layers (`Mamba2`: in_proj's gate,
x, B, C and time step; one causal convolution over x, B and C with its bias; the selective
state space through `kernels.gated_linear_attention`; the gated group norm) among
attention layers with or without rotary embeddings, a dense shared_mlp or experts beside
it. Logits (layer list and scanned, several chunks, packed sequences), gradients, greedy
generation through the sampler's recurrent state, continuous batching, export, LoRA and
PEFT files on the Mamba2 projections, the planner's cache, and refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from posttrain.sampling import Sampler
from tests.models.parity import (assert_close_to_scale, check_peft_round_trip,
                                 check_slots_and_resume_draw_one_calls_samples,
                                 greedy_tokens, hf_logits, perturb, save_families,
                                 spread_mamba2_parameters, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
              pad_token_id=0, bos_token_id=2, eos_token_id=1, embedding_multiplier=6.0,
              residual_multiplier=0.5, attention_multiplier=0.0625, logits_scaling=4.0,
              mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=8)
VARIANTS = {
    # granite-4.0-h-micro's layout: a dense shared_mlp, no position embedding.
    "dense": dict(layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0,
                  shared_intermediate_size=80, position_embedding_type=None,
                  tie_word_embeddings=True),
    # -h-tiny / -h-small: experts beside the shared_mlp; here with rotary embeddings and
    # one group of B and C.
    "moe": dict(layer_types=["mamba", "attention"] * 2, num_local_experts=4,
                num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48,
                position_embedding_type="rope", mamba_n_groups=1),
}
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))
_jitted_packed = nnx.jit(lambda m, t, p, s: m(t, p, s))


def _hf_model(variant, **extra):
  cfg = transformers.GraniteMoeHybridConfig(**{**COMMON, **VARIANTS[variant], **extra})
  torch.manual_seed(0)
  model = perturb(transformers.GraniteMoeHybridForCausalLM(cfg).float().eval())
  return spread_mamba2_parameters(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


def test_config_reads_the_mamba_layers(saved):
  cfg = models.from_pretrained(saved["dense"][0]).cfg
  assert cfg.layer_types == ("linear_attention",) * 2 + ("full_attention", "linear_attention")
  assert (cfg.linear_mixer, cfg.linear_num_key_heads, cfg.linear_key_head_dim,
          cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel,
          cfg.linear_conv_bias) == ("mamba2", 2, 8, 8, 16, 4, True)
  assert cfg.nope_layers == (True,) * 4 and cfg.ffn_dim == 80 and not cfg.num_experts
  assert (cfg.linear_dt_min, cfg.linear_dt_max, cfg.linear_chunk) == (0.0, float("inf"), 8)
  moe = models.from_pretrained(saved["moe"][0]).cfg
  assert (moe.linear_num_key_heads, moe.num_experts, moe.rope_layers,
          moe.layer_period) == (1, 4, (), 2)
  for variant in VARIANTS:
    m = models.from_pretrained(saved[variant][0])
    assert type(m.linear_layers[0].linear_attn).__name__ == "Mamba2"
    assert m.cfg.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(m))), variant
    hf = saved[variant][1]
    assert m.cfg.num_params == sum(p.numel() for p in hf.parameters()), variant


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  """Both run the chunked scan in chunks of 8 (mamba_chunk_size); ours in 6s too."""
  folder, hf = saved[variant]
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=2e-4, rtol=0)
  assert np.abs(want).max() > 1
  if not scan:
    chunked = models.from_pretrained(folder, linear_chunk=6)
    np.testing.assert_allclose(np.asarray(_jitted_logits(chunked, TOKENS)), want, atol=2e-4,
                               rtol=0)


def test_each_part_moves_the_logits(saved):
  """The gate, the convolution and its bias, the decay, the skip D and the gated norm
  each matter: zeroing one moves the logits."""
  folder, hf = saved["dense"]
  want = hf_logits(hf, TOKENS)
  for name in ("z_proj", "k_conv", "q_conv_bias", "A_log", "D", "norm", "a_proj"):
    m = models.from_pretrained(folder)
    node = getattr(m.linear_layers[1].linear_attn, name)
    node.value = jnp.zeros_like(node[...])
    assert np.abs(np.asarray(_jitted_logits(m, TOKENS)) - want).max() > 1e-3, name


def test_packed_sequences_are_run_apart(saved):
  """Two sequences packed in one row give each the logits it has alone: the state and
  the convolution restart at the seam."""
  m = models.from_pretrained(saved["moe"][0], linear_chunk=4)
  a, b = TOKENS[0, :11], TOKENS[1, :9]
  packed = np.concatenate([a, b])[None]
  seg = np.array([[1] * 11 + [2] * 9])
  pos = np.array([list(range(11)) + list(range(9))])
  got = np.asarray(_jitted_packed(m, jnp.asarray(packed), jnp.asarray(pos),
                                  jnp.asarray(seg)))[0]
  np.testing.assert_allclose(got[:11], np.asarray(_jitted_logits(m, a[None]))[0], atol=1e-4)
  np.testing.assert_allclose(got[11:], np.asarray(_jitted_logits(m, b[None]))[0], atol=1e-4)


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for every Mamba2 weight: in_proj's five parts,
  the convolution's taps and bias, A_log, dt_bias, D, the norm and out_proj."""
  folder, hf_model = saved["dense"]
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  ours, theirs = grads["linear_layers"][1]["linear_attn"], hf_model.model.layers[1].mamba
  inner, bc = 128, 16  # 8 heads x 16; 2 groups x state 8
  rows = theirs.in_proj.weight.grad.numpy()  # [z (128); x (128); B (16); C (16); dt (8)]
  conv = theirs.conv1d.weight.grad.numpy()[:, 0]  # [x; B; C] channels, 4 taps
  bias = theirs.conv1d.bias.grad.numpy()

  def flat(name):
    return np.asarray(ours[name][...])

  pairs = [(flat("z_proj").reshape(64, -1).T, rows[:inner]),
           (flat("v_proj").reshape(64, -1).T, rows[inner:2 * inner]),
           (flat("k_proj").reshape(64, -1).T, rows[2 * inner:2 * inner + bc]),
           (flat("q_proj").reshape(64, -1).T, rows[2 * inner + bc:2 * inner + 2 * bc]),
           (flat("a_proj").T, rows[2 * inner + 2 * bc:]),
           (flat("v_conv").reshape(inner, 4), conv[:inner]),
           (flat("q_conv").reshape(bc, 4), conv[inner + bc:]),
           (flat("k_conv_bias").reshape(-1), bias[inner:inner + bc]),
           (flat("A_log"), theirs.A_log.grad), (flat("dt_bias"), theirs.dt_bias.grad),
           (flat("D"), theirs.D.grad), (flat("norm").reshape(-1), theirs.norm.weight.grad),
           (flat("o_proj").reshape(inner, 64).T, theirs.out_proj.weight.grad)]
  for i, (a, b) in enumerate(pairs):
    assert_close_to_scale(a, np.asarray(b), rel=2e-3), i


@pytest.mark.parametrize("variant,scan", [("dense", False),
                                          pytest.param("moe", True, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  """Prompts of different lengths prefilled in one right-padded block (padding leaves
  the state and the convolution's window alone), then decoded a token at a time."""
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 10, scan)):
    assert got == want, i


def test_time_step_limit_clips_prefill_and_decode_alike(tmp_path):
  """time_step_limit clips the time step: ours as transformers' chunked scan does, and
  in the decode step too (transformers' one-token step skips the clip, as mamba_ssm's
  does), so that what the sampler draws is what a forward pass over the same tokens
  scores."""
  hf = _hf_model("moe", time_step_limit=(0.0, 0.3))
  hf.save_pretrained(str(tmp_path / "clipped"))
  ours = models.from_pretrained(str(tmp_path / "clipped"))
  assert (ours.cfg.linear_dt_min, ours.cfg.linear_dt_max) == (0.0, 0.3)
  want = hf_logits(hf, TOKENS)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=2e-4, rtol=0)
  unclipped = models.from_pretrained(str(tmp_path / "clipped"), linear_dt_max=float("inf"))
  assert np.abs(np.asarray(_jitted_logits(unclipped, TOKENS)) - want).max() > 1e-2
  out = Sampler(ours, max_len=48, extend_chunk=4).generate(PROMPTS, max_new_tokens=8,
                                                           temperature=0.0)
  for i, prompt in enumerate(PROMPTS):
    row = np.asarray(prompt + out.tokens[i].tolist())[None]
    greedy = np.asarray(_jitted_logits(ours, row))[0, len(prompt) - 1:-1].argmax(-1)
    assert greedy.tolist() == out.tokens[i].tolist(), i


@pytest.mark.slow  # about 25 s of compiling on 2 cores
def test_continuous_batching_and_resume_draw_the_same_samples(saved):
  """Rows that stop early leave their slot's state alone while the others decode; slots,
  refilled rows and resumed rows draw what one call draws."""
  model = models.from_pretrained(saved["moe"][0], scan_layers=True)
  check_slots_and_resume_draw_one_calls_samples(model, PROMPTS + [[7, 8, 9], [30, 31]])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  """The files we write hold transformers' names (in_proj and conv1d written back byte
  for byte) and load back to the same logits and config."""
  folder, hf = saved[variant]
  ours = models.from_pretrained(folder, scan_layers=variant == "moe")
  models.save_pretrained(ours, str(tmp_path / "out"))
  from safetensors.numpy import load_file
  theirs, written = load_file(f"{folder}/model.safetensors"), load_file(
      tmp_path / "out" / "model.safetensors")
  assert set(written) == set(theirs)
  for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "norm.weight"):
    np.testing.assert_array_equal(written[f"model.layers.0.mamba.{name}"],
                                  theirs[f"model.layers.0.mamba.{name}"])
  back = transformers.GraniteMoeHybridForCausalLM.from_pretrained(
      str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["layer_types"] == VARIANTS[variant]["layer_types"]
  assert models.hf_config_to_model_config(config) == ours.cfg.replace(scan_layers=False)


def test_lora_on_the_mamba_projections(saved):
  """By default the attention's and the Mamba2 layers' in_proj / out_proj are adapted;
  both layouts draw the same adapters, each reaches its projections, and merging keeps
  the function."""
  folder, _ = saved["dense"]
  a = models.from_pretrained(folder, lora_rank=4, seed=3)
  b = models.from_pretrained(folder, lora_rank=4, seed=3, scan_layers=True)
  assert a.cfg.lora_target_names == ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj",
                                     "out_proj")
  lin = a.linear_layers[2].linear_attn
  assert lin.in_proj_lora_b.shape == (4, 2 * 128 + 2 * 16 + 8)  # [r, z; x; B; C; dt]
  assert lin.out_proj_lora_a.shape == (8, 16, 4)
  np.testing.assert_array_equal(np.asarray(lin.in_proj_lora_a[...]),
                                np.asarray(b.linear_layers.linear_attn.in_proj_lora_a[...][2]))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(a, nnx.LoRAParam)))
  assert count == a.cfg.num_lora_params
  base = np.asarray(_jitted_logits(a, TOKENS))
  rng = np.random.default_rng(0)
  for _, v in nnx.iter_graph(a):
    if isinstance(v, nnx.LoRAParam) and np.all(np.asarray(v[...]) == 0):
      v.value = jnp.asarray(rng.normal(0, 0.1, v.shape), v.dtype)
  want = np.asarray(_jitted_logits(a, TOKENS))
  assert np.abs(want - base).max() > 1e-2
  np.testing.assert_allclose(np.asarray(_jitted_logits(models.merge_lora(a), TOKENS)), want,
                             atol=2e-3)
  for name in ("in_proj", "out_proj"):
    one = models.relayout(a, scan_layers=False)
    node = getattr(one.linear_layers[1].linear_attn, f"{name}_lora_b")
    node.value = jnp.zeros_like(node[...])
    assert np.abs(np.asarray(_jitted_logits(one, TOKENS)) - want).max() > 1e-4, name
  with pytest.raises(ValueError, match="those are in_proj,out_proj"):
    models.from_pretrained(folder, lora_rank=2, lora_targets="in_proj_qkv")


def test_peft_adapters_on_the_mamba_projections_round_trip(saved, tmp_path):
  """Our adapters load in PEFT (its mamba.in_proj / out_proj modules) with our logits,
  and PEFT's load in ours with its."""
  folder, hf = saved["moe"]
  check_peft_round_trip(folder, hf, lambda: _hf_model("moe"), TOKENS, tmp_path,
                        ["q_proj", "o_proj", "in_proj", "out_proj"])


def test_planner_counts_the_recurrent_state(saved):
  """The planner's cache bytes are the cache the sampler builds: a KV cache for the
  attention layer, a fixed-size state and convolution window for each Mamba2 layer."""
  from jax.sharding import AbstractMesh

  from posttrain import planner
  cfg = models.from_pretrained(saved["dense"][0]).cfg
  mesh = AbstractMesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "sequence"))
  for max_len in (64, 256):
    built = sum(x.size * x.dtype.itemsize
                for x in jax.tree.leaves(models.init_cache(cfg, 3, max_len)))
    assert planner.kv_cache_bytes(cfg, batch=3, max_len=max_len, mesh=mesh) == built
  # Each Mamba2 layer: the state [8 heads, 16 head dim, 8 state] (mamba_ssm's layout)
  # and 3 inputs of x, B and C.
  state = models.init_cache(cfg, 3, 64)[0]
  assert state.state.shape == (3, 8, 16, 8) and state.v_conv.shape == (3, 3, 8, 16)
  assert state.q_conv.shape == state.k_conv.shape == (3, 3, 2, 8)


def test_what_is_refused(saved):
  folder, _ = saved["dense"]
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="linear_mixer='mamba2' layers cannot be written as "
                     "Qwen3_5ForCausalLM"):
    check_exportable(cfg.replace(architecture="Qwen3_5ForCausalLM"))
  qwen = cfg.replace(linear_mixer="gated_deltanet", linear_conv_bias=False)
  with pytest.raises(ValueError, match="Gated DeltaNet layers cannot be written as "
                     "GraniteMoeHybridForCausalLM"):
    check_exportable(qwen)
  with pytest.raises(ValueError, match="linear_conv_bias are Mamba2's"):
    cfg.replace(linear_mixer="gated_deltanet")
  with pytest.raises(ValueError, match="linear_mixer='mamba'; expected one of"):
    cfg.replace(linear_mixer="mamba")
  with pytest.raises(ValueError, match="linear_dt_min=0.5 and linear_dt_max=0.5"):
    cfg.replace(linear_dt_min=0.5, linear_dt_max=0.5)
  hf_config = json.loads(open(f"{folder}/config.json").read())
  with pytest.raises(ValueError, match="mamba_proj_bias=true"):
    models.hf_config_to_model_config({**hf_config, "mamba_proj_bias": True})
  with pytest.raises(ValueError, match="mamba_n_heads=8 x mamba_d_head=12 must equal"):
    models.hf_config_to_model_config({**hf_config, "mamba_d_head": 12})
  with pytest.raises(ValueError, match="expected one of"):
    models.hf_config_to_model_config({**hf_config, "layer_types": ["mamba", "moe"] * 2})
