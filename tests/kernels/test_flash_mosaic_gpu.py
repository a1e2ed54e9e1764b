"""The Hopper (Mosaic GPU) flash kernels: their block schedules against a brute-force
mask, lowering for CUDA without a GPU, one compile per distinct kernel, and the choice
between them and the Triton kernels.
Its numbers are checked on an H200 by `python -m benchmarks.attention --accelerator-only`
(the Mosaic GPU interpreter of this jax cannot run wgmma kernels on CPU)."""
import dataclasses
import importlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels

fa = importlib.import_module("kernels.flash_attention")  # the module, not the function
fm = importlib.import_module("kernels.flash_mosaic_gpu")


def _visible(cfg, q_rows, kv_block, block_kv, q_seg=None, kv_seg=None):
  """Brute force: [rows, keys] visibility of real query rows against one kv block
  (segment ids padded to whole blocks)."""
  q_pos = np.asarray(q_rows)[:, None] + cfg.offset
  kv_pos = kv_block * block_kv + np.arange(block_kv)[None, :]
  mask = np.broadcast_to(kv_pos < cfg.kv_len, (len(q_rows), block_kv)).copy()
  if q_seg is not None:
    q_ids, kv_ids = q_seg[np.asarray(q_rows)][:, None], kv_seg[kv_pos]
    mask &= (q_ids == kv_ids) & (kv_ids != 0)
  if cfg.causal:
    mask &= q_pos >= kv_pos
  if cfg.sliding_window is not None:
    mask &= q_pos - kv_pos < cfg.sliding_window
    if not cfg.causal:
      mask &= kv_pos - q_pos < cfg.sliding_window
  return mask


def _packed_ids(draw, length, pad_to):
  """Packed-row ids: runs of 1, 2, ... then padding (0), padded to `pad_to`."""
  sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
  ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(sizes)])[:length]
  ids = np.pad(ids, (0, length - len(ids)))
  if draw(st.booleans()):  # arbitrary ids instead: the ranges only bound them
    ids = np.asarray(draw(st.lists(st.integers(0, 3), min_size=length, max_size=length)))
  return np.pad(ids, (0, -length % pad_to)).astype(np.int32)


# One program per shape, not one dispatch per op.
_segment_block_ranges = jax.jit(fa.segment_block_ranges, static_argnums=(2, 3))


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(
    q_len=st.integers(1, 700), kv_len=st.integers(1, 700), causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 400)), head_dim=st.sampled_from([128, 256]),
    offset=st.one_of(st.none(), st.integers(-300, 300)), segments=st.booleans(),
    data=st.data())
