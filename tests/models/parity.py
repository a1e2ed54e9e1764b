"""What the family parity tests against `transformers` share: logits on both sides, the
gradients of the targets' log-probs, and a reward model's scores in and out."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import models


def hf_logits(model, tokens):
  """transformers' logits of int tokens [B, T], as numpy."""
  import torch
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def target_logprob_grads(hf_model, ours, tokens):
  """d(sum of the next tokens' log-probs) of `tokens` for both models: transformers'
  land in its parameters' .grad, ours are returned as a state of the same tree."""
  import torch
  targets = np.roll(tokens, -1, axis=1)
  hf_model.zero_grad()
  logp = torch.log_softmax(hf_model(torch.tensor(tokens)).logits, -1)
  logp.gather(-1, torch.tensor(targets)[..., None]).sum().backward()
  graphdef, state = nnx.split(ours)

  def loss(state):
    logits = nnx.merge(graphdef, state)(jnp.asarray(tokens))
    lp = jax.nn.log_softmax(logits, -1)
    return jnp.take_along_axis(lp, jnp.asarray(targets)[..., None], -1).sum()

  return jax.jit(jax.grad(loss))(state)


def assert_close_to_scale(ours, theirs, rel=5e-4):
  """Float32 through large random weights: the error relative to the gradient's own
  scale (a wrong term moves it by percents)."""
  got, want = np.asarray(ours).reshape(-1), np.asarray(theirs).reshape(-1)
  assert np.abs(got - want).max() < rel * np.abs(want).max()


def check_reward_model_round_trip(hf, cls, tmp_path):
  """A *ForSequenceClassification `hf` of class `cls`: our scores at each row's last real
  token are its logits, and what we write back loads in transformers with the same."""
  import torch
  hf.save_pretrained(str(tmp_path / "rm"))
  ours = models.from_pretrained(str(tmp_path / "rm"))
  assert not ours.cfg.lm_head and ours.cfg.value_head
  tokens = np.array([[5, 6, 7, 8, 9, 0, 0], [3, 4, 5, 6, 7, 8, 9]])
  with torch.no_grad():
    want = hf(torch.tensor(tokens)).logits[:, 0].numpy()
  got = np.asarray(ours.scores(jnp.asarray(tokens), jnp.asarray((tokens != 0).astype(np.int32))))
  np.testing.assert_allclose(got, want, atol=1e-4)
  models.save_pretrained(ours, str(tmp_path / "back"))
  back = cls.from_pretrained(str(tmp_path / "back"))
  with torch.no_grad():
    np.testing.assert_allclose(back.float()(torch.tensor(tokens)).logits[:, 0].numpy(), want,
                               atol=1e-5)


def save_families(tmp_path_factory, names, make):
  """name -> (folder holding make(name)'s save_pretrained files, the HF model)."""
  out = {}
  for name in names:
    folder = str(tmp_path_factory.mktemp(name) / "model")
    hf = make(name)
    hf.save_pretrained(folder)
    out[name] = (folder, hf)
  return out


def greedy_tokens(folder, hf_model, prompts, new_tokens, scan):
  """[(our sampler's greedy tokens, transformers' generate()'s)] per prompt; ours from one
  batched generate call through the KV cache (blocks of 4 slots)."""
  import torch

  from posttrain.sampling import Sampler
  sampler = Sampler(models.from_pretrained(folder, scan_layers=scan), max_len=48,
                    extend_chunk=4)
  out = sampler.generate(prompts, max_new_tokens=new_tokens, temperature=0.0)
  pairs = []
  for i, prompt in enumerate(prompts):
    with torch.no_grad():
      want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    pairs.append((out.tokens[i].tolist(), want))
  return pairs


def perturb(model, seed: int = 0, scale: float = 0.3, biases: bool = True):
  """Moves a fresh transformers model's norm scales (one at init) and biases (zero) off
  their initial values, so that each of them moves the logits; returns the model."""
  import torch
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or (biases and name.endswith("bias")):
        p.add_(torch.randn_like(p) * scale)
  return model


def spread_routers(model, std: float = 0.5):
  """Draws a transformers mixture's router weights (every `gate.weight`) with std `std`,
  so that tokens prefer different experts; returns the model."""
  import torch
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("gate.weight"):
        p.normal_(0.0, std)
  return model


def randomize_correction_biases(model, seed: int = 0, scale: float = 0.3):
  """Draws a sigmoid router's e_score_correction_bias buffers (zero at init; GLM-4.5,
  DeepSeek-V3), so that the choice of experts depends on them; returns the model."""
  import torch
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, buf in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buf.copy_(torch.randn_like(buf) * scale)
  return model


