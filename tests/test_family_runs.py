"""A GRPO run from an OLMo 3, a GLM-4, a GLM-4.5 (mixture), a DeepSeek-V3 (latent
attention), a DeepSeek-V3.2 (sparse attention), a Qwen3.5 (Gated DeltaNet), a Llama 4
(chunked attention, dense and mixture layers), a Granite 3 MoE, a Granite 4 hybrid
(Mamba2), a Nemotron-H (single-sublayer layers), a Mamba2 (its mixers alone), a
FalconMamba (Mamba 1's), a Jamba (Mamba 1 and attention, mixtures every other layer), a
Nemotron 3 (mixtures alone), a Falcon-H1, an LFM2 (short convolutions), a Ministral 3
(queries scaled by position), an OLMoE, an EXAONE 4, two Gemma 4s (full layers of their
own widths, experts beside the dense MLP; per-layer embeddings and layers sharing keys
and values), a Seed-OSS, a Phi-2 (an output bias), a Pythia (q, k and v fused head by
head), a GPT-2 (learned positions), a Falcon-40B (grouped keys), a DBRX (clamped q, k and
v, stacked experts), a BLOOM and an MPT (ALiBi), a GPT-Neo (local layers, unscaled
logits), a Phi-3.5-MoE (sparsemixer routing), an OPT (learned positions past two unread
rows), a GPT-J (interleaved partial rotation, an output bias), an OLMo 1.7 (LayerNorms
without parameters), a Minitron (LayerNorm1P), a VaultGemma (Gemma 2 without output
norms) and a Phi-3 (LongRoPE, partial rotary) Hugging Face folder, end to end: SFT and RL
steps with rollouts through the sampler, checkpoints, and the final checkpoint exported
as a folder that transformers loads into the same class and computes our logits with."""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import default
from posttrain import models, planner, trainer
from posttrain.export import export_checkpoint
from posttrain.metrics import read_metrics
from tests.test_trainer import OVERRIDES

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install '.[parity]')")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers")

RUN = {**OVERRIDES, "model.overrides.num_layers": 2, "sft.steps": 2, "sft.warmup": 0,
       "train.rl_steps": 2,
       "eval.seeds_per_domain": 0}
