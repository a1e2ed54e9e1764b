"""Compile a run's programs for a TPU slice on any host, ahead of time (no TPU needed).

    devices = aot.tpu_devices("v5p:2x4x4")
    print(aot.format_report(aot.compile_rl_step(config, devices)))
    print(aot.format_rollout(aot.compile_rollout(config, devices)))

libtpu (`pip install -e '.[tpu]'`) compiles for a described TPU topology on a CPU host,
Pallas kernels included. The programs are built exactly as the trainer builds them: the
RL update (`rl.train_step.make_train_step` on the config's mesh and rules, the
checkpoint's state layout, a worst-case batch) and the sampler's prefill and decode for
one generate call (`Sampler.compile` on an abstract model). They are lowered with
abstract arrays and compiled; XLA's memory analysis then gives the bytes one device
needs, which `launch.plan` sets beside its own estimate. A program that XLA or Mosaic
cannot compile for the slice fails here, on a laptop, rather than after the slice is
provisioned.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import ml_collections

from posttrain import experiment, models, planner
from posttrain.rl import packing
from posttrain.rl import train_step as ts


def tpu_devices(topology: str) -> list:
  """The devices of a TPU topology described by name, e.g. 'v5p:2x4x4' (32 chips) or
  'v5e:16x16'; no TPU needs to be attached."""
  try:
    import libtpu  # noqa: F401
  except ImportError:
    raise ValueError(f"compiling for TPU topology {topology!r} needs libtpu: "
                     "pip install -e '.[tpu]'") from None
  # Nothing runs on the devices, so several processes may load libtpu at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  try:
    return list(topologies.get_topology_desc(topology, "tpu").devices)
  except Exception as e:  # libtpu's errors are long; the first line names the problem
    raise ValueError(f"TPU topology {topology!r}: {_first_line(e)}") from None


class CompileError(ValueError):
  """XLA or Mosaic could not compile the program for the slice (e.g. it needs more
  memory than a device has)."""


def _first_line(e: BaseException) -> str:
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  return lines[0] if lines else type(e).__name__


@contextlib.contextmanager
def _compiling(mesh):
  """Lowers and compiles under `mesh` (Pallas picks the kernels of its platform); XLA's
  and Mosaic's refusals become a one-line `CompileError`."""
  try:
    with jax.set_mesh(mesh):
      yield
  except (jax.errors.JaxRuntimeError, NotImplementedError) as e:
    raise CompileError(_first_line(e)) from e


def _run(config: ml_collections.ConfigDict, devices):
  """(train mesh, rollout mesh, rules, model config, algorithm) of `config` over
  `devices`, as the trainer lays them out."""
  experiment.check_config(config)
  mesh, rollout_mesh = experiment.build_meshes(config, devices=devices)
  rules = models.rules_from_config(config.get("sharding_rules") or None)
  return (mesh, rollout_mesh, rules, experiment.model_config(config),
          experiment.algorithm(config))


def _peak(memory) -> int:
  """Arguments + outputs + temporaries, less outputs that reuse donated arguments."""
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class Report:
  """What one device of the compiled update program needs, in bytes."""
  topology: str
  mesh: dict[str, int]
  batch_shape: tuple[int, int, int]
  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int
  peak: int  # arguments + outputs + temporaries, less outputs reusing donated arguments
  mosaic_kernels: int  # Pallas TPU kernel calls in the program (flash attention's)
  compile_s: float


def abstract_rl_batch(config: ml_collections.ConfigDict, algo, required: tuple[str, ...],
                      sharding) -> dict[str, jax.ShapeDtypeStruct]:
  """The trainer's packed batch for one update, worst case (every sequence
  rollout.max_len long): [micro-batches, rows per micro-batch, row_len]."""
  per_update, _ = planner.microbatches(config, algo)
  shape = (per_update, int(config.train.rows_per_microbatch), int(config.train.row_len))
  packed = packing._empty_rows(1, 1, 0)
  keys = [k for k in ts.TOKEN_KEYS if k in packed or k in required]
  batch = {k: jax.ShapeDtypeStruct(shape, packed[k].dtype if k in packed else jnp.float32,
                                   sharding=sharding) for k in keys}
  if algo.kl_controller == "adaptive" and not algo.kl_in_reward:  # the trainer's row weights
    batch["kl_coef"] = jax.ShapeDtypeStruct(shape[:2], jnp.float32, sharding=sharding)
  if algo.get("routing_replay", "none") != "none":  # the experts each token replays
    cfg = experiment.model_config(config)
    batch[ts.ROUTING_KEY] = jax.ShapeDtypeStruct(
        shape + (cfg.mixture_layers, cfg.num_experts_per_tok), ts.routing_dtype(cfg),
        sharding=sharding)
  return batch