def test_schedule_runs_exactly_the_visible_blocks(q_len, kv_len, causal, window, head_dim,
                                                  offset, segments, data):
  """Per pair of q tiles: both consumers run the same steps (the producer's union, in
  order, so barrier phases match); each computes every kv block a real row of its tile
  sees (exactly those without segment ids: with them the segment and causal ranges are
  each exact for packed rows, their intersection a bound), and skips the element mask
  only where no element is masked."""
  hypothesis.assume(causal or window is None or offset is None)
  q = jax.ShapeDtypeStruct((1, q_len, 1, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, kv_len, 1, head_dim), jnp.bfloat16)
  cfg = fa.make_config(q, k, causal=causal, sliding_window=window, q_offset=offset,
                       segments=segments, backend="gpu", interpret=True)
  block_kv, _ = fm.kv_block_and_slots(head_dim)
  cfg = fm._tile_config(cfg, block_kv)
  pairs = -(-q_len // (fm.CONSUMERS * fm.TILE_Q))
  q_seg = kv_seg = table = None
  if segments:  # padded as `forward` pads them
    q_seg = _packed_ids(data.draw, q_len, fm.CONSUMERS * fm.TILE_Q)
    kv_seg = _packed_ids(data.draw, kv_len, block_kv)
    table = np.asarray(_segment_block_ranges(q_seg[None], kv_seg[None], fm.TILE_Q,
                                             block_kv)[0][0])
  row = lambda tile: None if table is None else tuple(table[tile])  # noqa: E731
  for pair in range(pairs):
    first = pair * fm.CONSUMERS
    u_lo, n = (int(x) for x in fm._union(cfg, first, row))
    if n:
      assert 0 <= u_lo and u_lo + n <= cfg.num_kv_blocks
    for tile in (first, first + 1):
      spans = fm._spans(u_lo, u_lo + n - 1, *fm._ranges(cfg, tile, row(tile)))
      spans = [(int(a), int(b), kind) for a, b, kind in spans]
      assert spans[0][0] == u_lo and spans[-1][1] == u_lo + n
      for (_, stop, _), (start, _, _) in zip(spans, spans[1:]):
        assert stop == start
      assert all(a <= b for a, b, _ in spans), spans
      computed = {i for a, b, kind in spans if kind != "skip" for i in range(a, b)}
      unmasked = {i for a, b, kind in spans if kind == "full" for i in range(a, b)}
      rows = np.arange(tile * fm.TILE_Q, min((tile + 1) * fm.TILE_Q, q_len))
      if not len(rows):  # a tile of padding rows: whatever it computes is dropped
        continue
      want = {i for i in range(cfg.num_kv_blocks)
              if _visible(cfg, rows, i, block_kv, q_seg, kv_seg).any()}
      if not segments:
        assert computed == want, (tile, spans, sorted(want))
      assert computed >= want, (tile, spans, sorted(want))
      for i in unmasked:
        assert _visible(cfg, rows, i, block_kv, q_seg, kv_seg).all(), (tile, i)


@pytest.mark.slow
@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    q_len=st.integers(1, 700), kv_len=st.integers(1, 700), causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 400)),
    offset=st.one_of(st.none(), st.integers(-300, 300)), segments=st.booleans(),
    data=st.data())
