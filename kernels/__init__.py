"""Attention kernels for JAX: reference, chunked, Pallas flash, ring and decode attention
(over a contiguous KV cache, a sliding window's ring buffer, or a paged cache), every one
with segment ids, soft caps, sliding windows, attention sinks and ALiBi (`alibi_slopes`);
the grouped matmul of a mixture of experts; and the linear-time mixers (gated delta rule,
gated linear attention / Mamba2's SSD, Mamba 1's selective scan).

Imports jax only. Backends are chosen at call time, never at import: `import kernels`
initialises no device and imports no Pallas GPU / TPU lowering.

    from kernels import dot_product_attention
    out = dot_product_attention(q, k, v, causal=True, implementation=None)
"""
from kernels.attention import (
    IMPLEMENTATIONS,
    default_implementation,
    dot_product_attention,
    gpu_target,
    sharded_attention,
    target_platform,
)
from kernels.chunked_attention import chunked_attention
from kernels.decode_attention import decode_attention, quantize_int8
from kernels.flash_attention import flash_attention
from kernels.gated_delta_rule import (
    causal_conv1d,
    gated_delta_rule,
    gated_delta_rule_reference,
)
from kernels.gated_linear_attention import (
    gated_linear_attention,
    gated_linear_attention_reference,
)
from kernels.grouped_matmul import grouped_matmul, grouped_weight_grad
from kernels.paged_attention import gather_pages, paged_cache_update, paged_decode_attention
from kernels.reference import (
    attention_block,
    attention_block_grad,
    attention_mask,
    local_chunk_segment_ids,
    merge_attention,
    reference_attention,
)
from kernels.ring_attention import (
    BlockKernel,
    chunked_block_kernel,
    flash_block_kernel,
    from_zigzag,
    reference_block_kernel,
    ring_attention,
    ring_attention_sharded,
    shard_from_zigzag,
    shard_to_zigzag,
    to_zigzag,
)
from kernels.selective_scan import selective_scan, selective_scan_reference

__all__ = [
    "IMPLEMENTATIONS",
    "BlockKernel",
    "attention_block",
    "attention_block_grad",
    "attention_mask",
    "causal_conv1d",
    "chunked_attention",
    "chunked_block_kernel",
    "decode_attention",
    "default_implementation",
    "dot_product_attention",
    "flash_attention",
    "flash_block_kernel",
    "from_zigzag",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "gated_linear_attention",
    "gated_linear_attention_reference",
    "gather_pages",
    "grouped_matmul",
    "grouped_weight_grad",
    "gpu_target",
    "merge_attention",
    "paged_cache_update",
    "paged_decode_attention",
    "quantize_int8",
    "local_chunk_segment_ids",
    "reference_attention",
    "reference_block_kernel",
    "ring_attention",
    "ring_attention_sharded",
    "selective_scan",
    "selective_scan_reference",
    "shard_from_zigzag",
    "sharded_attention",
    "shard_to_zigzag",
    "target_platform",
    "to_zigzag",
]
