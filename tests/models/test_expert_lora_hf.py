"""LoRA adapters on a mixture's routed experts across the Hugging Face boundary: PEFT's
target_parameters adapters (mlp.experts.gate_up_proj / down_proj) both ways, against
PEFT on `transformers`, and the adapter configs we refuse."""

import json

import numpy as np
import pytest

from posttrain import models

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
peft = pytest.importorskip("peft", reason="adapter tests need peft (pip install '.[parity]')")

from tests.models.test_hf import _our_logits  # noqa: E402
from tests.models.test_lora_hf import _randomise_b  # noqa: E402
from tests.models.test_moe_hf import TOKENS, _hf_logits, _hf_model  # noqa: E402

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("family,targets,scan", [
    ("qwen3_moe", "q_proj,experts_gate_up_proj,experts_down_proj", False),
    ("mixtral", "experts_down_proj", True),
])
def test_saved_expert_adapters_load_in_peft_and_back(tmp_path, family, targets, scan):
  hf = _hf_model(family)
  hf.save_pretrained(tmp_path / "base")
  ours = models.from_pretrained(str(tmp_path / "base"), lora_rank=3, lora_alpha=5.0,
                                lora_targets=targets, scan_layers=scan)
  _randomise_b(ours)
  models.save_lora_adapter(ours, str(tmp_path / "adapter"))
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  names = targets.split(",")
  assert config["target_modules"] == [t for t in names if not t.startswith("experts_")]
  assert config["target_parameters"] == [
      "mlp.experts." + t[len("experts_"):] for t in names if t.startswith("experts_")]
  want = _our_logits(ours, TOKENS)
  base = _hf_logits(hf, TOKENS)
  assert np.abs(base - want).max() > 1e-2  # the adapters matter
  pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
  np.testing.assert_allclose(_hf_logits(pm, TOKENS), want, atol=1e-4)
  again = models.from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"),
                                 scan_layers=not scan)
  assert again.cfg.lora_target_names == tuple(names)
  np.testing.assert_allclose(_our_logits(again, TOKENS), want, atol=1e-5)
  # Merged, the experts' weights carry each expert's update.
  models.save_pretrained(models.merge_lora(ours), str(tmp_path / "merged"))
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
  np.testing.assert_allclose(_hf_logits(merged, TOKENS), want, atol=1e-4)


@pytest.mark.parametrize("parameters", [EXPERTS, ["experts.down_proj"]])
def test_an_adapter_peft_made_on_the_experts_loads(tmp_path, parameters):
  hf = _hf_model("qwen3_moe")
  hf.save_pretrained(tmp_path / "base")
  config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["v_proj"],
                           target_parameters=parameters, lora_dropout=0.0,
                           task_type="CAUSAL_LM")
  pm = peft.get_peft_model(hf, config)
  torch.manual_seed(1)
  with torch.no_grad():
    for name, p in pm.named_parameters():
      if "lora_" in name:  # every expert's A and B its own, B nonzero
        p.normal_(0.0, 0.2)
  pm.eval()
  pm.save_pretrained(tmp_path / "adapter")
  ours = models.from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
  assert ours.cfg.lora_rank == 2 and ours.cfg.lora_scale == 3.0
  want = _hf_logits(pm, TOKENS)
  with pm.disable_adapter():
    assert np.abs(_hf_logits(pm, TOKENS) - want).max() > 1e-2
  np.testing.assert_allclose(_our_logits(ours, TOKENS), want, atol=1e-4)


@pytest.mark.parametrize("parameters,message", [
    (["model.layers.0.mlp.experts.gate_up_proj"], "wrap gate_up_proj in only some layers"),
    (["mlp.experts.gate_proj"], r"target_parameters \['mlp.experts.gate_proj'\] are not"),
    ("mlp.experts.down_proj", "target_parameters='mlp.experts.down_proj' is not supported"),
])
def test_expert_adapter_configs_we_cannot_hold_are_refused(tmp_path, parameters, message):
  hf = _hf_model("qwen3_moe")
  hf.save_pretrained(tmp_path / "base")
  ours = models.from_pretrained(str(tmp_path / "base"), lora_rank=2,
                                lora_targets="q_proj,experts_down_proj")
  models.save_lora_adapter(ours, str(tmp_path / "adapter"))
  path = tmp_path / "adapter" / "adapter_config.json"
  config = json.loads(path.read_text())
  path.write_text(json.dumps({**config, "target_parameters": parameters}))
  with pytest.raises(ValueError, match=message):
    models.from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
