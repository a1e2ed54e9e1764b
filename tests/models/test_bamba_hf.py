"""Bamba (BambaForCausalLM: Mamba2 layers, attention layers at attn_layer_indices with
half of each head rotated, a Llama MLP beside each) against `transformers`: logits in
both layouts, gradients, greedy generation through the sampler's recurrent state,
export, PEFT adapters on the Mamba2 and MLP projections, and refusals."""

import json

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from posttrain.models.hf import check_exportable
from tests.models.parity import (assert_close_to_scale, check_mamba2_cache,
                                 check_peft_round_trip, greedy_tokens, hf_logits,
                                 mamba2_hf_model, save_families, target_logprob_grads)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, mamba_n_heads=8, mamba_n_groups=2,
              mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model():
  return mamba2_hf_model(transformers.BambaForCausalLM, transformers.BambaConfig(**CONFIG))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return save_families(tmp_path_factory, ["bamba"], lambda _: _hf_model())["bamba"]


def test_config_reads_the_layers_and_the_half_rotation(saved):
  cfg = models.from_pretrained(saved[0]).cfg
  assert cfg.layer_types == ("linear_attention", "full_attention") * 2
  assert (cfg.linear_mixer, cfg.linear_num_key_heads, cfg.linear_key_head_dim,
          cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_chunk,
          cfg.linear_conv_bias) == ("mamba2", 2, 8, 8, 16, 8, True)
  assert cfg.rope.partial_rotary_factor == 0.5 and cfg.ffn_dim == 96
  m = models.from_pretrained(saved[0])
  assert m.cfg.num_params == sum(p.numel() for p in saved[1].parameters())


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_logits_match_transformers(saved, scan):
  folder, hf = saved
  want = hf_logits(hf, TOKENS)
  ours = models.from_pretrained(folder, scan_layers=scan)
  np.testing.assert_allclose(np.asarray(_jitted_logits(ours, TOKENS)), want, atol=2e-4, rtol=0)
  assert np.abs(want).max() > 1


def test_gradients_match_transformers(saved):
  """d(sum of the targets' log-probs) for a Mamba2 layer's in_proj and out_proj, the
  attention's q_proj (half its features rotated) and the MLP beside it."""
  folder, hf_model = saved
  grads = target_logprob_grads(hf_model, models.from_pretrained(folder), TOKENS)
  mamba, theirs = grads["linear_layers"][1]["linear_attn"], hf_model.model.layers[2].mamba
  rows = theirs.in_proj.weight.grad.numpy()  # [z (128); x (128); B (16); C (16); dt (8)]
  attn = grads["layers"][0]["attn"]
  hf_attn = hf_model.model.layers[1].self_attn
  pairs = [(np.asarray(mamba["v_proj"][...]).reshape(64, -1).T, rows[128:256]),
           (np.asarray(mamba["a_proj"][...]).T, rows[288:]),
           (np.asarray(mamba["o_proj"][...]).reshape(128, 64).T, theirs.out_proj.weight.grad),
           (np.asarray(attn["q_proj"][...]).reshape(64, -1).T, hf_attn.q_proj.weight.grad),
           (np.asarray(grads["layers"][0]["mlp"]["down_proj"][...]).T,
            hf_model.model.layers[1].feed_forward.down_proj.weight.grad)]
  for ours, want in pairs:
    assert_close_to_scale(ours, np.asarray(want), rel=2e-3)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["layers", "scanned"])
def test_greedy_generation_matches_transformers(saved, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved, PROMPTS, 10, scan)):
    assert got == want, i


def test_prefill_leaves_the_cache_transformers_keeps(saved):
  """After a prompt, each Mamba2 layer's cache is transformers': the recurrent state in
  its layout [batch, heads, head dim, state], and the last three inputs of x, B and C to
  the convolution (transformers keeps four, the oldest unused)."""
  folder, hf = saved
  ours = models.from_pretrained(folder)
  _, cache = ours(TOKENS, cache=models.init_cache(ours.cfg, 2, 32), prefill=True)
  with torch.no_grad():
    theirs = hf(torch.tensor(TOKENS), use_cache=True).past_key_values
  check_mamba2_cache(cache, theirs, (0, 2), (2, 8, 16, 8))


def test_export_round_trip_is_exact(saved, tmp_path):
  folder, hf = saved
  ours = models.from_pretrained(folder, scan_layers=True)
  models.save_pretrained(ours, str(tmp_path / "out"))
  from safetensors.numpy import load_file
  theirs, written = load_file(f"{folder}/model.safetensors"), load_file(
      tmp_path / "out" / "model.safetensors")
  assert set(written) == set(theirs)
  for name in ("model.layers.0.mamba.in_proj.weight", "model.final_layernorm.weight",
               "model.layers.2.pre_ff_layernorm.weight"):
    np.testing.assert_array_equal(written[name], theirs[name])
  back = transformers.BambaForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
  np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf, TOKENS))
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["attn_layer_indices"] == [1, 3] and config["model_type"] == "bamba"
  assert models.hf_config_to_model_config(config) == ours.cfg.replace(scan_layers=False)


def test_peft_adapters_round_trip(saved, tmp_path):
  """Adapters on the attention, the Mamba2 layers' in_proj / out_proj and the MLP
  (feed_forward), ours into PEFT and PEFT's into ours."""
  folder, hf = saved
  check_peft_round_trip(folder, hf, _hf_model, TOKENS, tmp_path,
                        ["q_proj", "v_proj", "in_proj", "out_proj", "gate_proj", "down_proj"])


def test_what_bamba_refuses(saved):
  folder, _ = saved
  config = json.loads(open(f"{folder}/config.json").read())
  with pytest.raises(ValueError, match=r"attn_layer_indices=\[1, 4\] in a BambaForCausalLM"):
    models.hf_config_to_model_config({**config, "attn_layer_indices": [1, 4]})
  with pytest.raises(ValueError, match="z_loss_coefficient=0.1"):
    models.hf_config_to_model_config({**config, "z_loss_coefficient": 0.1})
  cfg = models.from_pretrained(folder).cfg
  with pytest.raises(ValueError, match="partial_rotary_factor=1.0 cannot be written as "
                                       "BambaForCausalLM"):
    check_exportable(cfg.replace(rope=models.RopeConfig(theta=cfg.rope.theta)))
  with pytest.raises(ValueError, match="linear_mixer='mamba2' layers cannot be written as "
                                       "LlamaForCausalLM"):
    check_exportable(cfg.replace(architecture="LlamaForCausalLM"))