def check_peft_round_trip(folder, hf, fresh_hf, tokens, tmp_path, targets,
                          target_parameters=None, peft_targets=None, scan: bool = True,
                          atol: float = 1e-4):
  """PEFT adapter files both ways for the HF folder `folder` (`hf` its model, `fresh_hf()`
  a new copy of it): ours (rank 3, B random) load in PEFT with our logits, and an adapter
  PEFT made (rank 2, B random) loads in ours with PEFT's logits. `targets`: our
  lora_targets, and the target_modules names unless `peft_targets` gives those (a family
  whose modules are named otherwise: LFM2's); `target_parameters`: PEFT's names of the
  routed experts, adapted too. Returns (our adapter's folder, the model read from
  PEFT's). `scan`: ours with its layers scanned (else as a list); `atol`: of the logits
  both ways."""
  import peft
  experts = "".join(f",experts_{p.rsplit('.', 1)[-1]}" for p in target_parameters or ())
  ours = models.from_pretrained(folder, lora_rank=3, lora_alpha=5.0, scan_layers=scan,
                                lora_targets=",".join(targets) + experts)
  rng = np.random.default_rng(1)
  for path, v in nnx.iter_graph(ours):
    if isinstance(v, nnx.LoRAParam) and str(path[-1]).endswith("_lora_b"):
      v[...] = rng.normal(size=v.shape).astype(np.float32) * 0.3
  models.save_lora_adapter(ours, str(tmp_path / "ours"))
  logits = nnx.jit(lambda m, t: m(t))
  want = np.asarray(logits(ours, tokens))
  assert np.abs(hf_logits(hf, tokens) - want).max() > 1e-2  # the adapters matter
  loaded = peft.PeftModel.from_pretrained(fresh_hf(), str(tmp_path / "ours")).eval()
  np.testing.assert_allclose(hf_logits(loaded, tokens), want, atol=atol, rtol=0)
  made = _peft_made(fresh_hf, tmp_path / "peft", list(peft_targets or targets),
                    target_parameters)
  back = models.from_pretrained(folder, adapter=str(tmp_path / "peft"))
  np.testing.assert_allclose(np.asarray(logits(back, tokens)), hf_logits(made, tokens),
                             atol=atol, rtol=0)
  return tmp_path / "ours", back


def _peft_made(fresh_hf, out, target_modules, target_parameters=None):
  """An adapter PEFT makes on `fresh_hf()` (rank 2, alpha 3, B random), saved to `out`;
  returns the PEFT model."""
  import peft
  import torch
  config = peft.LoraConfig(r=2, lora_alpha=3, target_modules=target_modules,
                           target_parameters=target_parameters, lora_dropout=0.0,
                           task_type="CAUSAL_LM")
  made = peft.get_peft_model(fresh_hf(), config)
  torch.manual_seed(2)
  with torch.no_grad():
    for name, p in made.named_parameters():
      if "lora_B" in name:
        p.normal_(0.0, 0.3)
  made.eval().save_pretrained(str(out))
  return made


def check_fused_qkv_peft(folder, hf, fresh_hf, tokens, tmp_path, fused, other, targets):
  """PEFT adapter files of a class whose q, k and v are one module (`fused`): one PEFT
  made on it and on `other` (rank 2, B random) loads into ours with PEFT's logits (q, k
  and v each the one A and their rows of B); ours on q, k and v are refused for writing
  with a one-line error; ours on `other` alone (our `targets`) go both ways."""
  import pytest
  made = _peft_made(fresh_hf, tmp_path / "fused", [fused, other])
  back = models.from_pretrained(folder, adapter=str(tmp_path / "fused"))
  assert {"q_proj", "k_proj", "v_proj"} <= set(back.cfg.lora_target_names)
  want = hf_logits(made, tokens)
  assert np.abs(want - hf_logits(hf, tokens)).max() > 1e-2  # the adapter matters
  got = np.asarray(nnx.jit(lambda m, t: m(t))(back, tokens))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  with pytest.raises(ValueError, match=f"are read, not written: PEFT wraps its fused {fused}"):
    models.save_lora_adapter(back, str(tmp_path / "refused"))
  check_peft_round_trip(folder, hf, fresh_hf, tokens, tmp_path / "other", targets,
                        peft_targets=[other])


