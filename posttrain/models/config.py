"""Model configuration: one frozen dataclass per architecture family, plus named presets."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ATTENTION_IMPLS = ("reference", "chunked", "flash", "ring")
# Keyword options of kernels.flash_attention a run may set (ModelConfig.attention_options).
FLASH_OPTIONS = {
    "backend": str, "block_q": int, "block_kv": int, "block_q_bwd": int, "block_kv_bwd": int,
    "block_q_dq": int, "block_kv_dq": int, "dq_atomic": bool, "fused_bwd": bool,
    "compact_grid": bool, "gpu_forward": str, "gpu_backward": str, "num_warps": int,
    "num_stages": int, "num_warps_bwd": int, "num_stages_bwd": int,
    # false: the compiled kernels even where the target is not a TPU or GPU (lowering
    # for a GPU ahead of time on a CPU host); true: interpret mode anywhere.
    "interpret": bool}


def parse_attention_options(text: str) -> dict[str, Any]:
  """"name=value,..." -> flash_attention keywords: ints, true / false, or (backend) text.
  Raises ValueError naming the bad entry."""
  options: dict[str, Any] = {}
  for item in filter(None, (part.strip() for part in str(text or "").split(","))):
    name, sep, value = (x.strip() for x in item.partition("="))
    if not sep or name not in FLASH_OPTIONS:
      raise ValueError(f"attention_options entry {item!r}: expected name=value with a name "
                       f"in {sorted(FLASH_OPTIONS)}")
    kind = FLASH_OPTIONS[name]
    if kind is bool:
      if value.lower() not in ("true", "false"):
        raise ValueError(f"attention_options {name}={value!r}: expected true or false")
      options[name] = value.lower() == "true"
    elif kind is int:
      try:
        options[name] = int(value)
      except ValueError:
        raise ValueError(f"attention_options {name}={value!r}: expected an integer") from None
    else:
      options[name] = value
  return options


REMAT_POLICIES = ("none", "full", "dots", "dots_with_no_batch_dims")
# Projections a LoRA adapter may wrap (Hugging Face / PEFT module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_LORA_TARGETS = LORA_TARGETS[:4]
DEFAULT_LORA_TARGETS = ",".join(LORA_TARGETS)
# Classes whose PEFT files cannot hold adapters on the dense MLPs and shared experts ours
# adapt (GLM-4.5 and Qwen3-Next put the MLP names on their fused routed experts; Granite
# 4's and Granite MoE Shared's shared_mlp fuses gate and up): their default lora_targets
# leave them out.
PEFT_FUSED_MLP = ("Glm4MoeForCausalLM", "Qwen3NextForCausalLM", "GraniteMoeHybridForCausalLM",
                  "GraniteMoeSharedForCausalLM")
# Classes whose Mamba2 out_proj PEFT refuses to adapt (its Mamba models' fused kernel
# skips the module): their default lora_targets leave it out.
PEFT_NO_OUT_PROJ = ("NemotronHForCausalLM", "FalconH1ForCausalLM", "Mamba2ForCausalLM",
                    "MambaForCausalLM", "FalconMambaForCausalLM")
# A Gated DeltaNet layer's projections (its linear_attn's module names): Qwen3.5's, and
# Qwen3-Next's, whose in_proj_qkvz / in_proj_ba fuse Qwen3.5's first four as two.
QWEN3_5_LINEAR_LORA_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                               "out_proj")
QWEN3_NEXT_LINEAR_LORA_TARGETS = ("in_proj_qkvz", "in_proj_ba", "out_proj")
# A Mamba2 layer's (Granite 4's mamba module): in_proj fuses the gate, x, B, C and dt.
MAMBA2_LORA_TARGETS = ("in_proj", "out_proj")
LINEAR_LORA_TARGETS = (QWEN3_5_LINEAR_LORA_TARGETS[:4] + QWEN3_NEXT_LINEAR_LORA_TARGETS
                       + MAMBA2_LORA_TARGETS[:1])
# LFM2's gated short convolution (its "conv" layers): in_proj's B, C and x, out_proj.
SHORT_CONV_LORA_TARGETS = ("in_proj", "out_proj")
# A Mamba 1 layer's (MambaForCausalLM's mixer): in_proj fuses x and the gate.
MAMBA1_LORA_TARGETS = ("in_proj", "out_proj")
LINEAR_MIXERS = ("gated_deltanet", "mamba2", "short_conv", "mamba1")
# A mixture's routed experts, adapted per expert (PEFT's target_parameters
# mlp.experts.gate_up_proj and mlp.experts.down_proj): one adapter over gate and up
# together (one A, B spanning both), one over down; experts without a gate (relu^2,
# Nemotron 3: mixer.experts.up_proj) one over up. Only named: never a default.
EXPERT_LORA_TARGETS = ("experts_gate_up_proj", "experts_down_proj", "experts_up_proj")
GATED_EXPERT_LORA_TARGETS = EXPERT_LORA_TARGETS[:2]
UNGATED_EXPERT_LORA_TARGETS = ("experts_up_proj", "experts_down_proj")
# Decode attention block per backend when ModelConfig.decode_chunk is None. On an H200, a
# 1.2B model decoding 64 rows with a 768-slot cache: 32-slot blocks ran a loop of small
# kernels per layer and token (BENCHMARKS.md, rollout on GPU). On CPU (heads-major cache,
# multiply-reduce scoring, no zeroing of the finite cache tail) 256-slot blocks: a cache up
# to 256 slots is read in place, without copying blocks out of it; against 64-slot blocks
# 16-18% faster for 16 rows and a 96-slot cache, 2-5% for 64 rows and 160-192 slots.
DECODE_CHUNK_BY_BACKEND = {"cpu": 256, "gpu": 1024, "tpu": 1024}


def decode_chunk_for(cfg: "ModelConfig", backend: str | None = None) -> int:
  """The decode attention block of `cfg` on `backend` (default: the target platform)."""
  if cfg.decode_chunk is not None:
    return int(cfg.decode_chunk)
  if backend is None:
    import kernels  # deferred: importing the config must not initialise a backend
    backend = kernels.target_platform()
  return DECODE_CHUNK_BY_BACKEND.get(backend, 1024)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional", "dynamic")
# Kinds of layer (Hugging Face's layer_types): attention to every key up to the query, to
# only the last `sliding_window` keys, or a linear-attention layer (Gated DeltaNet:
# Qwen3-Next, Qwen3.5) whose cache is a fixed-size recurrent state; or an MLP alone or
# a mixture of experts alone (Nemotron-H's "mlp" and Nemotron 3's "moe" layers: a model
# with either has single-sublayer layers, `ModelConfig.split_layers`).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "mlp", "moe")
# The MLP's activation: gated, SwiGLU (Llama, Qwen, Mixtral) or GeGLU with tanh-approximate
# GELU (Gemma's gelu_pytorch_tanh) or gpt-oss's clamped SwiGLU; or relu2, the squared ReLU
# of an MLP with no gate (Nemotron-H: down(relu(up(x))^2)), or xielu, Apertus's xIELU of an
# MLP with no gate (its two scales learned in each MLP), or gelu_tanh_ungated, the
# tanh-approximate GELU of an MLP with no gate (StarCoder2: down(gelu(up(x)))), or
# gelu_ungated, the exact (erf) GELU of an MLP with no gate (GPT-NeoX / Pythia's "gelu"),
# or relu_ungated, the ReLU of an MLP with no gate (OPT's fc2(relu(fc1(x)))).
MLP_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu", "relu2", "xielu",
                   "gelu_tanh_ungated", "gelu_ungated", "relu_ungated")
# Activations of an MLP without a gate: down(act(up(x))) (no gate_proj).
UNGATED_ACTIVATIONS = ("relu2", "xielu", "gelu_tanh_ungated", "gelu_ungated", "relu_ungated")
# Where a Mamba2 layer's output is RMS-normed (`ModelConfig.linear_norm`).
LINEAR_NORMS = ("after_gate", "before_gate", "none")
# Falcon-H1's muP scalars (`ModelConfig`): any finite number, 1.0 none.
MUP_MULTIPLIERS = ("attention_in_multiplier", "attention_out_multiplier",
                   "ssm_in_multiplier", "ssm_out_multiplier", "mlp_gate_multiplier",
                   "mlp_down_multiplier", "key_multiplier", "lm_head_multiplier")
ROUTER_SCORINGS = ("softmax", "sigmoid", "sparsemixer")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding settings, in Hugging Face's vocabulary.

  Attributes:
    theta: base wavelength.
    type: one of default, linear, llama3, yarn, longrope, proportional, dynamic (NTK
      scaling by a sequence's length once it passes the model's max_position_embeddings:
      `rope.dynamic_tables`; InternLM3's).
    factor: context extension factor (linear, llama3, yarn, dynamic, longrope: its
      attention factor's default).
    low_freq_factor / high_freq_factor: Llama 3 smoothing band.
    original_max_position_embeddings: pre-training context (llama3, yarn, longrope).
    beta_fast / beta_slow / mscale / mscale_all_dim / attention_factor / truncate: YaRN
      (attention_factor: LongRoPE's too).
    short_factor / long_factor: LongRoPE (Phi-3.5, Phi-4-mini): per-frequency divisors,
      the long ones for every token of a sequence whose positions in a call pass
      original_max_position_embeddings (`rope.longrope_tables`; a row decoding past it
      keeps the keys it cached, as vLLM does, where transformers recomputes them).
    partial_rotary_factor: the fraction of head_dim rotated (its first
      int(head_dim * factor) features; the rest pass through), Phi-4-mini's 0.75. Under
      "proportional" (Gemma 4's global layers) it is instead the fraction of the
      frequencies that turn: the whole head pairs up as in a full rotation (feature i with
      i + head_dim / 2), its first int(factor * head_dim / 2) pairs at the full-width
      schedule's frequencies theta^(-2i / head_dim) (divided by `factor`), the others at
      frequency 0 (unrotated).
  """

  theta: float = 10_000.0
  type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True
  short_factor: tuple[float, ...] = ()
  long_factor: tuple[float, ...] = ()
  partial_rotary_factor: float = 1.0

  def __post_init__(self):
    if self.type not in ROPE_TYPES:
      raise ValueError(f"rope type {self.type!r} is not supported; expected one of {ROPE_TYPES}")
    for name in ("short_factor", "long_factor"):  # From JSON: lists.
      object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name) or ()))
    if not 0.0 < self.partial_rotary_factor <= 1.0:
      raise ValueError(f"partial_rotary_factor must be in (0, 1], got "
                       f"{self.partial_rotary_factor!r}")
    if self.type == "dynamic" and not self.factor >= 1.0:
      raise ValueError(f"dynamic rope needs a factor >= 1, got {self.factor!r}")
    if self.type == "longrope":
      if not self.short_factor or len(self.long_factor) != len(self.short_factor):
        raise ValueError("longrope needs short_factor and long_factor of one length (one "
                         "per rotated frequency)")
      if not self.original_max_position_embeddings:
        raise ValueError("longrope needs original_max_position_embeddings (the context "
                         "past which the long factors apply)")

  def rotary_dim(self, head_dim: int) -> int:
    """Features of each head that rotate (all of head_dim unless partial_rotary_factor;
    all of it under "proportional", whose pairs past the factor turn at frequency 0)."""
    if self.type == "proportional":
      if head_dim % 2:
        raise ValueError(f"proportional rope needs an even head_dim, got {head_dim}")
      return head_dim
    # As transformers truncates it; the epsilon keeps a factor such as 64 / 192, one
    # rounding below a third, from losing a feature.
    dim = int(head_dim * self.partial_rotary_factor + 1e-9)
    if dim < 2 or dim % 2:
      raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} of head_dim="
                       f"{head_dim} rotates {dim} features; it must be an even number >= 2")
    if self.type == "longrope" and len(self.short_factor) != dim // 2:
      raise ValueError(f"longrope factors must have one entry per rotated frequency "
                       f"({dim // 2}), got {len(self.short_factor)}")
    return dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and options of a decoder-only transformer (Llama 3, Mistral, Ministral 3,
  Qwen2.5, Qwen3, Gemma, Gemma 2, Gemma 3, OLMo 2, OLMo 3, Phi-3 / Phi-4, SmolLM3,
  Seed-OSS, EXAONE 4, ERNIE 4.5, GLM-4, Qwen3.5, Granite 3 / 4, the Mamba2 hybrids Granite
  4-H, Bamba, Nemotron-H and Falcon-H1, LFM2 (short convolutions), and the mixtures of
  experts Qwen3-MoE, OLMoE, ERNIE 4.5, Mixtral, gpt-oss, Qwen2-MoE, GLM-4.5, DeepSeek-V2 / V3,
  MiniMax-M2, Granite MoE, Nemotron 3 and Llama 4).

  Attributes:
    architecture: the HF class name this config maps to (LlamaForCausalLM, ...).
    qkv_bias: Qwen2-style bias on q/k/v projections.
    qk_norm: Qwen3-style RMSNorm over head_dim of q and k before RoPE.
    qk_norm_after_rope: with qk_norm, the norms apply to the rotated q and k instead
      (Hunyuan's query_layernorm / key_layernorm).
    qk_norm_heads: with qk_norm, each norm spans every head's features at once (q's
      heads * head_dim, k's kv_heads * head_dim, one scale per feature: OLMo 2 / 3,
      MiniMax-M2) instead of each head's head_dim.
    qk_norm_head_weights: with qk_norm, each head's norm (over its own head_dim) has a
      weight of its own: q's [heads, head_dim], k's [kv_heads, head_dim] (Cohere Command
      R+'s) instead of one [head_dim] shared by the heads.
    rope_layers: per layer, 1 where its q and k rotate and 0 where they do not (a NoPE
      layer: SmolLM3's every fourth; transformers' no_rope_layers); () = every layer
      rotates.
    output_norms: no input norms; the attention's and the MLP's outputs are normed before
      their residual adds (OLMo 2 / 3's post_attention_layernorm and
      post_feedforward_layernorm: `attn_out_norm`, `mlp_out_norm`).
    dtype: compute dtype; param_dtype: storage dtype of parameters.
    remat: rematerialisation policy per block (none, full, dots, dots_with_no_batch_dims).
    scan_layers: stack the layers' parameters on a leading "layers" axis and run them as
      one `lax.scan`: compile time and program size stay those of one layer at any depth
      (what an 80-layer model needs on a pod); the KV cache stacks the layers too. The
      parameter tree differs (layers/attn/q_proj is [L, D, N, H]), HF files do not.
    attention_impl: reference, chunked, flash or ring (kernels/).
    attention_options: flash kernel options, "name=value,..." (e.g. "block_q=128,
      num_warps_bwd=4,dq_atomic=true"; names in FLASH_OPTIONS), for attention_impl flash
      and for ring attention's inner flash kernel: a device sweep's best options
      (benchmarks/attention.py --accelerator-only) go here.
    attention_chunk / decode_chunk: kv block of chunked attention / of decode attention.
    value_head: add a scalar head on the final hidden state (PPO critic; a reward model's
      score head).
    lm_head: the output projection to the vocabulary. False (needs value_head=True): a
      reward model, the trunk and its score head alone, with no parameter for the head
      (with tie_embeddings the embedding stays, as the input table only); it has no logits
      or log-probs (Hugging Face's *ForSequenceClassification).
    learned_positions: a learned absolute position embedding, max_position_embeddings
      rows of D, added to the token embeddings at each token's position (GPT-2's wpe;
      with rope_layers all 0, no rotary embedding). A position past the table reads NaN
      (jnp.take's fill), so nothing runs past it silently; the sampler refuses a max_len
      beyond it.
    position_offset: with learned_positions, the table's leading rows no position reads:
      position p reads row p + position_offset, of max_position_embeddings +
      position_offset rows (OPT's 2).
    lm_head_bias: the output projection adds a bias [V] to the logits, h W + b (Phi-1 /
      Phi-1.5 / Phi-2's lm_head; scaled as W is by logits_scaling and
      lm_head_multiplier). Without lm_head (a reward model) it has no parameter.
    pad_token_id: the pad token config.json records (Hugging Face's sequence classifiers
      find each row's last token by it; export writes it back). Nothing here reads it:
      segment ids mark padding.
    logprob_chunk: sequence chunk used when computing per-token log-probs.
    lora_rank: rank of the LoRA adapters (0: none). With adapters, the train step updates
      only them (optimizer state for them alone) and the KL reference is the base
      weights, the adapters switched off (no second copy of the model).
    lora_alpha: the adapters' output is scaled by lora_alpha / lora_rank (PEFT's rule).
    lora_targets: comma-separated projections given adapters (names in LORA_TARGETS). In
      a mixture of experts the MLP names adapt the dense MLPs it has (its leading dense
      layers, each mixture layer's shared expert), never the routed experts; a mixture
      with neither takes adapters on the attention alone (left at its default, the MLP
      names are dropped; named explicitly, they are an error). GLM-4.5 and Qwen3-Next
      take them only named (their PEFT files cannot hold them). Gated
      DeltaNet layers' projections are named as in their Hugging Face family:
      in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj (Qwen3.5), or
      in_proj_qkvz, in_proj_ba and out_proj (Qwen3-Next, architecture Qwen3Next*); left
      at its default, a model with such layers adapts all of them too. A mixture's routed
      experts take adapters only named: experts_gate_up_proj (one adapter per expert
      over its gate and up projections, PEFT's target_parameters
      mlp.experts.gate_up_proj) and experts_down_proj (mlp.experts.down_proj); experts
      without a gate (mlp_activation relu2, Nemotron 3) experts_up_proj
      (mixer.experts.up_proj) and experts_down_proj.
    base_quantization: "int8" or "nf4" to hold the frozen base's projections quantized
      (QLoRA; needs lora_rank > 0): every projection of the layers is stored as codes with
      a bfloat16 scale a block (`posttrain.models.quant`) and dequantized where a layer
      reads it; embeddings, the output head, norms and routers stay in param_dtype. ""
      (default): none. Exports write the dequantized base (merged with the adapters).
    base_quantization_block: the values a scale covers along a weight's first axis past
      the layer and expert axes (64, QLoRA's; narrower axes take their largest divisor
      below it).
    num_experts: 0 for a dense SwiGLU MLP in every layer; else every layer's MLP (past the
      `dense_layers`) is that many SwiGLU experts of width ffn_dim, and a router sends
      each token to `num_experts_per_tok` of them (Qwen3-MoE, Mixtral).
    num_experts_per_tok: experts each token runs (top-k of the router's scores).
    norm_topk_prob: rescale the top-k router probabilities to sum to one (Mixtral always
      does; Qwen3-MoE says so in its config.json).
    router_aux_loss_coef: weight of the load-balancing loss the train step adds for a
      mixture (`transformers`' aux loss over every layer's tokens; 0: none). Read from
      config.json when it has output_router_logits=true, as `transformers` trains.
    attention_sinks: a learned logit per head in every layer's softmax, with a zero
      value (gpt-oss): a query may attend to nothing (`kernels` `sinks=`).
    attn_out_bias: a bias on the attention's output projection (gpt-oss's attention_bias
      sets it and qkv_bias).
    router_bias / expert_bias: a mixture's router logits get a bias per expert / each
      expert's gate, up and down projections a bias (gpt-oss).
    shared_expert_dim: width of a dense SwiGLU MLP every token runs beside its routed
      experts, added to their sum (Qwen2-MoE's shared expert; GLM-4.5's and DeepSeek-V3's
      shared experts, n_shared_experts of them fused into one); 0: none.
    shared_expert_gate: the shared expert's output is scaled by sigmoid(x . w), w [D]
      learned (Qwen2-MoE).
    router_scoring: "softmax" (each token's top-k of the softmax over experts) or
      "sigmoid" (GLM-4.5, DeepSeek-V3, MiniMax-M2: each expert scores sigmoid(logit);
      the top-k is chosen on the scores plus a per-expert correction bias,
      `score_correction_bias`, which the train step leaves as it is, and weighted by the
      scores themselves) or "sparsemixer" (PhiMoE's, as it runs in evaluation: the
      experts by the logits, best first; each chosen expert weighted by the softmax over
      the logits not yet chosen that lie within 2 x router_jitter_eps of its own,
      relative to max(|logit|, its own); the weights not renormalised, norm_topk_prob
      False. Its gradient is this forward's, not PhiMoE's training-time estimator).
    router_jitter_eps: sparsemixer's relative band around each chosen logit (PhiMoE's
      router_jitter_noise).
    router_groups / router_group_topk: the router chooses among the experts of the
      `router_group_topk` best of `router_groups` equal groups (DeepSeek's device- /
      node-limited routing), a group ranked by the sum of its two best biased scores
      (sigmoid, DeepSeek-V3) or by its best probability (softmax, DeepSeek-V2's
      group_limited_greedy); 1 / 1: all.
    routed_scaling_factor: the routed experts' weights are multiplied by this (after the
      norm_topk_prob rescaling), as GLM-4.5 and DeepSeek-V3 do.
    dense_layers: the first this many layers have a dense SwiGLU MLP of width
      dense_ffn_dim in place of the mixture (DeepSeek-V3's and GLM-4.5's
      first_k_dense_replace, Qwen2-MoE's leading mlp_only_layers). Their parameters sit
      in the model's `dense_layers`, the mixture layers' in `layers`.
    moe_layer_step: every this-many-th layer is a mixture (layers step - 1, 2 step - 1,
      ...), the others dense SwiGLU MLPs of width dense_ffn_dim, their parameters in the
      model's `dense_layers` as a leading dense layer's (Llama 4 Maverick's
      interleave_moe_layer_step 2); 1: every layer past the `dense_layers` a mixture.
    kv_lora_rank: > 0 for multi-head latent attention (DeepSeek-V2 / V3, Kimi K2): keys and
      values come from a latent of this width, x -> kv_a_proj -> RMSNorm -> per-head
      k_b_proj (keys' unrotated features) and v_b_proj (values); every head shares one
      rotated key part of qk_rope_head_dim features (k_rope_proj). head_dim is a query's
      and key's width (unrotated + rotated: the rotated part first in ours, so the
      rotary embedding is partial with rope.rotary_dim(head_dim) == qk_rope_head_dim);
      values are v_head_dim wide, zero-padded to head_dim for the kernels and cache and
      cut back before o_proj [heads, v_head_dim, D]. The KV cache holds the latent
      instead, one "head" of qk_rope_head_dim + kv_lora_rank features a token ([rotated
      key part, normed latent], `cache_head_dim`; no value array): cached calls absorb
      k_b_proj into the queries and v_b_proj into the output (DeepSeek's inference form).
    q_lora_rank: with MLA, queries through a latent of this width too (q_a_proj ->
      RMSNorm -> q_b_proj); 0: one q_proj. LoRA's attention targets name MLA's per-head
      projections: q_proj the queries' (q_b_proj with a query latent), k_proj k_b_proj,
      v_proj v_b_proj, o_proj o_proj.
    qk_rope_head_dim / v_head_dim: MLA's rotated key features and value width.
    index_topk / index_heads / index_head_dim: DeepSeek Sparse Attention (DeepSeek-V3.2,
      GLM-5; MLA with a query latent): each query attends to the index_topk keys its
      lightning indexer scores highest, sum_h w_h relu(q_h . k / sqrt(index_head_dim)),
      its index_heads queries from the query latent (index_q_proj), one key a token
      (index_k_proj, then a LayerNorm), the first qk_rope_head_dim features of both
      rotated, the head weights w from the input (index_weights_proj) over
      sqrt(index_heads). No gradient flows through the choice. A row of at most
      index_topk positions attends densely (every key chosen). The cache keeps each
      token's index key beside the latent (in its v, [B, 1, S, index_head_dim]).
    linear_num_key_heads / linear_num_value_heads / linear_key_head_dim /
      linear_value_head_dim / linear_conv_kernel: the Gated DeltaNet of layer_types'
      "linear_attention" layers (Qwen3-Next, Qwen3.5; `LinearAttention`): q and k of
      key heads, v and the output gate of value heads (a multiple of the key heads), a
      causal depthwise convolution of this width over q, k and v, and a recurrent state
      [value heads, key head dim, value head dim] a row in place of a KV cache.
    linear_chunk: tokens per chunk of the chunked delta rule (training and prefill).
    linear_mixer: what a "linear_attention" layer is: "gated_deltanet" (above), or
      "mamba2", Mamba2's selective state space (Granite 4's -h- models; `Mamba2`), read
      through its duality with linear attention: linear_num_key_heads its groups (n_groups)
      of B and C, linear_key_head_dim its state size (d_state), linear_num_value_heads its
      heads, linear_value_head_dim its head dim; one causal convolution of
      linear_conv_kernel taps over x, B and C, with a bias when linear_conv_bias.
      linear_dt_min / linear_dt_max clip its time step after the softplus
      (time_step_limit). Or "short_conv", LFM2's gated short convolution (its "conv"
      layers; `ShortConv`): y = C * conv(B * x), B, C and x three [D, D] projections of
      the input, conv depthwise and causal over linear_conv_kernel taps, then out_proj;
      with linear_conv_bias each of them has a bias (LFM2's conv_bias). Its cache is the
      convolution's window alone; it takes no linear_num_* / linear_*_head_dim fields.
      Or "mamba1", Mamba 1's selective scan (MambaForCausalLM, FalconMamba; `Mamba1`):
      each of linear_num_value_heads channels (d_inner) is a head of width 1
      (linear_value_head_dim 1, linear_num_key_heads 1) with a state of
      linear_key_head_dim (d_state) decaying at its own rate per state entry; x_proj
      gives a time step of rank linear_dt_rank (dt_proj brings it back to the channels,
      with a bias), B and C; one causal convolution over x.
    linear_dt_rank: Mamba 1's time-step rank (time_step_rank); 0 for other mixers.
    linear_bcdt_norm: Mamba 1's time step (at its rank), B and C each RMS-normed, eps
      linear_bcdt_norm_eps: "weightless" (FalconMamba's, eps its mixer_rms_eps) or
      "weighted", each norm with a scale of its own (Jamba's dt_layernorm, b_layernorm,
      c_layernorm); "none" (Mamba 1's) by default.
    attn_output_gate: the attention's output is scaled by sigmoid of a second query-sized
      projection (`q_gate`) before o_proj, per head and feature (Qwen3-Next, Qwen3.5).
    mlp_activation: silu (SwiGLU), gelu_tanh (Gemma's GeGLU), or clamped_swiglu
      (gpt-oss: gate clamped above at swiglu_limit, up to +-swiglu_limit, then
      (up + 1) * gate * sigmoid(swiglu_alpha * gate)); or relu2, an MLP without a gate,
      down(relu(up(x))^2) (Nemotron-H; no gate_proj); or xielu, an MLP without a gate
      through Apertus's xIELU, whose two scales each MLP learns (`xielu_alpha_p`,
      `xielu_alpha_n`) beside its fixed beta and eps (`xielu_beta`, `xielu_eps`, which no
      gradient reaches).
    layer_types: per layer, full_attention, sliding_attention or linear_attention (a
      Gated DeltaNet, Mamba2 or short-convolution layer: `linear_mixer`); () = every
      layer full_attention. With "mlp" entries the layers are single sublayers, as
      Nemotron-H's blocks are (`split_layers`): a linear_attention layer is
      x + mixer(norm(x)), a full_attention layer x + attn(norm(x)) and an mlp layer
      x + mlp(norm(x)), each with one norm (its input_norm) and no other sublayer.
      "moe" entries (Nemotron 3) are single-sublayer layers too, x + moe(norm(x)), the
      mixture of experts of num_experts (their parameters in the model's `moe_layers`);
      a model with them has its "mlp" layers (if any) of width dense_ffn_dim.
    qk_l2_norm: the rotary layers' (every layer's without `rope_layers`) q and k are
      normed over head_dim after the rotary embedding, x / sqrt(mean(x^2) + norm_eps),
      with no weight (Llama 4's use_qk_norm).
    attention_chunk_size: > 0: the sliding layers (layer_types' sliding_attention, with
      sliding_window equal to it) attend only within chunks of this many positions, a
      query at p to the keys at [p - p % size, p], not to the trailing window (Llama 4's
      chunked_attention layers: `kernels` local_chunk). Each chunk lies within the
      window, so their caches are the sliding layers' rings.
    attn_temperature_tuning: the NoPE layers' queries at position p are scaled by
      log(1 + floor((p + 1) / attn_floor_scale)) * attn_scale + 1 (Llama 4's
      temperature tuning for long contexts).
    attn_position_scale: > 0: every attention layer's queries at position p are scaled by
      1 + attn_position_scale * log(1 + floor(p / attn_position_scale_length)) after the
      rotary embedding (Ministral 3's and Mistral 4's llama_4_scaling_beta over their
      original_max_position_embeddings: the queries past the pre-training context grow
      sharper; latent attention's too). 0: off.
    routed_input_scaling: each routed expert's input is scaled by the token's router
      weight and its output summed unweighted (Llama 4), instead of the output weighted.
    moe_latent_dim: > 0: the routed experts run in a latent of this width, each token's
      input projected down to it (`latent_in` [D, L]) and their weighted sum back up
      (`latent_out` [L, D]); the router and the shared expert read the token itself
      (Nemotron 3's moe_latent_size). 0: none.
    router_correction_bias: sigmoid routing has its score_correction_bias (GLM-4.5,
      DeepSeek-V3, MiniMax-M2); False: none, the top-k by the scores alone (Llama 4).
    softmax_correction_bias: softmax routing chooses each token's top-k on the
      probabilities plus a `score_correction_bias` (which the train step leaves as it is)
      and weights them by the probabilities alone (ERNIE 4.5's moe_statics).
    embedding_multiplier / residual_multiplier / attention_multiplier / logits_scaling:
      Granite's (IBM Granite 3) scalars: the embeddings times the first, each sublayer's
      output times the second before its residual add, the attention logits scaled by
      the third in place of 1 / sqrt(head_dim) (None: that default), and the logits
      divided by the fourth (the output projection divided by it, `Transformer.unembed`,
      so every head, the sampler's included, sees it).
    parallel_mixer: every layer has a Mamba2 mixer (`linear_mixer` "mamba2", of the
      linear_* fields) beside its attention, both reading the layer's normed input, their
      outputs summed before the residual add, then the MLP as usual (Falcon-H1's hybrid
      layers). Its cache holds each layer's KV cache and Mamba2 state both
      (`HybridCaches`). layer_types must leave every layer full_attention.
    attention_in_multiplier / attention_out_multiplier / ssm_in_multiplier /
      ssm_out_multiplier: with parallel_mixer, the attention's and the Mamba2 mixer's
      input (the normed x) and output are scaled by these (Falcon-H1's muP scalars).
    ssm_multipliers: () or five scalars scaling the Mamba2 in_proj's parts after the
      projection: z (gate), x, B, C and dt, in in_proj's order (Falcon-H1's mup vector).
    mlp_gate_multiplier / mlp_down_multiplier: the MLP's gate projection is scaled before
      its activation, and its down projection's output after it (Falcon-H1's
      mlp_multipliers).
    key_multiplier / lm_head_multiplier: Falcon-H1's scales of the keys (the attention
      logits, `attention_scale`) and of the logits (the output projection,
      `Transformer.unembed`).
    linear_norm: the Mamba2 output's RMS norm: "after_gate" (Mamba2's gated norm,
      norm_before_gate=False: norm(y SiLU(z))), "before_gate" (norm(y) SiLU(z)) or "none"
      (y SiLU(z), no norm weight; Falcon-H1's mamba_rms_norm=false).
    global_head_dim / global_kv_heads: the full-attention layers' own head width and
      key/value heads (Gemma 4's global_head_dim, num_global_key_value_heads), where the
      sliding layers have head_dim and num_kv_heads; 0: the same. A model whose full
      layers differ (these, or k_eq_v) holds them in a stack of their own,
      `global_layers` (`global_layers_apart`), its sliding ones in `layers`; its rope
      rotates the full layers (at their width), rope_local the sliding ones.
    k_eq_v: the full-attention layers have no v_proj: their values are their keys'
      projection, taken before the key norm and the rotation (Gemma 4's
      attention_k_eq_v).
    v_norm: every attention layer's values are RMS-normed over head_dim, with no weight
      (Gemma 4).
    residual_fp32: the residual stream stays float32 between layers, each sublayer reading
      it rounded to the compute dtype and its output added in float32; the final norm's
      output is rounded back (Mamba2's residual_in_fp32). Single-sublayer layers alone
      (split_layers); it changes nothing when dtype is float32.
    layer_scale: each layer's output (the residual stream after it) is multiplied by a
      scalar of its own, `layer_scale` [1], that no gradient reaches (Gemma 4's
      layer_scalar buffer).
    moe_input_norms: a mixture layer's experts read the residual stream through a norm of
      their own (`pre_norm`), its router that stream RMS-normed without a weight, times
      `router_scale` [D] / sqrt(D); the chosen experts' weights are multiplied by
      `per_expert_scale` [E]; the shared expert's output (it reads the MLP's usual input
      norm) and the experts' are normed apart (`shared_out_norm`, `routed_out_norm`)
      before their sum (Gemma 4's MoE layers: a dense MLP beside 128 experts).
    per_layer_dim / per_layer_vocab: per-layer embeddings (Gemma 4 E2B / E4B's PLE): each
      token has an embedding of per_layer_dim for every layer (`per_layer_embed`
      [per_layer_vocab (0: vocab_size), L, P], times sqrt(P)), added to a projection of
      its scaled embedding (`per_layer_proj` [D, L, P], times 1 / sqrt(D), RMS-normed over
      P by `per_layer_norm`), the sum times 1 / sqrt(2); after its MLP each layer adds
      norm(out(gelu(gate(x)) * its per-layer input)) to the residual stream
      (`per_layer_gate` [D, P], `per_layer_out` [P, D], `per_layer_out_norm`). 0: none.
    kv_shared_layers: the last this many layers compute no keys or values: each attends
      over those of the last earlier layer of its kind (sliding or full), in training as
      in its cache, which it reads and does not hold (Gemma 4 E2B / E4B's
      num_kv_shared_layers). Their parameters sit in stacks of their own,
      `shared_layers` and `shared_global_layers`. Needs scan_layers=False.
    kv_shared_wide_mlp: those layers' MLPs are twice ffn_dim wide (use_double_wide_mlp).
    layer_norm: every norm is a LayerNorm with a weight and no bias, (x - mean(x)) /
      sqrt(var(x) + eps) * w in float32, in place of an RMSNorm (Cohere's).
    norm_bias: with layer_norm, every norm of the residual stream (each layer's and the
      final one) adds a bias after its weight (torch's LayerNorm: StarCoder2, Jais 2,
      StableLM); q/k norms have none.
    mlp_bias: the dense MLPs' projections have biases (up_bias, gate_bias, down_bias).
    norm_weightless: every norm of the residual stream (each layer's and the final one) is
      x / sqrt(mean(x^2) + eps) with no weight (nanochat's); with layer_norm, x less its
      mean over its standard deviation, no weight or bias (OLMo's).
    clip_qkv: q, k and v each clamped to [-clip_qkv, clip_qkv] after their projections
      (and biases), before the rotary embedding (OLMo 1.7's, DBRX's); None: not clamped.
    clip_qkv_after_norm: with clip_qkv and qk_norm, q and k are clamped after their norms
      (OLMoE's), not before them.
    embed_norm: the embeddings are normed so before the first layer: with
      norm_weightless by the final norm's function, no parameters of its own (nanochat);
      else by a norm of cfg's kind of its own (BLOOM's word_embeddings_layernorm).
    alibi: attention with linear biases in place of a rotary embedding (BLOOM, MPT,
      Falcon-RW; needs rope_layers all 0): head h's logits add -slope[h] |i - j| for
      query position i and key position j (`alibi_slopes`; `kernels`' alibi_slopes=).
    alibi_bias_max: the spread of the slopes: with P the power of two at or above
      num_heads, head h of P has slope 2^(-alibi_bias_max (h + 1) / P), and a head count
      short of P takes P's odd-numbered slopes then its even ones (MPT's alibi_bias_max;
      BLOOM's and Falcon's are 8, their formula the same series).
    alibi_scaled: the biases are scaled as the logits are, by the attention scale
      (Falcon-RW's (q.k + bias) / sqrt(head_dim)); else added after it (BLOOM, MPT).
    parallel_residual: each layer is x + attn(norm(x)) + mlp(norm(x)), the attention and
      the MLP reading one normed input (its input_norm; no post_attn_norm: Cohere
      Command R7B / Command A).
    parallel_mlp_norm: with parallel_residual, the MLP reads x through a norm of its own
      (post_attn_norm), x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX / Pythia).
    shared_expert_average: a mixture's output is the mean of its routed experts' sum and
      its shared expert's, (routed + shared) / 2, not their sum (Cohere2-MoE's
      shared_expert_combination_strategy "average").
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope: RopeConfig = RopeConfig()
  norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  qk_norm_heads: bool = False
  qk_norm_head_weights: bool = False
  qk_norm_after_rope: bool = False
  max_position_embeddings: int = 8192
  architecture: str = "LlamaForCausalLM"
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"
  scan_layers: bool = False
  attention_impl: str = "reference"
  attention_options: str = ""
  attention_chunk: int = 512
  # Cache slots read per block in decode attention; None = by backend at trace time
  # (`decode_chunk_for`, measured: DECODE_CHUNK_BY_BACKEND). Large blocks avoid a loop of
  # tiny kernels per layer and token; blocks past the longest row are skipped.
  decode_chunk: int | None = None
  value_head: bool = False
  lm_head_bias: bool = False
  learned_positions: bool = False
  position_offset: int = 0
  clip_qkv: float | None = None
  clip_qkv_after_norm: bool = False
  alibi: bool = False
  alibi_bias_max: float = 8.0
  alibi_scaled: bool = False
  lm_head: bool = True
  pad_token_id: int | None = None
  logprob_chunk: int = 256
  init_std: float = 0.02
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: str = DEFAULT_LORA_TARGETS
  base_quantization: str = ""
  base_quantization_block: int = 64
  num_experts: int = 0
  num_experts_per_tok: int = 0
  norm_topk_prob: bool = True
  router_aux_loss_coef: float = 0.0
  norm_unit_offset: bool = False
  sandwich_norms: bool = False
  output_norms: bool = False
  rope_layers: tuple[int, ...] = ()
  embed_scale: bool = False
  mlp_activation: str = "silu"
  query_pre_attn_scalar: float | None = None
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  embedding_multiplier: float = 1.0
  residual_multiplier: float = 1.0
  attention_multiplier: float | None = None
  logits_scaling: float = 1.0
  sliding_window: int | None = None
  layer_types: tuple[str, ...] = ()
  rope_local: RopeConfig | None = None
  attention_sinks: bool = False
  attn_out_bias: bool = False
  router_bias: bool = False
  expert_bias: bool = False
  swiglu_limit: float = 7.0
  swiglu_alpha: float = 1.702
  shared_expert_dim: int = 0
  shared_expert_gate: bool = False
  router_scoring: str = "softmax"
  router_jitter_eps: float = 0.01
  router_groups: int = 1
  router_group_topk: int = 1
  routed_scaling_factor: float = 1.0
  dense_layers: int = 0
  dense_ffn_dim: int = 0
  moe_layer_step: int = 1
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  index_topk: int = 0
  index_heads: int = 0
  index_head_dim: int = 0
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel: int = 4
  linear_chunk: int = 64
  linear_mixer: str = "gated_deltanet"
  linear_conv_bias: bool = False
  linear_dt_min: float = 0.0
  linear_dt_max: float = float("inf")
  linear_dt_rank: int = 0
  linear_bcdt_norm: str = "none"
  linear_bcdt_norm_eps: float = 1e-6
  attn_output_gate: bool = False
  qk_l2_norm: bool = False
  attention_chunk_size: int = 0
  attn_temperature_tuning: bool = False
  attn_floor_scale: float = 8192.0
  attn_scale: float = 0.1
  attn_position_scale: float = 0.0
  attn_position_scale_length: int = 0
  routed_input_scaling: bool = False
  router_correction_bias: bool = True
  softmax_correction_bias: bool = False
  moe_latent_dim: int = 0
  parallel_mixer: bool = False
  attention_in_multiplier: float = 1.0
  attention_out_multiplier: float = 1.0
  ssm_in_multiplier: float = 1.0
  ssm_out_multiplier: float = 1.0
  ssm_multipliers: tuple[float, ...] = ()
  mlp_gate_multiplier: float = 1.0
  mlp_down_multiplier: float = 1.0
  key_multiplier: float = 1.0
  lm_head_multiplier: float = 1.0
  linear_norm: str = "after_gate"
  global_head_dim: int = 0
  global_kv_heads: int = 0
  k_eq_v: bool = False
  v_norm: bool = False
  layer_scale: bool = False
  residual_fp32: bool = False
  moe_input_norms: bool = False
  per_layer_dim: int = 0
  per_layer_vocab: int = 0
  kv_shared_layers: int = 0
  kv_shared_wide_mlp: bool = False
  layer_norm: bool = False
  norm_bias: bool = False
  norm_weightless: bool = False
  embed_norm: bool = False
  mlp_bias: bool = False
  parallel_residual: bool = False
  parallel_mlp_norm: bool = False
  shared_expert_average: bool = False

  def __post_init__(self):
    # From JSON (a checkpoint's config) these arrive as a list and a dict.
    if isinstance(self.layer_types, str):
      object.__setattr__(self, "layer_types",
                         tuple(t.strip() for t in self.layer_types.split(",") if t.strip()))
    elif not isinstance(self.layer_types, tuple):
      object.__setattr__(self, "layer_types", tuple(self.layer_types or ()))
    if isinstance(self.rope_local, dict):
      object.__setattr__(self, "rope_local", RopeConfig(**self.rope_local))
    object.__setattr__(self, "ssm_multipliers", tuple(
        float(m) for m in (self.ssm_multipliers.split(",") if isinstance(
            self.ssm_multipliers, str) else self.ssm_multipliers or ()) if str(m).strip()))
    if isinstance(self.rope_layers, str):
      object.__setattr__(self, "rope_layers", tuple(
          int(t) for t in self.rope_layers.split(",") if t.strip()))
    else:
      object.__setattr__(self, "rope_layers", tuple(self.rope_layers or ()))
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "ffn_dim"):
      if getattr(self, name) <= 0 and not (name == "ffn_dim" and getattr(self, name) == 0):
        raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")
    if not self.ffn_dim and (self.num_experts or not self.layer_types
                             or set(self.layer_types) & {"mlp", "moe"}):
      raise ValueError("ffn_dim=0 (layers without an MLP, each its mixer alone: pure "
                       "Mamba2) needs layer_types without mlp or moe layers and no "
                       "num_experts")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
          f"attention_impl={self.attention_impl!r}; expected one of {ATTENTION_IMPLS}")
    if self.flash_options and self.attention_impl not in ("flash", "ring"):
      raise ValueError(f"attention_options={self.attention_options!r} are flash kernel "
                       f"options; attention_impl={self.attention_impl!r} takes none")
    if self.decode_chunk is not None and (int(self.decode_chunk) != self.decode_chunk
                                          or self.decode_chunk < 1):
      raise ValueError(f"decode_chunk must be a positive int or None, got {self.decode_chunk}")
    if not self.lm_head and not self.value_head:
      raise ValueError("lm_head=False needs value_head=True: a model without a language-model "
                       "head is a reward model, scored by its value head")
    if self.pad_token_id is not None and (isinstance(self.pad_token_id, bool)
                                          or not isinstance(self.pad_token_id, int)):
      raise ValueError(f"pad_token_id must be an int or None, got {self.pad_token_id!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; expected one of {REMAT_POLICIES}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{name}={getattr(self, name)!r}; expected float32, bfloat16 or float16")
    for name in ("num_experts", "num_experts_per_tok"):
      value = getattr(self, name)
      if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if self.num_experts:
      if not 1 <= self.num_experts_per_tok <= self.num_experts:
        raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                         f"[1, num_experts={self.num_experts}]")
    elif self.num_experts_per_tok:
      raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} needs num_experts > 0")
    if not 0.0 <= self.router_aux_loss_coef < float("inf"):
      raise ValueError(f"router_aux_loss_coef must be a finite number >= 0, got "
                       f"{self.router_aux_loss_coef!r}")
    if self.router_aux_loss_coef and not self.num_experts:
      raise ValueError(f"router_aux_loss_coef={self.router_aux_loss_coef} needs a mixture of "
                       "experts (num_experts > 0)")
    self._check_gemma_fields()
    self._check_mixture_fields()
    self._check_latent_attention_fields()
    self._check_linear_attention_fields()
    self._check_split_layers()
    if self.qk_norm_heads and not self.qk_norm:
      raise ValueError("qk_norm_heads=True needs qk_norm=True (it says what the q/k norms "
                       "span)")
    if self.qk_norm_head_weights and not self.qk_norm:
      raise ValueError("qk_norm_head_weights=True needs qk_norm=True (it says what the "
                       "q/k norms' weights are)")
    if self.qk_norm_head_weights and self.qk_norm_heads:
      raise ValueError("qk_norm_head_weights (a weight per head, each head normed alone) "
                       "and qk_norm_heads (every head normed at once) are two layouts of "
                       "the q/k norms; set one")
    if self.qk_norm_after_rope and not self.qk_norm:
      raise ValueError("qk_norm_after_rope=True needs qk_norm=True (it says when the q/k "
                       "norms apply)")
    if self.rope_layers and (len(self.rope_layers) != self.num_layers or any(
        isinstance(r, bool) or r not in (0, 1) for r in self.rope_layers)):
      raise ValueError(f"rope_layers must hold a 1 (rotary) or 0 (NoPE) for each of the "
                       f"{self.num_layers} layers, got {self.rope_layers!r}")
    self._check_llama4_fields()
    self._check_gemma4_fields()
    self._check_per_layer_fields()
    if self.parallel_residual:
      held = [name for name, on in (
          ("sandwich_norms", self.sandwich_norms), ("output_norms", self.output_norms),
          ("linear_attention layers", any(self.linear_layers)),
          ("split layers", self.split_layers), ("parallel_mixer", self.parallel_mixer),
          ("per_layer_dim", self.per_layer_dim)) if on]
      if held:
        raise ValueError(f"parallel_residual=True (one norm, attention and MLP side by side) "
                         f"with {', '.join(held)} is not supported")
    if self.parallel_mlp_norm and not self.parallel_residual:
      raise ValueError("parallel_mlp_norm=True (the MLP's own norm beside the attention's) "
                       "needs parallel_residual=True")
    if self.output_norms and self.sandwich_norms:
      raise ValueError("output_norms and sandwich_norms are two layouts of a block's norms; "
                       "set one")
    if self.base_quantization:
      if self.base_quantization not in ("int8", "nf4"):
        raise ValueError(f"base_quantization must be 'int8', 'nf4' or '' (none), got "
                         f"{self.base_quantization!r}")
      if not self.lora_rank:
        raise ValueError(f"base_quantization={self.base_quantization!r} holds a frozen base "
                         "for LoRA adapters: set lora_rank > 0")
    if (isinstance(self.base_quantization_block, bool)
        or not isinstance(self.base_quantization_block, int)
        or self.base_quantization_block < 2):
      raise ValueError(f"base_quantization_block must be an int >= 2, got "
                       f"{self.base_quantization_block!r}")
    if int(self.lora_rank) != self.lora_rank or self.lora_rank < 0:
      raise ValueError(f"lora_rank must be an int >= 0 (0: no adapters), got {self.lora_rank}")
    if self.lora_rank:
      if not self.lora_alpha > 0:
        raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
      names = [t.strip() for t in str(self.lora_targets).split(",") if t.strip()]
      linear = self.linear_lora_targets if self.linear_mixers else ()
      experts = [t for t in names if t in EXPERT_LORA_TARGETS]
      experts_allowed = self.expert_lora_targets
      if experts and not self.num_experts:
        raise ValueError(f"lora_targets {experts} adapt a mixture's routed experts, but this "
                         "model has none (num_experts=0)")
      other = [t for t in experts if t not in experts_allowed]
      if other and self.mlp_activation == "relu2":
        raise ValueError(f"lora_targets {other}: this model's experts have no gate "
                         "(mlp_activation='relu2'); use experts_up_proj and "
                         "experts_down_proj")
      if other:
        raise ValueError(f"lora_targets {other} adapt experts without a gate (relu^2); "
                         "this model's experts are gated: use experts_gate_up_proj and "
                         "experts_down_proj")
      bad = [t for t in names if t not in LORA_TARGETS + linear + EXPERT_LORA_TARGETS]
      if bad or not names:
        wrong = [t for t in bad if t in LINEAR_LORA_TARGETS]
        if wrong and linear:
          raise ValueError(f"lora_targets {wrong} are not projections of {self.architecture}"
                           f"'s {self.linear_mixer} layers; those are {','.join(linear)}")
        if wrong:
          raise ValueError(f"lora_targets {wrong} are Gated DeltaNet projections, but this "
                           "model has no linear_attention layers")
        raise ValueError(f"lora_targets={self.lora_targets!r}: expected a comma-separated "
                         f"subset of {LORA_TARGETS + linear + experts_allowed}")
      if (self.ungated and "gate_proj" in names
          and self.lora_targets != DEFAULT_LORA_TARGETS):
        raise ValueError(f"lora_targets names gate_proj, but this model's MLPs have no gate "
                         f"(mlp_activation={self.mlp_activation!r}); use up_proj and "
                         "down_proj")
      absent = [t for t in names if t in self._absent_lora_targets]
      if absent and self.lora_targets != DEFAULT_LORA_TARGETS:
        raise ValueError(f"lora_targets {absent}: this model has no such projections (its "
                         f"layers are {self.linear_mixer} mixers"
                         f"{' and MLPs' if any(self.mlp_layers) else ''} alone); use "
                         f"{','.join(linear)}")
      mlp = [t for t in names if t in LORA_TARGETS[4:]]
      dense_mlps = self.shared_expert_dim or self.num_dense_layers
      if (self.num_experts and not dense_mlps and mlp
          and self.lora_targets != DEFAULT_LORA_TARGETS):
        raise ValueError(f"lora_targets {mlp} are MLP projections, but this model's MLPs "
                         f"are {self.num_experts} experts (no shared expert), which take "
                         "no adapters; use attention projections "
                         f"({','.join(ATTENTION_LORA_TARGETS)})")

  def _check_mixture_fields(self) -> None:
    for name in ("shared_expert_dim", "router_groups", "router_group_topk", "dense_layers",
                 "dense_ffn_dim", "moe_layer_step"):
      value = getattr(self, name)
      if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    mixture_only = [name for name, on in (
        ("shared_expert_dim", self.shared_expert_dim), ("shared_expert_gate",
                                                         self.shared_expert_gate),
        ("router_scoring", self.router_scoring != "softmax"),
        ("router_groups", self.router_groups != 1),
        ("router_group_topk", self.router_group_topk != 1),
        ("routed_scaling_factor", self.routed_scaling_factor != 1.0),
        ("dense_layers", self.dense_layers),
        ("moe_layer_step", self.moe_layer_step != 1)) if on]
    if mixture_only and not self.num_experts:
      raise ValueError(f"{', '.join(mixture_only)} describe a mixture of experts; this model "
                       "has none (num_experts=0)")
    if self.router_scoring not in ROUTER_SCORINGS:
      raise ValueError(f"router_scoring={self.router_scoring!r}; expected one of "
                       f"{ROUTER_SCORINGS}")
    if self.router_scoring == "sparsemixer" and (
        self.norm_topk_prob or self.router_groups != 1 or self.softmax_correction_bias):
      raise ValueError("router_scoring='sparsemixer' weighs each chosen expert itself: "
                       "norm_topk_prob, router_groups and softmax_correction_bias do not "
                       "apply")
    if not 0 <= self.router_jitter_eps < float("inf"):
      raise ValueError(f"router_jitter_eps must be a number >= 0, got "
                       f"{self.router_jitter_eps!r}")
    if self.shared_expert_average and not self.shared_expert_dim:
      raise ValueError("shared_expert_average=True needs a shared expert (shared_expert_dim "
                       "> 0)")
    if self.shared_expert_gate and not self.shared_expert_dim:
      raise ValueError("shared_expert_gate=True needs a shared expert (shared_expert_dim > 0)")
    if self.num_experts and (self.router_groups < 1 or self.num_experts % self.router_groups
                             or not 1 <= self.router_group_topk <= self.router_groups):
      raise ValueError(f"router_groups={self.router_groups} must divide num_experts="
                       f"{self.num_experts}, and router_group_topk="
                       f"{self.router_group_topk} be in [1, router_groups]")
    pair = self.router_scoring == "sigmoid"  # a sigmoid group is ranked by its best two
    if self.num_experts and self.router_groups > 1 and (
        self.num_experts // self.router_groups < 1 + pair or self.num_experts_per_tok >
        self.router_group_topk * (self.num_experts // self.router_groups)):
      raise ValueError(f"router_groups={self.router_groups}: each group needs >= "
                       f"{1 + pair} experts and the chosen groups >= num_experts_per_tok="
                       f"{self.num_experts_per_tok} of them")
    value = self.routed_scaling_factor
    if isinstance(value, bool) or not 0 < value < float("inf"):
      raise ValueError(f"routed_scaling_factor must be a positive number, got {value!r}")
    if self.dense_layers >= self.num_layers and self.dense_layers:
      raise ValueError(f"dense_layers={self.dense_layers} leaves no mixture layer of "
                       f"num_layers={self.num_layers}; use a dense model (num_experts=0)")
    if self.moe_layer_step < 1:
      raise ValueError(f"moe_layer_step must be an int >= 1, got {self.moe_layer_step!r}")
    if self.moe_layer_step > 1 and self.dense_layers:
      raise ValueError(f"moe_layer_step={self.moe_layer_step} with dense_layers="
                       f"{self.dense_layers} is not supported: set one")
    if self.moe_layer_step > self.num_layers:
      raise ValueError(f"moe_layer_step={self.moe_layer_step} leaves no mixture layer of "
                       f"num_layers={self.num_layers}; use a dense model (num_experts=0)")
    interleaved = self.moe_layer_step > 1
    if interleaved and self.scan_layers and self.num_layers % self.moe_layer_step:
      raise ValueError(f"scan_layers with moe_layer_step={self.moe_layer_step} needs "
                       f"num_layers={self.num_layers} a multiple of it (the scan runs "
                       "periods of dense layers, then a mixture layer)")
    # A model of single-sublayer layers (Nemotron 3) with MLPs beside its mixtures: the
    # MLPs' width is dense_ffn_dim (ffn_dim is each expert's).
    mlps = bool(self.num_experts) and any(self.moe_layers) and any(self.mlp_layers)
    if bool(self.dense_layers or interleaved or mlps) != bool(self.dense_ffn_dim):
      what = (f"moe_layer_step={self.moe_layer_step}" if interleaved
              else "layer_types with mlp and moe layers" if mlps
              else f"dense_layers={self.dense_layers}")
      raise ValueError(f"{what} and dense_ffn_dim={self.dense_ffn_dim}: set both (the "
                       "dense layers' MLP width) or neither")

  def _check_latent_attention_fields(self) -> None:
    names = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")
    for name in names:
      value = getattr(self, name)
      if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    index = ("index_topk", "index_heads", "index_head_dim")
    for name in index:
      value = getattr(self, name)
      if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if any(getattr(self, n) for n in index):
      if not (self.kv_lora_rank and self.q_lora_rank):
        raise ValueError("index_topk / index_heads / index_head_dim (DeepSeek Sparse "
                         "Attention's indexer) need multi-head latent attention with a "
                         "query latent (kv_lora_rank > 0, q_lora_rank > 0)")
      if not all(getattr(self, n) for n in index):
        raise ValueError(f"set index_topk, index_heads and index_head_dim together, got "
                         f"{self.index_topk}, {self.index_heads}, {self.index_head_dim}")
      if self.index_head_dim < self.qk_rope_head_dim:
        raise ValueError(f"index_head_dim={self.index_head_dim} must hold the "
                         f"qk_rope_head_dim={self.qk_rope_head_dim} rotated features")
    if not self.kv_lora_rank:
      held = [n for n in names[1:] if getattr(self, n)]
      if held:
        raise ValueError(f"{', '.join(held)} describe multi-head latent attention; set "
                         "kv_lora_rank > 0 for it")
      return
    if self.num_kv_heads != self.num_heads:
      raise ValueError(f"multi-head latent attention expands a key and value per head: "
                       f"num_kv_heads={self.num_kv_heads} must equal num_heads="
                       f"{self.num_heads}")
    if not 0 < self.qk_rope_head_dim < self.head_dim or self.qk_rope_head_dim % 2:
      raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and in (0, "
                       f"head_dim={self.head_dim}) (head_dim = unrotated + rotated)")
    if self.rope.rotary_dim(self.head_dim) != self.qk_rope_head_dim:
      raise ValueError(f"rope.partial_rotary_factor={self.rope.partial_rotary_factor} "
                       f"rotates {self.rope.rotary_dim(self.head_dim)} of head_dim="
                       f"{self.head_dim}, but qk_rope_head_dim={self.qk_rope_head_dim}")
    if not 0 < self.v_head_dim <= self.head_dim:
      raise ValueError(f"v_head_dim={self.v_head_dim} must be in [1, head_dim="
                       f"{self.head_dim}]")
    held = [n for n, on in (("qkv_bias", self.qkv_bias), ("qk_norm", self.qk_norm),
                            ("attention_sinks", self.attention_sinks),
                            ("attn_output_gate", self.attn_output_gate),
                            ("sliding_window", self.sliding_window is not None)) if on]
    if held:
      raise ValueError(f"{', '.join(held)} with multi-head latent attention "
                       "(kv_lora_rank > 0) are not supported")

  def _check_alibi(self) -> None:
    if not self.alibi:
      if self.alibi_scaled:
        raise ValueError("alibi_scaled=True needs alibi=True (it scales ALiBi's biases)")
      return
    if not 0 < self.alibi_bias_max < float("inf"):
      raise ValueError(f"alibi_bias_max must be a positive number, got "
                       f"{self.alibi_bias_max!r}")
    if any(not nope for nope in self.nope_layers):
      raise ValueError("alibi=True (linear attention biases in place of a rotary "
                       "embedding) needs rope_layers all 0 (no layer rotates q and k)")
    if self.kv_lora_rank or self.index_topk:
      raise ValueError("alibi=True with multi-head latent attention (kv_lora_rank) or "
                       "sparse attention (index_topk) is not supported")

  @property
  def alibi_slopes(self) -> tuple[float, ...] | None:
    """ALiBi's slope per query head (times the attention scale with alibi_scaled), or
    None without alibi: MPT's series (`alibi_bias_max`), which at 8 is BLOOM's and
    Falcon's."""
    if not self.alibi:
      return None
    n = self.num_heads
    p = 1 << (n - 1).bit_length()
    slopes = [2.0 ** (-self.alibi_bias_max * (i + 1) / p) for i in range(p)]
    if p != n:
      slopes = (slopes[1::2] + slopes[::2])[:n]
    if self.alibi_scaled:
      scale = self.attention_scale
      scale = self.head_dim ** -0.5 if scale is None else scale
      slopes = [s * scale for s in slopes]
    return tuple(slopes)

  def _check_linear_attention_fields(self) -> None:
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim")
    for name in names + ("linear_conv_kernel", "linear_chunk"):
      value = getattr(self, name)
      if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if self.linear_conv_kernel < 1 or self.linear_chunk < 1:
      raise ValueError(f"linear_conv_kernel={self.linear_conv_kernel} and linear_chunk="
                       f"{self.linear_chunk} must be at least 1")
    if self.linear_mixer not in LINEAR_MIXERS:
      raise ValueError(f"linear_mixer={self.linear_mixer!r}; expected one of {LINEAR_MIXERS}")
    low, high = self.linear_dt_min, self.linear_dt_max
    if (isinstance(low, bool) or isinstance(high, bool) or not 0.0 <= low < float("inf")
        or not low < high):
      raise ValueError(f"linear_dt_min={low!r} and linear_dt_max={high!r} must satisfy "
                       "0 <= linear_dt_min < linear_dt_max (inf: no upper limit)")
    short_conv = self.linear_mixer == "short_conv"
    mamba1 = self.linear_mixer == "mamba1"
    rank = self.linear_dt_rank
    if isinstance(rank, bool) or int(rank) != rank or rank < 0:
      raise ValueError(f"linear_dt_rank must be an int >= 0, got {rank!r}")
    eps = self.linear_bcdt_norm_eps
    if isinstance(eps, bool) or not 0.0 < eps < 1.0:
      raise ValueError(f"linear_bcdt_norm_eps must be in (0, 1), got {eps!r}")
    if self.linear_bcdt_norm not in ("none", "weightless", "weighted"):
      raise ValueError(f"linear_bcdt_norm={self.linear_bcdt_norm!r}; expected 'none', "
                       "'weightless' or 'weighted'")
    held = [n for n, on in (("linear_dt_rank", rank),
                            ("linear_bcdt_norm", self.linear_bcdt_norm != "none")) if on]
    if held and not mamba1:
      raise ValueError(f"{', '.join(held)} are Mamba 1's: they need linear_mixer='mamba1'")
    if mamba1 and any(self.linear_layers):
      if not rank:
        raise ValueError("linear_mixer='mamba1' needs linear_dt_rank >= 1 (its "
                         "time_step_rank)")
      if self.linear_num_key_heads != 1 or self.linear_value_head_dim != 1:
        raise ValueError(f"linear_mixer='mamba1' has one B and C for every channel and "
                         f"channels of width 1: linear_num_key_heads="
                         f"{self.linear_num_key_heads} and linear_value_head_dim="
                         f"{self.linear_value_head_dim} must be 1")
      if self.parallel_mixer:
        raise ValueError("parallel_mixer=True runs Mamba2 mixers; linear_mixer='mamba1' "
                         "is not supported there")
    mamba_only = [n for n, on in (("linear_conv_bias",
                                   self.linear_conv_bias and not short_conv and not mamba1),
                                  ("linear_dt_min", low != 0.0),
                                  ("linear_dt_max", high != float("inf"))) if on]
    if self.linear_norm not in LINEAR_NORMS:
      raise ValueError(f"linear_norm={self.linear_norm!r}; expected one of {LINEAR_NORMS}")
    if len(self.ssm_multipliers) not in (0, 5) or not all(
        math.isfinite(m) for m in self.ssm_multipliers):
      raise ValueError(f"ssm_multipliers must be () or five finite numbers (z, x, B, C, "
                       f"dt), got {self.ssm_multipliers!r}")
    mamba_only += [n for n, on in (("linear_norm", self.linear_norm != "after_gate"),
                                   ("ssm_multipliers", self.ssm_multipliers)) if on]
    if mamba_only and self.linear_mixer != "mamba2":
      raise ValueError(f"{', '.join(mamba_only)} are Mamba2's: they need "
                       "linear_mixer='mamba2'")
    self._check_parallel_mixer()
    if short_conv:  # its channels are d_model's: no heads of its own
      held = [n for n in names if getattr(self, n)]
      if held:
        raise ValueError(f"{', '.join(held)} describe Gated DeltaNet / Mamba2 heads; "
                         "linear_mixer='short_conv' has none (its channels are d_model's): "
                         "leave them 0")
    if not any(self.linear_layers) and not self.parallel_mixer:
      return
    missing = [n for n in names if not getattr(self, n) and not short_conv]
    if missing:
      mixers = ("parallel_mixer=True" if self.parallel_mixer else
                "layer_types has linear_attention layers")
      raise ValueError(f"{mixers}: set {', '.join(missing)}")
    if not short_conv and self.linear_num_value_heads % self.linear_num_key_heads:
      raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a "
                       f"multiple of linear_num_key_heads={self.linear_num_key_heads}")
    held = [n for n, on in (("kv_lora_rank", self.kv_lora_rank),
                            ("sliding_attention layers", any(self.sliding_layers)),
                            ("rope_layers with rotary and NoPE layers both",
                             len(set(self.rope_layers)) > 1),
                            ("output_norms", self.output_norms),
                            ("sandwich_norms", self.sandwich_norms)) if on]
    if held:
      raise ValueError(f"{', '.join(held)} with linear_attention layers are not supported")
    if all(self.linear_layers) and not self.split_layers:
      raise ValueError("layer_types has no full_attention layer; a model of linear_attention "
                       "layers alone, each with an MLP, is not supported (without MLPs, "
                       "ffn_dim=0, it is: Mamba2's)")

  def _check_parallel_mixer(self) -> None:
    for name in MUP_MULTIPLIERS:
      value = getattr(self, name)
      if isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    mixer_scalars = [n for n in MUP_MULTIPLIERS[:4] if getattr(self, n) != 1.0]
    if mixer_scalars and not self.parallel_mixer:
      raise ValueError(f"{', '.join(mixer_scalars)} scale the mixers of parallel_mixer "
                       "layers (Falcon-H1's); they need parallel_mixer=True")
    if self.mlp_gate_multiplier != 1.0 and self.ungated:
      raise ValueError(f"mlp_gate_multiplier scales the MLP's gate, but mlp_activation="
                       f"{self.mlp_activation!r} has none")
    if (self.mlp_gate_multiplier != 1.0 or self.mlp_down_multiplier != 1.0) and (
        self.num_experts):
      raise ValueError("mlp_gate_multiplier / mlp_down_multiplier with a mixture of experts "
                       "are not supported")
    if not self.parallel_mixer:
      if self.ssm_multipliers and not any(self.linear_layers):
        raise ValueError("ssm_multipliers scale Mamba2 layers' in_proj, but this model has "
                         "none (parallel_mixer or linear_attention layers)")
      return
    if self.linear_mixer != "mamba2":
      raise ValueError("parallel_mixer=True runs a Mamba2 mixer beside each attention: it "
                       "needs linear_mixer='mamba2'")
    held = [n for n, on in (("layer_types other than full_attention",
                             set(self.layer_types) - {"full_attention"}),
                            ("a mixture of experts", self.num_experts),
                            ("kv_lora_rank", self.kv_lora_rank),
                            ("sliding_window", self.sliding_window is not None),
                            ("output_norms", self.output_norms),
                            ("sandwich_norms", self.sandwich_norms)) if on]
    if held:
      raise ValueError(f"{', '.join(held)} with parallel_mixer=True are not supported")

  @property
  def ungated(self) -> bool:
    """Whether the MLPs have no gate (mlp_activation relu2 or xielu): down(act(up(x)))."""
    return self.mlp_activation in UNGATED_ACTIVATIONS

  @property
  def has_correction_bias(self) -> bool:
    """Whether the routers hold a score_correction_bias [E] (sigmoid routing's, or
    softmax_correction_bias)."""
    return bool(self.num_experts) and (
        (self.router_scoring == "sigmoid" and self.router_correction_bias)
        or self.softmax_correction_bias)

  @property
  def linear_mixers(self) -> bool:
    """Whether the model has Gated DeltaNet, Mamba2 or short-convolution mixers, in
    linear_attention layers or beside every attention (parallel_mixer): a recurrent state
    (or a convolution's window) in its cache."""
    return self.parallel_mixer or any(self.linear_layers)

  @property
  def split_layers(self) -> bool:
    """Whether each layer is one sublayer, a mixer, an MLP or a mixture of experts
    (layer_types with "mlp" or "moe" layers: Nemotron-H, Nemotron 3; or ffn_dim=0, no MLP
    at all: Mamba2ForCausalLM's), not a mixer and an MLP."""
    return ("mlp" in self.layer_types or "moe" in self.layer_types
            or not self.ffn_dim)

  @property
  def mlp_layers(self) -> tuple[bool, ...]:
    """Per layer, whether it is an MLP alone (layer_types' "mlp": `split_layers`)."""
    return tuple(t == "mlp" for t in self.layer_types) or (False,) * self.num_layers

  @property
  def moe_layers(self) -> tuple[bool, ...]:
    """Per layer, whether it is a mixture of experts alone (layer_types' "moe":
    `split_layers`)."""
    return tuple(t == "moe" for t in self.layer_types) or (False,) * self.num_layers

  @property
  def attention_layers(self) -> tuple[bool, ...]:
    """Per layer, whether it has softmax attention (a KV cache): neither a linear-attention
    layer nor an MLP or a mixture alone."""
    return tuple(not (lin or mlp or moe) for lin, mlp, moe in zip(
        self.linear_layers, self.mlp_layers, self.moe_layers))

  @property
  def linear_layers(self) -> tuple[bool, ...]:
    """Per layer, whether it is a linear-attention layer (Gated DeltaNet, or Mamba2's
    state space: `linear_mixer`)."""
    return tuple(t == "linear_attention" for t in self.layer_types) or (
        (False,) * self.num_layers)

  @property
  def layer_period(self) -> int:
    """The shortest p dividing num_layers with layer_types[i] == layer_types[i % p]: a
    scanned model of linear and full layers runs p layers per scan step (num_layers
    when no shorter pattern repeats)."""
    kinds = self.layer_types or ("full_attention",) * self.num_layers
    if self.num_experts and not self.split_layers:  # a mixture's dense layers apart
      kinds = tuple(zip(kinds, self.mixture_flags))
    return next(p for p in range(1, len(kinds) + 1) if len(kinds) % p == 0
                and all(kinds[i] == kinds[i % p] for i in range(len(kinds))))

  @property
  def cache_heads(self) -> int:
    """Heads of the KV cache: num_kv_heads, or 1 for multi-head latent attention."""
    return 1 if self.kv_lora_rank else self.num_kv_heads

  @property
  def cache_head_dim(self) -> int:
    """Features of a cache head: head_dim, or multi-head latent attention's rotated key
    part and latent, qk_rope_head_dim + kv_lora_rank."""
    return self.qk_rope_head_dim + self.kv_lora_rank if self.kv_lora_rank else self.head_dim

  @property
  def mixture_layers(self) -> int:
    """Layers whose MLP is the mixture (`mixture_flags`); 0 for a dense model."""
    return sum(self.mixture_flags)

  @property
  def mixture_flags(self) -> tuple[bool, ...]:
    """Per layer, whether its MLP is the mixture: past the `dense_layers`, every
    moe_layer_step-th layer; all False for a dense model."""
    if self.split_layers:  # layer_types' moe layers (Nemotron 3)
      return self.moe_layers
    k, step = self.dense_layers, self.moe_layer_step
    return tuple(bool(self.num_experts) and i >= k and (i - k + 1) % step == 0
                 for i in range(self.num_layers))

  @property
  def num_dense_layers(self) -> int:
    """A mixture's layers with a dense MLP of dense_ffn_dim (leading or interleaved; with
    split_layers its MLPs alone); 0 for a dense model."""
    if self.split_layers:
      return sum(self.mlp_layers) if self.num_experts else 0
    return self.num_layers - self.mixture_layers if self.num_experts else 0

  def _check_llama4_fields(self) -> None:
    size = self.attention_chunk_size
    if isinstance(size, bool) or int(size) != size or size < 0:
      raise ValueError(f"attention_chunk_size must be an int >= 0 (0: none), got {size!r}")
    for name in ("attn_floor_scale", "attn_scale"):
      value = getattr(self, name)
      if isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if (size or self.qk_l2_norm or self.attn_temperature_tuning) and (
        self.kv_lora_rank or any(self.linear_layers)):
      raise ValueError("attention_chunk_size, qk_l2_norm and attn_temperature_tuning "
                       "(Llama 4's attention) are not supported with latent attention or "
                       "linear-attention layers")
    beta, length = self.attn_position_scale, self.attn_position_scale_length
    if isinstance(beta, bool) or not 0 <= beta < float("inf"):
      raise ValueError(f"attn_position_scale must be a number >= 0 (0: off), got {beta!r}")
    if isinstance(length, bool) or int(length) != length or length < 0 or (
        beta and not length):
      raise ValueError(f"attn_position_scale_length must be an int > 0 with "
                       f"attn_position_scale (the positions per step of the scale), got "
                       f"{length!r}")
    if size and (self.sliding_window != size or not any(self.sliding_layers)):
      raise ValueError(f"attention_chunk_size={size} chunks the sliding layers: it needs "
                       f"sliding_window={size} (got {self.sliding_window}) and layer_types "
                       "with sliding_attention layers")
    if self.routed_input_scaling and not self.num_experts:
      raise ValueError("routed_input_scaling=True needs a mixture of experts (num_experts "
                       "> 0)")
    if self.routed_input_scaling and self.expert_bias:
      raise ValueError("routed_input_scaling=True with expert_bias is not supported (the "
                       "down biases are weighted by the router)")
    if not self.router_correction_bias and self.router_scoring != "sigmoid":
      raise ValueError("router_correction_bias=False is sigmoid routing's option "
                       "(router_scoring='sigmoid')")
    if self.softmax_correction_bias and (self.router_scoring != "softmax"
                                         or not self.num_experts):
      raise ValueError("softmax_correction_bias=True needs a mixture of experts with "
                       "router_scoring='softmax'")

  def _check_gemma_fields(self) -> None:
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"mlp_activation={self.mlp_activation!r}; expected one of "
                       f"{MLP_ACTIVATIONS}")
    if (self.mlp_activation in ("xielu", "gelu_tanh_ungated", "gelu_ungated", "relu_ungated")
        and self.num_experts):
      raise ValueError(f"mlp_activation={self.mlp_activation!r} (a dense MLP's) has no "
                       "mixture of experts form; this model has num_experts > 0")
    if self.mlp_bias and self.num_experts:
      raise ValueError("mlp_bias=True (biases on a dense MLP's projections) has no mixture "
                       "of experts form; this model has num_experts > 0")
    if self.norm_weightless and (self.norm_bias or self.norm_unit_offset or self.qk_norm):
      raise ValueError("norm_weightless=True (norms without a weight) with norm_bias, "
                       "norm_unit_offset or qk_norm (normed q/k without a weight: "
                       "qk_l2_norm) is not supported")
    if self.position_offset < 0 or (self.position_offset and not self.learned_positions):
      raise ValueError(f"position_offset={self.position_offset} needs learned_positions=True "
                       "and must be >= 0 (the leading rows of its table no position reads)")
    if self.clip_qkv is not None and not 0 < self.clip_qkv < float("inf"):
      raise ValueError(f"clip_qkv must be a positive number (or None: no clamp), got "
                       f"{self.clip_qkv!r}")
    if self.clip_qkv is not None and (self.kv_lora_rank or any(self.linear_layers)):
      raise ValueError("clip_qkv (q, k and v projections clamped) with latent attention "
                       "(kv_lora_rank) or linear-attention layers is not supported")
    if self.clip_qkv_after_norm and (self.clip_qkv is None or not self.qk_norm
                                     or self.qk_norm_after_rope):
      raise ValueError("clip_qkv_after_norm=True needs clip_qkv and qk_norm (normed before "
                       "the rotation): it clamps the normed q and k")
    self._check_alibi()
    if self.norm_bias and not self.layer_norm:
      raise ValueError("norm_bias=True needs layer_norm=True (a LayerNorm's bias; an "
                       "RMSNorm has none)")
    if (self.router_bias or self.expert_bias) and not self.num_experts:
      raise ValueError("router_bias / expert_bias need a mixture of experts (num_experts > 0)")
    for name in ("swiglu_limit", "swiglu_alpha"):
      value = getattr(self, name)
      if isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                 "attention_multiplier"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not 0 < value < float("inf")):
        raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
      value = getattr(self, name)
      if isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if self.attention_multiplier is not None and (self.query_pre_attn_scalar is not None
                                                  or self.kv_lora_rank):
      raise ValueError("attention_multiplier sets the attention's scale itself; it cannot "
                       "be combined with query_pre_attn_scalar or latent attention's")
    window = self.sliding_window
    if window is not None and (isinstance(window, bool) or int(window) != window
                               or window < 1):
      raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
    if self.layer_types:
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                         f"num_layers={self.num_layers}")
      bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
      if bad:
        raise ValueError(f"layer_types {bad} are not supported; expected entries in "
                         f"{LAYER_TYPES}")
      if "sliding_attention" in self.layer_types and window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is "
                         "None")
    if self.rope_local is not None and not isinstance(self.rope_local, RopeConfig):
      raise ValueError(f"rope_local must be a RopeConfig, a dict or None, got "
                       f"{self.rope_local!r}")

  def _check_gemma4_fields(self) -> None:
    for name in ("global_head_dim", "global_kv_heads"):
      value = getattr(self, name)
      if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (0: as the sliding layers), got "
                         f"{value!r}")
    if self.global_head_dim % 2:
      raise ValueError(f"global_head_dim={self.global_head_dim} must be even for RoPE")
    if self.global_kv_heads and self.num_heads % self.global_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"global_kv_heads={self.global_kv_heads}")
    if self.moe_input_norms and not (self.num_experts and self.shared_expert_dim):
      raise ValueError("moe_input_norms=True describes a mixture beside a shared expert "
                       "(num_experts > 0, shared_expert_dim > 0)")
    if self.moe_input_norms and (self.router_scoring != "softmax" or self.moe_latent_dim
                                 or self.shared_expert_gate or self.has_correction_bias):
      raise ValueError("moe_input_norms=True (Gemma 4's mixture) takes a softmax router "
                       "without a correction bias, a latent or a shared-expert gate")
    if not self.global_layers_apart:
      return
    sliding = self.sliding_layers
    if all(sliding) or not any(sliding) or not self.layer_types:
      raise ValueError("global_head_dim / global_kv_heads / k_eq_v describe the full "
                       "layers beside sliding ones: layer_types needs both kinds")
    held = [name for name, on in (
        ("linear_attention layers", any(self.linear_layers)),
        ("split layers", self.split_layers), ("kv_lora_rank", self.kv_lora_rank),
        ("parallel_mixer", self.parallel_mixer), ("dense_layers", self.dense_layers),
        ("moe_layer_step", self.moe_layer_step != 1),
        ("attention_chunk_size", self.attention_chunk_size),
        ("rope_layers", self.rope_layers), ("attn_output_gate", self.attn_output_gate),
        ("qkv_bias", self.qkv_bias), ("qk_norm_heads", self.qk_norm_heads),
        ("qk_norm_head_weights", self.qk_norm_head_weights)) if on]
    if held:
      raise ValueError(f"full layers of their own (global_head_dim / global_kv_heads / "
                       f"k_eq_v) with {', '.join(held)} are not supported")
    if self.rope_local is None:
      raise ValueError("full layers of their own rotate by rope and the sliding ones by "
                       "rope_local: set rope_local")

  def _check_per_layer_fields(self) -> None:
    for name in ("per_layer_dim", "per_layer_vocab", "kv_shared_layers"):
      value = getattr(self, name)
      if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if self.per_layer_vocab and not self.per_layer_dim:
      raise ValueError("per_layer_vocab needs per-layer embeddings (per_layer_dim > 0)")
    if self.kv_shared_wide_mlp and self.num_experts:
      raise ValueError("kv_shared_wide_mlp=True widens dense MLPs; this model's are a "
                       "mixture of experts")
    if self.kv_shared_wide_mlp and not self.kv_shared_layers:
      raise ValueError("kv_shared_wide_mlp=True widens the MLPs of the layers sharing keys "
                       "and values: set kv_shared_layers > 0")
    if not (self.per_layer_dim or self.kv_shared_layers):
      return
    if self.scan_layers:
      raise ValueError("per-layer embeddings (per_layer_dim) and layers sharing keys and "
                       "values (kv_shared_layers) run with scan_layers=False")
    held = [name for name, on in (
        ("linear_attention layers", any(self.linear_layers)),
        ("split layers", self.split_layers), ("kv_lora_rank", self.kv_lora_rank),
        ("parallel_mixer", self.parallel_mixer), ("dense_layers", self.dense_layers),
        ("moe_layer_step", self.moe_layer_step != 1),
        ("attention_chunk_size", self.attention_chunk_size)) if on]
    if held:
      raise ValueError(f"per_layer_dim / kv_shared_layers with {', '.join(held)} are not "
                       "supported")
    if self.kv_shared_layers >= self.num_layers:
      raise ValueError(f"kv_shared_layers={self.kv_shared_layers} leaves no layer of "
                       f"num_layers={self.num_layers} computing keys and values")
    first = self.num_layers - self.kv_shared_layers
    kinds = self.sliding_layers
    missing = sorted({("sliding" if k else "full") for k in kinds[first:]}
                     - {("sliding" if k else "full") for k in kinds[:first]})
    if missing:
      raise ValueError(f"kv_shared_layers={self.kv_shared_layers}: the {missing} layers "
                       "among them have no earlier layer of their kind to share with")

  def kv_producer(self, i: int) -> int | None:
    """The layer whose keys and values layer i attends over when it shares them
    (`kv_shared_layers`): the last earlier layer of its kind that computes its own; None
    for a layer computing its own."""
    first = self.num_layers - self.kv_shared_layers
    if i < first:
      return None
    kinds = self.sliding_layers
    return max(j for j in range(first) if kinds[j] == kinds[i])

  @property
  def global_layers_apart(self) -> bool:
    """Whether the full-attention layers differ in shape from the sliding ones
    (global_head_dim, global_kv_heads, k_eq_v) and sit in a stack of their own,
    `global_layers`."""
    return bool((self.global_head_dim and self.global_head_dim != self.head_dim)
                or (self.global_kv_heads and self.global_kv_heads != self.num_kv_heads)
                or self.k_eq_v)

  def global_config(self) -> "ModelConfig":
    """The config a full-attention layer of its own (`global_layers_apart`) is built and
    run by: head_dim and num_kv_heads its own."""
    return dataclasses.replace(
        self, head_dim=self.global_head_dim or self.head_dim,
        num_kv_heads=self.global_kv_heads or self.num_kv_heads, global_head_dim=0,
        global_kv_heads=0)

  def _check_split_layers(self) -> None:
    if self.residual_fp32 and not self.split_layers:
      raise ValueError("residual_fp32=True is supported in single-sublayer layers alone "
                       "(split_layers: layer_types' mlp or moe layers, or ffn_dim=0)")
    latent = self.moe_latent_dim
    if isinstance(latent, bool) or int(latent) != latent or latent < 0:
      raise ValueError(f"moe_latent_dim must be an int >= 0 (0: none), got {latent!r}")
    if latent and not self.num_experts:
      raise ValueError(f"moe_latent_dim={latent} describes a mixture of experts; this model "
                       "has none (num_experts=0)")
    if self.mlp_activation == "relu2" and self.num_experts:
      # Experts without a gate: [E, D, F] up and [E, F, D] down (Nemotron 3).
      held = [n for n, on in (("expert_bias", self.expert_bias),
                              ("routed_input_scaling", self.routed_input_scaling)) if on]
      if held:
        raise ValueError(f"{', '.join(held)} with mlp_activation='relu2' (experts without "
                         "a gate) are not supported")
    moe = "moe" in self.layer_types
    if moe and not self.num_experts:
      raise ValueError("layer_types has moe layers: set num_experts (and "
                       "num_experts_per_tok)")
    if not self.split_layers:
      return
    if self.num_experts and not moe:
      raise ValueError(f"num_experts={self.num_experts} with layer_types' mlp layers: a "
                       "mixture sits in layer_types' moe layers alone")
    held = [n for n, on in (("dense_layers", self.dense_layers),
                            ("moe_layer_step", self.moe_layer_step != 1),
                            ("sliding_attention layers", any(self.sliding_layers)),
                            ("output_norms", self.output_norms),
                            ("sandwich_norms", self.sandwich_norms),
                            ("kv_lora_rank", self.kv_lora_rank)) if on]
    if held:
      raise ValueError(f"{', '.join(held)} with layer_types' mlp or moe layers "
                       "(single-sublayer layers) are not supported")
    if not any(self.linear_layers):
      raise ValueError("single-sublayer layers (layer_types' mlp or moe layers, or "
                       "ffn_dim=0) need linear_attention layers (Nemotron-H's, Mamba2's); a "
                       "model of attention and MLPs alone is not supported")

  @property
  def nope_layers(self) -> tuple[bool, ...]:
    """Per layer, whether its q and k go without a rotary embedding (NoPE)."""
    return tuple(not r for r in self.rope_layers) or (False,) * self.num_layers

  @property
  def sliding_layers(self) -> tuple[bool, ...]:
    """Per layer, whether it is a sliding-window attention layer."""
    if self.layer_types:
      return tuple(t == "sliding_attention" for t in self.layer_types)
    return (self.sliding_window is not None,) * self.num_layers

  @property
  def attention_scale(self) -> float | None:
    """The attention logits' scale (None: the kernels' 1 / sqrt(head_dim)). Multi-head
    latent attention under YaRN with mscale_all_dim multiplies 1 / sqrt(head_dim) by
    (0.1 mscale_all_dim ln(factor) + 1)^2, as DeepSeek-V3 does. Falcon-H1's
    key_multiplier scales the keys: the logits, by as much."""
    if self.key_multiplier != 1.0:
      base = self.replace(key_multiplier=1.0).attention_scale
      return (self.head_dim ** -0.5 if base is None else base) * float(self.key_multiplier)
    if self.attention_multiplier is not None:
      return float(self.attention_multiplier)
    rope = self.rope
    if (self.kv_lora_rank and rope.type == "yarn" and rope.mscale_all_dim
        and rope.factor > 1):
      m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
      return self.head_dim ** -0.5 * m * m
    if self.query_pre_attn_scalar is None:
      return None
    return float(self.query_pre_attn_scalar) ** -0.5

  @property
  def lora_target_names(self) -> tuple[str, ...]:
    """The projections with LoRA adapters, in LORA_TARGETS order, then the Gated DeltaNet
    and routed-expert ones (empty at rank 0)."""
    if not self.lora_rank:
      return ()
    names = {t.strip() for t in str(self.lora_targets).split(",")}
    dense_mlps = not self.num_experts or self.shared_expert_dim or self.num_dense_layers
    if self.lora_targets == DEFAULT_LORA_TARGETS and self.architecture in PEFT_FUSED_MLP:
      dense_mlps = False  # by default only what PEFT files of the class can hold
    allowed = LORA_TARGETS if dense_mlps else ATTENTION_LORA_TARGETS
    if self.linear_mixers:
      allowed += self.linear_lora_targets
      if self.lora_targets == DEFAULT_LORA_TARGETS:
        names |= set(self.linear_lora_targets)
        if self.architecture in PEFT_NO_OUT_PROJ:
          names.discard("out_proj")
    allowed += self.expert_lora_targets
    if self.ungated:  # an MLP without a gate
      allowed = tuple(t for t in allowed if t != "gate_proj")
    absent = self._absent_lora_targets
    return tuple(t for t in allowed if t in names and t not in absent)

  @property
  def _absent_lora_targets(self) -> tuple[str, ...]:
    """LORA_TARGETS of sublayers this model has none of: attention in a model of
    single-sublayer layers without attention layers, the MLP's in one without MLPs
    (ffn_dim=0, Mamba2's)."""
    out = ()
    if self.split_layers and not any(self.attention_layers):
      out += ATTENTION_LORA_TARGETS
    if not self.ffn_dim:
      out += LORA_TARGETS[4:]
    return out

  @property
  def expert_lora_targets(self) -> tuple[str, ...]:
    """The LoRA target names of a mixture's routed experts (none without one):
    experts_gate_up_proj and experts_down_proj, or with experts without a gate (relu^2,
    Nemotron 3) experts_up_proj and experts_down_proj, in the order the Hugging Face
    experts module holds its parameters."""
    if not self.num_experts:
      return ()
    if self.mlp_activation == "relu2":
      return UNGATED_EXPERT_LORA_TARGETS
    return GATED_EXPERT_LORA_TARGETS

  @property
  def linear_lora_targets(self) -> tuple[str, ...]:
    """The LoRA target names of a linear-attention layer's projections, as the model's
    Hugging Face family names its modules (a Mamba2 or short-convolution layer's in_proj /
    out_proj, Qwen3-Next's fused in_proj_qkvz / in_proj_ba, else Qwen3.5's)."""
    if self.linear_mixer == "mamba2":
      return MAMBA2_LORA_TARGETS
    if self.linear_mixer == "mamba1":
      return MAMBA1_LORA_TARGETS
    if self.linear_mixer == "short_conv":
      return SHORT_CONV_LORA_TARGETS
    if self.architecture.startswith("Qwen3Next"):
      return QWEN3_NEXT_LINEAR_LORA_TARGETS
    return QWEN3_5_LINEAR_LORA_TARGETS

  @property
  def lora_scale(self) -> float:
    return float(self.lora_alpha) / float(self.lora_rank) if self.lora_rank else 0.0

  @property
  def num_lora_params(self) -> int:
    """Parameter count of the LoRA adapters (0 without)."""
    d, f, n, k, h = (self.d_model, self.ffn_dim, self.num_heads, self.num_kv_heads,
                     self.head_dim)
    sizes = {"q_proj": d + n * h, "k_proj": d + k * h, "v_proj": d + k * h,
             "o_proj": n * h + d}
    # An MLP target's layers: every dense MLP (a mixture's leading dense layers, of
    # dense_ffn_dim) and every mixture layer's shared expert (`stack_lora_targets`).
    mlp = ((sum(self.mlp_layers) if self.split_layers else self.num_layers) * (d + f)
           if not self.num_experts else
           self.num_dense_layers * (d + self.dense_ffn_dim)
           + (self.mixture_layers * (d + self.shared_expert_dim)
              if self.shared_expert_dim else 0))
    sizes.update(gate_proj=mlp, up_proj=mlp, down_proj=mlp)
    if self.kv_lora_rank:  # MLA's projections (`Attention._init_latent`)
      r, v = self.kv_lora_rank, self.v_head_dim
      sizes.update(q_proj=(self.q_lora_rank or d) + n * h,
                   k_proj=r + n * (h - self.qk_rope_head_dim), v_proj=r + n * v,
                   o_proj=n * v + d)
    hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
    qk, vd = hk * self.linear_key_head_dim, hv * self.linear_value_head_dim
    sizes.update(in_proj_qkv=d + 2 * qk + vd, in_proj_z=d + vd, in_proj_b=d + hv,
                 in_proj_a=d + hv, in_proj_qkvz=d + 2 * qk + 2 * vd, in_proj_ba=d + 2 * hv,
                 in_proj=d + 2 * vd + 2 * qk + hv, out_proj=vd + d)
    if self.linear_mixer == "short_conv":  # B, C and x of d_model channels each
      sizes.update(in_proj=d + 3 * d, out_proj=d + d)
    # A mixture layer's routed experts, each its own A and B (`EXPERT_LORA_TARGETS`).
    e, latent = self.num_experts, self.moe_latent_dim or d
    sizes.update(experts_gate_up_proj=e * (latent + 2 * f), experts_up_proj=e * (latent + f),
                 experts_down_proj=e * (f + latent))
    # A linear-attention layer has no attention targets and full layers no linear ones
    # (`stack_lora_targets`).
    linear = self.num_layers if self.parallel_mixer else sum(self.linear_layers)
    layers = {t: linear if t in LINEAR_LORA_TARGETS else
              sum(self.attention_layers) if t in ATTENTION_LORA_TARGETS else
              self.mixture_layers if t in EXPERT_LORA_TARGETS else 1
              for t in self.lora_target_names}
    return self.lora_rank * sum(sizes[t] * layers[t] for t in self.lora_target_names)

  @property
  def flash_options(self) -> dict[str, Any]:
    """attention_options parsed into kernels.flash_attention keywords."""
    return parse_attention_options(self.attention_options)

  def replace(self, **kwargs: Any) -> "ModelConfig":
    """A copy with fields replaced. A new num_layers without layer_types keeps the layer
    kinds' pattern (its shortest period: a 2-layer Gemma 2 is sliding, full)."""
    if "num_layers" in kwargs and "layer_types" not in kwargs and self.layer_types:
      kinds = self.layer_types
      period = next(p for p in range(1, len(kinds) + 1)
                    if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
      kwargs["layer_types"] = tuple(kinds[i % period] for i in range(int(kwargs["num_layers"])))
    for name in ("rope", "rope_local"):
      if isinstance(kwargs.get(name), dict):
        kwargs[name] = RopeConfig(**kwargs[name])
    return dataclasses.replace(self, **kwargs)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    d = dict(d)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"unknown model config keys {unknown}")
    for name in ("rope", "rope_local"):
      if isinstance(d.get(name), dict):
        d[name] = RopeConfig(**d[name])
    return cls(**d)

  def _count_params(self, experts: int) -> int:
    d, f, h, kv, hd = self.d_model, self.ffn_dim, self.num_heads, self.num_kv_heads, self.head_dim
    attn = d * h * hd * 2 + d * kv * hd * 2
    if self.kv_lora_rank:  # multi-head latent attention
      rq, rkv, hr, v = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim
      attn = ((d * rq + rq + rq * h * hd) if rq else d * h * hd) + d * (rkv + hr) + rkv
      attn += rkv * h * (hd - hr + v) + h * v * d
      hi, di = self.index_heads, self.index_head_dim  # the sparse attention's indexer
      attn += rq * hi * di + d * di + 2 * di + d * hi
    if self.qkv_bias:
      attn += (h + 2 * kv) * hd
    if self.qk_norm:
      attn += (h + kv) * hd if self.qk_norm_heads or self.qk_norm_head_weights else 2 * hd
    attn += h * self.attention_sinks + d * self.attn_out_bias + d * h * hd * self.attn_output_gate
    router = (d + self.router_bias + self.has_correction_bias) * self.num_experts
    norms = (4 if self.sandwich_norms else
             1 if self.parallel_residual and not self.parallel_mlp_norm else 2)
    norms *= (1 + self.norm_bias) * (not self.norm_weightless)
    mats = 2 if self.ungated else 3  # no gate_proj without a gate
    latent = self.moe_latent_dim or d  # the experts' input and output width
    expert = mats * latent * f + (2 * f + d) * self.expert_bias
    shared = (mats * d * self.shared_expert_dim + d * self.shared_expert_gate
              + 2 * d * self.moe_latent_dim)  # the latent projections count beside it
    per_layer = attn + experts * expert + router + shared + norms * d
    dense = attn + 3 * d * self.dense_ffn_dim + norms * d
    emb = self.vocab_size * d * (2 if self.lm_head and not self.tie_embeddings else 1)
    emb += self.vocab_size * (self.lm_head and self.lm_head_bias)
    emb += (self.max_position_embeddings + self.position_offset) * d * self.learned_positions
    emb += (1 + self.norm_bias) * d * (self.embed_norm and not self.norm_weightless)
    swapped = 0
    linear = sum(self.linear_layers)
    if self.linear_mixers:  # Gated DeltaNet, Mamba2 or LFM2's short convolution
      hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
      dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
      mixer = ((d + self.linear_conv_kernel) * (2 * hk * dk + hv * dv) + d * hv * dv
               + 2 * d * hv + 2 * hv + dv + hv * dv * d)
      if self.linear_mixer == "mamba2":  # in_proj, conv (+ bias), A_log, dt_bias, D, norm
        conv = (self.linear_conv_kernel + self.linear_conv_bias) * (2 * hk * dk + hv * dv)
        mixer = (d * (2 * hv * dv + 2 * hk * dk + hv) + conv + 3 * hv
                 + hv * dv * (self.linear_norm != "none") + hv * dv * d)
      if self.linear_mixer == "short_conv":  # in_proj [3D, D], taps [D, C], out_proj
        mixer = 4 * d * d + self.linear_conv_kernel * d + 5 * d * self.linear_conv_bias
      if self.linear_mixer == "mamba1":  # in_proj, conv (+ bias), x_proj, dt_proj (+ bias),
        # A_log, D, out_proj
        r, n = self.linear_dt_rank, dk
        mixer = (3 * d * hv + (self.linear_conv_kernel + self.linear_conv_bias) * hv
                 + hv * (r + 2 * n) + r * hv + hv + hv * n + hv
                 + (r + 2 * n) * (self.linear_bcdt_norm == "weighted"))
      # in place of attention; with parallel_mixer beside it in every layer
      swapped = (self.num_layers * mixer if self.parallel_mixer else
                 linear * (mixer - attn))
    if self.split_layers:  # one sublayer and its norm a layer
      full = sum(self.attention_layers)
      width = self.dense_ffn_dim if self.num_experts else f  # an MLP alone's
      return (full * (attn + d) + linear * (attn + d) + swapped
              + sum(self.mlp_layers) * (mats * d * width + d)
              + sum(self.moe_layers) * (experts * expert + router + shared + d) + emb + d
              + (d + 1 if self.value_head else 0))
    dense_layers = self.num_dense_layers
    # Gemma 4: a scalar a layer; a mixture's router scales and three norms more
    per_layer += self.layer_scale + (d + self.num_experts + 3 * d) * self.moe_input_norms
    dense += self.layer_scale
    if self.global_layers_apart:  # the full layers' attention at their own widths
      def core(width, heads, kv_mats):  # q, o, k (and v) and the q / k norms
        return d * h * width * 2 + d * heads * width * kv_mats + 2 * width * self.qk_norm
      gh, gkv = self.global_head_dim or hd, self.global_kv_heads or kv
      swapped += (self.num_layers - sum(self.sliding_layers)) * (
          core(gh, gkv, 1 if self.k_eq_v else 2) - core(hd, kv, 2))
    if self.per_layer_dim:  # Gemma 4's per-layer embeddings, their projection and norms
      p, layers = self.per_layer_dim, self.num_layers
      swapped += ((self.per_layer_vocab or self.vocab_size) * layers * p + d * layers * p + p
                  + layers * (2 * d * p + d))
    first = self.num_layers - self.kv_shared_layers
    for i in range(first, self.num_layers):  # no k_proj, v_proj or k_norm; a wider MLP
      full = self.global_layers_apart and not self.sliding_layers[i]
      width = (self.global_head_dim or hd) if full else hd
      heads = (self.global_kv_heads or kv) if full else kv
      kv_mats = 1 if full and self.k_eq_v else 2
      swapped -= d * heads * width * kv_mats + width * self.qk_norm
      swapped += mats * d * f * self.kv_shared_wide_mlp
    per_layer += ((mats - 1) * f + d) * self.mlp_bias
    return ((self.num_layers - dense_layers) * per_layer + dense_layers * dense + swapped
            + emb + d * (1 + self.norm_bias) * (not self.norm_weightless)
            + (d + 1 if self.value_head else 0))

  @property
  def num_params(self) -> int:
    """Parameter count (embeddings included; every expert of a mixture-of-experts)."""
    return self._count_params(self.num_experts or 1)

  @property
  def num_active_params(self) -> int:
    """Parameters one token runs through: num_params with only the top-k experts of each
    layer counted (the same as num_params for a dense model)."""
    return self._count_params(self.num_experts_per_tok or 1)


_LLAMA3_ROPE = RopeConfig(theta=500_000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)

# Llama 4's 48 layers: three chunked (sliding_window = attention_chunk_size) rotary
# layers, then a NoPE layer over the whole context, twelve times.
_LLAMA4_LAYERS = (("sliding_attention",) * 3 + ("full_attention",)) * 12

# What the Qwen3.5 presets share: a gated attention layer after every three Gated
# DeltaNet layers (16 key heads of 128), a quarter of each head rotated.
_QWEN3_5_PERIOD = ("linear_attention",) * 3 + ("full_attention",)
_QWEN3_5 = dict(
    rope=RopeConfig(theta=10_000_000.0, partial_rotary_factor=0.25), norm_eps=1e-6,
    qk_norm=True, norm_unit_offset=True, attn_output_gate=True, linear_num_key_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=262_144,
    dtype="bfloat16", param_dtype="bfloat16", remat="full", scan_layers=True)

PRESETS: dict[str, ModelConfig] = {
    # Fits the byte tokenizer (256 bytes + specials); a few seconds per step on CPU.
    "tiny": ModelConfig(vocab_size=272, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=32, ffn_dim=384, rope=RopeConfig(theta=10_000.0),
                        max_position_embeddings=2048, tie_embeddings=True),
    # The side-by-side comparison config used by benchmarks (same as the peer's).
    "bench": ModelConfig(vocab_size=1024, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=64, ffn_dim=1024, rope=RopeConfig(theta=10_000.0),
                         max_position_embeddings=2048, tie_embeddings=True,
                         architecture="Qwen3ForCausalLM", qk_norm=True),
    "llama3_8b": ModelConfig(vocab_size=128_256, d_model=4096, num_layers=32, num_heads=32,
                             num_kv_heads=8, head_dim=128, ffn_dim=14_336, rope=_LLAMA3_ROPE,
                             norm_eps=1e-5, max_position_embeddings=131_072,
                             architecture="LlamaForCausalLM", dtype="bfloat16",
                             param_dtype="bfloat16", remat="dots_with_no_batch_dims"),
    "llama3_70b": ModelConfig(vocab_size=128_256, d_model=8192, num_layers=80, num_heads=64,
                              num_kv_heads=8, head_dim=128, ffn_dim=28_672, rope=_LLAMA3_ROPE,
                              norm_eps=1e-5, max_position_embeddings=131_072,
                              architecture="LlamaForCausalLM", dtype="bfloat16",
                              param_dtype="bfloat16", remat="full"),
    "qwen2_5_7b": ModelConfig(vocab_size=152_064, d_model=3584, num_layers=28, num_heads=28,
                              num_kv_heads=4, head_dim=128, ffn_dim=18_944,
                              rope=RopeConfig(theta=1_000_000.0), norm_eps=1e-6, qkv_bias=True,
                              max_position_embeddings=32_768, architecture="Qwen2ForCausalLM",
                              dtype="bfloat16", param_dtype="bfloat16",
                              remat="dots_with_no_batch_dims"),
    "qwen3_8b": ModelConfig(vocab_size=151_936, d_model=4096, num_layers=36, num_heads=32,
                            num_kv_heads=8, head_dim=128, ffn_dim=12_288,
                            rope=RopeConfig(theta=1_000_000.0), norm_eps=1e-6, qk_norm=True,
                            max_position_embeddings=40_960, architecture="Qwen3ForCausalLM",
                            dtype="bfloat16", param_dtype="bfloat16",
                            remat="dots_with_no_batch_dims"),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 per token (30.5B parameters, 3.3B active).
    "qwen3_30b_a3b": ModelConfig(vocab_size=151_936, d_model=2048, num_layers=48, num_heads=32,
                                 num_kv_heads=4, head_dim=128, ffn_dim=768, num_experts=128,
                                 num_experts_per_tok=8, norm_topk_prob=True,
                                 rope=RopeConfig(theta=1_000_000.0), norm_eps=1e-6,
                                 qk_norm=True, max_position_embeddings=40_960,
                                 architecture="Qwen3MoeForCausalLM", dtype="bfloat16",
                                 param_dtype="bfloat16", remat="dots_with_no_batch_dims",
                                 scan_layers=True),
    # Qwen3.5-27B (its text model): three Gated DeltaNet layers (16 key, 48 value heads of
    # 128) to each gated full-attention layer (24 heads, 4 kv, a quarter of each rotated);
    # 26.9B parameters.
    "qwen3_5_27b": ModelConfig(
        vocab_size=248_320, d_model=5120, num_layers=64, num_heads=24, num_kv_heads=4,
        head_dim=256, ffn_dim=17_408, layer_types=_QWEN3_5_PERIOD * 16,
        linear_num_value_heads=48, architecture="Qwen3_5ForCausalLM", **_QWEN3_5),
    # Qwen3.5-35B-A3B (its text model): Qwen3.5's layers, every MLP 256 experts of 512
    # (8 a token) beside a gated shared expert of 512; 34.7B parameters, 3.5B active.
    "qwen3_5_35b_a3b": ModelConfig(
        vocab_size=248_320, d_model=2048, num_layers=40, num_heads=16, num_kv_heads=2,
        head_dim=256, ffn_dim=512, num_experts=256, num_experts_per_tok=8,
        norm_topk_prob=True, shared_expert_dim=512, shared_expert_gate=True,
        layer_types=_QWEN3_5_PERIOD * 10, linear_num_value_heads=32,
        architecture="Qwen3_5MoeForCausalLM", **_QWEN3_5),
    # Qwen1.5-MoE-A2.7B: 60 experts of 1408, 4 per token, a gated shared expert of 5632
    # (14.3B parameters, 2.7B active).
    "qwen1_5_moe_a2_7b": ModelConfig(
        vocab_size=151_936, d_model=2048, num_layers=24, num_heads=16, num_kv_heads=16,
        head_dim=128, ffn_dim=1408, num_experts=60, num_experts_per_tok=4,
        norm_topk_prob=False, shared_expert_dim=5632, shared_expert_gate=True, qkv_bias=True,
        rope=RopeConfig(theta=1_000_000.0), norm_eps=1e-6, max_position_embeddings=8192,
        architecture="Qwen2MoeForCausalLM", dtype="bfloat16", param_dtype="bfloat16",
        remat="dots_with_no_batch_dims", scan_layers=True),
    # GLM-4.5-Air: a dense first layer, then 128 experts of 1408 (8 a token, sigmoid
    # routing) and a shared one; half of each head rotated (106B parameters, 12B active).
    "glm4_5_air": ModelConfig(
        vocab_size=151_552, d_model=4096, num_layers=46, num_heads=96, num_kv_heads=8,
        head_dim=128, ffn_dim=1408, num_experts=128, num_experts_per_tok=8,
        shared_expert_dim=1408, router_scoring="sigmoid", dense_layers=1, dense_ffn_dim=10_944,
        qkv_bias=True, rope=RopeConfig(theta=1_000_000.0, partial_rotary_factor=0.5),
        norm_eps=1e-5, max_position_embeddings=131_072, architecture="Glm4MoeForCausalLM",
        dtype="bfloat16", param_dtype="bfloat16", remat="full", scan_layers=True),
    # Moonlight-16B-A3B (DeepSeek-V3's layout): latent attention (kv rank 512, one q_proj),
    # a dense first layer, 64 experts of 1408 (6 a token) and two shared (16B, 3B active).
    "moonlight_16b_a3b": ModelConfig(
        vocab_size=163_840, d_model=2048, num_layers=27, num_heads=16, num_kv_heads=16,
        head_dim=192, ffn_dim=1408, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=64, num_experts_per_tok=6, shared_expert_dim=2816,
        router_scoring="sigmoid", routed_scaling_factor=2.446, dense_layers=1,
        dense_ffn_dim=11_264, rope=RopeConfig(theta=50_000.0, partial_rotary_factor=64 / 192),
        norm_eps=1e-5, max_position_embeddings=8192, architecture="DeepseekV3ForCausalLM",
        dtype="bfloat16", param_dtype="bfloat16", remat="dots_with_no_batch_dims",
        scan_layers=True),
    # DeepSeek-V3 / R1: latent attention (q rank 1536, kv rank 512; YaRN x40), three dense
    # layers, 256 experts of 2048 (8 a token within 4 of 8 groups) and a shared one
    # (671B parameters, 37B active).
    "deepseek_v3": ModelConfig(
        vocab_size=129_280, d_model=7168, num_layers=61, num_heads=128, num_kv_heads=128,
        head_dim=192, ffn_dim=2048, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=256, num_experts_per_tok=8, shared_expert_dim=2048,
        router_scoring="sigmoid", router_groups=8, router_group_topk=4,
        routed_scaling_factor=2.5, dense_layers=3, dense_ffn_dim=18_432,
        rope=RopeConfig(theta=10_000.0, type="yarn", factor=40.0, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                        original_max_position_embeddings=4096, partial_rotary_factor=64 / 192),
        norm_eps=1e-6, max_position_embeddings=163_840, architecture="DeepseekV3ForCausalLM",
        dtype="bfloat16", param_dtype="bfloat16", remat="full", scan_layers=True),
    # GLM-4.7-Flash (transformers' Glm4MoeLiteConfig): DeepSeek-V3's latent attention and
    # sigmoid routing, 64 experts of 1536 (4 a token) beside a shared one, the first layer
    # dense (29.9B parameters, 3.9B active).
    "glm4_7_flash": ModelConfig(
        vocab_size=154_880, d_model=2048, num_layers=47, num_heads=20, num_kv_heads=20,
        head_dim=256, ffn_dim=1536, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
        v_head_dim=256, num_experts=64, num_experts_per_tok=4, shared_expert_dim=1536,
        router_scoring="sigmoid", routed_scaling_factor=1.8, dense_layers=1,
        dense_ffn_dim=10_240, rope=RopeConfig(theta=10_000.0, partial_rotary_factor=0.25),
        norm_eps=1e-5, max_position_embeddings=202_752,
        architecture="Glm4MoeLiteForCausalLM", dtype="bfloat16", param_dtype="bfloat16",
        remat="full", scan_layers=True),
    # GLM-5 (transformers' GlmMoeDsaConfig): latent attention (64 heads, q rank 2048) under
    # DeepSeek Sparse Attention (2048 keys a query, an indexer of 32 heads of 128), three
    # dense layers, 256 experts of 2048 (8 a token) beside a shared one (743.9B
    # parameters, 41.8B active).
    "glm5": ModelConfig(
        vocab_size=154_880, d_model=6144, num_layers=78, num_heads=64, num_kv_heads=64,
        head_dim=256, ffn_dim=2048, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
        v_head_dim=256, num_experts=256, num_experts_per_tok=8, shared_expert_dim=2048,
        router_scoring="sigmoid", routed_scaling_factor=2.5, dense_layers=3,
        dense_ffn_dim=12_288, index_topk=2048, index_heads=32, index_head_dim=128,
        rope=RopeConfig(theta=10_000.0, partial_rotary_factor=0.25), norm_eps=1e-5,
        max_position_embeddings=202_752, architecture="GlmMoeDsaForCausalLM",
        dtype="bfloat16", param_dtype="bfloat16", remat="full", scan_layers=True),
    # Mistral Small 4 (transformers' Mistral4Config): latent attention with the queries
    # scaled by position past 8192, 128 experts of 2048 (4 a token, softmax) beside a
    # shared one (119.0B parameters, 6.6B active).
    "mistral_small4": ModelConfig(
        vocab_size=131_072, d_model=4096, num_layers=36, num_heads=32, num_kv_heads=32,
        head_dim=128, ffn_dim=2048, kv_lora_rank=256, q_lora_rank=1024, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=128, num_experts_per_tok=4, shared_expert_dim=2048,
        rope=RopeConfig(theta=10_000.0, type="yarn", factor=128.0, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                        original_max_position_embeddings=8192, partial_rotary_factor=0.5),
        attn_position_scale=0.1, attn_position_scale_length=8192, norm_eps=1e-6,
        max_position_embeddings=1_048_576, pad_token_id=11,
        architecture="Mistral4ForCausalLM", dtype="bfloat16", param_dtype="bfloat16",
        remat="full", scan_layers=True),
    # MiniMax-M2: 256 experts of 1536, 8 a token by sigmoid scores plus a correction bias,
    # no shared expert; q/k norms over all heads, half of each head rotated (228.7B
    # parameters, 11.0B active with both embedding tables, 9.8B without).
    "minimax_m2": ModelConfig(
        vocab_size=200_064, d_model=3072, num_layers=62, num_heads=48, num_kv_heads=8,
        head_dim=128, ffn_dim=1536, num_experts=256, num_experts_per_tok=8,
        norm_topk_prob=True, router_scoring="sigmoid",
        rope=RopeConfig(theta=5_000_000.0, partial_rotary_factor=0.5), norm_eps=1e-6,
        qk_norm=True, qk_norm_heads=True, max_position_embeddings=196_608,
        architecture="MiniMaxM2ForCausalLM", dtype="bfloat16", param_dtype="bfloat16",
        remat="full", scan_layers=True),
    # Llama-4-Scout-17B-16E (its text model): every layer 16 experts of 8192 (one a token,
    # its input scaled by its sigmoid score) beside a shared one; three rotary layers
    # attending within chunks of 8192 to each NoPE layer over the whole context (107.8B
    # parameters, 17.2B active).
    "llama4_scout": ModelConfig(
        vocab_size=202_048, d_model=5120, num_layers=48, num_heads=40, num_kv_heads=8,
        head_dim=128, ffn_dim=8192, num_experts=16, num_experts_per_tok=1,
        norm_topk_prob=False, shared_expert_dim=8192, router_scoring="sigmoid",
        router_correction_bias=False, routed_input_scaling=True,
        rope=RopeConfig(theta=500_000.0, type="llama3", factor=16.0, low_freq_factor=1.0,
                        high_freq_factor=1.0, original_max_position_embeddings=8192),
        norm_eps=1e-5, rope_layers=(1, 1, 1, 0) * 12, qk_l2_norm=True,
        attention_chunk_size=8192, sliding_window=8192, layer_types=_LLAMA4_LAYERS,
        attn_temperature_tuning=True,
        max_position_embeddings=10_485_760, architecture="Llama4ForCausalLM",
        dtype="bfloat16", param_dtype="bfloat16", remat="full", scan_layers=True),
    # Llama-4-Maverick-17B-128E (its text model): Scout's attention without q/k norms and
    # no rotary scaling; every other layer 128 experts of 8192 (one a token) beside a
    # shared one, the others dense MLPs of 16384 (400.7B parameters, 17.2B active).
    "llama4_maverick": ModelConfig(
        vocab_size=202_048, d_model=5120, num_layers=48, num_heads=40, num_kv_heads=8,
        head_dim=128, ffn_dim=8192, num_experts=128, num_experts_per_tok=1,
        norm_topk_prob=False, shared_expert_dim=8192, router_scoring="sigmoid",
        router_correction_bias=False, routed_input_scaling=True, moe_layer_step=2,
        dense_ffn_dim=16_384, rope=RopeConfig(theta=500_000.0), norm_eps=1e-5,
        rope_layers=(1, 1, 1, 0) * 12, attention_chunk_size=8192, sliding_window=8192,
        layer_types=_LLAMA4_LAYERS, attn_temperature_tuning=True,
        max_position_embeddings=1_048_576,
        architecture="Llama4ForCausalLM", dtype="bfloat16", param_dtype="bfloat16",
        remat="full", scan_layers=True),
    # Granite 3.3 8B (IBM; 3.1's layout, its vocabulary 4 larger): Llama's blocks scaled
    # by Granite's four scalars, the table tied to the output projection (8.2B).
    "granite3_8b": ModelConfig(
        vocab_size=49_159, d_model=4096, num_layers=40, num_heads=32, num_kv_heads=8,
        head_dim=128, ffn_dim=12_800, rope=RopeConfig(theta=10_000_000.0), norm_eps=1e-5,
        tie_embeddings=True, max_position_embeddings=131_072, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0,
        architecture="GraniteForCausalLM", dtype="bfloat16", param_dtype="bfloat16",
        remat="full", scan_layers=True),
    # Mixtral 8x7B: 8 experts of width 14336, 2 per token (46.7B parameters, 12.9B active).
    "mixtral_8x7b": ModelConfig(vocab_size=32_000, d_model=4096, num_layers=32, num_heads=32,
                                num_kv_heads=8, head_dim=128, ffn_dim=14_336, num_experts=8,
                                num_experts_per_tok=2, rope=RopeConfig(theta=1_000_000.0),
                                norm_eps=1e-5, max_position_embeddings=32_768,
                                architecture="MixtralForCausalLM", dtype="bfloat16",
                                param_dtype="bfloat16", remat="full"),
    # Gemma 2 2B: sliding (4096) and full layers alternating, soft caps 50 / 30.
    "gemma2_2b": ModelConfig(vocab_size=256_000, d_model=2304, num_layers=26, num_heads=8,
                             num_kv_heads=4, head_dim=256, ffn_dim=9216,
                             rope=RopeConfig(theta=10_000.0), norm_eps=1e-6,
                             tie_embeddings=True, max_position_embeddings=8192,
                             architecture="Gemma2ForCausalLM", dtype="bfloat16",
                             param_dtype="bfloat16", remat="dots_with_no_batch_dims",
                             norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
                             mlp_activation="gelu_tanh", query_pre_attn_scalar=256.0,
                             attn_logit_softcap=50.0, final_logit_softcap=30.0,
                             sliding_window=4096,
                             layer_types=("sliding_attention", "full_attention") * 13),
    # Gemma 3 1B: five sliding (512, rope base 10k) layers to one full (base 1M), q/k norms.
    "gemma3_1b": ModelConfig(vocab_size=262_144, d_model=1152, num_layers=26, num_heads=4,
                             num_kv_heads=1, head_dim=256, ffn_dim=6912,
                             rope=RopeConfig(theta=1_000_000.0), norm_eps=1e-6,
                             tie_embeddings=True, qk_norm=True, max_position_embeddings=32_768,
                             architecture="Gemma3ForCausalLM", dtype="bfloat16",
                             param_dtype="bfloat16", remat="dots_with_no_batch_dims",
                             norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
                             mlp_activation="gelu_tanh", query_pre_attn_scalar=256.0,
                             sliding_window=512, rope_local=RopeConfig(theta=10_000.0),
                             layer_types=tuple("full_attention" if (i + 1) % 6 == 0
                                               else "sliding_attention" for i in range(26))),
    # Gemma 3 12B's language model (published as Gemma3ForConditionalGeneration; read alone):
    # window 1024, linear rope scaling x8 on the full layers.
    "gemma3_12b": ModelConfig(vocab_size=262_208, d_model=3840, num_layers=48, num_heads=16,
                              num_kv_heads=8, head_dim=256, ffn_dim=15_360,
                              rope=RopeConfig(theta=1_000_000.0, type="linear", factor=8.0),
                              norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
                              max_position_embeddings=131_072,
                              architecture="Gemma3ForCausalLM", dtype="bfloat16",
                              param_dtype="bfloat16", remat="dots_with_no_batch_dims",
                              norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
                              mlp_activation="gelu_tanh", query_pre_attn_scalar=256.0,
                              sliding_window=1024, rope_local=RopeConfig(theta=10_000.0),
                              scan_layers=True,
                              layer_types=tuple("full_attention" if (i + 1) % 6 == 0
                                                else "sliding_attention" for i in range(48))),
    # gpt-oss-20b: 32 experts of width 2880, 4 per token, attention sinks, sliding (128)
    # and full layers alternating, YaRN x32 over a 4096-token pre-training context.
    "gpt_oss_20b": ModelConfig(vocab_size=201_088, d_model=2880, num_layers=24, num_heads=64,
                               num_kv_heads=8, head_dim=64, ffn_dim=2880, num_experts=32,
                               num_experts_per_tok=4, norm_topk_prob=True,
                               rope=RopeConfig(theta=150_000.0, type="yarn", factor=32.0,
                                               beta_fast=32.0, beta_slow=1.0, truncate=False,
                                               original_max_position_embeddings=4096),
                               norm_eps=1e-5, qkv_bias=True, attn_out_bias=True,
                               attention_sinks=True, router_bias=True, expert_bias=True,
                               mlp_activation="clamped_swiglu",
                               max_position_embeddings=131_072,
                               architecture="GptOssForCausalLM", dtype="bfloat16",
                               param_dtype="bfloat16", remat="dots_with_no_batch_dims",
                               scan_layers=True, sliding_window=128,
                               layer_types=tuple("sliding_attention" if i % 2 == 0
                                                 else "full_attention" for i in range(24))),
    # OLMoE-1B-7B (AllenAI): 64 experts of width 1024, 8 per token, not renormalised, q/k
    # norms over every head; 6.9B parameters, 1.3B active.
    "olmoe_1b_7b": ModelConfig(
        vocab_size=50_304, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=16,
        head_dim=128, ffn_dim=1024, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, qk_norm=True, qk_norm_heads=True,
        rope=RopeConfig(theta=10_000.0), norm_eps=1e-5, max_position_embeddings=4096,
        architecture="OlmoeForCausalLM", dtype="bfloat16", param_dtype="bfloat16",
        remat="dots_with_no_batch_dims", scan_layers=True),
    # Ministral 3 8B's language model (transformers' Ministral3Config): Mistral with YaRN
    # x16 over a 16K pre-training context to 256K, the queries scaled up by position past
    # it; 8.5B parameters.
    "ministral3_8b": ModelConfig(
        vocab_size=131_072, d_model=4096, num_layers=34, num_heads=32, num_kv_heads=8,
        head_dim=128, ffn_dim=14_336, rope=RopeConfig(
            theta=1_000_000.0, type="yarn", factor=16.0, original_max_position_embeddings=16_384,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        norm_eps=1e-5, attn_position_scale=0.1, attn_position_scale_length=16_384,
        max_position_embeddings=262_144, architecture="Ministral3ForCausalLM",
        dtype="bfloat16", param_dtype="bfloat16", remat="dots_with_no_batch_dims",
        scan_layers=True),
    # Seed-OSS-36B (ByteDance Seed): Llama with q/k/v biases, 80 heads over 8 kv heads of
    # 128 on a width of 5120, a 512K context; 36.2B parameters.
    "seed_oss_36b": ModelConfig(vocab_size=155_136, d_model=5120, num_layers=64, num_heads=80,
                                num_kv_heads=8, head_dim=128, ffn_dim=27_648,
                                rope=RopeConfig(theta=10_000_000.0), norm_eps=1e-6,
                                qkv_bias=True, max_position_embeddings=524_288,
                                architecture="SeedOssForCausalLM", dtype="bfloat16",
                                param_dtype="bfloat16", remat="full", scan_layers=True),
}

# DeepSeek-V3.2 (-Exp, -Speciale): DeepSeek-V3 under DeepSeek Sparse Attention, each query
# attending to the 2048 keys its indexer (64 heads of 128) scores highest (671.9B
# parameters, 38.4B active).
PRESETS["deepseek_v3_2"] = PRESETS["deepseek_v3"].replace(
    index_topk=2048, index_heads=64, index_head_dim=128,
    architecture="DeepseekV32ForCausalLM")


# Gemma 4's language models (published as Gemma4ForConditionalGeneration; read alone): five
# sliding layers (window 1024, rope base 10k, 256-wide heads) to one full layer (512-wide
# heads, few key/value heads, values from the keys' projection, proportional RoPE over a
# quarter of the frequencies at base 1M), plain norms and value norms, a scalar a layer.
_GEMMA4 = dict(vocab_size=262_144, head_dim=256, global_head_dim=512,
               rope=RopeConfig(theta=1_000_000.0, type="proportional",
                               partial_rotary_factor=0.25),
               rope_local=RopeConfig(theta=10_000.0), norm_eps=1e-6, tie_embeddings=True,
               qk_norm=True, sandwich_norms=True, embed_scale=True, mlp_activation="gelu_tanh",
               attention_multiplier=1.0, final_logit_softcap=30.0, sliding_window=1024,
               k_eq_v=True, v_norm=True, layer_scale=True, max_position_embeddings=262_144,
               architecture="Gemma4ForCausalLM", dtype="bfloat16", param_dtype="bfloat16",
               remat="full", scan_layers=True)
# Gemma 4 31B: 60 layers of width 5376, 32 heads over 16 key/value heads (4 in the full
# layers); 30.7B parameters.
PRESETS["gemma4_31b"] = ModelConfig(
    d_model=5376, num_layers=60, num_heads=32, num_kv_heads=16, global_kv_heads=4,
    ffn_dim=21_504, layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 10,
    **_GEMMA4)
# Gemma 4 26B-A4B: 30 layers of width 2816, each a dense GeGLU MLP (2112) beside 128
# experts of width 704, 8 a token; 25.2B parameters, 3.8B active.
PRESETS["gemma4_26b_a4b"] = ModelConfig(
    d_model=2816, num_layers=30, num_heads=16, num_kv_heads=8, global_kv_heads=2,
    ffn_dim=704, num_experts=128, num_experts_per_tok=8, shared_expert_dim=2112,
    moe_input_norms=True, layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 5,
    **_GEMMA4)

# Gemma 4 E2B / E4B: per-layer embeddings of 256 (a table of 262,144 x layers x 256 beside
# the vocabulary's), window 512, the full layers' key/value heads as the sliding layers'
# with their own values; the last 20 (E2B) / 18 (E4B) layers attend over the keys and
# values of the last earlier layer of their kind (E2B's with MLPs twice as wide). Their
# layers run as a list (scan_layers=False). 4.6B / 7.5B parameters (2.3B / 4.6B without
# the per-layer table; the published counts add the vision and audio towers).
_GEMMA4_EDGE = {**_GEMMA4, "k_eq_v": False, "sliding_window": 512,
                "max_position_embeddings": 131_072, "scan_layers": False, "per_layer_dim": 256}
PRESETS["gemma4_e2b"] = ModelConfig(
    d_model=1536, num_layers=35, num_heads=8, num_kv_heads=1, ffn_dim=6144,
    kv_shared_layers=20, kv_shared_wide_mlp=True,
    layer_types=(("sliding_attention",) * 4 + ("full_attention",)) * 7, **_GEMMA4_EDGE)
PRESETS["gemma4_e4b"] = ModelConfig(
    d_model=2560, num_layers=42, num_heads=8, num_kv_heads=2, ffn_dim=10_240,
    kv_shared_layers=18, layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 7,
    **_GEMMA4_EDGE)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
  """Returns a named preset, optionally with fields replaced."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
