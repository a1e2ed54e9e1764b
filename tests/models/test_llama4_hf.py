"""Llama 4 (Llama4ForCausalLM, and the text model of Llama4ForConditionalGeneration)
against `transformers`: every layer a mixture routed top-1 by sigmoid scores with the
chosen expert's input scaled by its score, a shared expert, the rotary layers' q and k
normed without a weight after an interleaved rotary embedding and attending within chunks,
NoPE layers whose queries are scaled up by position. Config reading, logits (layer list,
scanned, the chunked kernel), gradients, greedy generation through the KV cache, export,
the vision-language files, the Scout preset's size, and what is refused."""

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (assert_close_to_scale, check_peft_round_trip, greedy_tokens,
                                 hf_logits, perturb, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

# 4 layers (the last NoPE), chunks of 4 positions and a temperature floor of 3, so that a
# 20-token row crosses five chunks and the NoPE layer's query scale changes six times.
COMMON = dict(vocab_size=97, hidden_size=40, intermediate_size=24, intermediate_size_mlp=48,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
              num_local_experts=5, num_experts_per_tok=1, max_position_embeddings=64,
              attention_chunk_size=4, floor_scale=3, attn_scale=0.5,
              rope_parameters={"rope_type": "default", "rope_theta": 100.0},
              initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=1)
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))
# Llama-4-Scout-17B-16E's text_config as published (meta-llama/Llama-4-Scout-17B-16E).
SCOUT_TEXT = {
    "attention_bias": False, "attention_chunk_size": 8192, "attn_scale": 0.1,
    "attn_temperature_tuning": True, "floor_scale": 8192, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "interleave_moe_layer_step": 1,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "max_position_embeddings": 10485760, "model_type": "llama4_text", "no_rope_layers": [],
    "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
    "num_key_value_heads": 8, "num_local_experts": 16, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "use_qk_norm": True,
    "vocab_size": 202048}


# Maverick's layout: every other layer a mixture (layers 1 and 3), the others dense MLPs
# of intermediate_size_mlp; no q/k norm.
MAVERICK = dict(interleave_moe_layer_step=2, use_qk_norm=False)


def _hf_model(name="llama4", **extra):
  del name
  cfg = transformers.Llama4TextConfig(**{**COMMON, **extra})
  torch.manual_seed(0)
  return perturb(transformers.Llama4ForCausalLM(cfg).float().eval())


def _config(folder):
  return json.loads(pathlib.Path(folder, "config.json").read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(folder with the files transformers wrote, the HF model)."""
  folder = str(tmp_path_factory.mktemp("llama4") / "model")
  hf = _hf_model()
  hf.save_pretrained(folder)
  return folder, hf


@pytest.fixture(scope="module")
def maverick(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("maverick") / "model")
  hf = _hf_model(**MAVERICK)
  hf.save_pretrained(folder)
  return folder, hf


def test_config_reads_every_llama4_feature(saved):
  cfg = models.from_pretrained(saved[0]).cfg
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.ffn_dim, cfg.shared_expert_dim,
          cfg.router_scoring, cfg.router_correction_bias, cfg.routed_input_scaling,
          cfg.norm_topk_prob, cfg.shared_expert_gate) == (
              5, 1, 24, 24, "sigmoid", False, True, False, False)
  assert cfg.rope_layers == (1, 1, 1, 0) and cfg.nope_layers == (False, False, False, True)
  assert (cfg.qk_l2_norm, cfg.qk_norm, cfg.attention_chunk_size, cfg.attn_temperature_tuning,
          cfg.attn_floor_scale, cfg.attn_scale) == (True, False, 4, True, 3.0, 0.5)
  # The chunked layers are sliding layers whose window is the chunk.
  assert cfg.sliding_window == 4 and cfg.sliding_layers == (True, True, True, False)
  assert cfg.rope.theta == 100.0 and cfg.norm_eps == 1e-5 and not cfg.tie_embeddings


@pytest.mark.parametrize("scan,impl", [(False, "reference"), (True, "reference"),
                                       (True, "chunked")],
                         ids=["layers", "scanned", "scanned-chunked"])
def test_logits_match_transformers(saved, scan, impl):
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  model = models.from_pretrained(folder, scan_layers=scan, attention_impl=impl,
                                 attention_chunk=8)
  got = np.asarray(_jitted_logits(model, TOKENS))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 3


@pytest.mark.parametrize("change", [
    dict(qk_l2_norm=False), dict(attention_chunk_size=0, sliding_window=None, layer_types=()),
    dict(attention_chunk_size=0), dict(attn_temperature_tuning=False),
    dict(routed_input_scaling=False), dict(rope_layers=())])
def test_each_part_moves_the_logits(saved, change):
  """Each Llama 4 option matters here: without it the logits move (so the parity above
  is not blind to it). Without the chunks the sliding layers see their trailing window
  instead, which differs too."""
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  changed = models.from_pretrained(folder, **change)
  assert np.abs(np.asarray(_jitted_logits(changed, TOKENS)) - want).max() > 1e-3


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for the router (through the chosen expert's score,
  which scales its input), the experts, the shared expert and the attention."""
  folder, hf_model = saved
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  f, h = COMMON["intermediate_size"], COMMON["head_dim"]
  # Our q / k features per head in rotate-half order: HF's interleaved pairs reordered.
  order = np.concatenate([np.arange(0, h, 2), np.arange(1, h, 2)])
  for i in range(COMMON["num_hidden_layers"]):
    layer, hf = grads["layers"][i], hf_model.model.layers[i]
    moe = hf.feed_forward
    gate_up = moe.experts.gate_up_proj.grad.numpy()  # [E, D, 2F]: gate's F, then up's
    q = np.asarray(layer["attn"]["q_proj"][...])  # [D, N, H]
    hf_q = hf.self_attn.q_proj.weight.grad.numpy().reshape(4, h, -1)[:, order]
    pairs = [(np.asarray(layer["mlp"]["router"][...]).T, moe.router.weight.grad),
             (layer["mlp"]["gate_proj"][...], gate_up[..., :f]),
             (layer["mlp"]["up_proj"][...], gate_up[..., f:]),
             (layer["mlp"]["down_proj"][...], moe.experts.down_proj.grad),
             (np.asarray(layer["mlp"]["shared"]["gate_proj"][...]).T,
              moe.shared_expert.gate_proj.weight.grad),
             (q.transpose(1, 2, 0), hf_q),
             (layer["input_norm"]["scale"][...], hf.input_layernorm.weight.grad)]
    for ours, theirs in pairs:
      assert_close_to_scale(ours, np.asarray(theirs))


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  """Through our KV cache and decode attention (the chunked layers' local_chunk over
  rings of 8 slots, the NoPE layer's query scale at each new position), prompts longer
  than a chunk."""
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, scan)):
    assert got == want, i