def test_dkv_schedule_runs_exactly_the_blocks_that_see_each_kv_tile(
    q_len, kv_len, causal, window, offset, segments, data):
  """The dk / dv kernel's steps per pair of kv tiles: the q blocks in the producer's
  union for both consumers, computed wherever a real query sees a real key of the tile
  (exactly there without segment ids), unmasked only where nothing is masked."""
  hypothesis.assume(causal or window is None or offset is None)
  q = jax.ShapeDtypeStruct((1, q_len, 1, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, kv_len, 1, 128), jnp.bfloat16)
  cfg = fa.make_config(q, k, causal=causal, sliding_window=window, q_offset=offset,
                       segments=segments, backend="gpu", interpret=True)
  cfg = dataclasses.replace(cfg, block_q=fm.TILE_Q_BWD, block_kv=fm.TILE_Q)
  q_seg = kv_seg = table = None
  if segments:  # padded as `dkv` pads them
    q_seg = _packed_ids(data.draw, q_len, fm.TILE_Q_BWD)
    kv_seg = _packed_ids(data.draw, kv_len, fm.CONSUMERS * fm.TILE_Q)
    table = np.asarray(fa.segment_block_ranges(q_seg[None], kv_seg[None], fm.TILE_Q_BWD,
                                               fm.TILE_Q)[1][0])
  row = lambda tile: None if table is None else tuple(table[tile])  # noqa: E731
  for pair in range(-(-kv_len // (fm.CONSUMERS * fm.TILE_Q))):
    first = pair * fm.CONSUMERS
    u_lo, n = (int(x) for x in fm._union(cfg, first, row, kv_major=True))
    if n:
      assert 0 <= u_lo and u_lo + n <= cfg.num_q_blocks
    for tile in (first, first + 1):
      spans = [(int(a), int(b), kind) for a, b, kind in
               fm._spans(u_lo, u_lo + n - 1, *fm._ranges(cfg, tile, row(tile), True))]
      assert spans[0][0] == u_lo and spans[-1][1] == u_lo + n
      assert all(a <= b for a, b, _ in spans) and all(
          x[1] == y[0] for x, y in zip(spans, spans[1:])), spans
      keys = np.arange(tile * fm.TILE_Q, min((tile + 1) * fm.TILE_Q, kv_len))
      if not len(keys):
        continue
      computed = {i for a, b, kind in spans if kind != "skip" for i in range(a, b)}
      unmasked = {i for a, b, kind in spans if kind == "full" for i in range(a, b)}

      def visible(qi):  # [keys, rows of q block qi] (padding rows: never masked)
        rows = np.arange(qi * fm.TILE_Q_BWD, (qi + 1) * fm.TILE_Q_BWD)
        padded_kv = -(-kv_len // (fm.CONSUMERS * fm.TILE_Q)) * fm.CONSUMERS * fm.TILE_Q
        ids = {} if q_seg is None else dict(
            q_seg=np.pad(q_seg, (0, fm.TILE_Q_BWD)), kv_seg=kv_seg)
        return _visible(cfg, rows, 0, padded_kv, **ids)[:, keys].T, rows < q_len
      want = {qi for qi in range(cfg.num_q_blocks)
              if (visible(qi)[0] & visible(qi)[1][None]).any()}
      if not segments:
        assert computed == want, (tile, spans, sorted(want))
      assert computed >= want, (tile, spans, sorted(want))
      for qi in unmasked:
        assert visible(qi)[0][:, visible(qi)[1]].all(), (tile, qi)


def _lower(gpu_forward="mosaic", q_len=1000, kv_len=1000, heads=4, kv_heads=2, d=128,
           dtype=jnp.bfloat16, segments=False, gpu_backward=None, **mask):
  def f(q, k, v, seg):
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}
    fn = lambda q, k, v: fa.flash_attention(  # noqa: E731
        q, k, v, backend="gpu", interpret=False, gpu_forward=gpu_forward,
        gpu_backward=gpu_backward, **ids, **mask)
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(out)
  q = jax.ShapeDtypeStruct((1, q_len, heads, d), dtype)
  k = jax.ShapeDtypeStruct((1, kv_len, kv_heads, d), dtype)
  seg = jax.ShapeDtypeStruct((1, q_len), jnp.int32)
  with kernels.gpu_target():
    return jax.jit(f).trace(q, k, k, seg).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kwargs", [
    dict(causal=True),
    dict(causal=True, sliding_window=300, logits_soft_cap=30.0),
    dict(causal=False, d=64, kv_heads=1, dtype=jnp.float16),
    dict(causal=True, q_len=300, d=256),
    dict(causal=True, q_len=1000, kv_len=300, d=192),
    dict(causal=True, segments=True),
    dict(causal=True, segments=True, sliding_window=200, kv_heads=4),
])
def test_lowers_for_cuda_with_mosaic_forward(kwargs):
  """Forward: one Mosaic GPU kernel; backward: the Triton dq and dk / dv kernels."""
  text = _lower(gpu_backward="triton", **kwargs)
  assert text.count("custom_call @mosaic_gpu") == 1, text.count("mosaic_gpu")
  triton = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
  assert len(triton) == 2 and not any("flash_attention_fwd" in c for c in triton)


@pytest.mark.parametrize("kwargs", [
    dict(causal=True),
    dict(causal=True, sliding_window=300, logits_soft_cap=30.0),
    dict(causal=False, d=64, kv_heads=1, dtype=jnp.float16),
    dict(causal=True, q_len=300, kv_heads=4),
    dict(causal=True, segments=True, sliding_window=200),
])
def test_lowers_for_cuda_with_mosaic_backward(kwargs):
  """gpu_backward='mosaic': Mosaic forward, dq and dk / dv kernels, no Triton."""
  text = _lower(gpu_backward="mosaic", **kwargs)
  assert text.count("custom_call @mosaic_gpu") == 3
  assert "__gpu$xla.gpu.triton" not in text


