"""The policy model: a Llama / Mistral / Qwen / Gemma decoder-only transformer with
logical-axis sharding; with `lm_head=False` a reward model (`Transformer.scores`).

from posttrain.models import get_preset, create_model, from_pretrained, save_pretrained
"""

from posttrain.models.config import PRESETS, ModelConfig, RopeConfig, decode_chunk_for, get_preset
from posttrain.models.factory import (abstract_model, create_model, relayout, shard_model,
                                      state_shardings)
from posttrain.models.hf import (from_pretrained, hf_config_to_model_config, save_lora_adapter,
                                 save_pretrained)
from posttrain.models.sharding import (DEFAULT_RULES, MESH_AXES, ShardingContext, logical_to_spec,
                                       make_mesh, named_sharding, rules_from_config)
from posttrain.models.transformer import (CACHED_WRITE_TOKENS, DIVERGENCES, KVCache,
                                          LayerKindCaches, Transformer, cache_slots,
                                          check_foldable, chunked_divergence,
                                          chunked_logprobs, constrain_cache, fold_lora, init_cache, map_cache,
                                          merge_lora, sliding_cache_slots, soft_cap,
                                          with_lora, without_lora, write_cache)

__all__ = [
    "PRESETS", "ModelConfig", "RopeConfig", "decode_chunk_for", "get_preset", "abstract_model", "create_model",
    "relayout", "shard_model", "state_shardings", "from_pretrained", "hf_config_to_model_config",
    "save_lora_adapter",
    "save_pretrained", "DEFAULT_RULES", "MESH_AXES", "ShardingContext", "logical_to_spec",
    "make_mesh", "named_sharding", "rules_from_config", "CACHED_WRITE_TOKENS", "KVCache",
    "LayerKindCaches",
    "sliding_cache_slots", "Transformer",
    "cache_slots", "chunked_divergence", "chunked_logprobs", "DIVERGENCES", "constrain_cache", "init_cache", "map_cache",
    "soft_cap", "write_cache", "check_foldable", "fold_lora", "merge_lora", "with_lora", "without_lora",
]