def test_maverick_layout_reads_its_dense_layers_between_the_mixtures(maverick):
  folder, hf = maverick
  m = models.from_pretrained(folder)
  cfg = m.cfg
  assert (cfg.moe_layer_step, cfg.dense_ffn_dim, cfg.dense_layers, cfg.qk_l2_norm) == (
      2, 48, 0, False)
  assert cfg.mixture_flags == (False, True, False, True)
  assert models.transformer.layer_stacks(cfg) == (("dense_layers", (0, 2)),
                                                  ("layers", (1, 3)))
  np.testing.assert_array_equal(
      np.asarray(m.dense_layers[1].mlp.gate_proj[...]).T,
      hf.model.layers[2].feed_forward.gate_proj.weight.detach().numpy())
  assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("scan,remat", [(False, "none"), (True, "none"), (True, "full")],
                         ids=["layers", "scanned", "scanned-remat"])
def test_maverick_logits_and_gradients_match_transformers(maverick, scan, remat):
  """One scan over periods of a dense and a mixture layer (rematerialised layer by
  layer, or not) gives transformers' logits and the dense and mixture layers' gradients."""
  folder, hf_model = maverick
  model = models.from_pretrained(folder, scan_layers=scan, remat=remat)
  want = hf_logits(hf_model, TOKENS)
  np.testing.assert_allclose(np.asarray(_jitted_logits(model, TOKENS)), want, atol=1e-4,
                             rtol=0)
  grads = target_logprob_grads(hf_model, model, TOKENS)
  dense, mixture = grads["dense_layers"], grads["layers"]
  if scan:  # stacked: layer j of each stack
    dense, mixture = ([jax.tree.map(lambda a, j=j: a[j], g) for j in range(2)]
                      for g in (dense, mixture))
  for j in range(2):
    hf_dense = hf_model.model.layers[2 * j].feed_forward
    hf_moe = hf_model.model.layers[2 * j + 1].feed_forward
    pairs = [(np.asarray(dense[j]["mlp"]["down_proj"][...]).T, hf_dense.down_proj.weight.grad),
             (np.asarray(mixture[j]["mlp"]["router"][...]).T, hf_moe.router.weight.grad),
             (mixture[j]["mlp"]["down_proj"][...], hf_moe.experts.down_proj.grad)]
    for ours, theirs in pairs:
      assert_close_to_scale(ours, np.asarray(theirs))


