"""Reward models across the Hugging Face boundary: *ForSequenceClassification in and out
(score parity with `transformers` on padded batches), a reward model started from a causal
LM, and the models and files we refuse."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models, planner

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

from tests.models.test_hf import COMMON  # noqa: E402

PAD = 0
D = COMMON["hidden_size"]
# Three right-padded rows of different lengths (prime T); real tokens avoid the pad id.
LENGTHS = np.array([13, 9, 4])
SEGMENTS = (np.arange(13)[None, :] < LENGTHS[:, None]).astype(np.int32)
TOKENS = np.random.default_rng(0).integers(1, COMMON["vocab_size"], (3, 13)) * SEGMENTS

FAMILIES = {  # family: (config class, extra config fields, class prefix)
    "llama": ("LlamaConfig", {}, "Llama"),
    "qwen2": ("Qwen2Config", {}, "Qwen2"),
    "qwen3": ("Qwen3Config", {"head_dim": 12}, "Qwen3"),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 12, "num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 24}, "Qwen3Moe"),
    "mixtral": ("MixtralConfig", {"num_local_experts": 5, "num_experts_per_tok": 2}, "Mixtral"),
    "mistral": ("MistralConfig", {"sliding_window": 4}, "Mistral"),
    # Sliding layers whose window (4) the longest row passes; Gemma 3's text classifier.
    "gemma2": ("Gemma2Config", {"head_dim": 12, "sliding_window": 4, "query_pre_attn_scalar": 12,
                                "attn_logit_softcapping": 5.0}, "Gemma2"),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 12, "sliding_window": 4,
                                    "query_pre_attn_scalar": 12, "sliding_window_pattern": 2},
               "Gemma3Text"),
}


def _hf_model(family, head="SequenceClassification", tie=False, num_labels=1):
  """A tiny random `transformers` model: <Family>For<head>, float32, every tensor random."""
  config_class, extra, prefix = FAMILIES[family]
  cfg = getattr(transformers, config_class)(
      **COMMON, **extra, tie_word_embeddings=tie, num_labels=num_labels, pad_token_id=PAD)
  torch.manual_seed(0)
  model = getattr(transformers, f"{prefix}For{head}")(cfg).float().eval()
  with torch.no_grad():  # Non-unit norms, biases, routers that differ; scores of unit scale.
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(torch.randn_like(p) * 0.1)
      if name.endswith("gate.weight"):
        p.normal_(0.0, 0.5)
      if name == "score.weight":
        p.normal_(0.0, 3.0 / np.sqrt(D))
  return model


def _hf_scores(model, tokens=TOKENS, segments=SEGMENTS):
  with torch.no_grad():
    out = model(torch.tensor(np.asarray(tokens)), attention_mask=torch.tensor(segments))
  return out.logits.numpy()[:, 0]


def _scores(model, tokens=TOKENS, segments=SEGMENTS):
  return np.asarray(model.scores(jnp.asarray(tokens), jnp.asarray(segments)))


def _assert_close(got, want, rtol=1e-5):
  scale = max(1.0, float(np.abs(want).max()))
  assert np.abs(np.asarray(got) - want).max() <= rtol * scale, (got, want)


def _tensor_names(folder):
  from safetensors import safe_open
  with safe_open(str(folder / "model.safetensors"), framework="numpy") as fh:
    return set(fh.keys())


def _param_paths(model):
  return {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model))}


# -- sequence classifiers in and out ----------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scores_match_transformers_and_export_loads_there(tmp_path, family):
  hf = _hf_model(family)
  hf.save_pretrained(tmp_path / "hf")
  ours = models.from_pretrained(str(tmp_path / "hf"))
  cfg = ours.cfg
  assert (cfg.architecture, cfg.lm_head, cfg.value_head, cfg.pad_token_id) == (
      hf.__class__.__name__, False, True, PAD)
  assert not any(p.startswith("lm_head") for p in _param_paths(ours))
  assert float(ours.value_b[...]) == 0.0
  want = _hf_scores(hf)
  assert np.abs(want).max() > 0.3  # a scale at which the tolerance means something
  _assert_close(_scores(ours), want)
  values = np.asarray(ours.values(jnp.asarray(TOKENS), segment_ids_BxT=jnp.asarray(SEGMENTS)))
  _assert_close(values[np.arange(3), LENGTHS - 1], want)

  models.save_pretrained(ours, str(tmp_path / "ours"))
  assert _tensor_names(tmp_path / "ours") == _tensor_names(tmp_path / "hf")
  assert "score.weight" in _tensor_names(tmp_path / "ours")
  written = json.loads((tmp_path / "ours" / "config.json").read_text())
  assert written["pad_token_id"] == PAD and written["id2label"] == {"0": "LABEL_0"}
  back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours")
  back = back.float().eval()
  assert back.__class__ is hf.__class__ and back.config.num_labels == 1
  _assert_close(_hf_scores(back), want)
  again = models.from_pretrained(str(tmp_path / "ours"))
  np.testing.assert_array_equal(_scores(again), _scores(ours))


def test_scores_take_the_last_real_token_of_each_row():
  cfg = models.get_preset("tiny", num_layers=1, value_head=True, lm_head=False)
  model = models.create_model(cfg)
  scores = nnx.jit(lambda m, t, s: m.scores(t, s))
  values_of = nnx.jit(lambda m, t, s: m.values(t, segment_ids_BxT=s))
  tokens = jnp.asarray(TOKENS)
  values = np.asarray(values_of(model, tokens, None))
  np.testing.assert_array_equal(np.asarray(scores(model, tokens, None)), values[:, -1])
  segments = SEGMENTS.copy()
  segments[2] = 0  # a row of padding alone
  got = np.asarray(scores(model, tokens, jnp.asarray(segments)))
  want_values = np.asarray(values_of(model, tokens, jnp.asarray(segments)))
  np.testing.assert_array_equal(got[:2], want_values[np.arange(2), LENGTHS[:2] - 1])
  assert got[2] == 0.0
  # Padding after a row's last token changes nothing: its score is that of the row alone.
  alone = np.asarray(scores(model, tokens[1:2, :LENGTHS[1]], None))
  np.testing.assert_allclose(got[1], alone[0], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_load_onto_a_mesh_with_scanned_layers_and_lora_exports_merged(tmp_path):
  hf = _hf_model("qwen2")
  hf.save_pretrained(tmp_path / "hf")
  mesh = models.make_mesh((1, 2, 1, 1), devices=jax.devices()[:2])
  ours = models.from_pretrained(str(tmp_path / "hf"), mesh=mesh, scan_layers=True, lora_rank=2)
  _assert_close(_scores(ours), _hf_scores(hf))  # fresh adapters (B = 0) change nothing
  rng = np.random.default_rng(1)
  for _, v in nnx.iter_graph(ours):
    if isinstance(v, nnx.LoRAParam):
      v[...] = jnp.asarray(rng.normal(size=v.shape) * 0.1, v.dtype)
  tuned = _scores(ours)
  assert np.abs(tuned - _hf_scores(hf)).max() > 1e-3
  models.save_pretrained(ours, str(tmp_path / "merged"))
  assert _tensor_names(tmp_path / "merged") == _tensor_names(tmp_path / "hf")
  back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
  _assert_close(_hf_scores(back.float().eval()), tuned, rtol=1e-4)


def test_pad_token_id_is_kept_or_given(tmp_path):
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path / "hf")
  ours = models.from_pretrained(str(tmp_path / "hf"))
  models.save_pretrained(ours, str(tmp_path / "given"), pad_token_id=5)
  assert json.loads((tmp_path / "given" / "config.json").read_text())["pad_token_id"] == 5
  unset = models.create_model(ours.cfg.replace(pad_token_id=None))
  models.save_pretrained(unset, str(tmp_path / "default"))
  assert json.loads((tmp_path / "default" / "config.json").read_text())["pad_token_id"] == 0


# -- a reward model started from a causal LM --------------------------------------------------


@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen3", True)])
def test_reward_model_from_a_causal_lm_keeps_the_trunk(tmp_path, family, tie):
  hf = _hf_model(family, head="CausalLM", tie=tie)
  hf.save_pretrained(tmp_path / "policy")
  arch = hf.__class__.__name__.replace("CausalLM", "SequenceClassification")
  policy = models.from_pretrained(str(tmp_path / "policy"))
  rm = models.from_pretrained(str(tmp_path / "policy"), value_head=True, lm_head=False,
                              architecture=arch, seed=3)
  assert (rm.cfg.architecture, rm.cfg.lm_head, rm.cfg.tie_embeddings) == (arch, False, tie)
  paths = _param_paths(rm)
  assert "embed" in paths and not any(p.startswith("lm_head") for p in paths)
  tokens = jnp.asarray(TOKENS)
  np.testing.assert_array_equal(np.asarray(rm.hidden_states(tokens)),
                                np.asarray(policy.hidden_states(tokens)))
  # The new score head: normal with TRL's std 1 / sqrt(D + 1), drawn from the seed; no bias.
  w = np.asarray(rm.value_w[...])
  np.testing.assert_allclose(w, np.asarray(jax.random.normal(jax.random.key(3), (D,)))
                             / np.sqrt(D + 1), rtol=1e-6)
  assert 0.6 < w.std() * np.sqrt(D + 1) < 1.4 and float(rm.value_b[...]) == 0.0
  with pytest.raises(ValueError, match="no language-model head"):
    rm(tokens)

  models.save_pretrained(rm, str(tmp_path / "rm"))
  names = _tensor_names(tmp_path / "rm")
  assert "score.weight" in names and "lm_head.weight" not in names
  back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
  assert back.__class__.__name__ == arch
  _assert_close(_hf_scores(back.float().eval()), _scores(rm))


def test_a_value_head_on_a_causal_lm_is_still_a_critic(tmp_path):
  hf = _hf_model("llama", head="CausalLM")
  hf.save_pretrained(tmp_path / "policy")
  critic = models.from_pretrained(str(tmp_path / "policy"), value_head=True, seed=3)
  assert critic.cfg.lm_head and critic.cfg.architecture == "LlamaForCausalLM"
  np.testing.assert_allclose(np.asarray(critic.value_w[...]),
                             np.asarray(jax.random.normal(jax.random.key(3), (D,))) * 0.02,
                             rtol=1e-6)
  with torch.no_grad():
    want = hf(torch.tensor(TOKENS)).logits.numpy()
  assert np.abs(np.asarray(critic(jnp.asarray(TOKENS))) - want).max() <= 1e-4
  models.save_pretrained(critic, str(tmp_path / "out"))  # a causal LM: the value head stays out
  assert _tensor_names(tmp_path / "out") == _tensor_names(tmp_path / "policy")


def test_without_lm_head_the_model_has_vocab_x_d_fewer_parameters():
  def count(cfg):
    return sum(x.size for x in jax.tree.leaves(models.abstract_model(cfg)[1]))

  base = models.get_preset("tiny", tie_embeddings=False, value_head=True)
  rm = base.replace(lm_head=False)
  assert count(base) - count(rm) == base.vocab_size * base.d_model
  assert (count(base), count(rm)) == (base.num_params, rm.num_params)
  tied = base.replace(tie_embeddings=True)  # the embedding stays: it is the input table
  assert count(tied) == count(tied.replace(lm_head=False)) == tied.replace(lm_head=False).num_params
  mesh = {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1}
  params, _ = planner.state_bytes(base, mesh)
  params_rm, _ = planner.state_bytes(rm, mesh)
  assert params - params_rm == 4 * base.vocab_size * base.d_model


# -- what we refuse -------------------------------------------------------------------------


def test_files_and_configs_we_cannot_hold_are_refused(tmp_path):
  _hf_model("qwen2", num_labels=2).save_pretrained(tmp_path / "two")
  with pytest.raises(ValueError, match="num_labels=2"):
    models.from_pretrained(str(tmp_path / "two"))

  _hf_model("llama").save_pretrained(tmp_path / "rm")
  from safetensors.numpy import load_file, save_file
  tensors = load_file(tmp_path / "rm" / "model.safetensors")
  del tensors["score.weight"]
  save_file(tensors, tmp_path / "rm" / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"is missing tensors: \['score.weight'\]"):
    models.from_pretrained(str(tmp_path / "rm"))

  with pytest.raises(ValueError, match="lm_head=False needs value_head=True"):
    models.get_preset("tiny", lm_head=False)


def test_a_reward_model_has_no_logits_or_logprobs():
  model = models.create_model(models.get_preset("tiny", num_layers=1, value_head=True,
                                                lm_head=False))
  tokens = jnp.asarray(TOKENS)
  for call in (lambda: model.token_logprobs(tokens, tokens), lambda: model(tokens),
               model.unembed):
    with pytest.raises(ValueError, match=r"no language-model head \(lm_head=False\)"):
      call()


def test_exports_the_class_cannot_hold_are_refused(tmp_path):
  cfg = models.get_preset("tiny", num_layers=1, value_head=True, lm_head=False,
                          architecture="LlamaForSequenceClassification")
  model = models.create_model(cfg)
  model.value_b[...] = jnp.float32(0.5)
  with pytest.raises(ValueError, match="value_b=0.5 cannot be written.*no bias"):
    models.save_pretrained(model, str(tmp_path / "bias"))
  assert not (tmp_path / "bias").exists()
  for bad, match in [
      (cfg.replace(architecture="LlamaForCausalLM"),
       "lm_head=False .* cannot be written as LlamaForCausalLM.*LlamaForSequenceClassification"),
      (cfg.replace(lm_head=True), "LlamaForSequenceClassification is a reward model"),
      (cfg.replace(architecture="MixtralForSequenceClassification"),
       "a mixture of experts is written as one of"),
      (cfg.replace(architecture="Qwen3ForSequenceClassification"), "qk_norm=False"),
  ]:
    with pytest.raises(ValueError, match=match):
      models.hf.check_exportable(bad)
  models.hf.check_exportable(cfg)


# -- LoRA reward models as PEFT adapters -------------------------------------------------------


def _randomise_lora_and_head(model, seed=1):
  rng = np.random.default_rng(seed)
  for _, v in nnx.iter_graph(model):
    if isinstance(v, nnx.LoRAParam):
      v[...] = jnp.asarray(rng.normal(size=v.shape) * 0.1, v.dtype)
  model.value_w[...] = jnp.asarray(rng.normal(size=model.value_w.shape) * 3 / np.sqrt(D),
                                   model.value_w.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("from_causal_lm", [False, True])
def test_a_lora_reward_model_saves_a_peft_seq_cls_adapter_with_its_score(tmp_path,
                                                                       from_causal_lm):
  """The adapter holds the trained score head beside the adapters: PEFT puts both on the
  base (a sequence classifier, or the causal LM the reward model started from) and
  scores as we do; loading it back here gives the same scores."""
  peft = pytest.importorskip("peft", reason="adapter tests need peft (pip install '.[parity]')")
  head = "CausalLM" if from_causal_lm else "SequenceClassification"
  _hf_model("llama", head=head).save_pretrained(tmp_path / "base")
  rm = {"value_head": True, "lm_head": False,
        "architecture": "LlamaForSequenceClassification"} if from_causal_lm else {}
  ours = models.from_pretrained(str(tmp_path / "base"), lora_rank=2, lora_alpha=4.0,
                                lora_targets="q_proj,v_proj,down_proj", **rm)
  _randomise_lora_and_head(ours)
  models.save_lora_adapter(ours, str(tmp_path / "adapter"))
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert config["task_type"] == "SEQ_CLS"
  assert config["modules_to_save"] == ["classifier", "score"]
  want = _scores(ours)
  base = transformers.AutoModelForSequenceClassification.from_pretrained(
      tmp_path / "base", num_labels=1, pad_token_id=PAD).float().eval()
  assert np.abs(_hf_scores(base) - want).max() > 1e-2  # adapters and head both matter
  pm = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
  _assert_close(_hf_scores(pm), want, rtol=1e-4)
  again = models.from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"),
                                 scan_layers=True, **rm)
  _assert_close(_scores(again), want)


def test_a_peft_seq_cls_adapter_loads_onto_the_reward_model(tmp_path):
  peft = pytest.importorskip("peft", reason="adapter tests need peft (pip install '.[parity]')")
  hf = _hf_model("qwen3")
  hf.save_pretrained(tmp_path / "base")
  pm = peft.get_peft_model(hf, peft.LoraConfig(task_type="SEQ_CLS", r=3, lora_alpha=6,
                                               target_modules=["k_proj", "o_proj", "up_proj"]))
  torch.manual_seed(2)
  with torch.no_grad():
    for name, p in pm.named_parameters():
      if "lora_B" in name or "modules_to_save" in name:
        p.normal_(0.0, 0.2)
  pm.eval().save_pretrained(tmp_path / "adapter")
  want = _hf_scores(pm)
  assert np.abs(want - _hf_scores(_hf_model("qwen3"))).max() > 1e-2
  ours = models.from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
  assert (ours.cfg.lora_rank, ours.cfg.lora_alpha) == (3, 6.0)
  _assert_close(_scores(ours), want, rtol=1e-4)
  # The same adapter on a causal LM that stays one: its score layer has nowhere to go.
  _hf_model("qwen3", head="CausalLM").save_pretrained(tmp_path / "lm")
  with pytest.raises(ValueError, match=r"modules_to_save=\['classifier', 'score'\] is not "
                                       r"supported \(a reward model's"):
    models.from_pretrained(str(tmp_path / "lm"), adapter=str(tmp_path / "adapter"))