FAMILIES = {
    # Output norms, q/k norms over every head, a sliding layer (window 8, shorter than
    # the rows) beside a full one with a scaled rotary embedding of its own.
    "olmo3": dict(architecture="Olmo3ForCausalLM", qk_norm=True, qk_norm_heads=True,
                  output_norms=True, qkv_bias=True, attn_out_bias=True, sliding_window=8,
                  layer_types=("sliding_attention", "full_attention"),
                  rope=models.RopeConfig(theta=500_000.0, type="linear", factor=2.0),
                  rope_local=models.RopeConfig(theta=500_000.0)),
    # Sandwich norms and half of each head rotated by an interleaved rotary embedding
    # (held as rotate-half over reordered q / k rows).
    "glm4": dict(architecture="Glm4ForCausalLM", sandwich_norms=True, qkv_bias=True,
                 rope=models.RopeConfig(partial_rotary_factor=0.5)),
    # Half of each head rotates, under LongRoPE whose original context (24) the rows
    # pass: prompts and rollouts cross it.
    "phi3": dict(architecture="Phi3ForCausalLM",
                 d_model=64, head_dim=16,  # transformers' Phi-3: d_model / heads
                 rope=models.RopeConfig(type="longrope", short_factor=(1.0, 1.5, 2.0, 2.5),
                                        long_factor=(3.0, 4.0, 5.0, 6.0), factor=4.0,
                                        original_max_position_embeddings=24,
                                        partial_rotary_factor=0.5)),
    # A dense first layer, then sigmoid routing over two groups of experts (the
    # correction bias frozen through the updates), a shared expert, partial rotary.
    "glm4_moe": dict(architecture="Glm4MoeForCausalLM", qkv_bias=True, qk_norm=True,
                     rope=models.RopeConfig(partial_rotary_factor=0.5), num_experts=4,
                     num_experts_per_tok=2, ffn_dim=64, shared_expert_dim=64,
                     router_scoring="sigmoid", router_groups=2, router_group_topk=1,
                     routed_scaling_factor=2.0, dense_layers=1, dense_ffn_dim=96),
    # Multi-head latent attention (a query latent; rollouts through the latent cache)
    # over GLM-4.5's mixture.
    "deepseek_v3": dict(architecture="DeepseekV3ForCausalLM", head_dim=48,
                        num_kv_heads=4, kv_lora_rank=32, q_lora_rank=24,
                        qk_rope_head_dim=16, v_head_dim=32,
                        rope=models.RopeConfig(partial_rotary_factor=16 / 48), num_experts=4,
                        num_experts_per_tok=2, ffn_dim=64, shared_expert_dim=64,
                        router_scoring="sigmoid", router_groups=2, router_group_topk=1,
                        routed_scaling_factor=2.0, dense_layers=1, dense_ffn_dim=96),
    # DeepSeek-V3.2: the latent attention under DeepSeek Sparse Attention, each query
    # choosing 8 keys (rows and rollouts are longer: the indexer's keys cached beside
    # the latent). 16 indexer heads: with few, a key every head scores below zero ties
    # others at exactly 0, which transformers' top-k breaks its own way.
    "deepseek_v32": dict(architecture="DeepseekV32ForCausalLM", head_dim=48,
                         num_kv_heads=4, kv_lora_rank=32, q_lora_rank=24,
                         qk_rope_head_dim=16, v_head_dim=32, index_topk=8, index_heads=16,
                         index_head_dim=16,
                         rope=models.RopeConfig(partial_rotary_factor=16 / 48), num_experts=4,
                         num_experts_per_tok=2, ffn_dim=64, shared_expert_dim=64,
                         router_scoring="sigmoid", router_groups=2, router_group_topk=1,
                         routed_scaling_factor=2.0, dense_layers=1, dense_ffn_dim=96),
    # A Gated DeltaNet layer (rollouts through its recurrent state, packed SFT rows
    # through its resets) beside a full layer with a gated output.
    "qwen3_5": dict(architecture="Qwen3_5ForCausalLM", qk_norm=True, norm_unit_offset=True,
                    attn_output_gate=True, layer_types=("linear_attention", "full_attention"),
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=8, rope=models.RopeConfig(partial_rotary_factor=0.25)),
    # Llama 4 (Maverick's layout): a dense layer, then a mixture routed top-1 by sigmoid
    # scores that scale the expert's input, beside a shared expert; the rotary layer's
    # weightless q/k norms and chunks of 8 positions (rows and rollouts cross them), the
    # NoPE layer's query scale by position.
    "llama4": dict(architecture="Llama4ForCausalLM", num_experts=4, num_experts_per_tok=1,
                   norm_topk_prob=False, ffn_dim=64, shared_expert_dim=64,
                   router_scoring="sigmoid", router_correction_bias=False,
                   routed_input_scaling=True, moe_layer_step=2, dense_ffn_dim=96,
                   rope_layers=(1, 0), qk_l2_norm=True, attention_chunk_size=8,
                   sliding_window=8, layer_types=("sliding_attention", "full_attention"),
                   attn_temperature_tuning=True, attn_floor_scale=4.0),
    # Granite 3 MoE: its four scalars (the scaled logits through the sampler's head and
    # the train step's) over stacked experts.
    "granite_moe": dict(architecture="GraniteMoeForCausalLM", num_experts=4,
                        num_experts_per_tok=2, norm_topk_prob=True, ffn_dim=64,
                        embedding_multiplier=12.0, residual_multiplier=0.22,
                        attention_multiplier=0.0625, logits_scaling=8.0),
    # Granite 4's -h- layout: a Mamba2 layer (its conv bias; rollouts through its state,
    # packed SFT rows through its resets) beside an attention layer, no position embedding.
    "granite4_h": dict(architecture="GraniteMoeHybridForCausalLM",
                       layer_types=("linear_attention", "full_attention"),
                       linear_mixer="mamba2", linear_num_key_heads=1, linear_key_head_dim=16,
                       linear_num_value_heads=4, linear_value_head_dim=32,
                       linear_conv_bias=True, rope_layers=(0, 0), embedding_multiplier=6.0,
                       residual_multiplier=0.5, attention_multiplier=0.0625,
                       logits_scaling=4.0),
    # Nemotron-H: single-sublayer layers, a Mamba2 layer, an MLP of squared ReLU alone
    # (no cache: rollouts step past it) and NoPE attention; its own output projection.
    "nemotron_h": dict(architecture="NemotronHForCausalLM", num_layers=3, tie_embeddings=False,
                       layer_types=("linear_attention", "mlp", "full_attention"),
                       rope_layers=(0, 0, 0), mlp_activation="relu2", linear_mixer="mamba2",
                       linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_num_value_heads=4, linear_value_head_dim=16,
                       linear_conv_bias=True, linear_dt_min=0.001),
    # Mamba2: layers of a Mamba2 mixer alone (no attention, no MLP: no KV cache at all),
    # the residual stream in float32, the time step clipped both ways.
    "mamba2": dict(architecture="Mamba2ForCausalLM", tie_embeddings=False, ffn_dim=0,
                   num_heads=1, num_kv_heads=1, head_dim=16,
                   layer_types=("linear_attention",) * 2, rope_layers=(0, 0),
                   linear_mixer="mamba2", linear_num_key_heads=2, linear_key_head_dim=16,
                   linear_num_value_heads=4, linear_value_head_dim=16, linear_conv_bias=True,
                   linear_chunk=16, linear_dt_min=0.001, linear_dt_max=2.0,
                   residual_fp32=True),
    # FalconMamba: Mamba 1 mixers alone (a state per channel, dt / B / C normed), tied
    # embeddings, the residual stream in float32.
    "falcon_mamba": dict(architecture="FalconMambaForCausalLM", tie_embeddings=True,
                         ffn_dim=0, num_heads=1, num_kv_heads=1, head_dim=2,
                         layer_types=("linear_attention",) * 2, rope_layers=(0, 0),
                         linear_mixer="mamba1", linear_num_key_heads=1,
                         linear_key_head_dim=8, linear_num_value_heads=64,
                         linear_value_head_dim=1, linear_dt_rank=2, linear_conv_bias=True,
                         linear_bcdt_norm="weightless", residual_fp32=True),
    # Jamba: Mamba 1 layers (weighted norms on dt, B and C) and NoPE attention, each
    # beside an MLP that every other layer is a mixture of unnormalised softmax weights.
    "jamba": dict(architecture="JambaForCausalLM", tie_embeddings=False, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=8,
                  layer_types=("linear_attention", "linear_attention", "full_attention",
                               "linear_attention"), rope_layers=(0,) * 4,
                  linear_mixer="mamba1", linear_num_key_heads=1, linear_key_head_dim=8,
                  linear_num_value_heads=64, linear_value_head_dim=1, linear_dt_rank=2,
                  linear_conv_bias=True, linear_bcdt_norm="weighted",
                  linear_bcdt_norm_eps=1e-6, norm_eps=1e-6, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=False, moe_layer_step=2,
                  dense_ffn_dim=64),
    # Nemotron 3: a mixture alone (sigmoid routing over two groups, experts without a
    # gate in a latent of their own, a shared expert, the correction bias frozen) beside
    # Mamba2, attention and an MLP alone of its own width.
    "nemotron3": dict(architecture="NemotronHForCausalLM", num_layers=4, tie_embeddings=False,
                      layer_types=("linear_attention", "moe", "full_attention", "mlp"),
                      rope_layers=(0,) * 4, mlp_activation="relu2", linear_mixer="mamba2",
                      linear_num_key_heads=2, linear_key_head_dim=16,
                      linear_num_value_heads=4, linear_value_head_dim=16,
                      linear_conv_bias=True, linear_dt_min=0.001, num_experts=4,
                      num_experts_per_tok=2, ffn_dim=64, shared_expert_dim=48,
                      dense_ffn_dim=96, router_scoring="sigmoid", router_groups=2,
                      router_group_topk=1, routed_scaling_factor=2.5, moe_latent_dim=32),
    # Falcon-H1: a Mamba2 mixer beside each layer's attention (packed SFT rows reset both),
    # every muP multiplier away from one, the Mamba2 output unnormed.
    "falcon_h1": dict(architecture="FalconH1ForCausalLM", tie_embeddings=False,
                      parallel_mixer=True, linear_mixer="mamba2", linear_num_key_heads=1,
                      linear_key_head_dim=16, linear_num_value_heads=4,
                      linear_value_head_dim=16, linear_conv_bias=True, linear_norm="none",
                      embedding_multiplier=2.0, lm_head_multiplier=0.3,
                      key_multiplier=0.45, attention_in_multiplier=1.5,
                      attention_out_multiplier=0.75, ssm_in_multiplier=1.25,
                      ssm_out_multiplier=0.5, mlp_gate_multiplier=0.8,
                      mlp_down_multiplier=0.6, ssm_multipliers=(0.5, 0.25, 0.5, 0.5, 1.5)),
    # LFM2: a gated short convolution with biases (rollouts through its window, packed SFT
    # rows through its resets) beside an attention layer with per-head q/k norms.
    "lfm2": dict(architecture="Lfm2ForCausalLM", tie_embeddings=False, qk_norm=True,
                 layer_types=("linear_attention", "full_attention"), linear_mixer="short_conv",
                 linear_conv_kernel=3, linear_conv_bias=True,
                 rope=models.RopeConfig(theta=1_000_000.0)),
    # Ministral 3: YaRN over a 24-token pre-training context that prompts and rollouts
    # cross, every layer's queries scaled up past it.
    "ministral3": dict(architecture="Ministral3ForCausalLM", attn_position_scale=0.5,
                       attn_position_scale_length=24, tie_embeddings=False,
                       rope=models.RopeConfig(theta=1_000_000.0, type="yarn", factor=4.0,
                                              original_max_position_embeddings=24,
                                              mscale=1.0, mscale_all_dim=1.0)),
    # OLMoE: every MLP a mixture, top-k weights not renormalised, q/k norms over every
    # head at once (whose widths transformers takes from d_model: heads split it evenly).
    "olmoe": dict(architecture="OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                  head_dim=8,
                  norm_topk_prob=False, qk_norm=True, qk_norm_heads=True,
                  tie_embeddings=False),
    # EXAONE 4: output norms, per-head q/k norms, a sliding rotary layer (window 8,
    # shorter than the rows) beside a full NoPE one.
    "exaone4": dict(architecture="Exaone4ForCausalLM", output_norms=True, qk_norm=True,
                    sliding_window=8, layer_types=("sliding_attention", "full_attention"),
                    rope_layers=(1, 0), tie_embeddings=False),
    # Gemma 4 (26B-A4B's layout): a sliding layer (window 8, shorter than the rows) beside
    # a full one of its own widths (one key/value head of 48, values from the keys,
    # proportional RoPE), value norms, layer scalars the updates leave alone, a mixture
    # of GeGLU experts beside each layer's dense MLP.
    "gemma4": dict(architecture="Gemma4ForCausalLM", qk_norm=True, sandwich_norms=True,
                   embed_scale=True, mlp_activation="gelu_tanh", attention_multiplier=1.0,
                   final_logit_softcap=30.0, sliding_window=8,
                   layer_types=("sliding_attention", "full_attention"), global_head_dim=48,
                   global_kv_heads=1, k_eq_v=True, v_norm=True, layer_scale=True,
                   rope=models.RopeConfig(theta=1_000_000.0, type="proportional",
                                          partial_rotary_factor=0.25),
                   rope_local=models.RopeConfig(theta=10_000.0), num_experts=4,
                   num_experts_per_tok=2, ffn_dim=64, shared_expert_dim=96,
                   moe_input_norms=True),
    # Gemma 4 E2B's layout: per-layer embeddings, the last two layers attending over the
    # first two's keys and values (through the sampler's cache too), their MLPs twice as
    # wide; layers as a list.
    "gemma4_e": dict(architecture="Gemma4ForCausalLM", qk_norm=True, sandwich_norms=True,
                     embed_scale=True, mlp_activation="gelu_tanh", attention_multiplier=1.0,
                     final_logit_softcap=30.0, sliding_window=8, num_layers=4,
                     layer_types=("sliding_attention", "full_attention") * 2,
                     global_head_dim=48, v_norm=True, layer_scale=True,
                     rope=models.RopeConfig(theta=1_000_000.0, type="proportional",
                                            partial_rotary_factor=0.25),
                     rope_local=models.RopeConfig(theta=10_000.0), per_layer_dim=8,
                     kv_shared_layers=2, kv_shared_wide_mlp=True, scan_layers=False),
    # LFM2-MoE: a dense short-convolution layer (its own stack) before mixture layers of
    # both kinds, sigmoid routing with a correction bias the updates leave alone.
    "lfm2_moe": dict(architecture="Lfm2MoeForCausalLM", tie_embeddings=False, qk_norm=True,
                     num_layers=4, layer_types=("linear_attention", "full_attention") * 2,
                     linear_mixer="short_conv", linear_conv_kernel=3,
                     rope=models.RopeConfig(theta=1_000_000.0), num_experts=4,
                     num_experts_per_tok=2, ffn_dim=32, dense_layers=1, dense_ffn_dim=64,
                     router_scoring="sigmoid"),
    # nanochat: weightless norms (the embeddings' too), q/k normed after a rotation held
    # over swapped halves, a relu^2 MLP, soft-capped logits.
    "nanochat": dict(architecture="NanoChatForCausalLM", tie_embeddings=False,
                     norm_weightless=True, embed_norm=True, qk_l2_norm=True,
                     mlp_activation="relu2", final_logit_softcap=15.0),
    # Phi-2: parallel layers under one LayerNorm, an ungated gelu_new MLP, biases
    # everywhere, the output projection's among them (trained, and in every rollout's
    # logits), 0.4 of each head rotated.
    "phi": dict(architecture="PhiForCausalLM", layer_norm=True, norm_bias=True,
                mlp_bias=True, qkv_bias=True, attn_out_bias=True, parallel_residual=True,
                lm_head_bias=True, tie_embeddings=False, mlp_activation="gelu_tanh_ungated",
                rope=models.RopeConfig(partial_rotary_factor=0.4)),
    # Pythia: q, k and v fused head by head, parallel layers each sublayer under its own
    # LayerNorm, an ungated exact GELU, a quarter of each head rotated.
    "gpt_neox": dict(architecture="GPTNeoXForCausalLM", d_model=64, head_dim=16,
                     num_kv_heads=4, layer_norm=True, norm_bias=True, mlp_bias=True,
                     qkv_bias=True, attn_out_bias=True, parallel_residual=True,
                     parallel_mlp_norm=True, tie_embeddings=False,
                     mlp_activation="gelu_ungated",
                     rope=models.RopeConfig(partial_rotary_factor=0.25)),
    # GPT-2: learned positions (rollouts read the table at their own positions), no
    # rotary embedding, q, k and v in one Conv1D c_attn, tied embeddings.
    "gpt2": dict(architecture="GPT2LMHeadModel", head_dim=8, num_kv_heads=4,
                 layer_norm=True, norm_bias=True, mlp_bias=True, qkv_bias=True,
                 attn_out_bias=True, learned_positions=True, rope_layers=(0, 0),
                 mlp_activation="gelu_tanh_ungated"),
    # Falcon-40B: grouped keys fused by group, parallel layers under two norms, no biases.
    "falcon": dict(architecture="FalconForCausalLM", head_dim=8, layer_norm=True,
                   norm_bias=True, parallel_residual=True, parallel_mlp_norm=True,
                   mlp_activation="gelu_ungated"),
    # DBRX: a mixture in every layer (its experts one tensor each for all), q, k and v
    # clamped, LayerNorms without biases.
    "dbrx": dict(architecture="DbrxForCausalLM", head_dim=8, layer_norm=True, norm_eps=1e-5,
                 clip_qkv=2.0, tie_embeddings=False, num_experts=4, num_experts_per_tok=2,
                 ffn_dim=32),
    # OPT: learned positions past its table's two unread rows, an ungated ReLU MLP.
    "opt": dict(architecture="OPTForCausalLM", head_dim=8, num_kv_heads=4, layer_norm=True,
                norm_bias=True, mlp_bias=True, qkv_bias=True, attn_out_bias=True,
                learned_positions=True, position_offset=2, rope_layers=(0, 0),
                mlp_activation="relu_ungated", norm_eps=1e-5),
    # GPT-J: interleaved partial rotation (reordered on load), an output bias.
    "gptj": dict(architecture="GPTJForCausalLM", d_model=64, head_dim=16, num_kv_heads=4,
                 layer_norm=True, norm_bias=True, mlp_bias=True, parallel_residual=True,
                 lm_head_bias=True, tie_embeddings=False, mlp_activation="gelu_tanh_ungated",
                 rope=models.RopeConfig(partial_rotary_factor=0.5)),
    # OLMo 1.7: LayerNorms without parameters, q, k and v clamped.
    "olmo1": dict(architecture="OlmoForCausalLM", layer_norm=True, norm_weightless=True,
                  clip_qkv=2.0, norm_eps=1e-5),
    # Minitron: LayerNorm1P, an ungated relu^2 MLP, half of each head rotated.
    "nemotron": dict(architecture="NemotronForCausalLM", layer_norm=True, norm_bias=True,
                     norm_unit_offset=True, mlp_activation="relu2", tie_embeddings=False,
                     rope=models.RopeConfig(partial_rotary_factor=0.5)),
    # VaultGemma: Gemma 2's soft caps and sliding layer without its output norms.
    "vaultgemma": dict(architecture="VaultGemmaForCausalLM", norm_unit_offset=True,
                       embed_scale=True, mlp_activation="gelu_tanh", sliding_window=8,
                       layer_types=("sliding_attention", "full_attention"),
                       attn_logit_softcap=30.0, final_logit_softcap=20.0,
                       query_pre_attn_scalar=32.0),
    # BLOOM: ALiBi over six heads (slopes between a power of two's), a LayerNorm on the
    # embeddings, biases everywhere.
    "bloom": dict(architecture="BloomForCausalLM", d_model=48, num_heads=6, num_kv_heads=6,
                  head_dim=8, ffn_dim=192, layer_norm=True, norm_bias=True, mlp_bias=True,
                  qkv_bias=True, attn_out_bias=True, alibi=True, embed_norm=True,
                  rope_layers=(0, 0), mlp_activation="gelu_tanh_ungated"),
    # MPT: ALiBi, q, k and v clamped, no biases, LayerNorms without them.
    "mpt": dict(architecture="MptForCausalLM", head_dim=8, num_kv_heads=4, ffn_dim=128,
                layer_norm=True, alibi=True, clip_qkv=2.0, rope_layers=(0, 0),
                mlp_activation="gelu_ungated", max_position_embeddings=64),
    # GPT-Neo: learned positions, a global layer and a local one (a window of 8, shorter
    # than the rows), unscaled logits, out_proj's bias alone.
    "gpt_neo": dict(architecture="GPTNeoForCausalLM", head_dim=8, num_kv_heads=4,
                    layer_norm=True, norm_bias=True, mlp_bias=True, attn_out_bias=True,
                    learned_positions=True, rope_layers=(0, 0), query_pre_attn_scalar=1.0,
                    sliding_window=8, layer_types=("full_attention", "sliding_attention"),
                    mlp_activation="gelu_tanh_ungated"),
    # Phi-3.5-MoE: sparsemixer routing, LayerNorms with biases, attention and output
    # biases.
    "phimoe": dict(architecture="PhimoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                   norm_topk_prob=False, router_scoring="sparsemixer", ffn_dim=32,
                   layer_norm=True, norm_bias=True, qkv_bias=True, attn_out_bias=True,
                   lm_head_bias=True, tie_embeddings=False),
    # Seed-OSS: q/k/v biases and o_proj's.
    "seed_oss": dict(architecture="SeedOssForCausalLM", qkv_bias=True, attn_out_bias=True,
                     tie_embeddings=False),
}