def check_slots_and_resume_draw_one_calls_samples(model, prompts):
  """A sampler's slots (rows refilled as others stop) and resumed rows (a call kept and
  continued) draw what one call over `prompts` draws, token for token."""
  from posttrain.sampling import Sampler
  sampler = Sampler(model, max_len=48, extend_chunk=4)
  kwargs = dict(temperature=1.0, seed=3)
  whole = sampler.generate(prompts, max_new_tokens=12, **kwargs)
  slots = sampler.generate(prompts, max_new_tokens=12, slots=2, **kwargs)
  np.testing.assert_array_equal(slots.tokens, whole.tokens)
  np.testing.assert_allclose(slots.logprobs, whole.logprobs, atol=1e-4)
  first = sampler.generate(prompts, max_new_tokens=5, keep_cache=True, reserve_tokens=12,
                           **kwargs)
  rest = sampler.resume(first.resume_state, list(range(len(prompts))), max_new_tokens=7)
  for i in range(len(prompts)):
    n = int(first.lengths[i])
    joined = first.tokens[i, :n].tolist() + rest.tokens[i, :rest.lengths[i]].tolist()
    assert joined == whole.tokens[i, :whole.lengths[i]].tolist(), i


def mamba2_hf_model(model_class, config):
  """A fresh transformers Mamba2 hybrid of `model_class` (seed 0, float32, eval), its
  norms and biases moved off their initial values (`perturb`) and its A, D and dt_bias
  drawn per head (`spread_mamba2_parameters`)."""
  import torch
  torch.manual_seed(0)
  return spread_mamba2_parameters(perturb(model_class(config).float().eval()))


def spread_mamba2_parameters(model):
  """A fresh transformers Mamba2 mixer's A (1..heads), D and dt_bias (one) drawn per
  head instead, so that each of them moves the outputs; returns the model."""
  import torch
  with torch.no_grad():
    trunk = getattr(model, "model", None) or model.backbone  # Mamba2ForCausalLM's
    for layer in trunk.layers:
      # Granite 4's and Bamba's mamba, or Nemotron-H's mixer when it is one.
      mamba = getattr(layer, "mamba", None) or getattr(layer, "mixer", None)
      if mamba is not None and hasattr(mamba, "A_log"):
        mamba.A_log.uniform_(-1.0, 1.0)
        mamba.D.normal_(1.0, 0.5)
        mamba.dt_bias.normal_(0.0, 1.0)
  return model


def check_mamba2_cache(cache, hf_cache, layers, state_shape):
  """Our cache after a prompt against transformers' `hf_cache` at each Mamba2 layer of
  `layers`: the recurrent state in its layout [batch, heads, head dim, state]
  (`state_shape`), and the last three inputs of x, B and C to the convolution
  (transformers keeps four, the oldest unused)."""
  rows = state_shape[0]
  for i in layers:
    state = np.asarray(cache[i].state)
    want = hf_cache.get_recurrent_state(i).numpy()
    assert state.shape == want.shape == tuple(state_shape)
    np.testing.assert_allclose(state, want, atol=1e-4 * np.abs(want).max(), rtol=0)
    window = np.concatenate([np.asarray(w).reshape(rows, 3, -1) for w in
                             (cache[i].v_conv, cache[i].k_conv, cache[i].q_conv)], axis=-1)
    want = hf_cache.get_conv_state(i).numpy()[..., 1:].transpose(0, 2, 1)
    np.testing.assert_allclose(window, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def check_next_turns_continue_from_their_slots(model, prompts, answer: int = 2):
  """A transcript that extends a row just ended goes on in that row's slot from the
  cache and recurrent state it left (its prompt and the tokens before its last: the one
  never fed), the answer (6 tokens for the first prompt, `answer` for the others)
  written in chunks of 4: the same samples as prefilling each turn whole."""
  from posttrain.sampling import Sampler
  sampler = Sampler(model, max_len=48, extend_chunk=4)

  def run(reuse):
    ended, sources = [], []

    def between_rounds(live):
      more = [(i, prompts[i] + t.tolist() + [9] * (6 if i == 0 else answer))
              for i, t in ended if i < len(prompts) and i % 2 == 0]
      ended.clear()
      sources.extend(i for i, _ in more)
      return [p for _, p in more]

    out = sampler.generate(prompts, slots=2, between_rounds=between_rounds,
                           max_prompt_len=36, reuse_cache=reuse, max_new_tokens=6,
                           temperature=1.0, seed=5,
                           on_finish=lambda i, t, *_: ended.append((i, t.copy())))
    return out, sources

  out, sources = run(True)
  whole, _ = run(False)
  assert out.stats["continued"] == len(sources) == 2 and whole.stats["continued"] == 0
  assert out.stats["reused_tokens"] == sum(len(prompts[i]) + int(out.lengths[i]) - 1
                                           for i in sources)
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-4)


