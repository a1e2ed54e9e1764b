"""The TPU (Mosaic) kernels compile for real TPUs: libtpu's compiler, no TPU needed.

Interpret mode and the TPU simulator check the kernels' arithmetic; only the Mosaic
compiler checks what a TPU accepts (layouts, tiling, VMEM, the ops each generation
has). These tests compile the forward and backward kernels ahead of time for TPU
generations, and ring attention's flash blocks inside shard_map on a 4-chip slice.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kernels
from tests.tpu_aot import compile_for, requires_libtpu, spec, tpu_mesh

pytestmark = requires_libtpu

ALIBI_SLOPES = np.asarray([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3], np.float32)  # BLOOM's

# name: (q_len, kv_len, heads, kv_heads, head_dim, dtype, segments, options)
CASES = {
    "gqa_segments_bf16": (1024, 1024, 8, 2, 128, jnp.bfloat16, True, {}),
    "mqa_ragged_q_shorter": (200, 1000, 4, 1, 128, jnp.bfloat16, False, {}),
    "soft_cap_window_f32": (512, 512, 4, 4, 64, jnp.float32, False,
                            dict(logits_soft_cap=30.0, sliding_window=200)),
    "head_dim_256_non_causal": (512, 512, 2, 2, 256, jnp.bfloat16, False,
                                dict(causal=False)),
    "own_dq_blocks": (1024, 1024, 4, 2, 128, jnp.bfloat16, True,
                      dict(block_q=256, block_kv=512, block_q_dq=512, block_kv_dq=256)),
    # dq from the dk/dv kernel (5 block matmuls, no dq kernel): a 5-d f32 output block.
    "fused_backward": (1024, 1024, 8, 2, 128, jnp.bfloat16, True, dict(fused_bwd=True)),
    # TPUs have no float16 vectors: the kernels run such inputs in float32.
    "float16_inputs": (1024, 1024, 4, 2, 128, jnp.float16, False, {}),
    # 1024 blocks (the 16-bit default) would overflow VMEM here: defaults fall to 512.
    "f32_head_dim_256_window_at_4k": (4096, 4096, 2, 2, 256, jnp.float32, True,
                                      dict(logits_soft_cap=30.0, sliding_window=1000)),
    # Compact grids (step tables in SMEM): a long window picks them by default; a causal
    # triangle when asked, with the fused backward and segment ids.
    "window_at_16k_compact": (16384, 16384, 4, 2, 128, jnp.bfloat16, False,
                              dict(sliding_window=2048)),
    "compact_causal_fused": (2048, 2048, 8, 2, 128, jnp.bfloat16, True,
                             dict(compact_grid=True, fused_bwd=True)),
    # ALiBi: the slopes in SMEM, one scalar read a grid step (GQA: 3 heads a kv head).
    "alibi_gqa_segments_window": (512, 512, 6, 2, 128, jnp.bfloat16, True,
                                  dict(alibi_slopes=ALIBI_SLOPES, sliding_window=200,
                                       logits_soft_cap=30.0)),
    "alibi_compact_fused": (2048, 2048, 6, 2, 128, jnp.bfloat16, True,
                            dict(alibi_slopes=ALIBI_SLOPES, compact_grid=True,
                                 fused_bwd=True)),
}


def _grad_program(mesh, q_len, kv_len, heads, kv_heads, head_dim, dtype, segments, options):
  def loss(q, k, v, *segment_ids):
    seg = dict(zip(("q_segment_ids", "kv_segment_ids"), segment_ids))
    out = kernels.flash_attention(q, k, v, backend="tpu", interpret=False, **seg, **options)
    return out.astype(jnp.float32).sum()

  args = [spec(mesh, (2, q_len, heads, head_dim), dtype),
          spec(mesh, (2, kv_len, kv_heads, head_dim), dtype),
          spec(mesh, (2, kv_len, kv_heads, head_dim), dtype)]
  if segments:
    args += [spec(mesh, (2, q_len), jnp.int32), spec(mesh, (2, kv_len), jnp.int32)]
  return compile_for(mesh, jax.grad(loss, argnums=(0, 1, 2)), *args)


# The cases that compile for 15-45 s on CPU run with -m slow.
_SLOW_CASES = ("gqa_segments_bf16", "fused_backward", "float16_inputs",
               "f32_head_dim_256_window_at_4k", "window_at_16k_compact", "compact_causal_fused")


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.slow if c in _SLOW_CASES else ()) for c in sorted(CASES)])
def test_flash_forward_and_backward_compile_for_v5e(case):
  compiled = _grad_program(tpu_mesh("v5e", (1,), ("x",)), *CASES[case])
  text = compiled.as_text()
  # The three Mosaic kernels are in the program, not an emulation of them (the fused
  # backward has no dq kernel).
  fused = CASES[case][-1].get("fused_bwd", False)
  for name in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
    assert (name in text) != (fused and name == "flash_attention_dq"), name
  assert "tpu_custom_call" in text


_GENERATION_CASES = ["gqa_segments_bf16", "f32_head_dim_256_window_at_4k", "fused_backward",
                     "compact_causal_fused"]
_CHIPS = ["v4", "v5p", "v6e"]


# Every case on every generation: 25-30 s each on CPU, so with -m slow.
@pytest.mark.slow
@pytest.mark.parametrize("case, chip", [
    (case, chip) for case in _GENERATION_CASES for chip in _CHIPS])
def test_default_blocks_compile_for_each_generation(case, chip):
  _grad_program(tpu_mesh(chip, (1,), ("x",)), *CASES[case])


def test_pallas_outside_shard_map_is_refused_on_a_mesh():
  """Why the model wraps flash in shard_map: XLA cannot partition a Mosaic call."""
  mesh = tpu_mesh("v5e", (4,), ("data",))
  q = spec(mesh, (4, 256, 2, 128), jnp.bfloat16, P("data"))
  flash = functools.partial(kernels.flash_attention, backend="tpu", interpret=False)
  with pytest.raises(NotImplementedError, match="cannot be automatically partitioned"):
    compile_for(mesh, flash, q, q, q)
  sharded = functools.partial(kernels.sharded_attention, mesh=mesh, batch_axis="data",
                              attention=flash)
  compile_for(mesh, sharded, q, q, q)


@pytest.mark.slow
@pytest.mark.parametrize("window,alibi", [(None, False), (700, False), (None, True)])
def test_ring_attention_with_flash_blocks_compiles_on_a_4_chip_slice(window, alibi):
  """The ring's flash blocks; with a window, at the kv shard's distance (q_offset); with
  ALiBi, zig-zag's chunk pairs (local positions a chunk apart)."""
  mesh = tpu_mesh("v5e", (4,), ("sequence",))
  q = spec(mesh, (1, 8192 if window else 2048, 4, 128), jnp.bfloat16)
  k = spec(mesh, (1, 8192 if window else 2048, 2, 128), jnp.bfloat16)

  def loss(q, k, v):
    out = kernels.ring_attention_sharded(q, k, v, mesh=mesh, axis_name="sequence",
                                         block_kernel="flash", backend="tpu",
                                         interpret=False, sliding_window=window,
                                         alibi_slopes=ALIBI_SLOPES[:4] if alibi else None)
    return out.astype(jnp.float32).sum()

  text = compile_for(mesh, jax.grad(loss, argnums=(0, 1, 2)), q, k, k).as_text()
  assert "collective-permute" in text and "tpu_custom_call" in text
