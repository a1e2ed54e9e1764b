"""What a run config means, shared by the trainer and the evaluator: meshes, the model
config, the domain list, the algorithm, and the checkpointed train-state layout."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from posttrain import models
from posttrain.data import reasoning as reasoning_lib
from posttrain.rl import preference, presets
from posttrain.rl import state as rl_state
from posttrain.rl import train_step as ts
from posttrain.tasks import registry
from posttrain.tasks.reward_model import SQUASH

PLACEMENTS = ("colocated", "disaggregated")


# (dotted key, lowest allowed value, "int" or "float"); a key the config lacks is skipped.
_RANGES = (
    ("seed", 0, "int"), ("sft.steps", 0, "int"), ("sft.warmup", 0, "int"),
    ("sft.batch_size", 1, "int"), ("sft.eval_every", 0, "int"), ("preference.steps", 0, "int"),
    ("train.rl_steps", 0, "int"), ("train.row_len", 1, "int"),
    ("train.rows_per_microbatch", 1, "int"), ("train.log_every", 1, "int"),
    ("optim.warmup", 0, "int"), ("optim.lr", 0.0, "float"), ("optim.weight_decay", 0.0, "float"),
    ("optim.clip", 0.0, "float"), ("rollout.prompts_per_step", 1, "int"),
    ("rollout.max_new_tokens", 1, "int"), ("rollout.max_len", 2, "int"),
    ("rollout.temperature", 0.0, "float"), ("rollout.top_p", 0.0, "float"),
    ("rollout.top_k", 0, "int"), ("rollout.chunk_rows", 1, "int"),
    ("rollout.scoring_threads", 1, "int"), ("rollout.max_turns", 1, "int"),
    ("rollout.max_draws", 1, "int"), ("eval.seeds_per_domain", 0, "int"),
    ("eval.samples", 0, "int"), ("checkpoint.every", 1, "int"),
    ("checkpoint.keep_last", 1, "int"), ("checkpoint.keep_every", 0, "int"),
    ("placement.devices", 0, "int"), ("placement.rollout_devices", 0, "int"),
    ("placement.sync_every", 1, "int"), ("placement.max_policy_lag", 0, "int"),
    ("placement.segment_tokens", 0, "int"), ("placement.step_tokens", 0, "int"),
    ("compile_cache_min_secs", 0.0, "float"), ("reward_model.mix", 0.0, "float"),
    ("reward_model.batch_size", 1, "int"), ("reward_model.max_len", 0, "int"),
    ("distill.coef", 0.0, "float"), ("distill.reward_weight", 0.0, "float"),
)


OBJECTIVES = ("policy", "reward_model")


def objective(config) -> str:
  """What a run trains: `policy` (the SFT, preference and RL stages, `posttrain.trainer`)
  or `reward_model` (`posttrain.reward_trainer`)."""
  value = str(config.get("objective", "policy") or "policy")
  if value not in OBJECTIVES:
    raise ValueError(f"objective={value!r}; expected one of {OBJECTIVES}")
  return value


def _lookup(config, key: str) -> Any:
  node = config
  for part in key.split("."):
    node = node.get(part) if hasattr(node, "get") else None
    if node is None:
      return None
  return node


def check_config(config) -> None:
  """Raises ValueError naming the first out-of-range number in a run config.

  Run before anything is built, so a bad value fails in a second rather than after the SFT
  stage (the sampler, say, would only reject max_new_tokens=0 at the first rollout).
  """
  for key, low, kind in _RANGES:
    node = _lookup(config, key)
    if node is None or isinstance(node, bool):
      continue
    try:
      value = float(node) if kind == "float" else int(node)
    except (TypeError, ValueError):
      raise ValueError(f"{key}={node!r} is not a{'n int' if kind == 'int' else ' number'}"
                       ) from None
    if kind == "int" and value != node:
      raise ValueError(f"{key}={node!r} must be a whole number")
    if not value >= low:  # also catches NaN
      raise ValueError(f"{key}={node!r} must be >= {low}")
  lr, top_p = _lookup(config, "optim.lr"), _lookup(config, "rollout.top_p")
  if lr is not None and not float(lr) > 0:
    raise ValueError(f"optim.lr={lr!r} must be > 0")
  if top_p is not None and float(top_p) > 1:
    raise ValueError(f"rollout.top_p={top_p!r} must be in [0, 1] (0 turns it off)")
  new, max_len = _lookup(config, "rollout.max_new_tokens"), _lookup(config, "rollout.max_len")
  if new is not None and max_len is not None and int(new) >= int(max_len):
    raise ValueError(f"rollout.max_new_tokens={new} leaves no room for a prompt in "
                     f"rollout.max_len={max_len}")
  _check_reward_model(config)
  _check_distill(config)
  rollout_reasoning(config)
  rollout_thinking(config)
  rollout_tool_format(config)


THINKING = {"": None, "on": True, "off": False, "low": "low", "medium": "medium",
            "high": "high"}


def rollout_reasoning(config) -> str:
  """How rollouts read a completion's reasoning (rollout.reasoning): auto (the tokenizer's
  chat format: Qwen3's <think> blocks, gpt-oss's analysis channel), none (the verifier
  reads the whole completion) or think (<think> blocks in any tokenizer's text)."""
  r = config.get("rollout")
  value = str((r.get("reasoning", "auto") if r is not None else "auto") or "auto")
  if value not in reasoning_lib.MODES:
    raise ValueError(f"rollout.reasoning={value!r}; expected one of {reasoning_lib.MODES}")
  return value


def rollout_tool_format(config) -> str:
  """How multi-turn domains' tools are called (rollout.tool_format): text (the domain's
  own protocol) or native (the model's own format: Qwen's or Llama 3.1's tool schemas and
  calls)."""
  from posttrain.rollout.worker import TOOL_FORMATS  # rollout imports the sampler: lazily
  r = config.get("rollout")
  value = str((r.get("tool_format", "text") if r is not None else "text") or "text")
  if value not in TOOL_FORMATS:
    raise ValueError(f"rollout.tool_format={value!r}; expected one of {TOOL_FORMATS}")
  return value


def rollout_thinking(config) -> bool | str | None:
  """The prompts' reasoning switch (rollout.thinking): "" the template's default; on / off
  (Qwen3's enable_thinking); low / medium / high (gpt-oss's reasoning effort)."""
  r = config.get("rollout")
  value = str((r.get("thinking", "") if r is not None else "") or "")
  if value not in THINKING:
    raise ValueError(f"rollout.thinking={value!r}; expected one of {tuple(THINKING)}")
  return THINKING[value]


DISTILL_DTYPES = ("", "float32", "bfloat16", "float16")
DISTILL_LOSSES = ("sampled",) + models.DIVERGENCES


def distill_teacher(config) -> str:
  """The on-policy distillation teacher's folder (distill.teacher), "" when off."""
  d = config.get("distill")
  return str(d.get("teacher", "") or "") if d is not None else ""


DISTILL_STAGES = ("sft", "rl")


def distill_stages(config) -> tuple[str, ...]:
  """The stages the distillation teacher joins (distill.stages; () without a teacher).

  Raises:
    ValueError: an unknown or empty list of stages.
  """
  if not distill_teacher(config):
    return ()
  raw = str(config.distill.get("stages", "rl") or "")
  stages = tuple(s.strip() for s in raw.split(",") if s.strip())
  bad = [s for s in stages if s not in DISTILL_STAGES]
  if bad or not stages:
    raise ValueError(f"distill.stages={raw!r}: expected a comma-separated subset of "
                     f"{DISTILL_STAGES}")
  return stages


def _check_distill(config) -> None:
  """The distill section: a known dtype and, with a teacher, a readable causal-LM folder
  and weights that leave some advantage (coef or reward_weight > 0)."""
  d = config.get("distill")
  if d is None:
    return
  dtype = str(d.get("dtype", "") or "")
  if dtype not in DISTILL_DTYPES:
    raise ValueError(f"distill.dtype={dtype!r}; expected one of {DISTILL_DTYPES[1:]} or \"\"")
  loss = str(d.get("loss", "sampled"))
  if loss not in DISTILL_LOSSES:
    raise ValueError(f"distill.loss={loss!r}; expected one of {DISTILL_LOSSES}")
  beta = d.get("beta")
  if loss == "jsd" and beta is not None and not 0 < float(beta) < 1:
    raise ValueError(f"distill.beta={beta!r} must be in (0, 1) for distill.loss=jsd "
                     "(0 is forward_kl, 1 reverse_kl)")
  sft_loss = str(d.get("sft_loss", "forward_kl"))
  if sft_loss not in models.DIVERGENCES:
    raise ValueError(f"distill.sft_loss={sft_loss!r}; expected one of {models.DIVERGENCES}")
  if not distill_teacher(config):
    return
  teacher_config(config)
  stages = distill_stages(config)
  if "rl" in stages and float(d.get("coef", 1.0)) == 0 and float(
      d.get("reward_weight", 1.0)) == 0:
    raise ValueError("distill.coef=0 and distill.reward_weight=0 leave no advantage to train "
                     "on")


def teacher_config(config) -> models.ModelConfig:
  """The distillation teacher's ModelConfig, from its folder's config.json alone, in
  distill.dtype ("" = the run's model dtype) for its weights and compute.

  Raises:
    ValueError: naming the folder, when it has no config.json, an architecture that cannot
      be read, or no language-model head (a reward model).
  """
  path = distill_teacher(config)
  cfg, _ = models.hf.folder_config(path, f"distill.teacher={path!r}",
                                   "a Hugging Face causal-LM folder")
  if not cfg.lm_head:
    raise ValueError(f"distill.teacher={path!r} is a {cfg.architecture} without a language-"
                     "model head; expected a *ForCausalLM folder")
  dtype = str(config.distill.get("dtype", "") or "") or model_config(config).dtype
  return cfg.replace(dtype=dtype, param_dtype=dtype)


def _check_reward_model(config) -> None:
  """The reward_model section: mix in [0, 1], a known squash and, with a path, domain
  patterns that each match one of the run's domains."""
  rm = config.get("reward_model")
  if rm is None:
    return
  mix, squash = rm.get("mix"), rm.get("squash")
  if mix is not None and float(mix) > 1:
    raise ValueError(f"reward_model.mix={mix!r} must be in [0, 1]")
  if squash is not None and squash not in SQUASH:
    raise ValueError(f"reward_model.squash={squash!r}; expected one of {SQUASH}")
  if rm.get("path") and _lookup(config, "tasks.domains") is not None:
    reward_model_domains(config, run_domains(config))


def enable_compile_cache(config) -> str | None:
  """Turns on JAX's persistent compilation cache in `config.compile_cache_dir` ("" = off;
  `~` expands; a gs:// path works where JAX's file layer reaches it): a restarted,
  preempted or resumed run, or a later run of the same programs, loads its executables
  instead of compiling them again (only process 0 writes). Programs that compiled in
  under `compile_cache_min_secs` (default 0: all) are not stored. Call before anything
  compiles: JAX reads the setting at its first compile. Returns the directory, or None."""
  path = str(config.get("compile_cache_dir", "") or "")
  if not path:
    return None
  if "://" not in path:
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(config.get("compile_cache_min_secs", 0.0)))
  return path


