"""Mixture-of-experts layer: dropless grouped experts against the dense mixture, compiled
for a TPU slice on this host (libtpu, no TPU), and timed on this CPU.

    python -m benchmarks.moe [--topology=v5p:2x2x1] [--preset=qwen3_30b_a3b]
        [--rows=8] [--row_len=2048] [--cpu_reps=5]

One layer's MLP, forward and backward (gradients in its input and every weight), two arms:

  grouped   `models.transformer.MoE`: tokens sorted by expert, each expert's run through
            `jax.lax.ragged_dot` (XLA:TPU's grouped matmul), inside `shard_map` (each
            device its own tokens; experts' D gathered over fsdp, F split over tensor)
  dense     every expert on every token, weighted by the same routing (zero off the top
            k), partitioned by XLA from the same shardings: what a mixture costs without
            a grouped matmul

TPU: XLA's flops and temporaries per device for the preset's layer at rows x row_len
tokens, mesh (1, fsdp, tensor, 1) over the slice; compiled, not run. CPU: the median
wall time of the same two programs for a small mixture (XLA:CPU expands `ragged_dot`
into a masked dense product, so there the grouped arm does the dense arm's work).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import aot, models
from posttrain.models import transformer as tr

MIB = 1 << 20


def _dense_mixture(cfg, ctx):
  def layer(params, x):
    dt = jnp.dtype(cfg.dtype)
    b, t, d = x.shape
    x = x.reshape(b * t, d).astype(dt)
    w, e = tr.route(x, params["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    combine = jnp.zeros((b * t, cfg.num_experts), jnp.float32).at[
        jnp.arange(b * t)[:, None], e].add(w)
    gate = jnp.einsum("ND,EDF->NEF", x, params["gate_proj"].astype(dt))
    up = jnp.einsum("ND,EDF->NEF", x, params["up_proj"].astype(dt))
    h = ctx.constrain(tr.swiglu(gate, up), ("batch", "experts", "mlp"))
    y = jnp.einsum("NEF,EFD->NED", h, params["down_proj"].astype(dt))
    return jnp.einsum("NED,NE->ND", y.astype(jnp.float32), combine).astype(dt).reshape(b, t, d)
  return layer


def _grouped(cfg, ctx):
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: tr.MoE(cfg, nnx.Rngs(0))))

  def layer(params, x):
    state = nnx.eval_shape(lambda: nnx.state(tr.MoE(cfg, nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)(x, ctx)
  return layer


def _programs(cfg, mesh, rows, row_len):
  """{arm: jitted grad of the layer}, abstract params and input laid out on `mesh`."""
  ctx = models.ShardingContext(mesh)
  abstract = nnx.eval_shape(lambda: nnx.state(tr.MoE(cfg, nnx.Rngs(0))))
  shardings = models.factory.state_shardings(abstract, mesh, models.DEFAULT_RULES)
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        nnx.to_pure_dict(abstract), nnx.to_pure_dict(shardings))
  shape = (rows, row_len, cfg.d_model)
  x = jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype),
                           sharding=ctx.sharding(("batch", "length", "embed"), shape))
  out = {}
  for arm, make in (("grouped", _grouped), ("dense", _dense_mixture)):
    fn = make(cfg, ctx)
    out[arm] = jax.jit(jax.grad(lambda p, x, fn=fn: jnp.sum(fn(p, x).astype(jnp.float32)),
                                argnums=(0, 1)))
  return out, params, x


def tpu_rows(topology: str, preset: str, rows: int, row_len: int,
             tensor: int = 1) -> list[dict]:
  """XLA:TPU's flops and temporaries per device of each arm."""
  devices = aot.tpu_devices(topology)
  mesh = models.make_mesh((1, -1, tensor, 1), devices=devices)
  cfg = models.get_preset(preset)
  programs, params, x = _programs(cfg, mesh, rows, row_len)
  out, flops = [], {}
  for arm, fn in programs.items():
    with jax.set_mesh(mesh):
      compiled = fn.lower(params, x).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops[arm] = float(cost.get("flops", 0.0))
    out.append({"where": f"{topology} {dict(mesh.shape)}", "arm": arm,
                "GFLOP / device": round(flops[arm] / 1e9, 1),
                "temporaries MiB": round(compiled.memory_analysis().temp_size_in_bytes / MIB, 1)})
  for row in out:
    row["flops dense / arm"] = round(flops["dense"] / max(flops[row["arm"]], 1.0), 2)
  return out


def cpu_rows(reps: int, rows: int = 4, row_len: int = 256) -> list[dict]:
  """Median CPU wall time of each arm on one device for a small mixture (8 of 2)."""
  cfg = models.get_preset("tiny", d_model=256, ffn_dim=512, num_experts=8,
                          num_experts_per_tok=2)
  mesh = models.make_mesh((1, 1, 1, 1), devices=jax.devices()[:1])
  programs, abstract, x = _programs(cfg, mesh, rows, row_len)
  key = iter(jax.random.split(jax.random.key(0), 16))
  params = jax.tree.map(lambda a: jax.random.normal(next(key), a.shape, a.dtype) * 0.05,
                        abstract)
  x = jax.random.normal(jax.random.key(1), x.shape, x.dtype)
  times = {}
  for arm, fn in programs.items():
    jax.block_until_ready(fn(params, x))
    samples = []
    for _ in range(reps):
      start = time.perf_counter()
      jax.block_until_ready(fn(params, x))
      samples.append(time.perf_counter() - start)
    times[arm] = float(np.median(samples))
  return [{"where": f"CPU, {rows}x{row_len} tokens, D 256, F 512, 8 experts, top 2",
           "arm": arm, "median ms": round(t * 1e3, 1),
           "time dense / arm": round(times["dense"] / t, 2)} for arm, t in times.items()]


def run(quick: bool) -> list[dict]:
  """benchmarks.run's entry."""
  if quick:
    return tpu_rows("v5p:2x2x1", "qwen3_30b_a3b", 4, 1024) + cpu_rows(3)
  return tpu_rows("v5p:2x2x1", "qwen3_30b_a3b", 8, 2048) + cpu_rows(5)


def _table(rows: list[dict]) -> None:
  keys = list(dict.fromkeys(k for r in rows for k in r))
  print("| " + " | ".join(keys) + " |")
  print("|" + "---|" * len(keys))
  for r in rows:
    print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5p:2x2x1")
  parser.add_argument("--preset", default="qwen3_30b_a3b")
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--row_len", type=int, default=2048)
  parser.add_argument("--tensor", type=int, default=1, help="mesh tensor axis size")
  parser.add_argument("--cpu_reps", type=int, default=5)
  args = parser.parse_args(argv)
  _table(tpu_rows(args.topology, args.preset, args.rows, args.row_len, args.tensor))
  _table(cpu_rows(args.cpu_reps))


if __name__ == "__main__":
  main()
