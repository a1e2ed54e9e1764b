"""DeepSeek Sparse Attention compiles for a TPU slice (libtpu, no TPU): the sharded
model's gradient over rows longer than index_topk (the indexer's top-k, the chosen-key
mask, the blocked masked attention under jax.checkpoint), and the sampler's prefill and
decode steps choosing among the cached index keys, bf16 and int8 caches."""
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

CFG = models.get_preset("tiny").replace(
    architecture="DeepseekV32ForCausalLM", vocab_size=512, d_model=256, num_heads=4,
    num_kv_heads=4, head_dim=192, kv_lora_rank=128, q_lora_rank=96, qk_rope_head_dim=64,
    v_head_dim=128, rope=models.RopeConfig(partial_rotary_factor=64 / 192),
    index_topk=128, index_heads=4, index_head_dim=128, num_layers=2, dtype="bfloat16")


def test_sparse_gradient_compiles_on_a_sharded_tpu_mesh():
  mesh = tpu_mesh("v5e", (2, 1, 2, 1), ("data", "fsdp", "tensor", "sequence"))
  graphdef, state = sharded_state(CFG, mesh)
  tokens = spec(mesh, (4, 1024), jnp.int32, P("data"))  # 4 blocks of 256 queries
  ctx = models.ShardingContext(mesh)

  def loss(state, tokens):
    model = nnx.merge(graphdef, state)
    return model(tokens, segment_ids_BxT=jnp.ones_like(tokens),
                 ctx=ctx).astype(jnp.float32).mean()

  text = compile_for(mesh, jax.grad(loss), state, tokens).as_text()
  assert "topk" in text.lower() or "sort" in text.lower()  # the indexer's choice


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_sparse_prefill_and_decode_compile_on_a_sharded_tpu_mesh(cache_dtype):
  mesh = tpu_mesh("v5e", (2, 1, 2, 1), ("data", "fsdp", "tensor", "sequence"))
  graphdef, state = sharded_state(CFG, mesh)
  ctx = models.ShardingContext(mesh)
  tokens = spec(mesh, (4, 512), jnp.int32, P("data"))
  step_tokens = spec(mesh, (4, 1), jnp.int32, P("data"))
  cache = sharded_cache(CFG, ctx, 4, 1024, jnp.int8 if cache_dtype else None)
  assert cache[0].v.shape[-1] == CFG.index_head_dim  # the index keys beside the latent
  prefill, decode = cache_programs(graphdef, ctx, 512)
  compile_for(mesh, prefill, state, tokens, cache)
  compile_for(mesh, decode, state, step_tokens, cache)