def _config(**extra):
  return planner.override(default.get_config(), {**RUN, **extra})


# The model-level parity tests cover each family; the default run keeps Phi-3's (LongRoPE
# through rollouts and the train step), the others run with the slow tests.
@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "phi3" else
                                                 pytest.mark.slow) for f in FAMILIES])
def test_a_run_from_a_hugging_face_folder_trains_and_exports(family, tmp_path):
  cfg = trainer.model_config(_config()).replace(**FAMILIES[family])
  folder = str(tmp_path / "base")
  base_model = models.create_model(cfg, seed=4)
  correction = cfg.router_scoring == "sigmoid" and cfg.router_correction_bias
  if correction:  # a correction bias the updates must leave alone
    stack = getattr(base_model, "moe_layers", base_model.layers)  # Nemotron 3's mixtures
    bias = (stack.mlp if cfg.scan_layers else stack[0].mlp).score_correction_bias
    bias.value = jax.random.normal(jax.random.key(1), bias.shape) * 0.3
  if cfg.layer_scale:  # layer scalars (buffers in transformers') no update may move
    for stack, _ in models.transformer.layer_stacks(cfg):
      blocks = getattr(base_model, stack)
      for block in ([blocks] if cfg.scan_layers else blocks):
        block.layer_scale.value = jax.random.uniform(
            jax.random.key(2), block.layer_scale.shape, minval=0.5, maxval=1.5)
  if cfg.lm_head_bias:  # an output bias that moves the logits
    base_model.lm_head_bias.value = jax.random.normal(jax.random.key(3), (cfg.vocab_size,))
  models.save_pretrained(base_model, folder)
  config = _config(init_from=folder)
  trainer.train(config, str(tmp_path / "run"))
  rows = read_metrics(str(tmp_path / "run"))
  rl = [r for r in rows if "reward/mean" in r]
  # A random model scores 0 on every sample (no advantage to follow); the SFT step moves
  # the weights.
  assert len(rl) == 2 and all(np.isfinite(r["loss"]) for r in rl)
  out = str(tmp_path / "export")
  done = export_checkpoint(config, str(tmp_path / "run"), out)
  assert done["architecture"] == cfg.architecture
  ours = models.from_pretrained(out)
  assert ours.cfg.replace(dtype=cfg.dtype, param_dtype=cfg.param_dtype) == cfg.replace(
      max_position_embeddings=ours.cfg.max_position_embeddings)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  assert type(theirs).__name__ == cfg.architecture
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))  # past 24
  with torch.no_grad():
    want = theirs(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours(tokens)), want, atol=1e-4, rtol=0)
  base = jax.tree.leaves(nnx.state(models.from_pretrained(folder)))
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
           for a, b in zip(base, jax.tree.leaves(nnx.state(ours)))]
  assert max(moved) > 0  # the SFT step moved the weights that were exported
  if correction:
    def biases(model):
      flat = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
      return [np.asarray(x) for path, x in flat if "score_correction_bias" in str(path)]
    np.testing.assert_array_equal(biases(ours), biases(models.from_pretrained(folder)))
    assert np.abs(biases(ours)[0]).min() > 0.02
  if cfg.layer_scale:
    def scalars(model):
      flat = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
      return [np.asarray(x) for path, x in flat if "layer_scale" in str(path)]
    np.testing.assert_array_equal(scalars(ours), scalars(models.from_pretrained(folder)))
    assert min(abs(float(x[0]) - 1.0) for x in scalars(ours)) > 1e-3