def check_on_a_mesh(folder, hf_model, tokens, prompts, atol: float, new_tokens: int = 6):
  """The model of the HF folder `folder`, scanned and sharded over a data 2 x tensor 2
  mesh: its logits of `tokens` are transformers' to `atol`, and the sampler's greedy
  tokens for `prompts` are transformers' generate()'s. Returns the model (its
  parameters' shardings for the caller to check)."""
  import torch

  from posttrain.sampling import Sampler
  mesh = models.make_mesh((2, 1, 2, 1), devices=jax.devices()[:4])
  model = models.from_pretrained(folder, mesh=mesh, scan_layers=True)
  got = jax.jit(lambda t: model(t, ctx=models.ShardingContext(mesh)))(tokens)
  np.testing.assert_allclose(np.asarray(got), hf_logits(hf_model, tokens), atol=atol, rtol=0)
  sampler = Sampler(model, mesh=mesh, max_len=48, extend_chunk=4)
  out = sampler.generate(prompts, max_new_tokens=new_tokens, temperature=0.0)
  for i, prompt in enumerate(prompts):
    with torch.no_grad():
      want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert out.tokens[i].tolist() == want, i
  return model


def check_packed_rows_run_apart(model, tokens):
  """Two sequences packed in one row (segment ids, positions restarting) give each the
  logits it has alone: attention, recurrent states and convolutions restart at the seam.
  `tokens` [2, >= 12] int."""
  a, b = tokens[0, :12], tokens[1, :8]
  packed = jnp.asarray(np.concatenate([a, b])[None])
  seg = jnp.asarray([[1] * 12 + [2] * 8])
  pos = jnp.asarray([list(range(12)) + list(range(8))])
  got = np.asarray(nnx.jit(lambda m, t, p, s: m(t, p, s))(model, packed, pos, seg))[0]
  alone = nnx.jit(lambda m, t: m(t))
  np.testing.assert_allclose(got[:12], np.asarray(alone(model, a[None]))[0], atol=1e-4)
  np.testing.assert_allclose(got[12:], np.asarray(alone(model, b[None]))[0], atol=1e-4)


def check_export_files(folder, ours, out) -> dict:
  """`ours` written to `out` holds exactly the tensors of the HF folder `folder` it was
  read from, bit for bit; returns the written config.json."""
  import json

  from safetensors.numpy import load_file
  models.save_pretrained(ours, str(out))
  theirs, written = load_file(f"{folder}/model.safetensors"), load_file(
      f"{out}/model.safetensors")
  assert set(written) == set(theirs)
  for name in theirs:
    np.testing.assert_array_equal(written[name], theirs[name], err_msg=name)
  with open(f"{out}/config.json") as f:
    return json.load(f)


def check_logits(folder, hf_model, tokens, scan: bool, atol: float = 1e-4,
                 overrides=None):
  """The model read from `folder` (layer list or scanned; ModelConfig `overrides`)
  computes transformers' logits of int `tokens`, and they are large enough for the
  tolerance to mean something."""
  want = hf_logits(hf_model, tokens)
  model = models.from_pretrained(folder, scan_layers=scan, **(overrides or {}))
  got = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(np.asarray(got), want, atol=atol, rtol=0)
  assert np.abs(want).max() > 3


def check_export_round_trip(folder, hf_model, cls, tokens, out) -> dict:
  """The model read from `folder`, written to `out`: the folder's tensors bit for bit
  (`check_export_files`), a config.json that reads back to the same ModelConfig, and a
  folder transformers' `cls` loads to `hf_model`'s logits exactly; returns the config."""
  ours = models.from_pretrained(folder)
  written = check_export_files(folder, ours, out)
  assert models.hf_config_to_model_config(written) == ours.cfg
  back = cls.from_pretrained(str(out)).float().eval()
  np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf_model, tokens))
  return written


def check_preset_is_default_config(name: str, config_cls, keys, rope_keys=("rope_theta",)):
  """Preset `name` written as a config.json is transformers' `config_cls()` (the
  published model's defaults) on `keys` and on rope_parameters' `rope_keys` (None: all
  of the default's), and reads back as the preset (training-only fields aside)."""
  import json
  preset = models.get_preset(name)
  written = json.loads(json.dumps(models.hf.model_config_to_hf(preset)))
  default = config_cls()
  hf = config_cls(**{k: v for k, v in written.items()
                     if k not in ("architectures", "model_type")})
  for key in keys:
    assert getattr(hf, key) == getattr(default, key), key
  if rope_keys is None:
    rope_keys = [k for k in default.rope_parameters
                 if k not in ("type", "rope_type", "max_position_embeddings")]
  for key in rope_keys:
    assert hf.rope_parameters[key] == default.rope_parameters[key], key
  back = models.hf_config_to_model_config(written)
  assert back == preset.replace(remat=back.remat, scan_layers=back.scan_layers)
