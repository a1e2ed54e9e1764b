"""The front door: `dot_product_attention` picks an implementation at call time."""
from __future__ import annotations

import jax

IMPLEMENTATIONS = ("pallas_tpu", "pallas_gpu", "chunked", "reference")


def target_device():
  """The abstract device of the mesh set with `jax.set_mesh` / `use_abstract_mesh`
  (platform, device_kind), which may be another platform's (a CPU host compiling for a
  TPU or GPU ahead of time), or None."""
  return getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)


def target_platform() -> str:
  """The platform being compiled for: `target_device()`'s, else the default backend."""
  device = target_device()
  return jax.default_backend() if device is None else device.platform


def gpu_target(device_kind: str = "NVIDIA H100 80GB HBM3"):
  """A context for lowering the GPU kernels where no GPU is present (ahead of time, e.g.
  `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` on a CPU host): an abstract
  mesh whose device is `device_kind`, which `target_platform()` then reports and from
  which jax 0.11's Triton lowering reads the target's limits (it refuses to lower
  without one). A no-op context on jax versions without abstract devices (0.10 lowers
  Triton kernels for CUDA as they are)."""
  import contextlib  # pylint: disable=g-import-not-at-top
  abstract_device = getattr(jax.sharding, "AbstractDevice", None)
  if abstract_device is None or not hasattr(jax.sharding, "use_abstract_mesh"):
    return contextlib.nullcontext()
  device = abstract_device(device_kind=device_kind, num_cores=None, platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device))


def default_implementation(backend: str | None = None) -> str:
  """Best implementation for a backend ('tpu', 'gpu', 'cpu'; default: the target one)."""
  backend = target_platform() if backend is None else backend
  if backend == "tpu":
    return "pallas_tpu"
  if backend in ("gpu", "cuda"):
    return "pallas_gpu"
  return "chunked"


def dot_product_attention(q, k, v, *, implementation: str | None = None,
                          causal: bool = True, q_segment_ids=None, kv_segment_ids=None,
                          sm_scale: float | None = None,
                          logits_soft_cap: float | None = None,
                          sliding_window: int | None = None, sinks=None,
                          alibi_slopes=None, **options):
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
    sinks: optional float [heads], attention-sink logits (gpt-oss): each query's
      softmax also holds exp(sinks[h]) with a zero value; differentiable.
    alibi_slopes: optional float [heads], ALiBi's slopes (BLOOM, MPT, Falcon-RW): each
      logit gains -slopes[h] * |q_pos - kv_pos| after the scale and soft cap; constants,
      with no gradient (see `kernels.reference`).
    **options: implementation-specific tuning, e.g. `block_q`, `block_kv`, `interpret`
      (pallas) or `chunk_size` (chunked).

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype, accumulated in float32;
    differentiable in q, k, v.
  """
  implementation = default_implementation() if implementation is None else implementation
  kwargs = dict(causal=causal, q_segment_ids=q_segment_ids,
                kv_segment_ids=kv_segment_ids, sm_scale=sm_scale,
                logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, sinks=sinks,
                alibi_slopes=alibi_slopes, **options)
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


def place(x, mesh, spec):
  """Lays x out as `spec` on `mesh` (as shard_map expects), with explicit or auto axes."""
  sharding = jax.sharding.NamedSharding(mesh, spec)
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return jax.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _axis_size(mesh, axes) -> int:
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  size = 1
  for axis in axes:
    size *= mesh.shape[axis]
  return size


def sharded_attention(q, k, v, *, mesh, batch_axis=None, head_axis=None, attention=None,
                      q_segment_ids=None, kv_segment_ids=None, sinks=None,
                      alibi_slopes=None, **kwargs):
  """Attention on global arrays, each device running the kernel on its own shard.

  XLA cannot partition a Pallas kernel: under `jit` on a multi-device mesh a Mosaic (TPU)
  call is refused ("cannot be automatically partitioned") and a Triton (GPU) call runs
  on the whole batch on every device. This wraps the call in `shard_map`, batch split
  over `batch_axis` and heads over `head_axis`. Keys and values are split with the
  heads when the axis divides kv_heads; otherwise every device holds all of them and
  takes the kv heads its query heads read (GQA / MQA with fewer kv heads than devices),
  or, when a device's query heads would straddle two kv groups, heads are not split.

  Args:
    q, k, v, q_segment_ids, kv_segment_ids, sinks, alibi_slopes, **kwargs: as in
      `dot_product_attention` (global shapes; the length is never split: use
      `ring_attention_sharded` for that). The sinks and slopes split with the heads.
    mesh: a `jax.sharding.Mesh`.
    batch_axis, head_axis: mesh axes (a name, a tuple of names or None) that split the
      batch and the query heads; they must divide batch and heads.
    attention: the per-shard function, `fn(q, k, v, **kwargs)`; default
      `dot_product_attention`.

  Returns:
    [batch, q_len, heads, head_dim], sharded like q.
  """
  from jax.sharding import PartitionSpec as P
  attention = dot_product_attention if attention is None else attention
  per_head = {name: x for name, x in (("sinks", sinks), ("alibi_slopes", alibi_slopes))
              if x is not None}  # [heads] arrays, split with the heads
  if mesh is None or mesh.size == 1:
    return attention(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                     **kwargs, **per_head)
  from kernels.reference import check_attention_inputs
  check_attention_inputs(q, k, v, q_segment_ids, kv_segment_ids, sinks=sinks,
                         alibi_slopes=alibi_slopes)
  heads, kv_heads = q.shape[2], k.shape[2]
  n_batch, n_heads = _axis_size(mesh, batch_axis), _axis_size(mesh, head_axis)
  if q.shape[0] % n_batch:
    raise ValueError(f"batch {q.shape[0]} is not divisible by the {batch_axis!r} axes "
                     f"({n_batch} devices)")
  if heads % n_heads:
    raise ValueError(f"heads {heads} is not divisible by the {head_axis!r} axes "
                     f"({n_heads} devices)")
  local_heads, group = heads // n_heads, heads // kv_heads
  kv_split = kv_heads % n_heads == 0
  if not kv_split and local_heads % group and group % local_heads:
    # A device's query heads would read parts of two kv heads' groups: keep heads whole.
    head_axis, local_heads, kv_split = None, heads, True
  q_spec = P(batch_axis, None, head_axis, None)
  kv_spec = P(batch_axis, None, head_axis if kv_split else None, None)
  seg_spec = P(batch_axis, None)

  def local(q, k, v, *rest):
    if not kv_split:  # the kv heads this device's query heads read
      first = jax.lax.axis_index(head_axis) * local_heads // group
      size = max(local_heads // group, 1)
      k = jax.lax.dynamic_slice_in_dim(k, first, size, axis=2)
      v = jax.lax.dynamic_slice_in_dim(v, first, size, axis=2)
    extra = dict(zip(per_head, rest))
    segments = rest[len(per_head):]
    q_seg, kv_seg = segments if segments else (None, None)
    return attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kwargs, **extra)

  args, specs = [q, k, v], [q_spec, kv_spec, kv_spec]
  for x in per_head.values():  # split with the query heads
    args.append(x)
    specs.append(P(head_axis))
  if q_segment_ids is not None:
    args += [q_segment_ids, kv_segment_ids]
    specs += [seg_spec, seg_spec]
  args = [place(x, mesh, spec) for x, spec in zip(args, specs)]
  return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=q_spec,
                       check_vma=False)(*args)