def data_cache_dir(config, workdir: str) -> str | None:
  """Where tokenized data files are cached (`config.data_cache_dir`): "" = the run's
  `<workdir>/data_cache`, "none" = nowhere (None), else that directory (`~` expands). The
  cache is memory-mapped, so it must be a local or mounted filesystem."""
  path = str(config.get("data_cache_dir", "") or "")
  if path.lower() == "none":
    return None
  if "://" in path:
    raise ValueError(f"data_cache_dir={path!r} is a URL; the tokenized data are "
                     "memory-mapped: give a local or mounted directory")
  return os.path.abspath(os.path.expanduser(path or os.path.join(workdir, "data_cache")))


def split_devices(devices: Sequence[Any], rollout: int) -> tuple[list[Any], list[Any]]:
  """(rollout devices, train devices) of a disaggregated run.

  One process: the first `rollout` devices roll out. Several processes (hosts): every
  process gives the same number, rollout / processes, of its own devices (its first ones)
  to the rollout mesh, so every host takes part in both meshes and host-to-host traffic is
  balanced; `rollout` must then be a multiple of the process count.
  """
  by_process: dict[int, list[Any]] = {}
  for d in devices:
    by_process.setdefault(int(getattr(d, "process_index", 0)), []).append(d)
  if len(by_process) == 1:
    return list(devices[:rollout]), list(devices[rollout:])
  counts = {len(v) for v in by_process.values()}
  if len(counts) > 1:
    raise ValueError(f"processes hold different numbers of devices ({sorted(counts)}); "
                     "a disaggregated split needs the same number on every host")
  if rollout % len(by_process):
    raise ValueError(f"placement.rollout_devices={rollout} must be a multiple of the "
                     f"{len(by_process)} processes (each host gives the same share)")
  share = rollout // len(by_process)
  roll = [d for _, ds in sorted(by_process.items()) for d in ds[:share]]
  train = [d for _, ds in sorted(by_process.items()) for d in ds[share:]]
  return roll, train