def test_a_folder_defines_the_model_and_the_run_its_choices(tmp_path, caplog):
  """init_from a folder: architecture and shapes are the folder's whatever the preset
  says; remat, layout, dtypes and LoRA are the run's; max_position_embeddings may be
  set; an override of the model's own fields is not applied, and a warning names it."""
  from posttrain import experiment
  cfg = models.get_preset("tiny").replace(**FAMILIES["olmo3"], num_layers=2, d_model=64,
                                          ffn_dim=96)
  folder = str(tmp_path / "olmo")
  models.save_pretrained(models.create_model(cfg), folder)
  config = _config(init_from=folder, **{"model.overrides.remat": "full",
                                        "model.overrides.scan_layers": True,
                                        "model.overrides.lora_rank": 4,
                                        "model.overrides.max_position_embeddings": 512})
  with caplog.at_level("WARNING"):
    run = experiment.model_config(config)
  assert run.replace(remat="none", scan_layers=False, lora_rank=0,
                     max_position_embeddings=cfg.max_position_embeddings) == cfg
  assert (run.remat, run.scan_layers, run.lora_rank, run.max_position_embeddings) == (
      "full", True, 4, 512)
  warned = [r.getMessage() for r in caplog.records if "defines the model" in r.getMessage()]
  assert len(warned) == 1 and "'d_model': 32" in warned[0] and "'d_model': 64" in warned[0]
  assert "'architecture': 'LlamaForCausalLM'" in warned[0]
  # Without a folder the preset and overrides define the model, as before.
  assert experiment.model_config(_config()).architecture == "LlamaForCausalLM"
  # With one, the overrides are checked against the folder's model, and their names at
  # once (a mixture's expert targets over a dense preset: `test_a_lora_run_on_nemotron3_`).
  with pytest.raises(ValueError, match=r"model.overrides \['lora_rnak'\] are not fields"):
    experiment.model_config(_config(init_from=folder, **{"model.overrides.lora_rnak": 4}))
  with pytest.raises(ValueError, match="adapt a mixture's routed experts, but this model "
                     "has none"):
    experiment.model_config(_config(init_from=folder, **{
        "model.overrides.lora_rank": 4, "model.overrides.lora_targets": "experts_up_proj"}))


