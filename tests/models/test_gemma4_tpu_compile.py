"""Gemma 4 compiles for a TPU slice (libtpu, no TPU): the scanned model of sliding layers
and full layers of their own widths (two stacks, their caches apart in a LayerKindCaches),
with GeGLU experts beside each layer's dense MLP, sharded over data x tensor: the
gradient, and the sampler's prefill and decode steps with bf16 and int8 caches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain import models
from tests.tpu_aot import (cache_programs, compile_for, requires_libtpu, sharded_cache,
                           sharded_state, spec, tpu_mesh)

pytestmark = [requires_libtpu, pytest.mark.slow]  # 10-25 s of compiling each

# The 26B-A4B's layout at small widths: 5 sliding layers (256-wide heads) to a full one
# (512-wide, two key/value heads whose values are the keys' projection).
CFG = models.get_preset("gemma4_26b_a4b").replace(
    vocab_size=512, d_model=256, num_layers=6, num_heads=4, num_kv_heads=2, global_kv_heads=2,
    ffn_dim=128, shared_expert_dim=256, num_experts=8, num_experts_per_tok=2,
    sliding_window=128, max_position_embeddings=2048,
    layer_types=("sliding_attention",) * 5 + ("full_attention",))


def test_gemma4_gradient_compiles_on_a_sharded_tpu_mesh():
  mesh = tpu_mesh("v5e", (2, 1, 2, 1), ("data", "fsdp", "tensor", "sequence"))
  graphdef, state = sharded_state(CFG, mesh)
  tokens = spec(mesh, (4, 512), jnp.int32, P("data"))
  ctx = models.ShardingContext(mesh)

  def loss(state, tokens):
    model = nnx.merge(graphdef, state)
    return model(tokens, segment_ids_BxT=jnp.ones_like(tokens),
                 ctx=ctx).astype(jnp.float32).mean()

  compile_for(mesh, jax.grad(loss), state, tokens)


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_gemma4_prefill_and_decode_compile_on_a_sharded_tpu_mesh(cache_dtype):
  mesh = tpu_mesh("v5e", (2, 1, 2, 1), ("data", "fsdp", "tensor", "sequence"))
  graphdef, state = sharded_state(CFG, mesh)
  ctx = models.ShardingContext(mesh)
  tokens = spec(mesh, (4, 256), jnp.int32, P("data"))
  step_tokens = spec(mesh, (4, 1), jnp.int32, P("data"))
  cache = sharded_cache(CFG, ctx, 4, 1024, jnp.int8 if cache_dtype else None)
  assert cache.full.k.shape[-1] == 512 and cache.sliding.k.shape[-1] == 256
  prefill, decode = cache_programs(graphdef, ctx, 256)
  compile_for(mesh, prefill, state, tokens, cache)
  compile_for(mesh, decode, state, step_tokens, cache)