def build_meshes(config, devices=None) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
  """(train mesh, rollout mesh). Colocated: one mesh over the devices. Disaggregated:
  `placement.rollout_devices` devices form the rollout mesh (the first ones; with several
  hosts, the same share of each host's, see `split_devices`), the rest the train mesh.
  `devices` defaults to all of JAX's (another set, e.g. a TPU topology's, to compile for
  it)."""
  p = config.get("placement") or ml_collections.ConfigDict(dict(mode="colocated"))
  mode = p.get("mode", "colocated")
  if mode not in PLACEMENTS:
    raise ValueError(f"placement.mode={mode!r}; expected one of {PLACEMENTS}")
  devices = list(jax.devices() if devices is None else devices)
  n = int(p.get("devices", 0) or 0)
  if n:
    if n > len(devices):
      raise ValueError(f"placement.devices={n} but only {len(devices)} devices exist")
    devices = devices[:n]
  m = config.mesh
  shape = (m.data, m.fsdp, m.tensor, m.sequence)
  if mode == "colocated":
    mesh = models.make_mesh(shape, devices=devices)
    return mesh, mesh
  r = int(p.get("rollout_devices", 0) or 0)
  if len(devices) < 2:
    raise ValueError(f"placement.mode=disaggregated needs at least 2 devices (one to sample, "
                     f"one to train); {len(devices)} available")
  if not 0 < r < len(devices):
    raise ValueError(f"placement.rollout_devices={r} must leave devices for training "
                     f"(1..{len(devices) - 1})")
  rollout_shape = tuple(p.get("rollout_mesh", (1, -1, 1, 1)))
  rollout_devices, train_devices = split_devices(devices, r)
  return (models.make_mesh(shape, devices=train_devices),
          models.make_mesh(rollout_shape, devices=rollout_devices))