def test_a_run_with_a_tokenizer_its_own_template_renders(tmp_path, scored):
  """End to end with "template:DIR" (OLMo 3 Think's layout: ChatML whose generation
  prompt opens <think>): SFT demonstrations and rollout prompts are the template's, and
  the verifier reads each completion after its reasoning."""
  from posttrain.data import load_tokenizer
  from tests.data.test_template_format import THINK, _folder
  tok_dir = tmp_path / "tok"
  tok_dir.mkdir()
  _folder(tok_dir, ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"],
          THINK)
  tok = load_tokenizer(f"template:{tok_dir}")
  seen = scored
  config = _config(**{"tokenizer": f"template:{tok_dir}", "model.overrides.vocab_size": 400,
                      "train.rl_steps": 1, "sft.steps": 1})
  assert trainer.train(config, str(tmp_path / "run"))["status"] == "done"
  assert seen
  for s in seen:
    text = tok._tok.decode(s.prompt_tokens, skip_special_tokens=False)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n<think>")
    assert s.text == tok.split_response(s.response_tokens, s.prompt_tokens).content


@pytest.mark.slow
@pytest.mark.parametrize("family", ["nemotron3", "glm4_moe", "lfm2_moe"])
def test_rollout_routing_replay_runs_through_a_mixtures_layers(family, tmp_path):
  """rl.routing_replay=rollout on a hybrid whose mixtures are layers of their own
  (Nemotron 3: Mamba2, a mixture, attention, an MLP), on leading dense layers before
  sigmoid-routed mixtures (GLM-4.5), and on a hybrid's dense short-convolution layer
  before mixtures of both kinds (LFM2-MoE): the sampler records, the old log-probs' pass and
  both minibatches replay, and the learner's own routing is the sampler's on nearly every
  trained token (float32, the same weights)."""
  cfg = trainer.model_config(_config()).replace(**FAMILIES[family])
  folder = str(tmp_path / "base")
  models.save_pretrained(models.create_model(cfg, seed=4), folder)
  config = _config(init_from=folder, **{"rl.routing_replay": "rollout",
                                        "rl.num_minibatches": 2})
  trainer.train(config, str(tmp_path / "run"))
  rl = [r for r in read_metrics(str(tmp_path / "run")) if "reward/mean" in r]
  assert len(rl) == 2 and all(np.isfinite(r["loss"]) for r in rl)
  assert all(0 <= r["routing/mismatch"] < 0.02 for r in rl)


