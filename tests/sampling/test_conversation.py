"""Multi-turn transcripts: full sequences, loss masks and log-probs against recomputation."""

import numpy as np
import pytest

from posttrain.sampling import Transcript, continue_conversation
from sampling_refs import PROMPTS, token_logprobs


def test_two_turns_with_observations_mark_model_tokens(model, sampler):
  prompts = PROMPTS[:3]
  convs = [Transcript.from_prompt(p) for p in prompts]
  convs = continue_conversation(sampler, convs, max_new_tokens=5, temperature=1.0, seed=1)
  observations = [[200, 201], [202], [203, 204, 205]]
  convs = continue_conversation(sampler, convs, observations=observations, max_new_tokens=6,
                                temperature=1.0, seed=2)
  for conv, p, obs in zip(convs, prompts, observations):
    assert conv.loss_mask == (0,) * len(p) + (1,) * 5 + (0,) * len(obs) + (1,) * 6
    assert conv.tokens[:len(p)] == tuple(p)
    assert conv.tokens[len(p) + 5:len(p) + 5 + len(obs)] == tuple(obs)
    assert conv.finish_reason == "length"
  # The second turn was prefilled from the whole conversation: its behaviour log-probs are
  # the model's log-probs of the full sequence at the masked positions.
  recomputed = token_logprobs(model, [list(c.tokens) for c in convs])
  for conv, logp in zip(convs, recomputed):
    mask = np.asarray(conv.loss_mask, bool)
    np.testing.assert_allclose(np.asarray(conv.logprobs)[mask], logp[mask[1:]], atol=1e-4)
    np.testing.assert_array_equal(np.asarray(conv.logprobs)[~mask], 0.0)


def test_stop_token_ends_the_turn(sampler):
  conv = Transcript.from_prompt(PROMPTS[0])
  first = continue_conversation(sampler, [conv], max_new_tokens=4, temperature=0.0)[0]
  stop = first.tokens[len(PROMPTS[0])]
  again = continue_conversation(sampler, [conv], max_new_tokens=4, temperature=0.0,
                                stop_token_ids=(stop,))[0]
  assert again.tokens == tuple(PROMPTS[0]) + (stop,)
  assert again.loss_mask[-1] == 1 and again.finish_reason == "stop"


def test_mismatched_observations_raise(sampler):
  convs = [Transcript.from_prompt([1, 2])] * 2
  with pytest.raises(ValueError, match="1 observations for 2 transcripts"):
    continue_conversation(sampler, convs, observations=[[3]], max_new_tokens=2)
