"""The rollout engine: bucketed prefill + jitted KV-cache decode with behaviour log-probs.

from posttrain.sampling import Sampler, Completions, Transcript, continue_conversation
"""

from posttrain.sampling.conversation import Transcript, continue_conversation
from posttrain.sampling.sampler import (FINISH_LENGTH, FINISH_STOP, Completions, Sampler,
                                        SamplingMode, sample_logits, sampling_mode)

__all__ = [
    "FINISH_LENGTH", "FINISH_STOP", "Completions", "Sampler", "SamplingMode", "sample_logits",
    "sampling_mode", "Transcript", "continue_conversation",
]