def _abstract_teacher(config, cfg, mesh, rules):
  """(teacher config, its params as sharded ShapeDtypeStructs) of a distillation teacher
  the update reads (distill.loss reverse_kl / forward_kl), as the trainer loads it; (None,
  None) otherwise."""
  distill = config.get("distill") or {}
  if ("rl" not in experiment.distill_stages(config)
      or str(distill.get("loss", "sampled")) == "sampled"):
    return None, None
  teacher_cfg = experiment.teacher_config(config).replace(
      attention_impl=cfg.attention_impl, logprob_chunk=cfg.logprob_chunk)
  _, abstract, _ = ts._split_abstract(teacher_cfg)
  shardings = models.state_shardings(abstract, mesh, rules)
  return teacher_cfg, jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def compile_rl_step(config: ml_collections.ConfigDict, devices, *, topology: str = ""
                    ) -> Report:
  """Compiles the RL update of `config` for `devices` (e.g. `tpu_devices(...)`); the
  train mesh is laid out over them as the trainer would."""
  mesh, _, rules, cfg, algo = _run(config, devices)
  optimizer = experiment.optimizer_like(config)
  in_step = ts.reference_in_step(algo)
  teacher_cfg, teacher = _abstract_teacher(config, cfg, mesh, rules)
  distill = config.get("distill") or {}
  step = ts.make_train_step(cfg, algo, optimizer, mesh=mesh, rules=rules,
                            reference_in_step=in_step,
                            temperature=float(config.rollout.temperature) or 1.0,
                            teacher_cfg=teacher_cfg,
                            distill_loss=str(distill.get("loss", "reverse_kl"))
                            if teacher_cfg else "reverse_kl",
                            distill_coef=float(distill.get("coef", 1.0)),
                            distill_beta=float(distill.get("beta", 0.5)))
  state = experiment.from_checkpoint(experiment.abstract_checkpoint(cfg, optimizer, mesh,
                                                                    rules))
  batch = abstract_rl_batch(config, algo, step.required, ts.batch_sharding(mesh, rules))
  # A LoRA step's reference is its own base, adapters off: no third argument.
  args = ((state, batch) + ((state.params,) if in_step and not cfg.lora_rank else ())
          + ((teacher,) if teacher is not None else ()))
  start = time.perf_counter()
  with _compiling(mesh):
    compiled = step.jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  return Report(
      topology=topology, mesh=dict(mesh.shape),
      batch_shape=tuple(batch["tokens"].shape), arguments=memory.argument_size_in_bytes,
      outputs=memory.output_size_in_bytes, aliased=memory.alias_size_in_bytes,
      temporaries=memory.temp_size_in_bytes, code=memory.generated_code_size_in_bytes,
      peak=_peak(memory), mosaic_kernels=compiled.as_text().count("custom_call_target=\"tpu_custom_call\""),
      compile_s=seconds)


@dataclasses.dataclass(frozen=True)
class RolloutReport:
  """Bytes one device of the rollout programs needs (prefill, then the decode loop)."""
  mesh: dict[str, int]
  rows: int
  prompt_len: int
  max_new_tokens: int
  prefill_peak: int
  decode_peak: int
  compile_s: float
  continuous: bool = False  # the programs of continuous batching over `rows` slots