def _kernels(text) -> tuple[int, int]:
  """(Mosaic GPU, Triton) kernel calls in lowered text."""
  return text.count("custom_call @mosaic_gpu"), text.count("__gpu$xla.gpu.triton")


def test_hopper_device_reads_the_lowering_target():
  """A CPU host lowering for a GPU ahead of time picks the kernels the GPU named by
  `gpu_target` would run (jax versions with abstract devices; on others the context
  names no device, and the host is what counts)."""
  assert not fm.hopper_device()  # the CPU test host
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe",
               "NVIDIA GH200 480GB", "NVIDIA H800", "NVIDIA H20", "NVIDIA H100 NVL"):
    assert fm.hopper_kind(kind), kind
  for kind in ("NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "NVIDIA B200", "NVIDIA H", "Tesla T4",
               "NVIDIA RTX 2000 Ada Generation", "TPU v5 lite"):
    assert not fm.hopper_kind(kind), kind
  abstract = hasattr(jax.sharding, "AbstractDevice")
  with kernels.gpu_target("NVIDIA H200"):
    assert fm.hopper_device() == abstract
  with kernels.gpu_target("NVIDIA A100-SXM4-80GB"):
    assert not fm.hopper_device()
  assert not fm.hopper_device()


@pytest.mark.slow
def test_default_kernels_on_hopper(monkeypatch):
  """Off Hopper: Triton. On it: the Mosaic forward for calls without segment ids and
  inputs it takes; the Mosaic backward kernels only when asked."""
  auto = dict(gpu_forward=None, causal=True)
  monkeypatch.setattr(fm, "hopper_device", lambda: False)
  assert _kernels(_lower(**auto)) == (0, 3)
  monkeypatch.setattr(fm, "hopper_device", lambda: True)
  assert _kernels(_lower(**auto)) == (1, 2)
  assert _kernels(_lower(**auto, sliding_window=300, logits_soft_cap=30.0)) == (1, 2)
  assert _kernels(_lower(**auto, segments=True)) == (0, 3)
  assert _kernels(_lower(**auto, gpu_backward="mosaic")) == (3, 0)
  assert _kernels(_lower(**auto, segments=True, gpu_backward="mosaic")) == (2, 1)
  assert _kernels(_lower(gpu_forward="triton", causal=True)) == (0, 3)
  assert _kernels(_lower(**auto, d=256)) == (1, 2)
  assert _kernels(_lower(**auto, dq_atomic=True)) == (1, 1)  # no dq kernel
  assert _kernels(_lower(**auto, d=96)) == (0, 3)
  assert _kernels(_lower(**auto, dtype=jnp.float32)) == (0, 3)


def _module(name="flash_attention_fwd", counter=0, body=""):
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
  with mlir.make_ir_context():
    return ir.Module.parse(f'module @{name} attributes {{{fm.BASENAME} = "{name}_{counter}"'
                           f'{body}}} {{}}')


def _basename(module) -> str:
  from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
  return ir.StringAttr(module.operation.attributes[fm.BASENAME]).value


def test_stable_basename(monkeypatch):
  """The same kernel lowered twice (counter 0 and 7) gets one name, so one hash and one
  compile; another kernel gets another; other modules and dumping runs are untouched."""
  monkeypatch.delenv("MOSAIC_GPU_DUMP_PTX", raising=False)
  a, b, c = _module(counter=0), _module(counter=7), _module(counter=1, body=", x.y = 3")
  assert fm.stable_basename(a) and fm.stable_basename(b) and fm.stable_basename(c)
  assert _basename(a) == _basename(b) != _basename(c)
  assert _basename(a).startswith("flash_attention_fwd_")
  assert _basename(a) != "flash_attention_fwd_0"
  other = _module(name="entry", counter=3)
  assert not fm.stable_basename(other) and _basename(other) == "entry_3"
  monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
  dumping = _module(counter=5)
  assert not fm.stable_basename(dumping) and _basename(dumping) == "flash_attention_fwd_5"


