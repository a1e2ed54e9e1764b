"""ERNIE 4.5 (Ernie4_5ForCausalLM, ERNIE-4.5-0.3B) against `transformers`: Llama whose rotary
embedding rotates interleaved pairs of each head (held as rotate-half over reordered q / k
rows). Logits (layer list and scanned), greedy generation through the sampler, export,
PEFT adapters, and the refusals."""

import json

import numpy as np
import pytest
from flax import nnx

from posttrain import models
from tests.models.parity import (check_export_round_trip, check_logits, greedy_tokens, hf_logits,
                                 perturb, save_families)

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.3, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
VARIANTS = {"tied": {}, "untied": dict(tie_word_embeddings=False)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 20))
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 33))]
_jitted_logits = nnx.jit(lambda m, t: m(t))


def _hf_model(variant):
  cfg = transformers.Ernie4_5Config(**{**COMMON, **VARIANTS[variant]})
  torch.manual_seed(0)
  return perturb(transformers.Ernie4_5ForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """variant -> (folder with the HF files, the HF model)."""
  return save_families(tmp_path_factory, VARIANTS, _hf_model)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved, variant, scan):
  cfg = models.from_pretrained(saved[variant][0]).cfg
  assert cfg.tie_embeddings == (variant == "tied") and not cfg.qkv_bias
  check_logits(*saved[variant], TOKENS, scan)


# The second variant (scanned) with the slow tests.
@pytest.mark.parametrize("variant,scan", [
    ("tied", False), pytest.param("untied", True, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(saved, variant, scan):
  for i, (got, want) in enumerate(greedy_tokens(*saved[variant], PROMPTS, 12, scan)):
    assert got == want, (variant, i)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_is_exact(saved, variant, tmp_path):
  written = check_export_round_trip(*saved[variant], transformers.Ernie4_5ForCausalLM,
                                    TOKENS, tmp_path / "out")
  assert written["model_type"] == "ernie4_5" and written["use_bias"] is False


def test_peft_adapters_round_trip(saved, tmp_path):
  """LoRA on the attention and MLP: the adapter files load in `peft` onto transformers'
  model and compute what ours does (q and k's B rows in HF's interleaved order), and load
  back here."""
  from tests.models.test_lora import randomise_adapters
  peft = pytest.importorskip("peft")
  folder, _ = saved["untied"]
  ours = randomise_adapters(models.from_pretrained(folder, lora_rank=4, lora_alpha=8.0))
  models.save_lora_adapter(ours, str(tmp_path / "adapter"))
  base = transformers.Ernie4_5ForCausalLM.from_pretrained(folder).float().eval()
  theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
  want = np.asarray(_jitted_logits(ours, TOKENS))
  np.testing.assert_allclose(hf_logits(theirs, TOKENS), want, atol=1e-4, rtol=0)
  again = models.from_pretrained(folder, adapter=str(tmp_path / "adapter"))
  np.testing.assert_allclose(np.asarray(_jitted_logits(again, TOKENS)), want, atol=1e-5,
                             rtol=0)


def test_what_cannot_be_read_or_written_is_refused(saved):
  config = json.loads(open(f"{saved['tied'][0]}/config.json").read())
  with pytest.raises(ValueError, match="use_bias=true in an ERNIE 4.5 config.json"):
    models.hf_config_to_model_config({**config, "use_bias": True})
  cfg = models.hf_config_to_model_config(config)
  with pytest.raises(ValueError, match="qkv_bias=True cannot be written as "
                                       "Ernie4_5ForCausalLM"):
    models.hf.check_exportable(cfg.replace(qkv_bias=True))
