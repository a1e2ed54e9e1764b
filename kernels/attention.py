"""The front door: `dot_product_attention` picks an implementation at call time."""
from __future__ import annotations

import jax

IMPLEMENTATIONS = ("pallas_tpu", "pallas_gpu", "chunked", "reference")


def default_implementation(backend: str | None = None) -> str:
  """Best implementation for a backend ('tpu', 'gpu', 'cpu'; default: the current one)."""
  backend = jax.default_backend() if backend is None else backend
  if backend == "tpu":
    return "pallas_tpu"
  if backend in ("gpu", "cuda"):
    return "pallas_gpu"
  return "chunked"


def dot_product_attention(q, k, v, *, implementation: str | None = None,
                          causal: bool = True, q_segment_ids=None, kv_segment_ids=None,
                          sm_scale: float | None = None,
                          logits_soft_cap: float | None = None,
                          sliding_window: int | None = None, **options):
  """Scaled dot-product attention with one contract for every backend.

  Args:
    q: [batch, q_len, heads, head_dim].
    k, v: [batch, kv_len, kv_heads, head_dim]; heads % kv_heads == 0 (GQA / MQA
      without repeating k, v).
    implementation: 'pallas_tpu', 'pallas_gpu', 'chunked', 'reference', or None for
      the best one on the current backend (pallas on TPU / GPU, chunked elsewhere).
    causal: mask keys after the query; for q_len < kv_len the queries are the last
      q_len positions.
    q_segment_ids, kv_segment_ids: optional int [batch, len]; a query sees only keys of
      its own segment, and id 0 is padding (padding queries output 0).
    sm_scale: logit scale, default 1/sqrt(head_dim).
    logits_soft_cap: if set, logits = cap * tanh(logits / cap).
    sliding_window: if set, a query sees only keys less than this many positions back.
    **options: implementation-specific tuning, e.g. `block_q`, `block_kv`, `interpret`
      (pallas) or `chunk_size` (chunked).

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype, accumulated in float32;
    differentiable in q, k, v.
  """
  implementation = default_implementation() if implementation is None else implementation
  kwargs = dict(causal=causal, q_segment_ids=q_segment_ids,
                kv_segment_ids=kv_segment_ids, sm_scale=sm_scale,
                logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, **options)
  if implementation == "reference":
    from kernels.reference import reference_attention
    return reference_attention(q, k, v, **kwargs)
  if implementation == "chunked":
    from kernels.chunked_attention import chunked_attention
    return chunked_attention(q, k, v, **kwargs)
  if implementation in ("pallas_tpu", "pallas_gpu"):
    from kernels.flash_attention import flash_attention
    backend = "tpu" if implementation == "pallas_tpu" else "gpu"
    return flash_attention(q, k, v, backend=backend, **kwargs)
  raise ValueError(
      f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
