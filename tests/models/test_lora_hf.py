"""LoRA adapters across the Hugging Face boundary: PEFT adapter folders both ways, merged
export, fresh adapters on a loaded checkpoint, and adapter configs we refuse."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import models

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
peft = pytest.importorskip("peft", reason="adapter tests need peft (pip install '.[parity]')")

from tests.models.test_hf import TOKENS, _hf_logits, _hf_model, _our_logits  # noqa: E402

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
FIVE = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def _lora_params(model):
  """{(path...): LoRAParam} of a model, either layer layout."""
  return {tuple(p): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.LoRAParam)}


def _randomise_b(model, seed=1):
  """Nonzero B (fresh adapters have B = 0 and change nothing)."""
  rng = np.random.default_rng(seed)
  for path, v in _lora_params(model).items():
    if path[-1].endswith("_lora_b"):
      v[...] = jnp.asarray(rng.normal(size=v.shape) * 0.1, v.dtype)


def _logits(model):
  return _our_logits(model)


def _peft_adapter(tmp_path, family="qwen3", targets=FIVE):
  """(base folder, adapter folder, PEFT model) for an adapter PEFT itself made, B random."""
  hf = _hf_model(family)
  hf.save_pretrained(tmp_path / "base")
  targets = targets if isinstance(targets, str) else list(targets)
  config = peft.LoraConfig(r=3, lora_alpha=7, target_modules=targets, lora_dropout=0.0,
                           task_type="CAUSAL_LM")
  pm = peft.get_peft_model(hf, config)
  torch.manual_seed(1)
  with torch.no_grad():
    for name, p in pm.named_parameters():
      if "lora_B" in name:
        p.normal_(0.0, 0.1)
  pm.eval()
  pm.save_pretrained(tmp_path / "adapter")
  return str(tmp_path / "base"), str(tmp_path / "adapter"), pm


@pytest.mark.parametrize("family,scan_layers,targets", [
    ("llama", False, ALL),
    ("qwen2", True, "q_proj,v_proj,o_proj,down_proj"),
    ("qwen3", False, "k_proj,o_proj,gate_proj,up_proj"),
])
def test_save_lora_adapter_loads_in_peft(tmp_path, family, scan_layers, targets):
  hf = _hf_model(family)
  hf.save_pretrained(tmp_path / "base")
  ours = models.from_pretrained(str(tmp_path / "base"), lora_rank=3, lora_alpha=5.0,
                                lora_targets=targets, scan_layers=scan_layers)
  _randomise_b(ours)
  models.save_lora_adapter(ours, str(tmp_path / "adapter"), base_model_name_or_path="tiny")
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert config["r"] == 3 and config["lora_alpha"] == 5 and config["peft_type"] == "LORA"
  assert config["target_modules"] == targets.split(",")
  want = _logits(ours)
  assert np.abs(_hf_logits(hf, TOKENS) - want).max() > 1e-2  # The adapters matter.
  pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
  assert np.abs(_hf_logits(pm, TOKENS) - want).max() <= 1e-4
  # And back, into the other layer layout.
  again = models.from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"),
                                 scan_layers=not scan_layers)
  assert np.abs(_logits(again) - want).max() <= 1e-5


# PEFT saves "all-linear" expanded to full module names (model.layers.0.self_attn.q_proj).
@pytest.mark.parametrize("scan_layers,targets,names", [
    (False, FIVE, FIVE),
    (True, "all-linear", tuple(ALL.split(","))),
])
def test_peft_adapter_loads_onto_the_base(tmp_path, scan_layers, targets, names):
  base, adapter, pm = _peft_adapter(tmp_path, targets=targets)
  ours = models.from_pretrained(base, adapter=adapter, scan_layers=scan_layers)
  assert (ours.cfg.lora_rank, ours.cfg.lora_alpha) == (3, 7.0)
  assert ours.cfg.lora_target_names == names
  assert np.abs(_logits(ours) - _hf_logits(pm, TOKENS)).max() <= 1e-4


def test_save_pretrained_writes_the_merged_model(tmp_path):
  base, adapter, pm = _peft_adapter(tmp_path, family="qwen2", targets=("k_proj", "o_proj",
                                                                        "gate_proj"))
  ours = models.from_pretrained(base, adapter=adapter, scan_layers=True)
  models.save_pretrained(ours, str(tmp_path / "merged"))
  written = json.loads((tmp_path / "merged" / "config.json").read_text())
  assert not [k for k in written if "lora" in k]
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
  want = _hf_logits(pm.merge_and_unload(), TOKENS)
  assert np.abs(_hf_logits(back, TOKENS) - want).max() <= 1e-4
  plain = models.from_pretrained(str(tmp_path / "merged"))
  assert plain.cfg.lora_rank == 0
  assert np.abs(_logits(plain) - _logits(ours)).max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_lora_rank_override_starts_at_the_base_on_a_mesh(tmp_path, scan_layers):
  _hf_model("qwen3").save_pretrained(tmp_path)
  mesh = models.make_mesh((1, 2, 4, 1))  # 8 devices: fsdp 2, tensor 4.
  base = models.from_pretrained(str(tmp_path), mesh=mesh, scan_layers=scan_layers)
  ours = models.from_pretrained(str(tmp_path), mesh=mesh, scan_layers=scan_layers,
                                lora_rank=3, lora_targets="q_proj,o_proj,up_proj,down_proj")
  assert np.array_equal(_logits(ours), _logits(base))

  lead = (2,) if scan_layers else ()  # 2 layers, d 40, 5 heads of 12, ffn 56, rank 3.
  shapes = {"q_proj_lora_a": (40, 3), "q_proj_lora_b": (3, 5, 12),
            "o_proj_lora_a": (5, 12, 3), "o_proj_lora_b": (3, 40),
            "up_proj_lora_a": (40, 3), "up_proj_lora_b": (3, 56),
            "down_proj_lora_a": (56, 3), "down_proj_lora_b": (3, 40)}
  params = _lora_params(ours)
  assert len(params) == len(shapes) * (1 if scan_layers else 2)
  expected = models.state_shardings(nnx.state(ours, nnx.LoRAParam), mesh)
  for path, v in params.items():
    arr = v[...]
    assert arr.shape == lead + shapes[path[-1]], path
    want = expected
    for k in path:
      want = want[k]
    assert arr.sharding.is_equivalent_to(want.value, arr.ndim), (path, arr.sharding)
    if path[-1].endswith("_b"):
      assert not np.asarray(arr).any(), path
    else:
      bound = 1 / np.sqrt(np.prod(shapes[path[-1]][:-1]))
      assert 0 < np.abs(np.asarray(arr)).max() <= bound, path
  up_b = params[("layers", "mlp", "up_proj_lora_b") if scan_layers else
                (("layers", 0, "mlp", "up_proj_lora_b"))][...]
  assert "tensor" in up_b.sharding.spec  # ffn 56 splits 4 ways: the rules shard it.

  # The same draws whatever the layout or the mesh; another seed draws others.
  other = models.from_pretrained(str(tmp_path), scan_layers=not scan_layers, lora_rank=3,
                                 lora_targets="q_proj,o_proj,up_proj,down_proj")
  stacked = ours if scan_layers else other
  listed = other if scan_layers else ours
  a_stacked = np.asarray(stacked.layers.attn.q_proj_lora_a[...])
  for i in range(2):
    assert np.array_equal(np.asarray(listed.layers[i].attn.q_proj_lora_a[...]), a_stacked[i])
  assert not np.array_equal(a_stacked[0], a_stacked[1])
  reseeded = models.from_pretrained(str(tmp_path), lora_rank=3, seed=1)
  assert not np.array_equal(np.asarray(reseeded.layers[0].attn.q_proj_lora_a[...]),
                            np.asarray(listed.layers[0].attn.q_proj_lora_a[...]))


BAD_CONFIGS = [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"use_rslora": True}, "use_rslora=True is not supported"),
    ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=True is not supported"),
    ({"rank_pattern": {"q_proj": 5}}, "rank_pattern=.*q_proj.* is not supported"),
    ({"alpha_pattern": {"o_proj": 2}}, "alpha_pattern=.*o_proj.* is not supported"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\] is not supported"),
    ({"layers_to_transform": [0]}, r"layers_to_transform=\[0\] is not supported"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, r"target_modules \['embed_tokens'\]"),
    ({"target_modules": ["lm_head"]}, r"target_modules \['lm_head'\]"),
    ({"target_modules": ".*q_proj"}, r"target_modules='\.\*q_proj' is not supported"),
    ({"target_modules": ["model.layers.1.self_attn.q_proj", "v_proj"]},
     r"wrap \['q_proj'\] in only some layers"),
    ({"peft_type": "IA3"}, "peft_type='IA3' is not supported"),
    ({"r": 0}, "r=0; expected an int >= 1"),
]


@pytest.mark.parametrize("change,message", BAD_CONFIGS, ids=[str(c) for c, _ in BAD_CONFIGS])
def test_unsupported_adapter_configs_are_refused(tmp_path, change, message):
  base, adapter, _ = _peft_adapter(tmp_path)
  cfg_file = tmp_path / "adapter" / "adapter_config.json"
  cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **change}))
  with pytest.raises(ValueError, match=message) as err:
    models.from_pretrained(base, adapter=adapter)
  assert "\n" not in str(err.value) and "adapter_config.json" in str(err.value)


def test_bad_adapter_tensors_and_overrides_name_the_problem(tmp_path):
  base, adapter, _ = _peft_adapter(tmp_path)
  for override, value in (("lora_rank", 5), ("lora_alpha", 16.0), ("lora_targets", ALL)):
    with pytest.raises(ValueError, match=f"{override}={value!r} disagrees with the adapter"):
      models.from_pretrained(base, adapter=adapter, **{override: value})
  ok = models.from_pretrained(base, adapter=adapter, lora_rank=3,  # Repeating it is fine.
                              lora_targets="down_proj,up_proj,o_proj,v_proj,q_proj")
  assert ok.cfg.lora_rank == 3

  from safetensors.numpy import load_file, save_file
  path = tmp_path / "adapter" / "adapter_model.safetensors"
  tensors = load_file(path)
  name = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
  save_file({k: v for k, v in tensors.items() if k != name}, path)
  with pytest.raises(ValueError, match=r"adapter .* is missing tensors: \[.*layers.1.mlp.up_proj"):
    models.from_pretrained(base, adapter=adapter)
  extra = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
  save_file({**tensors, extra: np.zeros((3, 40), np.float32)}, path)
  with pytest.raises(ValueError, match=r"has unexpected tensors: \[.*layers.0.mlp.gate_proj"):
    models.from_pretrained(base, adapter=adapter)
  save_file({**tensors, name: np.zeros((4, 40), np.float32)}, path)
  with pytest.raises(ValueError, match=r"up_proj.lora_A.weight has shape \(4, 40\), expected "
                                       r"\(3, 40\)"):
    models.from_pretrained(base, adapter=adapter)

  plain = models.from_pretrained(base)
  with pytest.raises(ValueError, match="no LoRA adapters"):
    models.save_lora_adapter(plain, str(tmp_path / "none"))