def _export_exactly(folder, out):
  """Loads `folder` scanned and writes it to `out`: the names transformers wrote, each
  tensor as it was, and a config.json that reads back to ours. Returns that config."""
  from safetensors.numpy import load_file
  ours = models.from_pretrained(folder, scan_layers=True)
  models.save_pretrained(ours, str(out))
  before, after = (load_file(f"{f}/model.safetensors") for f in (folder, out))
  assert set(after) == set(before)
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)
  written = json.loads((out / "config.json").read_text())
  assert models.hf_config_to_model_config(written) == ours.cfg.replace(scan_layers=False)
  return written


def test_maverick_greedy_generation_and_export(maverick, tmp_path):
  """Scanned, through the stacked KV cache; written back from the scanned layout, the
  files transformers wrote, each tensor as it was."""
  for i, (got, want) in enumerate(greedy_tokens(*maverick, PROMPTS, 10, True)):
    assert got == want, i
  written = _export_exactly(maverick[0], tmp_path / "out")
  assert (written["interleave_moe_layer_step"], written["moe_layers"],
          written["intermediate_size_mlp"]) == (2, [1, 3], 48)


def test_export_round_trip_is_exact(saved, tmp_path):
  """From the scanned layout: the names transformers wrote, each tensor as it was,
  loadable by transformers with the same logits, and a config.json that reads back."""
  folder, hf = saved
  written = _export_exactly(folder, tmp_path / "out")
  back = transformers.Llama4ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  assert written["model_type"] == "llama4_text"
  assert written["layer_types"] == ["chunked_attention"] * 3 + ["full_attention"]


def test_vision_language_files_load_their_language_model(saved, tmp_path):
  """Llama4ForConditionalGeneration's files as published: text_config nested, the text
  tensors under language_model.model.* and language_model.lm_head, a vision tower beside
  them (left unread)."""
  from safetensors.numpy import load_file, save_file
  folder, hf = saved
  tensors = {("language_model." + name): value
             for name, value in load_file(f"{folder}/model.safetensors").items()}
  tensors["vision_model.patch_embedding.linear.weight"] = np.zeros((8, 6), np.float32)
  (tmp_path / "vl").mkdir()
  save_file(tensors, str(tmp_path / "vl" / "model.safetensors"))
  text = {k: v for k, v in _config(folder).items() if k not in ("architectures",)}
  config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
            "text_config": text, "vision_config": {"model_type": "llama4_vision_model"},
            "tie_word_embeddings": False}
  (tmp_path / "vl" / "config.json").write_text(json.dumps(config))
  got = np.asarray(_jitted_logits(models.from_pretrained(str(tmp_path / "vl")), TOKENS))
  np.testing.assert_allclose(got, hf_logits(hf, TOKENS), atol=1e-4, rtol=0)


def test_scout_preset_is_the_published_config_and_size():
  """Scout's text model: 107.8B parameters (the published 109B counts the vision tower
  too), 17.2B active (17B as published)."""
  preset = models.get_preset("llama4_scout")
  read = models.hf_config_to_model_config(
      {"architectures": ["Llama4ForConditionalGeneration"], "text_config": SCOUT_TEXT,
       "torch_dtype": "bfloat16", "tie_word_embeddings": False},
      remat=preset.remat, scan_layers=preset.scan_layers)
  assert read == preset
  assert abs(preset.num_params / 107.8e9 - 1) < 0.005
  assert abs(preset.num_active_params / 17.2e9 - 1) < 0.01
  _, state = models.abstract_model(preset)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == preset.num_params
  models.hf.check_exportable(preset)


def test_maverick_preset_has_the_published_size():
  """400B parameters and 17B active, as published: 400.7B and 17.2B for the text model
  (the published total rounds the vision tower in); the abstract model holds as many."""
  preset = models.get_preset("llama4_maverick")
  assert preset.mixture_flags == (False, True) * 24
  assert abs(preset.num_params / 400e9 - 1) < 0.005
  assert abs(preset.num_active_params / 17.2e9 - 1) < 0.01
  _, state = models.abstract_model(preset)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == preset.num_params
  models.hf.check_exportable(preset)
  written = models.hf.model_config_to_hf(preset)
  assert (written["interleave_moe_layer_step"], written["intermediate_size_mlp"],
          written["use_qk_norm"]) == (2, 16_384, False)
  assert models.hf_config_to_model_config(written, remat="full", scan_layers=True) == preset