def build_mesh(config) -> jax.sharding.Mesh:
  """The train mesh of `config`."""
  return build_meshes(config)[0]


# ModelConfig fields a run chooses (its preset's, or its overrides), whatever weights it
# starts from; the others define the model, and come from init_from's config.json when
# the run starts from a Hugging Face folder.
RUN_FIELDS = ("dtype", "param_dtype", "remat", "scan_layers", "attention_impl",
              "attention_options", "attention_chunk", "decode_chunk", "value_head",
              "logprob_chunk", "init_std", "lora_rank", "lora_alpha", "lora_targets",
              "base_quantization", "base_quantization_block")


# Fields that define the model which a run starting from a folder may still set.
ADJUSTABLE_FIELDS = ("max_position_embeddings", "router_aux_loss_coef")
_WARNED: set = set()


def hf_init_folder(config) -> str | None:
  """config.init_from when it is a Hugging Face folder (it holds a config.json)."""
  src = str(config.get("init_from", "") or "")
  return src if src and os.path.exists(os.path.join(src, "config.json")) else None


def model_config(config, vocab_size: int | None = None) -> models.ModelConfig:
  """The ModelConfig of a run: a preset plus `config.model.overrides`. A run that starts
  from a Hugging Face folder (init_from) takes the model itself (architecture, shapes,
  rotary embedding, norms, ...) from the folder's config.json, and the RUN_FIELDS (dtypes,
  remat, layer layout, kernels, LoRA) from the preset and the overrides; overrides of
  the model's own fields other than ADJUSTABLE_FIELDS are not applied (the weights fix
  them), and a warning names those that differ from the folder's."""
  overrides = dict(config.model.get("overrides", {}) or {})
  if config.model.get("value_head") is not None:
    overrides["value_head"] = bool(config.model.value_head)
  preset = models.get_preset(config.model.preset)
  folder = hf_init_folder(config)
  if not folder:
    cfg = preset.replace(**overrides) if overrides else preset  # checks the overrides too
  else:  # the overrides are checked against the folder's model (LoRA on its experts)
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(preset)})
    if unknown:
      raise ValueError(f"model.overrides {unknown} are not fields of ModelConfig")
    read, _ = models.hf.folder_config(folder, f"init_from={folder!r}")
    run = {f: overrides.get(f, getattr(preset, f)) for f in RUN_FIELDS}
    if not read.lm_head:  # a reward model's folder: its score head is the value head
      run["value_head"] = True
    run.update({f: overrides[f] for f in ADJUSTABLE_FIELDS if f in overrides and not (
        f == "max_position_embeddings" and read.learned_positions)})  # GPT-2's wpe rows
    ignored = sorted(k for k, v in overrides.items()
                     if k not in run and getattr(read, k, v) != v)
    if ignored and (folder, tuple(ignored)) not in _WARNED:
      _WARNED.add((folder, tuple(ignored)))
      logging.getLogger(__name__).warning(
          "init_from=%s defines the model: model.overrides %s are not applied (the "
          "folder's: %s)", folder, {k: overrides[k] for k in ignored},
          {k: getattr(read, k) for k in ignored})
    cfg = read.replace(**run)
  if vocab_size is not None and cfg.vocab_size < vocab_size:
    raise ValueError(f"model vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
                     f"{vocab_size}")
  return cfg


