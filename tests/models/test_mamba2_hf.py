"""Mamba2 (Mamba2ForCausalLM: Mamba-Codestral, the state-spaces mamba2 models; layers of a
norm and a Mamba2 mixer alone, no attention and no MLP) against `transformers`: logits in
both layouts, gradients, time-step limits, the float32 residual stream of
residual_in_fp32 in bfloat16, greedy generation through the sampler's recurrent state,
the cache a prompt leaves, export both ways, PEFT adapters and refusals."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from tests.models.parity import (assert_close_to_scale, check_export_files,
                                 check_export_round_trip, check_mamba2_cache,
                                 check_peft_round_trip,
                                 check_slots_and_resume_draw_one_calls_samples,
                                 greedy_tokens, hf_logits, mamba2_hf_model, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

CONFIG = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_heads=8, head_dim=8,
              expand=2, n_groups=2, state_size=8, conv_kernel=4, chunk_size=8,
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              layer_norm_epsilon=1e-5)
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(**changes):
  return mamba2_hf_model(transformers.Mamba2ForCausalLM,
                         transformers.Mamba2Config(**{**CONFIG, **changes}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, ["mamba2"], lambda _: _hf_model())["mamba2"]


def test_config_reads_the_mixers_alone(saved):
  m = models.from_pretrained(saved[0])
  cfg = m.cfg
  assert cfg.layer_types == ("linear_attention",) * 3 and cfg.ffn_dim == 0
  assert cfg.split_layers and cfg.residual_fp32 and not cfg.tie_embeddings
  assert (cfg.linear_dt_min, cfg.linear_dt_max) == (0.0, float("inf"))
  assert (cfg.linear_mixer, cfg.linear_num_key_heads, cfg.linear_key_head_dim,
          cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_chunk,
          cfg.linear_conv_bias, cfg.linear_conv_kernel) == ("mamba2", 2, 8, 8, 8, 8, True, 4)
  assert m.cfg.num_params == sum(p.numel() for p in saved[1].parameters())
  # A layer holds its norm and its mixer, nothing else.
  assert [k for k in vars(m) if k.endswith("layers")] == ["linear_layers"]
  assert not hasattr(m.linear_layers[0], "mlp") and not hasattr(m.linear_layers[0], "attn")


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, scan):
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 1


def test_time_step_limit_clips_as_transformers_does(tmp_path):
  """time_step_limit (0.5, 2): each head's time step clipped both ways after the
  softplus, which moves the logits (dt_bias is drawn around 0)."""
  hf = _hf_model(time_step_limit=(0.5, 2.0))
  hf.save_pretrained(str(tmp_path / "clipped"))
  ours = models.from_pretrained(str(tmp_path / "clipped"))
  assert (ours.cfg.linear_dt_min, ours.cfg.linear_dt_max) == (0.5, 2.0)
  want = hf_logits(hf, TOKENS)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=1e-4, rtol=0)
  free = models.from_pretrained(str(tmp_path / "clipped"), linear_dt_min=0.0,
                                linear_dt_max=float("inf"))
  assert np.abs(np.asarray(_jitted_logits(free, TOKENS)) - want).max() > 1e-2


def test_residual_stream_in_float32_as_residual_in_fp32(saved, tmp_path):
  """In bfloat16, with an embedding whose rows are large against the mixers' outputs
  (each add rounds away much of them in a bfloat16 stream), ours with and without
  residual_fp32 follow transformers with and without residual_in_fp32, each far closer to
  its own than to the other."""
  folder, hf = saved
  with torch.no_grad():
    big = _hf_model()
    big.backbone.embeddings.weight.mul_(64).add_(300)
  big.save_pretrained(str(tmp_path / "big"))
  tokens, theirs, ours = TOKENS[:1], {}, {}
  for fp32 in (True, False):
    hf16 = transformers.Mamba2ForCausalLM.from_pretrained(
        str(tmp_path / "big"), residual_in_fp32=fp32).eval().to(torch.bfloat16)
    with torch.no_grad():
      theirs[fp32] = hf16(torch.tensor(tokens)).logits.float().numpy()
    m = models.from_pretrained(str(tmp_path / "big"), dtype="bfloat16",
                               param_dtype="bfloat16", residual_fp32=fp32)
    # Without XLA's excess precision, which may keep a bfloat16 stream's sums in float32
    # across a fusion and hide what residual_fp32 changes.
    graphdef, state = nnx.split(m)
    run = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, tokens).compile(
        {"xla_allow_excess_precision": False})
    ours[fp32] = np.asarray(run(state, tokens)).astype(np.float32)
  errors = {(a, b): np.abs(ours[b] - theirs[a]).mean() for a in theirs for b in ours}
  for theirs in (True, False):
    assert errors[theirs, theirs] < 1e-3, errors
    assert errors[theirs, not theirs] > 10 * errors[theirs, theirs], errors


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned_remat"])
def test_gradients_match_transformers(saved, scan):
  """d(sum of the targets' log-probs) for a layer's in_proj (its x and dt rows),
  out_proj, A_log, its norm and the final norm; scanned, sliced by layer, through the
  training scan's rematerialised layers."""
  folder, hf_model = saved
  extra = dict(scan_layers=True, remat="full") if scan else {}
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder, **extra), TOKENS)
  layers = grads["linear_layers"]
  if scan:
    layers = {j: jax.tree.map(lambda a, j=j: a[j], layers) for j in range(3)}
  mamba, theirs = layers[1]["linear_attn"], hf_model.backbone.layers[1]
  rows = theirs.mixer.in_proj.weight.grad.numpy()  # [z (64); x (64); B (16); C (16); dt (8)]
  pairs = [(np.asarray(mamba["v_proj"][...]).reshape(32, -1).T, rows[64:128]),
           (np.asarray(mamba["a_proj"][...]).T, rows[160:]),
           (np.asarray(mamba["o_proj"][...]).reshape(64, 32).T, theirs.mixer.out_proj.weight.grad),
           (np.asarray(mamba["A_log"][...]), theirs.mixer.A_log.grad),
           (np.asarray(layers[1]["input_norm"]["scale"][...]), theirs.norm.weight.grad),
           (np.asarray(grads["final_norm"]["scale"][...]), hf_model.backbone.norm_f.weight.grad)]
  for ours, want in pairs:
    assert_close_to_scale(ours, np.asarray(want), rel=2e-3)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, scan)):
    assert got == want, i


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_prefill_leaves_the_cache_transformers_keeps(saved, scan):
  """After a prompt, each layer's cache is transformers' recurrent state and convolution
  window; scanned, the stack of them (and an empty attention stack)."""
  folder, hf = saved
  ours = models.from_pretrained(folder, scan_layers=scan)
  _, cache = nnx.jit(lambda m, t, c: m(t, cache=c, prefill=True))(
      ours, TOKENS, models.init_cache(ours.cfg, 2, 32))
  if scan:
    assert cache.full.k.shape[0] == 0
    cache = [jax.tree.map(lambda a, j=j: a[j], cache.linear) for j in range(3)]
  with torch.no_grad():
    theirs = hf(torch.tensor(TOKENS), use_cache=True).past_key_values
  check_mamba2_cache(cache, theirs, (0, 1, 2), (2, 8, 8, 8))


