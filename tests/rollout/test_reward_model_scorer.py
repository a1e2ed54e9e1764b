"""TransformerRewardModel: device scores of (prompt, completion) texts equal the value head
at the last token of each conversation, whatever the batching, padding and mesh; and the
rule that mixes them with a verifier."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain import models
from posttrain.data.preference import encode_pair
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rollout.reward_model import TransformerRewardModel, conversation_tokens
from posttrain.tasks import Reward
from posttrain.tasks.reward_model import mix_rewards, verifier_value

TOK = ByteTokenizer()
CFG = models.get_preset("tiny", vocab_size=TOK.vocab_size, num_layers=2, d_model=40,
                        num_heads=4, num_kv_heads=2, head_dim=10, ffn_dim=56, value_head=True,
                        lm_head=False)
# Prompts and completions of different lengths, not in length order.
PROMPTS = ["What is 3 + 4?", "x", "Sort these words: pear apple fig banana cherry kiwi.",
           "Count the vowels in 'education'.", "hi", "Reverse 'abcdefghij'."]
COMPLETIONS = ["<answer>7</answer>", "", "apple banana cherry fig kiwi pear " * 3, "5",
               "hello there, how are you doing today?", "jihgfedcba"]


@pytest.fixture(scope="module")
def model():
  m = models.create_model(CFG, seed=3)
  # A head that spreads the scores (the default init gives all of them about 0).
  m.value_w[...] = jax.random.normal(jax.random.key(7), (CFG.d_model,), jnp.float32)
  m.value_b[...] = jnp.float32(0.25)
  return m


def _by_hand(model, prompts, completions, max_lens=None):
  """The value head at the last trained token of each encoded conversation, run without
  packing. The sequences are right-padded to one length for one call; under causal
  attention nothing after a token changes its value."""
  seqs = []
  for prompt, completion, max_len in zip(prompts, completions,
                                         max_lens or [None] * len(prompts)):
    ids, mask = TOK.encode_chat([{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": completion}])
    seqs.append(ids[:int(np.flatnonzero(mask)[-1]) + 1][:max_len])
  tokens = np.zeros((len(seqs), max(len(seq) for seq in seqs)), np.int32)
  for i, seq in enumerate(seqs):
    tokens[i, :len(seq)] = seq
  values = np.asarray(_values(model, jnp.asarray(tokens)))
  return [float(values[i, len(seq) - 1]) for i, seq in enumerate(seqs)]


@nnx.jit
def _values(model, tokens_BxT):
  return model.values(tokens_BxT)


def test_the_scored_tokens_are_a_preference_pairs_answer_layout():
  for p, c in zip(PROMPTS, COMPLETIONS):
    pair = encode_pair([{"role": "user", "content": p}], [{"role": "assistant", "content": c}],
                       [{"role": "assistant", "content": "other"}], TOK)
    want = np.concatenate([pair["prompt_tokens"], pair["chosen_tokens"]]).tolist()
    assert conversation_tokens(TOK, p, c) == want
    assert want[-1] == TOK.chat.end_of_turn[-1]


def test_a_chat_prompt_is_scored_with_its_messages():
  """A task's chat prompt (system and earlier turns) reaches the reward model whole."""
  messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "1+1?"},
              {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2?"}]
  ids, mask = TOK.encode_chat(messages + [{"role": "assistant", "content": "4"}])
  want = ids[:int(np.flatnonzero(mask)[-1]) + 1]
  assert conversation_tokens(TOK, messages, "4") == want
  assert conversation_tokens(TOK, "2+2?", "4") == conversation_tokens(TOK, messages[3:], "4")


def test_scores_are_the_value_at_the_last_token_in_input_order(model):
  rm = TransformerRewardModel(model, TOK, max_len=256, batch_size=4)
  got = rm.score_texts(PROMPTS, COMPLETIONS)
  want = _by_hand(model, PROMPTS, COMPLETIONS)
  assert all(isinstance(x, float) for x in got)
  np.testing.assert_allclose(got, want, atol=2e-5)
  assert np.std(want) > 0.1  # distinct scores: a mix-up of rows would show
  assert rm.last_stats["rows"] == len(PROMPTS) and rm.last_stats["truncated"] == 0


def test_a_mixed_batch_equals_each_row_scored_alone(model):
  rm = TransformerRewardModel(model, TOK, max_len=256, batch_size=8)
  together = rm.score_texts(PROMPTS, COMPLETIONS)
  alone = [rm.score_texts([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS)]
  np.testing.assert_allclose(together, alone, atol=2e-5)
  assert rm.score_texts([], []) == []


def test_buckets_pad_lengths_and_batches_and_compile_once_per_shape(model):
  rm = TransformerRewardModel(model, TOK, max_len=64, batch_size=2)
  # Two rows of 10 and 20 tokens: one program of 2 rows x 24 (16, 24, 32, 48, 64).
  rm.score_tokens([[1] * 10, [2] * 20])
  assert rm.num_compiles == 1
  assert rm.last_stats["padding_fraction"] == pytest.approx(1 - 30 / 48)
  rm.score_tokens([[3] * 12, [4] * 17])  # the same bucket: no new program
  assert rm.num_compiles == 1
  rm.score_tokens([[5] * 40])  # 1 row x 48
  assert rm.num_compiles == 2


def test_truncation_keeps_the_head_and_is_counted(model):
  rm = TransformerRewardModel(model, TOK, max_len=24, batch_size=4)
  long_c, short_c = "a long answer that runs past the limit " * 2, "ok"
  got = rm.score_texts(["p", "q"], [long_c, short_c])
  assert len(conversation_tokens(TOK, "p", long_c)) > 24
  assert len(conversation_tokens(TOK, "q", short_c)) <= 24
  np.testing.assert_allclose(got, _by_hand(model, ["p", "q"], [long_c, short_c], [24, None]),
                             atol=2e-5)
  assert rm.last_stats["truncated"] == 1 and rm.last_stats["rows"] == 2


@pytest.mark.parametrize("shape", [(1, 8, 1, 1), (2, 2, 2, 1)])
def test_a_mesh_of_eight_devices_equals_one_device(model, shape):
  single = TransformerRewardModel(model, TOK, max_len=128, batch_size=4)
  mesh = models.make_mesh(shape)
  meshed = TransformerRewardModel(model, TOK, mesh=mesh, max_len=128, batch_size=3)
  batch_devices = shape[0] * shape[1]
  assert meshed.batch_size % batch_devices == 0
  state = meshed._state["layers"][0]["attn"]["q_proj"][...]
  assert len(state.sharding.device_set) == 8
  np.testing.assert_allclose(meshed.score_texts(PROMPTS, COMPLETIONS),
                             single.score_texts(PROMPTS, COMPLETIONS), atol=2e-5)


def test_refuses_a_model_without_a_value_head_or_a_larger_vocabulary():
  with pytest.raises(ValueError, match="no value head"):
    TransformerRewardModel(models.create_model(CFG.replace(value_head=False, lm_head=True)),
                           TOK)
  with pytest.raises(ValueError, match="vocabulary of 100"):
    TransformerRewardModel(models.create_model(CFG.replace(vocab_size=100)), TOK)


# -- mixing -----------------------------------------------------------------------------


VERIFIED = [Reward(1.0, {"exact": 1.0}, "right"), Reward(0.0, {"exact": 0.0}, "wrong"),
            Reward(0.5, {"partial": 0.5}, "half")]


@pytest.mark.parametrize("mix", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("squash", ["clip", "sigmoid"])
def test_mix_rewards(mix, squash):
  scores = [0.3, 2.0, -1.0]
  out = mix_rewards(VERIFIED, scores, mix, squash)
  for r, v, s in zip(out, VERIFIED, scores):
    model = min(1.0, max(0.0, s)) if squash == "clip" else 1 / (1 + math.exp(-s))
    assert r.value == pytest.approx((1 - mix) * v.value + mix * model)
    assert r.components["model"] == pytest.approx(model)
    assert r.components["verifier"] == v.value and verifier_value(r) == v.value
    assert {k: r.components[k] for k in v.components} == v.components
    assert r.verdict == v.verdict


def test_a_non_finite_score_gives_the_verifier_value():
  out = mix_rewards(VERIFIED[:2], [float("nan"), float("inf")], 0.5, "sigmoid")
  assert [r.value for r in out] == [1.0, 0.0]
  assert all("model" not in r.components for r in out)
  assert "reward model gave nan" in out[0].verdict and "gave inf" in out[1].verdict


def test_mixing_twice_keeps_the_first_verifier_value():
  once = mix_rewards(VERIFIED, [0.0, 0.0, 0.0], 0.5, "clip")
  twice = mix_rewards(once, [1.0, 1.0, 1.0], 0.5, "clip")
  assert [verifier_value(r) for r in twice] == [1.0, 0.0, 0.5]
  assert [r.value for r in twice] == pytest.approx([0.75, 0.5, 0.625])


@pytest.mark.parametrize("args, message", [
    ((VERIFIED, [0.0] * 3, 1.5, "clip"), r"mix must be in \[0, 1\]"),
    ((VERIFIED, [0.0] * 3, 0.5, "tanh"), "squash must be one of"),
    ((VERIFIED, [0.0] * 2, 0.5, "clip"), "got 2 scores for 3 rewards"),
])
def test_mix_rewards_errors(args, message):
  with pytest.raises(ValueError, match=message):
    mix_rewards(*args)


@settings(max_examples=200, deadline=None)
@given(verifier=st.floats(0, 1), score=st.floats(allow_nan=False, allow_infinity=False),
       mix=st.floats(0, 1), squash=st.sampled_from(["clip", "sigmoid"]))
def test_a_mixed_value_lies_between_the_verifier_and_the_squashed_score(verifier, score, mix,
                                                                       squash):
  (r,) = mix_rewards([Reward(verifier, {}, "")], [score], mix, squash)
  low, high = sorted((verifier, r.components["model"]))
  assert 0.0 <= r.components["model"] <= 1.0
  assert low - 1e-12 <= r.value <= high + 1e-12