def initial_model(config, cfg: models.ModelConfig, mesh, rules) -> models.Transformer:
  """The weights a run starts from (config.init_from): random from config.seed; a Hugging
  Face folder (config.json); or an earlier run's checkpoint directory, in whichever layout
  of the layers it had (a run without adapters may seed a LoRA run: fresh adapters on its
  weights)."""
  from posttrain.checkpoint import CheckpointManager  # trainer and evaluation only
  src = str(config.get("init_from", "") or "")
  if not src:
    return models.create_model(cfg, mesh=mesh, rules=rules, seed=int(config.seed))
  if os.path.exists(os.path.join(src, "config.json")):  # the run's config is the folder's
    return models.from_pretrained(src, mesh=mesh, rules=rules, seed=int(config.seed),
                                  **{f.name: getattr(cfg, f.name)
                                     for f in dataclasses.fields(cfg)})
  ckpt_dir = os.path.join(src, "checkpoints") if os.path.isdir(
      os.path.join(src, "checkpoints")) else src
  manager = CheckpointManager(ckpt_dir, read_only=True)
  layouts = [cfg, cfg.replace(scan_layers=not cfg.scan_layers)]
  candidates = layouts + ([c.replace(lora_rank=0, base_quantization="") for c in layouts]
                          if cfg.lora_rank else [])
  first_error = None
  for saved_cfg in candidates:
    try:
      restored = manager.restore(abstract_checkpoint(saved_cfg, optimizer_like(config), mesh,
                                                     rules))
      break
    except ValueError as e:
      first_error = first_error or e
  else:
    raise first_error
  if restored is None:
    raise ValueError(f"init_from={src!r} is neither a Hugging Face folder (config.json) nor "
                     "a checkpoint directory with a complete checkpoint")
  graphdef, _, rest = ts._split_abstract(saved_cfg)
  model = nnx.merge(graphdef, restored[0]["params"], rest)
  if saved_cfg.scan_layers != cfg.scan_layers:
    model = models.relayout(model, scan_layers=cfg.scan_layers, mesh=mesh, rules=rules)
  if saved_cfg.lora_rank != cfg.lora_rank:
    model = models.shard_model(
        models.with_lora(model, cfg.lora_rank, jax.random.key(int(config.seed)),
                         lora_alpha=cfg.lora_alpha, lora_targets=cfg.lora_targets,
                         base_quantization=cfg.base_quantization,
                         base_quantization_block=cfg.base_quantization_block),
        mesh, rules)
  return model