@pytest.mark.parametrize("change,match", [
    ({"moe_layers": [0, 1, 3]}, r"moe_layers=\[0, 1, 3\] in a Llama 4 config.json"),
    ({"moe_layers": [1, 2]}, r"moe_layers=\[1, 2\] in a Llama 4 config.json"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types=.* in a Llama 4 config.json"),
    ({"attention_chunk_size": None}, "layer_types=.* in a Llama 4 config.json"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers has 2 entries for 4 layers"),
    ({"architectures": ["Llama4ForSequenceClassification"]}, "unsupported architecture"),
])
def test_configs_we_cannot_run_are_refused(saved, tmp_path, change, match):
  config = _config(saved[0])
  config.pop("moe_layers", None)
  (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
  with pytest.raises(ValueError, match=match):
    models.from_pretrained(str(tmp_path))


def test_what_cannot_be_written_is_refused(saved, tmp_path):
  cfg = models.from_pretrained(saved[0]).cfg
  for change, match in [
      (dict(routed_input_scaling=False), "routed_input_scaling=False cannot be written"),
      (dict(shared_expert_dim=48), "shared_expert_dim=48 cannot be written"),
      (dict(qk_norm=True), "has no weighted q/k norms")]:
    with pytest.raises(ValueError, match=match):
      models.hf.check_exportable(cfg.replace(**change))
  qwen = models.get_preset("qwen3_30b_a3b").replace(num_layers=2)
  with pytest.raises(ValueError, match="moe_layer_step=2 cannot be written as Qwen3Moe"):
    models.hf.check_exportable(qwen.replace(moe_layer_step=2, dense_ffn_dim=64))
  llama = models.get_preset("llama3_8b").replace(num_layers=2)
  with pytest.raises(ValueError, match=r"\['qk_l2_norm'\] cannot be written as Llama"):
    models.hf.check_exportable(llama.replace(qk_l2_norm=True))


@pytest.mark.parametrize("layout", ["scout", "maverick"])
def test_peft_adapter_files_in_and_out(saved, maverick, tmp_path, layout):
  """Our adapters (attention, the MLP names on the shared experts and Maverick's dense
  layers, and the routed experts' gate_up_proj [E, D, 2F] and down_proj) load in PEFT
  with our logits, q and k's B rows in HF's interleaved order; and an adapter PEFT made
  loads in ours with PEFT's logits."""
  pytest.importorskip("peft", reason="adapter tests need peft")
  folder, hf = saved if layout == "scout" else maverick
  targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
  experts = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
  ours, back = check_peft_round_trip(
      folder, hf, lambda: _hf_model(**({} if layout == "scout" else MAVERICK)), TOKENS,
      tmp_path, targets, target_parameters=experts)
  assert json.loads((ours / "adapter_config.json").read_text())["target_parameters"] == experts
  assert back.cfg.lora_target_names[-2:] == ("experts_gate_up_proj", "experts_down_proj")


def test_sampled_logprobs_equal_the_learners_packed_or_not(saved):
  """On-policy at step 0: the sampler's behaviour log-probs (prefill and decode through
  rings of 8 slots, decode attention's local_chunk, the NoPE layer's scale at each new
  position) are the learner's, whether it reads each row alone or two packed in one row
  (the second from offset 11, not a chunk boundary: its positions restart, its chunks
  and query scales are its own)."""
  from posttrain.sampling import Sampler
  model = models.from_pretrained(saved[0], scan_layers=True)
  out = Sampler(model, max_len=48, extend_chunk=4).generate(
      PROMPTS, max_new_tokens=10, temperature=1.0, seed=3)
  seqs = [list(p) + list(c[:n]) for p, c, n in zip(PROMPTS, out.tokens, out.lengths)]
  for i, seq in enumerate(seqs):  # each generated token's log-prob, the row alone
    tokens = np.asarray([seq])
    logp = np.asarray(model.token_logprobs(tokens[:, :-1], tokens[:, 1:]))[0]
    np.testing.assert_allclose(logp[len(PROMPTS[i]) - 1:], out.logprobs[i, :out.lengths[i]],
                               atol=1e-5, err_msg=f"row {i}")
  a, b = seqs[1], seqs[2]  # 11 and 23 tokens in one row of 40
  tokens = np.zeros((1, 40), np.int32)
  tokens[0, :len(a) + len(b)] = a + b
  positions = np.zeros((1, 40), np.int32)
  positions[0, :len(a) + len(b)] = list(range(len(a))) + list(range(len(b)))
  segments = np.zeros((1, 40), np.int32)
  segments[0, :len(a)], segments[0, len(a):len(a) + len(b)] = 1, 2
  packed = np.asarray(model.token_logprobs(tokens, np.roll(tokens, -1, axis=1), positions,
                                           segments))[0]
  for i, (first, seq) in ((1, (0, a)), (2, (len(a), b))):
    generated = packed[first + len(PROMPTS[i]) - 1:first + len(seq) - 1]
    np.testing.assert_allclose(generated, out.logprobs[i, :out.lengths[i]], atol=1e-5,
                               err_msg=f"packed row {i}")