def compile_rollout(config: ml_collections.ConfigDict, devices) -> RolloutReport:
  """Compiles the sampler's prefill and decode programs for one generate call of the
  run (`rollout.chunk_rows` rows, padded as the planner counts them, one prefill per
  group, prompts as long as rollout.max_len leaves) on the rollout mesh over `devices`.
  When the worker streams the step's rows through those rows (continuous batching), the
  programs are the first fill, the decode loop and a refill; the prefill peak is the
  larger of the fill's and the refill's."""
  from flax import nnx

  from posttrain.sampling.sampler import Sampler
  _, mesh, rules, cfg, algo = _run(config, devices)
  r = config.rollout
  model = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  sampler = Sampler(model, mesh=mesh, rules=rules, max_len=int(r.max_len),
                    cache_dtype=r.get("cache_dtype", None),
                    gather_weights=bool(r.get("gather_weights", True)),
                    record_routing=algo.get("routing_replay", "none") == "rollout")
  group = int(algo.group_size)
  rows = planner.sampler_batch(config, group, planner.batch_mesh_size(mesh.abstract_mesh,
                                                                      rules))
  new = int(r.max_new_tokens)
  prompt_len = int(r.max_len) - new
  # The worker streams rollouts of more rows than that through `rows` slots (multi-turn:
  # later turns are refilled as transcripts up to max_len - 1 tokens).
  total = int(r.prompts_per_step) * group
  streams = planner.continuous_rollout(
      config, group, planner.batch_mesh_size(mesh.abstract_mesh, rules))
  start = time.perf_counter()
  with _compiling(mesh):
    programs = sampler.compile(
        total if streams else rows, prompt_len, new,
        distinct_prompts=-(-(total if streams else rows) // group),
        temperature=float(r.temperature), top_k=int(r.top_k) if r.get("top_k") else None,
        top_p=float(r.top_p) if r.get("top_p") else None, slots=rows if streams else None,
        max_prompt_len=(int(r.max_len) - 1 if streams and int(r.get("max_turns", 1)) > 1
                        else None), rounds=streams and int(r.get("max_turns", 1)) > 1)
  prefill, decode = programs[0], programs[1]
  prefill_peak = max(_peak(p.memory_analysis()) for p in programs[:1] + programs[2:])
  return RolloutReport(mesh=dict(mesh.shape), rows=rows, prompt_len=prompt_len,
                       max_new_tokens=new, prefill_peak=prefill_peak,
                       decode_peak=_peak(decode.memory_analysis()),
                       compile_s=time.perf_counter() - start, continuous=streams)


def _against_plan(lines: list[str], peak: int, planned_peak: int | None, what: str,
                  resident: tuple[int, str]) -> None:
  """Appends the resident bytes outside the program and the comparison with the plan."""
  h = planner.human_bytes
  extra, about = resident
  if extra:
    lines.append(f"  + {h(extra)} held outside this program ({about}) = {h(peak + extra)}")
  if planned_peak:
    lines.append(f"  the plan's {what} peak: {h(planned_peak)} "
                 f"(compiled / planned = {(peak + extra) / planned_peak:.2f})")


def format_rollout(report: RolloutReport, planned_peak: int | None = None,
                   resident: tuple[int, str] = (0, "")) -> str:
  h = planner.human_bytes
  mesh = ", ".join(f"{k}={v}" for k, v in report.mesh.items())
  lines = [f"compiled the rollout in {report.compile_s:.1f} s on mesh ({mesh}): "
           f"{report.rows} {'slots (continuous batching)' if report.continuous else 'rows'}, "
           f"prompts up to {report.prompt_len} + {report.max_new_tokens} new tokens",
           f"  peak per device (XLA): prefill {h(report.prefill_peak)}, decode "
           f"{h(report.decode_peak)}"]
  _against_plan(lines, max(report.prefill_peak, report.decode_peak), planned_peak,
                "rollout", resident)
  return "\n".join(lines)


def format_report(report: Report, planned_peak: int | None = None,
                  resident: tuple[int, str] = (0, "")) -> str:
  h = planner.human_bytes
  mesh = ", ".join(f"{k}={v}" for k, v in report.mesh.items())
  micro, rows, length = report.batch_shape
  lines = [
      f"compiled for {report.topology or 'the given devices'} in {report.compile_s:.1f} s: "
      f"the RL update on mesh ({mesh}), {micro} x {rows} x {length} tokens, "
      f"{report.mosaic_kernels} Mosaic kernel calls",
      f"  per device: arguments {h(report.arguments)}, outputs {h(report.outputs)} "
      f"({h(report.aliased)} reuse donated arguments), temporaries {h(report.temporaries)}",
      f"  peak per device (XLA): {h(report.peak)}",
  ]
  _against_plan(lines, report.peak, planned_peak, "train", resident)
  return "\n".join(lines)