def reward_architecture(architecture: str) -> str:
  """The sequence-classification class of a causal LM's (or already one)."""
  if architecture.endswith("ForSequenceClassification"):
    return architecture
  from posttrain.models import hf
  if architecture in hf.CAUSAL_LMS:  # Gemma 3's text classifier is named apart.
    return hf._sequence_classifier(architecture)
  if not architecture.endswith("ForCausalLM"):
    raise ValueError(f"architecture {architecture!r} has no sequence-classification form")
  return architecture[:-len("ForCausalLM")] + "ForSequenceClassification"


def reward_model_config(config, vocab_size: int | None = None) -> models.ModelConfig:
  """The run's model config as a reward model: a score head, no vocabulary projection."""
  cfg = model_config(config, vocab_size)
  return cfg.replace(value_head=True, lm_head=False,
                     architecture=reward_architecture(cfg.architecture))


def select_domains(patterns: str, levels: str | Sequence[int] = "", limit: int = 0
                   ) -> list[str]:
  """Registered domains matching comma-separated globs (and levels), in pattern order."""
  globs = [p.strip() for p in str(patterns).split(",") if p.strip()]
  if isinstance(levels, str):
    levels = [int(x) for x in levels.split(",") if x.strip()]
  names: list[str] = []
  for glob in globs:
    for name in registry.names():
      if (fnmatch.fnmatchcase(name, glob) and name not in names
          and (not levels or registry.get(name).level in levels)):
        names.append(name)
  if limit:
    names = names[:limit]
  if not names:
    raise ValueError(f"domains={patterns!r} (levels {list(levels) or 'any'}) matches no "
                     "registered domain")
  return names


# Domains registered from a run's task sources: name -> the source that registered it.
_SOURCED: dict[str, str] = {}
# Task files read: (path, verifier, size, mtime) -> their domain.
_FILE_DOMAINS: dict[tuple, Any] = {}


def _register_sourced(domain, source: str) -> None:
  owner = _SOURCED.get(domain.name)
  if domain.name in registry and owner != source:
    where = f"from {owner}" if owner else "built in"
    raise ValueError(f"{source}: domain {domain.name!r} is already registered ({where}); "
                     "rename it")
  registry.register(domain, replace=True)
  _SOURCED[domain.name] = source


def _import_tasks_module(spec: str):
  """A module by name, or a .py file by path."""
  import importlib
  import importlib.util
  import sys
  if not spec.endswith(".py"):
    return importlib.import_module(spec)
  path = os.path.abspath(spec)
  if not os.path.exists(path):
    raise FileNotFoundError(f"tasks.modules: no file {spec!r}")
  name = "posttrain_user_tasks_" + "".join(c if c.isalnum() else "_" for c in path)
  if name in sys.modules:
    return sys.modules[name]
  module_spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(module_spec)
  sys.modules[name] = module
  try:
    module_spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  return module


