"""Hugging Face mixtures of experts (Qwen3-MoE, Mixtral): logits parity with `transformers`,
per-expert files in and out, loading onto a mesh, configs we cannot run."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

from tests.models.test_hf import _our_logits  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
              num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=256,
              rms_norm_eps=1e-6)
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 19))


def _hf_model(family, norm_topk_prob=True, **extra):
  extra = {**COMMON, **extra}
  if family == "qwen3_moe":
    cfg = transformers.Qwen3MoeConfig(head_dim=12, num_experts=6, num_experts_per_tok=2,
                                      moe_intermediate_size=24,
                                      norm_topk_prob=norm_topk_prob, **extra)
    cls = transformers.Qwen3MoeForCausalLM
  else:
    cfg = transformers.MixtralConfig(num_local_experts=5, num_experts_per_tok=2, **extra)
    cls = transformers.MixtralForCausalLM
  torch.manual_seed(0)
  model = cls(cfg).float().eval()
  with torch.no_grad():  # Non-unit norms, and routers that prefer different experts per token.
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(torch.randn_like(p) * 0.1)
      if name.endswith("gate.weight"):
        p.normal_(0.0, 0.5)
  return model


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen3_moe", False),
                                         ("mixtral", True)])
def test_logits_match_transformers(tmp_path, family, norm):
  hf = _hf_model(family, norm)
  hf.save_pretrained(tmp_path)
  ours = models.from_pretrained(str(tmp_path))
  assert ours.cfg.num_experts == (6 if family == "qwen3_moe" else 5)
  assert ours.cfg.norm_topk_prob == norm
  want = _hf_logits(hf, TOKENS)
  assert np.abs(_our_logits(ours, TOKENS) - want).max() <= 1e-4
  # The routing matters: with every expert's weights swapped for expert 0's the logits move.
  w = ours.layers[0].mlp.up_proj
  w.value = jnp.broadcast_to(w[...][:1], w.shape)
  assert np.abs(_our_logits(ours, TOKENS) - want).max() > 1e-3


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_saved_files_are_per_expert_and_load_in_transformers(tmp_path, family):
  hf = _hf_model(family)
  hf.save_pretrained(tmp_path / "a")
  ours = models.from_pretrained(str(tmp_path / "a"))
  models.save_pretrained(ours, str(tmp_path / "b"), max_shard_bytes=20_000)
  index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
  from safetensors.numpy import load_file
  published = set(load_file(tmp_path / "a" / "model.safetensors"))
  assert set(index["weight_map"]) == published  # the names transformers wrote, one per expert
  assert (("model.layers.1.mlp.experts.5.down_proj.weight" if family == "qwen3_moe" else
           "model.layers.1.block_sparse_moe.experts.4.w2.weight") in published)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").float().eval()
  assert np.abs(_hf_logits(back, TOKENS) - _hf_logits(hf, TOKENS)).max() <= 1e-5


def test_load_onto_a_mesh_with_scanned_layers(tmp_path):
  hf = _hf_model("qwen3_moe", num_key_value_heads=5)
  hf.save_pretrained(tmp_path)
  mesh = models.make_mesh((1, 2, 2, 1), devices=jax.devices()[:4])
  m = models.from_pretrained(str(tmp_path), mesh=mesh, scan_layers=True)
  gate = m.layers.mlp.gate_proj[...]
  assert gate.shape == (2, 6, 40, 24)
  assert gate.sharding.spec == jax.P(None, None, "fsdp", "tensor")
  got = np.asarray(jax.jit(lambda t: m(t, ctx=models.ShardingContext(mesh)))(TOKENS))
  assert np.abs(got - _hf_logits(hf, TOKENS)).max() <= 1e-4
  # Written back from the stacked layout: the same files.
  models.save_pretrained(m, str(tmp_path / "b"))
  from safetensors.numpy import load_file
  a, b = load_file(tmp_path / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
  assert set(a) == set(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("family,change,match", [
    ("qwen3_moe", {"mlp_only_layers": [1]}, "dense layers in a Qwen MoE model other than"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "dense layers in a Qwen MoE model other than"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true"),
    ("qwen3_moe", {"architectures": ["JetMoeForCausalLM"]}, "unsupported architecture"),
])
def test_configs_we_cannot_run_are_refused(tmp_path, family, change, match):
  _hf_model(family).save_pretrained(tmp_path)
  path = tmp_path / "config.json"
  path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
  with pytest.raises(ValueError, match=match):
    models.from_pretrained(str(tmp_path))


def test_mixtral_sliding_window_covers_every_layer(tmp_path):
  """A Mixtral config.json's sliding_window (shorter than the rows) applies to every layer,
  read and written back as transformers does."""
  hf = _hf_model("mixtral", sliding_window=4)
  hf.save_pretrained(tmp_path / "a")
  ours = models.from_pretrained(str(tmp_path / "a"))
  assert ours.cfg.sliding_window == 4 and all(ours.cfg.sliding_layers)
  want = _hf_logits(hf, TOKENS)
  assert np.abs(_our_logits(ours, TOKENS) - want).max() <= 1e-4
  full = models.from_pretrained(str(tmp_path / "a"), sliding_window=None)
  assert np.abs(_our_logits(full, TOKENS) - want).max() > 1e-2  # the window matters here
  models.save_pretrained(ours, str(tmp_path / "b"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").float().eval()
  assert back.config.sliding_window == 4
  assert np.abs(_hf_logits(back, TOKENS) - want).max() <= 1e-5


def test_a_missing_expert_is_named(tmp_path):
  _hf_model("mixtral").save_pretrained(tmp_path)
  from safetensors.numpy import load_file, save_file
  tensors = load_file(tmp_path / "model.safetensors")
  del tensors["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"is missing tensors.*experts\.3\.w1"):
    models.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_load_balancing_loss_matches_transformers_aux_loss(tmp_path, family):
  """The train step's router loss is `transformers`' aux_loss, padding masked out; a
  config.json that trains with it (output_router_logits) sets router_aux_loss_coef."""
  hf = _hf_model(family, output_router_logits=True, router_aux_loss_coef=0.02)
  hf.save_pretrained(tmp_path)
  ours = models.from_pretrained(str(tmp_path))
  assert ours.cfg.router_aux_loss_coef == 0.02
  mask = np.ones(TOKENS.shape, np.int64)
  mask[1, 11:] = 0
  router_loss = nnx.jit(lambda m, t, s: m.hidden_states(t, segment_ids_BxT=s,
                                                        router_loss=True)[1])
  for attention_mask in (None, mask):
    with torch.no_grad():
      want = float(hf(torch.tensor(TOKENS), attention_mask=None if attention_mask is None
                      else torch.tensor(attention_mask)).aux_loss)
    segments = None if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    got = router_loss(ours, jnp.asarray(TOKENS), segments)
    assert abs(float(got) - want) <= 1e-5 * want
  models.save_pretrained(ours, str(tmp_path / "b"))
  again = json.loads((tmp_path / "b" / "config.json").read_text())
  assert again["output_router_logits"] and again["router_aux_loss_coef"] == 0.02


@pytest.mark.slow
def test_attention_adapters_on_a_mixture_round_trip_through_peft(tmp_path):
  """LoRA on a mixture adapts the attention projections: the adapter files load in
  `peft` onto the published base and compute what ours does, and load back here."""
  peft = pytest.importorskip("peft")
  hf = _hf_model("qwen3_moe")
  hf.save_pretrained(tmp_path / "base")
  ours = models.from_pretrained(str(tmp_path / "base"), lora_rank=4, seed=3)
  adapters = nnx.state(ours, nnx.LoRAParam)
  nnx.update(ours, jax.tree.map(
      lambda v: v + 0.05 * jax.random.normal(jax.random.key(1), v.shape), adapters))
  models.save_lora_adapter(ours, str(tmp_path / "adapter"))
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").float().eval()
  adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
  want = _hf_logits(adapted, TOKENS)
  assert np.abs(_our_logits(ours, TOKENS) - want).max() <= 1e-4
  back = models.from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
  assert np.abs(_our_logits(back, TOKENS) - want).max() <= 1e-4