def test_export_round_trip_is_exact(saved, tmp_path):
  """Written from either layout: the folder's tensors bit for bit, a config.json that
  reads back the same and that transformers loads to the same logits."""
  folder, hf = saved
  config = check_export_round_trip(folder, hf, transformers.Mamba2ForCausalLM, TOKENS,
                                   tmp_path / "out")
  assert config["model_type"] == "mamba2" and config["expand"] == 2
  assert config["residual_in_fp32"] is True and "intermediate_size" not in config
  check_export_files(folder, models.from_pretrained(folder, scan_layers=True),
                     tmp_path / "scanned")


def test_reads_a_published_config(saved):
  """Mamba-Codestral's config.json keys (rms_norm, norm_before_gate, time_step_rank, ...,
  which transformers does not read either) read as the model transformers runs; its
  defaults where a key is left out."""
  config = json.loads(open(f"{saved[0]}/config.json").read())
  published = {**config, "rms_norm": True, "norm_before_gate": True, "time_step_rank": 256,
               "time_step_limit": [0.0, float("inf")]}
  assert (models.hf_config_to_model_config(published)
          == models.hf_config_to_model_config(config))
  bare = models.hf_config_to_model_config({"architectures": ["Mamba2ForCausalLM"]})
  want = transformers.Mamba2Config()
  assert (bare.d_model, bare.num_layers, bare.vocab_size, bare.linear_num_value_heads,
          bare.linear_value_head_dim, bare.linear_key_head_dim, bare.linear_num_key_heads,
          bare.linear_chunk, bare.residual_fp32, bare.tie_embeddings, bare.pad_token_id) == (
      want.hidden_size, want.num_hidden_layers, want.vocab_size, want.num_heads,
      want.head_dim, want.state_size, want.n_groups, want.chunk_size,
      want.residual_in_fp32, want.tie_word_embeddings, want.pad_token_id)


