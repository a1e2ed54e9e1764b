"""Hugging Face import/export for the causal LMs of `CAUSAL_LMS` (Llama, Mistral, Qwen,
Gemma, ..., and their mixtures of experts), the vision-language folders of
`VISION_LANGUAGE` (whose language model is read alone, and written as its causal LM), and
for the reward models on the same trunks, their *ForSequenceClassification
(`score.weight` [1, D] is the value head, there is no lm_head: `lm_head=False,
value_head=True`). Quantized files are read dequantized (FP8: `fp8`, MXFP4: `mxfp4`,
bitsandbytes: `bnb`).

`from_pretrained` reads a local folder (config.json + *.safetensors, single file or sharded
with an index) and streams one tensor at a time onto its sharding. `save_pretrained` writes
the same layout back, so a round trip is exact. A mixture's experts are one tensor per
expert in the files (as published, and as `transformers` saves them) and one [E, ...]
parameter here. LoRA adapters travel in PEFT's format:
`from_pretrained(..., adapter=folder)` reads one, `save_lora_adapter` writes one; a
reward model's adapter is PEFT's SEQ_CLS kind, its score head saved whole beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from posttrain.models.config import (EXPERT_LORA_TARGETS, GATED_EXPERT_LORA_TARGETS,
                                     LORA_TARGETS, MUP_MULTIPLIERS, PEFT_FUSED_MLP,
                                     PEFT_NO_OUT_PROJ, ModelConfig, RopeConfig)
from posttrain.models import bnb as bnb_lib
from posttrain.models import compressed as compressed_lib
from posttrain.models import fp8 as fp8_lib
from posttrain.models import quant
from posttrain.models import rope as rope_lib
from posttrain.models.factory import abstract_model, state_shardings
from posttrain.models.sharding import DEFAULT_RULES, Rules
from posttrain.models.transformer import (_ATTN_TARGETS, Transformer, _fresh_adapter,
                                          _lora_axes, _owner_path, layer_index, layer_path,
                                          layer_stacks, merge_lora, stack_lora_targets,
                                          value_head_std)

CAUSAL_LMS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
              "MixtralForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
              "MistralForCausalLM", "GptOssForCausalLM", "Olmo2ForCausalLM",
              "Olmo3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM", "Glm4ForCausalLM",
              "Qwen2MoeForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM",
              "DeepseekV2ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
              "Qwen3NextForCausalLM", "MiniMaxM2ForCausalLM", "Llama4ForCausalLM",
              "GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
              "GraniteMoeHybridForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM",
              "FalconH1ForCausalLM", "Lfm2ForCausalLM", "SeedOssForCausalLM",
              "Ministral3ForCausalLM", "OlmoeForCausalLM", "Exaone4ForCausalLM",
              "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", "Glm4MoeLiteForCausalLM",
              "Mistral4ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
              "Dots1ForCausalLM", "ArceeForCausalLM", "ExaoneMoeForCausalLM",
              "MinistralForCausalLM", "HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM",
              "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM", "Gemma4ForCausalLM",
              "ApertusForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM",
              "GlmForCausalLM", "CohereForCausalLM", "HeliumForCausalLM",
              "SolarOpenForCausalLM", "Starcoder2ForCausalLM", "Jais2ForCausalLM",
              "CwmForCausalLM", "YoutuForCausalLM", "FlexOlmoForCausalLM",
              "MellumForCausalLM", "StableLmForCausalLM",
              "Lfm2MoeForCausalLM", "NanoChatForCausalLM", "GPTNeoXForCausalLM",
              "PhiForCausalLM", "NemotronForCausalLM", "GPT2LMHeadModel",
              "OlmoForCausalLM", "FalconForCausalLM", "GPTJForCausalLM", "OPTForCausalLM",
              "GPTBigCodeForCausalLM", "DbrxForCausalLM", "CodeGenForCausalLM",
              "VaultGemmaForCausalLM", "BloomForCausalLM", "MptForCausalLM",
              "GPTNeoForCausalLM", "PhimoeForCausalLM", "Mamba2ForCausalLM",
              "MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM")
# Causal LMs whose family has no *ForSequenceClassification class in transformers.
_NO_CLASSIFIER = ("Glm4MoeForCausalLM", "Qwen3_5MoeForCausalLM", "MiniMaxM2ForCausalLM",
                  "Llama4ForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM",
                  "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM",
                  "BambaForCausalLM", "NemotronHForCausalLM", "FalconH1ForCausalLM",
                  "Mamba2ForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM",
                  "Lfm2ForCausalLM", "OlmoeForCausalLM", "Ernie4_5ForCausalLM",
                  "Ernie4_5_MoeForCausalLM", "Glm4MoeLiteForCausalLM",
                  "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Dots1ForCausalLM",
                  "ExaoneMoeForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM",
                  "Gemma4ForCausalLM", "ApertusForCausalLM", "Cohere2ForCausalLM",
                  "Cohere2MoeForCausalLM", "CohereForCausalLM", "SolarOpenForCausalLM",
                  "Jais2ForCausalLM", "CwmForCausalLM", "YoutuForCausalLM",
                  "FlexOlmoForCausalLM", "MellumForCausalLM", "Lfm2MoeForCausalLM",
                  "DbrxForCausalLM", "CodeGenForCausalLM", "VaultGemmaForCausalLM",
                  "NanoChatForCausalLM")


def _classifier_name(lm: str) -> str:
  # Gemma3ForSequenceClassification (Qwen3_5...) is the vision-language model's; the text
  # one differs.
  if lm in ("Gemma3ForCausalLM", "Qwen3_5ForCausalLM"):
    return lm.replace("ForCausalLM", "TextForSequenceClassification")
  if lm == "GPT2LMHeadModel":
    return "GPT2ForSequenceClassification"
  return lm.replace("ForCausalLM", "ForSequenceClassification")


# A reward model: the causal LM's trunk with a [1, D] score layer in place of lm_head.
SEQUENCE_CLASSIFIERS = {_classifier_name(lm): lm for lm in CAUSAL_LMS
                        if lm not in _NO_CLASSIFIER}
SUPPORTED = CAUSAL_LMS + tuple(SEQUENCE_CLASSIFIERS)
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                "MixtralForCausalLM": "mixtral", "GemmaForCausalLM": "gemma",
                "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                "MistralForCausalLM": "mistral", "GptOssForCausalLM": "gpt_oss",
                "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3",
                "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3",
                "Glm4ForCausalLM": "glm4", "Qwen2MoeForCausalLM": "qwen2_moe",
                "Glm4MoeForCausalLM": "glm4_moe", "DeepseekV3ForCausalLM": "deepseek_v3",
                "DeepseekV2ForCausalLM": "deepseek_v2", "Qwen3_5ForCausalLM": "qwen3_5_text",
                "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
                "Qwen3NextForCausalLM": "qwen3_next", "MiniMaxM2ForCausalLM": "minimax_m2",
                "Llama4ForCausalLM": "llama4_text", "GraniteForCausalLM": "granite",
                "GraniteMoeForCausalLM": "granitemoe",
                "GraniteMoeSharedForCausalLM": "granitemoeshared",
                "GraniteMoeHybridForCausalLM": "granitemoehybrid", "BambaForCausalLM": "bamba",
                "NemotronHForCausalLM": "nemotron_h", "FalconH1ForCausalLM": "falcon_h1",
                "Mamba2ForCausalLM": "mamba2", "MambaForCausalLM": "mamba",
                "FalconMambaForCausalLM": "falcon_mamba", "JambaForCausalLM": "jamba",
                "Lfm2ForCausalLM": "lfm2", "SeedOssForCausalLM": "seed_oss",
                "Ministral3ForCausalLM": "ministral3", "OlmoeForCausalLM": "olmoe",
                "Exaone4ForCausalLM": "exaone4", "Ernie4_5ForCausalLM": "ernie4_5",
                "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
                "Glm4MoeLiteForCausalLM": "glm4_moe_lite", "Mistral4ForCausalLM": "mistral4",
                "DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa",
                "Dots1ForCausalLM": "dots1", "ArceeForCausalLM": "arcee",
                "ExaoneMoeForCausalLM": "exaone_moe", "MinistralForCausalLM": "ministral",
                "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense",
                "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
                "GraniteSWAForCausalLM": "granite_swa",
                "GraniteMoeSWAForCausalLM": "granitemoe_swa",
                "Gemma4ForCausalLM": "gemma4_text", "ApertusForCausalLM": "apertus",
                "Cohere2ForCausalLM": "cohere2", "GlmForCausalLM": "glm",
                "CohereForCausalLM": "cohere", "HeliumForCausalLM": "helium",
                "SolarOpenForCausalLM": "solar_open", "Starcoder2ForCausalLM": "starcoder2",
                "Jais2ForCausalLM": "jais2", "CwmForCausalLM": "cwm",
                "YoutuForCausalLM": "youtu", "FlexOlmoForCausalLM": "flex_olmo",
                "MellumForCausalLM": "mellum", "StableLmForCausalLM": "stablelm",
                "Lfm2MoeForCausalLM": "lfm2_moe", "NanoChatForCausalLM": "nanochat",
                "Cohere2MoeForCausalLM": "cohere2_moe", "GPTNeoXForCausalLM": "gpt_neox",
                "PhiForCausalLM": "phi", "NemotronForCausalLM": "nemotron",
                "GPT2LMHeadModel": "gpt2", "OlmoForCausalLM": "olmo",
                "FalconForCausalLM": "falcon", "GPTJForCausalLM": "gptj",
                "OPTForCausalLM": "opt", "GPTBigCodeForCausalLM": "gpt_bigcode",
                "DbrxForCausalLM": "dbrx", "CodeGenForCausalLM": "codegen",
                "VaultGemmaForCausalLM": "vaultgemma", "BloomForCausalLM": "bloom",
                "MptForCausalLM": "mpt", "GPTNeoForCausalLM": "gpt_neo",
                "PhimoeForCausalLM": "phimoe"}
# gpt-oss: attention sinks, biases on every attention projection, a router bias, experts
# with biases and a clamped SwiGLU, stored stacked ([E, ...], gate and up interleaved),
# sliding-window layers alternating with full ones. transformers' defaults where a
# config.json leaves a field out.
GPT_OSS = "GptOssForCausalLM"
_GPT_OSS_DEFAULTS = dict(
    rope_theta=150_000.0, sliding_window=128, attention_bias=True, swiglu_limit=7.0,
    swiglu_alpha=1.702, rms_norm_eps=1e-5, num_local_experts=128, num_experts_per_tok=4,
    router_aux_loss_coef=0.001, max_position_embeddings=131_072)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}
# OLMo 2 / 3: no input norms, each sublayer's output normed before its residual add, q/k
# norms over every head's features at once, a bias on all four attention projections or
# none; 3 adds sliding-window layers (three to each full one) whose rotary embedding is
# the plain one when the full layers' is scaled. transformers' defaults where a
# config.json leaves a field out. FlexOlmo (FlexOlmoForCausalLM): OLMo 2's layers over
# OLMoE's mixture (softmax routing, every layer).
FLEX_OLMO = "FlexOlmoForCausalLM"
OLMOS = ("Olmo2ForCausalLM", "Olmo3ForCausalLM", FLEX_OLMO)
# OLMo 1 / OLMo 1.7 (OlmoForCausalLM): Llama's layers under LayerNorms with neither weight
# nor bias (eps 1e-5: `ModelConfig.layer_norm` with `norm_weightless`), attention_bias on
# all four projections, q, k and v clamped to [-clip_qkv, clip_qkv] (`clip_qkv`).
OLMO1 = "OlmoForCausalLM"
# Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini: q, k and v in one fused projection (qkv_proj, [q;
# k; v] rows), gate and up in one (gate_up_proj, gate first), LongRoPE (its legacy names
# "su" and "yarn" included, as transformers reads them) and a partial rotary embedding
# (Phi-4-mini rotates 3/4 of each head); a config.json's sliding_window covers every
# layer. Our parameters keep q / k / v and gate / up apart: each is a slice of the
# fused tensor.
PHI3 = "Phi3ForCausalLM"
# SmolLM3: Llama with NoPE layers (no_rope_layers: 1 where a layer rotates; by default
# every fourth does not), and with use_sliding_window a window on the NoPE layers.
SMOLLM3 = "SmolLM3ForCausalLM"
# Seed-OSS (ByteDance Seed-OSS-36B): Llama with biases on q, k and v (attention_bias, on by
# default) and, apart from them, on o_proj (attention_out_bias); its dropouts (training
# only in transformers too) are not applied.
SEED_OSS = "SeedOssForCausalLM"
# Ministral 3 (the text model of Ministral 3 3B / 8B / 14B): Mistral with YaRN and every
# layer's queries scaled up by position past the pre-training context
# (rope_parameters' llama_4_scaling_beta over original_max_position_embeddings:
# ModelConfig.attn_position_scale).
MINISTRAL3 = "Ministral3ForCausalLM"
# The classes whose queries are scaled by position (attn_position_scale).
_POSITION_SCALED = (MINISTRAL3, "Mistral4ForCausalLM")
# OLMoE (AllenAI's OLMoE-1B-7B): Llama's pre-norm layers, q/k norms over every head's
# features at once (OLMo 2's), biases on all four attention projections or none, every
# MLP a mixture (softmax top-k, by default not renormalised) with the experts in Qwen's
# per-expert files; clip_qkv clamps v and the normed q and k (`clip_qkv_after_norm`).
OLMOE = "OlmoeForCausalLM"
# EXAONE 4.0 (LG AI Research): OLMo 2's layout (no input norms, each sublayer's output
# normed before its residual add) with q/k norms per head, no biases, and with a
# sliding_window its layers sliding (layer_types, or every sliding_window_pattern-th one
# full) and only those rotating: the full layers are NoPE.
EXAONE4 = "Exaone4ForCausalLM"
# K-EXAONE (ExaoneMoeForCausalLM, K-EXAONE-236B-A23B): EXAONE 4.0's attention (q/k norms,
# sliding layers rotating and full ones NoPE) in pre-norm layers (OLMoE's), the MLPs
# DeepSeek-V3's mixture (sigmoid routing with a correction bias, groups, shared experts)
# after the dense layers mlp_layer_types names. Its mtp.* tensors are not read.
EXAONE_MOE = "ExaoneMoeForCausalLM"
# Ministral 8B (MinistralForCausalLM, Ministral-8B-Instruct-2410): Mistral with a window
# on the layers layer_types names (by default every layer, as Mistral's).
MINISTRAL = "MinistralForCausalLM"
# Meta's Code World Model (CwmForCausalLM, CWM 32B): Llama with a window (8192) on the
# layers layer_types names (by default three of every four, the first of each four full),
# llama3 rope scaled 16x by default.
CWM = "CwmForCausalLM"
_CWM_DEFAULTS = dict(
    vocab_size=128_256, hidden_size=6144, intermediate_size=21_504, num_hidden_layers=64,
    num_attention_heads=48, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131_072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    sliding_window=8192)
_CWM_ROPE = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0,
             "high_freq_factor": 4.0, "low_freq_factor": 1.0,
             "original_max_position_embeddings": 8192}
# Hunyuan dense (HunYuanDenseV1ForCausalLM: Hunyuan-7B, -4B, -1.8B, -0.5B): Llama with the
# rotated q and k normed per head (query_layernorm / key_layernorm,
# `ModelConfig.qk_norm_after_rope`). Its rope_type "dynamic" with an alpha is NTK's base
# stretched once, theta x alpha^(d / (d - 2)), read as a default rope of that base.
HUNYUAN = "HunYuanDenseV1ForCausalLM"
# Hunyuan MoE (HunYuanMoEV1ForCausalLM, Hunyuan-A13B): the dense model's attention over a
# mixture routed by softmax (the top moe_topk renormalised; its router mlp.gate.wg) beside
# an ungated shared MLP (mlp.shared_mlp), experts and shared MLP both intermediate_size
# wide.
HUNYUAN_MOE = "HunYuanMoEV1ForCausalLM"
_HUNYUANS = (HUNYUAN, HUNYUAN_MOE)
# ERNIE 4.5 (Baidu's dense ERNIE-4.5-0.3B): Llama with an interleaved rotary embedding
# (pairs 2i, 2i + 1, as Llama 4's), tied embeddings by default; use_bias (biases on
# every projection, the MLP's too) is not read.
ERNIE4_5 = "Ernie4_5ForCausalLM"
# ERNIE 4.5's mixtures (ERNIE-4.5-21B-A3B, 300B-A47B): its attention, and from layer
# moe_layer_start_index on a mixture (softmax routing whose choice adds the
# moe_statics' correction bias, `ModelConfig.softmax_correction_bias`; the top-k
# renormalised; ungated shared experts) in per-expert files.
ERNIE4_5_MOE = "Ernie4_5_MoeForCausalLM"
_ERNIES = (ERNIE4_5, ERNIE4_5_MOE)
# Granite 3 (IBM granite-3.x): Llama's layout and names, scaled by four scalars
# (`ModelConfig` embedding_multiplier, residual_multiplier, attention_multiplier,
# logits_scaling); attention_bias covers the output projection too.
GRANITE = "GraniteForCausalLM"
# Granite 3 MoE (granite-3.x-1b-a400m, 3b-a800m): Granite's attention and scalars over
# Mixtral's routing (softmax over the top-k logits), its experts stacked in two tensors:
# input_linear [E, 2F, D] (gate's F rows, then up's) and output_linear [E, D, F].
GRANITE_MOE = "GraniteMoeForCausalLM"
# Granite 4 (granite-4.0-micro, -1b, -350m: GraniteMoeHybridForCausalLM with attention
# layers alone): Granite's scalars, the MLP a shared_mlp (input_linear [2F, D], gate's
# rows then up's; output_linear [D, F]), beside Granite MoE's experts when it has them
# (its shared expert then); rotary or no position embedding at all. The -h- models'
# Mamba2 layers (layer_types "mamba") are linear_attention layers of linear_mixer
# "mamba2" (`Mamba2`): mamba.in_proj's rows [z; x; B; C; dt] and conv1d's channels
# [x; B; C] are kept apart.
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"
# Granite MoE with a shared expert (GraniteMoeSharedForCausalLM): Granite MoE's layers
# and, where shared_intermediate_size > 0, Granite 4's shared_mlp beside the experts.
GRANITE_SHARED = "GraniteMoeSharedForCausalLM"
# Granite "swash" (GraniteSWAForCausalLM, granite-swash-2b): Granite with a learnable
# attention sink per head, a window on the layers layer_types names (by default all but
# every fourth) and a rope base per layer (layer_rope_theta; 0: NoPE), read as one base
# for the full layers and one for the sliding ones (`ModelConfig.rope_local`).
GRANITE_SWA = "GraniteSWAForCausalLM"
# Its mixture (GraniteMoeSWAForCausalLM, granite-swash-3b-a600m): that attention in
# GraniteMoeShared's layers, the experts stacked as transformers 5 holds them
# (block_sparse_moe.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F]) beside
# block_sparse_moe.router.weight.
GRANITE_MOE_SWA = "GraniteMoeSWAForCausalLM"
_SWAS = (GRANITE_SWA, GRANITE_MOE_SWA)
_SHAREDS = (GRANITE_SHARED, GRANITE_MOE_SWA)
GRANITES = (GRANITE, GRANITE_MOE, GRANITE_SHARED, GRANITE_HYBRID, GRANITE_SWA,
            GRANITE_MOE_SWA)
# Bamba (ibm-ai-platform/Bamba-9B): Mamba2 layers with attention layers at
# attn_layer_indices, each beside a Llama MLP (feed_forward; its norm pre_ff_layernorm,
# the last final_layernorm); half of each attention head rotates, as transformers fixes.
BAMBA = "BambaForCausalLM"
# Nemotron-H (NVIDIA Nemotron-H, Nemotron Nano 2): single-sublayer layers
# (`ModelConfig.split_layers`), each a norm and one mixer: Mamba2 ("M",
# linear_attention), attention with no position embedding ("*", full_attention) or an
# MLP without a gate, relu^2 ("-", mlp). Its files name the trunk backbone.* (as the
# published ones do and transformers writes; model.* is read too), a layer's sublayer
# mixer.*, the final norm norm_f. Its mixture layers ("E", Nemotron 3) are not read.
NEMOTRON_H = "NemotronHForCausalLM"
# Mamba2 (Mamba2ForCausalLM: Mamba-Codestral, the state-spaces mamba2 models): layers of a
# norm and a Mamba2 mixer alone, no attention and no MLP (ffn_dim=0: `split_layers` of
# linear_attention layers only), with Nemotron-H's names (backbone.embeddings,
# backbone.layers.N.norm and .mixer.*, backbone.norm_f). Its time step is clipped to
# time_step_limit; residual_in_fp32 keeps the residual stream in float32
# (`ModelConfig.residual_fp32`). Its config's rms_norm and norm_before_gate are not read,
# as transformers reads neither: the output is normed after the gate, per group.
MAMBA2 = "Mamba2ForCausalLM"
# Mamba 1 (MambaForCausalLM: the state-spaces mamba models as transformers holds them)
# and FalconMamba (FalconMambaForCausalLM: Falcon-Mamba-7B, Falcon3-Mamba): Mamba2's
# layout and names with Mamba 1's mixer (`ModelConfig.linear_mixer` "mamba1": in_proj
# [x; z], conv1d over x, x_proj [dt; B; C], dt_proj with its bias, A_log [E, N], D,
# out_proj), FalconMamba's with weightless RMS norms on dt, B and C (mixer_rms_eps). Both
# tie lm_head to the embeddings by default.
MAMBA1 = "MambaForCausalLM"
FALCON_MAMBA = "FalconMambaForCausalLM"
_MAMBA1S = (MAMBA1, FALCON_MAMBA)
# Jamba (JambaForCausalLM: AI21's Jamba, Jamba 1.5 / 1.6 / 1.7 Mini and Large): Mamba 1
# layers (mamba.*: their dt, B and C RMS-normed with weights of their own,
# dt_layernorm / b_layernorm / c_layernorm) with attention without a position embedding
# every attn_layer_period-th layer (from attn_layer_offset), each beside an MLP
# (feed_forward; its norm pre_ff_layernorm, the last final_layernorm) that every
# expert_layer_period-th layer is a mixture (softmax top-k weights left unnormalised,
# feed_forward.router, one tensor per expert in the files).
JAMBA = "JambaForCausalLM"
# The classes whose linear_attention layers are Mamba 1's.
_MAMBA1_CLASSES = _MAMBA1S + (JAMBA,)
# The classes of single-sublayer layers and Nemotron-H's file names.
_BACKBONES = (NEMOTRON_H, MAMBA2) + _MAMBA1S
# Falcon-H1 (tiiuae Falcon-H1, Falcon-H1R): every layer runs attention and a Mamba2 mixer
# side by side on its normed input (`ModelConfig.parallel_mixer`), then a Llama MLP
# (feed_forward; its norm pre_ff_layernorm, the last final_layernorm), all scaled by muP
# multipliers (`ModelConfig`'s fields of the same names; mlp_multipliers and
# ssm_multipliers as mlp_gate_multiplier / mlp_down_multiplier and ssm_multipliers);
# mamba_rms_norm / mamba_norm_before_gate say where the Mamba2 output's norm sits
# (`ModelConfig.linear_norm`).
FALCON_H1 = "FalconH1ForCausalLM"
# transformers' FalconH1Config defaults, where a config.json leaves a field out.
_FALCON_H1_DEFAULTS = dict(
    rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=8192,
    mamba_d_ssm=1024, mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1,
    mamba_d_state=256, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
    mamba_conv_bias=True, mamba_proj_bias=False, mamba_norm_before_gate=True,
    mamba_rms_norm=False, projectors_bias=False, lm_head_multiplier=1.0,
    embedding_multiplier=1.0, key_multiplier=1.0, attention_in_multiplier=1.0,
    attention_out_multiplier=1.0, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0,
    mlp_multipliers=[1.0, 1.0], ssm_multipliers=[1.0] * 5)
# LFM2 (LiquidAI LFM2-350M ... 2.6B): layer_types' "conv" layers are gated short
# convolutions (`ModelConfig.linear_mixer` "short_conv", `ShortConv`: conv.in_proj's rows
# [B; C; x] kept apart), the others attention with per-head q/k norms (q_layernorm,
# k_layernorm) and an output projection named out_proj; each beside a SwiGLU
# feed_forward (w1 gate, w3 up, w2 down; operator_norm and ffn_norm), the last norm
# embedding_norm. Its config.json says norm_eps, conv_L_cache and conv_bias, and the
# MLP's width through block_auto_adjust_ff_dim (read as transformers sizes it; written
# as the size itself). Lfm2MoeForCausalLM (its mixture layers) is not read.
LFM2 = "Lfm2ForCausalLM"
# LFM2-MoE (Lfm2MoeForCausalLM, LFM2-8B-A1B): LFM2's layers, the first num_dense_layers
# with a dense feed_forward of intermediate_size, the rest a mixture: sigmoid scores, the
# top-k chosen by score + expert_bias (a correction bias, with use_expert_bias), the
# chosen scores renormalised (norm_topk_prob) times routed_scaling_factor; its experts'
# w1 / w3 / w2 one tensor each in the files.
LFM2_MOE = "Lfm2MoeForCausalLM"
_LFM2S = (LFM2, LFM2_MOE)
# The classes whose linear_attention layers are Mamba2's (`ModelConfig.linear_mixer`).
_MAMBA2S = (GRANITE_HYBRID, BAMBA, NEMOTRON_H, MAMBA2)
_GRANITE_SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                    "logits_scaling")
# GLM-4 (GLM-4-0414, GLM-Z1): gate and up fused (as Phi-3's), q/k/v biases, a norm on
# each sublayer's input and output (Gemma 2's layout with plain norms), and half of each
# head rotated by an interleaved rotary embedding (features 2i and 2i + 1 pair up). Ours
# is rotate-half: q's and k's rotated features are permuted on load (evens, then odds),
# which turns one into the other and leaves q . k unchanged, and back on export.
GLM4 = "Glm4ForCausalLM"
# GLM-4-9B (GlmForCausalLM, glm-4-9b-chat-hf, glm-4-9b-hf): GLM-4-0414's layers without the
# norms on each sublayer's output (Llama's two norms), as transformers computes it.
GLM = "GlmForCausalLM"
_GLMS = (GLM, GLM4)
_GLM4_DEFAULTS = dict(rms_norm_eps=1.5625e-07, attention_bias=True, partial_rotary_factor=0.5)
# Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases), softmax
# routing, and a shared expert every token runs, scaled by sigmoid(x . w).
QWEN2_MOE = "Qwen2MoeForCausalLM"
# JetBrains' Mellum 2 (MellumForCausalLM): Qwen3-MoE with a window on the layers
# layer_types names (none by default), the sliding layers rotating at their own base
# (rope_parameters by layer type: 500k full, 10k sliding), dense layers where
# mlp_layer_types says (read where they lead). Its mtp.* layer is not read.
MELLUM = "MellumForCausalLM"
_MELLUM_DEFAULTS = dict(
    vocab_size=98_304, hidden_size=2304, intermediate_size=7168, num_hidden_layers=28,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, sliding_window=1024, moe_intermediate_size=896,
    num_experts_per_tok=8, num_local_experts=64, norm_topk_prob=True,
    router_aux_loss_coef=0.001)
# GLM-4.5 / GLM-4.5-Air / GLM-4.6: Llama's block layout, half of each head rotated
# (rotate-half, unlike GLM-4's interleaved pairs), optional q/k norms, the first
# first_k_dense_replace layers dense, then sigmoid routing with a score-correction bias,
# expert groups and a routed scaling factor, plus shared experts. The files' extra
# layers past num_hidden_layers (multi-token prediction) are not read.
GLM4_MOE = "Glm4MoeForCausalLM"
# Upstage's Solar Open (SolarOpenForCausalLM): GLM-4.5's mixture (sigmoid routing with a
# score-correction bias, shared experts) in every layer, under Llama's attention (no q/k
# norms, every feature rotated).
SOLAR_OPEN = "SolarOpenForCausalLM"
_SOLAR_OPEN_DEFAULTS = dict(
    vocab_size=196_608, hidden_size=4096, num_hidden_layers=48, num_attention_heads=64,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131_072, rms_norm_eps=1e-5,
    tie_word_embeddings=False, rope_theta=1_000_000.0, attention_bias=False,
    moe_intermediate_size=1280, num_experts_per_tok=8, n_shared_experts=1,
    n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
    norm_topk_prob=True)
# dots.llm1 (Dots1ForCausalLM): Qwen3's attention (q/k norms per head, every feature
# rotated) over DeepSeek-V3's mixture (sigmoid routing with a correction bias, groups,
# shared experts, first_k_dense_replace dense layers); sliding windows on the layers
# from max_window_layers on (layer_types), none by default.
DOTS1 = "Dots1ForCausalLM"
# Arcee AFM (ArceeForCausalLM, AFM-4.5B): Llama with an MLP of no gate,
# down(relu(up(x))^2) (`ModelConfig.mlp_activation` relu2).
ARCEE = "ArceeForCausalLM"
# Apertus (Swiss AI, ApertusForCausalLM): Llama with q/k norms per head, its norms named
# attention_layernorm / feedforward_layernorm, and an MLP of no gate through xIELU, whose
# two scales each MLP learns (mlp.act_fn.alpha_p / alpha_n) beside fixed buffers
# (beta 0.5, eps -1e-6) (`ModelConfig.mlp_activation` xielu); llama3 rope at base 12M by
# default.
APERTUS = "ApertusForCausalLM"
# Cohere Command R7B / Command A (Cohere2ForCausalLM): each layer x + attn(norm(x)) +
# mlp(norm(x)) under one LayerNorm without bias (`ModelConfig.parallel_residual`,
# `layer_norm`), three sliding layers (rotary, interleaved pairs: reordered on load) to a
# full one without a position embedding, heads splitting hidden_size evenly, the logits
# times logit_scale (our lm_head_multiplier).
COHERE2 = "Cohere2ForCausalLM"
# Cohere Command R / R+ / Aya Expanse / Aya 23 (CohereForCausalLM): Command R7B's parallel
# layers under one bias-free LayerNorm, every layer rotating (interleaved pairs), biases
# on all four attention projections with attention_bias; with use_qk_norm (Command R+)
# q and k LayerNorm-ed per head, each head its own weight (`qk_norm_head_weights`).
COHERE = "CohereForCausalLM"
# Kyutai's Helium (HeliumForCausalLM): Llama rotating interleaved pairs (reordered on
# load), heads splitting hidden_size evenly (its o_proj is [D, D]).
HELIUM = "HeliumForCausalLM"
# StarCoder2 (Starcoder2ForCausalLM): Mistral's attention (a window on every layer where
# sliding_window is set) under LayerNorms with biases, an MLP of no gate, c_proj(gelu_tanh(
# c_fc(x))), use_bias putting biases on all four attention projections and both of the
# MLP's. Jais 2 (Jais2ForCausalLM): Llama's attention (attention_bias: all four) under
# LayerNorms with biases, an MLP of no gate, down(relu(up(x))^2), with mlp_bias's biases.
STARCODER2 = "Starcoder2ForCausalLM"
# StableLM 2 (StableLmForCausalLM): LayerNorms with biases, a quarter of each head
# rotated (rotate-half), q/k/v biases with use_qkv_bias, an o_proj of [D, D]; with
# qk_layernorm q and k LayerNorm-ed per head, each its own weight (one tensor a head in
# the files); with use_parallel_residual x + attn(norm(x)) + mlp(norm(x)).
STABLELM = "StableLmForCausalLM"
# nanochat (NanoChatForCausalLM): every norm x / rms(x) with no weight
# (`ModelConfig.norm_weightless`), the embeddings normed so before the first layer
# (`embed_norm`), q and k normed so after their rotation (`qk_l2_norm`), which turns each
# head the other way (rotate_half as cat(x2, -x1): held as ours over q's and k's halves
# swapped, `_swapped_rows`), an MLP of no gate fc2(relu(fc1(x))^2), the logits soft-capped.
NANOCHAT = "NanoChatForCausalLM"
JAIS2 = "Jais2ForCausalLM"
# Nemotron-4 / Minitron (NemotronForCausalLM): Jais 2's layers under LayerNorm1P (a
# LayerNorm with a bias whose weight is held less one: `ModelConfig.norm_unit_offset`),
# half of each head rotated by default, attention_bias on all four projections.
NEMOTRON = "NemotronForCausalLM"
_PLAIN_MLPS = (STARCODER2, JAIS2, NEMOTRON)
# GPT-NeoX-20B / Pythia (GPTNeoXForCausalLM): LayerNorms with biases, a quarter of each
# head rotated (rotary_pct, rotate-half) at base rotary_emb_base, q, k and v fused in one
# query_key_value head by head (`_gpt_neox_rows`), biases on all four attention
# projections (attention_bias) and on both of its MLP's, which has no gate:
# dense_4h_to_h(gelu(dense_h_to_4h(x))) (Pythia's exact GELU, GPT-NeoX-20B's gelu_fast);
# with use_parallel_residual (its default) x + attn(norm1(x)) + mlp(norm2(x))
# (`ModelConfig.parallel_mlp_norm`), else Llama's sequential layers. Its own tensor names
# (gpt_neox.embed_in, gpt_neox.layers.N.attention.dense, embed_out, ...).
GPT_NEOX = "GPTNeoXForCausalLM"
# Falcon 7B / 40B / 180B / Falcon 2 (FalconForCausalLM): LayerNorms with biases, an MLP of
# no gate dense_4h_to_h(gelu(dense_h_to_4h(x))), bias on every projection or none; with
# parallel_attn attention and MLP side by side under one norm (input_layernorm) or, in
# the new decoder architecture, under one each (ln_attn, ln_mlp:
# `ModelConfig.parallel_mlp_norm`); q, k and v fused in query_key_value by key/value
# head (`_grouped_qkv_part`): each group's query heads, its key, its value (one group:
# Falcon-7B's multi_query; a group a head: neither). Its own tensor names
# (transformer.word_embeddings, transformer.h.N.self_attention.dense, ...). Falcon-RW's
# alibi: ALiBi's biases in place of a rotary embedding, scaled with the logits
# (`ModelConfig.alibi_scaled`).
FALCON = "FalconForCausalLM"
# BLOOM / BLOOMZ (BloomForCausalLM, 560M to 176B): ALiBi (`ModelConfig.alibi`) in place of
# any position embedding, a LayerNorm on the embeddings (word_embeddings_layernorm:
# `embed_norm`), Falcon's names and per-head query_key_value, biases everywhere, an MLP
# of no gate dense_4h_to_h(gelu_tanh(dense_h_to_4h(x))) 4 x hidden_size wide.
BLOOM = "BloomForCausalLM"
# MPT (MptForCausalLM, MPT-7B / 30B): ALiBi (its attn_config's alibi_bias_max), LayerNorms
# without biases, no biases anywhere, q, k and v in one Wqkv ([q; k; v]) clamped by
# clip_qkv, an MLP of no gate down_proj(gelu(up_proj(x))) 4 x d_model wide; a nested
# attn_config and its own names (transformer.blocks.N.attn.Wqkv, ...).
MPT = "MptForCausalLM"
# GPT-Neo (GPTNeoForCausalLM: GPT-Neo 125M to 2.7B, the TinyStories models): GPT-2's
# learned positions and LayerNorms, its global layers alternating with local ones (a
# window of window_size keys: `layer_types`, `sliding_window`), logits not scaled by
# 1 / sqrt(head_dim) (query_pre_attn_scalar 1), q, k and v without biases beside an
# out_proj with one, an MLP of no gate c_proj(gelu_new(c_fc(x))); its own tensor names
# (transformer.h.N.attn.attention.q_proj, ...).
GPT_NEO = "GPTNeoForCausalLM"
# Phi-3.5-MoE (PhimoeForCausalLM): Mixtral's mixture and files routed by sparsemixer
# (`ModelConfig.router_scoring`, router_jitter_noise its band), LayerNorms with biases,
# biases on every attention projection (attention_bias) and on the output projection
# (lm_head_bias), LongRoPE whose short_mscale / long_mscale scale cos and sin (one value
# for both: `RopeConfig.attention_factor`).
PHIMOE = "PhimoeForCausalLM"
# Phi-1 / Phi-1.5 / Phi-2 (PhiForCausalLM): each layer x + attn(norm(x)) + mlp(norm(x))
# under one LayerNorm with a bias (`ModelConfig.parallel_residual`), half of each head
# rotated by default (Phi-2: 0.4), biases on all four attention projections (o_proj
# named dense) and on its MLP's, which has no gate: fc2(gelu_new(fc1(x))), the final norm
# model.final_layernorm, and a bias on the output projection (`lm_head_bias`).
PHI = "PhiForCausalLM"
# GPT-2 (GPT2LMHeadModel): a learned absolute position embedding (wpe,
# `ModelConfig.learned_positions`) and no rotary one, LayerNorms with biases, q, k and v
# in one c_attn, biases on every projection, an MLP of no gate c_proj(gelu_new(c_fc(x))),
# its projections torch Conv1D's ([in, out], the transpose of a Linear's), tied
# embeddings by default; its own names (transformer.wte, transformer.h.N.attn.c_attn,
# ...; its oldest files without the transformer. prefix, beside attention-mask buffers).
GPT2 = "GPT2LMHeadModel"
# GPT-J (GPTJForCausalLM): attention and MLP side by side under one LayerNorm with a
# bias, the first rotary_dim features of each head rotated by interleaved pairs (at base
# 10000, reordered on load), no attention biases, an MLP of no gate
# fc_out(gelu_new(fc_in(x))) with biases, and a bias on the output projection
# (`lm_head_bias`); GPT-2's config keys and its own tensor names (transformer.h.N.attn
# .out_proj, ...).
GPTJ = "GPTJForCausalLM"
# CodeGen (CodeGenForCausalLM): GPT-J with q, k and v in one qkv_proj, interleaved across
# the four model-parallel shards it was trained on (`_codegen_rows`).
CODEGEN = "CodeGenForCausalLM"
_GPTJS = (GPTJ, CODEGEN)
# StarCoder 1 / SantaCoder / WizardCoder / OctoCoder (GPTBigCodeForCausalLM): GPT-2's layers
# and learned positions, its projections Linear's, q, k and v fused in c_attn as
# Falcon's query_key_value (`_grouped_qkv_part`): multi_query's one key/value head
# after the queries, else a head's q, k and v together; gelu_pytorch_tanh.
GPT_BIGCODE = "GPTBigCodeForCausalLM"
# DBRX (DbrxForCausalLM): LayerNorms without biases, q, k and v in one Wqkv ([q; k; v])
# clamped to [-clip_qkv, clip_qkv], grouped keys, a mixture in every layer (softmax over
# the experts, the top-k weights over their sum with moe_normalize_expert_weights 1, as
# they are with none), each of the experts' gate (w1), up (v1) and down (w2) projections
# one tensor [E F, D] for all; a nested config.json (attn_config, ffn_config) and its own
# tensor names (transformer.blocks.N.norm_attn_norm.attn.Wqkv, ...).
DBRX = "DbrxForCausalLM"
# OPT (OPTForCausalLM, 125M to 66B): GPT-2's learned positions (its table's first two
# rows unread: `ModelConfig.position_offset`), LayerNorms with biases (neither weight nor
# bias without layer_norm_elementwise_affine), enable_bias on every projection, an MLP of
# no gate fc2(relu(fc1(x))); its own tensor names (model.decoder.layers.N
# .self_attn_layer_norm, ...). OPT-350m's post-norm layers and narrower embeddings are
# refused.
OPT = "OPTForCausalLM"
# These classes' hidden_act -> our mlp_activation (gelu_fast, gelu_new: tanh's
# approximation).
_UNGATED_GELUS = {"gelu": "gelu_ungated", "gelu_fast": "gelu_tanh_ungated",
                  "gelu_new": "gelu_tanh_ungated", "gelu_pytorch_tanh": "gelu_tanh_ungated"}
# Classes with LayerNorms with biases and an MLP of no gate through a GELU (`_UNGATED_GELUS`).
_UNGATED_GELU_CLASSES = (GPT_NEOX, PHI, GPT2, FALCON, GPT_BIGCODE, BLOOM, MPT,
                         GPT_NEO) + _GPTJS
# Cohere2-MoE: Cohere2's layers over a mixture (its router's softmax over the top-k logits,
# or their sigmoids, renormalised with norm_topk_prob; one tensor per expert, as
# transformers saves them, or stacked), leading dense layers (first_k_dense_replace:
# mlp_layer_types, of prefix_dense_intermediate_size) whose own sliding pattern of 1
# makes them full layers that rotate, shared experts summed or averaged with the routed
# ones; an RMSNorm where the file gives rms_norm_eps, else Cohere's LayerNorm.
COHERE2_MOE = "Cohere2MoeForCausalLM"
_COHERES = (COHERE2, COHERE2_MOE)
_APERTUS_DEFAULTS = dict(rms_norm_eps=1e-5, max_position_embeddings=65_536,
                         attention_bias=False, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 12_000_000.0,
                                          "factor": 8.0, "original_max_position_embeddings": 8192,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0})
_DOTS1_DEFAULTS = dict(rms_norm_eps=1e-6, n_group=1, topk_group=1, first_k_dense_replace=0,
                       norm_topk_prob=False, routed_scaling_factor=1.0,
                       sliding_window=4096, max_window_layers=62, attention_bias=False,
                       max_position_embeddings=2048, tie_word_embeddings=False)
# DeepSeek-V3 / R1, Kimi K2, Moonlight: GLM-4.5's mixture (sigmoid group routing, shared
# experts, leading dense layers) under multi-head latent attention (`ModelConfig`
# kv_lora_rank): q (through its own latent, q_lora_rank) and the keys' shared rotated part
# (the last qk_rope_head_dim rows of kv_a_proj_with_mqa) hold their rotated features as
# interleaved pairs (rope_interleave), reordered on load as GLM-4's are; ours put the
# rotated part first in each head (k = [rotated, unrotated]), which leaves q . k as it is.
# kv_b_proj's rows per head, keys' unrotated features then values, split into k_b_proj
# and v_b_proj. YaRN's mscale_all_dim scales the softmax (`ModelConfig.attention_scale`).
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
_DEEPSEEK_V3_DEFAULTS = dict(
    rms_norm_eps=1e-6, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
    kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
    rope_interleave=True, attention_bias=False, moe_intermediate_size=2048)
# DeepSeek-V2 / V2-Lite / Coder-V2: V3's latent attention (rotated pairs interleaved) and
# mixture layout, routed by softmax: greedy top-k, or group_limited_greedy among the
# best groups by their best probability; the chosen probabilities, unnormalised (the
# class ignores norm_topk_prob), times routed_scaling_factor.
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
_DEEPSEEK_V2_DEFAULTS = dict(
    rms_norm_eps=1e-6, first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536,
    n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64,
    routed_scaling_factor=1.0, topk_method="greedy", v_head_dim=128,
    moe_intermediate_size=1407, max_position_embeddings=2048, attention_bias=False)
# GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's latent attention and mixture
# (sigmoid group routing with a correction bias, shared experts) under GLM's defaults;
# mlp_layer_types names each layer's MLP, its dense ones a leading run (read as
# first_k_dense_replace). The files' layers past num_hidden_layers (multi-token
# prediction) are not read.
GLM4_MOE_LITE = "Glm4MoeLiteForCausalLM"
_GLM4_MOE_LITE_DEFAULTS = dict(
    rms_norm_eps=1e-5, n_shared_experts=1, n_routed_experts=64, routed_scaling_factor=1.8,
    kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=256,
    qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4,
    norm_topk_prob=True, max_position_embeddings=202_752, rope_interleave=True,
    attention_bias=False, moe_intermediate_size=1536, tie_word_embeddings=False)
# Mistral Small 4 (Mistral4ForCausalLM): DeepSeek-V3's latent attention with every
# layer's queries scaled up by position (Ministral 3's llama_4_scaling_beta,
# `ModelConfig.attn_position_scale`), and a mixture routed by softmax: the top-k
# probabilities, renormalised with norm_topk_prob, times routed_scaling_factor, beside
# shared experts, after first_k_dense_replace dense layers. Its experts are stacked as
# transformers 5 holds them ([E, 2F, D] gate_up_proj, [E, D, F] down_proj). Expert groups
# (n_group > 1, each ranked by its two best probabilities) are not read.
MISTRAL4 = "Mistral4ForCausalLM"
_MISTRAL4_DEFAULTS = dict(
    rms_norm_eps=1e-6, n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0,
    kv_lora_rank=256, q_lora_rank=1024, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=64, n_group=1, topk_group=1, num_experts_per_tok=4,
    first_k_dense_replace=0, norm_topk_prob=True, max_position_embeddings=1_048_576,
    rope_interleave=True, attention_bias=False, moe_intermediate_size=2048,
    tie_word_embeddings=False)
# transformers' Mistral4Config rope_parameters where a config.json has none.
_MISTRAL4_ROPE = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 128.0,
                  "original_max_position_embeddings": 8192, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                  "llama_4_scaling_beta": 0.1}
# DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3's
# latent attention and mixture (GLM-5's dense layers named by mlp_layer_types) under
# DeepSeek Sparse Attention (`ModelConfig.index_topk`): each layer's lightning indexer
# (self_attn.indexer: wq_b over the query latent, wk and a LayerNorm k_norm, weights_proj)
# picks the index_topk keys each query attends to. Its queries' and keys' first
# qk_rope_head_dim features are rotated, rotate-half in V3.2 and as interleaved pairs in
# GLM-5 (reordered on load, as the attention's are). GLM-5 layers that reuse another
# layer's choice (indexer_types "shared") are not read. Layers past num_hidden_layers
# (multi-token prediction) are not read.
DEEPSEEK_V32 = "DeepseekV32ForCausalLM"
GLM_MOE_DSA = "GlmMoeDsaForCausalLM"
_DEEPSEEK_V32_DEFAULTS = dict(_DEEPSEEK_V3_DEFAULTS, index_topk=2048, index_head_dim=128,
                              index_n_heads=64, max_position_embeddings=163_840)
_GLM_MOE_DSA_DEFAULTS = dict(
    rms_norm_eps=1e-5, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
    kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256,
    qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=202_752,
    rope_interleave=True, attention_bias=False, moe_intermediate_size=2048,
    tie_word_embeddings=False, index_topk=2048, index_head_dim=128, index_n_heads=32)
# The classes with DeepSeek Sparse Attention, and their indexers' rotary layout.
_SPARSE_ATTENTION = (DEEPSEEK_V32, GLM_MOE_DSA)
# The classes with DeepSeek's multi-head latent attention.
# Tencent's Youtu-LLM (YoutuForCausalLM, Youtu-LLM-2B): DeepSeek-V3's latent attention
# (rotated pairs interleaved) over a dense SwiGLU MLP in every layer.
YOUTU = "YoutuForCausalLM"
_YOUTU_DEFAULTS = dict(
    vocab_size=128_256, hidden_size=2048, intermediate_size=6144, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_theta=10_000.0, attention_bias=False)
_DEEPSEEKS = (DEEPSEEK_V3, DEEPSEEK_V2, GLM4_MOE_LITE, MISTRAL4, YOUTU) + _SPARSE_ATTENTION
# Their classes whose mixtures route as DeepSeek-V3's (sigmoid, groups, correction bias).
_V3_ROUTED = (DEEPSEEK_V3, GLM4_MOE_LITE) + _SPARSE_ATTENTION
_GLM4_MOE_DEFAULTS = dict(rms_norm_eps=1e-5, partial_rotary_factor=0.5, n_shared_experts=1,
                          n_routed_experts=128, routed_scaling_factor=1.0, n_group=1,
                          topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                          use_qk_norm=False, attention_bias=False,
                          max_position_embeddings=131_072)
# Qwen3.5 (and its text model alone, Qwen3_5ForCausalLM): three Gated DeltaNet layers
# (`ModelConfig` linear_*: a recurrent state in place of a KV cache) to each full-attention
# layer, whose output is gated by a second half of q_proj (attn_output_gate: each head's
# rows are [queries; gate]); (1 + w) norms, q/k norms, a quarter of each head rotated.
QWEN3_5 = "Qwen3_5ForCausalLM"
# Qwen3.5-MoE: Qwen3.5's layers with Qwen2-MoE's mixture (softmax top-k, renormalised, and
# a shared expert scaled by sigmoid(x . w)) in every layer.
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
# Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5-MoE's layers, its Gated DeltaNet projections
# fused per key head (in_proj_qkvz: each key head's q, k, then its value heads' v and z;
# in_proj_ba: their b, then a), the mixture's norm_topk_prob read from config.json.
QWEN3_NEXT = "Qwen3NextForCausalLM"
_QWEN3_5S = (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT)
# MiniMax-M2 (and later releases of its class): Mixtral's files (block_sparse_moe, w1 /
# w3 / w2 per expert) routed by sigmoid scores, the top-k chosen on the scores plus an
# e_score_correction_bias kept beside the gate, weighted by the chosen scores renormalised;
# no shared expert; q/k norms over every head's features at once (OLMo 2's); part of each
# head rotated (the published config.json's rotary_dim, transformers 5's
# partial_rotary_factor). The published config.json's own keys (use_qk_norm, scoring_func,
# ...) are read where they name this computation and refused where they name another.
MINIMAX_M2 = "MiniMaxM2ForCausalLM"
_MINIMAX_M2_DEFAULTS = dict(
    rms_norm_eps=1e-6, head_dim=128, rope_theta=5_000_000.0, intermediate_size=1536,
    num_local_experts=256, num_experts_per_tok=8, max_position_embeddings=196_608)
# Llama 4 (Scout, Maverick; the text model of Llama4ForConditionalGeneration): every
# layer's MLP a mixture of experts routed top-1 by sigmoid scores, the chosen expert's
# input (not its output) scaled by its score, plus a shared expert every token runs; the
# rotary layers' q and k normed without a weight after an interleaved rotary embedding
# (reordered on load as GLM-4's) and attending within chunks of attention_chunk_size
# positions (ours: sliding layers whose window is the chunk); every fourth layer NoPE,
# attending to the whole context with its queries scaled up by position
# (attn_temperature_tuning). Maverick's dense layers between the mixture layers
# (interleave_moe_layer_step 2) are read as moe_layer_step.
LLAMA4 = "Llama4ForCausalLM"
_LLAMA4_DEFAULTS = dict(
    vocab_size=202_048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16_384,
    num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-5, max_position_embeddings=131_072, rope_theta=500_000.0,
    num_experts_per_tok=1, num_local_experts=16, interleave_moe_layer_step=1,
    use_qk_norm=True, no_rope_layer_interval=4, attention_chunk_size=8192,
    attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
    tie_word_embeddings=False, attention_bias=False)
_QWEN3_5_DEFAULTS = dict(
    rms_norm_eps=1e-6, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    max_position_embeddings=32_768, attention_bias=False, tie_word_embeddings=False)
# transformers' defaults of these classes' fields that a config.json may leave out.
_CLASS_DEFAULTS = {
    PHIMOE: dict(vocab_size=32_064, hidden_size=4096, intermediate_size=6400,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=131_072, rms_norm_eps=1e-5, rope_theta=1_000_000.0,
                 tie_word_embeddings=False, num_experts_per_tok=2, num_local_experts=16,
                 router_jitter_noise=0.01, attention_bias=False, lm_head_bias=False),
    FALCON_H1: _FALCON_H1_DEFAULTS, GPT_OSS: _GPT_OSS_DEFAULTS, GLM4: _GLM4_DEFAULTS,
    GLM: _GLM4_DEFAULTS, APERTUS: _APERTUS_DEFAULTS,
    STARCODER2: dict(vocab_size=49_152, hidden_size=3072, intermediate_size=12_288,
                     num_hidden_layers=30, num_attention_heads=24, num_key_value_heads=2,
                     max_position_embeddings=4096, norm_epsilon=1e-5, rope_theta=10_000.0,
                     use_bias=True, tie_word_embeddings=True),
    NEMOTRON: dict(vocab_size=256_000, hidden_size=6144, intermediate_size=24_576,
                   num_hidden_layers=32, num_attention_heads=48, max_position_embeddings=4096,
                   norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                   mlp_bias=False),
    JAIS2: dict(vocab_size=150_272, hidden_size=3328, intermediate_size=26_624,
                num_hidden_layers=32, num_attention_heads=26, max_position_embeddings=8192,
                layer_norm_eps=1e-5, rope_theta=10_000.0, attention_bias=True, mlp_bias=True,
                head_dim=128, tie_word_embeddings=False),
    CWM: _CWM_DEFAULTS, YOUTU: _YOUTU_DEFAULTS, MELLUM: _MELLUM_DEFAULTS,
    GPT_NEOX: dict(vocab_size=50_432, hidden_size=6144, num_hidden_layers=44,
                   num_attention_heads=64, intermediate_size=24_576, hidden_act="gelu",
                   max_position_embeddings=2048, layer_norm_eps=1e-5,
                   tie_word_embeddings=False, use_parallel_residual=True,
                   attention_bias=True),
    FALCON: dict(vocab_size=65_024, hidden_size=4544, num_hidden_layers=32,
                 num_attention_heads=71, num_ln_in_parallel_attn=None, layer_norm_epsilon=1e-5,
                 num_kv_heads=None, alibi=False, new_decoder_architecture=False,
                 multi_query=True, parallel_attn=True, bias=False,
                 max_position_embeddings=2048, ffn_hidden_size=None, activation="gelu",
                 tie_word_embeddings=True),
    BLOOM: dict(vocab_size=250_880, hidden_size=64, n_layer=2, n_head=8,
                layer_norm_epsilon=1e-5, apply_residual_connection_post_layernorm=False,
                pretraining_tp=1, slow_but_exact=False, tie_word_embeddings=True),
    MPT: dict(d_model=2048, n_heads=16, n_layers=24, expansion_ratio=4, max_seq_len=2048,
              vocab_size=50_368, layer_norm_epsilon=1e-5, no_bias=True, attn_config=None,
              tie_word_embeddings=True),
    GPT_NEO: dict(vocab_size=50_257, max_position_embeddings=2048, hidden_size=2048,
                  num_layers=24, attention_types=[[["global", "local"], 12]], num_heads=16,
                  intermediate_size=None, window_size=256, activation_function="gelu_new",
                  layer_norm_epsilon=1e-5, tie_word_embeddings=True),
    OLMO1: dict(vocab_size=50_304, hidden_size=4096, intermediate_size=11_008,
                num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                tie_word_embeddings=False, attention_bias=False, clip_qkv=None),
    OPT: dict(vocab_size=50_272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072,
              max_position_embeddings=2048, do_layer_norm_before=True,
              _remove_final_layer_norm=False, word_embed_proj_dim=None,
              num_attention_heads=12, activation_function="relu", enable_bias=True,
              layer_norm_elementwise_affine=True, tie_word_embeddings=True),
    DBRX: dict(d_model=2048, n_heads=16, n_layers=24, max_seq_len=2048, vocab_size=32_000,
               tie_word_embeddings=False),
    GPT_BIGCODE: dict(vocab_size=50_257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                      n_inner=None, activation_function="gelu_pytorch_tanh",
                      layer_norm_epsilon=1e-5, scale_attn_weights=True, multi_query=True,
                      add_cross_attention=False, tie_word_embeddings=True),
    CODEGEN: dict(vocab_size=50_400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16,
                  rotary_dim=64, n_inner=None, activation_function="gelu_new",
                  layer_norm_epsilon=1e-5, tie_word_embeddings=False),
    GPTJ: dict(vocab_size=50_400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16,
               rotary_dim=64, n_inner=None, activation_function="gelu_new",
               layer_norm_epsilon=1e-5, tie_word_embeddings=False),
    GPT2: dict(vocab_size=50_257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
               n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
               tie_word_embeddings=True, scale_attn_weights=True,
               scale_attn_by_inverse_layer_idx=False, add_cross_attention=False),
    PHI: dict(vocab_size=51_200, hidden_size=2048, intermediate_size=8192,
              num_hidden_layers=24, num_attention_heads=32, hidden_act="gelu_new",
              max_position_embeddings=2048, layer_norm_eps=1e-5, tie_word_embeddings=False,
              qk_layernorm=False),
    NANOCHAT: dict(vocab_size=50_304, hidden_size=768, intermediate_size=8192,
                   num_hidden_layers=12, num_attention_heads=6, num_key_value_heads=6,
                   max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10_000.0,
                   final_logit_softcapping=15.0, attention_bias=False,
                   tie_word_embeddings=False),
    STABLELM: dict(vocab_size=50_304, hidden_size=2560, intermediate_size=6912,
                   num_hidden_layers=32, num_attention_heads=32,
                   max_position_embeddings=4096, layer_norm_eps=1e-5, rope_theta=10_000.0,
                   use_qkv_bias=False, qk_layernorm=False, use_parallel_residual=False,
                   tie_word_embeddings=False),
    HELIUM: dict(vocab_size=48_000, hidden_size=2560, intermediate_size=7040,
                 num_hidden_layers=24, num_attention_heads=20, num_key_value_heads=20,
                 head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-8,
                 rope_theta=100_000.0, tie_word_embeddings=False, attention_bias=False),
    COHERE: dict(layer_norm_eps=1e-5, logit_scale=0.0625, max_position_embeddings=8192,
                 tie_word_embeddings=True, attention_bias=False, use_qk_norm=False,
                 rope_theta=500_000.0, vocab_size=256_000),
    COHERE2: dict(layer_norm_eps=1e-5, logit_scale=0.0625, sliding_window=4096,
                  max_position_embeddings=8192, tie_word_embeddings=True,
                  attention_bias=False),
    COHERE2_MOE: dict(layer_norm_eps=1e-5, logit_scale=0.0625, sliding_window=4096,
                      max_position_embeddings=8192, tie_word_embeddings=True,
                      attention_bias=False, head_dim=128, num_experts=8,
                      num_experts_per_tok=2, num_shared_experts=0,
                      shared_expert_combination_strategy="average",
                      expert_selection_fn="softmax", norm_topk_prob=True,
                      prefix_dense_sliding_window_pattern=1, sliding_window_pattern=4,
                      rms_norm_eps=None),
    GLM4_MOE: _GLM4_MOE_DEFAULTS, DOTS1: _DOTS1_DEFAULTS, SOLAR_OPEN: _SOLAR_OPEN_DEFAULTS,
    DEEPSEEK_V3: _DEEPSEEK_V3_DEFAULTS, DEEPSEEK_V2: _DEEPSEEK_V2_DEFAULTS,
    GLM4_MOE_LITE: _GLM4_MOE_LITE_DEFAULTS, MISTRAL4: _MISTRAL4_DEFAULTS,
    DEEPSEEK_V32: _DEEPSEEK_V32_DEFAULTS, GLM_MOE_DSA: _GLM_MOE_DSA_DEFAULTS,
    QWEN3_5: _QWEN3_5_DEFAULTS, MINIMAX_M2: _MINIMAX_M2_DEFAULTS, LLAMA4: _LLAMA4_DEFAULTS,
    QWEN3_5_MOE: {**_QWEN3_5_DEFAULTS, "num_experts": 256, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                  "router_aux_loss_coef": 0.001},
    QWEN3_NEXT: {**_QWEN3_5_DEFAULTS, "num_experts": 512, "num_experts_per_tok": 10,
                 "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                 "router_aux_loss_coef": 0.001, "norm_topk_prob": True,
                 "intermediate_size": 5632},
    QWEN2_MOE: dict(qkv_bias=True, norm_topk_prob=False, max_position_embeddings=32_768),
    "Olmo2ForCausalLM": dict(rms_norm_eps=1e-5, max_position_embeddings=2048,
                             rope_theta=10_000.0),
    FLEX_OLMO: dict(vocab_size=100_352, hidden_size=4096, intermediate_size=11_008,
                    num_hidden_layers=32, num_attention_heads=32,
                    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500_000.0,
                    tie_word_embeddings=False, attention_bias=False, num_experts=7,
                    num_experts_per_tok=5, norm_topk_prob=False, router_aux_loss_coef=0.01),
    "Olmo3ForCausalLM": dict(rms_norm_eps=1e-5, max_position_embeddings=2048,
                             rope_theta=500_000.0, sliding_window=4096),
    ERNIE4_5: dict(rms_norm_eps=1e-5, max_position_embeddings=131_072, head_dim=128,
                   rope_theta=500_000.0, tie_word_embeddings=True, use_bias=False),
    ERNIE4_5_MOE: dict(rms_norm_eps=1e-5, max_position_embeddings=131_072,
                       rope_theta=500_000.0, tie_word_embeddings=True, use_bias=False,
                       moe_intermediate_size=1536, moe_k=6, moe_num_experts=64,
                       moe_num_shared_experts=2, moe_layer_start_index=1,
                       moe_layer_end_index=-1, moe_layer_interval=1,
                       router_aux_loss_coef=0.001),
    EXAONE4: dict(rms_norm_eps=1e-5, max_position_embeddings=2048, sliding_window=4096,
                  sliding_window_pattern=4, tie_word_embeddings=False),
    EXAONE_MOE: dict(rms_norm_eps=1e-5, max_position_embeddings=2048, sliding_window=4096,
                     sliding_window_pattern=4, tie_word_embeddings=False,
                     first_k_dense_replace=1, num_shared_experts=1, norm_topk_prob=True,
                     routed_scaling_factor=2.5, n_group=1, topk_group=1),
    OLMOE: dict(rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10_000.0,
                num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                router_aux_loss_coef=0.01, attention_bias=False, tie_word_embeddings=False),
    MINISTRAL3: dict(rms_norm_eps=1e-5, max_position_embeddings=262_144, head_dim=128,
                     tie_word_embeddings=False),
    SEED_OSS: dict(attention_bias=True, attention_out_bias=False, head_dim=128,
                   rms_norm_eps=1e-6, max_position_embeddings=524_288)}
# Gemma: (1 + w) norms, sqrt(D)-scaled embeddings, GeGLU; 2 and 3 add sandwich norms,
# query_pre_attn_scalar, soft caps (2) and sliding-window layers; 3 adds q/k norms and a
# rotary embedding of its own for the sliding layers. VaultGemma (VaultGemmaForCausalLM):
# Gemma 2 without its norms of the sublayers' outputs (input_layernorm and
# pre_feedforward_layernorm alone).
VAULTGEMMA = "VaultGemmaForCausalLM"
GEMMAS = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", VAULTGEMMA)
_SANDWICHED = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_GEMMA2S = _SANDWICHED + (VAULTGEMMA,)  # Gemma 2's options: soft caps, windows, scalar
# Classes whose config keys transformers also reads under Llama's names (attribute_map;
# where a config.json says both, Llama's name wins): Llama's name -> the class's own.
_GPT2_KEYS = {"hidden_size": "n_embd", "num_attention_heads": "n_head",
              "num_hidden_layers": "n_layer", "max_position_embeddings": "n_positions"}
_CONFIG_ALIASES = {GPT2: _GPT2_KEYS, GPTJ: _GPT2_KEYS, CODEGEN: _GPT2_KEYS,
                   GPT_BIGCODE: _GPT2_KEYS,
                   BLOOM: {"num_attention_heads": "n_head", "num_hidden_layers": "n_layer"},
                   GPT_NEO: {"num_attention_heads": "num_heads",
                             "num_hidden_layers": "num_layers"},
                   MPT: {"hidden_size": "d_model", "num_attention_heads": "n_heads",
                         "num_hidden_layers": "n_layers"},
                   DBRX: {"hidden_size": "d_model", "num_attention_heads": "n_heads",
                          "num_hidden_layers": "n_layers",
                          "max_position_embeddings": "max_seq_len"}}
_CLASS_DEFAULTS[JAMBA] = dict(
    vocab_size=65_536, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=262_144, num_experts=16,
    num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
    attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4,
    mamba_expand=2, mamba_dt_rank="auto", mamba_conv_bias=True, mamba_proj_bias=False,
    pad_token_id=0)
_CLASS_DEFAULTS[VAULTGEMMA] = dict(
    vocab_size=256_000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    tie_word_embeddings=True, attention_bias=False)
# HF's defaults where a config.json leaves a Gemma field out.
_GEMMA_DEFAULTS = {
    "GemmaForCausalLM": dict(max_position_embeddings=8192),
    "Gemma2ForCausalLM": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              query_pre_attn_scalar=256, sliding_window=4096, pattern=2,
                              max_position_embeddings=8192),
    VAULTGEMMA: dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                     query_pre_attn_scalar=256, sliding_window=4096, pattern=2,
                     max_position_embeddings=8192),
    "Gemma3ForCausalLM": dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                              query_pre_attn_scalar=256, sliding_window=4096, pattern=6,
                              max_position_embeddings=131_072)}
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")  # Gemma's legacy "gelu" means tanh.
# Gemma 4 (31B, 26B-A4B, 12B; Gemma4ForConditionalGeneration's language model as well):
# Gemma 3's sandwich-normed layers with plain norms (w, not 1 + w), q/k norms, values
# RMS-normed without a weight, unscaled attention logits (the norms set their scale) and
# a scalar per layer on its output (layer_scalar). The full layers have a width of their
# own (global_head_dim, num_global_key_value_heads, or transformers 5's
# per_layer_config), with attention_k_eq_v no v_proj (values from the keys' projection),
# and rotate by proportional RoPE; with enable_moe_block every layer runs a mixture of
# GeGLU experts beside its dense MLP (`ModelConfig.moe_input_norms`). The E2B / E4B's
# per-layer embeddings (hidden_size_per_layer_input) and shared-KV layers
# (num_kv_shared_layers) are not read. transformers' defaults where a file leaves a
# field out.
GEMMA4 = "Gemma4ForCausalLM"
_GEMMA4_DEFAULTS = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    sliding_window=512, max_position_embeddings=131_072, tie_word_embeddings=True,
    hidden_size_per_layer_input=256, num_kv_shared_layers=0, attention_k_eq_v=False,
    enable_moe_block=False, final_logit_softcapping=None)
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
# Vision-language classes whose language model is read alone (the vision tower and its
# projector are left in the files): class -> the causal LM it holds. Gemma 3 4B / 12B /
# 27B are published this way; their text_config leaves out what equals these defaults.
VISION_LANGUAGE = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                   "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
                   "Qwen3_5ForConditionalGeneration": QWEN3_5,
                   "Qwen3_5MoeForConditionalGeneration": QWEN3_5_MOE,
                   "Llama4ForConditionalGeneration": LLAMA4,
                   # Mistral Small 3.1 / 3.2 (a Mistral text model), Ministral 3
                   "Mistral3ForConditionalGeneration": "MistralForCausalLM",
                   # Qwen3-VL 2B-32B: Qwen3 whose multimodal rotary embedding (MRoPE) has
                   # its three position axes equal on text, where it is the 1D one
                   "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
                   # Qwen3-VL-30B-A3B / 235B-A22B: Qwen3-MoE, its files' experts stacked
                   # (`_stacked_expert_rows`), its router always renormalising
                   "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
                   # GLM-4.1V-9B / GLM-4.6V-Flash: GLM-4, whose MRoPE is GLM's 1D rotary
                   # embedding on text
                   "Glm4vForConditionalGeneration": GLM4,
                   # GLM-4.5V / GLM-4.6V: GLM-4.5's mixture
                   "Glm4vMoeForConditionalGeneration": GLM4_MOE,
                   # Kimi K2.5 / K2.6: Kimi K2's DeepSeek-V3 (text_config model_type
                   # deepseek_v3, or kimi_k2 in the published files); transformers'
                   # class name and the published one
                   "Kimi_K25ForConditionalGeneration": DEEPSEEK_V3,
                   "KimiK25ForConditionalGeneration": DEEPSEEK_V3}
# Vision-language classes whose causal LM depends on text_config's model_type (the
# first entry: transformers' default).
_VISION_TEXT_TYPES = {"Mistral3ForConditionalGeneration": {
    "mistral": "MistralForCausalLM", "ministral3": MINISTRAL3}}
# transformers' DeepseekV3Config's sizes (its mixture's in _DEEPSEEK_V3_DEFAULTS).
_KIMI_TEXT_DEFAULTS = dict(vocab_size=129_280, hidden_size=7168, intermediate_size=18_432,
                           num_hidden_layers=61, num_attention_heads=128,
                           num_key_value_heads=128, tie_word_embeddings=False)
_TEXT_DEFAULTS = {"Kimi_K25ForConditionalGeneration": _KIMI_TEXT_DEFAULTS,
                  "KimiK25ForConditionalGeneration": _KIMI_TEXT_DEFAULTS,
                  "Gemma3ForConditionalGeneration": dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6),
    "Qwen3VLForConditionalGeneration": dict(
        vocab_size=151_936, hidden_size=4096, intermediate_size=22_016, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=128_000, rope_theta=500_000.0, attention_bias=False),
    "Qwen3VLMoeForConditionalGeneration": dict(
        vocab_size=151_936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, rms_norm_eps=1e-6,
        max_position_embeddings=128_000, rope_theta=500_000.0, attention_bias=False,
        tie_word_embeddings=True, decoder_sparse_step=1, moe_intermediate_size=1408,
        num_experts_per_tok=4, num_local_experts=60, router_aux_loss_coef=0.001),
    "Glm4vForConditionalGeneration": dict(
        vocab_size=151_552, hidden_size=4096, intermediate_size=13_696, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=32_768),
    "Glm4vMoeForConditionalGeneration": dict(
        vocab_size=151_424, hidden_size=4096, intermediate_size=10_944, num_hidden_layers=46,
        num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=65_536,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
        moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1,
        n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=True, router_aux_loss_coef=0.0001)}
_KIMI_K25 = ("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration")
# What a vision-language class's text model always computes, whatever its text_config says.
_TEXT_FIXED = {"Qwen3VLMoeForConditionalGeneration": dict(norm_topk_prob=True),
               "Glm4vForConditionalGeneration": dict(attention_bias=True)}


def _language_model_config(c: dict[str, Any]) -> dict[str, Any]:
  """A vision-language config.json's text model as a causal LM's config.json (others as
  they are)."""
  arch = next((a for a in c.get("architectures") or [] if a in VISION_LANGUAGE), None)
  if arch is None:
    return c
  text = {**_TEXT_DEFAULTS.get(arch, {}), **(c.get("text_config") or {})}
  for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
    if key in c:
      text[key] = c[key]
  if arch in _KIMI_K25 and "tie_word_embeddings" not in c:
    text["tie_word_embeddings"] = True  # its config's default, which transformers ties by
  lm = VISION_LANGUAGE[arch]
  if arch in _VISION_TEXT_TYPES:
    types = _VISION_TEXT_TYPES[arch]
    kind = text.get("model_type") or next(iter(types))
    if kind not in types:
      raise ValueError(f"{arch} with a {kind!r} text model is not read (read: "
                       f"{', '.join(types)})")
    lm = types[kind]
  return {**text, **_TEXT_FIXED.get(arch, {}), "architectures": [lm]}


def _language_model_names(c: dict[str, Any], files: dict[str, str]) -> Callable[[str], str]:
  """HF causal-LM tensor name -> its name in the files: the names themselves, or a
  vision-language checkpoint's (language_model.model.X, as published and as transformers
  5 saves, or model.language_model.X); a Nemotron-H checkpoint's trunk as model.X when
  its files say so (transformers' name in memory) in place of backbone.X; EXAONE 3's
  names (`_EXAONE_NAMES`) where its files hold them."""
  if _renamed_files(c, files):
    renames = _FILE_NAMES[c["model_type"]][1]
    return functools.partial(functools.reduce, lambda name, rename: re.sub(*rename, name),
                             renames)
  if (GPT2 in (c.get("architectures") or []) and "wte.weight" in files
      and "transformer.wte.weight" not in files):  # GPT-2's oldest files: no prefix
    return lambda name: (name[len("transformer."):] if name.startswith("transformer.")
                         else name)
  if (NEMOTRON_H in (c.get("architectures") or []) and "backbone.embeddings.weight" not in
      files and "model.embeddings.weight" in files):
    return lambda name: ("model." + name[len("backbone."):] if name.startswith("backbone.")
                         else name)
  if not any(a in VISION_LANGUAGE for a in c.get("architectures") or []):
    return lambda name: name
  if any(n.startswith("model.language_model.") for n in files):
    return lambda name: ("model.language_model." + name[len("model."):]
                         if name.startswith("model.") else name)
  if any(n.startswith("language_model.model.blocks.") for n in files):
    # Kimi K2.5 as transformers 5 saves it: its renaming of the vision tower's blocks to
    # layers, reversed, reaches the language model's layers too.
    return lambda name: "language_model." + name.replace("model.layers.", "model.blocks.", 1)
  return lambda name: "language_model." + name
# HF module names of a mixture's router and of expert j's gate, up and down projections.
_QWEN_MOE_NAMES = ("mlp.gate", "mlp.experts.{j}.gate_proj", "mlp.experts.{j}.up_proj",
                   "mlp.experts.{j}.down_proj")  # the layout Qwen's MoE files set
_MIXTRAL_MOE_NAMES = ("block_sparse_moe.gate", "block_sparse_moe.experts.{j}.w1",
                      "block_sparse_moe.experts.{j}.w3", "block_sparse_moe.experts.{j}.w2")
_MOE_NAMES = {"Qwen3MoeForCausalLM": _QWEN_MOE_NAMES, QWEN2_MOE: _QWEN_MOE_NAMES,
              MELLUM: _QWEN_MOE_NAMES,
              LFM2_MOE: ("feed_forward.gate", "feed_forward.experts.{j}.w1",
                         "feed_forward.experts.{j}.w3", "feed_forward.experts.{j}.w2"),
              GLM4_MOE: _QWEN_MOE_NAMES, SOLAR_OPEN: _QWEN_MOE_NAMES,
              DEEPSEEK_V3: _QWEN_MOE_NAMES, DOTS1: _QWEN_MOE_NAMES,
              EXAONE_MOE: _QWEN_MOE_NAMES,
              HUNYUAN_MOE: ("mlp.gate.wg", "mlp.experts.{j}.gate_proj",
                            "mlp.experts.{j}.up_proj", "mlp.experts.{j}.down_proj"),
              DEEPSEEK_V2: _QWEN_MOE_NAMES, QWEN3_5_MOE: _QWEN_MOE_NAMES,
              QWEN3_NEXT: _QWEN_MOE_NAMES, "MixtralForCausalLM": _MIXTRAL_MOE_NAMES,
              PHIMOE: _MIXTRAL_MOE_NAMES,
              MINIMAX_M2: _MIXTRAL_MOE_NAMES, OLMOE: _QWEN_MOE_NAMES,
              FLEX_OLMO: _QWEN_MOE_NAMES,
              ERNIE4_5_MOE: _QWEN_MOE_NAMES, GLM4_MOE_LITE: _QWEN_MOE_NAMES,
              MISTRAL4: _QWEN_MOE_NAMES, DEEPSEEK_V32: _QWEN_MOE_NAMES,
              GLM_MOE_DSA: _QWEN_MOE_NAMES, COHERE2_MOE: _QWEN_MOE_NAMES,
              JAMBA: ("feed_forward.router", "feed_forward.experts.{j}.gate_proj",
                      "feed_forward.experts.{j}.up_proj", "feed_forward.experts.{j}.down_proj")}
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
              "short_factor", "long_factor", "partial_rotary_factor")


def _causal_lm(arch: str) -> str:
  """The causal-LM class with the trunk of `arch` (itself for a causal LM)."""
  return SEQUENCE_CLASSIFIERS.get(arch, arch)


def _sequence_classifier(arch: str) -> str:
  """The *ForSequenceClassification class on the trunk of `arch`."""
  return _classifier_name(_causal_lm(arch))


def _num_labels(c: dict[str, Any]) -> int:
  """Outputs of a sequence classifier's score layer, read as `transformers` does: the
  length of id2label, else num_labels, else its default of 2."""
  if c.get("id2label"):
    return len(c["id2label"])
  return int(c["num_labels"]) if c.get("num_labels") is not None else 2


def _rope_from_hf(c: dict[str, Any], lm: str = "") -> tuple[RopeConfig, RopeConfig | None]:
  """(rope, rope of the sliding layers or None) of a config.json."""
  params = c.get("rope_parameters") or {}
  per_type = bool(params) and all(isinstance(v, dict) for v in params.values())
  # Per layer type: transformers 5 writes rope_parameters {full_attention: ...,
  # sliding_attention: ...}; the published files rope_theta and rope_scaling, which give
  # the full layers theirs. The sliding layers' then: Gemma 3's rope_local_base_freq;
  # OLMo 3's the default kind at base 500k, even when rope_theta differs (what
  # transformers computes).
  bases = {"Gemma3ForCausalLM": (1_000_000.0, 10_000.0),
           "Olmo3ForCausalLM": (500_000.0, 500_000.0), MELLUM: (500_000.0, 10_000.0)}
  if lm in bases:
    full_base, local_base = bases[lm]
    if per_type:
      full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
      full = {**(c.get("rope_scaling") or {}), **params}
      full.setdefault("rope_theta", c.get("rope_theta", full_base))
      local = ({"rope_theta": c.get("rope_local_base_freq", local_base)}
               if lm == "Gemma3ForCausalLM" else {})
    full.setdefault("rope_theta", full_base)
    local.setdefault("rope_theta", local_base)
    return _rope_from_params(full, c), _rope_from_params(local, c)
  if per_type:
    raise ValueError(f"per-layer-type rope_parameters {sorted(params)} are not supported "
                     f"for {lm or 'this architecture'}")
  merged = {**dict(c.get("rope_scaling") or {}), **params}
  if lm in _HUNYUANS and merged.get("rope_type", merged.get("type")) == "dynamic":
    if not merged.get("alpha"):
      raise ValueError(f"rope type 'dynamic' without an alpha in a {lm} config.json "
                       "(NTK scaling by the sequence length) is not supported")
    dim = int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
    theta = float(merged.get("rope_theta", c.get("rope_theta", 10_000.0)))
    merged = {"rope_type": "default",
              "rope_theta": theta * float(merged["alpha"]) ** (dim / (dim - 2))}
  if lm in _GLMS + (GLM4_MOE,):
    merged.setdefault("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))
  if lm in _QWEN3_5S + (STABLELM,):
    merged.setdefault("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
  if lm in (PHI, NEMOTRON):
    merged.setdefault("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))
  if lm == GPT_NEOX:  # the published files' names: rotary_pct, rotary_emb_base
    merged.setdefault("partial_rotary_factor", c.get("rotary_pct", 0.25))
    merged.setdefault("rope_theta", c.get("rotary_emb_base", 10_000.0))
  if lm == BAMBA:  # transformers' BambaConfig sets it, whatever the file says
    merged["partial_rotary_factor"] = 0.5
  if lm == MINIMAX_M2:
    # The published files say rotary_dim; a partial_rotary_factor anywhere ranks above it,
    # as transformers reads them (neither: every feature rotates).
    rotary = c.get("rotary_dim")
    merged.setdefault("partial_rotary_factor", c.get(
        "partial_rotary_factor", 1.0 if rotary is None else int(rotary) / int(c["head_dim"])))
  if lm in _DEEPSEEKS:  # the rotated part of each query and key head
    rotary = int(c["qk_rope_head_dim"])
    merged["partial_rotary_factor"] = rotary / (rotary + int(c["qk_nope_head_dim"]))
  if lm == PHIMOE and merged.get("rope_type", merged.get("type")) == "longrope":
    short, long = merged.get("short_mscale"), merged.get("long_mscale")
    if short != long:
      raise ValueError(f"short_mscale={short} and long_mscale={long} in a PhiMoE "
                       "config.json: cos and sin scaled by one value up to its original "
                       "context and another past it is not supported")
    if short is not None:
      merged["attention_factor"] = float(short)
  if lm in (PHI3, PHIMOE):
    if merged.get("rope_type", merged.get("type")) in ("su", "yarn"):
      merged["rope_type"] = "longrope"  # the legacy names, as transformers reads them
    merged.setdefault("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    longrope = merged.get("rope_type", merged.get("type")) == "longrope"
    if longrope and c.get("original_max_position_embeddings"):
      merged.setdefault("original_max_position_embeddings",
                        int(c["original_max_position_embeddings"]))
  elif merged.get("rope_type", merged.get("type")) == "longrope":
    raise ValueError(f"rope type 'longrope' is read for {PHI3} and {PHIMOE} only, not "
                     f"{lm or 'this architecture'}")
  return _rope_from_params(merged, c), None


def _rope_from_params(merged: dict[str, Any], c: dict[str, Any]) -> RopeConfig:
  theta = merged.get("rope_theta", c.get("rope_theta", 10_000.0))
  rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
  if rope_type == "dynamic" and merged.get("factor") is None:
    raise ValueError("rope type 'dynamic' without a factor in config.json is not supported")
  if rope_type not in ("default", "linear", "llama3", "yarn", "longrope", "proportional",
                       "dynamic"):
    raise ValueError(f"rope type {rope_type!r} in config.json is not supported")
  kwargs = {k: merged[k] for k in _ROPE_KEYS if merged.get(k) is not None}
  if rope_type == "longrope":
    # transformers' default factor: the ratio of the two contexts.
    kwargs.setdefault("original_max_position_embeddings",
                      int(c.get("max_position_embeddings", 4096)))
    kwargs.setdefault("factor", int(c.get("max_position_embeddings", 4096))
                      / kwargs["original_max_position_embeddings"])
  if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in kwargs:
    kwargs["original_max_position_embeddings"] = int(c.get("max_position_embeddings", 8192))
  if rope_type == "yarn" and "factor" not in kwargs:
    kwargs["factor"] = c["max_position_embeddings"] / kwargs["original_max_position_embeddings"]
  return RopeConfig(theta=float(theta), type=rope_type, **kwargs)


# Families transformers runs through a class read here, known by config.json's model_type
# (their published files name a class of their own, in remote code): model_type -> (that
# class, config.json keys of their own -> the class's names, their config's defaults).
# They are written back as that class.
_MODEL_TYPE_CLASSES: dict[str, tuple[str, dict[str, str], dict[str, Any]]] = {
    # EXAONE 3.0 / 3.5 / EXAONE Deep: Llama, its files named GPT-2's way (`_EXAONE_NAMES`)
    "exaone": ("LlamaForCausalLM", {
        "num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
        "activation_function": "hidden_act"}, dict(
        vocab_size=102_400, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=False)),
    # InternLM3: Llama (qkv_bias: all four attention projections' biases; bias: the
    # MLP's), rotated by dynamic NTK scaling past its context in the published files
    "internlm3": ("LlamaForCausalLM", {"qkv_bias": "attention_bias", "bias": "mlp_bias"},
                  dict(vocab_size=128_512, hidden_size=4096, intermediate_size=10_240,
                       num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
                       head_dim=128, max_position_embeddings=32_768, rms_norm_eps=1e-5,
                       tie_word_embeddings=False)),
    # IQuest-Coder-V1: Llama
    "iquestcoder": ("LlamaForCausalLM", {}, dict(
        vocab_size=76_800, hidden_size=5120, intermediate_size=27_648, num_hidden_layers=80,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131_072, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # Sarvam-105B: DeepSeek-V3 (one group, a dense first layer, no query compression)
    "sarvam_mla": (DEEPSEEK_V3, {
        "num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
        "num_shared_experts": "n_shared_experts",
        "num_mtp_layers": "num_nextn_predict_layers"}, {
        **_KIMI_TEXT_DEFAULTS, **_DEEPSEEK_V3_DEFAULTS, **dict(
            vocab_size=262_144, hidden_size=4096, intermediate_size=16_384,
            num_hidden_layers=32, num_attention_heads=64, num_key_value_heads=None,
            n_routed_experts=128, q_lora_rank=None, n_group=1, topk_group=1,
            first_k_dense_replace=1)}),
    # Sarvam-30B: GLM-4.5 (every feature rotated, q/k norms), its files' names its own and
    # q, k and v fused (`_SARVAM_NAMES`, `_fused_qkv_rows`)
    "sarvam_moe": (GLM4_MOE, {
        "num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
        "num_shared_experts": "n_shared_experts", "use_qkv_bias": "attention_bias",
        "num_mtp_layers": "num_nextn_predict_layers"}, {
        **_GLM4_MOE_DEFAULTS, **dict(
            vocab_size=262_144, hidden_size=4096, intermediate_size=8192,
            num_hidden_layers=19, num_attention_heads=64, num_key_value_heads=4, head_dim=64,
            rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=8_000_000.0,
            partial_rotary_factor=1.0, moe_intermediate_size=1024, num_experts_per_tok=6,
            routed_scaling_factor=2.5, use_qk_norm=True, num_nextn_predict_layers=0)}),
}
# Sarvam-30B's tensor names in its files (transformers' names -> theirs, in order); its
# q, k and v rows sit in one query_key_value.
_SARVAM_NAMES = ((r"^model\.embed_tokens\.", "model.word_embeddings."),
                 (r"\.self_attn\.o_proj\.", ".attention.dense."),
                 (r"\.self_attn\.q_norm\.", ".attention.query_layernorm."),
                 (r"\.self_attn\.k_norm\.", ".attention.key_layernorm."),
                 (r"\.self_attn\.", ".attention."),
                 (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.expert_bias"))
# EXAONE 3's tensor names in its files (transformers' names -> theirs, in order).
_EXAONE_NAMES = ((r"^model\.embed_tokens\.", "transformer.wte."),
                 (r"^model\.layers\.", "transformer.h."), (r"^model\.norm\.", "transformer.ln_f."),
                 (r"\.self_attn\.o_proj\.", ".attn.attention.out_proj."),
                 (r"\.self_attn\.", ".attn.attention."), (r"\.input_layernorm\.", ".ln_1."),
                 (r"\.post_attention_layernorm\.", ".ln_2."),
                 (r"\.mlp\.gate_proj\.", ".mlp.c_fc_0."), (r"\.mlp\.up_proj\.", ".mlp.c_fc_1."),
                 (r"\.mlp\.down_proj\.", ".mlp.c_proj."))


# model_type -> (a tensor its own files hold, transformers' names -> theirs).
_FILE_NAMES = {"exaone": ("transformer.wte.weight", _EXAONE_NAMES),
               "sarvam_moe": ("model.word_embeddings.weight", _SARVAM_NAMES)}


def _renamed_files(c: dict[str, Any], files: dict[str, str]) -> bool:
  """Whether the files hold a `_FILE_NAMES` family's own names (not transformers')."""
  return (c.get("model_type") in _FILE_NAMES
          and _FILE_NAMES[c["model_type"]][0] in files)


def _model_type_config(c: dict[str, Any]) -> dict[str, Any]:
  """A config.json of a `_MODEL_TYPE_CLASSES` family as its class's (others as they
  are): keys under the class's names, its family's defaults where it says nothing."""
  if c.get("model_type") not in _MODEL_TYPE_CLASSES:
    return c
  _, names, defaults = _MODEL_TYPE_CLASSES[c["model_type"]]
  out = {**defaults, **{names.get(k, k): v for k, v in c.items() if names.get(k, k) not in c
                        or k not in names}}
  if out.get("num_key_value_heads") is None:
    out["num_key_value_heads"] = out["num_attention_heads"]
  scaling = out.get("rope_scaling") or {}
  if "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
    # Sarvam's name for DeepSeek's YaRN, read as transformers does
    out["rope_scaling"] = {**{k: v for k, v in scaling.items() if k != "type"},
                           "rope_type": "yarn"}
  return out


def _architecture(c: dict[str, Any]) -> str:
  """The supported class a config.json names (or its model_type runs as,
  `_MODEL_TYPE_CLASSES`); an unknown architecture is an error."""
  archs = c.get("architectures") or []
  arch = next((a for a in archs if a in SUPPORTED), None)
  if arch is None and c.get("model_type") in _MODEL_TYPE_CLASSES:
    arch = _MODEL_TYPE_CLASSES[c["model_type"]][0]
  if arch is None:
    raise ValueError(f"unsupported architecture {archs or c.get('model_type')!r}; "
                     f"supported: {list(SUPPORTED) + list(VISION_LANGUAGE)}")
  return arch


def folder_config(path: str, what: str, expected: str = "a Hugging Face folder"
                  ) -> tuple[ModelConfig, dict[str, Any]]:
  """(ModelConfig, config.json as a dict) of a model folder, from its config.json alone.

  Raises:
    ValueError: starting with `what` (e.g. "reward model 'dir'"), when the folder has no
      config.json or holds an architecture that cannot be read.
  """
  cfg_path = os.path.join(str(path), "config.json")
  if not os.path.exists(cfg_path):
    raise ValueError(f"{what} has no config.json (expected {expected})")
  with open(cfg_path) as fh:
    hf_cfg = json.load(fh)
  try:
    return hf_config_to_model_config(hf_cfg), hf_cfg
  except (ValueError, KeyError) as e:
    raise ValueError(f"{what}: {e}") from None


def hf_config_to_model_config(c: dict[str, Any], **overrides: Any) -> ModelConfig:
  """Maps a config.json dict to a ModelConfig; an unknown architecture is an error. A
  *ForSequenceClassification is a reward model (lm_head=False, value_head=True) of one
  label; another num_labels is an error. A vision-language model (VISION_LANGUAGE) maps
  to its language model's causal LM."""
  c = _model_type_config(_language_model_config(c))
  arch = _architecture(c)
  lm = _causal_lm(arch)
  if lm in (GEMMA4,) + _BACKBONES + _LFM2S:
    cfg = (_nemotron_h_from_hf(c) if lm == NEMOTRON_H else _mamba2_lm_from_hf(c)
           if lm == MAMBA2 else _mamba1_from_hf(c, lm) if lm in _MAMBA1S
           else _lfm2_from_hf(c, lm) if lm in _LFM2S
           else _gemma4_from_hf(c, arch))
    return cfg.replace(**overrides) if overrides else cfg
  aliases = _CONFIG_ALIASES.get(lm, {})  # Llama's names of its keys win, as transformers'
  c = {**_CLASS_DEFAULTS.get(lm, {}), **c,
       **{own: c[alias] for alias, own in aliases.items() if alias in c}}
  if lm == STARCODER2:  # its eps's name; use_bias for every projection
    c = {**c, "rms_norm_eps": c["norm_epsilon"], "attention_bias": bool(c["use_bias"])}
  if lm in (JAIS2, NEMOTRON):  # their eps's names
    c = {**c, "rms_norm_eps": c["layer_norm_eps" if lm == JAIS2 else "norm_eps"]}
  if lm == STABLELM:
    c = {**c, "rms_norm_eps": c["layer_norm_eps"], "attention_bias": bool(c["use_qkv_bias"]),
         "head_dim": int(c["hidden_size"]) // int(c["num_attention_heads"])}
  if lm == GPT_NEOX:  # its eps's name; heads split the width, a key head for each query's
    c = {**c, "rms_norm_eps": c["layer_norm_eps"],
         "num_key_value_heads": c["num_attention_heads"],
         "head_dim": int(c["hidden_size"]) // int(c["num_attention_heads"])}
  if lm in (GPT2, GPT_BIGCODE) + _GPTJS:
    c = _gpt2_config(c, lm)
  if lm in _CLASS_CONFIGS:  # the class's own keys under Llama's
    c = _CLASS_CONFIGS[lm](c)
  if lm == OLMO1:  # its LayerNorms' eps, fixed
    c = {**c, "rms_norm_eps": 1e-5}
  if lm == PHI:  # its eps's name; its q/k/v and output biases always there
    if c["qk_layernorm"]:
      raise ValueError("qk_layernorm=true in a Phi config.json (q and k LayerNorm-ed, with "
                       "biases, over each head) is not supported")
    c = {**c, "rms_norm_eps": c["layer_norm_eps"], "attention_bias": True}
  if lm in (COHERE, COHERE2):  # transformers' config: its eps's name, head_dim from the width
    c = {**c, "rms_norm_eps": c["layer_norm_eps"],
         "head_dim": int(c["hidden_size"]) // int(c["num_attention_heads"])}
  if lm == COHERE2_MOE:  # an RMSNorm's eps where it has one, else the LayerNorm's
    c = {**c, "rms_norm_eps": c.get("rms_norm_eps") or c["layer_norm_eps"],
         "_layer_norm": c.get("rms_norm_eps") is None}
  if lm == GPT_OSS and not c.get("rope_scaling") and not c.get("rope_parameters"):
    c["rope_scaling"] = dict(_GPT_OSS_ROPE)
  if lm == CWM and not any(c.get(k) for k in ("rope_scaling", "rope_parameters", "rope_theta")):
    c["rope_parameters"] = dict(_CWM_ROPE)
  if lm == MISTRAL4 and not c.get("rope_scaling") and not c.get("rope_parameters"):
    c["rope_parameters"] = dict(_MISTRAL4_ROPE)
  reward_model = arch != lm
  if reward_model and _num_labels(c) != 1:
    raise ValueError(f"{arch} with num_labels={_num_labels(c)} is not supported: a reward "
                     "model has one label (num_labels=1), one score per sequence")
  if c.get("mlp_bias") and lm not in (JAIS2, NEMOTRON):
    raise ValueError("mlp_bias=true in config.json is not supported")
  if lm in _HUNYUANS and c.get("use_cla"):
    raise ValueError(f"use_cla=true in a {lm} config.json (layers sharing another's keys "
                     "and values) is not supported")
  if lm in _ERNIES and c.get("use_bias"):
    raise ValueError("use_bias=true in an ERNIE 4.5 config.json (biases on the MLP's "
                     "projections too) is not supported")
  gemma = lm in GEMMAS
  expected = ("gelu_pytorch_tanh" if gemma or lm == STARCODER2 else
              "relu2" if lm in (ARCEE, JAIS2, NANOCHAT, NEMOTRON) else "xielu" if lm == APERTUS
              else "relu" if lm == OPT
              else "silu")
  act = c.get("hidden_activation") or c.get("hidden_act") or expected
  ungated = lm in (ARCEE, APERTUS, NANOCHAT, OPT) + _PLAIN_MLPS  # MLPs of no gate
  if lm in _UNGATED_GELU_CLASSES:
    expected = " or ".join(_UNGATED_GELUS)
  if (act not in _UNGATED_GELUS if lm in _UNGATED_GELU_CLASSES else
      act != expected if ungated
      else act != "silu" and not (gemma and act in _GELU_TANH)):
    raise ValueError(f"hidden_act={act!r} is not supported (expected {expected})")
  heads = int(c["num_attention_heads"])
  head_dim = c.get("head_dim") or c["hidden_size"] // heads
  latent = _latent_attention_from_hf(lm, c)
  if latent:  # transformers' DeepSeek config says head_dim for the rotated part alone
    head_dim = int(c["qk_nope_head_dim"]) + latent["qk_rope_head_dim"]
    c = {**c, "num_key_value_heads": heads}
  dtype = c.get("dtype") or c.get("torch_dtype") or "float32"
  pad = c.get("pad_token_id")
  pad = pad if isinstance(pad, int) and not isinstance(pad, bool) else None
  moe = _moe_from_hf(lm, c)
  if "ffn_dim" not in moe:
    moe["ffn_dim"] = int(c["intermediate_size"])
  rope, rope_local = _rope_from_hf(c, lm)
  if lm in _SWAS:
    rope, rope_local = _granite_swa_ropes(c, rope)
  defaults = _GEMMA_DEFAULTS.get(lm, {})
  cfg = ModelConfig(
      vocab_size=int(c["vocab_size"]), d_model=int(c["hidden_size"]),
      num_layers=int(c["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=int(head_dim),
      rope=rope, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(c.get("tie_word_embeddings", gemma)),
      qkv_bias=lm == "Qwen2ForCausalLM" or (bool(c.get("attention_bias", False))
                                             and lm not in _NO_ATTENTION_BIAS)
      or (lm == QWEN2_MOE and bool(c["qkv_bias"])),
      qk_norm=lm in _QK_NORMED or (lm in (GLM4_MOE, COHERE) and bool(c["use_qk_norm"]))
      or (lm == STABLELM and bool(c["qk_layernorm"])),
      qk_norm_after_rope=lm in _HUNYUANS,
      **_output_bias_from_hf(lm, c), max_position_embeddings=int(c.get(
          "max_position_embeddings", defaults.get("max_position_embeddings", 8192))),
      architecture=arch, dtype=str(dtype), param_dtype=str(dtype),
      lm_head=not reward_model, value_head=reward_model, pad_token_id=pad, **moe,
      **_gemma_from_hf(lm, c), **_window_from_hf(lm, c), rope_local=rope_local,
      **_gpt_oss_from_hf(lm, c), **_olmo_from_hf(lm, c), **_smollm3_from_hf(lm, c),
      **_minimax_m2_from_hf(lm, c), **_llama4_from_hf(lm, c), **_granite_from_hf(lm, c),
      **({"sandwich_norms": True} if lm == GLM4 else {}), **latent,
      **_linear_attention_from_hf(lm, c), **_bamba_from_hf(lm, c), **_jamba_from_hf(lm, c),
      **_falcon_h1_from_hf(lm, c), **_ministral3_from_hf(lm, c), **_olmoe_from_hf(lm, c),
      **_exaone4_from_hf(lm, c), **({"mlp_activation": "relu2"} if lm == ARCEE else {}),
      **({"mlp_activation": "xielu"} if lm == APERTUS else {}), **_cohere2_from_hf(lm, c),
      **_plain_mlp_from_hf(lm, c), **_stablelm_from_hf(lm, c), **_nanochat_from_hf(lm, c),
      **_ungated_gelu_from_hf(lm, c), **_opt_from_hf(lm, c), **_alibi_from_hf(lm, c),
      **(dict(layer_norm=True, norm_bias=True, lm_head_bias=bool(c["lm_head_bias"]))
         if lm == PHIMOE else {}),
      **(dict(layer_norm=True, norm_weightless=lm == OLMO1,
              clip_qkv=None if c["clip_qkv"] is None else float(c["clip_qkv"]))
         if lm in (OLMO1, DBRX) else {}))
  return cfg.replace(**overrides) if overrides else cfg


def _ministral3_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """Ministral 3's and Mistral 4's query scaling by position, from their rope_parameters
  (where transformers reads it; {} for other families)."""
  if lm not in _POSITION_SCALED:
    return {}
  params = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
  beta, length = params.get("llama_4_scaling_beta"), params.get(
      "original_max_position_embeddings")
  if beta is None or not length:
    raise ValueError(f"{lm} config.json needs rope_parameters "
                     "llama_4_scaling_beta and original_max_position_embeddings (the "
                     f"queries' scaling by position); got {sorted(params)}")
  return {"attn_position_scale": float(beta), "attn_position_scale_length": int(length)}


def _granite_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """Granite's four scalars ({} for other classes), transformers' defaults (1.0 each,
  the attention's scale too) where a config.json leaves one out."""
  if lm not in GRANITES:
    return {}
  out: dict[str, Any] = {name: float(1.0 if c.get(name) is None else c[name])
                         for name in _GRANITE_SCALARS}
  if lm == GRANITE_HYBRID:
    layers = int(c["num_hidden_layers"])
    kinds = c.get("layer_types") or c.get("layers_block_type") or ["mamba"] * layers
    if len(kinds) != layers or not set(kinds) <= set(_GRANITE_LAYER_TYPES):
      raise ValueError(f"layer_types={kinds!r} in a {GRANITE_HYBRID} config.json: expected "
                       f"one of {sorted(set(_GRANITE_LAYER_TYPES))} for each of the "
                       f"{layers} layers")
    if any(_GRANITE_LAYER_TYPES[k] == "linear_attention" for k in kinds):
      out.update(_mamba2_from_hf(c, kinds))
    if c.get("position_embedding_type") not in ("rope", None, "nope"):
      raise ValueError(f"position_embedding_type={c['position_embedding_type']!r} is not "
                       "supported (expected rope, or none)")
    if c.get("position_embedding_type") != "rope":  # no position embedding: every layer NoPE
      out["rope_layers"] = (0,) * layers
  if lm in _SWAS:
    out.update(_granite_swa_from_hf(c))
  return out


def _granite_swa_kinds(c: dict[str, Any], rope: RopeConfig) -> tuple[list, list]:
  """(layer_types, layer_rope_theta) of a Granite "swash" config.json, its defaults
  (every fourth layer full, from the first; every layer at the rope's base) where it
  leaves them out."""
  layers = int(c["num_hidden_layers"])
  kinds = c.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention"
                                   for i in range(layers)]
  thetas = c.get("layer_rope_theta") or [rope.theta] * layers
  if len(kinds) != layers or len(thetas) != layers or not set(kinds) <= {
      "full_attention", "sliding_attention"}:
    raise ValueError(f"layer_types={kinds!r} / layer_rope_theta={thetas!r} in a "
                     f"{GRANITE_SWA} config.json: expected full_attention or "
                     f"sliding_attention and a base for each of the {layers} layers")
  return list(kinds), list(thetas)


def _granite_swa_ropes(c: dict[str, Any], rope: RopeConfig
                       ) -> tuple[RopeConfig, RopeConfig | None]:
  """(rope, rope_local) of a Granite "swash" config.json: its full layers' base and, where
  it differs, its sliding layers'."""
  bases: dict[str, set] = {}
  kinds, thetas = _granite_swa_kinds(c, rope)
  for kind, theta in zip(kinds, thetas):
    if float(theta):
      bases.setdefault(kind, set()).add(float(theta))
  if any(len(b) > 1 for b in bases.values()):
    raise ValueError(f"layer_rope_theta={thetas!r} in a {GRANITE_SWA} config.json: layers of "
                     "one kind with different bases are not supported")
  full = next(iter(bases.get("full_attention", {rope.theta})))
  local = next(iter(bases.get("sliding_attention", {full})))
  return (dataclasses.replace(rope, theta=full),
          dataclasses.replace(rope, theta=local) if local != full else None)


def _granite_swa_from_hf(c: dict[str, Any]) -> dict[str, Any]:
  """A Granite "swash" config.json's sinks, windows and NoPE layers (a base of 0)."""
  kinds, thetas = _granite_swa_kinds(c, _rope_from_hf(c, GRANITE_SWA)[0])
  out: dict[str, Any] = {"attention_sinks": True, "layer_types": tuple(kinds),
                         "rope_layers": tuple(int(bool(float(t))) for t in thetas)}
  if c.get("sliding_window"):
    out["sliding_window"] = int(c["sliding_window"])
  return out


# A Granite 4 config.json's layer kinds (transformers reads "mamba" as linear_attention).
_GRANITE_LAYER_TYPES = {"attention": "full_attention", "full_attention": "full_attention",
                        "mamba": "linear_attention", "linear_attention": "linear_attention"}


def _mamba2_from_hf(c: dict[str, Any], kinds: list[str]) -> dict[str, Any]:
  """The Mamba2 fields of a Granite 4 -h- or Bamba config.json: its mamba_* entries as the
  linear-attention fields they map to (`ModelConfig.linear_mixer`; mamba_chunk_size the
  chunk of ours, linear_chunk), transformers' defaults where one is left out."""
  d = int(c["hidden_size"])
  heads = int(c.get("mamba_n_heads") or 128)
  inner = int(c.get("mamba_expand") or 2) * d
  head_dim = c.get("mamba_d_head", "auto")
  head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
  if head_dim * heads != inner:
    raise ValueError(f"mamba_n_heads={heads} x mamba_d_head={head_dim} must equal "
                     f"mamba_expand x hidden_size = {inner}")
  if c.get("mamba_proj_bias"):
    raise ValueError("mamba_proj_bias=true (biases on a Mamba2 layer's in_proj and "
                     "out_proj) is not supported")
  low, high = (_json_float(x) for x in c.get("time_step_limit") or (0.0, float("inf")))
  return dict(layer_types=tuple(_GRANITE_LAYER_TYPES[k] for k in kinds),
              linear_mixer="mamba2", linear_num_key_heads=int(c.get("mamba_n_groups") or 1),
              linear_key_head_dim=int(c.get("mamba_d_state") or 256),
              linear_num_value_heads=heads, linear_value_head_dim=head_dim,
              linear_conv_kernel=int(c.get("mamba_d_conv") or 4),
              linear_conv_bias=bool(c.get("mamba_conv_bias", True)),
              linear_chunk=int(c.get("mamba_chunk_size") or 256),
              linear_dt_min=float(low), linear_dt_max=float(high))


def _jamba_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """A Jamba config.json's layer kinds (attention every attn_layer_period-th layer from
  attn_layer_offset, Mamba 1 at the others, as transformers' JambaConfig lays them out),
  its attention without a position embedding and its Mamba 1 fields ({} for other
  classes)."""
  if lm != JAMBA:
    return {}
  if c.get("mamba_proj_bias"):
    raise ValueError(f"mamba_proj_bias=true (biases on a {JAMBA} Mamba layer's in_proj and "
                     "out_proj) is not supported")
  layers, d = int(c["num_hidden_layers"]), int(c["hidden_size"])
  period, offset = int(c["attn_layer_period"]), int(c["attn_layer_offset"])
  rank = c["mamba_dt_rank"]
  return dict(
      layer_types=tuple("full_attention" if i % period == offset else "linear_attention"
                        for i in range(layers)),
      rope_layers=(0,) * layers, linear_mixer="mamba1", linear_num_key_heads=1,
      linear_key_head_dim=int(c["mamba_d_state"]),
      linear_num_value_heads=int(c["mamba_expand"]) * d, linear_value_head_dim=1,
      linear_conv_kernel=int(c["mamba_d_conv"]),
      linear_conv_bias=bool(c["mamba_conv_bias"]),
      linear_dt_rank=math.ceil(d / 16) if rank == "auto" else int(rank),
      linear_bcdt_norm="weighted", linear_bcdt_norm_eps=float(c["rms_norm_eps"]))


def _jamba_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """A Jamba config.json's own fields (`_jamba_from_hf`'s and the mixture's inverse); the
  layers' pattern is `_jamba_attention_period`'s."""
  period, offset = _jamba_attention_period(cfg)
  step = cfg.moe_layer_step if cfg.num_experts else 1
  return dict(
      num_experts=cfg.num_experts or 1, num_experts_per_tok=cfg.num_experts_per_tok or 2,
      expert_layer_period=step, expert_layer_offset=step - 1, attn_layer_period=period,
      attn_layer_offset=offset, mamba_d_state=cfg.linear_key_head_dim,
      mamba_d_conv=cfg.linear_conv_kernel,
      mamba_expand=cfg.linear_num_value_heads // cfg.d_model,
      mamba_dt_rank=cfg.linear_dt_rank, mamba_conv_bias=cfg.linear_conv_bias,
      mamba_proj_bias=False, output_router_logits=bool(cfg.router_aux_loss_coef),
      router_aux_loss_coef=cfg.router_aux_loss_coef or 0.001, use_mamba_kernels=False)


def _jamba_attention_period(cfg: ModelConfig) -> tuple[int, int]:
  """(attn_layer_period, attn_layer_offset) of a model Jamba can hold: its attention
  layers exactly those i with i % period == offset (offset < period); ValueError
  otherwise."""
  kinds = ["full_attention" if full else "linear_attention" for full in cfg.attention_layers]
  for period in range(1, cfg.num_layers + 1):
    for offset in range(period):
      if kinds == ["full_attention" if i % period == offset else "linear_attention"
                   for i in range(cfg.num_layers)]:
        return period, offset
  raise ValueError(f"layer_types {cfg.layer_types} cannot be written as {JAMBA}, whose "
                   "attention layers are every attn_layer_period-th layer from "
                   "attn_layer_offset")


def _bamba_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """A Bamba config.json's layer kinds (attention at attn_layer_indices, Mamba2 at the
  others) and Mamba2 fields ({} for other classes)."""
  if lm != BAMBA:
    return {}
  layers = int(c["num_hidden_layers"])
  attention = [int(i) for i in c.get("attn_layer_indices") or ()]
  if any(not 0 <= i < layers for i in attention):
    raise ValueError(f"attn_layer_indices={attention} in a {BAMBA} config.json: each must "
                     f"be a layer, 0 to {layers - 1}")
  if float(c.get("z_loss_coefficient") or 0.0):
    raise ValueError(f"z_loss_coefficient={c['z_loss_coefficient']} (a training loss on the "
                     "logits' log-sum-exp) is not supported")
  kinds = ["attention" if i in attention else "mamba" for i in range(layers)]
  return _mamba2_from_hf(c, kinds)


# Falcon-H1's config.json scalars that are ModelConfig fields of the same name.
_FALCON_H1_SCALARS = MUP_MULTIPLIERS[:4] + MUP_MULTIPLIERS[6:]


def _falcon_h1_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """A Falcon-H1 config.json's Mamba2 fields and multipliers ({} for other classes)."""
  if lm != FALCON_H1:
    return {}
  # transformers' defaults for keys a file sets to null, but mamba_d_ssm: null there
  # means mamba_expand x hidden_size.
  c = {**c, **{k: v for k, v in _FALCON_H1_DEFAULTS.items()
               if c.get(k) is None and k != "mamba_d_ssm"}}
  if c.get("projectors_bias"):
    raise ValueError("projectors_bias=true (biases on a Falcon-H1 Mamba2 mixer's out_proj) "
                     "is not supported")
  inner = c.get("mamba_d_ssm") or int(c["mamba_expand"]) * int(c["hidden_size"])
  mamba = _mamba2_from_hf({**c, "hidden_size": int(inner), "mamba_expand": 1}, [])
  mamba.pop("layer_types")
  mlp, ssm = (list(c.get(key) or [1.0] * n) for key, n in (("mlp_multipliers", 2),
                                                          ("ssm_multipliers", 5)))
  if len(mlp) != 2 or len(ssm) != 5:
    raise ValueError(f"mlp_multipliers={mlp} and ssm_multipliers={ssm} in a {FALCON_H1} "
                     "config.json must hold 2 and 5 numbers")
  norm = ("none" if not c.get("mamba_rms_norm") else
          "before_gate" if c.get("mamba_norm_before_gate") else "after_gate")
  return dict(
      **mamba, parallel_mixer=True, linear_norm=norm,
      embedding_multiplier=float(c["embedding_multiplier"]),
      **{name: float(c[name]) for name in _FALCON_H1_SCALARS},
      mlp_gate_multiplier=float(mlp[0]), mlp_down_multiplier=float(mlp[1]),
      ssm_multipliers=() if all(float(m) == 1.0 for m in ssm) else
      tuple(float(m) for m in ssm))


# Nemotron-H's layer kinds: layers_block_type's names (transformers 5), or the letters of
# hybrid_override_pattern (the published config.json files).
_NEMOTRON_H_LETTERS = {"linear_attention": "M", "full_attention": "*", "mlp": "-",
                       "moe": "E"}
_NEMOTRON_H_LAYER_TYPES = {**{k: k for k in _NEMOTRON_H_LETTERS},
                           **{c: k for k, c in _NEMOTRON_H_LETTERS.items()}}
# Nemotron-H config.json keys and the older names of a few (transformers reads both).
_NEMOTRON_H_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv",
                       "expand": "mamba_expand", "time_step_min": "mamba_dt_min",
                       "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size"}


def _nemotron_h_from_hf(c: dict[str, Any]) -> ModelConfig:
  """The ModelConfig of a Nemotron-H config.json, read as transformers' NemotronHConfig
  reads it (its defaults where a key is left out; a Mamba2 layer's time step clipped
  below at time_step_min, as its mixer does, whatever time_step_limit says)."""
  def get(key, default):
    value = c.get(key)
    if value is None:
      value = c.get(_NEMOTRON_H_ALIASES.get(key, key))
    return default if value is None else value

  kinds = c.get("layers_block_type") or c.get("layer_types")
  if not kinds and c.get("hybrid_override_pattern"):
    kinds = list(c["hybrid_override_pattern"])
  kinds = list(kinds or ["linear_attention", "moe", "full_attention", "mlp"])
  bad = sorted({str(k) for k in kinds if k not in _NEMOTRON_H_LAYER_TYPES})
  if bad:
    raise ValueError(f"layers_block_type entries {bad} in a {NEMOTRON_H} config.json: "
                     f"expected linear_attention (M), full_attention (*), mlp (-) or moe (E)")
  kinds = [_NEMOTRON_H_LAYER_TYPES[k] for k in kinds]
  for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
    if get(key, want) != want:
      raise ValueError(f"{key}={c[key]!r} in a {NEMOTRON_H} config.json is not supported "
                       f"(expected {want})")
  for key in ("mlp_bias", "use_bias", "mamba_proj_bias"):
    if c.get(key):
      raise ValueError(f"{key}=true (biases on a {NEMOTRON_H} layer's projections) is not "
                       "supported")
  d = int(c.get("hidden_size") or 4096)
  heads = int(get("mamba_num_heads", 128))
  head_dim = int(get("mamba_head_dim", 64))
  pad = c.get("pad_token_id", 0)
  dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
  layers = len(kinds)
  mlp_width = int(c.get("intermediate_size") or 21_504)
  mixture = {}
  if "moe" in kinds:  # Nemotron 3: sigmoid-routed experts without a gate, a shared expert
    mixture = dict(
        num_experts=int(get("n_routed_experts", 8)),
        num_experts_per_tok=int(get("num_experts_per_tok", 2)),
        ffn_dim=int(get("moe_intermediate_size", 7688)),
        shared_expert_dim=int(get("moe_shared_expert_intermediate_size", 7688)),
        dense_ffn_dim=mlp_width if "mlp" in kinds else 0,
        norm_topk_prob=bool(get("norm_topk_prob", True)), router_scoring="sigmoid",
        router_groups=int(get("n_group", 1)), router_group_topk=int(get("topk_group", 1)),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        moe_latent_dim=int(get("moe_latent_size", 0)))
  return ModelConfig(
      vocab_size=int(c.get("vocab_size") or 131_072), d_model=d, num_layers=layers,
      num_heads=int(c.get("num_attention_heads") or 32),
      num_kv_heads=int(c.get("num_key_value_heads") or c.get("num_attention_heads") or 8),
      head_dim=int(c.get("head_dim") or 128), ffn_dim=mixture.pop("ffn_dim", mlp_width),
      norm_eps=float(get("layer_norm_epsilon", 1e-5)),
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      max_position_embeddings=int(c.get("max_position_embeddings") or 4096),
      architecture=NEMOTRON_H, dtype=dtype, param_dtype=dtype,
      pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else None,
      layer_types=tuple(kinds),
      rope_layers=(0,) * layers, mlp_activation="relu2", linear_mixer="mamba2",
      linear_num_key_heads=int(get("n_groups", 8)),
      linear_key_head_dim=int(get("ssm_state_size", 128)),
      linear_num_value_heads=heads, linear_value_head_dim=head_dim,
      linear_conv_kernel=int(get("conv_kernel", 4)),
      linear_conv_bias=bool(get("use_conv_bias", True)),
      linear_chunk=int(get("chunk_size", 128)),
      linear_dt_min=float(_json_float(get("time_step_min", 0.001))), **mixture)


def _nemotron_h_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """A Nemotron-H config.json's fields (`_nemotron_h_from_hf`'s inverse), the layers'
  kinds both ways they are read (layers_block_type, hybrid_override_pattern)."""
  heads, head_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
  mixture = {}
  if cfg.num_experts:  # Nemotron 3's mixture layers (no aux loss: transformers has none)
    mixture = dict(
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.ffn_dim,
        moe_shared_expert_intermediate_size=cfg.shared_expert_dim, n_shared_experts=1,
        norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.router_groups,
        topk_group=cfg.router_group_topk,
        routed_scaling_factor=cfg.routed_scaling_factor,
        moe_latent_size=cfg.moe_latent_dim or None)
  return dict(
      layers_block_type=list(cfg.layer_types),
      hybrid_override_pattern="".join(_NEMOTRON_H_LETTERS[k] for k in cfg.layer_types),
      intermediate_size=cfg.dense_ffn_dim if cfg.num_experts else cfg.ffn_dim, **mixture,
      layer_norm_epsilon=cfg.norm_eps, mlp_hidden_act="relu2", mamba_hidden_act="silu",
      mlp_bias=False, use_bias=False, attention_bias=False, mamba_num_heads=heads,
      mamba_head_dim=head_dim, expand=max(1, heads * head_dim // cfg.d_model),
      n_groups=cfg.linear_num_key_heads, ssm_state_size=cfg.linear_key_head_dim,
      conv_kernel=cfg.linear_conv_kernel, use_conv_bias=cfg.linear_conv_bias,
      chunk_size=cfg.linear_chunk, time_step_min=cfg.linear_dt_min,
      time_step_limit=[0.0, _float_to_json(float("inf"))], residual_in_fp32=False,
      num_nextn_predict_layers=0)


def _mamba2_lm_from_hf(c: dict[str, Any]) -> ModelConfig:
  """The ModelConfig of a Mamba2ForCausalLM config.json, read as transformers' Mamba2Config
  reads it (its defaults where a key is left out). The attention fields, which no layer
  uses, are those of one head of the Mamba2 heads' width."""
  get = _mamba_lm_getter(c, MAMBA2)
  d = int(get("hidden_size", 4096))
  heads, head_dim = int(get("num_heads", 128)), int(get("head_dim", 64))
  expand = get("expand", 2)
  if d * expand != heads * head_dim:
    raise ValueError(f"a {MAMBA2} config.json with hidden_size * expand ({d} * {expand}) "
                     f"!= num_heads * head_dim ({heads} * {head_dim})")
  low, high = (_json_float(x) for x in get("time_step_limit", (0.0, float("inf"))))
  pad = c["pad_token_id"] if "pad_token_id" in c else 1  # null: none
  dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
  layers = int(get("num_hidden_layers", 64))
  return ModelConfig(
      vocab_size=int(get("vocab_size", 32_768)), d_model=d, num_layers=layers, num_heads=1,
      num_kv_heads=1, head_dim=head_dim + head_dim % 2, ffn_dim=0,
      norm_eps=float(get("layer_norm_epsilon", 1e-5)),
      tie_embeddings=bool(get("tie_word_embeddings", False)), architecture=MAMBA2,
      dtype=dtype, param_dtype=dtype,
      pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else None,
      layer_types=("linear_attention",) * layers, rope_layers=(0,) * layers,
      linear_mixer="mamba2", linear_num_key_heads=int(get("n_groups", 8)),
      linear_key_head_dim=int(get("state_size", 128)), linear_num_value_heads=heads,
      linear_value_head_dim=head_dim, linear_conv_kernel=int(get("conv_kernel", 4)),
      linear_conv_bias=bool(get("use_conv_bias", True)),
      linear_chunk=int(get("chunk_size", 256)), linear_dt_min=float(low),
      linear_dt_max=float(high), residual_fp32=bool(get("residual_in_fp32", True)))


def _mamba_lm_getter(c: dict[str, Any], lm: str) -> Callable[[str, Any], Any]:
  """get(key, default) of a Mamba / Mamba2 causal LM's config.json (the default where a
  key is left out or null), after refusing what those mixers do not run here: an
  activation other than SiLU, biases on in_proj and out_proj (use_bias)."""
  def get(key, default):
    return default if c.get(key) is None else c[key]

  if get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act={c['hidden_act']!r} in a {lm} config.json is not "
                     "supported (expected silu)")
  if c.get("use_bias"):
    raise ValueError(f"use_bias=true (biases on a {lm} layer's in_proj and out_proj) is "
                     "not supported")
  return get


def _mamba1_from_hf(c: dict[str, Any], lm: str) -> ModelConfig:
  """The ModelConfig of a MambaForCausalLM / FalconMambaForCausalLM config.json, read as
  transformers' MambaConfig / FalconMambaConfig reads it (its defaults where a key is
  left out: time_step_rank "auto" is ceil(hidden_size / 16)). The attention fields,
  which no layer uses, are one head of width 2."""
  get = _mamba_lm_getter(c, lm)
  d = int(get("hidden_size", 768))
  rank = get("time_step_rank", "auto")
  rank = math.ceil(d / 16) if rank == "auto" else int(rank)
  pad = c["pad_token_id"] if "pad_token_id" in c else 0  # null: none
  dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
  layers = int(get("num_hidden_layers", 32))
  return ModelConfig(
      vocab_size=int(get("vocab_size", 50_280)), d_model=d, num_layers=layers, num_heads=1,
      num_kv_heads=1, head_dim=2, ffn_dim=0, norm_eps=float(get("layer_norm_epsilon", 1e-5)),
      tie_embeddings=bool(get("tie_word_embeddings", True)), architecture=lm, dtype=dtype,
      param_dtype=dtype,
      pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else None,
      layer_types=("linear_attention",) * layers, rope_layers=(0,) * layers,
      linear_mixer="mamba1", linear_num_key_heads=1,
      linear_key_head_dim=int(get("state_size", 16)),
      linear_num_value_heads=int(get("expand", 2) * d), linear_value_head_dim=1,
      linear_conv_kernel=int(get("conv_kernel", 4)),
      linear_conv_bias=bool(get("use_conv_bias", True)), linear_dt_rank=rank,
      linear_bcdt_norm="weightless" if lm == FALCON_MAMBA else "none",
      linear_bcdt_norm_eps=float(get("mixer_rms_eps", 1e-6)),
      residual_fp32=bool(get("residual_in_fp32", True)))


def _mamba1_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """A MambaForCausalLM / FalconMambaForCausalLM config.json's fields
  (`_mamba1_from_hf`'s inverse)."""
  out = dict(state_size=cfg.linear_key_head_dim,
             expand=cfg.linear_num_value_heads // cfg.d_model,
             conv_kernel=cfg.linear_conv_kernel, use_conv_bias=cfg.linear_conv_bias,
             use_bias=False, hidden_act="silu", layer_norm_epsilon=cfg.norm_eps,
             time_step_rank=cfg.linear_dt_rank, residual_in_fp32=cfg.residual_fp32)
  if cfg.linear_bcdt_norm != "none":
    out["mixer_rms_eps"] = cfg.linear_bcdt_norm_eps
  return out


def _check_mamba1(cfg: ModelConfig, lm: str) -> None:
  """What a MambaForCausalLM / FalconMambaForCausalLM holds: Mamba 1 layers alone
  (ffn_dim=0), d_inner a whole multiple of d_model, the norms on dt, B and C exactly in
  FalconMamba."""
  if (set(cfg.layer_types) != {"linear_attention"} or cfg.ffn_dim
      or cfg.linear_mixer != "mamba1"):
    raise ValueError(f"layer_types {sorted(set(cfg.layer_types))} with ffn_dim={cfg.ffn_dim} "
                     f"and linear_mixer={cfg.linear_mixer!r} cannot be written as {lm}, "
                     "whose layers are Mamba 1 mixers alone")
  if cfg.linear_num_value_heads % cfg.d_model:
    raise ValueError(f"linear_num_value_heads={cfg.linear_num_value_heads} (d_inner) cannot "
                     f"be written as {lm}, whose d_inner is expand times d_model="
                     f"{cfg.d_model}")
  if cfg.linear_bcdt_norm != ("weightless" if lm == FALCON_MAMBA else "none"):
    raise ValueError(f"linear_bcdt_norm={cfg.linear_bcdt_norm!r} cannot be written as {lm}; "
                     f"{FALCON_MAMBA} norms dt, B and C, and only it")


def _check_jamba(cfg: ModelConfig) -> None:
  """What a JambaForCausalLM holds: Mamba 1 layers with weighted norms on dt, B and C (eps
  its rms_norm_eps), attention in a period (`_jamba_attention_period`) without a
  position embedding, and mixtures every moe_layer_step-th layer as wide as its MLPs."""
  _jamba_attention_period(cfg)
  if cfg.head_dim * cfg.num_heads != cfg.d_model:
    raise ValueError(f"head_dim={cfg.head_dim} cannot be written as {JAMBA}, whose heads "
                     f"split d_model={cfg.d_model} (num_heads={cfg.num_heads})")
  if cfg.linear_bcdt_norm != "weighted" or cfg.linear_bcdt_norm_eps != cfg.norm_eps:
    raise ValueError(f"linear_bcdt_norm={cfg.linear_bcdt_norm!r} (eps "
                     f"{cfg.linear_bcdt_norm_eps}) cannot be written as {JAMBA}, whose dt, B "
                     f"and C norms are weighted, with its rms_norm_eps ({cfg.norm_eps})")
  if cfg.linear_num_value_heads % cfg.d_model:
    raise ValueError(f"linear_num_value_heads={cfg.linear_num_value_heads} (d_inner) cannot "
                     f"be written as {JAMBA}, whose d_inner is mamba_expand times d_model="
                     f"{cfg.d_model}")
  if cfg.rope_layers != (0,) * cfg.num_layers:
    raise ValueError(f"rope_layers={cfg.rope_layers} cannot be written as {JAMBA}, whose "
                     "attention has no position embedding (rope_layers all 0)")
  if cfg.num_experts and (cfg.dense_layers or cfg.moe_layer_step > 1
                          and cfg.dense_ffn_dim != cfg.ffn_dim):
    raise ValueError(f"dense_layers={cfg.dense_layers}, dense_ffn_dim={cfg.dense_ffn_dim} "
                     f"cannot be written as {JAMBA}, whose mixtures are every "
                     "expert_layer_period-th layer from the first period's last, its MLPs "
                     "as wide as its experts (intermediate_size)")


def _check_mamba2_lm(cfg: ModelConfig) -> None:
  """What a Mamba2ForCausalLM holds: Mamba2 layers alone (ffn_dim=0), without biases on
  in_proj and out_proj, the mixers' width a whole multiple of d_model."""
  if set(cfg.layer_types) != {"linear_attention"} or cfg.ffn_dim:
    raise ValueError(f"layer_types {sorted(set(cfg.layer_types))} with ffn_dim="
                     f"{cfg.ffn_dim} cannot be written as {MAMBA2}, whose layers are "
                     "Mamba2 mixers alone (linear_attention layers, ffn_dim=0)")
  width = cfg.linear_num_value_heads * cfg.linear_value_head_dim
  if width % cfg.d_model:
    raise ValueError(f"Mamba2 layers {width} wide (linear_num_value_heads * "
                     f"linear_value_head_dim) cannot be written as {MAMBA2}, whose width "
                     f"is expand times d_model={cfg.d_model}")


def _mamba2_lm_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """A Mamba2ForCausalLM config.json's fields (`_mamba2_lm_from_hf`'s inverse)."""
  heads, head_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
  return dict(
      num_heads=heads, head_dim=head_dim, expand=heads * head_dim // cfg.d_model,
      state_size=cfg.linear_key_head_dim, n_groups=cfg.linear_num_key_heads,
      conv_kernel=cfg.linear_conv_kernel, use_conv_bias=cfg.linear_conv_bias,
      use_bias=False, hidden_act="silu", layer_norm_epsilon=cfg.norm_eps,
      chunk_size=cfg.linear_chunk, residual_in_fp32=cfg.residual_fp32,
      time_step_limit=[_float_to_json(cfg.linear_dt_min), _float_to_json(cfg.linear_dt_max)])


_LFM2_LAYER_TYPES = {"full_attention": "full_attention", "conv": "linear_attention"}


def _lfm2_ffn_dim(c: dict[str, Any]) -> int:
  """The width of an LFM2 config.json's feed_forward, as transformers' Lfm2MLP sizes it:
  with block_auto_adjust_ff_dim, 2/3 of intermediate_size (block_ff_dim in the published
  files) times block_ffn_dim_multiplier, rounded up to block_multiple_of."""
  size = int(c["block_ff_dim"] if "block_ff_dim" in c else c.get("intermediate_size", 12_288))
  if c.get("block_auto_adjust_ff_dim", True):
    size = int(2 * size / 3)
    multiplier = c.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
      step = int(c.get("block_multiple_of", 256))
      size = step * ((int(float(multiplier) * size) + step - 1) // step)
  return size


def _lfm2_from_hf(c: dict[str, Any], lm: str = LFM2) -> ModelConfig:
  """The ModelConfig of an LFM2 / LFM2-MoE config.json, read as transformers' Lfm2Config
  reads it (its defaults where a key is left out; layer_types, else attention at
  full_attn_idxs, else at every layer; the published files' tie_embedding and
  block_ff_dim above tie_word_embeddings and intermediate_size); LFM2-MoE's mixture."""
  if lm == LFM2_MOE:
    c = {"hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
         "num_dense_layers": 2, "num_experts_per_tok": 4, "num_experts": 32,
         "use_expert_bias": True, "routed_scaling_factor": 1.0, "norm_topk_prob": True, **c}
  layers = int(c.get("num_hidden_layers") or 32)
  kinds = c.get("layer_types")
  if kinds is None:
    attention = c.get("full_attn_idxs")
    attention = range(layers) if attention is None else [int(i) for i in attention]
    kinds = ["full_attention" if i in attention else "conv" for i in range(layers)]
  kinds = list(kinds)
  if len(kinds) != layers or not set(kinds) <= set(_LFM2_LAYER_TYPES):
    raise ValueError(f"layer_types={kinds!r} in an {LFM2} config.json: expected "
                     f"full_attention or conv for each of the {layers} layers")
  d = int(c.get("hidden_size") or 2560)
  heads = int(c.get("num_attention_heads") or 32)
  moe: dict[str, Any] = dict(ffn_dim=_lfm2_ffn_dim(c))
  if lm == LFM2_MOE:  # its dense layers' width as it is (no auto adjustment)
    dense = int(c["num_dense_layers"])
    moe = dict(ffn_dim=int(c["moe_intermediate_size"]), num_experts=int(c["num_experts"]),
               num_experts_per_tok=int(c["num_experts_per_tok"]),
               norm_topk_prob=bool(c["norm_topk_prob"]), router_scoring="sigmoid",
               router_correction_bias=bool(c["use_expert_bias"]),
               routed_scaling_factor=float(c["routed_scaling_factor"]), dense_layers=dense,
               dense_ffn_dim=int(c["intermediate_size"]) if dense else 0,
               **_aux_loss_from_hf(c))
  tie = c["tie_embedding"] if "tie_embedding" in c else c.get("tie_word_embeddings", True)
  rope, _ = _rope_from_hf({"rope_theta": 1_000_000.0, **c}, LFM2)
  pad = c.get("pad_token_id", 0)
  dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
  return ModelConfig(
      vocab_size=int(c.get("vocab_size") or 65_536), d_model=d, num_layers=layers,
      num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or 8),
      head_dim=int(c.get("head_dim") or d // heads), rope=rope, **moe,
      norm_eps=float(c.get("norm_eps", 1e-5)), tie_embeddings=bool(tie), qk_norm=True,
      max_position_embeddings=int(c.get("max_position_embeddings") or 128_000),
      architecture=lm, dtype=dtype, param_dtype=dtype,
      pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else None,
      layer_types=tuple(_LFM2_LAYER_TYPES[k] for k in kinds), linear_mixer="short_conv",
      linear_conv_kernel=int(c.get("conv_L_cache") or 3),
      linear_conv_bias=bool(c.get("conv_bias", False)))


def _lfm2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """An LFM2 config.json's own fields (`_lfm2_from_hf`'s inverse): the MLP's width as it
  is (no auto adjustment), the layers' kinds."""
  rope = cfg.rope
  mixture = {} if not cfg.num_experts else dict(
      intermediate_size=cfg.dense_ffn_dim or cfg.ffn_dim, moe_intermediate_size=cfg.ffn_dim,
      num_dense_layers=cfg.dense_layers, num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
      use_expert_bias=cfg.router_correction_bias,
      routed_scaling_factor=cfg.routed_scaling_factor,
      output_router_logits=bool(cfg.router_aux_loss_coef))
  return dict(
      **mixture,
      norm_eps=cfg.norm_eps, rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                              **(_rope_scaling(rope) or {})},
      layer_types=["conv" if linear else "full_attention" for linear in cfg.linear_layers],
      full_attn_idxs=[i for i, linear in enumerate(cfg.linear_layers) if not linear],
      conv_L_cache=cfg.linear_conv_kernel, conv_bias=cfg.linear_conv_bias,
      block_auto_adjust_ff_dim=False, block_ffn_dim_multiplier=1.0, block_multiple_of=256)


def _mamba2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The mamba_* entries of a Granite 4 or Bamba config.json (`_mamba2_from_hf`'s
  inverse)."""
  heads, head_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
  if heads * head_dim % cfg.d_model:
    raise ValueError(f"linear_num_value_heads x linear_value_head_dim = {heads * head_dim} "
                     f"cannot be written as {cfg.architecture}: it must be a multiple "
                     f"(mamba_expand) of d_model={cfg.d_model}")
  return dict(mamba_n_heads=heads, mamba_d_head=head_dim,
              mamba_expand=heads * head_dim // cfg.d_model,
              mamba_n_groups=cfg.linear_num_key_heads, mamba_d_state=cfg.linear_key_head_dim,
              mamba_d_conv=cfg.linear_conv_kernel, mamba_conv_bias=cfg.linear_conv_bias,
              mamba_proj_bias=False, mamba_chunk_size=cfg.linear_chunk,
              time_step_limit=[_float_to_json(cfg.linear_dt_min),
                               _float_to_json(cfg.linear_dt_max)])


def _json_float(x: Any) -> float:
  """A float of a config.json: a number, or transformers' {"__float__": "Infinity"} (its
  strict-JSON form of inf, -inf and NaN)."""
  if isinstance(x, dict) and set(x) == {"__float__"}:
    return float(x["__float__"])
  return float(x)


def _float_to_json(x: float) -> Any:
  """`_json_float`'s inverse: inf, -inf and NaN in transformers' strict-JSON form."""
  return x if np.isfinite(x) else {"__float__": {np.inf: "Infinity", -np.inf: "-Infinity"}
                                   .get(x, "NaN")}


def _llama4_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The attention fields of a Llama 4 config.json ({} for other classes), read as
  transformers does: no_rope_layers (1: rotary) by default a NoPE layer every
  no_rope_layer_interval-th; layer_types by default the rotary layers chunked
  (chunked_attention) when attention_chunk_size is set. Ours hold the chunked layers as
  sliding layers whose window is the chunk (their caches rings of it)."""
  if lm != LLAMA4:
    return {}
  layers = int(c["num_hidden_layers"])
  interval = int(c.get("no_rope_layer_interval") or 4)
  rope = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
  if len(rope) != layers:
    raise ValueError(f"no_rope_layers has {len(rope)} entries for {layers} layers")
  chunk = int(c.get("attention_chunk_size") or 0)
  types = list(c.get("layer_types") or ["chunked_attention" if r and chunk
                                        else "full_attention" for r in rope])
  if len(types) != layers or not set(types) <= {"chunked_attention", "full_attention"} or (
      "chunked_attention" in types and not chunk):
    raise ValueError(f"layer_types={types!r} in a Llama 4 config.json is not supported: "
                     f"one chunked_attention (with attention_chunk_size) or full_attention "
                     f"entry for each of the {layers} layers")
  window = {}
  if "chunked_attention" in types:
    window = dict(sliding_window=chunk, layer_types=tuple(
        "sliding_attention" if t == "chunked_attention" else t for t in types))
  return dict(rope_layers=tuple(int(r) for r in rope), qk_l2_norm=bool(c["use_qk_norm"]),
              attention_chunk_size=chunk if window else 0, **window,
              attn_temperature_tuning=bool(c["attn_temperature_tuning"]),
              attn_floor_scale=float(c["floor_scale"]), attn_scale=float(c["attn_scale"]))


def _linear_attention_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of a Qwen3.5 config.json ({} for other classes): layer_types
  (by default every full_attention_interval-th layer full, the others linear)."""
  if lm not in _QWEN3_5S:
    return {}
  layers = int(c["num_hidden_layers"])
  interval = int(c.get("full_attention_interval") or 4)
  types = c.get("layer_types") or ["linear_attention" if (i + 1) % interval
                                   else "full_attention" for i in range(layers)]
  return dict(layer_types=tuple(types), norm_unit_offset=True, attn_output_gate=True,
              linear_num_key_heads=int(c["linear_num_key_heads"]),
              linear_num_value_heads=int(c["linear_num_value_heads"]),
              linear_key_head_dim=int(c["linear_key_head_dim"]),
              linear_value_head_dim=int(c["linear_value_head_dim"]),
              linear_conv_kernel=int(c["linear_conv_kernel_dim"]))


# The published MiniMax-M2 config.json's keys for what transformers' class always computes:
# key -> (the value that says so, what another value would need).
_MINIMAX_M2_FIXED = {
    "use_qk_norm": (True, "attention without q/k norms"),
    "qk_norm_type": ("per_layer", "q/k norms per head"),
    "scoring_func": ("sigmoid", "another router scoring"),
    "use_routing_bias": (True, "a router without its correction bias"),
    "shared_intermediate_size": (0, "a shared expert"),
}


def _minimax_m2_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """qk_norm_heads of a MiniMax-M2 config.json ({} for other families); its published
  keys may only repeat what MiniMaxM2ForCausalLM computes, and attn_type_list only name
  full-attention layers (1; MiniMax-Text-01's lightning attention is 0)."""
  if lm != MINIMAX_M2:
    return {}
  for key, (value, other) in _MINIMAX_M2_FIXED.items():
    if c.get(key) is not None and c[key] != value:
      raise ValueError(f"{key}={c[key]!r} in a MiniMax-M2 config.json ({other}) is not "
                       f"supported; MiniMaxM2ForCausalLM has {key}={value!r}")
  kinds = c.get("attn_type_list") or []
  if any(kind != 1 for kind in kinds):
    raise ValueError(f"attn_type_list with {sorted(set(kinds) - {1})} (lightning attention "
                     "layers) is not supported; MiniMaxM2ForCausalLM's layers are all "
                     "full attention (1)")
  return {"qk_norm_heads": True}


def _olmoe_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """qk_norm_heads and clip_qkv (after the q/k norms) of an OLMoE config.json ({} for
  other families)."""
  if lm != OLMOE:
    return {}
  if c.get("clip_qkv") is None:
    return {"qk_norm_heads": True}
  return {"qk_norm_heads": True, "clip_qkv": float(c["clip_qkv"]), "clip_qkv_after_norm": True}


def _latent_attention_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """Multi-head latent attention's ModelConfig fields of a DeepSeek-V2 / V3 config.json
  ({} for other classes)."""
  if lm not in _DEEPSEEKS:
    return {}
  if c.get("attention_bias"):
    raise ValueError("attention_bias=true in a DeepSeek config.json is not supported")
  if not c.get("rope_interleave", True):
    raise ValueError("rope_interleave=false in a DeepSeek-V3 config.json is not supported "
                     "(DeepSeek's and Kimi's files hold interleaved rotary features)")
  out = {"kv_lora_rank": int(c["kv_lora_rank"]), "q_lora_rank": int(c["q_lora_rank"] or 0),
         "qk_rope_head_dim": int(c["qk_rope_head_dim"]), "v_head_dim": int(c["v_head_dim"])}
  if lm in _SPARSE_ATTENTION:
    kinds = c.get("indexer_types")
    if c.get("index_topk_pattern") is not None or int(c.get("index_topk_freq", 1) or 1) > 1 \
        or (kinds is not None and any(k != "full" for k in kinds)):
      raise ValueError(f"indexer_types={kinds!r} (index_topk_pattern="
                       f"{c.get('index_topk_pattern')!r}, index_topk_freq="
                       f"{c.get('index_topk_freq')!r}): layers that reuse another layer's "
                       "sparse attention choice are not supported; every layer's own "
                       "indexer ('full') is read")
    out.update(index_topk=int(c["index_topk"]), index_heads=int(c["index_n_heads"]),
               index_head_dim=int(c["index_head_dim"]))
  return out

# Classes whose layers name their MLP feed_forward.
_FEED_FORWARD = (LLAMA4, BAMBA, FALCON_H1, JAMBA) + _LFM2S

# Classes whose config.json attention_bias puts a bias on all four attention projections
# (the output's too); Qwen2 always has q/k/v biases and no output bias, Mistral and
# Mixtral none.
_BIASED_OUTPUT = (("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", MELLUM,
                   "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", LLAMA4,
                   VAULTGEMMA,
                   GRANITE, GRANITE_MOE, GRANITE_HYBRID, FALCON_H1, OLMOE,
                   ARCEE, APERTUS, COHERE, GPT_NEOX, PHI, GPT2, OLMO1, FALCON, OPT,
                   GPT_BIGCODE, BLOOM, PHIMOE)
                  + _COHERES
                  + _HUNYUANS
                  + _SWAS + _PLAIN_MLPS)
# Classes whose attention projections never have biases (transformers ignores a
# config.json's attention_bias there).
_NO_ATTENTION_BIAS = ("MistralForCausalLM", MINISTRAL, CWM, "MixtralForCausalLM", PHI3,
                      QWEN2_MOE, MINIMAX_M2, MINISTRAL3, EXAONE4) + _ERNIES
# Classes with q/k norms (per head; OLMo's and MiniMax-M2's over all heads).
_QK_NORMED = (("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", MELLUM)
              + _QWEN3_5S
              + OLMOS + (MINIMAX_M2, OLMOE, EXAONE4, DOTS1, EXAONE_MOE, APERTUS) + _LFM2S
              + _HUNYUANS)
# Dense Qwen models whose config.json may turn on sliding-window attention
# (use_sliding_window: the layers from max_window_layers on, or as layer_types says).
_QWEN_WINDOWED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Every layer sliding when config.json has a sliding_window (Mistral 7B v0.1's 4096);
# transformers' default where the key is absent.
_ALL_WINDOWED = {"MistralForCausalLM": 4096, "MixtralForCausalLM": None, PHI3: None,
                 PHIMOE: None,
                 MINISTRAL3: None, STARCODER2: None}


def _window_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """sliding_window / layer_types of a Qwen, Mistral or Mixtral config.json ({} without a
  window), read as transformers does: Qwen's window only with use_sliding_window, on the
  layers from max_window_layers on; Mistral's and Mixtral's on every layer."""
  if lm in _ALL_WINDOWED:
    window = c.get("sliding_window", _ALL_WINDOWED[lm])
    return {"sliding_window": int(window)} if window else {}
  if lm in (MELLUM, GPT_NEO):  # the window on the layers layer_types names (none by default)
    types = c.get("layer_types") or ["full_attention"] * int(c["num_hidden_layers"])
    if "sliding_attention" not in types or not c.get("sliding_window"):
      return {}
    return {"sliding_window": int(c["sliding_window"]), "layer_types": tuple(types)}
  if lm in (MINISTRAL, CWM):  # the window on the layers layer_types names, else on all
    window = c.get("sliding_window", 4096)  # (CWM: on three of each four)
    if window is None:
      return {}
    types = c.get("layer_types") or [
        "full_attention" if lm == CWM and i % 4 == 0 else "sliding_attention"
        for i in range(int(c["num_hidden_layers"]))]
    return {"sliding_window": int(window), "layer_types": tuple(types)}
  if lm == DOTS1:  # no use_sliding_window: the window is on from max_window_layers
    layers, window = int(c["num_hidden_layers"]), c.get("sliding_window")
    first = int(c.get("max_window_layers") or layers)
    types = c.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first else "full_attention"
        for i in range(layers)]
    if "sliding_attention" not in types:
      return {}
    return {"sliding_window": int(window), "layer_types": tuple(types)}
  if lm not in _QWEN_WINDOWED or not c.get("use_sliding_window") or not c.get(
      "sliding_window"):
    return {}
  layers = int(c["num_hidden_layers"])
  first = int(c.get("max_window_layers", 28))
  types = c.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                   for i in range(layers)]
  return {"sliding_window": int(c["sliding_window"]), "layer_types": tuple(types)}


def _output_bias_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """attn_out_bias of a class whose attention_bias covers the output projection (of
  Seed-OSS, its own attention_out_bias)."""
  if lm == SEED_OSS:
    return {"attn_out_bias": bool(c.get("attention_out_bias"))}
  if lm == GPT_NEO:  # out_proj's bias alone
    return {"attn_out_bias": True}
  return {"attn_out_bias": bool(c.get("attention_bias"))} if lm in _BIASED_OUTPUT else {}


def _smollm3_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """rope_layers (and a window, with use_sliding_window) of a SmolLM3 config.json, read
  as transformers does ({} for other families)."""
  if lm != SMOLLM3:
    return {}
  layers = int(c["num_hidden_layers"])
  interval = int(c.get("no_rope_layer_interval") or 4)
  rope = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
  out: dict[str, Any] = {"rope_layers": tuple(int(r) for r in rope),
                         "attn_out_bias": bool(c.get("attention_bias", False))}
  window = c.get("sliding_window")
  if c.get("use_sliding_window") and window:
    types = c.get("layer_types") or ["full_attention" if r else "sliding_attention"
                                     for r in rope]
    out.update(sliding_window=int(window), layer_types=tuple(types))
  return out


def _olmo_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of an OLMo 2 / 3 config.json ({} for other families): OLMo
  3's sliding_window / layer_types are every fourth layer full by default; without a
  window every layer is full, as transformers reads it."""
  if lm not in OLMOS:
    return {}
  out = dict(qk_norm_heads=True, output_norms=True,
             attn_out_bias=bool(c.get("attention_bias", False)))
  if lm != "Olmo3ForCausalLM":
    return out
  layers = int(c["num_hidden_layers"])
  types = c.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0
                                   else "sliding_attention" for i in range(layers)]
  window = c.get("sliding_window")
  if not window:
    return {**out, "layer_types": ("full_attention",) * layers}
  return {**out, "sliding_window": int(window), "layer_types": tuple(types)}


def _exaone4_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of an EXAONE 4.0 config.json ({} for other families), read as
  transformers does: with a sliding_window, layer_types (default: every
  sliding_window_pattern-th layer full, the last one too) and only the sliding layers
  rotating; without one, every layer full and rotating."""
  if lm not in (EXAONE4, EXAONE_MOE):
    return {}
  layers = int(c["num_hidden_layers"])
  window = c.get("sliding_window")
  norms = lm == EXAONE4  # K-EXAONE's layers are pre-norm
  if not window:
    return {"output_norms": norms, "layer_types": ("full_attention",) * layers}
  types = c.get("layer_types")
  if not types:
    pattern = c.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):  # "LLLG": local and global layers, repeating
      types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
               for i in range(layers)]
      types[-1] = "full_attention"
    else:
      types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
               for i in range(layers)]
  return {"output_norms": norms, "sliding_window": int(window), "layer_types": tuple(types),
          "rope_layers": tuple(int(t == "sliding_attention") for t in types)}


def _cohere2_moe_prefix_pattern(cfg: ModelConfig) -> int:
  """The prefix_dense_sliding_window_pattern a Cohere2-MoE config.json says for `cfg`: 1
  where its leading dense layers' full layers rotate, 2 where they do not (layer_types
  names the kinds either way; the others rotate in their sliding layers alone)."""
  rope = tuple(cfg.rope_layers or (1,) * cfg.num_layers)
  for pattern in (1, 2):
    want = tuple(int(s or (pattern == 1 and i < cfg.dense_layers))
                 for i, s in enumerate(cfg.sliding_layers))
    if rope == want:
      return pattern
  raise ValueError(f"rope_layers={cfg.rope_layers} cannot be written as {cfg.architecture}, "
                   "whose sliding layers rotate, its full ones do not, but for its leading "
                   "dense layers' full ones (all of them or none)")


def _cohere2_dense_layers(c: dict[str, Any]) -> int:
  """How many of a Cohere2-MoE config.json's layers lead as dense ones (mlp_layer_types,
  else first_k_dense_replace); dense layers after a mixture layer are an error."""
  layers = int(c["num_hidden_layers"])
  kinds = c.get("mlp_layer_types") or (
      ["dense"] * int(c.get("first_k_dense_replace") or 0)
      + ["sparse"] * (layers - int(c.get("first_k_dense_replace") or 0)))
  dense = kinds.index("sparse") if "sparse" in kinds else len(kinds)
  if len(kinds) != layers or any(k != "sparse" for k in kinds[dense:]):
    raise ValueError(f"mlp_layer_types={kinds!r} in a {COHERE2_MOE} config.json: dense layers "
                     "other than the first few are not supported")
  return dense


def _cohere2_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of a Cohere / Cohere2 config.json ({} for other families), read
  as transformers does: Cohere2's layer_types (default: every sliding_window_pattern-th
  layer full, 4), the sliding layers rotating and the full ones not."""
  if lm == COHERE:
    return dict(layer_norm=True, parallel_residual=True,
                lm_head_multiplier=float(c["logit_scale"]),
                qk_norm_head_weights=bool(c["use_qk_norm"]))
  if lm not in _COHERES:
    return {}
  layers = int(c["num_hidden_layers"])
  dense = _cohere2_dense_layers(c) if lm == COHERE2_MOE else 0
  if c.get("layer_types"):
    types = list(c["layer_types"])
  else:
    prefix = int(c.get("prefix_dense_sliding_window_pattern") or 1)
    pattern = int(c.get("sliding_window_pattern") or 4)
    types = ([("sliding_attention" if (i + 1) % prefix else "full_attention")
              for i in range(dense)]
             + [("sliding_attention" if (i + 1) % pattern else "full_attention")
                for i in range(layers - dense)])
  # The dense prefix rotates in every layer where its own pattern is 1 (all full).
  forced = lm == COHERE2_MOE and int(c.get("prefix_dense_sliding_window_pattern") or 1) == 1
  rope = [int(t == "sliding_attention" or (forced and i < dense)) for i, t in enumerate(types)]
  out = dict(layer_norm=lm == COHERE2 or bool(c.get("_layer_norm")), parallel_residual=True,
             lm_head_multiplier=float(c["logit_scale"]), layer_types=tuple(types),
             rope_layers=tuple(rope))
  if "sliding_attention" in types:
    out["sliding_window"] = int(c["sliding_window"])
  return out


def _nanochat_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of a nanochat config.json ({} for other families)."""
  if lm != NANOCHAT:
    return {}
  cap = c.get("final_logit_softcapping")
  return dict(norm_weightless=True, embed_norm=True, qk_l2_norm=True,
              mlp_activation="relu2", final_logit_softcap=None if cap is None else float(cap))


def _stablelm_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of a StableLM config.json ({} for other families)."""
  if lm != STABLELM:
    return {}
  return dict(layer_norm=True, norm_bias=True, qk_norm_head_weights=bool(c["qk_layernorm"]),
              parallel_residual=bool(c["use_parallel_residual"]))


def _ungated_gelu_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of a GPT-NeoX, Phi or GPT-2 config.json ({} for other
  families)."""
  if lm not in _UNGATED_GELU_CLASSES:
    return {}
  parallel = (lm in (PHI,) + _GPTJS or (lm == GPT_NEOX and bool(c["use_parallel_residual"]))
              or (lm == FALCON and c["_parallel_norms"] > 0))
  learned = dict(learned_positions=True, rope_layers=(0,) * int(c["num_hidden_layers"]))
  return dict(layer_norm=True, norm_bias=lm != MPT,
              mlp_bias=bool(c["attention_bias"]) if lm in (FALCON, MPT) else True,
              mlp_activation=_UNGATED_GELUS[c["hidden_act"]], parallel_residual=parallel,
              parallel_mlp_norm=parallel and (lm == GPT_NEOX or (
                  lm == FALCON and c["_parallel_norms"] == 2)),
              lm_head_bias=lm in (PHI,) + _GPTJS,
              **(learned if lm in (GPT2, GPT_BIGCODE, GPT_NEO) else {}),
              **({"query_pre_attn_scalar": 1.0} if lm == GPT_NEO else {}))


def _gpt_neo_config(c: dict[str, Any]) -> dict[str, Any]:
  """A GPT-Neo config.json under Llama's keys: its attention_types ([[kinds, repeats],
  ...]) expanded to layer_types, window_size its sliding_window."""
  kinds = [k for kinds, times in c["attention_types"] for _ in range(int(times))
           for k in kinds]
  layers, d, heads = int(c["num_layers"]), int(c["hidden_size"]), int(c["num_heads"])
  if len(kinds) != layers or set(kinds) - {"global", "local"}:
    raise ValueError(f"attention_types={c['attention_types']} in a GPT-Neo config.json must "
                     f"give {layers} layers (num_layers), each global or local")
  return {**c, "num_hidden_layers": layers, "num_attention_heads": heads,
          "num_key_value_heads": heads, "head_dim": d // heads,
          "intermediate_size": int(c["intermediate_size"] or 4 * d),
          "rms_norm_eps": c["layer_norm_epsilon"], "hidden_act": c["activation_function"],
          "attention_bias": False, "sliding_window": int(c["window_size"]),
          "layer_types": ["sliding_attention" if k == "local" else "full_attention"
                          for k in kinds]}


def _bloom_config(c: dict[str, Any]) -> dict[str, Any]:
  """A BLOOM config.json under Llama's keys (n_embed, its oldest name of hidden_size;
  an MLP 4 x hidden_size wide), with residuals taken after the norms refused."""
  if c["apply_residual_connection_post_layernorm"]:
    raise ValueError("apply_residual_connection_post_layernorm=true in a BLOOM config.json "
                     "(each residual taken from the normed input) is not supported")
  d, heads = int(c.get("n_embed") or c["hidden_size"]), int(c["n_head"])
  return {**c, "hidden_size": d, "num_hidden_layers": int(c["n_layer"]),
          "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": d // heads,
          "intermediate_size": 4 * d, "rms_norm_eps": c["layer_norm_epsilon"],
          "hidden_act": "gelu_pytorch_tanh", "attention_bias": True}


# MPT's attn_config as transformers reads it where a config.json leaves a key out.
_MPT_ATTENTION = dict(attn_type="multihead_attention", clip_qkv=None, softmax_scale=None,
                      prefix_lm=False, qk_ln=False, attn_uses_sequence_id=False, alibi=True,
                      alibi_bias_max=8)


def _mpt_config(c: dict[str, Any]) -> dict[str, Any]:
  """An MPT config.json under Llama's keys (its attn_config nested), with what
  transformers' MPT does not run refused: no ALiBi, q/k LayerNorms, multi-query or
  prefix-LM attention, biases, an MLP other than 4 x d_model; and another logit scale
  than 1 / sqrt(head_dim) or slopes than alibi_bias_max 8's, which it ignores."""
  attn = {**_MPT_ATTENTION, **(c.get("attn_config") or {})}
  for key, want, what in (
      ("alibi", True, "learned positions in place of ALiBi"),
      ("qk_ln", False, "q and k LayerNorm-ed"),
      ("prefix_lm", False, "a prefix attended bidirectionally"),
      ("attn_uses_sequence_id", False, "attention within token_type_ids")):
    if bool(attn[key]) != want:
      raise ValueError(f"attn_config.{key}={str(not want).lower()} in an MPT config.json "
                       f"({what}) is not supported")
  if attn["softmax_scale"] is not None:
    raise ValueError(f"attn_config.softmax_scale={attn['softmax_scale']} in an MPT "
                     "config.json is not supported (expected null: 1 / sqrt(head_dim))")
  if float(attn["alibi_bias_max"]) != 8:
    raise ValueError(f"attn_config.alibi_bias_max={attn['alibi_bias_max']} in an MPT "
                     "config.json is not supported: transformers' MPT spreads its slopes "
                     "by 8 whatever it says")
  if attn["attn_type"] != "multihead_attention":
    raise ValueError(f"attn_config.attn_type={attn['attn_type']!r} in an MPT config.json "
                     "is not supported (expected multihead_attention)")
  if not c["no_bias"]:
    raise ValueError("no_bias=false in an MPT config.json (biases on every projection, "
                     "which transformers' MPT does not load) is not supported")
  if int(c["expansion_ratio"]) != 4:
    raise ValueError(f"expansion_ratio={c['expansion_ratio']} in an MPT config.json is not "
                     "supported: transformers' MPT MLP is 4 x d_model wide")
  d, heads = int(c["d_model"]), int(c["n_heads"])
  return {**c, "attn_config": attn, "hidden_size": d, "num_hidden_layers": int(c["n_layers"]),
          "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": d // heads,
          "intermediate_size": 4 * d, "rms_norm_eps": c["layer_norm_epsilon"],
          "hidden_act": "gelu", "attention_bias": False,
          "max_position_embeddings": int(c["max_seq_len"])}


def _alibi_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of ALiBi's families: BLOOM's and MPT's, and Falcon-RW's
  (alibi) ({} for others)."""
  if lm not in (BLOOM, MPT) and not (lm == FALCON and c["alibi"]):
    return {}
  out = dict(alibi=True, alibi_scaled=lm == FALCON,
             rope_layers=(0,) * int(c["num_hidden_layers"]))
  if lm == BLOOM:
    out["embed_norm"] = True
  if lm == MPT:
    clip = c["attn_config"]["clip_qkv"]
    out["clip_qkv"] = None if clip is None else float(clip)
  return out


def _falcon_config(c: dict[str, Any]) -> dict[str, Any]:
  """A Falcon config.json under Llama's keys: its key/value heads (num_kv_heads in the
  new decoder architecture, else one with multi_query, else one a query head), its
  norms beside the attention (`_parallel_norms`: 0 sequential layers, 1 or 2 parallel),
  ALiBi's (alibi) read by `_alibi_from_hf`."""
  new, parallel = bool(c["new_decoder_architecture"]), bool(c["parallel_attn"])
  if new and not parallel:
    raise ValueError("new_decoder_architecture=true with parallel_attn=false in a Falcon "
                     "config.json (sequential layers without their MLP's norm) is not "
                     "supported")
  d = int(c.get("n_embed") or c["hidden_size"])
  heads = int(c["num_attention_heads"])
  kv = int(c["num_kv_heads"] or heads) if new else 1 if c["multi_query"] else heads
  return {**c, "hidden_size": d, "num_key_value_heads": kv, "head_dim": d // heads,
          "intermediate_size": int(c["ffn_hidden_size"] or 4 * d),
          "rms_norm_eps": c["layer_norm_epsilon"], "hidden_act": c["activation"],
          "attention_bias": bool(c["bias"]),
          "_parallel_norms": (int(c["num_ln_in_parallel_attn"] or 2) if new else
                              int(parallel))}


def _gpt2_config(c: dict[str, Any], lm: str) -> dict[str, Any]:
  """A GPT-2, GPT-J or GPTBigCode config.json under Llama's keys (their attribute_map;
  n_inner by default 4 x n_embd), with the options of GPT-2's attention that are not read
  refused, GPT-J's rotated features its rope's partial_rotary_factor (at base 10000),
  GPTBigCode's multi_query one key/value head."""
  d, heads = int(c["n_embd"]), int(c["n_head"])
  out = {**c, "hidden_size": d, "num_hidden_layers": int(c["n_layer"]),
         "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": d // heads,
         "max_position_embeddings": int(c["n_positions"]),
         "intermediate_size": int(c.get("n_inner") or 4 * d),
         "rms_norm_eps": c["layer_norm_epsilon"], "hidden_act": c["activation_function"],
         "attention_bias": lm not in _GPTJS}
  if lm == GPT_BIGCODE and c["multi_query"]:
    out["num_key_value_heads"] = 1
  if lm == CODEGEN and heads % 4:
    raise ValueError(f"n_head={heads} in a CodeGen config.json: its qkv_proj interleaves "
                     "four shards of whole heads, so n_head must be a multiple of 4")
  if lm in _GPTJS:
    if not c.get("rotary_dim"):
      family = "GPT-J" if lm == GPTJ else "CodeGen"
      raise ValueError(f"rotary_dim=null in a {family} config.json (a rotary embedding as "
                       "wide as hidden_size, which transformers cannot apply) is not "
                       "supported")
    return {**out, "rope_theta": 10_000.0, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                                "partial_rotary_factor": int(c["rotary_dim"]) / (d // heads)}}
  for key, refused, what in (
      ("scale_attn_by_inverse_layer_idx", True, "the attention logits divided by the "
       "layer's index + 1"), ("scale_attn_weights", False, "unscaled attention logits"),
      ("add_cross_attention", True, "cross-attention to an encoder")):
    if bool(c.get(key, not refused)) == refused:
      family = "GPT-2" if lm == GPT2 else "GPTBigCode"
      raise ValueError(f"{key}={str(refused).lower()} in a {family} config.json ({what}) "
                       "is not supported")
  return out


def _dbrx_config(c: dict[str, Any]) -> dict[str, Any]:
  """A DBRX config.json (its nested attn_config and ffn_config) under Llama's keys and
  Mixtral's; its rotary base where transformers 5 reads it (rope_parameters, rope_theta),
  else attn_config's rope_theta (the published files'). Another activation than silu, or
  top-k weights normalised by another norm than their sum, are refused."""
  attn = {"clip_qkv": None, "kv_n_heads": 1, **(c.get("attn_config") or {})}
  ffn = {"ffn_hidden_size": 3584, "moe_num_experts": 4, "moe_top_k": 1,
         "moe_normalize_expert_weights": 1.0, "ffn_act_fn": {"name": "silu"},
         "moe_loss_weight": 0.01, **(c.get("ffn_config") or {})}
  if (ffn["ffn_act_fn"] or {}).get("name", "silu") != "silu":
    raise ValueError(f"ffn_act_fn={ffn['ffn_act_fn']!r} in a DBRX config.json is not "
                     "supported (expected silu)")
  norm = ffn["moe_normalize_expert_weights"]
  if norm is not None and float(norm) != 1.0:
    raise ValueError(f"moe_normalize_expert_weights={norm!r} in a DBRX config.json (the "
                     f"top-k weights over their {norm}-norm) is not supported: 1 (over "
                     "their sum) or null (as they are)")
  d, heads = int(c["d_model"]), int(c["n_heads"])
  out = {**c, "hidden_size": d, "num_hidden_layers": int(c["n_layers"]),
         "num_attention_heads": heads, "num_key_value_heads": int(attn["kv_n_heads"]),
         "head_dim": d // heads, "max_position_embeddings": int(c["max_seq_len"]),
         "intermediate_size": int(ffn["ffn_hidden_size"]), "rms_norm_eps": 1e-5,
         "attention_bias": False, "clip_qkv": attn["clip_qkv"],
         "num_local_experts": int(ffn["moe_num_experts"]),
         "num_experts_per_tok": int(ffn["moe_top_k"]), "norm_topk_prob": norm is not None,
         "router_aux_loss_coef": float(ffn["moe_loss_weight"])}
  if not (c.get("rope_parameters") or c.get("rope_theta")) and attn.get("rope_theta"):
    out["rope_theta"] = float(attn["rope_theta"])
  return out


def _opt_config(c: dict[str, Any]) -> dict[str, Any]:
  """An OPT config.json under Llama's keys, with the layouts of OPT-350m refused."""
  d, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
  if not c["do_layer_norm_before"]:
    raise ValueError("do_layer_norm_before=false in an OPT config.json (OPT-350m's norms "
                     "after each sublayer) is not supported")
  if c["word_embed_proj_dim"] not in (None, d):
    raise ValueError(f"word_embed_proj_dim={c['word_embed_proj_dim']} in an OPT config.json "
                     f"(embeddings narrower than hidden_size {d}, projected in and out) is "
                     "not supported")
  if c["_remove_final_layer_norm"]:
    raise ValueError("_remove_final_layer_norm=true in an OPT config.json (no final norm) "
                     "is not supported")
  if c["activation_function"] != "relu":
    raise ValueError(f"activation_function={c['activation_function']!r} in an OPT "
                     "config.json is not supported (expected relu)")
  return {**c, "intermediate_size": int(c["ffn_dim"]), "num_key_value_heads": heads,
          "head_dim": d // heads, "rms_norm_eps": 1e-5, "hidden_act": "relu",
          "attention_bias": bool(c["enable_bias"])}


# Classes whose config.json keys are their own: the function that gives them Llama's.
_CLASS_CONFIGS = {OPT: _opt_config, DBRX: _dbrx_config, FALCON: _falcon_config,
                  BLOOM: _bloom_config, GPT_NEO: _gpt_neo_config, MPT: _mpt_config}


def _opt_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of an OPT config.json ({} for other families)."""
  if lm != OPT:
    return {}
  affine = bool(c["layer_norm_elementwise_affine"])
  return dict(layer_norm=True, norm_bias=affine, norm_weightless=not affine,
              mlp_bias=bool(c["enable_bias"]), mlp_activation="relu_ungated",
              learned_positions=True, position_offset=2,
              rope_layers=(0,) * int(c["num_hidden_layers"]))


def _plain_mlp_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of a StarCoder2 / Jais 2 / Nemotron config.json ({} for other
  families): LayerNorms with biases (Nemotron's weights less one), an MLP of no gate and
  its biases."""
  if lm not in _PLAIN_MLPS:
    return {}
  return dict(layer_norm=True, norm_bias=True, norm_unit_offset=lm == NEMOTRON,
              mlp_activation="gelu_tanh_ungated" if lm == STARCODER2 else "relu2",
              mlp_bias=bool(c["use_bias"] if lm == STARCODER2 else c["mlp_bias"]))


def _gpt_oss_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of a gpt-oss config.json ({} for other families)."""
  if lm != GPT_OSS:
    return {}
  layers = int(c["num_hidden_layers"])
  types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                   for i in range(layers)]
  window = c.get("sliding_window")
  if not window:
    types = ["full_attention"] * layers
  bias = bool(c.get("attention_bias"))
  return dict(attention_sinks=True, attn_out_bias=bias, router_bias=True, expert_bias=True,
              mlp_activation="clamped_swiglu", swiglu_limit=float(c["swiglu_limit"]),
              swiglu_alpha=float(c["swiglu_alpha"]),
              sliding_window=int(window) if window else None, layer_types=tuple(types))


def _gemma_from_hf(lm: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of a Gemma config.json ({} for other families)."""
  if lm not in GEMMAS:
    return {}
  out = dict(norm_unit_offset=True, embed_scale=True, mlp_activation="gelu_tanh")
  if lm == "GemmaForCausalLM":
    return out
  defaults = _GEMMA_DEFAULTS[lm]
  if c.get("use_bidirectional_attention"):
    raise ValueError("use_bidirectional_attention=true in config.json is not supported "
                     "(a causal language model attends to earlier tokens only)")
  get = lambda key: c.get(key, defaults[key])  # noqa: E731
  layer_types = c.get("layer_types")
  if not layer_types:  # Older files: every `pattern`-th layer is full, the rest slide.
    pattern = int(c.get("sliding_window_pattern") or defaults["pattern"])
    layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                   for i in range(int(c["num_hidden_layers"]))]
  window = get("sliding_window")
  if window is None and "sliding_attention" in layer_types:
    layer_types = ["full_attention"] * len(layer_types)
  out.update(sandwich_norms=lm in _SANDWICHED,
             query_pre_attn_scalar=get("query_pre_attn_scalar"),
             attn_logit_softcap=get("attn_logit_softcapping"),
             final_logit_softcap=get("final_logit_softcapping"),
             sliding_window=None if window is None else int(window),
             layer_types=tuple(layer_types))
  for key in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
    if out[key] is not None:
      out[key] = float(out[key])
  return out


def _gemma4_global_widths(c: dict[str, Any], kinds: list[str], head_dim: int,
                          kv_heads: int) -> tuple[int, int]:
  """(head_dim, key/value heads) of a Gemma 4 config.json's full layers: transformers 5's
  per_layer_config (by layer index), else global_head_dim (default 512) and, with
  attention_k_eq_v, num_global_key_value_heads."""
  per = c.get("per_layer_config")
  if per is None:
    gkv = c.get("num_global_key_value_heads") if c.get("attention_k_eq_v") else None
    return int(c.get("global_head_dim") or 512), int(gkv or kv_heads)
  if not isinstance(per, dict):
    raise ValueError(f"per_layer_config in a {GEMMA4} config.json must be a mapping of layer "
                     f"index to overrides, got {per!r}")
  widths = set()
  for i, kind in enumerate(kinds):
    own = per.get(str(i), per.get(i)) or {}
    unknown = sorted(set(own) - {"head_dim", "num_key_value_heads"})
    if unknown:
      raise ValueError(f"per_layer_config overrides {unknown} of layer {i} in a {GEMMA4} "
                       "config.json are not supported (read: head_dim, num_key_value_heads)")
    width = (int(own.get("head_dim", head_dim)), int(own.get("num_key_value_heads", kv_heads)))
    if kind == "sliding_attention" and width != (head_dim, kv_heads):
      raise ValueError(f"per_layer_config gives sliding layer {i} of a {GEMMA4} config.json "
                       f"head_dim / key-value heads {width}, not the model's "
                       f"{(head_dim, kv_heads)}")
    if kind == "full_attention":
      widths.add(width)
  if len(widths) > 1:
    raise ValueError(f"per_layer_config gives the full layers of a {GEMMA4} config.json "
                     f"different widths {sorted(widths)}; one width is read")
  return widths.pop() if widths else (head_dim, kv_heads)


def _gemma4_from_hf(c: dict[str, Any], arch: str) -> ModelConfig:
  """The ModelConfig of a Gemma 4 (text) config.json."""
  c = {**_GEMMA4_DEFAULTS, **c}
  if c.get("use_bidirectional_attention") == "all":
    raise ValueError("use_bidirectional_attention='all' in a Gemma 4 config.json is not "
                     "supported (a causal language model attends to earlier tokens only)")
  if c.get("attention_bias"):
    raise ValueError(f"attention_bias=true in a {GEMMA4} config.json is not supported")
  act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
  if act not in _GELU_TANH:
    raise ValueError(f"hidden_activation={act!r} is not supported (expected "
                     "gelu_pytorch_tanh)")
  n = int(c["num_hidden_layers"])
  kinds = list(c.get("layer_types") or [
      "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
  bad = sorted(set(kinds) - {"sliding_attention", "full_attention"})
  if len(kinds) != n or bad:
    raise ValueError(f"layer_types of a {GEMMA4} config.json must give each of its {n} "
                     f"layers sliding_attention or full_attention, got {kinds!r}")
  kinds[-1] = "full_attention"  # as transformers forces it
  heads = int(c["num_attention_heads"])
  head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
  kv = int(c.get("num_key_value_heads") or heads)
  global_dim, global_kv = _gemma4_global_widths(c, kinds, head_dim, kv)
  params = c.get("rope_parameters") or _GEMMA4_ROPE
  if not all(isinstance(params.get(k), dict) for k in ("full_attention", "sliding_attention")):
    raise ValueError(f"rope_parameters of a {GEMMA4} config.json must hold full_attention "
                     f"and sliding_attention entries, got {sorted(params)}")
  rope, local = (_rope_from_params(params[k], c) for k in ("full_attention", "sliding_attention"))
  moe: dict[str, Any] = dict(ffn_dim=int(c["intermediate_size"]))
  if c.get("enable_moe_block"):
    moe = dict(num_experts=int(c["num_experts"]), num_experts_per_tok=int(c["top_k_experts"]),
               ffn_dim=int(c["moe_intermediate_size"]),
               shared_expert_dim=int(c["intermediate_size"]), moe_input_norms=True)
  dtype = c.get("dtype") or c.get("torch_dtype") or "float32"
  pad = c.get("pad_token_id")
  cap = c.get("final_logit_softcapping")
  window = c.get("sliding_window")
  per_layer = int(c.get("hidden_size_per_layer_input") or 0)
  per_layer_vocab = int(c.get("vocab_size_per_layer_input") or c["vocab_size"])
  shared = int(c.get("num_kv_shared_layers") or 0)
  return ModelConfig(
      vocab_size=int(c["vocab_size"]), d_model=int(c["hidden_size"]), num_layers=n,
      num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope=rope, rope_local=local,
      norm_eps=float(c.get("rms_norm_eps") or 1e-6),
      tie_embeddings=bool(c.get("tie_word_embeddings", True)), qk_norm=True,
      sandwich_norms=True, embed_scale=True, mlp_activation="gelu_tanh",
      attention_multiplier=1.0, final_logit_softcap=None if cap is None else float(cap),
      sliding_window=None if window is None else int(window), layer_types=tuple(kinds),
      # 0 where the full layers' width is the sliding layers' (as a preset says it)
      global_head_dim=0 if global_dim == head_dim else global_dim,
      global_kv_heads=0 if global_kv == kv else global_kv,
      k_eq_v=bool(c.get("attention_k_eq_v")), v_norm=True, layer_scale=True,
      max_position_embeddings=int(c["max_position_embeddings"]), architecture=arch,
      dtype=str(dtype), param_dtype=str(dtype),
      pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else None,
      per_layer_dim=per_layer,
      per_layer_vocab=(per_layer_vocab if per_layer and per_layer_vocab != int(c["vocab_size"])
                       else 0),
      kv_shared_layers=shared, kv_shared_wide_mlp=bool(shared and c.get("use_double_wide_mlp")),
      **moe)


def _gemma4_to_hf(cfg: ModelConfig, pad: int | None) -> dict[str, Any]:
  """A Gemma 4 config.json: the full layers' widths both as transformers 5 writes them
  (per_layer_config) and as the published files do (global_head_dim,
  num_global_key_value_heads)."""
  wide = cfg.global_config()
  full = [i for i, s in enumerate(cfg.sliding_layers) if not s]

  def rope_entry(r: RopeConfig) -> dict[str, Any]:
    entry: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
    if r.type == "proportional":
      entry["partial_rotary_factor"] = r.partial_rotary_factor
      if r.factor != 1.0:
        entry["factor"] = r.factor
    elif r.type != "default":
      entry.update(_rope_scaling(r) or {})
    return entry

  moe = bool(cfg.num_experts)
  return {
      "architectures": [cfg.architecture], "model_type": _MODEL_TYPES[GEMMA4],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.shared_expert_dim if moe else cfg.ffn_dim,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "global_head_dim": wide.head_dim, "num_global_key_value_heads": wide.num_kv_heads,
      "per_layer_config": {str(i): {"head_dim": wide.head_dim,
                                    "num_key_value_heads": wide.num_kv_heads} for i in full},
      "attention_k_eq_v": cfg.k_eq_v, "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.param_dtype,
      "attention_bias": False, "sliding_window": cfg.sliding_window,
      "layer_types": ["sliding_attention" if s else "full_attention"
                      for s in cfg.sliding_layers],
      "rope_parameters": {"full_attention": rope_entry(cfg.rope),
                          "sliding_attention": rope_entry(cfg.rope_local or cfg.rope)},
      "final_logit_softcapping": cfg.final_logit_softcap,
      "hidden_size_per_layer_input": cfg.per_layer_dim,
      "vocab_size_per_layer_input": cfg.per_layer_vocab or cfg.vocab_size,
      "num_kv_shared_layers": cfg.kv_shared_layers,
      "use_double_wide_mlp": cfg.kv_shared_wide_mlp, "enable_moe_block": moe,
      "num_experts": cfg.num_experts or None, "top_k_experts": cfg.num_experts_per_tok or None,
      "moe_intermediate_size": cfg.ffn_dim if moe else None,
      "pad_token_id": None if pad is None else int(pad)}


def _check_gemma4(cfg: ModelConfig, lm: str) -> None:
  """Gemma 4's options are written as Gemma4ForCausalLM alone, which always has them."""
  fields = ("global_head_dim", "global_kv_heads", "k_eq_v", "v_norm", "layer_scale",
            "moe_input_norms", "per_layer_dim", "kv_shared_layers", "kv_shared_wide_mlp")
  if lm != GEMMA4:
    held = [name for name in fields if getattr(cfg, name)]
    held += ["proportional rope"] * any(r is not None and r.type == "proportional"
                                        for r in (cfg.rope, cfg.rope_local))
    if held:
      raise ValueError(f"{held} cannot be written as {cfg.architecture}; {GEMMA4} holds them")
    return
  fixed = dict(norm_unit_offset=False, embed_scale=True, sandwich_norms=True,
               mlp_activation="gelu_tanh", qk_norm=True, v_norm=True, layer_scale=True,
               attention_multiplier=1.0, qkv_bias=False, qk_norm_heads=False,
               attention_sinks=False, attn_out_bias=False, query_pre_attn_scalar=None,
               attn_logit_softcap=None, output_norms=False, qk_norm_after_rope=False,
               moe_input_norms=bool(cfg.num_experts), norm_topk_prob=True,
               router_scoring="softmax", router_groups=1, routed_scaling_factor=1.0,
               router_bias=False, expert_bias=False, routed_input_scaling=False,
               shared_expert_gate=False, moe_latent_dim=0, rope_layers=(),
               attn_position_scale=0.0,
               residual_multiplier=1.0, embedding_multiplier=1.0, logits_scaling=1.0,
               layer_norm=False, parallel_residual=False, lm_head_multiplier=1.0)
  for name, value in fixed.items():
    if getattr(cfg, name) != value and not (name == "norm_topk_prob" and not cfg.num_experts):
      raise ValueError(f"{name}={getattr(cfg, name)!r} cannot be written as "
                       f"{cfg.architecture}, which always has {name}={value!r}")
  if cfg.sliding_window is None or cfg.rope_local is None or not cfg.layer_types:
    raise ValueError(f"{cfg.architecture} has sliding layers (layer_types, sliding_window) "
                     "with a rotary embedding of their own (rope_local)")
  if cfg.rope.type not in ("default", "proportional", "linear", "llama3", "yarn") or (
      cfg.rope_local.type not in ("default", "proportional", "linear", "llama3", "yarn")):
    raise ValueError(f"rope types {cfg.rope.type!r} / {cfg.rope_local.type!r} cannot be "
                     f"written as {cfg.architecture}")
  if not cfg.sliding_layers[-1]:
    return
  raise ValueError(f"{cfg.architecture}'s last layer is always a full_attention layer")


def _gemma4_rows(cfg: ModelConfig) -> list:
  """(ours, HF name, hf->ours, ours->hf, our shape) of a Gemma 4 model's tensors."""
  d, n, e, f = cfg.d_model, cfg.num_heads, cfg.num_experts, cfg.ffn_dim
  ident = lambda x: x  # noqa: E731
  t = (lambda x: x.T, lambda x: x.T)
  rows = [(("embed",), "model.embed_tokens.weight", ident, ident, (cfg.vocab_size, d)),
          (("final_norm", "scale"), "model.norm.weight", ident, ident, (d,))]
  if cfg.lm_head and not cfg.tie_embeddings:
    rows.append((("lm_head",), "lm_head.weight", *t, (d, cfg.vocab_size)))
  big_p, layers = cfg.per_layer_dim, cfg.num_layers
  if big_p:  # per-layer embeddings: HF [V', L * P] and [L * P, D] <-> ours [V', L, P], [D, L, P]
    vp = cfg.per_layer_vocab or cfg.vocab_size
    rows += [(("per_layer_embed",), "model.embed_tokens_per_layer.weight",
              lambda x: x.reshape(vp, layers, big_p), lambda x: x.reshape(vp, layers * big_p),
              (vp, layers, big_p)),
             (("per_layer_proj",), "model.per_layer_model_projection.weight",
              lambda x: x.T.reshape(d, layers, big_p),
              lambda x: x.reshape(d, layers * big_p).T, (d, layers, big_p)),
             (("per_layer_norm", "scale"), "model.per_layer_projection_norm.weight", ident,
              ident, (big_p,))]
  norms = (("input_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
           ("post_attn_norm", "pre_feedforward_layernorm"),
           ("mlp_out_norm", "post_feedforward_layernorm"))
  for i in range(cfg.num_layers):
    p, hf = layer_path(cfg, i), f"model.layers.{i}."
    layer = cfg.global_config() if p[0] in ("global_layers", "shared_global_layers") else cfg
    h, k = layer.head_dim, layer.num_kv_heads
    shared = p[0] in ("shared_layers", "shared_global_layers")  # no keys or values of its own

    def proj_in(heads, h=h):  # HF [heads * h, d] <-> ours [d, heads, h]
      return (lambda x: x.T.reshape(d, heads, h), lambda x: x.reshape(d, heads * h).T)
    rows += [(p + (ours, "scale"), hf + name + ".weight", ident, ident, (d,))
             for ours, name in norms]
    rows.append((p + ("layer_scale",), hf + "layer_scalar", ident, ident, (1,)))
    if big_p:
      rows += [(p + ("per_layer_gate",), hf + "per_layer_input_gate.weight", *t, (d, big_p)),
               (p + ("per_layer_out",), hf + "per_layer_projection.weight", *t, (big_p, d)),
               (p + ("per_layer_out_norm", "scale"), hf + "post_per_layer_input_norm.weight",
                ident, ident, (d,))]
    attn = [("q_proj", n)] + ([] if shared else [("k_proj", k)])
    if not (p[0] == "global_layers" and cfg.k_eq_v) and not shared:
      attn.append(("v_proj", k))
    rows += [(p + ("attn", name), hf + f"self_attn.{name}.weight", *proj_in(heads),
              (d, heads, h)) for name, heads in attn]
    rows.append((p + ("attn", "o_proj"), hf + "self_attn.o_proj.weight",
                 lambda x, h=h: x.reshape(d, n, h).transpose(1, 2, 0),
                 lambda x, h=h: x.transpose(2, 0, 1).reshape(d, n * h), (n, h, d)))
    rows += [(p + ("attn", name, "scale"), hf + f"self_attn.{name}.weight", ident, ident,
              (h,)) for name in (("q_norm",) if shared else ("q_norm", "k_norm"))]
    mlp = p + (("mlp", "shared") if e else ("mlp",))
    width = cfg.shared_expert_dim if e else f * (2 if shared and cfg.kv_shared_wide_mlp else 1)
    rows += [(mlp + (name,), hf + f"mlp.{name}.weight", *t, shape)
             for name, shape in (("gate_proj", (d, width)), ("up_proj", (d, width)),
                                 ("down_proj", (width, d)))]
    if not e:
      continue
    moe = p + ("mlp",)
    swap = lambda x: np.swapaxes(x, 1, 2)  # noqa: E731  [E, out, in] <-> ours [E, in, out]
    half = functools.partial(_fused_experts_half, e, f, d)
    rows += [(moe + ("router",), hf + "router.proj.weight", *t, (d, e)),
             (moe + ("router_scale",), hf + "router.scale", ident, ident, (d,)),
             (moe + ("per_expert_scale",), hf + "router.per_expert_scale", ident, ident, (e,)),
             (moe + ("gate_proj",), hf + "experts.gate_up_proj", *half(0), (e, d, f)),
             (moe + ("up_proj",), hf + "experts.gate_up_proj", *half(f), (e, d, f)),
             (moe + ("down_proj",), hf + "experts.down_proj", swap, swap, (e, f, d))]
    rows += [(moe + (ours, "scale"), hf + name + ".weight", ident, ident, (d,))
             for ours, name in (("pre_norm", "pre_feedforward_layernorm_2"),
                                ("shared_out_norm", "post_feedforward_layernorm_1"),
                                ("routed_out_norm", "post_feedforward_layernorm_2"))]
  return rows


def _leading_dense_layers(c: dict[str, Any], default: int = 1) -> int:
  """How many of a GLM-4.7-Flash (GLM-5, DeepSeek-V3.2) config.json's layers are dense:
  its mlp_layer_types ("dense" / "sparse" per layer; by default the first `default`
  layers dense), whose dense layers must lead."""
  layers = int(c["num_hidden_layers"])
  kinds = c.get("mlp_layer_types")
  kinds = (["dense"] * default + ["sparse"] * (layers - default) if kinds is None
           else list(kinds))
  dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
  if len(kinds) != layers or any(kind != "sparse" for kind in kinds[dense:]):
    raise ValueError(f"mlp_layer_types={kinds!r} is not supported: {layers} entries, the "
                     "dense layers first and the mixture ('sparse') layers after them")
  return dense


def _moe_from_hf(arch: str, c: dict[str, Any]) -> dict[str, Any]:
  """The ModelConfig fields of a mixture-of-experts config.json ({} for dense ones)."""
  if arch == DBRX:  # (`_dbrx_config`'s keys)
    return {"num_experts": c["num_local_experts"],
            "num_experts_per_tok": c["num_experts_per_tok"],
            "norm_topk_prob": c["norm_topk_prob"], "ffn_dim": c["intermediate_size"],
            **_aux_loss_from_hf(c)}
  if arch == HUNYUAN_MOE:
    def one(key):  # an int, or one per layer (all alike here)
      values = c[key] if isinstance(c[key], list) else [c[key]]
      if len(set(values)) != 1:
        raise ValueError(f"{key}={c[key]!r} in a {HUNYUAN_MOE} config.json: layers that "
                         "differ are not supported")
      return int(values[0])
    width = int(c["intermediate_size"])
    return {"num_experts": one("num_experts"), "num_experts_per_tok": one("moe_topk"),
            "norm_topk_prob": True, "ffn_dim": width, "shared_expert_dim": width,
            **_aux_loss_from_hf(c)}
  if arch == COHERE2_MOE:
    select = c.get("expert_selection_fn") or "softmax"
    combine = c.get("shared_expert_combination_strategy") or "average"
    if select not in ("softmax", "sigmoid") or combine not in ("sum", "average"):
      raise ValueError(f"expert_selection_fn={select!r} / shared_expert_combination_strategy="
                       f"{combine!r} in a {COHERE2_MOE} config.json: expected softmax or "
                       "sigmoid / sum or average")
    width, shared = int(c["intermediate_size"]), int(c.get("num_shared_experts") or 0)
    dense = _cohere2_dense_layers(c)
    return {"num_experts": int(c["num_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]),
            # softmax over the top-k logits: the top-k probabilities renormalised
            "norm_topk_prob": select == "softmax" or bool(c.get("norm_topk_prob", True)),
            "router_scoring": select, "router_correction_bias": select != "sigmoid",
            "ffn_dim": width,
            "shared_expert_dim": width * shared,
            "shared_expert_average": bool(shared) and combine == "average",
            "dense_layers": dense,
            "dense_ffn_dim": int(c.get("prefix_dense_intermediate_size") or width) if dense
            else 0, **_aux_loss_from_hf(c)}
  if arch == MELLUM:  # its mlp_layer_types, as mlp_only_layers
    kinds = c.get("mlp_layer_types") or ["sparse"] * int(c["num_hidden_layers"])
    c = {**c, "mlp_only_layers": [i for i, k in enumerate(kinds) if k != "sparse"]}
  if arch in ("Qwen3MoeForCausalLM", QWEN2_MOE, MELLUM):
    # Dense layers (mlp_only_layers) are read where they lead: layers 0..k-1.
    dense = sorted(int(i) for i in c.get("mlp_only_layers") or ())
    if dense != list(range(len(dense))) or int(c.get("decoder_sparse_step", 1)) != 1:
      raise ValueError("dense layers in a Qwen MoE model other than the first few "
                       f"(mlp_only_layers={c.get('mlp_only_layers')!r}, decoder_sparse_step="
                       f"{c.get('decoder_sparse_step')!r}) are not supported")
    if c.get("use_sliding_window"):
      raise ValueError("use_sliding_window=true in config.json is not supported")
    shared = {}
    if arch == QWEN2_MOE and int(c.get("shared_expert_intermediate_size", 5632)):
      shared = {"shared_expert_dim": int(c.get("shared_expert_intermediate_size", 5632)),
                "shared_expert_gate": True}
    # The published files say num_experts; transformers 5 writes num_local_experts.
    return {"num_experts": int(c.get("num_experts") or c["num_local_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]),
            "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
            "ffn_dim": int(c["moe_intermediate_size"]), "dense_layers": len(dense),
            "dense_ffn_dim": int(c["intermediate_size"]) if dense else 0, **shared,
            **_aux_loss_from_hf(c)}
  if arch == ERNIE4_5_MOE:
    layers = int(c["num_hidden_layers"])
    start, end = int(c["moe_layer_start_index"]), int(c["moe_layer_end_index"])
    end = layers - 1 if end == -1 else end
    if int(c["moe_layer_interval"]) != 1 or end != layers - 1:
      raise ValueError(f"moe_layer_interval={c['moe_layer_interval']!r}, "
                       f"moe_layer_end_index={c['moe_layer_end_index']!r} in an ERNIE 4.5 "
                       "config.json: the mixture layers must run from moe_layer_start_index "
                       "to the last layer")
    width = int(c["moe_intermediate_size"])
    return {"num_experts": int(c.get("moe_num_experts") or c["num_experts"]),
            "num_experts_per_tok": int(c.get("moe_k") or c["num_experts_per_tok"]),
            "norm_topk_prob": True, "ffn_dim": width, "softmax_correction_bias": True,
            "shared_expert_dim": int(c.get("moe_num_shared_experts") or 0) * width,
            "dense_layers": start, "dense_ffn_dim": int(c["intermediate_size"]) if start else 0,
            **_aux_loss_from_hf(c)}
  if arch in (OLMOE, FLEX_OLMO):
    return {"num_experts": int(c.get("num_experts") or c["num_local_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]),
            "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
            "ffn_dim": int(c["intermediate_size"]), **_aux_loss_from_hf(c)}
  if arch in (QWEN3_5_MOE, QWEN3_NEXT):
    if arch == QWEN3_NEXT and (c.get("mlp_only_layers") or int(c.get("decoder_sparse_step",
                                                                      1)) != 1):
      raise ValueError("dense layers in a Qwen3-Next model (mlp_only_layers="
                       f"{c.get('mlp_only_layers')!r}, decoder_sparse_step="
                       f"{c.get('decoder_sparse_step')!r}) are not supported")
    return {"num_experts": int(c["num_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]),
            "norm_topk_prob": arch == QWEN3_5_MOE or bool(c["norm_topk_prob"]),
            "ffn_dim": int(c["moe_intermediate_size"]),
            "shared_expert_dim": int(c["shared_expert_intermediate_size"]),
            "shared_expert_gate": True, **_aux_loss_from_hf(c)}
  if arch == DEEPSEEK_V2:
    method = c.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
      raise ValueError(f"topk_method={method!r}: DeepSeek-V2's greedy or "
                       "group_limited_greedy routing is read")
    dense = int(c.get("first_k_dense_replace") or 0)
    grouped = method == "group_limited_greedy"
    return {"num_experts": int(c.get("n_routed_experts") or c["num_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]), "norm_topk_prob": False,
            "ffn_dim": int(c["moe_intermediate_size"]),
            "shared_expert_dim": int(c["n_shared_experts"] or 0)
            * int(c["moe_intermediate_size"]),
            "router_groups": int(c["n_group"]) if grouped else 1,
            "router_group_topk": int(c["topk_group"]) if grouped else 1,
            "routed_scaling_factor": float(c["routed_scaling_factor"]),
            "dense_layers": dense, "dense_ffn_dim": int(c["intermediate_size"]) if dense else 0,
            **_aux_loss_from_hf(c)}
  if arch == MISTRAL4:
    if int(c.get("n_group") or 1) != 1:
      raise ValueError(f"n_group={c['n_group']!r} in a Mistral 4 config.json (expert groups, "
                       "each ranked by its two best probabilities) is not supported; "
                       "n_group=1 is read")
    dense = int(c.get("first_k_dense_replace") or 0)
    return {"num_experts": int(c["n_routed_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]),
            "norm_topk_prob": bool(c["norm_topk_prob"]),
            "ffn_dim": int(c["moe_intermediate_size"]),
            "shared_expert_dim": int(c["n_shared_experts"] or 0)
            * int(c["moe_intermediate_size"]),
            "routed_scaling_factor": float(c["routed_scaling_factor"]),
            "dense_layers": dense, "dense_ffn_dim": int(c["intermediate_size"]) if dense else 0,
            **_aux_loss_from_hf(c)}
  if arch == GLM4_MOE_LITE:
    c = {**c, "first_k_dense_replace": _leading_dense_layers(c)}
  if arch in _SPARSE_ATTENTION:
    c = {**c, "first_k_dense_replace": _leading_dense_layers(
        c, int(c.get("first_k_dense_replace", 3)))}
  if arch == EXAONE_MOE:
    c = {**c, "first_k_dense_replace": _leading_dense_layers(
        c, int(c["first_k_dense_replace"])), "n_routed_experts": int(c["num_experts"]),
         "n_shared_experts": int(c["num_shared_experts"] or 0)}
  if arch == SOLAR_OPEN:  # a mixture in every layer, whatever the file says
    c = {**c, "first_k_dense_replace": 0}
  if arch in (GLM4_MOE, DOTS1, EXAONE_MOE, SOLAR_OPEN) + _V3_ROUTED:
    if arch in (DEEPSEEK_V3, DEEPSEEK_V32) and (
        c.get("topk_method", "noaux_tc") != "noaux_tc"
        or c.get("scoring_func", "sigmoid") != "sigmoid"
        or int(c.get("moe_layer_freq", 1)) != 1):
      raise ValueError(f"topk_method={c.get('topk_method')!r}, scoring_func="
                       f"{c.get('scoring_func')!r}, moe_layer_freq={c.get('moe_layer_freq')!r}"
                       ": only DeepSeek-V3's routing (noaux_tc over sigmoid scores, every "
                       "layer past the dense ones a mixture) is read")
    dense = int(c["first_k_dense_replace"])
    return {"num_experts": int(c.get("n_routed_experts") or c["num_local_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]),
            "norm_topk_prob": bool(c["norm_topk_prob"]),
            "ffn_dim": int(c["moe_intermediate_size"]),
            "shared_expert_dim": int(c["n_shared_experts"] or 0)
            * int(c["moe_intermediate_size"]),
            "router_scoring": "sigmoid", "router_groups": int(c["n_group"]),
            "router_group_topk": int(c["topk_group"]),
            "routed_scaling_factor": float(c["routed_scaling_factor"]),
            "dense_layers": dense, "dense_ffn_dim": int(c["intermediate_size"]) if dense else 0,
            **_aux_loss_from_hf(c)}
  if arch == LLAMA4:
    layers = int(c["num_hidden_layers"])
    step = int(c.get("interleave_moe_layer_step") or 1)
    moe = c.get("moe_layers")
    moe = list(range(step - 1, layers, step)) if moe is None else sorted(int(i) for i in moe)
    # Every step-th layer a mixture (Scout's 1, Maverick's 2), whichever key says so.
    step = next((s for s in range(1, layers + 1)
                 if moe == list(range(s - 1, layers, s))), None)
    if step is None:
      raise ValueError(f"moe_layers={moe!r} in a Llama 4 config.json is not supported: the "
                       "mixture layers must be every n-th layer (layers n - 1, 2n - 1, ...; "
                       "interleave_moe_layer_step n)")
    interleaved = {"moe_layer_step": step,
                   "dense_ffn_dim": int(c["intermediate_size_mlp"])} if step > 1 else {}
    return {"num_experts": int(c["num_local_experts"]), **interleaved,
            "num_experts_per_tok": int(c["num_experts_per_tok"]), "norm_topk_prob": False,
            "ffn_dim": int(c["intermediate_size"]),
            "shared_expert_dim": int(c["intermediate_size"]), "router_scoring": "sigmoid",
            "router_correction_bias": False, "routed_input_scaling": True,
            **_aux_loss_from_hf(c)}
  if arch == JAMBA:  # every expert_layer_period-th layer (from its offset) a mixture
    experts, period = int(c["num_experts"]), int(c["expert_layer_period"])
    if experts <= 1:
      return {}
    if int(c["expert_layer_offset"]) != period - 1:
      raise ValueError(f"expert_layer_offset={c['expert_layer_offset']} with "
                       f"expert_layer_period={period} in a {JAMBA} config.json is not "
                       f"supported: the mixtures must be layers {period - 1}, "
                       f"{2 * period - 1}, ... (offset period - 1, as published)")
    interleaved = ({"moe_layer_step": period, "dense_ffn_dim": int(c["intermediate_size"])}
                   if period > 1 else {})
    return {"num_experts": experts, "num_experts_per_tok": int(c["num_experts_per_tok"]),
            "norm_topk_prob": False, **interleaved, **_aux_loss_from_hf(c)}
  if arch == GRANITE_HYBRID:
    shared = int(c.get("shared_intermediate_size") or 1024)
    if not int(c.get("num_local_experts") or 0):
      return {"ffn_dim": shared}
    return {"num_experts": int(c["num_local_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]), "norm_topk_prob": True,
            "shared_expert_dim": shared, **_aux_loss_from_hf(c)}
  if arch in _SHAREDS:
    return {"num_experts": int(c["num_local_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]), "norm_topk_prob": True,
            "shared_expert_dim": int(c.get("shared_intermediate_size") or 0),
            **_aux_loss_from_hf(c)}
  if arch == PHIMOE:
    return {"num_experts": int(c["num_local_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]), "norm_topk_prob": False,
            "router_scoring": "sparsemixer",
            "router_jitter_eps": float(c["router_jitter_noise"]), **_aux_loss_from_hf(c)}
  if arch in ("MixtralForCausalLM", GPT_OSS, MINIMAX_M2, GRANITE_MOE):
    return {"num_experts": int(c["num_local_experts"]),
            "num_experts_per_tok": int(c["num_experts_per_tok"]), "norm_topk_prob": True,
            **({"router_scoring": "sigmoid"} if arch == MINIMAX_M2 else {}),
            **_aux_loss_from_hf(c)}
  return {}


def _aux_loss_from_hf(c: dict[str, Any]) -> dict[str, Any]:
  """`transformers` adds router_aux_loss_coef x the aux loss only with output_router_logits."""
  if not c.get("output_router_logits"):
    return {}
  return {"router_aux_loss_coef": float(c.get("router_aux_loss_coef", 0.001))}


def check_exportable(cfg: ModelConfig) -> None:
  """Raises ValueError when `cfg.architecture`'s Hugging Face class cannot hold the model
  (the class implies q/k norms, q/k/v biases, whether the MLPs are experts, and the head:
  a *ForCausalLM has lm_head, its value head if any is not written; a
  *ForSequenceClassification is a reward model, value_head=True and lm_head=False), so
  that `save_pretrained` never writes files that load as another function."""
  arch = cfg.architecture
  if arch not in SUPPORTED:
    raise ValueError(f"architecture={arch!r} cannot be written; expected one of "
                     f"{list(SUPPORTED)}")
  lm = _causal_lm(arch)
  if arch != lm and (cfg.lm_head or not cfg.value_head):
    raise ValueError(f"architecture={arch} is a reward model (a score head, no "
                     f"language-model head), but value_head={cfg.value_head}, lm_head="
                     f"{cfg.lm_head}; write a language model as {lm}")
  if arch == lm and not cfg.lm_head:
    raise ValueError(f"lm_head=False (a reward model) cannot be written as {arch}, a "
                     f"language model; set architecture={_sequence_classifier(arch)}")
  kind = [a for a in SUPPORTED if (a == _causal_lm(a)) == (arch == lm)]
  stacked = (GPT_OSS, LLAMA4, GRANITE_MOE, DBRX) + _SHAREDS  # files stacking the experts
  moe = (lm in _MOE_NAMES and lm != JAMBA) or lm in stacked or (
      lm in (GRANITE_HYBRID, NEMOTRON_H, GEMMA4, JAMBA) and bool(cfg.num_experts))
  mixtures = [a for a in kind if _causal_lm(a) in _MOE_NAMES or _causal_lm(a) in stacked]
  if moe != bool(cfg.num_experts):
    raise ValueError(
        f"architecture={arch} with num_experts={cfg.num_experts}: a mixture of experts is "
        f"written as one of {mixtures}, a dense model as one of "
        f"{[a for a in kind if a not in mixtures]}")
  if bool(cfg.kv_lora_rank) != (lm in _DEEPSEEKS):
    raise ValueError(f"kv_lora_rank={cfg.kv_lora_rank} cannot be written as "
                     f"{cfg.architecture}: multi-head latent attention is written as "
                     f"one of {list(_DEEPSEEKS)}, and only they")
  if bool(cfg.index_topk) != (lm in _SPARSE_ATTENTION):
    raise ValueError(f"index_topk={cfg.index_topk} cannot be written as {cfg.architecture}: "
                     f"DeepSeek Sparse Attention is written as one of "
                     f"{list(_SPARSE_ATTENTION)}, and only they")
  _check_gemma4(cfg, lm)
  if lm == GEMMA4:
    if cfg.kv_lora_rank or any(cfg.linear_layers) or cfg.parallel_mixer or cfg.dense_layers:
      raise ValueError(f"{arch} has softmax attention (no latent) in every layer, each with "
                       "its MLP (kv_lora_rank, linear layers, parallel_mixer, dense_layers)")
    return
  qwen3_5 = lm in _QWEN3_5S
  mamba = cfg.linear_mixer == "mamba2" and any(cfg.linear_layers)
  short = cfg.linear_mixer == "short_conv" and any(cfg.linear_layers)
  mamba1 = cfg.linear_mixer == "mamba1" and any(cfg.linear_layers)
  if mamba1 != (lm in _MAMBA1_CLASSES):
    raise ValueError(f"linear_mixer={cfg.linear_mixer!r} cannot be written as {arch}: "
                     f"{' and '.join(_MAMBA1_CLASSES)} hold Mamba 1 layers, and only they")
  if lm == JAMBA:
    _check_jamba(cfg)
  if mamba and lm not in _MAMBA2S:
    raise ValueError(f"linear_mixer='mamba2' layers cannot be written as {arch}: "
                     f"{' and '.join(_MAMBA2S)} hold them")
  if short and lm not in _LFM2S:
    raise ValueError(f"linear_mixer='short_conv' layers cannot be written as {arch}: "
                     f"{LFM2} holds them")
  if lm in _LFM2S and any(cfg.linear_layers) and not short:
    raise ValueError(f"linear_mixer={cfg.linear_mixer!r} layers cannot be written as "
                     f"{arch}, whose linear layers are short convolutions")
  if lm in _MAMBA2S and any(cfg.linear_layers) and not mamba:
    raise ValueError(f"Gated DeltaNet layers cannot be written as {arch}: "
                     f"{', '.join(_QWEN3_5S)} hold them")
  for name, value in (("attn_output_gate", cfg.attn_output_gate),
                      ("linear_attention layers",
                       any(cfg.linear_layers) and not mamba and not short and not mamba1)):
    if qwen3_5 != bool(value):
      raise ValueError(f"{name}={bool(value)} cannot be written as {arch}: "
                       f"{'it always has' if qwen3_5 else ', '.join(_QWEN3_5S) + ' hold'} "
                       "them")
  _check_family_options(cfg, lm)
  _check_mixture_options(cfg, lm)
  qk_norm = lm in _QK_NORMED
  if qk_norm != cfg.qk_norm and lm not in (GLM4_MOE, COHERE, STABLELM):
    raise ValueError(f"qk_norm={cfg.qk_norm} cannot be written as {arch}, which "
                     f"{'always has' if qk_norm else 'has no'} q/k norms")
  if lm == "Qwen2ForCausalLM" and not cfg.qkv_bias:
    raise ValueError(f"qkv_bias=False cannot be written as {arch}, which always "
                     "has q/k/v biases")
  if lm in ("MistralForCausalLM", MINISTRAL, CWM) and cfg.qkv_bias:
    raise ValueError(f"qkv_bias=True cannot be written as {arch}, whose attention "
                     "projections have no biases")
  if lm in ("MixtralForCausalLM", MINIMAX_M2) and (cfg.qkv_bias or not cfg.norm_topk_prob):
    raise ValueError(f"{arch} has no q/k/v biases and always renormalises the "
                     f"top-k router weights (qkv_bias={cfg.qkv_bias}, norm_topk_prob="
                     f"{cfg.norm_topk_prob})")
  if lm in GRANITES[1:] and cfg.num_experts and not cfg.norm_topk_prob:
    raise ValueError(f"norm_topk_prob=False cannot be written as {arch}, whose router "
                     "weights are the softmax over the top-k logits")


def _check_mixture_options(cfg: ModelConfig, lm: str) -> None:
  """What `cfg`'s mixture options allow `lm` to hold: shared experts (Qwen2-MoE's one,
  gated; GLM-4.5's and DeepSeek's, n_shared_experts of width ffn_dim), sigmoid routing
  (GLM-4.5, DeepSeek-V3, MiniMax-M2), expert groups and scaling (GLM-4.5 and the
  DeepSeeks, V2's softmax weights never renormalised), leading dense layers (all but
  Mixtral, gpt-oss and MiniMax-M2)."""
  if not cfg.num_experts:
    return
  sigmoid = lm in (GLM4_MOE, DOTS1, EXAONE_MOE, MINIMAX_M2, LLAMA4, NEMOTRON_H,
                  SOLAR_OPEN) + _V3_ROUTED
  qwen2 = lm in (QWEN2_MOE, QWEN3_5_MOE, QWEN3_NEXT)
  grouped = lm in (GLM4_MOE, DOTS1, EXAONE_MOE, SOLAR_OPEN) + _DEEPSEEKS  # groups, scaling
  if lm == COHERE2_MOE:  # softmax or sigmoid without a correction bias; shared experts
    # n of width ffn_dim, summed or averaged; no groups or scaling
    for name, value in (("router_correction_bias", cfg.router_scoring != "sigmoid"),
                        ("softmax_correction_bias", False),
                        ("shared_expert_gate", False), ("routed_input_scaling", False),
                        ("router_groups", 1), ("router_group_topk", 1),
                        ("routed_scaling_factor", 1.0), ("moe_layer_step", 1),
                        ("router_bias", False), ("expert_bias", False),
                        # softmax over the top-k logits: always renormalised
                        ("norm_topk_prob", cfg.router_scoring == "softmax" or cfg.norm_topk_prob)):
      if getattr(cfg, name) != value:
        raise ValueError(f"{name}={getattr(cfg, name)!r} cannot be written as "
                         f"{cfg.architecture}, which always has {name}={value!r}")
    if cfg.shared_expert_dim % cfg.ffn_dim:
      raise ValueError(f"shared_expert_dim={cfg.shared_expert_dim} cannot be written as "
                       f"{cfg.architecture}, whose shared experts are num_shared_experts of "
                       f"width ffn_dim={cfg.ffn_dim}")
    return
  if cfg.shared_expert_average:
    raise ValueError(f"shared_expert_average=True cannot be written as {cfg.architecture}; "
                     f"{COHERE2_MOE} holds it")
  if lm == LFM2_MOE:  # sigmoid scores, a correction bias or none, no groups or shared expert
    for name, value in (("router_scoring", "sigmoid"), ("softmax_correction_bias", False),
                        ("shared_expert_dim", 0), ("shared_expert_gate", False),
                        ("routed_input_scaling", False), ("router_groups", 1),
                        ("router_group_topk", 1), ("moe_layer_step", 1),
                        ("router_bias", False), ("expert_bias", False)):
      if getattr(cfg, name) != value:
        raise ValueError(f"{name}={getattr(cfg, name)!r} cannot be written as "
                         f"{cfg.architecture}, which always has {name}={value!r}")
    return
  if lm == NEMOTRON_H:  # Nemotron 3: groups and scaling, one shared expert of its width
    if not cfg.shared_expert_dim:
      raise ValueError(f"shared_expert_dim=0 cannot be written as {cfg.architecture}, "
                       "whose mixture layers always have a shared expert")
    for name, value in (("router_scoring", "sigmoid"), ("router_correction_bias", True),
                        ("shared_expert_gate", False), ("routed_input_scaling", False)):
      if getattr(cfg, name) != value:
        raise ValueError(f"{name}={getattr(cfg, name)!r} cannot be written as "
                         f"{cfg.architecture}, which always has {name}={value!r}")
    return
  fixed = dict(router_scoring=("sigmoid" if sigmoid else "sparsemixer" if lm == PHIMOE
                               else "softmax"), shared_expert_gate=qwen2,
               routed_input_scaling=lm == LLAMA4, router_correction_bias=lm != LLAMA4,
               softmax_correction_bias=lm == ERNIE4_5_MOE)
  if lm == ERNIE4_5_MOE:
    fixed.update(norm_topk_prob=True)
  if lm == SOLAR_OPEN:
    fixed.update(dense_layers=0)
  if lm == LLAMA4:
    fixed.update(norm_topk_prob=False, dense_layers=0, shared_expert_dim=cfg.ffn_dim)
  elif lm == JAMBA:  # softmax weights left unnormalised, mixtures every step-th layer
    fixed.update(norm_topk_prob=False, dense_layers=0)
  else:
    fixed.update(moe_layer_step=1)
  if not grouped:
    fixed.update(router_groups=1, router_group_topk=1, routed_scaling_factor=1.0)
  if lm == DEEPSEEK_V2:
    fixed.update(norm_topk_prob=False)
  if lm == MISTRAL4:  # groups ranked by their two best probabilities are not written
    fixed.update(router_groups=1, router_group_topk=1)
  if lm == QWEN3_5_MOE:
    fixed.update(norm_topk_prob=True)
  if lm in (QWEN3_5_MOE, QWEN3_NEXT):
    fixed.update(dense_layers=0)
  if lm in ("MixtralForCausalLM", GPT_OSS, MINIMAX_M2, GRANITE_MOE, OLMOE, FLEX_OLMO, DBRX,
            PHIMOE):
    fixed.update(dense_layers=0)
  if lm == PHIMOE:
    fixed.update(norm_topk_prob=False)
  if lm == HUNYUAN_MOE:  # an ungated shared MLP as wide as the experts, every layer
    fixed.update(dense_layers=0, norm_topk_prob=True, shared_expert_dim=cfg.ffn_dim,
                 shared_expert_gate=False)
  if lm in (GRANITE_HYBRID,) + _SHAREDS:
    fixed.update(dense_layers=0)
  if not (grouped or qwen2
          or lm in (LLAMA4, GRANITE_HYBRID, ERNIE4_5_MOE, HUNYUAN_MOE) + _SHAREDS):
    fixed.update(shared_expert_dim=0)
  for name, value in fixed.items():
    if getattr(cfg, name) != value:
      raise ValueError(f"{name}={getattr(cfg, name)!r} cannot be written as "
                       f"{cfg.architecture}, which always has {name}={value!r}")
  if qwen2 and not cfg.shared_expert_dim:
    raise ValueError(f"shared_expert_dim=0 cannot be written as {cfg.architecture}, whose "
                     "mixture layers always have a gated shared expert")
  if lm == GRANITE_HYBRID and not cfg.shared_expert_dim:
    raise ValueError(f"shared_expert_dim=0 cannot be written as {cfg.architecture}, whose "
                     "layers always have a shared_mlp (beside the experts when it has them)")
  if (grouped or lm == ERNIE4_5_MOE) and cfg.shared_expert_dim % cfg.ffn_dim:
    raise ValueError(f"shared_expert_dim={cfg.shared_expert_dim} cannot be written as "
                     f"{cfg.architecture}, whose shared experts are n_shared_experts of "
                     f"width ffn_dim={cfg.ffn_dim}")


def _check_family_options(cfg: ModelConfig, lm: str) -> None:
  """What `cfg`'s Gemma and window options allow `lm` to hold: each class fixes its norms,
  embedding scale and activation; only Gemma 2 / 3 hold soft caps, a query scale and
  layers of both kinds (Qwen2 / Qwen3 a window on some layers, Mistral / Mixtral on all),
  and only Gemma 3 a rotary embedding of the sliding layers' own."""
  gemma, oss = lm in GEMMAS, lm == GPT_OSS
  olmo = lm in OLMOS
  fixed = dict(norm_unit_offset=gemma or lm in _QWEN3_5S + (NEMOTRON,), embed_scale=gemma,
               sandwich_norms=lm in _SANDWICHED or lm == GLM4,
               mlp_activation=("gelu_tanh" if gemma else "clamped_swiglu" if oss else
                               "relu_ungated" if lm == OPT else
                               "gelu_tanh_ungated" if lm == BLOOM else
                               "gelu_ungated" if lm == MPT else
                               "relu2" if lm in (NEMOTRON_H, ARCEE, JAIS2, NANOCHAT,
                                                 NEMOTRON) else
                               "gelu_tanh_ungated" if lm == STARCODER2 else
                               "xielu" if lm == APERTUS else
                               (cfg.mlp_activation if cfg.mlp_activation in
                                _UNGATED_GELUS.values() else "gelu_ungated")
                               if lm in _UNGATED_GELU_CLASSES else "silu"),
               norm_bias=(not cfg.norm_weightless if lm == OPT else
                          lm in _PLAIN_MLPS + _UNGATED_GELU_CLASSES + (STABLELM, PHIMOE)
                          and lm != MPT),
               norm_weightless=(cfg.norm_weightless if lm == OPT else
                                lm in (NANOCHAT, OLMO1)), embed_norm=lm in (NANOCHAT, BLOOM),
               clip_qkv=cfg.clip_qkv if lm in (OLMO1, DBRX, MPT, OLMOE) else None,
               clip_qkv_after_norm=lm == OLMOE and cfg.clip_qkv is not None,
               alibi=lm in (BLOOM, MPT) or lm == FALCON and cfg.alibi,
               alibi_scaled=lm == FALCON and cfg.alibi,
               alibi_bias_max=8.0,
               mlp_bias=(cfg.mlp_bias if lm in (JAIS2, NEMOTRON) else
                         lm == OPT and cfg.qkv_bias or
                         lm in (GPT_NEOX, PHI, GPT2, GPT_BIGCODE, BLOOM, GPT_NEO) + _GPTJS or
                         lm == FALCON and cfg.qkv_bias or
                         lm == STARCODER2 and cfg.qkv_bias),
               attention_sinks=oss or lm in _SWAS, router_bias=oss, expert_bias=oss,
               attn_out_bias=(cfg.attn_out_bias if lm == SEED_OSS else lm == GPT_NEO or
                              (oss or olmo or lm in (SMOLLM3,) + _BIASED_OUTPUT)
                              and cfg.qkv_bias),
               output_norms=olmo or lm == EXAONE4, qk_norm_after_rope=lm in _HUNYUANS,
               qk_norm_heads=(olmo or lm in (MINIMAX_M2, OLMOE)) and cfg.qk_norm,
               layer_norm=(cfg.layer_norm if lm == COHERE2_MOE else
                           lm in (COHERE, COHERE2, STABLELM, OLMO1, OPT, DBRX, PHIMOE)
                           + _UNGATED_GELU_CLASSES
                           + _PLAIN_MLPS),
               learned_positions=lm in (GPT2, OPT, GPT_BIGCODE, GPT_NEO),
               position_offset=2 * (lm == OPT),
               parallel_residual=(cfg.parallel_residual if lm in (STABLELM, GPT_NEOX, FALCON)
                                  else lm in _COHERES + (COHERE, PHI) + _GPTJS),
               lm_head_bias=(lm in (PHI,) + _GPTJS if cfg.lm_head and lm != PHIMOE
                             else cfg.lm_head_bias),
               parallel_mlp_norm=(cfg.parallel_mlp_norm if lm == FALCON else
                                  lm == GPT_NEOX and cfg.parallel_residual),
               qk_norm_head_weights=lm in (COHERE, STABLELM) and cfg.qk_norm)
  for name, value in fixed.items():
    if getattr(cfg, name) != value:
      raise ValueError(f"{name}={getattr(cfg, name)!r} cannot be written as "
                       f"{cfg.architecture}, which always has {name}={value!r}")
  if lm not in _GEMMA2S:
    windowed = (lm in _QWEN_WINDOWED or lm in _ALL_WINDOWED or oss
                or lm in ("Olmo3ForCausalLM", SMOLLM3, LLAMA4, EXAONE4, DOTS1, EXAONE_MOE,
                          MINISTRAL, CWM, MELLUM, GPT_NEO) + _COHERES + _SWAS)
    names = [] if lm == GPT_NEO else ["query_pre_attn_scalar"]
    names += ["attn_logit_softcap"]
    names += [] if lm == NANOCHAT else ["final_logit_softcap"]
    names += [] if lm in ("Olmo3ForCausalLM", MELLUM) + _SWAS else ["rope_local"]
    names += [] if windowed else ["sliding_window"]
    held = {name: getattr(cfg, name) for name in names if getattr(cfg, name) is not None}
    if held:
      raise ValueError(f"{sorted(held)} cannot be written as {cfg.architecture}; "
                       "Gemma2ForCausalLM / Gemma3ForCausalLM hold them"
                       + ("" if "sliding_window" not in held else
                          " (and Mistral, Mixtral, Qwen2 / Qwen3, gpt-oss, OLMo 3 a "
                          "sliding window)"))
    if lm in _ALL_WINDOWED and cfg.sliding_window is not None and not all(
        cfg.sliding_layers):
      raise ValueError(f"layer_types with full-attention layers cannot be written as "
                       f"{cfg.architecture}, whose window applies to every layer")
  if lm == NEMOTRON_H and (cfg.rope_layers or (1,)) != (0,) * cfg.num_layers:
    raise ValueError(f"rope_layers with rotary layers cannot be written as "
                     f"{cfg.architecture}, whose attention has no position embedding")
  if cfg.split_layers != (lm in _BACKBONES):
    raise ValueError(f"split_layers={cfg.split_layers} (layer_types with mlp or moe layers, "
                     f"or ffn_dim=0) cannot be written as {cfg.architecture}; "
                     f"{' and '.join(_BACKBONES)} hold single-sublayer layers, and only they")
  if lm == MAMBA2:
    _check_mamba2_lm(cfg)
  if lm in _MAMBA1S:
    _check_mamba1(cfg, lm)
  if lm == NEMOTRON_H and cfg.ffn_dim == 0:
    raise ValueError(f"ffn_dim=0 (no MLP layers) cannot be written as {cfg.architecture}; "
                     f"a model of Mamba2 layers alone is written as {MAMBA2}")
  if lm == NEMOTRON_H and cfg.tie_embeddings:
    raise ValueError(f"tie_embeddings=True cannot be written as {cfg.architecture}, whose "
                     "transformers class does not tie lm_head to the embeddings")
  if lm == NEMOTRON_H and (cfg.qkv_bias or cfg.attn_out_bias
                           or cfg.linear_dt_max != float("inf")):
    raise ValueError(f"{cfg.architecture}'s attention has no biases, and its Mamba2 "
                     "layers' time step no upper limit (qkv_bias, attn_out_bias, "
                     "linear_dt_max)")
  if lm in (EXAONE4, EXAONE_MOE, COHERE2):
    want = (tuple(int(s) for s in cfg.sliding_layers) if cfg.sliding_window is not None
            else (1,) * cfg.num_layers)
    if tuple(cfg.rope_layers or (1,) * cfg.num_layers) != want:
      raise ValueError(f"rope_layers={cfg.rope_layers} cannot be written as "
                       f"{cfg.architecture}, whose sliding layers rotate and full ones do "
                       "not (with a sliding_window; without one every layer rotates)")
  elif lm == COHERE2_MOE:
    _cohere2_moe_prefix_pattern(cfg)  # raises where the rotary layers cannot be written
  elif lm in (GPT2, OPT, GPT_BIGCODE, GPT_NEO) or cfg.alibi:
    if cfg.rope_layers != (0,) * cfg.num_layers:
      raise ValueError(f"rope_layers={cfg.rope_layers} cannot be written as "
                       f"{cfg.architecture}, which has no rotary embedding (rope_layers "
                       "all 0): its positions are learned or ALiBi's")
  elif lm not in (SMOLLM3, LLAMA4, GRANITE_HYBRID, JAMBA) + _BACKBONES + _SWAS and not all(
      cfg.rope_layers or (1,)):
    raise ValueError(f"rope_layers with NoPE layers cannot be written as {cfg.architecture}; "
                     f"{SMOLLM3} and {LLAMA4} hold them")
  if lm == GRANITE_HYBRID and len(set(cfg.rope_layers or (1,))) > 1:
    raise ValueError(f"rope_layers with rotary and NoPE layers both cannot be written as "
                     f"{cfg.architecture}, whose layers all rotate or none does")
  if cfg.parallel_mixer != (lm == FALCON_H1):
    raise ValueError(f"parallel_mixer={cfg.parallel_mixer} cannot be written as "
                     f"{cfg.architecture}; {FALCON_H1} holds Mamba2 mixers beside the "
                     "attention, and always has them")
  held = [name for name in MUP_MULTIPLIERS if getattr(cfg, name) != 1.0]
  held += ["ssm_multipliers"] * bool(cfg.ssm_multipliers and not cfg.parallel_mixer)
  held += ["linear_norm"] * (cfg.linear_norm != "after_gate" and not cfg.parallel_mixer)
  if held and lm != FALCON_H1 and not (lm in _COHERES + (COHERE,)
                                       and held == ["lm_head_multiplier"]):
    raise ValueError(f"{held} cannot be written as {cfg.architecture}; {FALCON_H1} holds "
                     "them")
  if lm not in GRANITES:  # Falcon-H1 has an embedding_multiplier too
    held = [name for name in _GRANITE_SCALARS
            if getattr(cfg, name) not in (None, 1.0)
            and not (lm == FALCON_H1 and name == "embedding_multiplier")]
    if held:
      raise ValueError(f"{held} cannot be written as {cfg.architecture}; {GRANITE} and "
                       f"{GRANITE_MOE} hold them")
  if lm == MINISTRAL3 and cfg.rope.type not in ("default", "yarn"):
    raise ValueError(f"rope type {cfg.rope.type!r} cannot be written as {cfg.architecture}, "
                     "whose rotary embedding is the default one or YaRN")
  if lm == MISTRAL4 and cfg.rope.type != "yarn":  # transformers' default one rotates all
    raise ValueError(f"rope type {cfg.rope.type!r} cannot be written as {cfg.architecture}, "
                     "whose rotary embedding is YaRN")
  if lm in _POSITION_SCALED and cfg.rope.type == "yarn" and (
      cfg.rope.original_max_position_embeddings != cfg.attn_position_scale_length):
    raise ValueError(f"attn_position_scale_length={cfg.attn_position_scale_length} cannot "
                     f"be written as {cfg.architecture} beside YaRN over "
                     f"{cfg.rope.original_max_position_embeddings} positions: both are its "
                     "rope_parameters' original_max_position_embeddings")
  if cfg.attn_position_scale and lm not in _POSITION_SCALED:
    raise ValueError(f"attn_position_scale cannot be written as {cfg.architecture}; "
                     f"{' and '.join(_POSITION_SCALED)} hold it")
  if lm == MISTRAL4 and not cfg.attn_position_scale:
    raise ValueError(f"attn_position_scale=0 cannot be written as {cfg.architecture}, whose "
                     "queries are always scaled by position")
  held = [name for name in ("qk_l2_norm", "attention_chunk_size", "attn_temperature_tuning")
          if getattr(cfg, name)]
  if lm == NANOCHAT:  # its q/k norms are Llama 4's, and always there
    if not cfg.qk_l2_norm:
      raise ValueError(f"qk_l2_norm=False cannot be written as {cfg.architecture}, whose "
                       "q and k are always normed after their rotation")
    held.remove("qk_l2_norm")
  if held and lm != LLAMA4:
    raise ValueError(f"{held} cannot be written as {cfg.architecture}; {LLAMA4} holds them")
  if lm == LLAMA4 and (cfg.rope.partial_rotary_factor != 1.0 or cfg.qk_norm):
    raise ValueError(f"{cfg.architecture} rotates every feature and has no weighted q/k "
                     "norms (qk_l2_norm is its norm)")
  if lm == LLAMA4 and cfg.sliding_window is not None and not cfg.attention_chunk_size:
    raise ValueError(f"sliding_window={cfg.sliding_window} without attention_chunk_size "
                     f"cannot be written as {cfg.architecture}, whose windowed layers are "
                     "chunked")
  ropes = [r for r in (cfg.rope, cfg.rope_local) if r is not None]
  if lm in (PHI3, PHIMOE) and any(r.type not in ("default", "longrope") for r in ropes):
    raise ValueError(f"rope type {cfg.rope.type!r} cannot be written as {cfg.architecture}, "
                     "whose rotary embedding is the default one or LongRoPE")
  if lm not in (PHI3, PHIMOE) and any(r.type == "longrope" for r in ropes):
    raise ValueError(f"LongRoPE cannot be written as {cfg.architecture}; {PHI3} and "
                     f"{PHIMOE} hold it")
  if lm == BAMBA and any(r.partial_rotary_factor != 0.5 for r in ropes):
    raise ValueError(f"partial_rotary_factor={cfg.rope.partial_rotary_factor} cannot be "
                     f"written as {cfg.architecture}, whose heads rotate half their "
                     "features")
  partial = ((PHI3, GLM4_MOE, MINIMAX_M2, BAMBA, STABLELM, GPT_NEOX, PHI, NEMOTRON)
             + _GPTJS + _GLMS
             + _QWEN3_5S
             + _DEEPSEEKS)
  if lm not in partial and any(r.partial_rotary_factor != 1.0 for r in ropes):
    raise ValueError(f"a partial rotary embedding cannot be written as {cfg.architecture}; "
                     f"{PHI3}, {GLM4} and {GLM4_MOE} hold it")
  if (lm in (PHI3, OLMOE, COHERE, COHERE2, HELIUM, STABLELM, GPT_NEOX, GPT2, FALCON, OPT,
             GPT_BIGCODE, DBRX, BLOOM, MPT, GPT_NEO) + _GPTJS
      and cfg.head_dim * cfg.num_heads != cfg.d_model):
    raise ValueError(f"head_dim={cfg.head_dim} cannot be written as {cfg.architecture}, "
                     f"whose heads split d_model={cfg.d_model} evenly (head_dim "
                     f"{cfg.d_model // cfg.num_heads} for {cfg.num_heads} heads)")
  if lm == GPT_BIGCODE and cfg.num_kv_heads not in (1, cfg.num_heads):
    raise ValueError(f"num_kv_heads={cfg.num_kv_heads} cannot be written as "
                     f"{cfg.architecture}, whose keys and values are one head (multi_query) "
                     "or one a query head")
  if lm == FALCON and not cfg.parallel_residual and cfg.num_kv_heads not in (
      1, cfg.num_heads):
    raise ValueError(f"num_kv_heads={cfg.num_kv_heads} cannot be written as "
                     f"{cfg.architecture} with sequential layers (parallel_residual=False), "
                     "whose keys and values are one head or one a query head")
  if lm in (OLMO1, DBRX) and cfg.norm_eps != 1e-5:
    raise ValueError(f"norm_eps={cfg.norm_eps} cannot be written as {cfg.architecture}, "
                     "whose LayerNorms' eps is 1e-5")
  if lm == CODEGEN and cfg.num_heads % 4:
    raise ValueError(f"num_heads={cfg.num_heads} cannot be written as {cfg.architecture}, "
                     "whose qkv_proj interleaves four shards of whole heads")
  if lm in _GPTJS and any((r.type, r.theta) != ("default", 10_000.0) for r in ropes):
    raise ValueError(f"rope type {cfg.rope.type!r} at theta {cfg.rope.theta} cannot be "
                     f"written as {cfg.architecture}, whose rotary embedding is the default "
                     "one at base 10000")
  if (lm in (GPT_NEOX, GPT2, OPT, BLOOM, MPT, GPT_NEO) + _GPTJS
      and cfg.num_kv_heads != cfg.num_heads):
    raise ValueError(f"num_kv_heads={cfg.num_kv_heads} cannot be written as "
                     f"{cfg.architecture}, whose keys and values have a head for each of "
                     f"its {cfg.num_heads} query heads")
  if lm in (PHI, GPT2, GPT_BIGCODE, BLOOM) and not cfg.qkv_bias:
    raise ValueError(f"qkv_bias=False cannot be written as {cfg.architecture}, whose "
                     "attention projections always have biases")
  if lm == PHI3 and cfg.qkv_bias:
    raise ValueError(f"qkv_bias=True cannot be written as {cfg.architecture}, whose fused "
                     "qkv_proj has no bias")
  if lm in (BLOOM, MPT) and cfg.ffn_dim != 4 * cfg.d_model:
    raise ValueError(f"ffn_dim={cfg.ffn_dim} cannot be written as {cfg.architecture}, "
                     f"whose MLP is 4 x d_model = {4 * cfg.d_model} wide")
  if lm == GPT_NEO and cfg.query_pre_attn_scalar != 1.0:
    raise ValueError(f"query_pre_attn_scalar={cfg.query_pre_attn_scalar} cannot be written "
                     f"as {cfg.architecture}, whose logits are not scaled "
                     "(query_pre_attn_scalar 1)")
  if lm in _LFM2S + _ERNIES + _GPTJS + (DBRX, MPT, GPT_NEO) and cfg.qkv_bias:
    raise ValueError(f"qkv_bias=True cannot be written as {cfg.architecture}, whose "
                     "attention projections have no biases")
  if lm in ("Gemma2ForCausalLM", VAULTGEMMA) and cfg.rope_local not in (None, cfg.rope):
    raise ValueError(f"rope_local cannot be written as {cfg.architecture}, whose layers "
                     "share one rotary embedding; Gemma3ForCausalLM holds it")


def _rope_scaling(rope: RopeConfig) -> dict[str, Any] | None:
  """Hugging Face's rope_scaling of `rope` (None for the default kind)."""
  if rope.type == "default":
    return None
  scaling = {"rope_type": rope.type, "factor": rope.factor}
  if rope.type == "llama3":
    scaling.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
  if rope.type == "longrope":
    scaling.update(short_factor=list(rope.short_factor), long_factor=list(rope.long_factor),
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    if rope.attention_factor is not None:
      scaling["attention_factor"] = rope.attention_factor
  if rope.type == "yarn":
    scaling.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    for k in ("mscale", "mscale_all_dim", "attention_factor"):
      if getattr(rope, k) is not None:
        scaling[k] = getattr(rope, k)
  return scaling


def model_config_to_hf(cfg: ModelConfig, pad_token_id: int | None = None) -> dict[str, Any]:
  """config.json of `cfg` (see `save_pretrained` for pad_token_id)."""
  check_exportable(cfg)
  lm = _causal_lm(cfg.architecture)
  if lm == GEMMA4:
    return _gemma4_to_hf(cfg, cfg.pad_token_id if pad_token_id is None else pad_token_id)
  rope = cfg.rope
  scaling = _rope_scaling(rope)
  out = {
      "architectures": [cfg.architecture], "model_type": _MODEL_TYPES[lm],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": rope.theta, "rope_scaling": scaling,
      "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.param_dtype,
  }
  if lm == NEMOTRON_H:  # no rotary embedding; its layers' kinds both ways it is read
    for key in ("rope_theta", "rope_scaling", "hidden_act", "rms_norm_eps"):
      out.pop(key)
    out.update(_nemotron_h_to_hf(cfg))
  if lm in (MAMBA2,) + _MAMBA1S:  # the mixers' fields alone: no attention, no MLP
    for key in ("rope_theta", "rope_scaling", "hidden_act", "rms_norm_eps",
                "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "head_dim"):
      out.pop(key)
    out.update(_mamba2_lm_to_hf(cfg) if lm == MAMBA2 else _mamba1_to_hf(cfg))
  if lm in _LFM2S:
    for key in ("rope_theta", "rope_scaling", "hidden_act", "rms_norm_eps"):
      out.pop(key)
    out.update(_lfm2_to_hf(cfg))
  if lm not in ("Qwen2ForCausalLM", MAMBA2) + _MAMBA1S + _LFM2S:
    out["attention_bias"] = cfg.qkv_bias
  if lm in _POSITION_SCALED:  # rope_parameters hold the query scaling too
    out.pop("rope_theta")
    out.pop("rope_scaling")
    out["rope_parameters"] = {
        "rope_type": rope.type, "rope_theta": rope.theta, **(scaling or {}),
        "llama_4_scaling_beta": cfg.attn_position_scale,
        "original_max_position_embeddings": cfg.attn_position_scale_length}
  if lm == MINISTRAL3:
    out["sliding_window"] = cfg.sliding_window
  if lm in (EXAONE4, EXAONE_MOE):
    out.update(sliding_window=cfg.sliding_window,
               layer_types=["sliding_attention" if s else "full_attention"
                            for s in cfg.sliding_layers])
  if lm == EXAONE_MOE:
    mixture = _grouped_mixture_to_hf(cfg)
    out.update(num_experts=mixture.pop("n_routed_experts"),
               num_shared_experts=mixture.pop("n_shared_experts"), **mixture,
               mlp_layer_types=["dense" if i < cfg.dense_layers else "sparse"
                                for i in range(cfg.num_layers)])
  if lm in _ERNIES:
    out["use_bias"] = False
  if lm == ERNIE4_5_MOE:
    out.update(moe_num_experts=cfg.num_experts, moe_k=cfg.num_experts_per_tok,
               moe_intermediate_size=cfg.ffn_dim,
               moe_num_shared_experts=cfg.shared_expert_dim // cfg.ffn_dim,
               moe_layer_start_index=cfg.dense_layers, moe_layer_end_index=cfg.num_layers - 1,
               moe_layer_interval=1, moe_norm_min=1e-12,
               intermediate_size=cfg.dense_ffn_dim or cfg.ffn_dim)
  if lm == SEED_OSS:  # no dropout: what the model was trained and run with here
    out.update(attention_out_bias=cfg.attn_out_bias, mlp_bias=False, attention_dropout=0.0,
               residual_dropout=0.0)
  if lm in GEMMAS:
    out["hidden_act"] = out["hidden_activation"] = "gelu_pytorch_tanh"
  if lm == ARCEE:
    out["hidden_act"] = "relu2"
  if lm == COHERE:
    out.pop("rms_norm_eps")
    out.update(layer_norm_eps=cfg.norm_eps, logit_scale=cfg.lm_head_multiplier,
               use_qk_norm=cfg.qk_norm)
  if lm == STARCODER2:
    for key in ("rms_norm_eps", "attention_bias"):
      out.pop(key)
    out.update(norm_epsilon=cfg.norm_eps, use_bias=cfg.qkv_bias, sliding_window=cfg.sliding_window,
               hidden_act="gelu_pytorch_tanh", attention_dropout=0.0, residual_dropout=0.0,
               embedding_dropout=0.0)
  if lm == JAIS2:
    out.pop("rms_norm_eps")
    out.update(layer_norm_eps=cfg.norm_eps, mlp_bias=cfg.mlp_bias, hidden_act="relu2")
  if lm == FALCON:
    for key in ("intermediate_size", "num_key_value_heads", "head_dim", "hidden_act",
                "rms_norm_eps", "attention_bias"):
      out.pop(key)
    kv = cfg.num_kv_heads
    new = cfg.parallel_mlp_norm or kv not in (1, cfg.num_heads)  # else the older layouts
    out.update(ffn_hidden_size=cfg.ffn_dim, num_kv_heads=kv, new_decoder_architecture=new,
               multi_query=kv == 1, parallel_attn=cfg.parallel_residual,
               num_ln_in_parallel_attn=(2 if cfg.parallel_mlp_norm else 1) if new else None,
               bias=cfg.qkv_bias, alibi=cfg.alibi, layer_norm_epsilon=cfg.norm_eps,
               activation="gelu" if cfg.mlp_activation == "gelu_ungated" else "gelu_new",
               hidden_dropout=0.0, attention_dropout=0.0)
  if lm == OLMO1:
    out.pop("rms_norm_eps")
    out.update(clip_qkv=cfg.clip_qkv, attention_dropout=0.0)
  if lm in (GPT2, GPTJ, GPT_BIGCODE):  # GPT2Config's own keys (GPTJConfig's, ...)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
                "rope_scaling", "max_position_embeddings", "attention_bias"):
      out.pop(key)
  if lm == DBRX:  # its nested config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
                "rope_scaling", "max_position_embeddings", "attention_bias"):
      out.pop(key)
    out.update(d_model=cfg.d_model, n_heads=cfg.num_heads, n_layers=cfg.num_layers,
               max_seq_len=cfg.max_position_embeddings, resid_pdrop=0.0, emb_pdrop=0.0,
               attn_config={"clip_qkv": cfg.clip_qkv, "kv_n_heads": cfg.num_kv_heads,
                            "rope_theta": rope.theta, "attn_pdrop": 0.0},
               ffn_config={"ffn_hidden_size": cfg.ffn_dim, "moe_num_experts": cfg.num_experts,
                           "moe_top_k": cfg.num_experts_per_tok,
                           "moe_normalize_expert_weights": 1.0 if cfg.norm_topk_prob else None,
                           "ffn_act_fn": {"name": "silu"},
                           "moe_loss_weight": cfg.router_aux_loss_coef or 0.01},
               output_router_logits=bool(cfg.router_aux_loss_coef),
               rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                **(scaling or {})})
  if lm in (BLOOM, MPT):  # BloomConfig's / MptConfig's own keys
    for key in ("intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
                "rope_scaling", "attention_bias"):
      out.pop(key)
  if lm == BLOOM:
    out.update(n_layer=cfg.num_layers, n_head=cfg.num_heads, layer_norm_epsilon=cfg.norm_eps,
               apply_residual_connection_post_layernorm=False, pretraining_tp=1,
               slow_but_exact=False, hidden_dropout=0.0, attention_dropout=0.0)
  if lm == GPT_NEO:
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias"):
      out.pop(key)
    kinds = ["local" if s else "global" for s in cfg.sliding_layers]
    period = next(p for p in range(1, len(kinds) + 1)
                  if len(kinds) % p == 0 and kinds == kinds[:p] * (len(kinds) // p))
    out.update(num_layers=cfg.num_layers, num_heads=cfg.num_heads,
               attention_types=[[kinds[:period], len(kinds) // period]],
               window_size=cfg.sliding_window or 256, layer_norm_epsilon=cfg.norm_eps,
               activation_function="gelu" if cfg.mlp_activation == "gelu_ungated" else
               "gelu_new", resid_dropout=0, embed_dropout=0, attention_dropout=0)
  if lm == MPT:
    for key in ("hidden_size", "max_position_embeddings"):
      out.pop(key)
    out.update(d_model=cfg.d_model, n_heads=cfg.num_heads, n_layers=cfg.num_layers,
               expansion_ratio=4, max_seq_len=cfg.max_position_embeddings,
               layer_norm_epsilon=cfg.norm_eps, no_bias=True, learned_pos_emb=False,
               resid_pdrop=0.0, emb_pdrop=0.0,
               attn_config={**_MPT_ATTENTION, "clip_qkv": cfg.clip_qkv,
                            "attn_pdrop": 0})
  if lm == OPT:
    for key in ("intermediate_size", "num_key_value_heads", "head_dim", "hidden_act",
                "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias"):
      out.pop(key)
    out.update(ffn_dim=cfg.ffn_dim, do_layer_norm_before=True, word_embed_proj_dim=cfg.d_model,
               _remove_final_layer_norm=False, enable_bias=cfg.qkv_bias,
               layer_norm_elementwise_affine=not cfg.norm_weightless,
               activation_function="relu", dropout=0.0, attention_dropout=0.0, layerdrop=0.0)
  if lm in _GPTJS:
    out.update(n_embd=cfg.d_model, n_layer=cfg.num_layers, n_head=cfg.num_heads,
               n_positions=cfg.max_position_embeddings, n_inner=cfg.ffn_dim,
               rotary_dim=rope.rotary_dim(cfg.head_dim), layer_norm_epsilon=cfg.norm_eps,
               activation_function="gelu" if cfg.mlp_activation == "gelu_ungated" else
               "gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  if lm == GPT_BIGCODE:
    out.update(n_embd=cfg.d_model, n_layer=cfg.num_layers, n_head=cfg.num_heads,
               n_positions=cfg.max_position_embeddings, n_inner=cfg.ffn_dim,
               layer_norm_epsilon=cfg.norm_eps, multi_query=cfg.num_kv_heads == 1,
               activation_function="gelu" if cfg.mlp_activation == "gelu_ungated" else
               "gelu_pytorch_tanh", scale_attn_weights=True, resid_pdrop=0.0,
               embd_pdrop=0.0, attn_pdrop=0.0)
  if lm == GPT2:
    out.update(n_embd=cfg.d_model, n_layer=cfg.num_layers, n_head=cfg.num_heads,
               n_positions=cfg.max_position_embeddings, n_inner=cfg.ffn_dim,
               layer_norm_epsilon=cfg.norm_eps,
               activation_function="gelu" if cfg.mlp_activation == "gelu_ungated" else
               "gelu_new", scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  if lm == NEMOTRON:
    for key in ("rms_norm_eps", "rope_theta", "rope_scaling"):
      out.pop(key)
    out.update(norm_eps=cfg.norm_eps, mlp_bias=cfg.mlp_bias, hidden_act="relu2",
               partial_rotary_factor=rope.partial_rotary_factor, attention_dropout=0.0,
               rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                "partial_rotary_factor": rope.partial_rotary_factor,
                                **(scaling or {})})
  if lm == NANOCHAT:
    out.update(hidden_act="relu2", final_logit_softcapping=cfg.final_logit_softcap)
  if lm == STABLELM:
    for key in ("rms_norm_eps", "attention_bias", "rope_theta", "rope_scaling"):
      out.pop(key)
    out.update(layer_norm_eps=cfg.norm_eps, use_qkv_bias=cfg.qkv_bias,
               qk_layernorm=cfg.qk_norm, use_parallel_residual=cfg.parallel_residual,
               partial_rotary_factor=rope.partial_rotary_factor, hidden_dropout=0.0,
               attention_dropout=0.0,
               rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                "partial_rotary_factor": rope.partial_rotary_factor,
                                **(scaling or {})})
  if lm == GPT_NEOX:
    for key in ("rms_norm_eps", "rope_theta", "rope_scaling", "num_key_value_heads",
                "head_dim"):
      out.pop(key)
    out.update(layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.parallel_residual,
               hidden_act="gelu" if cfg.mlp_activation == "gelu_ungated" else "gelu_fast",
               rotary_pct=rope.partial_rotary_factor, rotary_emb_base=rope.theta,
               attention_dropout=0.0, hidden_dropout=0.0,
               rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                "partial_rotary_factor": rope.partial_rotary_factor,
                                **(scaling or {})})
  if lm == PHI:
    for key in ("rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias"):
      out.pop(key)
    out.update(layer_norm_eps=cfg.norm_eps, qk_layernorm=False,
               hidden_act="gelu" if cfg.mlp_activation == "gelu_ungated" else "gelu_new",
               partial_rotary_factor=rope.partial_rotary_factor, resid_pdrop=0.0,
               embd_pdrop=0.0, attention_dropout=0.0,
               rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                "partial_rotary_factor": rope.partial_rotary_factor,
                                **(scaling or {})})
  if lm in _COHERES:
    out.pop("rms_norm_eps")
    out.update(layer_norm_eps=cfg.norm_eps, logit_scale=cfg.lm_head_multiplier,
               sliding_window=cfg.sliding_window,
               layer_types=["sliding_attention" if s else "full_attention"
                            for s in cfg.sliding_layers])
  if lm == COHERE2_MOE:
    out.update(rms_norm_eps=None if cfg.layer_norm else cfg.norm_eps, intermediate_size=cfg.ffn_dim,
               num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               expert_selection_fn=cfg.router_scoring, norm_topk_prob=cfg.norm_topk_prob,
               num_shared_experts=cfg.shared_expert_dim // cfg.ffn_dim,
               shared_expert_combination_strategy=(
                   "average" if cfg.shared_expert_average else "sum"),
               mlp_layer_types=["dense" if i < cfg.dense_layers else "sparse"
                                for i in range(cfg.num_layers)],
               prefix_dense_intermediate_size=cfg.dense_ffn_dim or None,
               prefix_dense_sliding_window_pattern=_cohere2_moe_prefix_pattern(cfg),
               output_router_logits=bool(cfg.router_aux_loss_coef),
               router_aux_loss_coef=cfg.router_aux_loss_coef)
  if lm == APERTUS:
    out.pop("rope_theta")
    out.pop("rope_scaling")
    out.update(hidden_act="xielu", rope_parameters={"rope_type": rope.type,
                                                    "rope_theta": rope.theta,
                                                    **(scaling or {})})
  if lm in _QWEN_WINDOWED and cfg.sliding_window is not None:
    kinds = cfg.sliding_layers
    out.update(use_sliding_window=True, sliding_window=cfg.sliding_window,
               max_window_layers=kinds.index(True) if True in kinds else cfg.num_layers,
               layer_types=["sliding_attention" if s else "full_attention" for s in kinds])
  if lm in _GEMMA2S:
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    # An int where it is one: transformers' strict config classes type the field so.
    out.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
               attn_logit_softcapping=cfg.attn_logit_softcap,
               final_logit_softcapping=cfg.final_logit_softcap,
               sliding_window=cfg.sliding_window,
               layer_types=["sliding_attention" if s else "full_attention"
                            for s in cfg.sliding_layers])
  if lm == "Olmo3ForCausalLM":
    # By layer type, as transformers 5 writes it (rope_theta / rope_scaling alone would
    # give the sliding layers base 500k whatever ours is).
    local = cfg.rope_local or cfg.rope
    out.pop("rope_theta")
    out.pop("rope_scaling")
    out["rope_parameters"] = {
        kind: {"rope_type": r.type, "rope_theta": r.theta, **(_rope_scaling(r) or {})}
        for kind, r in (("full_attention", rope), ("sliding_attention", local))}
    out.update(sliding_window=cfg.sliding_window,
               layer_types=["sliding_attention" if s else "full_attention"
                            for s in cfg.sliding_layers])
  if lm == "Gemma3ForCausalLM":
    # Both forms: transformers 5 reads rope_parameters by layer type, earlier releases
    # rope_theta / rope_scaling (full layers) and rope_local_base_freq.
    local = cfg.rope_local or cfg.rope
    out["rope_local_base_freq"] = local.theta
    out["rope_parameters"] = {
        kind: {"rope_type": r.type, "rope_theta": r.theta, **(_rope_scaling(r) or {})}
        for kind, r in (("full_attention", rope), ("sliding_attention", local))}
  if cfg.dense_layers and lm != COHERE2_MOE:  # (its dense layers' width is their own key)
    out["intermediate_size"] = cfg.dense_ffn_dim
  if lm == HUNYUAN_MOE:
    out.update(num_experts=cfg.num_experts, moe_topk=cfg.num_experts_per_tok,
               intermediate_size=cfg.ffn_dim)
  if lm == MELLUM:
    local = cfg.rope_local or cfg.rope
    out.pop("rope_theta")
    out.pop("rope_scaling")
    out.update(
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob, moe_intermediate_size=cfg.ffn_dim,
        intermediate_size=cfg.dense_ffn_dim or cfg.ffn_dim,
        mlp_layer_types=["dense" if i < cfg.dense_layers else "sparse"
                         for i in range(cfg.num_layers)],
        sliding_window=cfg.sliding_window or 1024,
        layer_types=["sliding_attention" if s else "full_attention"
                     for s in cfg.sliding_layers],
        rope_parameters={kind: {"rope_type": r.type, "rope_theta": r.theta,
                                **(_rope_scaling(r) or {})}
                         for kind, r in (("full_attention", rope),
                                         ("sliding_attention", local))},
        output_router_logits=bool(cfg.router_aux_loss_coef),
        router_aux_loss_coef=cfg.router_aux_loss_coef or 0.001)
  if lm == JAMBA:  # its own keys: no rotary embedding, the layers' periods, Mamba 1's
    for key in ("rope_theta", "rope_scaling", "head_dim", "attention_bias"):
      out.pop(key, None)
    out.update(_jamba_to_hf(cfg), intermediate_size=cfg.ffn_dim)
  if lm in ("Qwen3MoeForCausalLM", QWEN2_MOE):
    out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               norm_topk_prob=cfg.norm_topk_prob, moe_intermediate_size=cfg.ffn_dim,
               decoder_sparse_step=1, mlp_only_layers=list(range(cfg.dense_layers)),
               use_sliding_window=False)
    if lm == QWEN2_MOE:
      out.pop("attention_bias")
      out.update(qkv_bias=cfg.qkv_bias,
                 shared_expert_intermediate_size=cfg.shared_expert_dim)
  elif lm in _DEEPSEEKS:
    out.pop("head_dim")  # transformers sets it to qk_rope_head_dim
    out.update(**({} if lm == YOUTU else _grouped_mixture_to_hf(cfg)),
               kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
               qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
               qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim)
    if lm in _SPARSE_ATTENTION:
      out.update(index_topk=cfg.index_topk, index_n_heads=cfg.index_heads,
                 index_head_dim=cfg.index_head_dim, rope_interleave=True,
                 num_nextn_predict_layers=0, mlp_layer_types=[
                     "dense" if i < cfg.dense_layers else "sparse"
                     for i in range(cfg.num_layers)])
      if lm == GLM_MOE_DSA:
        out["indexer_types"] = ["full"] * cfg.num_layers
    elif lm == DEEPSEEK_V3:
      out.update(rope_interleave=True, num_nextn_predict_layers=0, topk_method="noaux_tc",
                 scoring_func="sigmoid")
    elif lm == GLM4_MOE_LITE:
      out.pop("first_k_dense_replace")
      out.update(rope_interleave=True, mlp_layer_types=[
          "dense" if i < cfg.dense_layers else "sparse" for i in range(cfg.num_layers)])
    elif lm in (MISTRAL4, YOUTU):
      out["rope_interleave"] = True
    else:
      out["topk_method"] = "group_limited_greedy" if cfg.router_groups > 1 else "greedy"
  elif lm == DOTS1:
    kinds = cfg.sliding_layers
    out.update(**_grouped_mixture_to_hf(cfg), sliding_window=cfg.sliding_window,
               max_window_layers=kinds.index(True) if True in kinds else cfg.num_layers,
               layer_types=["sliding_attention" if s else "full_attention" for s in kinds])
  elif lm == SOLAR_OPEN:
    out.pop("intermediate_size")
    out.update(**_grouped_mixture_to_hf(cfg))
    out.pop("first_k_dense_replace")
  elif lm == GLM4_MOE:
    out.update(**_grouped_mixture_to_hf(cfg), use_qk_norm=cfg.qk_norm,
               num_nextn_predict_layers=0,
               partial_rotary_factor=rope.partial_rotary_factor,
               rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                "partial_rotary_factor": rope.partial_rotary_factor,
                                **(scaling or {})})
  elif lm in _QWEN3_5S:
    if lm in (QWEN3_5_MOE, QWEN3_NEXT):
      out.pop("intermediate_size")
      out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.ffn_dim,
                 shared_expert_intermediate_size=cfg.shared_expert_dim)
    if lm == QWEN3_NEXT:
      out.update(norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
                 mlp_only_layers=[])
    out.pop("rope_theta")
    out.pop("rope_scaling")
    out.update(rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                "partial_rotary_factor": rope.partial_rotary_factor,
                                **(scaling or {})},
               layer_types=list(cfg.layer_types),
               linear_num_key_heads=cfg.linear_num_key_heads,
               linear_num_value_heads=cfg.linear_num_value_heads,
               linear_key_head_dim=cfg.linear_key_head_dim,
               linear_value_head_dim=cfg.linear_value_head_dim,
               linear_conv_kernel_dim=cfg.linear_conv_kernel)
  elif lm == "MixtralForCausalLM":
    out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               sliding_window=cfg.sliding_window)
  elif lm == PHIMOE:
    out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               sliding_window=cfg.sliding_window, router_jitter_noise=cfg.router_jitter_eps,
               input_jitter_noise=0.0, lm_head_bias=cfg.lm_head_bias, rms_norm_eps=cfg.norm_eps)
    if rope.type == "longrope":  # its cos and sin scale, read by PhiMoE's rotary embedding
      mscale = rope_lib.inverse_frequencies(rope, cfg.head_dim, cfg.max_position_embeddings)[1]
      out["rope_scaling"] = {**scaling, "short_mscale": mscale, "long_mscale": mscale}
  elif lm == BAMBA:
    out.pop("rope_theta")
    out.pop("rope_scaling")
    out.update(rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                "partial_rotary_factor": rope.partial_rotary_factor,
                                **(scaling or {})},
               attn_layer_indices=[i for i, linear in enumerate(cfg.linear_layers)
                                   if not linear],
               mlp_bias=False, z_loss_coefficient=0.0, **_mamba2_to_hf(cfg))
  elif lm == FALCON_H1:
    out.pop("rope_theta")
    out.pop("rope_scaling")
    inner = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    mamba = _mamba2_to_hf(cfg.replace(d_model=inner))  # mamba_d_ssm says the width
    mamba.pop("mamba_expand")
    out.update(rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                **(scaling or {})},
               **mamba, mamba_d_ssm=inner, mamba_expand=max(1, inner // cfg.d_model),
               mamba_rms_norm=cfg.linear_norm != "none",
               mamba_norm_before_gate=cfg.linear_norm == "before_gate",
               mlp_bias=False, projectors_bias=False,
               embedding_multiplier=cfg.embedding_multiplier,
               **{name: getattr(cfg, name) for name in _FALCON_H1_SCALARS},
               mlp_multipliers=[cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier],
               ssm_multipliers=list(cfg.ssm_multipliers or (1.0,) * 5))
  elif lm in (OLMOE, FLEX_OLMO):
    out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               norm_topk_prob=cfg.norm_topk_prob, clip_qkv=cfg.clip_qkv)
  elif lm == MINIMAX_M2:
    # transformers 5's rope_parameters, and the published files' keys beside them (what
    # vLLM and SGLang read: without use_routing_bias they drop the correction bias).
    out.pop("rope_scaling")
    out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                "partial_rotary_factor": rope.partial_rotary_factor,
                                **(scaling or {})},
               rotary_dim=rope.rotary_dim(cfg.head_dim),
               **{key: value for key, (value, _) in _MINIMAX_M2_FIXED.items()})
  elif lm == LLAMA4:
    rope_layers = [int(r) for r in (cfg.rope_layers or (1,) * cfg.num_layers)]
    floor = cfg.attn_floor_scale
    out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               intermediate_size_mlp=cfg.dense_ffn_dim or cfg.ffn_dim,
               interleave_moe_layer_step=cfg.moe_layer_step,
               moe_layers=[i for i, moe in enumerate(cfg.mixture_flags) if moe],
               use_qk_norm=cfg.qk_l2_norm, no_rope_layers=rope_layers,
               attention_chunk_size=cfg.attention_chunk_size or None,
               layer_types=["chunked_attention" if s else "full_attention"
                            for s in cfg.sliding_layers],
               attn_temperature_tuning=cfg.attn_temperature_tuning,
               floor_scale=int(floor) if float(floor).is_integer() else floor,
               attn_scale=cfg.attn_scale)
  elif lm == "MistralForCausalLM":
    out["sliding_window"] = cfg.sliding_window
  elif lm in (MINISTRAL, CWM):
    out.update(sliding_window=cfg.sliding_window, layer_types=[
        "sliding_attention" if s else "full_attention" for s in cfg.sliding_layers])
    if lm == CWM:  # its config's rope without rope_parameters is its llama3 one
      out.pop("rope_theta")
      out.pop("rope_scaling")
      out["rope_parameters"] = {"rope_type": rope.type, "rope_theta": rope.theta,
                                **(scaling or {})}
  elif lm in GRANITES:
    out.update({name: getattr(cfg, name) for name in _GRANITE_SCALARS})
    out["attention_multiplier"] = cfg.attention_scale or cfg.head_dim ** -0.5
    if lm in _SWAS:
      local = (cfg.rope_local or cfg.rope).theta
      out.update(sliding_window=cfg.sliding_window, layer_types=[
          "sliding_attention" if s else "full_attention" for s in cfg.sliding_layers],
          layer_rope_theta=[0.0 if not r else local if s else cfg.rope.theta for s, r in zip(
              cfg.sliding_layers, cfg.rope_layers or (1,) * cfg.num_layers)])
    if lm in (GRANITE_MOE,) + _SHAREDS:
      out.update(num_local_experts=cfg.num_experts,
                 num_experts_per_tok=cfg.num_experts_per_tok)
      if lm in _SHAREDS:
        out["shared_intermediate_size"] = cfg.shared_expert_dim
    elif lm == GRANITE_HYBRID:
      nope = not all(cfg.rope_layers or (1,))
      out.update(num_local_experts=cfg.num_experts,
                 num_experts_per_tok=cfg.num_experts_per_tok or 1,
                 shared_intermediate_size=(cfg.shared_expert_dim if cfg.num_experts
                                           else cfg.ffn_dim),
                 layer_types=["mamba" if linear else "attention"
                              for linear in cfg.linear_layers],
                 position_embedding_type=None if nope else "rope")
      if any(cfg.linear_layers):
        out.update(_mamba2_to_hf(cfg))
    else:
      out["mlp_bias"] = False
  elif lm in _GLMS:
    out.update(partial_rotary_factor=rope.partial_rotary_factor,
               rope_parameters={"rope_type": rope.type, "rope_theta": rope.theta,
                                "partial_rotary_factor": rope.partial_rotary_factor,
                                **(scaling or {})})
  elif lm == SMOLLM3:
    out["no_rope_layers"] = [int(r) for r in (cfg.rope_layers or (1,) * cfg.num_layers)]
    kinds = cfg.sliding_layers
    out.update(use_sliding_window=cfg.sliding_window is not None,
               sliding_window=cfg.sliding_window, mlp_bias=False,
               layer_types=["sliding_attention" if k else "full_attention" for k in kinds])
  elif lm == PHI3:
    out.pop("attention_bias")
    out.update(sliding_window=cfg.sliding_window,
               partial_rotary_factor=rope.partial_rotary_factor,
               original_max_position_embeddings=(rope.original_max_position_embeddings
                                                 or cfg.max_position_embeddings))
  elif lm == GPT_OSS:
    # Explicit even for the default kind: transformers (and `hf_config_to_model_config`)
    # read a gpt-oss config.json without rope parameters as YaRN x32.
    out["rope_parameters"] = {"rope_type": rope.type, "rope_theta": rope.theta,
                              **(scaling or {})}
    out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
               sliding_window=cfg.sliding_window, swiglu_limit=cfg.swiglu_limit,
               swiglu_alpha=cfg.swiglu_alpha,
               layer_types=["sliding_attention" if s else "full_attention"
                            for s in cfg.sliding_layers])
  if cfg.num_experts:
    out.update(output_router_logits=cfg.router_aux_loss_coef > 0,
               router_aux_loss_coef=cfg.router_aux_loss_coef)
  pad = cfg.pad_token_id if pad_token_id is None else pad_token_id
  if cfg.architecture != lm:  # A reward model: one label, and the pad id it finds rows by.
    out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    pad = 0 if pad is None else pad
  # Stated even when unknown: transformers' defaults for some classes (Phi-3's 32000,
  # GLM-4's 151329, ...) lie past a smaller vocabulary.
  out["pad_token_id"] = None if pad is None else int(pad)
  return out


def _grouped_mixture_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """GLM-4.5's and DeepSeek's config.json fields of the mixture: routed and shared
  experts, groups, scaling and the leading dense layers."""
  return dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
              norm_topk_prob=cfg.norm_topk_prob, moe_intermediate_size=cfg.ffn_dim,
              n_shared_experts=cfg.shared_expert_dim // cfg.ffn_dim,
              routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.router_groups,
              topk_group=cfg.router_group_topk, first_k_dense_replace=cfg.dense_layers)


# -- parameter name mapping -----------------------------------------------------------------

Transform = Callable[[np.ndarray], np.ndarray]


def _mapping(cfg: ModelConfig, score: bool | None = None
             ) -> list[tuple[tuple, str, Transform, Transform, tuple]]:
  """(our state path, HF name, hf->ours, ours->hf, our shape) for every parameter in the
  files: with `score` (default: cfg.architecture is a sequence classifier) the value head
  as `score.weight` [1, D]."""
  if score is None:
    score = cfg.architecture in SEQUENCE_CLASSIFIERS
  d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  ident = lambda x: x  # noqa: E731

  def proj_in(heads):  # HF [heads*h, d] <-> ours [d, heads, h]
    return (lambda x: x.T.reshape(d, heads, h), lambda x: x.reshape(d, heads * h).T)

  def bias(heads):
    return (lambda x: x.reshape(heads, h), lambda x: x.reshape(heads * h))

  if _causal_lm(cfg.architecture) in _BACKBONES:
    return _nemotron_h_rows(cfg, proj_in)
  if _causal_lm(cfg.architecture) in _LFM2S:
    return _lfm2_rows(cfg, proj_in)
  if _causal_lm(cfg.architecture) == GEMMA4:
    return _gemma4_rows(cfg)
  final = ("final_layernorm" if _causal_lm(cfg.architecture) in (BAMBA, FALCON_H1, PHI, JAMBA)
           else "norm")
  # A norm's weight, and a LayerNorm's bias (norm_bias)
  norm_parts = ([("scale", "weight")] + [("bias", "bias")] * cfg.norm_bias
                if not cfg.norm_weightless else [])
  rows = [(("embed",), "model.embed_tokens.weight", ident, ident, (cfg.vocab_size, d))]
  rows += [(("final_norm", part), f"model.{final}.{hf_part}", ident, ident, (d,))
           for part, hf_part in norm_parts]
  if cfg.embed_norm and not cfg.norm_weightless:  # BLOOM's word_embeddings_layernorm
    rows += [(("embed_norm", part), f"model.embed_norm.{hf_part}", ident, ident, (d,))
             for part, hf_part in norm_parts]
  if cfg.lm_head and not cfg.tie_embeddings:
    rows.append((("lm_head",), "lm_head.weight", lambda x: x.T, lambda x: x.T,
                 (d, cfg.vocab_size)))
  if cfg.lm_head and cfg.lm_head_bias:  # Phi's
    rows.append((("lm_head_bias",), "lm_head.bias", ident, ident, (cfg.vocab_size,)))
  if cfg.learned_positions:  # GPT-2's wpe (`_GPT2_NAMES`)
    rows.append((("pos_embed",), "model.embed_positions.weight", ident, ident,
                 (cfg.max_position_embeddings + cfg.position_offset, d)))
  if score:
    rows.append((("value_w",), "score.weight", lambda x: x[0], lambda x: x[None, :], (d,)))
  # Our post_attn_norm is the MLP's input norm: Llama's post_attention_layernorm, Gemma
  # 2's pre_feedforward_layernorm (whose post_attention_layernorm norms the attention's
  # output: our attn_out_norm).
  norms = [("input_norm", "input_layernorm")]
  if _causal_lm(cfg.architecture) == APERTUS:
    norms = [("input_norm", "attention_layernorm"), ("post_attn_norm", "feedforward_layernorm")]
  elif cfg.parallel_residual and not cfg.parallel_mlp_norm:  # one norm a layer (Cohere)
    pass
  elif _causal_lm(cfg.architecture) == GLM4:  # both norms of each sublayer, GLM's names
    norms += [("attn_out_norm", "post_self_attn_layernorm"),
              ("post_attn_norm", "post_attention_layernorm"),
              ("mlp_out_norm", "post_mlp_layernorm")]
  elif cfg.output_norms:  # OLMo 2 / 3: the outputs' norms alone
    norms = [("attn_out_norm", "post_attention_layernorm"),
             ("mlp_out_norm", "post_feedforward_layernorm")]
  elif cfg.sandwich_norms:
    norms += [("post_attn_norm", "pre_feedforward_layernorm"),
              ("attn_out_norm", "post_attention_layernorm"),
              ("mlp_out_norm", "post_feedforward_layernorm")]
  elif _causal_lm(cfg.architecture) in (BAMBA, FALCON_H1, JAMBA):
    norms += [("post_attn_norm", "pre_ff_layernorm")]
  elif _causal_lm(cfg.architecture) == VAULTGEMMA:
    norms += [("post_attn_norm", "pre_feedforward_layernorm")]
  else:
    norms += [("post_attn_norm", "post_attention_layernorm")]
  fused = _causal_lm(cfg.architecture) == PHI3
  fused_mlp = _causal_lm(cfg.architecture) in (PHI3,) + _GLMS
  qk_in, qk_bias = proj_in, bias
  if _causal_lm(cfg.architecture) in _INTERLEAVED:  # interleaved rotary <-> rotate-half
    qk_in = _interleaved_rows(proj_in, h, d, cfg)
    qk_bias = _interleaved_rows(bias, h, None, cfg)
  if _causal_lm(cfg.architecture) == NANOCHAT:  # its rotation the other way
    qk_in = _swapped_rows(proj_in, h, d)

  def dense_mlp(p: tuple, hf: str, width: int) -> list:
    if cfg.mlp_activation == "xielu":  # no gate, xIELU's scalars (Apertus)
      return _relu2_mlp_rows(p, hf, d, width) + [
          (p + (f"xielu_{name}",), hf + f"act_fn.{name}", ident, ident, shape)
          for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()),
                              ("eps", ()))]
    if _causal_lm(cfg.architecture) == NANOCHAT:  # no gate: fc1, fc2
      return [(p + (ours,), hf + name + ".weight", lambda x: x.T, lambda x: x.T, shape)
              for ours, name, shape in (("up_proj", "fc1", (d, width)),
                                        ("down_proj", "fc2", (width, d)))]
    if _causal_lm(cfg.architecture) == STARCODER2:  # no gate: c_fc, c_proj (and biases)
      return [(p + (ours,), hf + name + ".weight", lambda x: x.T, lambda x: x.T, shape)
              for ours, name, shape in (("up_proj", "c_fc", (d, width)),
                                        ("down_proj", "c_proj", (width, d)))] + [
          (p + (ours,), hf + name + ".bias", ident, ident, shape)
          for ours, name, shape in (("up_bias", "c_fc", (width,)),
                                    ("down_bias", "c_proj", (d,))) if cfg.mlp_bias]
    if cfg.ungated:  # no gate (Arcee, Jais 2, GPT-NeoX)
      return _relu2_mlp_rows(p, hf, d, width) + [
          (p + (ours,), hf + name + ".bias", ident, ident, shape)
          for ours, name, shape in (("up_bias", "up_proj", (width,)),
                                    ("down_bias", "down_proj", (d,))) if cfg.mlp_bias]
    return [(p + (name,), hf + name + ".weight", lambda x: x.T, lambda x: x.T, shape)
            for name, shape in (("gate_proj", (d, width)), ("up_proj", (d, width)),
                                ("down_proj", (width, d)))]

  for i in range(cfg.num_layers):
    p, hf = layer_path(cfg, i), f"model.layers.{i}."
    mixture = cfg.mixture_flags[i]
    rows += [(p + (ours, part), hf + name + f".{hf_part}", ident, ident, (d,))
             for ours, name in norms for part, hf_part in norm_parts]
    if cfg.parallel_mixer:  # Falcon-H1: its mamba beside the attention
      rows += _mamba2_rows(cfg, p, hf)
    if cfg.linear_layers[i] and cfg.linear_mixer == "mamba2":
      rows += _mamba2_rows(cfg, p, hf)
    elif cfg.linear_layers[i] and cfg.linear_mixer == "mamba1":  # Jamba's
      rows += _mamba1_rows(cfg, p, hf + "mamba.")
    elif cfg.linear_layers[i]:
      rows += _linear_attention_rows(cfg, p, hf)
    elif cfg.kv_lora_rank:
      rows += _latent_attention_rows(cfg, p, hf)
    elif cfg.attn_output_gate:  # q_proj's rows per head: [queries; gate]
      rows += [(p + ("attn", name), hf + "self_attn.q_proj.weight",
                *_head_half(proj_in(n), which, n, h, d), (d, n, h))
               for which, name in ((0, "q_proj"), (1, "q_gate"))]
      rows += [
          (p + ("attn", "k_proj"), hf + "self_attn.k_proj.weight", *qk_in(k), (d, k, h)),
          (p + ("attn", "v_proj"), hf + "self_attn.v_proj.weight", *proj_in(k), (d, k, h))]
    elif fused:  # Phi-3: [q; k; v] rows of one qkv_proj, [gate; up] rows of gate_up_proj
      qkv = hf + "self_attn.qkv_proj.weight"
      rows += [(p + ("attn", name), qkv, *_fused_part(proj_in(heads), start * h, heads * h,
                                                      (n + 2 * k) * h), (d, heads, h))
               for name, start, heads in (("q_proj", 0, n), ("k_proj", n, k),
                                          ("v_proj", n + k, k))]
    else:
      rows += [
          (p + ("attn", "q_proj"), hf + "self_attn.q_proj.weight", *qk_in(n), (d, n, h)),
          (p + ("attn", "k_proj"), hf + "self_attn.k_proj.weight", *qk_in(k), (d, k, h)),
          (p + ("attn", "v_proj"), hf + "self_attn.v_proj.weight", *proj_in(k), (d, k, h))]
    attention = not cfg.linear_layers[i]
    vh = cfg.v_head_dim or h
    if attention:
      rows.append((p + ("attn", "o_proj"), hf + "self_attn.o_proj.weight",
                   lambda x: x.reshape(d, n, vh).transpose(1, 2, 0),
                   lambda x: x.transpose(2, 0, 1).reshape(d, n * vh), (n, vh, d)))
    if fused_mlp:
      transposed = (lambda x: x.T, lambda x: x.T)
      rows += [(p + ("mlp", name), hf + "mlp.gate_up_proj.weight",
                *_fused_part(transposed, start, f, 2 * f), (d, f))
               for name, start in (("gate_proj", 0), ("up_proj", f))]
      rows.append((p + ("mlp", "down_proj"), hf + "mlp.down_proj.weight", lambda x: x.T,
                   lambda x: x.T, (f, d)))
    elif mixture and _causal_lm(cfg.architecture) == DBRX:
      rows += _dbrx_expert_rows(cfg, p, hf)
    elif mixture and _causal_lm(cfg.architecture) == GPT_OSS:
      rows += _gpt_oss_expert_rows(cfg, p, hf)
    elif mixture and _causal_lm(cfg.architecture) in GRANITES[1:]:
      rows += _granite_moe_expert_rows(cfg, p, hf)
      if cfg.shared_expert_dim:  # Granite 4's shared_mlp
        rows += _granite_shared_mlp_rows(p + ("mlp", "shared"), hf, d, cfg.shared_expert_dim)
    elif _causal_lm(cfg.architecture) == GRANITE_HYBRID:  # its dense MLP: the shared_mlp
      rows += _granite_shared_mlp_rows(p + ("mlp",), hf, d, f)
    elif mixture and _causal_lm(cfg.architecture) == LLAMA4:
      rows += _llama4_expert_rows(cfg, p, hf)
      rows += dense_mlp(p + ("mlp", "shared"), hf + "feed_forward.shared_expert.",
                        cfg.shared_expert_dim)
    elif mixture:
      # One HF tensor per expert; ours stack them: ("layers", i, "mlp", name, j) is the
      # expert-j slice of the [E, ...] parameter.
      router, gate, up, down = _MOE_NAMES[_causal_lm(cfg.architecture)]
      rows.append((p + ("mlp", "router"), hf + router + ".weight", lambda x: x.T,
                   lambda x: x.T, (d, cfg.num_experts)))
      if _causal_lm(cfg.architecture) == ERNIE4_5_MOE:  # moe_statics', [1, E]
        rows.append((p + ("mlp", "score_correction_bias"),
                     hf + "mlp.moe_statics.e_score_correction_bias", lambda x: x[0],
                     lambda x: x[None], (cfg.num_experts,)))
      elif cfg.has_correction_bias:  # MiniMax-M2's and K-EXAONE's on the block
        owner = {MINIMAX_M2: "block_sparse_moe", EXAONE_MOE: "mlp"}.get(
            _causal_lm(cfg.architecture), router)
        rows.append((p + ("mlp", "score_correction_bias"),
                     hf + owner + ".e_score_correction_bias", ident, ident,
                     (cfg.num_experts,)))
      if cfg.shared_expert_dim:
        shared = ("mlp.shared_expert." if cfg.shared_expert_gate else "mlp.shared_mlp."
                  if _causal_lm(cfg.architecture) == HUNYUAN_MOE else "mlp.shared_experts.")
        rows += dense_mlp(p + ("mlp", "shared"), hf + shared, cfg.shared_expert_dim)
      if cfg.shared_expert_gate:
        rows.append((p + ("mlp", "shared_gate"), hf + "mlp.shared_expert_gate.weight",
                     lambda x: x[0], lambda x: x[None, :], (d,)))
      for j in range(cfg.num_experts):
        rows += [(p + ("mlp", ours, j), hf + name.format(j=j) + ".weight", lambda x: x.T,
                  lambda x: x.T, shape)
                 for ours, name, shape in (("gate_proj", gate, (d, f)),
                                           ("up_proj", up, (d, f)),
                                           ("down_proj", down, (f, d)))]
    else:
      mlp = "feed_forward." if _causal_lm(cfg.architecture) in _FEED_FORWARD else "mlp."
      rows += dense_mlp(p + ("mlp",), hf + mlp, cfg.dense_ffn_dim if cfg.num_experts else f)
    if attention and cfg.qkv_bias:
      rows += [(p + ("attn", "q_bias"), hf + "self_attn.q_proj.bias", *qk_bias(n), (n, h)),
               (p + ("attn", "k_bias"), hf + "self_attn.k_proj.bias", *qk_bias(k), (k, h)),
               (p + ("attn", "v_bias"), hf + "self_attn.v_proj.bias", *bias(k), (k, h))]
    if attention and cfg.qk_norm and _causal_lm(cfg.architecture) == STABLELM:
      # one LayerNorm a head in the files: each row a head's slice of ours [heads, h]
      rows += [(p + ("attn", f"{q}_norm", "scale", j),
                hf + f"self_attn.{q}_layernorm.norms.{j}.weight", ident, ident, (h,))
               for q, heads in (("q", n), ("k", k)) for j in range(heads)]
    elif attention and cfg.qk_norm and cfg.qk_norm_head_weights:  # HF [heads, h], as ours
      rows += [(p + ("attn", "q_norm", "scale"), hf + "self_attn.q_norm.weight",
                *_head_weights(qk_bias(n), n, h), (n, h)),
               (p + ("attn", "k_norm", "scale"), hf + "self_attn.k_norm.weight",
                *_head_weights(qk_bias(k), k, h), (k, h))]
    elif attention and cfg.qk_norm and cfg.qk_norm_heads:  # HF [heads * h] <-> ours [heads, h]
      rows += [(p + ("attn", "q_norm", "scale"), hf + "self_attn.q_norm.weight", *bias(n),
                (n, h)),
               (p + ("attn", "k_norm", "scale"), hf + "self_attn.k_norm.weight", *bias(k),
                (k, h))]
    elif attention and cfg.qk_norm:
      q_name, k_name = (("query_layernorm", "key_layernorm") if cfg.qk_norm_after_rope
                        else ("q_norm", "k_norm"))
      rows += [(p + ("attn", "q_norm", "scale"), hf + f"self_attn.{q_name}.weight", ident,
                ident, (h,)),
               (p + ("attn", "k_norm", "scale"), hf + f"self_attn.{k_name}.weight", ident,
                ident, (h,))]
    if attention and cfg.attn_out_bias:
      rows.append((p + ("attn", "o_bias"), hf + "self_attn.o_proj.bias", ident, ident, (d,)))
    if attention and cfg.attention_sinks:
      rows.append((p + ("attn", "sinks"), hf + "self_attn.sinks", ident, ident, (n,)))
  return _renamed_rows(cfg, rows)


# The parts of transformers' Llama names that other classes name their own way, in the
# order their renames apply (`_renames`).
_LLAMA_PARTS = {"embed_tokens": r"^model\.embed_tokens\.",
                "embed_positions": r"^model\.embed_positions\.", "norm": r"^model\.norm\.",
                "embed_norm": r"^model\.embed_norm\.",
                "layers": r"^model\.layers\.", "lm_head": r"^lm_head\.",
                "input_layernorm": r"\.input_layernorm\.",
                "post_attention_layernorm": r"\.post_attention_layernorm\.",
                "o_proj": r"\.self_attn\.o_proj\.", "qkv": r"\.self_attn\.[qkv]_proj\.",
                "self_attn": r"\.self_attn\.", "up_proj": r"\.mlp\.up_proj\.",
                "down_proj": r"\.mlp\.down_proj\.", "mlp": r"\.mlp\."}


def _renames(**names: str) -> tuple[tuple[str, str], ...]:
  """(pattern, replacement) renames from Llama's names to a class's: `names` gives its
  name of each part of `_LLAMA_PARTS` it names otherwise (qkv: q_proj, k_proj and v_proj,
  which it fuses; self_attn and mlp: the modules, after their projections), dots and
  all."""
  return tuple((pattern, names[part]) for part, pattern in _LLAMA_PARTS.items()
               if part in names)


# GPT-NeoX's (q, k and v in one query_key_value: `_renamed_rows`), Phi's (its final norm
# named in `_mapping`), GPT-2's (q, k and v in one c_attn, [q; k; v] along its output),
# Falcon's (ln_attn and ln_mlp for the parallel layers' two norms), GPT-J's, OPT's (the
# MLP's modules on the layer: a PEFT name's mlp.fc1 is fc1), DBRX's (its experts' rows
# under their own names, `_dbrx_expert_rows`).
_GPT_NEOX_NAMES = _renames(
    embed_tokens="gpt_neox.embed_in.", norm="gpt_neox.final_layer_norm.",
    layers="gpt_neox.layers.", lm_head="embed_out.", o_proj=".attention.dense.",
    qkv=".attention.query_key_value.", up_proj=".mlp.dense_h_to_4h.",
    down_proj=".mlp.dense_4h_to_h.")
_PHI_NAMES = _renames(o_proj=".self_attn.dense.", up_proj=".mlp.fc1.", down_proj=".mlp.fc2.")
_GPT2_NAMES = _renames(
    embed_tokens="transformer.wte.", embed_positions="transformer.wpe.",
    norm="transformer.ln_f.", layers="transformer.h.", input_layernorm=".ln_1.",
    post_attention_layernorm=".ln_2.", o_proj=".attn.c_proj.", qkv=".attn.c_attn.",
    up_proj=".mlp.c_fc.", down_proj=".mlp.c_proj.")
_FALCON_NAMES = _renames(
    embed_tokens="transformer.word_embeddings.", norm="transformer.ln_f.",
    layers="transformer.h.", o_proj=".self_attention.dense.",
    qkv=".self_attention.query_key_value.", up_proj=".mlp.dense_h_to_4h.",
    down_proj=".mlp.dense_4h_to_h.")
_BLOOM_NAMES = _FALCON_NAMES + _renames(
    embed_norm="transformer.word_embeddings_layernorm.")
_MPT_NAMES = _renames(
    embed_tokens="transformer.wte.", norm="transformer.norm_f.", layers="transformer.blocks.",
    input_layernorm=".norm_1.", post_attention_layernorm=".norm_2.",
    o_proj=".attn.out_proj.", qkv=".attn.Wqkv.", self_attn=".attn.",
    up_proj=".ffn.up_proj.", down_proj=".ffn.down_proj.", mlp=".ffn.")
_GPT_NEO_NAMES = _renames(
    embed_tokens="transformer.wte.", embed_positions="transformer.wpe.",
    norm="transformer.ln_f.", layers="transformer.h.", input_layernorm=".ln_1.",
    post_attention_layernorm=".ln_2.", o_proj=".attn.attention.out_proj.",
    self_attn=".attn.attention.", up_proj=".mlp.c_fc.", down_proj=".mlp.c_proj.")
_FALCON_TWO_NORMS = _renames(input_layernorm=".ln_attn.", post_attention_layernorm=".ln_mlp.")
_GPTJ_NAMES = _renames(
    embed_tokens="transformer.wte.", norm="transformer.ln_f.", layers="transformer.h.",
    input_layernorm=".ln_1.", o_proj=".attn.out_proj.", self_attn=".attn.",
    up_proj=".mlp.fc_in.", down_proj=".mlp.fc_out.")
_OPT_NAMES = _renames(
    embed_tokens="model.decoder.embed_tokens.", embed_positions="model.decoder.embed_positions.",
    norm="model.decoder.final_layer_norm.", layers="model.decoder.layers.",
    input_layernorm=".self_attn_layer_norm.", post_attention_layernorm=".final_layer_norm.",
    o_proj=".self_attn.out_proj.", up_proj=".fc1.", down_proj=".fc2.", mlp=".")
_DBRX_NAMES = _renames(
    embed_tokens="transformer.wte.", norm="transformer.norm_f.", layers="transformer.blocks.",
    input_layernorm=".norm_attn_norm.norm_1.",
    post_attention_layernorm=".norm_attn_norm.norm_2.",
    o_proj=".norm_attn_norm.attn.out_proj.", qkv=".norm_attn_norm.attn.Wqkv.")
# Classes whose tensors transformers names its own way (not Llama's).
_CLASS_NAMES = {GPT_NEOX: _GPT_NEOX_NAMES, PHI: _PHI_NAMES, GPT2: _GPT2_NAMES,
                FALCON: _FALCON_NAMES, GPTJ: _GPTJ_NAMES, OPT: _OPT_NAMES,
                GPT_BIGCODE: _GPT2_NAMES, DBRX: _DBRX_NAMES, BLOOM: _BLOOM_NAMES,
                MPT: _MPT_NAMES, GPT_NEO: _GPT_NEO_NAMES,
                CODEGEN: _renames(qkv=".attn.qkv_proj.") + _GPTJ_NAMES}
# GPT-2's projections: torch Conv1D's weights, [in, out].
_CONV1D = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


def _renamed_rows(cfg: ModelConfig, rows: list) -> list:
  """`rows` under the class's own names (`_CLASS_NAMES`; others as they are). GPT-NeoX's
  q, k and v are each the part of query_key_value that its rows are there: head by
  head, head_dim rows of q, of k, of v ([head 0's q; its k; its v; head 1's q; ...],
  weight and bias alike); Falcon's its groups' (`_grouped_qkv_part`); GPT-2's the thirds
  of c_attn's output, [q; k; v], its projections' weights transposed (Conv1D's [in,
  out])."""
  lm = _causal_lm(cfg.architecture)
  if lm not in _CLASS_NAMES:
    return rows
  out = []
  for ours, name, to_ours, to_hf, shape in rows:
    fused = re.search(r"\.self_attn\.([qkv])_proj\.", name)
    if fused:
      to_ours, to_hf = _fused_qkv_part(cfg, fused[1], (to_ours, to_hf))
    name = _class_name(cfg, name)
    if lm == GPT2 and _CONV1D.search(name):
      to_ours, to_hf = _transposed((to_ours, to_hf))
    out.append((ours, name, to_ours, to_hf, shape))
  return out


# Classes whose q, k and v are parts of one fused tensor under their own names
# (`_fused_qkv_part`).
_FUSED_QKV = (GPT_NEOX, FALCON, GPT_BIGCODE, BLOOM, CODEGEN, GPT2, DBRX, MPT)


def _fused_qkv_part(cfg: ModelConfig, which: str, inner: tuple[Transform, Transform]
                    ) -> tuple[Transform, Transform]:
  """(HF -> ours, ours -> HF) of q, k or v (`which`) as rows of the class's fused tensor
  (`inner` mapping those rows to ours; the tensor's other rows zeros on the way out): by
  key/value group (GPT-NeoX, Falcon, GPTBigCode, BLOOM), CodeGen's four shards, or [q; k;
  v] (GPT-2, DBRX, MPT); `inner` itself for other classes."""
  lm = _causal_lm(cfg.architecture)
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if lm in (GPT_NEOX, FALCON, GPT_BIGCODE, BLOOM):  # NeoX's: a group a query head
    return _grouped_qkv_part(inner, which, k, n // k, h)
  if lm == CODEGEN:
    return _indexed_part(inner, _codegen_rows(cfg, which), 3 * n * h)
  if lm in (GPT2, DBRX, MPT):  # [q; k; v]
    start, size = {"q": (0, n * h), "k": (n * h, k * h), "v": ((n + k) * h, k * h)}[which]
    return _fused_part(inner, start, size, (n + 2 * k) * h)
  return inner


def _codegen_rows(cfg: ModelConfig, part: str) -> np.ndarray:
  """The rows of CodeGen's qkv_proj [3 D, D] that hold q, k or v (`part`) in our head
  order: four model-parallel shards, each its quarter of the heads' q, then v, then k."""
  local = cfg.num_heads * cfg.head_dim // 4
  offset = "qvk".index(part) * local
  return (np.arange(4)[:, None] * 3 * local + offset + np.arange(local)[None]).reshape(-1)


def _indexed_part(inner: tuple[Transform, Transform], index: np.ndarray, total: int
                  ) -> tuple[Transform, Transform]:
  """(HF -> ours, ours -> HF) of rows `index` of a fused HF tensor of `total` rows,
  `inner` mapping those rows (in that order) to ours. The HF side holds zeros in the
  other rows: the parts of one tensor add up to it."""
  to_ours, to_hf = inner

  def part_to_hf(x):
    rows = to_hf(x)
    out = np.zeros((total, *rows.shape[1:]), rows.dtype)
    out[index] = rows
    return out
  return (lambda x: to_ours(x[index])), part_to_hf


def _class_name(cfg: ModelConfig, name: str) -> str:
  """Llama's name of a tensor (or module, ending in a dot) under its class's own
  (`_CLASS_NAMES`; Falcon's two parallel norms ln_attn and ln_mlp; other classes' as it
  is)."""
  lm = _causal_lm(cfg.architecture)
  renames = _CLASS_NAMES.get(lm, ()) + (_FALCON_TWO_NORMS if lm == FALCON and cfg.parallel_mlp_norm
                                else ())
  return functools.reduce(lambda s, rename: re.sub(*rename, s), renames, name)


def _transposed(inner: tuple[Transform, Transform]) -> tuple[Transform, Transform]:
  """`inner` (HF -> ours, ours -> HF) of a Linear's weight [out, in], for a tensor held
  transposed ([in, out]: GPT-2's Conv1D)."""
  to_ours, to_hf = inner
  return (lambda x: to_ours(x.T)), (lambda x: to_hf(x).T)


def _grouped_qkv_part(inner: tuple[Transform, Transform], which: str, groups: int,
                      queries: int, h: int) -> tuple[Transform, Transform]:
  """(HF -> ours, ours -> HF) of q, k or v (`which`) in a fused HF tensor whose rows hold,
  for each of `groups` key/value heads, h rows of each of its `queries` query heads, then
  of its key, then of its value (Falcon's query_key_value; GPT-NeoX's, a query head a
  group), `inner` mapping the part's rows [heads * h, ...] (group-major, as the heads
  share keys) to ours. The HF side holds zeros in the other parts' rows: the parts of one
  tensor add up to it."""
  to_ours, to_hf = inner
  parts = queries + 2
  index = {"q": slice(0, queries), "k": slice(queries, queries + 1),
           "v": slice(queries + 1, parts)}[which]

  def part_to_ours(x):
    rest = x.shape[1:]
    return to_ours(x.reshape(groups, parts, h, *rest)[:, index].reshape(-1, *rest))

  def part_to_hf(x):
    rows = to_hf(x)
    rest = rows.shape[1:]
    out = np.zeros((groups, parts, h, *rest), rows.dtype)
    out[:, index] = rows.reshape(groups, -1, h, *rest)
    return out.reshape(groups * parts * h, *rest)
  return part_to_ours, part_to_hf


def _nemotron_h_rows(cfg: ModelConfig, proj_in: Callable[[int], tuple[Transform, Transform]]
                     ) -> list:
  """`_mapping` of Nemotron-H: backbone.embeddings, backbone.norm_f, and per layer its
  norm and its mixer's tensors (Mamba2's, attention's q/k/v/o_proj, or the MLP's up_proj
  and down_proj)."""
  d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  ident = lambda x: x  # noqa: E731
  rows = [(("embed",), "backbone.embeddings.weight", ident, ident, (cfg.vocab_size, d)),
          (("final_norm", "scale"), "backbone.norm_f.weight", ident, ident, (d,))]
  if cfg.lm_head and not cfg.tie_embeddings:
    rows.append((("lm_head",), "lm_head.weight", lambda x: x.T, lambda x: x.T,
                 (d, cfg.vocab_size)))
  for i, kind in enumerate(cfg.layer_types):
    p, hf = layer_path(cfg, i), f"backbone.layers.{i}."
    rows.append((p + ("input_norm", "scale"), hf + "norm.weight", ident, ident, (d,)))
    mixer = hf + "mixer."
    if kind == "linear_attention" and cfg.linear_mixer == "mamba1":
      rows += _mamba1_rows(cfg, p, mixer)
    elif kind == "linear_attention":
      rows += _mamba2_rows(cfg, p, hf, "mixer.")
    elif kind == "mlp":
      rows += _relu2_mlp_rows(p + ("mlp",), mixer, d, cfg.dense_ffn_dim or f)
    elif kind == "moe":
      rows += _nemotron_moe_rows(cfg, p + ("mlp",), mixer)
    else:
      rows += [(p + ("attn", name), mixer + f"{name}.weight", *proj_in(heads), (d, heads, h))
               for name, heads in (("q_proj", n), ("k_proj", k), ("v_proj", k))]
      rows.append((p + ("attn", "o_proj"), mixer + "o_proj.weight",
                   lambda x: x.reshape(d, n, h).transpose(1, 2, 0),
                   lambda x: x.transpose(2, 0, 1).reshape(d, n * h), (n, h, d)))
  return rows


def _lfm2_rows(cfg: ModelConfig, proj_in: Callable[[int], tuple[Transform, Transform]]
               ) -> list:
  """`_mapping` of LFM2: model.embed_tokens, model.embedding_norm, and per layer its
  operator_norm and ffn_norm, its short convolution (`_short_conv_rows`) or attention
  (q/k/v_proj, out_proj, q_layernorm / k_layernorm), and its feed_forward (w1, w3, w2)."""
  d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  ident = lambda x: x  # noqa: E731
  transposed = (lambda x: x.T, lambda x: x.T)
  rows = [(("embed",), "model.embed_tokens.weight", ident, ident, (cfg.vocab_size, d)),
          (("final_norm", "scale"), "model.embedding_norm.weight", ident, ident, (d,))]
  if cfg.lm_head and not cfg.tie_embeddings:
    rows.append((("lm_head",), "lm_head.weight", *transposed, (d, cfg.vocab_size)))
  for i, linear in enumerate(cfg.linear_layers):
    p, hf = layer_path(cfg, i), f"model.layers.{i}."
    rows += [(p + (ours, "scale"), hf + f"{name}.weight", ident, ident, (d,))
             for ours, name in (("input_norm", "operator_norm"), ("post_attn_norm", "ffn_norm"))]
    if linear:
      rows += _short_conv_rows(cfg, p, hf + "conv.")
    else:
      attn = hf + "self_attn."
      rows += [(p + ("attn", name), attn + f"{name}.weight", *proj_in(heads), (d, heads, h))
               for name, heads in (("q_proj", n), ("k_proj", k), ("v_proj", k))]
      rows.append((p + ("attn", "o_proj"), attn + "out_proj.weight",
                   lambda x: x.reshape(d, n, h).transpose(1, 2, 0),
                   lambda x: x.transpose(2, 0, 1).reshape(d, n * h), (n, h, d)))
      rows += [(p + ("attn", f"{q}_norm", "scale"), attn + f"{q}_layernorm.weight", ident,
                ident, (h,)) for q in "qk"]
    if cfg.mixture_flags[i]:  # LFM2-MoE: the router, its correction bias, each expert
      ff, e = hf + "feed_forward.", cfg.num_experts
      rows.append((p + ("mlp", "router"), ff + "gate.weight", *transposed, (d, e)))
      if cfg.router_correction_bias:
        rows.append((p + ("mlp", "score_correction_bias"), ff + "expert_bias", ident, ident,
                     (e,)))
      rows += [(p + ("mlp", ours, j), ff + f"experts.{j}.{name}.weight", *transposed, shape)
               for j in range(e)
               for ours, name, shape in (("gate_proj", "w1", (d, f)),
                                         ("up_proj", "w3", (d, f)),
                                         ("down_proj", "w2", (f, d)))]
      continue
    w = cfg.dense_ffn_dim if cfg.num_experts else f
    rows += [(p + ("mlp", ours), hf + f"feed_forward.{name}.weight", *transposed, shape)
             for ours, name, shape in (("gate_proj", "w1", (d, w)), ("up_proj", "w3", (d, w)),
                                       ("down_proj", "w2", (w, d)))]
  return rows


def _short_conv_rows(cfg: ModelConfig, p: tuple, conv: str) -> list:
  """An LFM2 short convolution (`ShortConv`) under `conv`: in_proj [3D, D] (rows B, C,
  x; ours b_proj, c_proj, x_proj [D, D]), conv.weight [D, 1, C] (ours conv [D, C]),
  out_proj [D, D] (ours o_proj), and with conv_bias their biases."""
  d, c = cfg.d_model, cfg.linear_conv_kernel
  ident = lambda x: x  # noqa: E731
  transposed = (lambda x: x.T, lambda x: x.T)
  mixer = p + ("linear_attn",)
  rows = [(mixer + (name,), conv + "in_proj.weight",
           *_fused_part(transposed, j * d, d, 3 * d), (d, d))
          for j, name in enumerate(("b_proj", "c_proj", "x_proj"))]
  rows += [(mixer + ("conv",), conv + "conv.weight", lambda x: x.reshape(d, c),
            lambda x: x.reshape(d, 1, c), (d, c)),
           (mixer + ("o_proj",), conv + "out_proj.weight", *transposed, (d, d))]
  if cfg.linear_conv_bias:
    rows += [(mixer + (name,), conv + "in_proj.bias", *_fused_part((ident, ident), j * d, d,
                                                                  3 * d), (d,))
             for j, name in enumerate(("b_bias", "c_bias", "x_bias"))]
    rows += [(mixer + ("conv_bias",), conv + "conv.bias", ident, ident, (d,)),
             (mixer + ("o_bias",), conv + "out_proj.bias", ident, ident, (d,))]
  return rows


def _relu2_mlp_rows(p: tuple, hf: str, d: int, f: int) -> list:
  """An MLP without a gate at `p` (Nemotron-H's): HF's up_proj [F, D], down_proj [D, F]."""
  transposed = (lambda x: x.T, lambda x: x.T)
  return [(p + ("up_proj",), hf + "up_proj.weight", *transposed, (d, f)),
          (p + ("down_proj",), hf + "down_proj.weight", *transposed, (f, d))]


def _nemotron_moe_rows(cfg: ModelConfig, p: tuple, hf: str) -> list:
  """A Nemotron 3 mixture layer's tensors under its `hf` mixer: the router (gate.weight
  [E, D], its e_score_correction_bias), the shared expert (shared_experts.up_proj /
  down_proj), the latent projections (fc1_latent_proj [L, D], fc2_latent_proj [D, L])
  where the experts run in a latent, and one up_proj [F, L] and down_proj [L, F] per
  expert (the published files' layout; transformers stacks them when it loads)."""
  d, f, e = cfg.d_model, cfg.ffn_dim, cfg.num_experts
  lat = cfg.moe_latent_dim or d
  ident = lambda x: x  # noqa: E731
  transposed = (lambda x: x.T, lambda x: x.T)
  rows = [(p + ("router",), hf + "gate.weight", *transposed, (d, e)),
          (p + ("score_correction_bias",), hf + "gate.e_score_correction_bias", ident,
           ident, (e,))]
  rows += _relu2_mlp_rows(p + ("shared",), hf + "shared_experts.", d, cfg.shared_expert_dim)
  if cfg.moe_latent_dim:
    rows += [(p + ("latent_in",), hf + "fc1_latent_proj.weight", *transposed, (d, lat)),
             (p + ("latent_out",), hf + "fc2_latent_proj.weight", *transposed, (lat, d))]
  for j in range(e):
    rows += [(p + ("up_proj", j), hf + f"experts.{j}.up_proj.weight", *transposed, (lat, f)),
             (p + ("down_proj", j), hf + f"experts.{j}.down_proj.weight", *transposed,
              (f, lat))]
  return rows


def _head_half(inner: tuple[Transform, Transform], which: int, n: int, h: int, d: int
               ) -> tuple[Transform, Transform]:
  """(HF -> ours, ours -> HF) of half `which` of each head's 2h rows of a [n * 2h, d] HF
  tensor (Qwen3.5's q_proj: a head's queries, then its output gate), `inner` mapping
  [n * h, d] rows to ours. The HF side holds zeros in the other half: the halves add up."""
  to_ours, to_hf = inner

  def half_to_hf(x):
    out = np.zeros((n, 2, h, d), x.dtype)
    out[:, which] = np.asarray(to_hf(x)).reshape(n, h, d)
    return out.reshape(n * 2 * h, d)
  return (lambda x: to_ours(x.reshape(n, 2, h, d)[:, which].reshape(n * h, d))), half_to_hf


def _linear_attention_rows(cfg: ModelConfig, p: tuple, hf: str) -> list:
  """A Gated DeltaNet layer (Qwen3.5's linear_attn): in_proj_qkv's rows are [q; k; v] and
  the depthwise conv1d's channels likewise; ours keep q, k and v (and their taps) apart."""
  d, c = cfg.d_model, cfg.linear_conv_kernel
  hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  total = 2 * hk * dk + hv * dv
  ident = lambda x: x  # noqa: E731
  attn = hf + "linear_attn."

  def proj_in(heads, width):  # HF [heads * width, d] <-> ours [d, heads, width]
    return (lambda x: x.T.reshape(d, heads, width),
            lambda x: x.reshape(d, heads * width).T)

  def taps(heads, width):  # HF [heads * width, 1, c] <-> ours [heads, width, c]
    return (lambda x: x.reshape(heads, width, c), lambda x: x.reshape(heads * width, 1, c))

  parts = (("q", 0, hk, dk), ("k", hk * dk, hk, dk), ("v", 2 * hk * dk, hv, dv))
  if _causal_lm(cfg.architecture) == QWEN3_NEXT:
    rows = _qwen3_next_projection_rows(cfg, p, attn)
  else:
    rows = [(p + ("linear_attn", f"{name}_proj"), attn + "in_proj_qkv.weight",
             *_fused_part(proj_in(heads, width), start, heads * width, total),
             (d, heads, width)) for name, start, heads, width in parts]
  rows += [(p + ("linear_attn", f"{name}_conv"), attn + "conv1d.weight",
            *_fused_part(taps(heads, width), start, heads * width, total), (heads, width, c))
           for name, start, heads, width in parts]
  transposed = (lambda x: x.T, lambda x: x.T)
  if _causal_lm(cfg.architecture) != QWEN3_NEXT:
    rows += [(p + ("linear_attn", "z_proj"), attn + "in_proj_z.weight", *proj_in(hv, dv),
              (d, hv, dv)),
             (p + ("linear_attn", "b_proj"), attn + "in_proj_b.weight", *transposed, (d, hv)),
             (p + ("linear_attn", "a_proj"), attn + "in_proj_a.weight", *transposed, (d, hv))]
  rows += [(p + ("linear_attn", "dt_bias"), attn + "dt_bias", ident, ident, (hv,)),
           (p + ("linear_attn", "A_log"), attn + "A_log", ident, ident, (hv,)),
           (p + ("linear_attn", "norm"), attn + "norm.weight", ident, ident, (dv,)),
           (p + ("linear_attn", "o_proj"), attn + "out_proj.weight",
            lambda x: x.reshape(d, hv, dv).transpose(1, 2, 0),
            lambda x: x.transpose(2, 0, 1).reshape(d, hv * dv), (hv, dv, d))]
  return rows


def _mamba1_rows(cfg: ModelConfig, p: tuple, mixer: str) -> list:
  """A Mamba 1 layer's mixer (`Mamba1`): in_proj's rows are [x; z], x_proj's [dt; B; C];
  ours keep each apart (v_proj, z_proj [D, E, 1]; x_dt [E, R], x_b, x_c [E, N])."""
  d, c = cfg.d_model, cfg.linear_conv_kernel
  e, n, r = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_dt_rank
  ident = lambda x: x  # noqa: E731
  proj_in = (lambda x: x.T.reshape(d, e, 1), lambda x: x.reshape(d, e).T)
  rows = [(p + ("linear_attn", name), mixer + "in_proj.weight",
           *_fused_part(proj_in, start, e, 2 * e), (d, e, 1))
          for name, start in (("v_proj", 0), ("z_proj", e))]
  transposed = (lambda x: x.T, lambda x: x.T)
  rows += [(p + ("linear_attn", name), mixer + "x_proj.weight",
            *_fused_part(transposed, start, size, r + 2 * n), (e, size))
           for name, start, size in (("x_dt", 0, r), ("x_b", r, n), ("x_c", r + n, n))]
  rows.append((p + ("linear_attn", "v_conv"), mixer + "conv1d.weight",
               lambda x: x.reshape(e, 1, c), lambda x: x.reshape(e, 1, c), (e, 1, c)))
  if cfg.linear_conv_bias:
    rows.append((p + ("linear_attn", "v_conv_bias"), mixer + "conv1d.bias",
                 lambda x: x.reshape(e, 1), lambda x: x.reshape(e), (e, 1)))
  rows += [(p + ("linear_attn", "dt_proj"), mixer + "dt_proj.weight", *transposed, (r, e)),
           (p + ("linear_attn", "dt_bias"), mixer + "dt_proj.bias", ident, ident, (e,)),
           (p + ("linear_attn", "A_log"), mixer + "A_log", ident, ident, (e, n)),
           (p + ("linear_attn", "D"), mixer + "D", ident, ident, (e,)),
           (p + ("linear_attn", "o_proj"), mixer + "out_proj.weight",
            lambda x: x.T.reshape(e, 1, d), lambda x: x.reshape(e, d).T, (e, 1, d))]
  if cfg.linear_bcdt_norm == "weighted":  # Jamba's
    rows += [(p + ("linear_attn", f"{ours}_norm"), mixer + f"{ours}_layernorm.weight", ident,
              ident, (width,)) for ours, width in (("dt", r), ("b", n), ("c", n))]
  return rows


def _mamba2_rows(cfg: ModelConfig, p: tuple, hf: str, module: str = "mamba.") -> list:
  """A Mamba2 layer (Granite 4's and Bamba's mamba, Nemotron-H's mixer: `module`):
  in_proj's rows are [z; x; B; C; dt] and the depthwise conv1d's channels (and bias) [x;
  B; C]; ours keep each apart (`Mamba2`: x in v_proj, B in k_proj, C in q_proj, dt in
  a_proj)."""
  d, c = cfg.d_model, cfg.linear_conv_kernel
  groups, heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  state, width = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  inner, bc = heads * width, groups * state
  conv_total, in_total = inner + 2 * bc, 2 * inner + 2 * bc + heads
  ident = lambda x: x  # noqa: E731
  mamba = hf + module

  def proj_in(shape):  # HF [prod(shape), d] <-> ours [d, *shape]
    return (lambda x: x.T.reshape(d, *shape), lambda x: x.reshape(d, -1).T)

  def taps(shape):  # HF [prod(shape), 1, c] <-> ours [*shape, c]
    return (lambda x: x.reshape(*shape, c), lambda x: x.reshape(-1, 1, c))

  def flat(shape):  # HF [prod(shape)] <-> ours shape
    return (lambda x: x.reshape(shape), lambda x: x.reshape(-1))

  conv = (("v", 0, (heads, width)), ("k", inner, (groups, state)),
          ("q", inner + bc, (groups, state)))
  inputs = (("z", 0, (heads, width)),) + tuple(
      (name, inner + start, shape) for name, start, shape in conv) + (
      ("a", 2 * inner + 2 * bc, (heads,)),)
  rows = [(p + ("linear_attn", f"{name}_proj"), mamba + "in_proj.weight",
           *_fused_part(proj_in(shape), start, int(np.prod(shape)), in_total), (d, *shape))
          for name, start, shape in inputs]
  rows += [(p + ("linear_attn", f"{name}_conv"), mamba + "conv1d.weight",
            *_fused_part(taps(shape), start, int(np.prod(shape)), conv_total), (*shape, c))
           for name, start, shape in conv]
  if cfg.linear_conv_bias:
    rows += [(p + ("linear_attn", f"{name}_conv_bias"), mamba + "conv1d.bias",
              *_fused_part(flat(shape), start, int(np.prod(shape)), conv_total), shape)
             for name, start, shape in conv]
  rows += [(p + ("linear_attn", name), mamba + name, ident, ident, (heads,))
           for name in ("A_log", "dt_bias", "D")]
  if cfg.linear_norm != "none":
    rows.append((p + ("linear_attn", "norm"), mamba + "norm.weight", *flat((heads, width)),
                 (heads, width)))
  rows += [(p + ("linear_attn", "o_proj"), mamba + "out_proj.weight",
            lambda x: x.reshape(d, heads, width).transpose(1, 2, 0),
            lambda x: x.transpose(2, 0, 1).reshape(d, inner), (heads, width, d))]
  return rows


def _key_group_part(groups: int, width: int, start: int, size: int, d: int, out: tuple
                    ) -> tuple[Transform, Transform]:
  """(HF -> ours, ours -> HF) of rows [start, start + size) of each of `groups` groups of
  `width` rows of a [groups * width, d] HF tensor (Qwen3-Next's in_proj_qkvz / in_proj_ba,
  grouped by key head), ours [d, *out] holding the groups' parts in order. The HF side
  holds zeros in the other rows: the parts add up."""
  def to_hf(x):
    full = np.zeros((groups, width, d), x.dtype)
    full[:, start:start + size] = np.asarray(x).reshape(d, groups, size).transpose(1, 2, 0)
    return full.reshape(groups * width, d)
  return (lambda x: x.reshape(groups, width, d)[:, start:start + size]
          .transpose(2, 0, 1).reshape(d, *out)), to_hf


def _qwen3_next_projection_rows(cfg: ModelConfig, p: tuple, attn: str) -> list:
  """Qwen3-Next's fused Gated DeltaNet projections: in_proj_qkvz's rows per key head
  [q (dk); k (dk); v (r dv); z (r dv)], in_proj_ba's [b (r); a (r)] (r value heads a key
  head, value head h r + i its i-th)."""
  d, hk, hv = cfg.d_model, cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  r = hv // hk
  width = 2 * dk + 2 * r * dv
  qkvz = [("q_proj", 0, dk, (hk, dk)), ("k_proj", dk, dk, (hk, dk)),
          ("v_proj", 2 * dk, r * dv, (hv, dv)), ("z_proj", 2 * dk + r * dv, r * dv, (hv, dv))]
  rows = [(p + ("linear_attn", name), attn + "in_proj_qkvz.weight",
           *_key_group_part(hk, width, start, size, d, out), (d, *out))
          for name, start, size, out in qkvz]
  rows += [(p + ("linear_attn", name), attn + "in_proj_ba.weight",
            *_key_group_part(hk, 2 * r, start, r, d, (hv,)), (d, hv))
           for name, start in (("b_proj", 0), ("a_proj", r))]
  return rows


def _latent_attention_rows(cfg: ModelConfig, p: tuple, hf: str) -> list:
  """A DeepSeek-V3 layer's multi-head latent attention (o_proj aside): HF's q rows per
  head [unrotated, rotated] become ours [rotated, unrotated], the rotated ones
  de-interleaved (evens, then odds) with rope_interleave; kv_a_proj_with_mqa's rows are
  [latent; the keys' rotated part]; kv_b_proj's per head [keys' unrotated; values]."""
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  hr, rkv, rq, vh = cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim
  hn = h - hr
  rotated = np.concatenate([np.arange(0, hr, 2), np.arange(1, hr, 2)])  # rope_interleave
  order = np.concatenate([hn + rotated, np.arange(hn)])  # our head features, in HF's
  back = np.argsort(order)
  ident = lambda x: x  # noqa: E731

  def q_rows(width):  # HF [n * h, width] <-> ours [width, n, h]
    return (lambda x: x.reshape(n, h, width)[:, order].transpose(2, 0, 1),
            lambda x: x.transpose(1, 2, 0)[:, back].reshape(n * h, width))

  def kv_b_part(start, size, total=hn + vh):  # HF [n * total, rkv] <-> ours [rkv, n, size]
    def to_hf(x):
      out = np.zeros((n, total, rkv), x.dtype)
      out[:, start:start + size] = x.transpose(1, 2, 0)
      return out.reshape(n * total, rkv)
    return (lambda x: x.reshape(n, total, rkv)[:, start:start + size].transpose(2, 0, 1),
            to_hf)

  attn = hf + "self_attn."
  rows = []
  if rq:
    rows += [(p + ("attn", "q_a_proj"), attn + "q_a_proj.weight", lambda x: x.T,
              lambda x: x.T, (d, rq)),
             (p + ("attn", "q_a_norm", "scale"), attn + "q_a_layernorm.weight", ident, ident,
              (rq,)),
             (p + ("attn", "q_b_proj"), attn + "q_b_proj.weight", *q_rows(rq), (rq, n, h))]
  else:
    rows.append((p + ("attn", "q_proj"), attn + "q_proj.weight", *q_rows(d), (d, n, h)))
  kv_a = attn + "kv_a_proj_with_mqa.weight"
  transposed = (lambda x: x.T, lambda x: x.T)
  rope_rows = (lambda x: x[rotated].T, lambda x: x.T[np.argsort(rotated)])
  rows += [(p + ("attn", "kv_a_proj"), kv_a, *_fused_part(transposed, 0, rkv, rkv + hr),
            (d, rkv)),
           (p + ("attn", "k_rope_proj"), kv_a, *_fused_part(rope_rows, rkv, hr, rkv + hr),
            (d, hr)),
           (p + ("attn", "kv_a_norm", "scale"), attn + "kv_a_layernorm.weight", ident, ident,
            (rkv,)),
           (p + ("attn", "k_b_proj"), attn + "kv_b_proj.weight", *kv_b_part(0, hn),
            (rkv, n, hn)),
           (p + ("attn", "v_b_proj"), attn + "kv_b_proj.weight", *kv_b_part(hn, vh),
            (rkv, n, vh))]
  if cfg.index_topk:  # DeepSeek Sparse Attention's indexer
    hi, di = cfg.index_heads, cfg.index_head_dim
    # Its rotated features: rotate-half in DeepSeek-V3.2, interleaved pairs in GLM-5.
    first = (rotated if _causal_lm(cfg.architecture) == GLM_MOE_DSA else np.arange(hr))
    feats = np.concatenate([first, np.arange(hr, di)])
    undo = np.argsort(feats)
    ix = attn + "indexer."
    rows += [(p + ("attn", "index_q_proj"), ix + "wq_b.weight",
              lambda x: x.reshape(hi, di, rq)[:, feats].transpose(2, 0, 1),
              lambda x: x.transpose(1, 2, 0)[:, undo].reshape(hi * di, rq), (rq, hi, di)),
             (p + ("attn", "index_k_proj"), ix + "wk.weight", lambda x: x[feats].T,
              lambda x: x.T[undo], (d, di)),
             (p + ("attn", "index_k_norm_scale"), ix + "k_norm.weight", lambda x: x[feats],
              lambda x: x[undo], (di,)),
             (p + ("attn", "index_k_norm_bias"), ix + "k_norm.bias", lambda x: x[feats],
              lambda x: x[undo], (di,)),
             (p + ("attn", "index_weights_proj"), ix + "weights_proj.weight", lambda x: x.T,
              lambda x: x.T, (d, hi))]
  return rows


# Classes whose rotary embedding rotates interleaved pairs (2i, 2i + 1) of each head.
_INTERLEAVED = (LLAMA4, COHERE, HELIUM) + _GPTJS + _GLMS + _COHERES + _ERNIES


def _permuted_rows(inner: Callable[[int], tuple[Transform, Transform]], h: int,
                   d: int | None, order: np.ndarray) -> Callable[[int], tuple]:
  """`inner` (heads -> (HF -> ours, ours -> HF) of a q/k weight [heads * h, d], or bias
  [heads * h] with d None) with each head's features taken in `order` (ours j is HF's
  order[j]), and put back on export."""
  back = np.argsort(order)
  tail = () if d is None else (d,)

  def rows(heads):
    to_ours, to_hf = inner(heads)
    return (lambda x: to_ours(x.reshape(heads, h, *tail)[:, order].reshape(heads * h, *tail)),
            lambda x: to_hf(x).reshape(heads, h, *tail)[:, back].reshape(heads * h, *tail))
  return rows


def _interleaved_rows(inner: Callable[[int], tuple[Transform, Transform]], h: int,
                      d: int | None, cfg: ModelConfig) -> Callable[[int], tuple]:
  """`_permuted_rows` for an interleaved rotary embedding: HF's pairs (2i, 2i + 1) become
  our rotate-half pairs (i, i + r / 2), evens then odds; the unrotated rest keeps its
  place."""
  r = cfg.rope.rotary_dim(h)
  return _permuted_rows(inner, h, d, np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2),
                                                     np.arange(r, h)]))


def _swapped_rows(inner: Callable[[int], tuple[Transform, Transform]], h: int,
                  d: int) -> Callable[[int], tuple]:
  """`_permuted_rows` with each head's halves swapped: nanochat rotates (x1, x2) to
  (x1 cos + x2 sin, x2 cos - x1 sin), which is our rotate-half over (x2, x1); q . k is
  unchanged by the same swap of both."""
  return _permuted_rows(inner, h, d, np.r_[h // 2:h, 0:h // 2])


def _fused_qkv_rows(cfg: ModelConfig, rows: list) -> list:
  """`rows` with q, k and v read from one fused tensor where the files name them
  X.query_key_value (Sarvam-30B's, rows [q; k; v]): each row the part of it its own
  tensor was (`_fused_part`)."""
  h, n, k = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
  parts = {"q_proj": (0, n), "k_proj": (n, k), "v_proj": (n + k, k)}
  out = []
  for ours, name, to_ours, to_hf, shape in rows:
    match = re.fullmatch(r"(.*\.attention\.)([qkv]_proj)\.(weight|bias)", name)
    if match:
      start, heads = parts[match[2]]
      name = f"{match[1]}query_key_value.{match[3]}"
      to_ours, to_hf = _fused_part((to_ours, to_hf), start * h, heads * h, (n + 2 * k) * h)
    out.append((ours, name, to_ours, to_hf, shape))
  return out


def _head_weights(inner: tuple[Transform, Transform], heads: int, h: int
                  ) -> tuple[Transform, Transform]:
  """(HF -> ours, ours -> HF) of a per-head weight HF holds as [heads, h], `inner` those
  of one held as [heads * h] (a q/k bias's: the rotated features reordered where the
  rotation pairs interleave)."""
  to_ours, to_hf = inner
  return (lambda x: to_ours(x.reshape(heads * h))), lambda x: to_hf(x).reshape(heads, h)


def _fused_part(inner: tuple[Transform, Transform], start: int, size: int, total: int
                ) -> tuple[Transform, Transform]:
  """(HF -> ours, ours -> HF) of rows [start, start + size) of a fused HF tensor of
  `total` rows (Phi-3's qkv_proj, gate_up_proj), `inner` mapping those rows to ours. The
  HF side holds zeros in the other rows: the parts of one tensor add up to it."""
  to_ours, to_hf = inner

  def part_to_hf(x):
    rows = to_hf(x)
    out = np.zeros((total, *rows.shape[1:]), rows.dtype)
    out[start:start + size] = rows
    return out
  return (lambda x: to_ours(x[start:start + size])), part_to_hf


def _interleaved_part(which: int) -> tuple[Transform, Transform]:
  """(HF -> ours, ours -> HF) of one half of a tensor whose last axis interleaves two
  (gpt-oss's gate_up_proj: gate at even indices, up at odd). The HF side of each part
  holds zeros at the other's indices: the parts of one tensor add up to it."""
  def to_hf(x):
    out = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), x.dtype)
    out[..., which::2] = x
    return out
  return (lambda x: x[..., which::2]), to_hf


def _dbrx_expert_rows(cfg: ModelConfig, p: tuple, hf: str) -> list:
  """DBRX's router (ffn.router.layer [E, D]) and experts: w1 (gate) and v1 (up) [E F, D],
  each expert's [F, D] rows in turn (ours [E, D, F]), w2 (down) [E F, D] (ours [E, F,
  D])."""
  d, f, e = cfg.d_model, cfg.ffn_dim, cfg.num_experts
  mlp, experts = p + ("mlp",), hf + "ffn.experts.mlp."
  stacked_in = (lambda x: x.reshape(e, f, d).transpose(0, 2, 1),
                lambda x: x.transpose(0, 2, 1).reshape(e * f, d))
  return [(mlp + ("router",), hf + "ffn.router.layer.weight", lambda x: x.T, lambda x: x.T,
           (d, e)),
          (mlp + ("gate_proj",), experts + "w1", *stacked_in, (e, d, f)),
          (mlp + ("up_proj",), experts + "v1", *stacked_in, (e, d, f)),
          (mlp + ("down_proj",), experts + "w2", lambda x: x.reshape(e, f, d),
           lambda x: x.reshape(e * f, d), (e, f, d))]


def _gpt_oss_expert_rows(cfg: ModelConfig, p: tuple, hf: str) -> list:
  """gpt-oss's router and experts: the HF tensors stack the experts ([E, ...], as ours
  do), gate_up_proj [E, D, 2F] interleaving gate and up (two rows of ours each)."""
  d, f, e = cfg.d_model, cfg.ffn_dim, cfg.num_experts
  ident = lambda x: x  # noqa: E731
  mlp, experts = p + ("mlp",), hf + "mlp.experts."
  return [
      (mlp + ("router",), hf + "mlp.router.weight", lambda x: x.T, lambda x: x.T, (d, e)),
      (mlp + ("router_bias",), hf + "mlp.router.bias", ident, ident, (e,)),
      (mlp + ("gate_proj",), experts + "gate_up_proj", *_interleaved_part(0), (e, d, f)),
      (mlp + ("up_proj",), experts + "gate_up_proj", *_interleaved_part(1), (e, d, f)),
      (mlp + ("gate_bias",), experts + "gate_up_proj_bias", *_interleaved_part(0), (e, f)),
      (mlp + ("up_bias",), experts + "gate_up_proj_bias", *_interleaved_part(1), (e, f)),
      (mlp + ("down_proj",), experts + "down_proj", ident, ident, (e, f, d)),
      (mlp + ("down_bias",), experts + "down_proj_bias", ident, ident, (e, d)),
  ]


def _llama4_expert_rows(cfg: ModelConfig, p: tuple, hf: str) -> list:
  """Llama 4's router and experts: stacked as ours ([E, ...]), gate_up_proj [E, D, 2F]
  gate's F columns, then up's (two rows of ours)."""
  d, f, e = cfg.d_model, cfg.ffn_dim, cfg.num_experts
  mlp, experts = p + ("mlp",), hf + "feed_forward.experts."

  def half(which):  # [..., 2F] <-> ours [..., F]; the HF side zero in the other half
    def to_hf(x):
      out = np.zeros((*x.shape[:-1], 2 * f), x.dtype)
      out[..., which * f:(which + 1) * f] = x
      return out
    return (lambda x: x[..., which * f:(which + 1) * f]), to_hf
  return [
      (mlp + ("router",), hf + "feed_forward.router.weight", lambda x: x.T, lambda x: x.T,
       (d, e)),
      (mlp + ("gate_proj",), experts + "gate_up_proj", *half(0), (e, d, f)),
      (mlp + ("up_proj",), experts + "gate_up_proj", *half(1), (e, d, f)),
      (mlp + ("down_proj",), experts + "down_proj", lambda x: x, lambda x: x, (e, f, d)),
  ]


def _stacked_expert_rows(cfg: ModelConfig, rows: list, transposed: bool = False) -> list:
  """`rows` with each layer's per-expert rows (mlp.experts.{j}.gate_proj, ...) replaced by
  the experts stacked as Qwen3-VL-MoE's files hold them: mlp.experts.gate_up_proj
  [E, D, 2F] (gate's F columns, then up's) and mlp.experts.down_proj [E, F, D] as
  published; `transposed`, as transformers 5 saves them ([E, 2F, D] and [E, D, F], its
  layout in memory, which it reads either way: by the shape, that one where both fit)."""
  d, f, e = cfg.d_model, cfg.ffn_dim, cfg.num_experts
  flip = (lambda x: x.transpose(0, 2, 1)) if transposed else (lambda x: x)

  def half(which):  # [..., 2F] <-> ours [..., F]; the HF side zero in the other half
    def to_hf(x):
      out = np.zeros((*x.shape[:-1], 2 * f), x.dtype)
      out[..., which * f:(which + 1) * f] = x
      return flip(out)
    return (lambda x: flip(x)[..., which * f:(which + 1) * f]), to_hf

  out, done = [], set()
  for row in rows:
    ours, name = row[0], row[1]
    if not _is_expert(ours):
      out.append(row)
      continue
    mlp, hf = ours[:-2], name[:name.index("mlp.experts.")] + "mlp.experts."
    if mlp not in done:
      done.add(mlp)
      out += [(mlp + ("gate_proj",), hf + "gate_up_proj", *half(0), (e, d, f)),
              (mlp + ("up_proj",), hf + "gate_up_proj", *half(1), (e, d, f)),
              (mlp + ("down_proj",), hf + "down_proj", flip, flip, (e, f, d))]
  return out


def _granite_shared_mlp_rows(p: tuple, hf: str, d: int, f: int) -> list:
  """Granite 4's shared_mlp as our MLP at `p` (a dense layer's, or a mixture layer's
  shared expert): input_linear [2F, D] (gate's F rows, then up's), output_linear [D, F]."""
  transposed = (lambda x: x.T, lambda x: x.T)
  mlp = hf + "shared_mlp."
  return [*[(p + (name,), mlp + "input_linear.weight",
             *_fused_part(transposed, start, f, 2 * f), (d, f))
            for name, start in (("gate_proj", 0), ("up_proj", f))],
          (p + ("down_proj",), mlp + "output_linear.weight", lambda x: x.T, lambda x: x.T,
           (f, d))]


def _fused_experts_half(e: int, f: int, d: int, start: int) -> tuple[Transform, Transform]:
  """(HF -> ours, ours -> HF) of rows [start, start + F) of stacked experts' fused gate and
  up projections as torch's Linear holds them, [E, 2F, D] (gate's F rows, then up's), and
  ours [E, D, F]; the HF side zero in the other half (Granite MoE's input_linear, Gemma
  4's gate_up_proj)."""
  def to_hf(x):
    out = np.zeros((e, 2 * f, d), x.dtype)
    out[:, start:start + f] = np.swapaxes(x, 1, 2)
    return out
  return (lambda x: np.swapaxes(x[:, start:start + f], 1, 2)), to_hf


def _granite_moe_expert_rows(cfg: ModelConfig, p: tuple, hf: str) -> list:
  """Granite MoE's router and experts: stacked as ours ([E, ...]) but each expert's
  matrices as torch's Linear holds them, input_linear [E, 2F, D] (gate's F rows, then
  up's: two rows of ours) and output_linear [E, D, F]."""
  d, f, e = cfg.d_model, cfg.ffn_dim, cfg.num_experts
  moe = hf + "block_sparse_moe."
  router, gate_up, down = (  # Granite swash's mixture: transformers 5's names
      ("router.weight", "experts.gate_up_proj", "experts.down_proj")
      if _causal_lm(cfg.architecture) == GRANITE_MOE_SWA else
      ("router.layer.weight", "input_linear.weight", "output_linear.weight"))
  swap = lambda x: np.swapaxes(x, 1, 2)  # noqa: E731  [E, out, in] <-> ours [E, in, out]
  half = functools.partial(_fused_experts_half, e, f, d)
  return [
      (p + ("mlp", "router"), moe + router, lambda x: x.T, lambda x: x.T, (d, e)),
      (p + ("mlp", "gate_proj"), moe + gate_up, *half(0), (e, d, f)),
      (p + ("mlp", "up_proj"), moe + gate_up, *half(f), (e, d, f)),
      (p + ("mlp", "down_proj"), moe + down, swap, swap, (e, f, d)),
  ]


def _hf_shape(cfg: ModelConfig, name: str, ours: tuple, to_hf: Transform) -> tuple:
  return to_hf(np.empty(ours, np.int8)).shape


def _lora_mapping(cfg: ModelConfig, reading: bool = False
                  ) -> list[tuple[tuple, str, Transform, Transform, tuple]]:
  """(our state path, PEFT name, peft->ours, ours->peft, our shape) for every adapter tensor.

  PEFT keeps torch's Linear layout, lora_A.weight [r, in] and lora_B.weight [out, r]; our
  A [*in, r] and B [r, *out] flatten their head axes row-major (n * H + h), as `_mapping`
  flattens q/k/v/o, so an adapter's update lines up with its base weight's rows. With
  `reading`, a class whose q, k and v are one fused module (`_FUSED_QKV`: PEFT's one
  adapter on query_key_value, c_attn, Wqkv or qkv_proj) gives q, k and v each the one A
  and its own rows of B: the same update, exactly.

  Raises:
    ValueError: for Phi-3, whose PEFT adapters sit on the fused qkv_proj / gate_up_proj
      (one A shared by q, k and v), which ours (an A each) are not; and for writing the
      `_FUSED_QKV` classes' (our three A's are not PEFT's one).
  """
  if _causal_lm(cfg.architecture) == PHI3:
    raise ValueError(f"PEFT adapter files of {cfg.architecture} wrap its fused qkv_proj / "
                     "gate_up_proj, which our per-projection adapters are not: they are "
                     "neither read nor written; export the model merged (save_pretrained)")
  qkv = [t for t in ("q_proj", "k_proj", "v_proj") if t in cfg.lora_target_names]
  if _causal_lm(cfg.architecture) in _FUSED_QKV and qkv and not reading:
    fused = _class_name(cfg, "model.layers.0.self_attn.q_proj.").split(".")[-2]
    raise ValueError(f"PEFT adapter files of {cfg.architecture} with lora_targets {qkv} "
                     f"are read, not written: PEFT wraps its fused {fused} with one A "
                     "shared by q, k and v, ours are one each; adapt the other projections, "
                     "or export the model merged (save_pretrained)")
  fused = [t for t in ("gate_proj", "up_proj") if t in cfg.lora_target_names]
  if _causal_lm(cfg.architecture) in _GLMS and fused:
    raise ValueError(f"PEFT adapter files of {cfg.architecture} with lora_targets {fused} "
                     "are not written or read: PEFT wraps its fused gate_up_proj with one "
                     "adapter, ours are one each; adapt the attention (and down_proj), or "
                     "export the model merged (save_pretrained)")
  mlp = [t for t in ("gate_proj", "up_proj", "down_proj") if t in cfg.lora_target_names]
  if _causal_lm(cfg.architecture) in (GRANITE_HYBRID,) + _SHAREDS and mlp:
    raise ValueError(f"PEFT adapter files of {cfg.architecture} with lora_targets {mlp} "
                     "are not written or read: PEFT wraps its shared_mlp's fused "
                     "input_linear / output_linear, ours adapt gate, up and down each; adapt "
                     "the attention, or export the model merged (save_pretrained)")
  if cfg.kv_lora_rank:
    raise ValueError(f"PEFT adapter files of {cfg.architecture} wrap its fused "
                     "kv_a_proj_with_mqa / kv_b_proj, which our per-projection adapters on "
                     "latent attention are not: they are neither read nor written; export "
                     "the model merged (save_pretrained)")
  if _causal_lm(cfg.architecture) in PEFT_FUSED_MLP and set(
      cfg.lora_target_names) & set(LORA_TARGETS[4:]):
    raise ValueError(f"PEFT adapter files of {cfg.architecture} with MLP targets (its "
                     "dense MLPs' and shared experts') are not written or read: PEFT puts "
                     "those names on its fused routed experts instead; leave gate_proj, "
                     "up_proj and down_proj out of lora_targets, or export the model merged")
  if _causal_lm(cfg.architecture) in PEFT_NO_OUT_PROJ and "out_proj" in cfg.lora_target_names:
    raise ValueError(f"PEFT adapter files of {cfg.architecture} with lora_targets out_proj "
                     "are not written or read: PEFT refuses adapters on a Mamba layer's "
                     "out_proj; leave it out of lora_targets, or export the model merged "
                     "(save_pretrained)")
  experts = [t for t in cfg.lora_target_names if t in EXPERT_LORA_TARGETS]
  if experts and _causal_lm(cfg.architecture) == GPT_OSS:
    raise ValueError(f"PEFT adapter files of {cfg.architecture} with routed-expert targets "
                     f"{experts} are not written or read: its gate_up_proj interleaves gate "
                     "and up, [E, D, 2F]; export the model merged (save_pretrained)")
  r = cfg.lora_rank
  rows = []
  interleaved = _causal_lm(cfg.architecture) in _INTERLEAVED
  for t, i in ((t, i) for t in cfg.lora_target_names for i in range(cfg.num_layers)):
    stack = layer_path(cfg, i)[0]
    if t not in stack_lora_targets(cfg, stack):
      continue  # a projection this kind of layer does not have
    if t in EXPERT_LORA_TARGETS:
      rows += _expert_lora_rows(cfg, t, i, nested=len(experts) > 1)
      continue
    in_shape, _, out_shape, _ = _lora_axes(cfg, t, stack)
    fan_in, fan_out = int(np.prod(in_shape)), int(np.prod(out_shape))
    owner = _owner_path(cfg, t, stack)
    module = {("linear_attn",): _linear_module(cfg), ("attn",): "self_attn"}.get(
        owner) or _mlp_module(cfg, i)
    a_maps = (lambda x, s=in_shape: x.T.reshape(*s, r), lambda x, n=fan_in: x.reshape(n, r).T)
    b_maps = (lambda x, s=out_shape: x.T.reshape(r, *s), lambda x, n=fan_out: x.reshape(r, n).T)
    if interleaved and t in ("q_proj", "k_proj"):  # B's rows in HF's interleaved rotary order
      h = cfg.head_dim
      b_maps = _interleaved_rows(lambda heads: (lambda x: x.T.reshape(r, heads, h),
                                                lambda x: x.reshape(r, heads * h).T),
                                 h, r, cfg)(out_shape[0])
    if _causal_lm(cfg.architecture) == NANOCHAT and t in ("q_proj", "k_proj"):  # halves
      h = cfg.head_dim  # swapped back
      b_maps = _swapped_rows(lambda heads: (lambda x: x.T.reshape(r, heads, h),
                                            lambda x: x.reshape(r, heads * h).T),
                             h, r)(out_shape[0])
    if t == "q_proj" and cfg.attn_output_gate:
      b_maps = _gated_query_b(cfg.num_heads, cfg.head_dim, r)
    if t in ("in_proj_qkvz", "in_proj_ba"):  # Qwen3-Next's, grouped by key head
      b_maps = _key_group_b(cfg, t, r)
    if t in qkv:  # its rows of a fused module's B (`reading`; others as they are)
      b_maps = _fused_qkv_part(cfg, t[0], b_maps)
    ours = layer_path(cfg, i) + owner
    peft = f"base_model.model.model.layers.{i}.{module}.{_peft_module(cfg, t)}."
    peft = "base_model.model." + _class_name(cfg, peft[len("base_model.model."):])
    if _causal_lm(cfg.architecture) in _BACKBONES:  # each layer's one sublayer: its mixer
      shared = "shared_experts." if stack == "moe_layers" else ""  # a mixture's MLP
      trunk = "backbone" if _causal_lm(cfg.architecture) in (MAMBA2,) + _MAMBA1S else "model"
      peft = f"base_model.model.{trunk}.layers.{i}.mixer.{shared}{t}."
    rows += [(ours + (f"{t}_lora_a",), peft + "lora_A.weight", *a_maps, (*in_shape, r)),
             (ours + (f"{t}_lora_b",), peft + "lora_B.weight", *b_maps, (r, *out_shape))]
  return rows


def _expert_lora_rows(cfg: ModelConfig, target: str, i: int, *, nested: bool) -> list:
  """`_lora_mapping`'s rows of layer i's adapter on its routed experts' gate_up_proj or
  down_proj (PEFT's target_parameters, a ParamWrapper on transformers' experts module).

  PEFT's lora_A.weight [E r, in] holds expert e's A in rows e r .. e r + r; its
  lora_B.weight [out, r E] expert e's B in columns j E + e (rank-major): its update of
  gate_up_proj [E, 2F, D] (gate's F rows, then up's) is B_e A_e. Ours: A [E, r, in]
  (PEFT's rows as they are), B [E, r, out] (gate_up's [E, r, 2, F]). With both targets
  PEFT nests the two wrappers in the experts module's parameter order, gate_up_proj
  inside (its names through base_layer), down_proj outside.

  Llama 4's experts hold their weights [E, in, out] (gate_up_proj [E, D, 2F], gate's F
  columns then up's), which PEFT treats as [E, out, in]: its lora_A spans their last axis
  and lora_B their middle one, so its lora_A holds our B and its lora_B our A (the
  update of each expert the same product)."""
  e, r = cfg.num_experts, cfg.lora_rank
  (_, fan_in), _, out_shape, _ = _lora_axes(cfg, target, layer_path(cfg, i)[0])

  def rows(shape):  # PEFT's lora_A [E r, n], expert-major rows <-> ours [E, r, *shape]
    n = int(np.prod(shape))
    return (lambda x: np.asarray(x).reshape(e, r, *shape),
            lambda x: np.asarray(x).reshape(e * r, n))

  def columns(shape):  # PEFT's lora_B [n, r E], rank-major columns <-> ours [E, r, *shape]
    n = int(np.prod(shape))
    return (lambda x: np.asarray(x).reshape(n, r, e).transpose(2, 1, 0).reshape(e, r, *shape),
            lambda x: np.asarray(x).reshape(e, r, n).transpose(2, 1, 0).reshape(n, r * e))

  llama4 = _causal_lm(cfg.architecture) == LLAMA4
  inner = nested and target != "experts_down_proj"  # gate_up_proj or up_proj: first held
  peft = (f"base_model.model.model.layers.{i}.{_experts_module(cfg)}."
          f"{'base_layer.' if inner else ''}")
  a, b = ("lora_B", "lora_A") if llama4 else ("lora_A", "lora_B")
  ours = layer_path(cfg, i) + ("mlp",)
  return [(ours + (f"{target}_lora_a",), f"{peft}{a}.weight",
           *(columns if llama4 else rows)((fan_in,)), (e, r, fan_in)),
          (ours + (f"{target}_lora_b",), f"{peft}{b}.weight",
           *(rows if llama4 else columns)(tuple(out_shape)), (e, r, *out_shape))]


def _key_group_b(cfg: ModelConfig, target: str, r: int) -> tuple[Transform, Transform]:
  """(PEFT -> ours, ours -> PEFT) of the B of an adapter on Qwen3-Next's in_proj_qkvz or
  in_proj_ba: PEFT's lora_B rows run per key head through its parts (q, k, its value
  heads' v, their z; or b, a), ours [r, total] through each part of every key head in
  turn (`_LINEAR_PARTS`), as the weights' rows are (`_qwen3_next_projection_rows`)."""
  hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  g = hv // hk
  sizes = (dk, dk, g * dv, g * dv) if target == "in_proj_qkvz" else (g, g)
  width, starts = sum(sizes), np.cumsum((0,) + sizes[:-1])

  def to_ours(x):
    x = np.asarray(x).reshape(hk, width, r)
    return np.concatenate([x[:, s:s + n].reshape(hk * n, r)
                           for s, n in zip(starts, sizes)]).T

  def to_peft(x):
    x = np.asarray(x).reshape(r, -1).T
    out, off = np.empty((hk, width, r), x.dtype), 0
    for s, n in zip(starts, sizes):
      out[:, s:s + n], off = x[off:off + hk * n].reshape(hk, n, r), off + hk * n
    return out.reshape(hk * width, r)
  return to_ours, to_peft


def _gated_query_b(n: int, h: int, r: int) -> tuple[Transform, Transform]:
  """(PEFT -> ours, ours -> PEFT) of a q_proj adapter's B under an output gate (Qwen3.5):
  PEFT's lora_B [n * 2h, r] spans each head's query rows and then its gate rows; ours
  [r, n, h] the query rows alone. Written with zero gate rows (the same update); read
  only when its gate rows are zero."""
  def to_ours(x):
    x = np.asarray(x).reshape(n, 2, h, r)
    if np.any(x[:, 1]):
      raise ValueError("a PEFT q_proj adapter that changes the attention's output gate "
                       "(the second half of each head's q_proj rows) is not supported: "
                       "ours adapts the queries alone")
    return x[:, 0].reshape(n * h, r).T.reshape(r, n, h)

  def to_peft(x):
    out = np.zeros((n, 2, h, r), np.asarray(x).dtype)
    out[:, 0] = np.asarray(x).reshape(r, n * h).T.reshape(n, h, r)
    return out.reshape(n * 2 * h, r)
  return to_ours, to_peft


# PEFT LoraConfig fields that change what the adapter computes (or which weights it holds)
# beyond y += lora_alpha / r * x A B on the targeted projections; any truthy value is refused.
_PEFT_UNSUPPORTED = ("use_dora", "use_rslora", "fan_in_fan_out",
                     "layers_to_transform", "rank_pattern", "alpha_pattern", "lora_bias",
                     "exclude_modules", "trainable_token_indices",
                     "layer_replication", "alora_invocation_tokens", "use_qalora",
                     "use_bdlora", "kasa_config", "monteclora_config", "arrow_config",
                     "megatron_config")
# PEFT's sequence classifiers save their score layer whole beside the adapters
# (task_type SEQ_CLS puts both names in modules_to_save); it is our value head.
_SCORE_MODULES = {"classifier", "score"}
_PEFT_SCORE = "base_model.model.score.weight"


def _linear_module(cfg: ModelConfig) -> str:
  """The HF module of a linear-attention layer's mixer: Granite 4's mamba, LFM2's conv,
  or Qwen3.5's linear_attn."""
  return {"mamba2": "mamba", "mamba1": "mamba", "short_conv": "conv"}.get(cfg.linear_mixer,
                                                                          "linear_attn")


# LFM2's names of the projections LoRA targets name otherwise: its attention's output
# projection and its feed_forward's.
_LFM2_MODULES = {"o_proj": "out_proj", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


_STARCODER2_MODULES = {"up_proj": "c_fc", "down_proj": "c_proj"}


def _peft_module(cfg: ModelConfig, target: str) -> str:
  """The name of the module LoRA target `target` wraps within its layer's attention,
  mixer or MLP, before the class's renames (`_class_name`, which name the modules of the
  classes in `_CLASS_NAMES`): the target's own, but for LFM2's `_LFM2_MODULES` and the
  MLPs of StarCoder2 and nanochat."""
  names = {LFM2: _LFM2_MODULES, LFM2_MOE: _LFM2_MODULES, STARCODER2: _STARCODER2_MODULES,
           NANOCHAT: {"up_proj": "fc1", "down_proj": "fc2"}}.get(
      _causal_lm(cfg.architecture), {})
  return names.get(target, target)


def _peft_target(cfg: ModelConfig, target: str) -> str:
  """A target_modules entry of PEFT's that wraps `target` and nothing else: its name, or
  where the name is ambiguous (LFM2's out_proj is the attention's and the convolution's)
  the name under its owner, e.g. self_attn.out_proj."""
  if _causal_lm(cfg.architecture) not in _LFM2S:  # the module's name under its class's
    owner = "self_attn" if target in _ATTN_TARGETS else "mlp"
    return _class_name(cfg, f"model.layers.0.{owner}.{_peft_module(cfg, target)}.").split(
        ".")[-2]
  owner = ("self_attn" if target in _ATTN_TARGETS else
           _linear_module(cfg) if target in cfg.linear_lora_targets else "feed_forward")
  return f"{owner}.{_peft_module(cfg, target)}"


def _mlp_module(cfg: ModelConfig, i: int) -> str:
  """The HF module within layer i that its MLP LoRA targets wrap: its dense MLP, or a
  mixture layer's shared expert (Llama 4's under feed_forward)."""
  mlp = "feed_forward" if _causal_lm(cfg.architecture) in _FEED_FORWARD else "mlp"
  if not cfg.mixture_flags[i]:
    return mlp
  if _causal_lm(cfg.architecture) == LLAMA4 or cfg.shared_expert_gate:
    return f"{mlp}.shared_expert"
  return f"{mlp}.shared_experts"


def _adapter_targets(where: str, targets: Any, cfg: ModelConfig) -> tuple[str, ...]:
  """The projections a PEFT target_modules list puts adapters on (in LORA_TARGETS order,
  then the Gated DeltaNet ones), for a base model of config `cfg`.

  PEFT matches an entry to a module whose dotted name equals it or ends in "." + it; its
  own "all-linear" is saved as full names (model.layers.0.self_attn.q_proj, ...). We hold
  one adapter per projection kind for every layer that has it, so each kind must cover
  all those layers.
  """
  if targets == "all-linear":  # Every Linear but the output layer: the default targets.
    return LORA_TARGETS
  names = LORA_TARGETS + (cfg.linear_lora_targets if cfg.linear_mixers else ())
  if not targets or isinstance(targets, str):
    raise ValueError(f"{where} target_modules={targets!r} is not supported; expected a list "
                     f"of names in {names}")

  def module(i, t):  # the layer's module of that name, None where it has none
    linear = cfg.linear_layers[i]
    if cfg.split_layers:  # Nemotron-H: each layer's one sublayer is its mixer
      mlps = LORA_TARGETS[4 + cfg.ungated:]  # relu^2: no gate_proj
      stack = layer_path(cfg, i)[0]
      has = {"linear_layers": cfg.linear_lora_targets, "layers": _ATTN_TARGETS,
             "mlp_layers": mlps, "moe_layers": mlps}[stack]
      shared = "shared_experts." if stack == "moe_layers" else ""  # a mixture's MLP
      return f"backbone.layers.{i}.mixer.{shared}{t}" if t in has else None
    if t in _ATTN_TARGETS:  # under the class's names: q, k and v fused in one for some
      return None if linear else _class_name(
          cfg, f"model.layers.{i}.self_attn.{_peft_module(cfg, t)}.")[:-1]
    if cfg.parallel_mixer and t in cfg.linear_lora_targets:  # Falcon-H1's mamba
      return f"model.layers.{i}.{_linear_module(cfg)}.{t}"
    if t in LORA_TARGETS:  # a mixture layer's: its shared expert's, if it has one
      if cfg.mixture_flags[i] and not cfg.shared_expert_dim:
        return None
      return _class_name(cfg, f"model.layers.{i}.{_mlp_module(cfg, i)}."
                              f"{_peft_module(cfg, t)}.")[:-1]
    return f"model.layers.{i}.{_linear_module(cfg)}.{t}" if linear else None

  modules = {(i, t): module(i, t) for i in range(cfg.num_layers) for t in names
             if module(i, t) is not None}
  owners = {t: [i for i in range(cfg.num_layers) if (i, t) in modules] for t in names}

  def matches(name, entry):
    return name == entry or name.endswith("." + entry)

  # A projection's name that this model has no module of (a mixture without a shared
  # expert: gate_proj) wraps nothing, as in PEFT; any other unmatched entry is refused.
  bad = sorted(e for e in targets if e not in names
               and not any(matches(n, e) for n in modules.values()))
  if bad:
    raise ValueError(f"{where} target_modules {bad[:5]} are not supported; expected names in "
                     f"{names}")
  covered = {m for m, n in modules.items() if any(matches(n, e) for e in targets)}
  kinds = tuple(t for t in names if any((i, t) in covered for i in owners[t]))
  partial = [t for t in kinds if not all((i, t) in covered for i in owners[t])]
  if partial:
    raise ValueError(f"{where} target_modules wrap {partial} in only some layers; adapters "
                     f"on every layer are supported")
  return kinds


def _experts_module(cfg: ModelConfig) -> str:
  """The module holding a mixture layer's stacked routed experts, within the layer."""
  return {LLAMA4: "feed_forward.experts", GRANITE_MOE: "block_sparse_moe.experts",
          GRANITE_HYBRID: "block_sparse_moe.experts",
          GRANITE_SHARED: "block_sparse_moe.experts",
          GRANITE_MOE_SWA: "block_sparse_moe.experts", NEMOTRON_H: "mixer.experts"}.get(
      _causal_lm(cfg.architecture), "mlp.experts")


def _expert_targets(where: str, parameters: Any, cfg: ModelConfig) -> tuple[str, ...]:
  """The routed-expert targets (EXPERT_LORA_TARGETS) a PEFT target_parameters list puts
  adapters on. PEFT matches an entry to a parameter whose dotted name
  (model.layers.{i}.mlp.experts.gate_up_proj) equals it or ends in "." + it; ours adapt
  every mixture layer's experts, so each entry must cover all of them."""
  if not parameters:
    return ()
  module = _experts_module(cfg)
  expected = " / ".join(f"{module}.{t[len('experts_'):]}"
                        for t in cfg.expert_lora_targets or GATED_EXPERT_LORA_TARGETS)
  if isinstance(parameters, str) or not cfg.num_experts:
    raise ValueError(f"{where} target_parameters={parameters!r} is not supported; expected "
                     f"a list of {expected} of a mixture of experts")
  # Each target's parameter in every mixture layer (not the dense layers).
  names = {t: [f"model.layers.{i}.{module}.{t[len('experts_'):]}"
               for i, moe in enumerate(cfg.mixture_flags) if moe]
           for t in cfg.expert_lora_targets}

  def covered(name):
    return any(name == p or name.endswith("." + p) for p in parameters)

  kinds = []
  for t, layers in names.items():
    hit = [n for n in layers if covered(n)]
    if hit and len(hit) != len(layers):
      raise ValueError(f"{where} target_parameters wrap {t[len('experts_'):]} in only "
                       "some layers; adapters on every mixture layer are supported")
    kinds += [t] if hit else []
  every = [n for layers in names.values() for n in layers]
  bad = sorted(p for p in parameters if not any(n == p or n.endswith("." + p) for n in every))
  if bad:
    raise ValueError(f"{where} target_parameters {bad[:5]} are not supported; expected "
                     f"{expected.replace(' / ', ', ')}")
  return tuple(kinds)


def _read_adapter_config(path: str, base: ModelConfig, *, classifier: bool = False
                         ) -> dict[str, Any]:
  """lora_rank, lora_alpha and lora_targets of a PEFT LoRA adapter folder over a model of
  config `base`; `classifier`: the base is a sequence classifier, whose adapter may save
  its score layer whole."""
  cfg_path = os.path.join(path, "adapter_config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{cfg_path} does not exist")
  with open(cfg_path) as fh:
    c = json.load(fh)
  where = f"adapter {cfg_path}:"
  if c.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{where} peft_type={c['peft_type']!r} is not supported (expected LORA)")
  for key in _PEFT_UNSUPPORTED:
    # GPT-2's Conv1D modules: PEFT sets fan_in_fan_out for the base weight's [in, out]
    # alone; its adapters are Linear's, as everywhere
    conv1d = key == "fan_in_fan_out" and _causal_lm(base.architecture) == GPT2
    if c.get(key) and not conv1d:
      raise ValueError(f"{where} {key}={c[key]!r} is not supported")
  saved = c.get("modules_to_save") or []
  if saved and (not classifier or isinstance(saved, str) or set(saved) - _SCORE_MODULES):
    raise ValueError(f"{where} modules_to_save={saved!r} is not supported (a reward "
                     "model's ['classifier', 'score'] is)")
  if c.get("bias", "none") != "none":
    raise ValueError(f"{where} bias={c['bias']!r} is not supported (expected 'none')")
  parameters = c.get("target_parameters") or []
  modules = c.get("target_modules")
  targets = (_adapter_targets(where, modules, base) if modules or not parameters else ())
  targets += _expert_targets(where, parameters, base)
  r, alpha = c.get("r"), c.get("lora_alpha")
  if isinstance(r, bool) or not isinstance(r, int) or r < 1:
    raise ValueError(f"{where} r={r!r}; expected an int >= 1")
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
    raise ValueError(f"{where} lora_alpha={alpha!r}; expected a number > 0")
  return {"lora_rank": r, "lora_alpha": float(alpha), "lora_targets": ",".join(targets)}


def _check_adapter_overrides(path: str, adapter: dict[str, Any],
                             overrides: dict[str, Any]) -> None:
  """An adapter fixes the LoRA fields; an override may only repeat them."""
  for key, value in adapter.items():
    if key not in overrides:
      continue
    given = overrides[key]
    if key == "lora_targets":
      same = {t.strip() for t in str(given).split(",") if t.strip()} == set(value.split(","))
    else:
      same = given == value
    if not same:
      raise ValueError(f"{key}={given!r} disagrees with the adapter in {path} ({value!r})")


# -- reading --------------------------------------------------------------------------------


@contextlib.contextmanager
def _open_tensors(f: str):
  """`safe_open(f)`, a damaged file (a truncated download, say) a one-line ValueError
  naming it; a missing one stays FileNotFoundError."""
  from safetensors import SafetensorError, safe_open
  if not os.path.exists(f):
    raise FileNotFoundError(f"{f} does not exist (named by the folder's safetensors index)")
  try:
    with safe_open(f, framework="numpy") as fh:
      yield fh
  except SafetensorError as e:
    raise ValueError(f"{f} is not a readable safetensors file: "
                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _tensor_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file, from an index or by scanning the folder."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as fh:
      weight_map = json.load(fh)["weight_map"]
    return {name: os.path.join(path, f) for name, f in weight_map.items()}
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  out = {}
  for f in files:
    with _open_tensors(os.path.join(path, f)) as fh:
      for name in fh.keys():
        out[name] = os.path.join(path, f)
  return out


_MXFP4_PARTS = ("_blocks", "_scales")


def _mxfp4_names(files: dict[str, str]) -> set[str]:
  """Tensors an MXFP4 checkpoint (gpt-oss's experts) stores as NAME_blocks and NAME_scales:
  their NAMEs."""
  return {n[:-len("_blocks")] for n in files
          if n.endswith("_blocks") and n[:-len("_blocks")] + "_scales" in files}


def _iter_tensors(files: dict[str, str], names: list[str], mxfp4: bool = False,
                  fp8: fp8_lib.Scheme | None = None, bnb: str | None = None,
                  ints: compressed_lib.Scheme | None = None
                  ) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (name, array), opening each file once and reading one tensor at a time. With
  `mxfp4`, a name stored as NAME_blocks / NAME_scales is read from both, dequantized
  (`posttrain.models.mxfp4`); with an `fp8` scheme, a name beside its scale (NAME +
  fp8.suffix) is a float8 weight, dequantized (`posttrain.models.fp8`); with `bnb`
  ("4bit", "8bit"), a bitsandbytes weight is read with its quantization state and
  dequantized (`posttrain.models.bnb`); with `ints`, a compressed-tensors integer or FP4
  weight is read from its codes, scales and zero points (`posttrain.models.compressed`)."""
  by_file: dict[str, list[str]] = {}
  packed = _mxfp4_names(files) if mxfp4 else set()
  packed4 = bnb_lib.packed4(files) if bnb == "4bit" else {}
  packed8 = bnb_lib.packed8(files) if bnb == "8bit" else set()
  codes = compressed_lib.quantized(files) if ints else {}
  for name in names:
    stored = name + "_blocks" if name in packed else codes.get(name, name)
    by_file.setdefault(files[stored], []).append(name)
  for f, group in by_file.items():
    with _open_tensors(f) as fh:

      def get(n, f=f, fh=fh):  # a tensor of this file or, beside it, of another
        if n not in files:
          raise KeyError(n)
        if files[n] != f:
          return next(_iter_tensors(files, [n]))[1]
        try:
          return fh.get_tensor(n)
        except (AttributeError, TypeError):  # float8, which safetensors' numpy lacks
          return fp8_lib.read_tensor(f, n)

      for name in group:
        if name in codes:
          yield name, compressed_lib.read(name, get, ints)
        elif name in packed4:
          yield name, bnb_lib.read4(name, get, packed4[name])
        elif name in packed8:
          yield name, bnb_lib.read8(name, get)
        elif name in packed:
          from posttrain.models import mxfp4 as mxfp4_lib
          blocks = fh.get_tensor(name + "_blocks")
          scales = (fh.get_tensor(name + "_scales") if files[name + "_scales"] == f else
                    next(_iter_tensors(files, [name + "_scales"]))[1])
          yield name, mxfp4_lib.dequantize(blocks, scales)
        elif fp8 and name + fp8.suffix in files:
          where = files[name + fp8.suffix]
          scale = (fh.get_tensor(name + fp8.suffix) if where == f else
                   next(_iter_tensors(files, [name + fp8.suffix]))[1])
          yield name, fp8.dequantize(name, fp8_lib.read_tensor(f, name), scale)
        else:
          yield name, get(name)


def _prediction_layer_names(c: dict[str, Any], files: dict[str, str]) -> set[str]:
  """The tensors of a GLM-4.5 checkpoint's multi-token-prediction layers (the
  num_nextn_predict_layers layers after num_hidden_layers), which are not read."""
  text = _language_model_config(c)
  lm = _causal_lm(_architecture(text))
  if lm in (NEMOTRON_H, EXAONE_MOE, MELLUM):  # their mtp.*, which transformers does not
    # read either
    return {n for n in files if n.startswith("mtp.")}
  if lm not in (GLM4_MOE,) + _V3_ROUTED:
    return set()
  first = int(text["num_hidden_layers"])
  extra = int(text.get("num_nextn_predict_layers", text.get("num_mtp_layers", 1)) or 0)
  named = _language_model_names(c, files)  # a vision-language folder's names
  prefixes = tuple(named(f"model.layers.{first + j}.") for j in range(extra))
  return {n for n in files if prefixes and n.startswith(prefixes)}


def _check_names(where: str, present: set[str], wanted: set[str],
                 tolerated: set[str] | frozenset[str] = frozenset()) -> None:
  missing, extra = sorted(wanted - present), sorted(present - wanted - tolerated)
  for what, names in (("is missing", missing), ("has unexpected", extra)):
    if names:
      raise ValueError(f"{where} {what} tensors: {names[:5]}{' ...' if len(names) > 5 else ''}")


def _adapter_files(path: str) -> dict[str, str]:
  """PEFT tensor name -> file, from the folder's adapter_model.safetensors."""
  f = os.path.join(path, "adapter_model.safetensors")
  if not os.path.exists(f):
    raise FileNotFoundError(f"{f} does not exist (only safetensors adapters are read)")
  with _open_tensors(f) as fh:
    return {name: f for name in fh.keys()}


# The quantized checkpoints `from_pretrained` reads (config.json's quant_method).
READ_QUANTIZATIONS = ("bitsandbytes", "compressed-tensors", "fbgemm_fp8", "fp8", "mxfp4")


def _check_quantization(where: str, hf_cfg: dict[str, Any]) -> None:
  """A one-line error for a checkpoint quantized in a format this reader does not know
  (GPTQ, AWQ, ...), rather than a list of unexpected tensors."""
  q = hf_cfg.get("quantization_config")
  m = q.get("quant_method") if isinstance(q, dict) else None
  if q is not None and m not in READ_QUANTIZATIONS:
    raise ValueError(f"{where}: quantization_config quant_method {m!r} is not read (read: "
                     f"{', '.join(READ_QUANTIZATIONS)}); dequantize the checkpoint first")


def from_pretrained(path: str, *, mesh: Mesh | None = None, dtype: str | None = None,
                    rules: Rules = DEFAULT_RULES, adapter: str | None = None, seed: int = 0,
                    **overrides: Any) -> Transformer:
  """Loads a local Hugging Face checkpoint folder into a Transformer.

  Args:
    path: folder with config.json and *.safetensors (optionally sharded with an index).
    mesh: place each parameter on its shards as it is read (default: the default device).
    dtype: parameter and compute dtype (default: the checkpoint's).
    rules: logical-axis rules.
    adapter: a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors)
      to load onto the base; its r, lora_alpha and target_modules set the LoRA fields.
    seed: draws what the files do not hold: a value head (value_w normal from key(seed),
      std `value_head_std`: 1 / sqrt(D + 1) for a reward model, init_std beside an
      lm_head; value_b zero), and new LoRA adapters (A of layer i, target t from
      fold_in(fold_in(key(seed), i), LORA_TARGETS.index(t)); B zero, so the model starts
      as the base).
    **overrides: ModelConfig fields to replace (attention_impl, remat, value_head,
      lora_rank, ...). A reward model from a causal LM's folder: value_head=True,
      lm_head=False, architecture="<Family>ForSequenceClassification" (its lm_head is
      not read; the score head is new).

  A *ForSequenceClassification folder loads as a reward model: score.weight [1, D] is
  value_w, value_b is 0 (HF's score layer has no bias), there is no lm_head.

  Raises:
    ValueError: unknown architecture; a sequence classifier of more than one label;
      missing, unexpected or wrongly shaped tensors; an adapter config this model cannot
      run, or overrides that disagree with it.
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{cfg_path} does not exist")
  with open(cfg_path) as fh:
    hf_cfg = json.load(fh)
  _check_quantization(cfg_path, hf_cfg)
  if dtype is not None:
    overrides = {"dtype": dtype, "param_dtype": dtype, **overrides}
  if adapter is not None and _language_model_config(hf_cfg) is not hf_cfg:
    raise ValueError(f"adapter={adapter!r}: adapters on a vision-language checkpoint "
                     f"({hf_cfg['architectures']}) are not read; merge it, or load its "
                     "language model saved alone")
  if adapter is not None:
    classifier = (_architecture(hf_cfg) in SEQUENCE_CLASSIFIERS
                  or overrides.get("architecture") in SEQUENCE_CLASSIFIERS)
    base = hf_config_to_model_config(
        hf_cfg, **{k: v for k, v in overrides.items()
                   if not k.startswith(("lora_", "base_quantization"))})
    lora = _read_adapter_config(adapter, base, classifier=classifier)
    _check_adapter_overrides(adapter, lora, overrides)
    overrides = {**overrides, **lora}
  cfg = hf_config_to_model_config(hf_cfg, **overrides)
  files = _tensor_files(path)
  # A sequence classifier's score is the value head; a causal LM's files hold none.
  rows = _mapping(cfg, score=_architecture(_language_model_config(hf_cfg))
                  in SEQUENCE_CLASSIFIERS and cfg.value_head)
  named = _language_model_names(hf_cfg, files)
  stacked = sorted(n for n in files if n.endswith(".mlp.experts.gate_up_proj"))
  if cfg.num_experts and stacked:  # Qwen3-VL-MoE's files: the experts stacked
    with _open_tensors(files[stacked[0]]) as fh:
      shape = tuple(fh.get_slice(stacked[0]).get_shape())
    rows = _stacked_expert_rows(cfg, rows, transposed=shape == (
        cfg.num_experts, 2 * cfg.ffn_dim, cfg.d_model))
  rows = [(ours, named(name), *rest) for ours, name, *rest in rows]
  if _renamed_files(hf_cfg, files) and hf_cfg["model_type"] == "sarvam_moe":
    rows = _fused_qkv_rows(cfg, rows)
  present = set(files) - _prediction_layer_names(hf_cfg, files)
  if _causal_lm(cfg.architecture) in (GPT2, GPT_NEO):  # older files' attention-mask buffers
    present = {n for n in present
               if not re.search(r"\.attn\.(attention\.)?(bias|masked_bias)$", n)}
  mxfp4 = (hf_cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
  if mxfp4:  # gpt-oss's experts: NAME_blocks and NAME_scales are read as NAME
    packed = _mxfp4_names(files)
    present = (present - {n + part for n in packed for part in _MXFP4_PARTS}) | packed
  fp8 = fp8_lib.scheme(hf_cfg)
  if fp8:  # FP8 weights: NAME and its scale are read as NAME; input scales not at all
    present -= {n for n in files if n.endswith(fp8.suffix) and n[:-len(fp8.suffix)] in files}
    present -= {n for n in files if n.endswith(tuple("." + i for i in fp8.ignored))}
  bnb = bnb_lib.method(hf_cfg)
  if bnb:  # bitsandbytes: a weight's quantization state is read with it
    present -= bnb_lib.companions(files, bnb)
  ints = compressed_lib.scheme(hf_cfg)
  if ints:  # compressed-tensors integers, FP4: X.weight is read from X.weight_packed and beside
    kept = {w for w, c in compressed_lib.quantized(files).items() if c in present}
    present = (present - compressed_lib.companions(files)) | kept
  if _language_model_config(hf_cfg) is not hf_cfg:  # The language model's tensors alone.
    present = {n for n in present if n == named("lm_head.weight")
               or n.startswith(named("model.x")[:-1])}
  # Tied checkpoints sometimes carry a copy of the embedding as lm_head; a reward model
  # started from a causal LM does not read its lm_head.
  # (Phi's lm_head.bias too, unread without an lm_head; the class's own name of it.)
  head = ["lm_head.weight"] + ["lm_head.bias"] * cfg.lm_head_bias
  _check_names(f"checkpoint {path}", present, {r[1] for r in rows},
               {named(_class_name(cfg, n)) for n in head}
               if cfg.tie_embeddings or not cfg.lm_head else set())
  sources = [(files, rows, mxfp4, fp8, bnb, ints)]
  if adapter is not None:
    adapter_files, lora_rows = _adapter_files(adapter), _lora_mapping(cfg, reading=True)
    if _causal_lm(cfg.architecture) == NEMOTRON_H and any(
        n.startswith("base_model.model.backbone.") for n in adapter_files):
      # PEFT writes the trunk as transformers names it in memory (model.*); files made
      # against the published names say backbone.*.
      lora_rows = [(ours, name.replace("base_model.model.model.", "base_model.model.backbone.",
                                       1), *rest) for ours, name, *rest in lora_rows]
    if _PEFT_SCORE in adapter_files and cfg.value_head and not cfg.lm_head:
      # A reward model's adapter holds its trained score layer: it replaces the base's.
      score = [r for r in _mapping(cfg, score=True) if r[0] == ("value_w",)]
      lora_rows += [(ours, _PEFT_SCORE, *rest) for ours, _, *rest in score]
    _check_names(f"adapter {adapter}", set(adapter_files), {r[1] for r in lora_rows})
    sources.append((adapter_files, lora_rows, False, None, None, None))

  graphdef, abstract_state = abstract_model(cfg)
  shardings = state_shardings(abstract_state, mesh, rules) if mesh is not None else None
  values: dict[tuple, jax.Array] = {}
  pd = jnp.dtype(cfg.param_dtype)
  for source_files, source_rows, mxfp4, fp8, bnb, ints in sources:
    by_name: dict[str, list] = {}
    for r in source_rows:  # a tensor may hold several of ours (gpt-oss's gate_up_proj)
      by_name.setdefault(r[1], []).append(r)
    for name, whole in _iter_tensors(source_files, list(by_name), mxfp4=mxfp4, fp8=fp8,
                                     bnb=bnb, ints=ints):
      for ours, _, to_ours, to_hf, shape in by_name[name]:
        expected = _hf_shape(cfg, name, shape, to_hf)
        if tuple(whole.shape) != tuple(expected):
          raise ValueError(f"tensor {name} has shape {tuple(whole.shape)}, expected "
                           f"{expected}")
        # The value head is float32 whatever param_dtype is (as the model creates it).
        arr = np.asarray(to_ours(whole)).astype(np.float32 if ours == ("value_w",) else pd)
        axis = _quantized_axis(abstract_state, ours, cfg)
        if axis is not None:  # QLoRA: quantized as it is read
          arr = quant.quantize(arr, cfg.base_quantization, cfg.base_quantization_block,
                               axis=axis)
        if shardings is not None:
          values[ours] = jax.device_put(arr, _target_sharding(shardings, ours, cfg))
        else:
          values[ours] = jax.tree.map(jnp.asarray, arr)
  if any(_is_slice(k) for k in values):
    values = _stack_experts(values, cfg, shardings)
  if cfg.scan_layers:
    values = _stack_layers(values, cfg, shardings)

  def fill(path, v):
    key = tuple(getattr(p, "key", getattr(p, "name", getattr(p, "idx", None))) for p in path)
    key = tuple(k for k in key if k != "value")
    if key not in values:  # A value head or new adapters: HF checkpoints do not have them.
      return _fresh(v, key, cfg, shardings, seed)
    return values[key]

  state = jax.tree_util.tree_map_with_path(fill, abstract_state, is_leaf=quant.is_quantized)
  return nnx.merge(graphdef, state)


def _lookup(tree, key: tuple):
  node = tree
  for k in key:
    node = node[k]
  return node


_STACKS = ("layers", "dense_layers", "linear_layers", "mlp_layers", "moe_layers",
           "global_layers", "shared_layers", "shared_global_layers", "linear_dense_layers")


def _stacked_key(key: tuple) -> tuple:
  """("layers", i, *rest) -> ("layers", *rest): the path in a scan_layers model (the same
  for "dense_layers")."""
  return key[:1] + key[2:]


def _is_expert(ours: tuple) -> bool:
  """An expert's slice of a mixture's parameter: ("layers", i, "mlp", name, j) (or in
  "linear_layers", or "moe_layers")."""
  return (len(ours) == 5
          and ours[0] in ("layers", "linear_layers", "moe_layers", "global_layers")
          and isinstance(ours[-1], int))


def _is_slice(ours: tuple) -> bool:
  """A slice of a parameter's leading axis: an expert's (`_is_expert`), or one head's of
  a q/k norm's weight per head (("layers", i, "attn", "q_norm", "scale", h): StableLM's
  files hold a tensor a head)."""
  return _is_expert(ours) or (len(ours) == 6 and ours[2] == "attn" and ours[-2] == "scale"
                              and isinstance(ours[-1], int))


def _param_key(ours: tuple, cfg: ModelConfig) -> tuple[tuple, int]:
  """(the parameter holding the tensor at `ours`, how many leading axes it has beyond the
  tensor's: one layer of a stacked parameter, one expert of a mixture's)."""
  drop = 0
  if _is_slice(ours):
    ours, drop = ours[:-1], 1
  if cfg.scan_layers and ours[0] in _STACKS:
    ours, drop = _stacked_key(ours), drop + 1
  return ours, drop


def _quantized_axis(abstract_state, ours: tuple, cfg: ModelConfig) -> int | None:
  """The block axis of the parameter holding the tensor at `ours` when it is held
  quantized (QLoRA), else None."""
  if not cfg.base_quantization:
    return None
  var = _lookup(abstract_state, _param_key(ours, cfg)[0])
  if not isinstance(var, quant.QuantizedParam):
    return None
  return quant.block_axis(var.get_metadata()["logical_axes"])


def _target_sharding(shardings, ours: tuple, cfg: ModelConfig):
  """Where a tensor read from the checkpoint goes: one layer of a stacked parameter
  (one expert of a mixture's) takes the stacked parameter's sharding without its layer
  (expert) axis (a QArray of shardings for a quantized one)."""
  ours, drop = _param_key(ours, cfg)
  sharding = _lookup(shardings, ours).get_value()
  if not drop:
    return sharding
  return jax.tree.map(lambda s: jax.sharding.NamedSharding(
      s.mesh, jax.sharding.PartitionSpec(*s.spec[drop:])), sharding)


def _stack(parts: list, sharding) -> jax.Array:
  """The arrays (or QArrays) stacked on a new leading axis, laid out as `sharding`
  (None: default)."""
  stack = lambda *xs: jax.tree.map(lambda *x: jnp.stack(x), *xs)  # noqa: E731
  if sharding is None:
    return stack(*parts)
  return jax.jit(stack, out_shardings=sharding)(*parts)


def _stack_experts(values: dict, cfg: ModelConfig, shardings) -> dict:
  """Stacks each layer's per-expert tensors into its [E, ...] parameter (a layer's slice
  of it with scan_layers), one parameter at a time."""
  out = {k: v for k, v in values.items() if not _is_slice(k)}
  for key in sorted({k[:-1] for k in values if _is_slice(k)}):
    parts = [values.pop(key + (j,)) for j in range(sum(k[:-1] == key for k in values))]
    out[key] = _stack(parts, None if shardings is None else
                      _target_sharding(shardings, key, cfg))
  return out


def _stack_layers(values: dict, cfg: ModelConfig, shardings) -> dict:
  """Stacks each per-layer tensor into its scan_layers parameter, one kind at a time
  (the per-layer copies of a kind are dropped as soon as it is stacked)."""
  out = {k: v for k, v in values.items() if k[0] not in _STACKS}
  for stack, indices in layer_stacks(cfg):
    for rest in sorted({k[2:] for k in values if k[0] == stack}):
      parts = [values.pop((stack, i) + rest) for i in range(len(indices))]
      key = (stack,) + rest
      out[key] = _stack(parts, None if shardings is None else
                        _lookup(shardings, key).get_value())
  return out


def _read_param(state, ours: tuple, cfg: ModelConfig) -> jax.Array:
  """Our parameter at an unstacked path; one layer's slice of a scan_layers parameter;
  one expert's slice of a mixture's."""
  index = ()
  if _is_slice(ours):
    ours, index = ours[:-1], (ours[-1],)
  if cfg.scan_layers and ours[0] in _STACKS:
    ours, index = _stacked_key(ours), (ours[1], *index)
  value = _lookup(state, ours)[...]
  return value[index] if index else value


def _fresh(v, key: tuple, cfg: ModelConfig, shardings, seed: int):
  """Initialises a parameter that the checkpoint does not hold (the value head, LoRA
  adapters), born on its sharding when there is a mesh."""
  name = key[-1]
  is_lora = key[0] in _STACKS and name.endswith(("_lora_a", "_lora_b"))
  if key not in (("value_w",), ("value_b",)) and not is_lora:
    raise ValueError(f"no checkpoint tensor for parameter {'/'.join(map(str, key))}")

  def make():
    if key == ("value_b",):
      return jnp.zeros(v.shape, v.dtype)
    if key == ("value_w",):
      return jax.random.normal(jax.random.key(seed), v.shape, v.dtype) * value_head_std(cfg)
    a_b = _fresh_adapter(cfg, name[:-len("_lora_a")], jax.random.key(seed),
                         None if cfg.scan_layers else layer_index(cfg, key[0], key[1]),
                         stack=key[0])
    return a_b[int(name.endswith("_b"))]

  if shardings is None:
    return make()
  return jax.jit(make, out_shardings=_lookup(shardings, key).value)()


# -- writing --------------------------------------------------------------------------------


def save_pretrained(model: Transformer, path: str, *, max_shard_bytes: int = 4 << 30,
                    dtype: str | None = None, pad_token_id: int | None = None) -> None:
  """Writes config.json and model*.safetensors (sharded with an index past max_shard_bytes).

  The class is cfg.architecture (`check_exportable`). A *ForCausalLM is written without
  a value head; a *ForSequenceClassification (a reward model) writes the value head as
  score.weight [1, D] in the export dtype, with num_labels 1.

  A model with LoRA adapters is written merged (see `merge_lora`); `save_lora_adapter`
  writes the adapters alone.

  Args:
    model: the model to write.
    path: the folder (created if missing).
    max_shard_bytes: the largest safetensors file; more tensors go to further files.
    dtype: the tensors' dtype (default: cfg.param_dtype).
    pad_token_id: config.json's pad_token_id, by which a `transformers` sequence
      classifier finds each row's last token (the tokenizer's pad id). None: cfg's (as
      read from the folder the model came from), else nothing for a causal LM and 0 for
      a sequence classifier.

  Raises:
    ValueError: the class cannot hold the model (`check_exportable`), or a sequence
      classifier's value_b is not 0 (HF's score layer has no bias).
  """
  from safetensors.numpy import save_file
  hf_cfg = model_config_to_hf(model.cfg, pad_token_id)
  if model.cfg.architecture in SEQUENCE_CLASSIFIERS:
    _check_no_score_bias(model)
  model = merge_lora(model)  # HF checkpoints hold no adapters: W + scale * A B.
  cfg = model.cfg
  state = nnx.state(model)
  # With several processes every one gathers each tensor (a collective, in the same
  # order everywhere); process 0 alone keeps them and writes the files.
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
  if dtype:
    hf_cfg["torch_dtype"] = dtype
  out_dtype = jnp.dtype(dtype or cfg.param_dtype)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  rows = _mapping(cfg)
  if _causal_lm(cfg.architecture) == MISTRAL4 and cfg.num_experts:
    rows = _stacked_expert_rows(cfg, rows, transposed=True)  # what transformers reads
  for ours, name, _, to_hf, _ in rows:
    arr = _to_host(_read_param(state, ours, cfg))
    if not writer:
      continue
    arr = to_hf(arr.astype(out_dtype))
    # (np.ascontiguousarray would make a 0-d tensor, Apertus's xIELU beta and eps, 1-d.)
    arr = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    if name in shards[-1]:  # another part of a tensor that holds several of ours
      shards[-1][name] = shards[-1][name] + arr
      continue
    if size and size + arr.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = arr
    size += arr.nbytes
  if not writer:
    return
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
      weight_map.update({name: fname for name in shard})
    total = sum(a.nbytes for s in shards for a in s.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(hf_cfg, fh, indent=2)


def _check_no_score_bias(model: Transformer) -> None:
  bias = float(_to_host(model.value_b[...]))
  if bias != 0.0:
    raise ValueError(f"value_b={bias:g} cannot be written as {model.cfg.architecture}, whose "
                     "score layer has no bias; set value_b to 0 first (a Bradley-Terry "
                     "reward is unchanged by a constant shift)")


def _to_host(x) -> np.ndarray:
  """A (possibly multi-process) array's whole value as numpy, on every process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_lora_adapter(model: Transformer, path: str, *, base_model_name_or_path: str = "") -> None:
  """Writes the model's LoRA adapters as a PEFT adapter folder (adapter_config.json +
  adapter_model.safetensors in the adapters' dtype), which
  `peft.PeftModel.from_pretrained(base, path)` puts on the base checkpoint the model was
  loaded from (or on `save_pretrained` of the model with its adapters zeroed).

  A reward model (a score head, no lm_head) trains its score head beside the adapters:
  the folder is PEFT's SEQ_CLS kind, the head saved whole as `score.weight` (float32)
  with modules_to_save ['classifier', 'score'], for a base loaded as
  `AutoModelForSequenceClassification(..., num_labels=1)` (a causal LM's folder too).

  Raises:
    ValueError: the model has no adapters, or a reward model's value_b is not 0.
  """
  from safetensors.numpy import save_file
  cfg = model.cfg
  if not cfg.lora_rank:
    raise ValueError("the model has no LoRA adapters (lora_rank=0); nothing to save")
  state = nnx.state(model)
  tensors = {}
  rows = _lora_mapping(cfg)
  reward_model = cfg.value_head and not cfg.lm_head
  if reward_model:
    _check_no_score_bias(model)
    rows += [(ours, _PEFT_SCORE, *rest) for ours, _, *rest in _mapping(cfg, score=True)
             if ours == ("value_w",)]
  for ours, name, _, to_peft, _ in rows:  # every process gathers; process 0 writes
    tensors[name] = np.ascontiguousarray(to_peft(_to_host(_read_param(state, ours, cfg))))
  if jax.process_index() != 0:
    return
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
  alpha = float(cfg.lora_alpha)
  config = {
      "peft_type": "LORA", "task_type": "SEQ_CLS" if reward_model else "CAUSAL_LM",
      "modules_to_save": sorted(_SCORE_MODULES) if reward_model else None, "r": cfg.lora_rank,
      "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
      "target_modules": [_peft_target(cfg, t) for t in cfg.lora_target_names
                         if t not in EXPERT_LORA_TARGETS],
      "lora_dropout": 0.0, "bias": "none",
      "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "base_model_name_or_path": base_model_name_or_path or None, "inference_mode": True,
      "init_lora_weights": True,
  }
  experts = [t for t in cfg.lora_target_names if t in EXPERT_LORA_TARGETS]
  if experts:  # PEFT's adapters on parameters: the routed experts' stacked weights
    config["target_parameters"] = [f"{_experts_module(cfg)}.{t[len('experts_'):]}"
                                   for t in experts]
  with open(os.path.join(path, "adapter_config.json"), "w") as fh:
    json.dump(config, fh, indent=2)
