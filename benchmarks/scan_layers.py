"""scan_layers: the layer list against the layers stacked and run as one lax.scan.

    python -m benchmarks.scan_layers [--quick] [--gemma]
    python -m benchmarks.scan_layers --config=configs/llama3_8b_grpo_v5p64.py \\
        --compile_for=v5p:2x4x4

Default (CPU, what `benchmarks.run` calls): a GRPO step (reference log-probs and the
update in one program, AdamW, remat "full") of the "bench" widths at 4 and 16 layers on 8
fake CPU devices (fsdp 8): the first step (compile included) and the median of the warm
steps, per arm, in one process, arms interleaved. --gemma: the same widths with Gemma 3's
layers (five sliding, window 32, to one full; sandwich norms, GeGLU, soft caps), whose
scanned body picks each layer's kernel with a lax.cond.

With --compile_for (needs libtpu): the config's RL update and its sampler's prefill and
decode, compiled for that TPU slice on this host as `launch.plan --compile_for` does,
each arm in its own process: compile seconds, the process's peak resident memory, and
XLA's peak bytes per device.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

STEPS = 5


def grpo_batch():
  """The CPU arms' batch: 16 rows of 96 tokens (32 prompt + 64 response), one micro-batch."""
  from posttrain.rl import packing
  rng = np.random.default_rng(0)
  trajectories = [dict(prompt_tokens=rng.integers(1, 1000, 32),
                       response_tokens=rng.integers(1, 1000, 64),
                       response_mask=np.ones(64, bool),
                       behaviour_logprobs=-rng.uniform(1, 8, 64), advantages=rng.normal(),
                       rewards=rng.normal()) for _ in range(16)]
  return packing.split_microbatches(packing.pack_trajectories(trajectories, 96, num_rows=16),
                                    96 * 16, num_microbatches=1)


def time_steps(steps: dict, states: dict, refs: dict, batch) -> tuple[dict, dict]:
  """(first step s, median warm step s) per arm: one step each (compile included), then
  STEPS warm steps with the arms interleaved, so load drifts hit them alike. `states`
  is updated in place."""
  import jax
  first, warm = {}, {name: [] for name in steps}

  def one(name):
    start = time.perf_counter()
    states[name], _ = steps[name](states[name], batch, refs[name])
    jax.block_until_ready(states[name].params)
    return time.perf_counter() - start

  for name in steps:
    first[name] = one(name)
  for _ in range(STEPS):
    for name in steps:
      warm[name].append(one(name))
  return first, {name: statistics.median(times) for name, times in warm.items()}


GEMMA = dict(norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
             mlp_activation="gelu_tanh", query_pre_attn_scalar=64.0, attn_logit_softcap=50.0,
             final_logit_softcap=30.0, sliding_window=32, architecture="Gemma3ForCausalLM")


def _cpu_rows(quick: bool, gemma: bool = False) -> list[dict]:
  from posttrain import models
  from posttrain.rl import presets
  from posttrain.rl import state as state_lib
  from posttrain.rl import train_step as ts
  mesh = models.make_mesh((1, -1, 1, 1))
  batch = grpo_batch()
  algo = presets.algorithm_config("grpo", kl_coef=0.04)
  optimizer = state_lib.make_optimizer(1e-5, warmup=0, total_steps=100)
  rows = []
  for layers in ((4,) if quick else (4, 16)):
    base = models.get_preset("bench", num_layers=layers, remat="full")
    if gemma:
      base = base.replace(**GEMMA, layer_types=tuple(
          "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
          for i in range(layers)))
    plain = models.create_model(base, mesh=mesh)
    arms = {"layer list": plain, "scan_layers": models.relayout(plain, scan_layers=True,
                                                                mesh=mesh)}
    steps, states, refs = {}, {}, {}
    for name, model in arms.items():
      steps[name] = ts.make_train_step(model.cfg, algo, optimizer, mesh=mesh,
                                       reference_in_step=True)
      states[name] = state_lib.init_train_state(model, optimizer, mesh=mesh)
      refs[name] = state_lib.frozen_copy(states[name].params)
    first, warm = time_steps(steps, states, refs, batch)
    for name in arms:
      rows.append({"layers": layers, "arm": name, "first step s": round(first[name], 2),
                   "warm step s (median)": round(warm[name], 3),
                   "first / list": round(first[name] / first["layer list"], 2),
                   "warm / list": round(warm[name] / warm["layer list"], 2)})
  return rows


def run(quick: bool = False, gemma: bool = False) -> list[dict]:
  return _cpu_rows(quick, gemma)


def _arm(config_path: str, topology: str, scan: bool) -> dict:
  """One arm of the TPU compile comparison (run in its own process for its peak RSS)."""
  import importlib.util

  from posttrain import aot
  spec = importlib.util.spec_from_file_location("run_config", config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.model.overrides.scan_layers = scan
  devices = aot.tpu_devices(topology)
  update = aot.compile_rl_step(config, devices, topology=topology)
  rollout = aot.compile_rollout(config, devices)
  gib = 1 << 30
  return {"update compile s": round(update.compile_s, 1),
          "rollout compile s": round(rollout.compile_s, 1),
          "host peak GiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20),
                                 2),
          "update peak GiB": round(update.peak / gib, 2),
          "prefill peak GiB": round(rollout.prefill_peak / gib, 2),
          "decode peak GiB": round(rollout.decode_peak / gib, 2)}


def _compile_rows(config_path: str, topology: str) -> list[dict]:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rows = []
  for scan in (False, True):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.scan_layers", f"--config={config_path}",
         f"--compile_for={topology}", f"--arm={'scan' if scan else 'list'}"],
        cwd=root, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": root})
    if proc.returncode:
      rows.append({"arm": "scan_layers" if scan else "layer list",
                   "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]})
      continue
    rows.append({"arm": "scan_layers" if scan else "layer list",
                 **json.loads(proc.stdout.strip().splitlines()[-1])})
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--gemma", action="store_true")
  parser.add_argument("--config", default=None)
  parser.add_argument("--compile_for", default=None)
  parser.add_argument("--arm", choices=("list", "scan"), default=None)
  args = parser.parse_args()
  if args.arm:
    print(json.dumps(_arm(args.config, args.compile_for, args.arm == "scan")))
    return
  if args.compile_for:
    rows = _compile_rows(args.config, args.compile_for)
  else:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    rows = run(args.quick, args.gemma)
  for row in rows:
    print(row)


if __name__ == "__main__":
  main()