def test_what_mamba2_refuses(saved):
  folder, _ = saved
  config = json.loads(open(f"{folder}/config.json").read())
  with pytest.raises(ValueError, match="use_bias=true"):
    models.hf_config_to_model_config({**config, "use_bias": True})
  with pytest.raises(ValueError, match="hidden_act='gelu'"):
    models.hf_config_to_model_config({**config, "hidden_act": "gelu"})
  with pytest.raises(ValueError, match=r"hidden_size \* expand \(32 \* 3\)"):
    models.hf_config_to_model_config({**config, "expand": 3})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="layer_types .* cannot be written as Mamba2ForCausalLM"):
    check_exportable(cfg.replace(layer_types=("linear_attention", "mlp", "linear_attention"),
                                 ffn_dim=48))
  with pytest.raises(ValueError, match="Mamba2 layers 40 wide .* cannot be written"):
    check_exportable(cfg.replace(linear_value_head_dim=5))
  with pytest.raises(ValueError, match="ffn_dim=0 .* written as Mamba2ForCausalLM"):
    check_exportable(cfg.replace(architecture="NemotronHForCausalLM", residual_fp32=False,
                                 mlp_activation="relu2"))
  with pytest.raises(ValueError, match="split_layers=True .* cannot be written as "
                                       "BambaForCausalLM"):
    check_exportable(cfg.replace(architecture="BambaForCausalLM"))
  with pytest.raises(ValueError, match="ffn_dim=0 .* needs layer_types without mlp"):
    cfg.replace(layer_types=("linear_attention", "mlp", "linear_attention"))
  with pytest.raises(ValueError, match="residual_fp32=True is supported in single-sublayer"):
    models.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, ffn_dim=64, residual_fp32=True)
  with pytest.raises(ValueError, match=r"lora_targets \['q_proj'\]: this model has no such"):
    cfg.replace(lora_rank=2, lora_targets="q_proj,in_proj")


def test_peft_adapters_round_trip(saved, tmp_path):
  """Adapters on in_proj, ours into PEFT and PEFT's into ours (PEFT names the trunk
  backbone.*); the default targets are in_proj alone (no attention, no MLP, and the
  out_proj PEFT refuses)."""
  folder, hf = saved
  check_peft_round_trip(folder, hf, _hf_model, TOKENS, tmp_path, ["in_proj"])
  cfg = models.from_pretrained(folder, lora_rank=2).cfg
  assert cfg.lora_target_names == ("in_proj",)
  lora = models.from_pretrained(folder, lora_rank=2, scan_layers=True)
  counted = sum(v.size for _, v in nnx.iter_graph(lora) if isinstance(v, nnx.LoRAParam))
  assert counted == cfg.num_lora_params > 0


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["layers", "scanned"])
def test_slots_and_resumed_rows_draw_what_one_call_draws(saved, scan):
  """Continuous batching's refilled slots and resumed rows carry each layer's recurrent
  state and convolution window, token for token, with no attention cache at all."""
  check_slots_and_resume_draw_one_calls_samples(
      models.from_pretrained(saved[0], scan_layers=scan), PROMPTS)