def register_task_sources(config) -> list[str]:
  """Registers the domains of a run's own task sources (beside the built-in families) and
  returns their names; safe to call again. Each process of a run registers the same.

    tasks.modules   comma-separated Python modules (import names, or .py paths) that
                    register domains in `posttrain.tasks.registry` when imported, or
                    define `domains()` returning the Domain objects to register
    tasks.files     comma-separated task files (`posttrain.tasks.jsonl`: JSON lines, a
                    JSON array or Parquet of {"prompt", "answer", "verifier"?, ...}
                    rows, or veRL's RL rows), each the domain jsonl/<file stem>;
                    rows without a verifier use tasks.file_verifier;
                    tasks.file_split=data_source makes one domain of each value of
                    that row key, jsonl/<file stem>/<value>
    tasks.gym       comma-separated reasoning-gym datasets (posttrain[gym]), gym/<name>
    tasks.tools     comma-separated tools (python, calculator) given to each single-turn
                    domain matching tasks.tool_domains' globs, as <domain>/tools
                    (`posttrain.tasks.tool_use`); tasks.tool_max_calls bounds the calls

  `tasks.domains` then selects among all registered domains, e.g. "jsonl/*".

  Raises:
    ValueError / FileNotFoundError / ImportError: one line naming the key and the source.
  """
  t = config.get("tasks")
  if t is None:
    return []
  names: list[str] = []
  for spec in _csv(t.get("modules", "")):
    try:
      module = _import_tasks_module(spec)
    except ImportError as e:
      raise ImportError(f"tasks.modules: cannot import {spec!r}: {e}") from None
    except FileNotFoundError:
      raise
    except Exception as e:  # noqa: BLE001 - a broken module: one line naming it
      raise ValueError(f"tasks.modules: importing {spec!r} failed: {type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}") from None
    make = getattr(module, "domains", None)
    for domain in (make() if callable(make) else []):
      _register_sourced(domain, f"tasks.modules {spec!r}")
      names.append(domain.name)
  files = _csv(t.get("files", ""))
  if files:
    from posttrain.tasks.jsonl import JsonlDomain, verifier_names  # grain: only when used
    verifier = str(t.get("file_verifier", "exact") or "exact")
    if verifier not in verifier_names():
      raise ValueError(f"tasks.file_verifier={verifier!r}; expected one of "
                       f"{verifier_names()}")
    split = str(t.get("file_split", "") or "")
    for path in files:
      try:
        from posttrain.data.rows import expand
        stats = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns)
                 for f in expand([path])]
        key = (path, verifier, split, tuple(stats))
      except OSError:
        key = None  # from_file names the missing file (or the glob that matches none)
      domains = _FILE_DOMAINS.get(key) or (
          JsonlDomain.split_file(path, split, verifier=verifier) if split
          else [JsonlDomain.from_file(path, verifier=verifier)])
      for domain in domains:
        _register_sourced(domain, f"tasks.files {path!r}")
        names.append(domain.name)
      if key is not None:
        _FILE_DOMAINS[key] = domains  # a run asks more than once: read an unchanged file once
  gym = _csv(t.get("gym", ""))
  if gym:
    from posttrain.tasks.gym import gym_domains
    for domain in gym_domains(gym):
      _register_sourced(domain, f"tasks.gym {domain.name!r}")
      names.append(domain.name)
  names += _register_tool_domains(t)
  return names


def _register_tool_domains(t) -> list[str]:
  """tasks.tools over tasks.tool_domains: `<domain>/tools` beside each single-turn domain
  the globs match (`posttrain.tasks.tool_use`)."""
  tools, globs = _csv(t.get("tools", "")), _csv(t.get("tool_domains", ""))
  if not tools and not globs:
    return []
  if not tools or not globs:
    raise ValueError(f"tasks.tools={t.get('tools', '')!r} and tasks.tool_domains="
                     f"{t.get('tool_domains', '')!r}: give both (the tools, and the domains "
                     "that get them) or neither")
  from posttrain.tasks.families.tools import TOOLS
  from posttrain.tasks.tool_use import SUFFIX, WithTools
  if sorted(set(tools) - set(TOOLS)):
    raise ValueError(f"tasks.tools={','.join(tools)!r}; the tools are {list(TOOLS)}")
  max_calls = int(t.get("tool_max_calls", 4) or 4)
  names = []
  for name in registry.names():
    domain = registry.get(name)
    if (not any(fnmatch.fnmatchcase(name, g) for g in globs) or domain.multi_turn
        or hasattr(domain, "step") or name.endswith("/" + SUFFIX)):
      continue
    wrapped = WithTools(domain, tools, max_calls)
    _register_sourced(wrapped, "tasks.tools")
    names.append(wrapped.name)
  if not names:
    raise ValueError(f"tasks.tool_domains={','.join(globs)!r} matches no single-turn domain")
  return names


