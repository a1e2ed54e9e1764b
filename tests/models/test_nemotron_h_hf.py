"""Nemotron-H (NemotronHForCausalLM: single-sublayer layers, each a norm and one of
Mamba2, attention without a position embedding, or an MLP of squared ReLU without a gate)
against `transformers`: logits in both layouts, gradients, greedy generation through the
sampler's recurrent state, the cache a prompt leaves, export both ways and the names of
published files, and refusals."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from tests.models.parity import (assert_close_to_scale, check_mamba2_cache,
                                 check_peft_round_trip,
                                 check_slots_and_resume_draw_one_calls_samples,
                                 greedy_tokens, hf_logits, mamba2_hf_model, save_families,
                                 target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

# M - M * - M M - : Mamba2 layers followed by an MLP or not, attention in the middle.
PATTERN = "M-M*-MM-"
CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96,
              layers_block_type=[{"M": "linear_attention", "*": "full_attention",
                                  "-": "mlp"}[c] for c in PATTERN],
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, mamba_num_heads=8, mamba_head_dim=16,
              n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
              time_step_min=0.01, layer_norm_epsilon=1e-5)
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model():
  return mamba2_hf_model(transformers.NemotronHForCausalLM, transformers.NemotronHConfig(**CONFIG))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, ["nemotron_h"], lambda _: _hf_model())["nemotron_h"]


def test_config_reads_the_layers(saved):
  m = models.from_pretrained(saved[0])
  cfg = m.cfg
  assert cfg.layer_types == tuple({"M": "linear_attention", "*": "full_attention",
                                   "-": "mlp"}[c] for c in PATTERN)
  assert cfg.split_layers and cfg.mlp_activation == "relu2"
  assert cfg.rope_layers == (0,) * 8 and cfg.linear_dt_min == 0.01
  assert (cfg.linear_mixer, cfg.linear_num_key_heads, cfg.linear_key_head_dim,
          cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_chunk,
          cfg.linear_conv_bias) == ("mamba2", 2, 8, 8, 16, 8, True)
  assert m.cfg.num_params == sum(p.numel() for p in saved[1].parameters())
  # An MLP layer holds its norm and MLP alone; a mixer layer no MLP.
  assert not hasattr(m.mlp_layers[0], "attn") and not hasattr(m.mlp_layers[0], "gate_proj")
  assert not hasattr(m.mlp_layers[0].mlp, "gate_proj")
  assert not hasattr(m.linear_layers[0], "mlp") and not hasattr(m.layers[0], "mlp")


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, scan):
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=2e-4, rtol=0)
  assert np.abs(want).max() > 1


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned_remat"])
def test_gradients_match_transformers(saved, scan):
  """d(sum of the targets' log-probs) for a Mamba2 layer's in_proj and out_proj, the
  attention's q_proj, an MLP's up and down projections and a layer norm; scanned, each
  kind's stack sliced by layer, through the training scan's rematerialised layers."""
  folder, hf_model = saved
  extra = dict(scan_layers=True, remat="full") if scan else {}
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder, **extra), TOKENS)
  if scan:
    grads = {k: {j: jax.tree.map(lambda a, j=j: a[j], v)
                 for j in range(jax.tree.leaves(v)[0].shape[0])}
             if k in ("linear_layers", "layers", "mlp_layers") else v
             for k, v in grads.items()}
  layers = hf_model.model.layers
  mamba, theirs = grads["linear_layers"][1]["linear_attn"], layers[2].mixer
  rows = theirs.in_proj.weight.grad.numpy()  # [z (128); x (128); B (16); C (16); dt (8)]
  attn, mlp = grads["layers"][0]["attn"], grads["mlp_layers"][1]["mlp"]
  pairs = [(np.asarray(mamba["v_proj"][...]).reshape(64, -1).T, rows[128:256]),
           (np.asarray(mamba["a_proj"][...]).T, rows[288:]),
           (np.asarray(mamba["o_proj"][...]).reshape(128, 64).T, theirs.out_proj.weight.grad),
           (np.asarray(attn["q_proj"][...]).reshape(64, -1).T, layers[3].mixer.q_proj.weight.grad),
           (np.asarray(mlp["up_proj"][...]).T, layers[4].mixer.up_proj.weight.grad),
           (np.asarray(mlp["down_proj"][...]).T, layers[4].mixer.down_proj.weight.grad),
           (np.asarray(grads["mlp_layers"][1]["input_norm"]["scale"][...]),
            layers[4].norm.weight.grad)]
  for ours, want in pairs:
    assert_close_to_scale(ours, np.asarray(want), rel=2e-3)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, scan)):
    assert got == want, i


def test_prefill_leaves_the_cache_transformers_keeps(saved):
  """After a prompt, each Mamba2 layer's cache is transformers' recurrent state and
  convolution window; an MLP layer has no cache."""
  folder, hf = saved
  ours = models.from_pretrained(folder)
  _, cache = ours(TOKENS, cache=models.init_cache(ours.cfg, 2, 32), prefill=True)
  assert [c is None for c in cache] == [c == "-" for c in PATTERN]
  with torch.no_grad():
    theirs = hf(torch.tensor(TOKENS), use_cache=True).past_key_values
  check_mamba2_cache(cache, theirs, (0, 2, 5, 6), (2, 8, 16, 8))


def test_export_round_trip_is_exact(saved, tmp_path):
  folder, hf = saved
  ours = models.from_pretrained(folder, scan_layers=True)
  models.save_pretrained(ours, str(tmp_path / "out"))
  from safetensors.numpy import load_file
  theirs, written = load_file(f"{folder}/model.safetensors"), load_file(
      tmp_path / "out" / "model.safetensors")
  assert set(written) == set(theirs)
  for name in ("backbone.layers.0.mixer.in_proj.weight", "backbone.norm_f.weight",
               "backbone.layers.4.mixer.up_proj.weight", "backbone.layers.3.mixer.o_proj.weight"):
    np.testing.assert_array_equal(written[name], theirs[name])
  back = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["hybrid_override_pattern"] == PATTERN and config["model_type"] == "nemotron_h"
  assert models.hf_config_to_model_config(config) == ours.cfg.replace(scan_layers=False)


def test_reads_published_config_names_and_model_prefixed_files(saved, tmp_path):
  """A published config.json (hybrid_override_pattern, mamba_* names of a few fields) and
  files naming the trunk model.* read as the same model; multi-token-prediction tensors
  (mtp.*) are not read."""
  folder, hf = saved
  config = json.loads(open(f"{folder}/config.json").read())
  published = {k: v for k, v in config.items() if k not in ("layers_block_type",
                                                            "n_groups", "conv_kernel")}
  published.update(hybrid_override_pattern=PATTERN, mamba_n_groups=2, mamba_d_conv=4,
                   num_hidden_layers=len(PATTERN))
  assert (models.hf_config_to_model_config(published)
          == models.hf_config_to_model_config(config))
  from safetensors.numpy import load_file, save_file
  tensors = {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v
             for k, v in load_file(f"{folder}/model.safetensors").items()}
  tensors["mtp.layers.0.norm.weight"] = np.ones(64, np.float32)
  (tmp_path / "renamed").mkdir()
  save_file(tensors, str(tmp_path / "renamed" / "model.safetensors"))
  (tmp_path / "renamed" / "config.json").write_text(json.dumps(published))
  ours = models.from_pretrained(str(tmp_path / "renamed"))
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), hf_logits(hf, TOKENS),
                             atol=2e-4, rtol=0)


def test_what_nemotron_h_refuses(saved):
  folder, _ = saved
  config = json.loads(open(f"{folder}/config.json").read())
  with pytest.raises(ValueError, match=r"entries \['attention'\].*moe \(E\)"):
    models.hf_config_to_model_config({**config, "layers_block_type": ["linear_attention",
                                                                     "attention"]})
  with pytest.raises(ValueError, match="mlp_hidden_act='silu'"):
    models.hf_config_to_model_config({**config, "mlp_hidden_act": "silu"})
  with pytest.raises(ValueError, match="mlp_bias=true"):
    models.hf_config_to_model_config({**config, "mlp_bias": True})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="rope_layers with rotary layers cannot be written"):
    check_exportable(cfg.replace(rope_layers=()))
  with pytest.raises(ValueError, match="split_layers=True .* cannot be written as "
                                       "GraniteMoeHybridForCausalLM"):
    check_exportable(cfg.replace(architecture="GraniteMoeHybridForCausalLM",
                                 mlp_activation="silu"))
  with pytest.raises(ValueError, match="mlp_activation='silu' cannot be written as "
                                       "NemotronHForCausalLM"):
    check_exportable(cfg.replace(mlp_activation="silu"))
  with pytest.raises(ValueError, match="tie_embeddings=True cannot be written"):
    check_exportable(cfg.replace(tie_embeddings=True))
  with pytest.raises(ValueError, match="need linear_attention layers"):
    cfg.replace(layer_types=("full_attention", "mlp") * 4)
  with pytest.raises(ValueError, match="mixture sits in layer_types' moe layers alone"):
    cfg.replace(num_experts=4, num_experts_per_tok=2)


def test_peft_adapters_round_trip(saved, tmp_path):
  """Adapters on the attention, the Mamba2 layers' in_proj and the MLPs' up and down
  projections (each under its layer's mixer), ours into PEFT and PEFT's into ours. The
  default targets leave out the gate the MLPs do not have and the Mamba2 out_proj PEFT
  refuses; named, out_proj trains but is not written as a PEFT file."""
  folder, hf = saved
  _, back = check_peft_round_trip(folder, hf, _hf_model, TOKENS, tmp_path,
                                  ["q_proj", "v_proj", "in_proj", "up_proj", "down_proj"])
  # PEFT's file names the trunk model.*; one naming it backbone.* reads the same.
  import shutil

  from safetensors.numpy import load_file, save_file
  shutil.copytree(tmp_path / "peft", tmp_path / "backbone")
  tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
  assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
  save_file({k.replace(".model.model.", ".model.backbone.", 1): v for k, v in tensors.items()},
            str(tmp_path / "backbone" / "adapter_model.safetensors"))
  renamed = models.from_pretrained(folder, adapter=str(tmp_path / "backbone"))
  np.testing.assert_array_equal(np.asarray(_jitted_logits(renamed, TOKENS)),
                                np.asarray(_jitted_logits(back, TOKENS)))
  cfg = models.from_pretrained(folder, lora_rank=2).cfg
  assert cfg.lora_target_names == ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                   "down_proj", "in_proj")
  named = models.from_pretrained(folder, lora_rank=2, lora_targets="in_proj,out_proj")
  assert named.cfg.lora_target_names == ("in_proj", "out_proj")
  with pytest.raises(ValueError, match="PEFT refuses adapters on a Mamba layer's out_proj"):
    models.save_lora_adapter(named, str(tmp_path / "out_proj"))
  lora = models.from_pretrained(folder, lora_rank=2, scan_layers=True)
  counted = sum(v.size for _, v in nnx.iter_graph(lora) if isinstance(v, nnx.LoRAParam))
  assert counted == cfg.num_lora_params
  with pytest.raises(ValueError, match="no gate"):
    cfg.replace(lora_targets="gate_proj,up_proj")


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_slots_and_resumed_rows_draw_what_one_call_draws(saved, scan):
  """Continuous batching's refilled slots and resumed rows carry the Mamba2 states and
  the attention cache past the cacheless MLP layers, token for token."""
  check_slots_and_resume_draw_one_calls_samples(
      models.from_pretrained(saved[0], scan_layers=scan), PROMPTS)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_a_pattern_of_many_runs_trains_as_its_layers_do(remat):
  """A pattern that does not repeat, of more than eight runs of one kind (as
  Nemotron-H-8B's): scanned, its unrolled layers rebuild in order under full remat
  (`_ordered_remat`) or are checkpointed each under another policy; its log-probs and
  every kind's gradients are the unscanned model's."""
  pattern = "M-M*-M-M*-M--"
  kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
  cfg = models.ModelConfig(
      vocab_size=64, d_model=32, num_layers=len(pattern), num_heads=4, num_kv_heads=2,
      head_dim=8, ffn_dim=48, layer_types=tuple(kinds[c] for c in pattern),
      rope_layers=(0,) * len(pattern), mlp_activation="relu2", linear_mixer="mamba2",
      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
      linear_value_head_dim=16, linear_conv_bias=True, linear_chunk=4, remat=remat)
  assert cfg.layer_period == cfg.num_layers
  layers = models.create_model(cfg, seed=0)
  scanned = models.relayout(layers, scan_layers=True)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 12))

  def loss(model):
    return model.token_logprobs(tokens, tokens).sum()

  (want, theirs), (got, ours) = (jax.jit(nnx.value_and_grad(loss))(m) for m in (layers, scanned))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for stack, path in (("linear_layers", ("linear_attn", "v_proj")), ("layers", ("attn", "q_proj")),
                      ("mlp_layers", ("mlp", "up_proj")), ("mlp_layers", ("input_norm", "scale"))):
    for j in range(len(theirs[stack])):
      a, b = theirs[stack][j], ours[stack]
      for k in path:
        a, b = a[k], b[k]
      np.testing.assert_allclose(np.asarray(b[...])[j], np.asarray(a[...]),
                                 atol=1e-5 * np.abs(np.asarray(a[...])).max())