@pytest.mark.slow
def test_a_lora_run_on_nemotron3_experts_exports_an_adapter_peft_reads(tmp_path):
  """A LoRA run from a Nemotron 3 folder with adapters on the attention, the Mamba2
  in_proj and every routed expert's up and down (experts in a latent, no gate): the SFT
  and RL steps move the experts' adapters, and the exported PEFT adapter folder
  (target_parameters mixer.experts.up_proj / down_proj) gives transformers our logits."""
  import peft
  cfg = trainer.model_config(_config()).replace(**FAMILIES["nemotron3"])
  folder = str(tmp_path / "base")
  models.save_pretrained(models.create_model(cfg, seed=4), folder)
  targets = "q_proj,in_proj,experts_up_proj,experts_down_proj"
  config = _config(init_from=folder, **{"model.overrides.lora_rank": 4,
                                        "model.overrides.lora_targets": targets})
  trainer.train(config, str(tmp_path / "run"))
  rl = [r for r in read_metrics(str(tmp_path / "run")) if "reward/mean" in r]
  assert len(rl) == 2 and all(np.isfinite(r["loss"]) for r in rl)
  out = str(tmp_path / "adapter")
  # RL folded SFT's adapters into the base: the final adapters alone are refused ...
  with pytest.raises(ValueError, match="past this run's SFT \\(2 steps\\) stage"):
    export_checkpoint(config, str(tmp_path / "run"), out, adapter=True)
  # ... and the SFT stage's own (a run of that stage alone) are its update.
  config = _config(init_from=folder, **{"model.overrides.lora_rank": 4,
                                        "model.overrides.lora_targets": targets,
                                        "train.rl_steps": 0})
  trainer.train(config, str(tmp_path / "sft"))
  assert export_checkpoint(config, str(tmp_path / "sft"), out, adapter=True)["adapter"]
  ours = models.from_pretrained(folder, adapter=out)
  assert ours.cfg.lora_target_names == tuple(targets.split(","))
  moved = ours.moe_layers[0].mlp
  assert np.abs(np.asarray(moved.experts_up_proj_lora_b[...])).max() > 0
  assert np.abs(np.asarray(moved.experts_down_proj_lora_b[...])).max() > 0
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
  theirs = peft.PeftModel.from_pretrained(hf, out).eval()
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
  with torch.no_grad():
    want = theirs(torch.tensor(tokens)).logits.numpy()
    with theirs.disable_adapter():
      base = theirs(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(ours(tokens))
  assert np.abs(got - base).max() > 1e-4  # the trained adapters matter
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
