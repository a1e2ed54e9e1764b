"""The gated MLP's hand-written backward against autodiff, in a model's gradient on CPU.

    python -m benchmarks.gated_mlp [--layers=4] [--rows=8] [--row_len=256]

`models.transformer.swiglu` (silu(gate) * up) and `geglu` (Gemma's tanh-approximate
gelu(gate) * up) save only their two inputs for the backward and recompute the rest in
one pass; autodiff of the plain expressions keeps the activation's intermediates too.
Each activation is measured in two arms of the same model and batch, in one process:

  autodiff     the plain expression (`jax.nn.silu(g) * u`, `jax.nn.gelu(g, True) * u`)
  custom_vjp   the model's own function

The program is the gradient of `token_logprobs` over one micro-batch (the "bench" widths,
D 256, F 1024, remat none, float32). Printed: XLA's temporaries of the compiled
gradient, and the median of 5 warm calls with the arms interleaved, each with its ratio
to autodiff.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
from flax import nnx

from posttrain import models
from posttrain.models import transformer

PLAIN = {"silu": lambda g, u: jax.nn.silu(g) * u,
         "gelu_tanh": lambda g, u: jax.nn.gelu(g, approximate=True) * u}
OWN = dict(transformer._GATED)
STEPS = 5


def _compiled(cfg, fn, rows: int, row_len: int):
  """(compiled gradient, its arguments) with the gated MLP `fn` traced in."""
  transformer._GATED[cfg.mlp_activation] = fn
  try:
    graphdef, params, rest = nnx.split(models.create_model(cfg, seed=0), nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (rows, row_len), 0, cfg.vocab_size)

    def loss(params, tokens):
      return nnx.merge(graphdef, params, rest).token_logprobs(tokens, tokens).sum()

    grad = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
  finally:
    transformer._GATED.update(OWN)
  return grad, (params, tokens)


def run(quick: bool = False, layers: int = 4, rows: int = 8, row_len: int = 256
        ) -> list[dict]:
  """The table's rows (`benchmarks.run` calls run(quick): 2 layers of 128 tokens)."""
  if quick:
    layers, row_len = 2, 128
  out = []
  for activation in ("gelu_tanh", "silu"):
    cfg = models.get_preset("bench", num_layers=layers, mlp_activation=activation,
                            remat="none", attention_impl="chunked", attention_chunk=128)
    arms = {"autodiff": PLAIN[activation], "custom_vjp": OWN[activation]}
    compiled = {name: _compiled(cfg, fn, rows, row_len) for name, fn in arms.items()}
    times = {name: [] for name in arms}
    for name, (grad, args) in compiled.items():  # warm-up
      jax.block_until_ready(grad(*args))
    for _ in range(STEPS):
      for name, (grad, args) in compiled.items():
        start = time.perf_counter()
        jax.block_until_ready(grad(*args))
        times[name].append(time.perf_counter() - start)
    temp = {name: grad.memory_analysis().temp_size_in_bytes
            for name, (grad, _) in compiled.items()}
    warm = {name: statistics.median(t) for name, t in times.items()}
    for name in arms:
      out.append({"activation": activation, "arm": name,
                  "temporaries MiB": round(temp[name] / (1 << 20), 1),
                  "warm s (median)": round(warm[name], 3),
                  "temp / autodiff": round(temp[name] / temp["autodiff"], 2),
                  "time / autodiff": round(warm[name] / warm["autodiff"], 2)})
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--row_len", type=int, default=256)
  args = parser.parse_args()
  for row in run(False, args.layers, args.rows, args.row_len):
    print(row)


if __name__ == "__main__":
  main()