def test_stable_kernel_names_wraps_the_lowering(monkeypatch):
  """Where the Mosaic GPU lowering has `lower_mgpu_module` (jax 0.11+), every module it
  finishes is renamed by its contents."""
  from jax.experimental.mosaic.gpu import core  # pylint: disable=g-import-not-at-top
  seen = []
  monkeypatch.setattr(core, "lower_mgpu_module", lambda module, *a, **k: seen.append(a),
                      raising=False)
  fm.stable_kernel_names.cache_clear()
  try:
    fm.stable_kernel_names()
    modules = [_module(counter=0), _module(counter=9)]
    for module in modules:
      core.lower_mgpu_module(module, "ctx", semantics="wg")
    assert seen == [("ctx",), ("ctx",)]
    assert _basename(modules[0]) == _basename(modules[1])
  finally:
    monkeypatch.undo()
    fm.stable_kernel_names.cache_clear()


def test_one_compile_per_distinct_kernel():
  """Three layers' attention (forward and both backward kernels) lower to three distinct
  kernel hashes, not nine: the compiled-kernel cache is keyed by them."""
  import re  # pylint: disable=g-import-not-at-top

  def loss(q, k, v):
    x = q
    for i in range(3):
      with jax.named_scope(f"layer{i}"):
        x = fa.flash_attention(x, k, v, backend="gpu", interpret=False, causal=True,
                               gpu_forward="mosaic", gpu_backward="mosaic") * 1.5
    return x.astype(jnp.float32).sum()
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  with kernels.gpu_target():
    text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, k).lower(
        lowering_platforms=("cuda",)).as_text()
  hashes = re.findall(r'kernel_hash = "([^"]*)"', text)
  assert len(hashes) == 9 and len(set(hashes)) == 3


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpu_forward="cudnn"), "gpu_forward must be 'mosaic', 'triton' or None"),
    (dict(backend="tpu", gpu_forward="mosaic"), "gpu_forward is an option of the gpu"),
    (dict(gpu_forward="mosaic", d=96), "cannot run this call: head_dim 96"),
    (dict(gpu_forward="mosaic", dtype=jnp.float32), "cannot run this call: dtype float32"),
    (dict(gpu_backward="both"), "gpu_backward must be 'mosaic', 'triton' or None"),
    (dict(backend="tpu", gpu_backward="mosaic"), "gpu_backward is an option of the gpu"),
    (dict(gpu_backward="mosaic", d=256), "gpu_backward='mosaic' cannot run this call: "
     "head_dim 256"),
    (dict(gpu_backward="mosaic", dq_atomic=True), "cannot run this call: dq_atomic"),
])
def test_bad_mosaic_options(kwargs, message):
  d, dtype = kwargs.pop("d", 128), kwargs.pop("dtype", jnp.bfloat16)
  x = jax.ShapeDtypeStruct((1, 128, 2, d), dtype)
  if kwargs.pop("segments", False):
    ids = jnp.ones((1, 128), jnp.int32)
    kwargs.update(q_segment_ids=ids, kv_segment_ids=ids)
  opts = {"backend": "gpu", "interpret": False} | kwargs
  with pytest.raises(ValueError, match=message):  # the backward's errors come on jax.grad
    jax.eval_shape(jax.grad(lambda q, k, v: fa.flash_attention(
        q, k, v, **opts).astype(jnp.float32).sum()), x, x, x)


def test_shared_memory_plan():
  assert fm.kv_block_and_slots(64) == (128, 2)
  assert fm.kv_block_and_slots(128) == (128, 2)
  assert fm.kv_block_and_slots(256) == (64, 2)
