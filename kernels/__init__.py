"""Attention kernels for JAX: reference, chunked, Pallas flash, ring and decode attention.

Imports jax only. Backends are chosen at call time, never at import: `import kernels`
initialises no device and imports no Pallas GPU / TPU lowering.

    from kernels import dot_product_attention
    out = dot_product_attention(q, k, v, causal=True, implementation=None)
"""
from kernels.attention import IMPLEMENTATIONS
from kernels.attention import default_implementation
from kernels.attention import dot_product_attention
from kernels.chunked_attention import chunked_attention
from kernels.decode_attention import decode_attention
from kernels.decode_attention import quantize_int8
from kernels.flash_attention import flash_attention
from kernels.reference import attention_block
from kernels.reference import attention_block_grad
from kernels.reference import attention_mask
from kernels.reference import merge_attention
from kernels.reference import reference_attention
from kernels.ring_attention import BlockKernel
from kernels.ring_attention import chunked_block_kernel
from kernels.ring_attention import flash_block_kernel
from kernels.ring_attention import from_zigzag
from kernels.ring_attention import reference_block_kernel
from kernels.ring_attention import ring_attention
from kernels.ring_attention import ring_attention_sharded
from kernels.ring_attention import shard_from_zigzag
from kernels.ring_attention import shard_to_zigzag
from kernels.ring_attention import to_zigzag

__all__ = [
    "BlockKernel",
    "IMPLEMENTATIONS",
    "attention_block",
    "attention_block_grad",
    "attention_mask",
    "chunked_attention",
    "chunked_block_kernel",
    "decode_attention",
    "default_implementation",
    "dot_product_attention",
    "flash_attention",
    "flash_block_kernel",
    "from_zigzag",
    "merge_attention",
    "quantize_int8",
    "reference_attention",
    "reference_block_kernel",
    "ring_attention",
    "ring_attention_sharded",
    "shard_from_zigzag",
    "shard_to_zigzag",
    "to_zigzag",
]
