"""A Qwen3.5 model (Gated DeltaNet layers beside gated full attention, layers scanned a
period at a time) compiles for a TPU slice (libtpu, no TPU): its sharded gradient, and
the sampler's prefill and decode programs with the recurrent state in the cache; a
Granite 4 hybrid's Mamba2 layers likewise; a prefill that takes each layer's weights
from its stack; and a decode step that gathers its sharded weights one layer at a time."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain import models
from tests.tpu_aot import compile_for, requires_libtpu, spec, tpu_mesh

pytestmark = requires_libtpu

CFG = models.get_preset("tiny").replace(
    vocab_size=512, d_model=256, num_heads=4, num_kv_heads=2, head_dim=128, ffn_dim=512,
    num_layers=4, dtype="bfloat16", attention_impl="flash", scan_layers=True,
    architecture="Qwen3_5ForCausalLM", qk_norm=True, norm_unit_offset=True,
    attn_output_gate=True, layer_types=("linear_attention",) * 3 + ("full_attention",),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
    linear_value_head_dim=128, rope=models.RopeConfig(partial_rotary_factor=0.25))


def _compile_gradient_and_decode(cfg):
  """(the compiled sharded gradient over 4 rows of 1,024, the sampler's decode program)
  of `cfg` for a v5e slice of data 2 x tensor 2."""
  mesh = tpu_mesh("v5e", (2, 1, 2, 1), ("data", "fsdp", "tensor", "sequence"))
  graphdef, state = models.abstract_model(cfg)
  shardings = models.state_shardings(state, mesh)
  state = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                       state, shardings)
  tokens = spec(mesh, (4, 1024), jnp.int32, P("data"))
  ctx = models.ShardingContext(mesh)

  def loss(state, tokens):
    model = nnx.merge(graphdef, state)
    return model(tokens, segment_ids_BxT=jnp.ones_like(tokens), ctx=ctx).astype(
        jnp.float32).mean()

  compiled = compile_for(mesh, jax.grad(loss), state, tokens)
  from posttrain.sampling.sampler import Sampler
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  sampler = Sampler(abstract, mesh=mesh, max_len=1024)
  with jax.set_mesh(mesh):
    _, decode = sampler.compile(16, 256, 256, distinct_prompts=4, temperature=1.0)
  return compiled, decode


@pytest.mark.slow  # about 40 s of compiling
def test_gradient_and_sampler_compile_on_a_sharded_tpu_mesh():
  compiled, decode = _compile_gradient_and_decode(CFG)
  # The linear layers' heads split over tensor: each chip holds half the value heads.
  assert compiled.memory_analysis().temp_size_in_bytes < 1 << 30
  # The recurrent state [rows, value heads / tensor, 128, 128] f32 rides the decode loop.
  assert "f32[3,8,2,128,128]" in decode.as_text()


@pytest.mark.slow  # about 30 s of compiling
def test_a_prefill_takes_each_layers_weights_from_its_stack():
  """The sampler's prefill indexes each cached layer's weights from its kind's stack by
  layer. Reshaped to [periods, layers a period, ...] first (the training scan's xs), the
  reshape left XLA:TPU a layout to choose: it relaid the full-attention layers' whole q
  and k stacks and sliced a period's three linear layers' weights at once (Qwen3.5-27B's
  rollout on a v5p-64: 2.15 GiB a chip more). The Gated DeltaNet projections it still
  relays whole, the heads major (the planner counts them)."""
  mesh = tpu_mesh("v5e", (1, 2, 2, 1), ("data", "fsdp", "tensor", "sequence"))
  cfg = CFG.replace(d_model=1024, ffn_dim=2048, num_layers=16, num_heads=8,
                    layer_types=CFG.layer_types * 4)
  from posttrain.sampling.sampler import Sampler
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  sampler = Sampler(abstract, mesh=mesh, max_len=2048)
  with jax.set_mesh(mesh):
    prefill, _ = sampler.compile(16, 1024, 256, distinct_prompts=4, temperature=1.0)
  text = prefill.as_text()
  # The four full-attention layers' q and k stacks: [4, D 1024, heads, head dim].
  assert not re.findall(r"%(copy[\w.-]*) = (bf16\[4,(?:1,)?1024,[^\]]*\])", text)
  # A period's slice of the three linear layers' weights.
  assert not re.findall(r"%(dynamic-slice[\w.-]*) = (bf16\[3,[^\]]*\])", text)


@pytest.mark.slow  # about 60 s of compiling
def test_a_period_rebuilds_one_linear_layer_at_a_time():
  """The backward pass of a scanned period of seven Gated DeltaNet layers and a full one
  rebuilds its linear layers one at a time: its program needs less than 1.5x the memory
  of the same eight layers as four periods of one of each (0.68x measured). Unrolled in
  the period's body, XLA:TPU rebuilt all seven linear layers up front and needed 3.0x.
  (Three and one, the ratio was 1.72x scanned and 1.87x unrolled: the peak of those
  programs is the gradients' bookkeeping before the loop, not a layer's rebuild.)"""
  mesh = tpu_mesh("v5e", (2, 1, 2, 1), ("data", "fsdp", "tensor", "sequence"))
  tokens = spec(mesh, (4, 2048), jnp.int32, P("data"))
  ctx = models.ShardingContext(mesh)
  temps = {}
  for pattern in (("linear_attention",) * 7 + ("full_attention",),
                  ("linear_attention", "full_attention")):
    cfg = CFG.replace(d_model=512, ffn_dim=2048, num_layers=8, remat="full",
                      layer_types=pattern * (8 // len(pattern)))
    graphdef, state = models.abstract_model(cfg)
    shardings = models.state_shardings(state, mesh)
    state = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                         state, shardings)

    def loss(state, tokens, graphdef=graphdef):
      model = nnx.merge(graphdef, state)
      return model(tokens, segment_ids_BxT=jnp.ones_like(tokens), ctx=ctx).astype(
          jnp.float32).mean()

    compiled = compile_for(mesh, jax.grad(loss), state, tokens)
    temps[len(pattern)] = compiled.memory_analysis().temp_size_in_bytes
  assert temps[8] < 1.5 * temps[2], temps


@pytest.mark.slow  # about 40 s of compiling
def test_a_granite4_hybrid_compiles_on_a_sharded_tpu_mesh():
  """Granite 4's -h- layout (Mamba2 layers: one group of B and C, a state of 128, the
  scan in chunks of 256, no position embedding; two periods of three Mamba2 layers and
  an attention layer) compiles for a TPU slice: its sharded gradient, and the sampler's
  decode with the Mamba2 state [heads, head dim, 128] in the cache, its heads split over
  tensor. The state stack rides the decode loop and the loop over periods in one layout:
  stored [heads, state, head dim], XLA copied the whole stack into and out of the loop
  over periods in every decode step."""
  cfg = CFG.replace(architecture="GraniteMoeHybridForCausalLM", qk_norm=False,
                    norm_unit_offset=False, attn_output_gate=False, linear_mixer="mamba2",
                    linear_num_key_heads=1, linear_key_head_dim=128,
                    linear_num_value_heads=8, linear_value_head_dim=64, linear_chunk=256,
                    linear_conv_bias=True, num_layers=8, layer_types=CFG.layer_types * 2,
                    rope_layers=(0,) * 8, rope=models.RopeConfig())
  compiled, decode = _compile_gradient_and_decode(cfg)
  assert compiled.memory_analysis().temp_size_in_bytes < 1 << 30
  # Six Mamba2 layers' states: rows 16 / data 2, heads 8 / tensor 2, 64 x 128, f32.
  text = decode.as_text()
  assert "f32[6,8,4,64,128]" in text
  assert not re.search(r"f32\[6,8,4,\d+,\d+\]\{[^}]*\} copy\(", text)


@pytest.mark.slow  # about 60 s of compiling
def test_a_decode_step_gathers_one_layer_at_a_time():
  """A hybrid whose layer pattern does not repeat runs its eight layers unrolled in one
  period. Decoding with the weights left sharded over fsdp, each step gathers each
  layer's weights as the layer comes: the program's temporaries stay near four of its
  96 MiB MLPs (gathered [2,048, 8,192] x 3). Untied, XLA:TPU gathered every layer's
  weights at the top of the step: eight MLPs' worth."""
  from posttrain.sampling.sampler import Sampler
  mesh = tpu_mesh("v5e", (1, 4, 1, 1), ("data", "fsdp", "tensor", "sequence"))
  kinds = ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 4
  cfg = CFG.replace(d_model=2048, ffn_dim=8192, num_layers=8, layer_types=kinds)
  assert cfg.layer_period == 8
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  sampler = Sampler(abstract, mesh=mesh, max_len=512, gather_weights=False)
  with jax.set_mesh(mesh):
    _, decode = sampler.compile(16, 256, 256, distinct_prompts=4, temperature=1.0)
  mlp = 3 * 2048 * 8192 * 2
  assert decode.memory_analysis().temp_size_in_bytes < 6 * mlp