def _csv(value) -> list[str]:
  return [x.strip() for x in str(value or "").split(",") if x.strip()]


def run_domains(config) -> list[str]:
  """The domains a run trains on: tasks.domains' globs (and tasks.levels) over the
  built-in domains and the run's own task sources (`register_task_sources`)."""
  register_task_sources(config)
  t = config.tasks
  return select_domains(t.domains, str(t.get("levels", "") or ""),
                        int(t.get("max_domains", 0) or 0))


def eval_domains(config) -> list[str]:
  """The domains evaluation visits: eval.domains' globs when set (a held-out task file's
  domain, say), else the run's domains."""
  register_task_sources(config)
  globs = str((config.get("eval") or {}).get("domains", "") or "")
  return select_domains(globs) if globs.strip() else run_domains(config)


def reward_model_domains(config, domains: Sequence[str]) -> list[str]:
  """The domains of `domains` whose rewards the reward model scores: those matching one of
  reward_model.domains' comma-separated globs.

  Raises:
    ValueError: naming the key, when it holds no pattern or a pattern matches no domain.
  """
  raw = config.reward_model.get("domains", "*")
  globs = [p.strip() for p in str(raw).split(",") if p.strip()]
  if not globs:
    raise ValueError(f"reward_model.domains={raw!r} holds no pattern (\"*\" scores every "
                     "domain)")
  for glob in globs:
    if not any(fnmatch.fnmatchcase(d, glob) for d in domains):
      raise ValueError(f"reward_model.domains={raw!r}: {glob!r} matches none of the run's "
                       f"{len(domains)} domains ({', '.join(list(domains)[:3])}"
                       f"{', ...' if len(domains) > 3 else ''})")
  return [d for d in domains if any(fnmatch.fnmatchcase(d, g) for g in globs)]


def algorithm(config) -> ml_collections.ConfigDict:
  overrides = {k: v for k, v in config.rl.items() if v is not None}
  return presets.algorithm_config(config.algorithm, **overrides)


def frozen_references(config, algo) -> tuple[bool, bool]:
  """Whether (the preference stage, RL) keep a frozen copy of the policy they started
  from: a preference loss other than simpo, or RL's KL term or online preference loss.
  With LoRA the copy is the base weights, not a second one."""
  pref = config.get("preference")
  stage = bool(pref is not None and int(pref.get("steps", 0) or 0) > 0
               and str(pref.get("loss", "sigmoid")) in preference.REFERENCE_LOSSES)
  rl = float(algo.kl_coef) > 0 or algo.get("preference_loss") in preference.REFERENCE_LOSSES
  return stage, rl


# -- the checkpointed state ---------------------------------------------------------------
# Saved as a plain dict, so the on-disk layout does not depend on optional TrainState fields.


def to_checkpoint(state: ts.TrainState) -> dict[str, Any]:
  d = {"params": state.params, "opt_state": state.opt_state, "step": state.step,
       "rng": state.rng}
  if state.critic_params is not None:
    d.update(critic_params=state.critic_params, critic_opt_state=state.critic_opt_state)
  return d


def from_checkpoint(d: dict[str, Any]) -> ts.TrainState:
  return ts.TrainState(**d)


def abstract_checkpoint(cfg: models.ModelConfig, optimizer, mesh, rules) -> dict[str, Any]:
  """The checkpoint dict as ShapeDtypeStructs with shardings on `mesh` (nothing allocated)."""
  _, abs_params, _ = ts._split_abstract(cfg)
  shardings = ts.train_state_shardings(abs_params, optimizer, mesh, rules)
  abstract = jax.eval_shape(
      lambda p: ts.TrainState(p, optimizer.init(rl_state.split_trainable(p)[0]),
                              jnp.zeros((), jnp.int32),
                              jax.random.PRNGKey(0)), abs_params)
  return to_checkpoint(jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings))


def optimizer_like(config) -> Any:
  """An optimizer with the run's state structure (only the structure matters to restore)."""
  return rl_state.make_optimizer(1.0, 0, 2, 0.0, 1.0 if config.optim.get("clip") else None)
