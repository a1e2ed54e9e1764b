"""RolloutWorker: groups of scored samples; with several processes each scores its share
and runs its share of the tool steps."""
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pytest

from posttrain import models
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rollout import worker as worker_lib
from posttrain.sampling import Sampler
from posttrain.tasks import Reward, StepResult

PAIRS = [("arithmetic/add_d1", 3), ("arithmetic/mod_d2", 4), ("arithmetic/add_d3", 5)]
CFG = models.get_preset("tiny", vocab_size=ByteTokenizer().vocab_size)
MAX_LEN = 256  # the sampler's


def _fake_score(calls):
  """A reward that depends on the text, so a reward landing on the wrong sample shows."""
  lock = threading.Lock()

  def score(task, sample):
    with lock:
      calls.append(sample.text)
    n = len(sample.text)
    return Reward(value=(n % 7) / 7, components={"chars": float(n)}, verdict=f"{n} chars")
  return score


class _ThreadExchange:
  """allgather between threads standing in for processes."""

  def __init__(self, n):
    self.barrier, self.slots = threading.Barrier(n, timeout=300), [None] * n

  def for_process(self, i):
    def exchange(obj):
      self.slots[i] = obj
      self.barrier.wait()
      out = list(self.slots)
      self.barrier.wait()
      return out
    return exchange


def _worker(**kw):
  sampler = Sampler(models.create_model(CFG, seed=0), max_len=MAX_LEN)
  return worker_lib.RolloutWorker(sampler, ByteTokenizer(), group_size=2, max_new_tokens=12,
                                  temperature=1.0, **{"chunk_rows": 4, **kw})


def _as_two_processes(fn, **kw):
  """Two workers as processes 0 and 1 of 2 (threads sharing an exchange) each run fn."""
  exchange = _ThreadExchange(2)
  workers = [_worker(process=(i, 2), exchange=exchange.for_process(i), **kw) for i in range(2)]
  results = [None, None]

  def run(i):
    results[i] = fn(workers[i])

  threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=600)
  return workers, results


def _rewards(groups):
  return [(s.text, s.reward) for g in groups for s in g.samples]


def test_two_processes_score_half_each_and_agree_with_one(monkeypatch):
  calls = []
  monkeypatch.setattr(worker_lib, "_score", _fake_score(calls))
  single = _worker(process=(0, 1))
  want = _rewards(single.rollout(PAIRS, seed=7))
  assert single.last_stats["scored_fraction"] == 1.0 and len(calls) == 6
  assert len({r.value for _, r in want}) > 1  # the texts differ, so do the rewards

  calls.clear()
  workers, results = _as_two_processes(lambda w: _rewards(w.rollout(PAIRS, seed=7)))
  assert results[0] == results[1] == want
  assert len(calls) == 6  # every sample scored exactly once, by one of the two
  assert [w.last_stats["scored_fraction"] for w in workers] == [0.5, 0.5]


def test_continuous_batching_draws_what_the_chunks_draw_and_scores_every_row(monkeypatch):
  """Continuous batching is a throughput switch: every row streams through 2 cache rows
  in one sampler call and draws what chunks of 2 rows draw (rows keyed by their index in
  the rollout), each sample scored exactly once with its own text."""
  calls = []
  monkeypatch.setattr(worker_lib, "_score", _fake_score(calls))
  stream = _worker(chunk_rows=2)
  seen = []
  real = stream.sampler.generate
  monkeypatch.setattr(stream.sampler, "generate",
                      lambda *a, **k: (seen.append(k.get("slots")), real(*a, **k))[1])
  streamed = stream.rollout(PAIRS, seed=9)
  assert seen == [2]  # one call for all six rows, two at a time
  chunked = _worker(chunk_rows=2, continuous=False).rollout(PAIRS, seed=9)
  # The same tokens; log-probs to float32 rounding (a row's prefill runs in another batch).
  for (tokens, logprobs, *rest), (want, want_logprobs, *want_rest) in zip(
      _samples(streamed), _samples(chunked), strict=True):
    assert (tokens, rest) == (want, want_rest)
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
  assert _rewards(streamed) == _rewards(chunked)
  assert sorted(calls) == sorted([s.text for g in streamed for s in g.samples] * 2)
  for g in streamed:
    for s in g.samples:
      assert s.reward.verdict == f"{len(s.text)} chars" and s.turns == 1
      assert s.response_mask == [1] * len(s.response_tokens) and s.versions == [0]
  assert 0 < stream.last_stats["decode_occupancy"] <= 1


def test_streamed_rollout_lets_the_learner_swap_weights_between_rounds(monkeypatch):
  """A streamed rollout with a lock lets go of it between rounds of at most
  segment_tokens steps. A learner waiting on the lock gets it at the first round's end
  and swaps in new weights: rows prefilled after it draw what a rollout under the new
  weights draws, rows decoding through it record both versions, and the next rounds go
  on (the worker takes the lock back)."""
  monkeypatch.setattr(worker_lib, "_score", _fake_score([]))
  lock, version = worker_lib.FairLock(), [0]
  worker = _worker(chunk_rows=2, segment_tokens=3, lock=lock, version_fn=lambda: version[0])
  sampler, new_model = worker.sampler, models.create_model(CFG, seed=1)
  real, learner, calls = sampler.generate, [], []

  def sync():  # the learner's Trainer.sync_weights
    with lock:
      sampler.update_params(new_model)
      version[0] = 1

  def generate(*a, **k):  # the learner comes to sync while the rollout holds the lock
    calls.append(k.get("round_steps"))
    learner.append(threading.Thread(target=sync))
    learner[0].start()
    while lock.waiting < 1:
      time.sleep(0.001)
    return real(*a, **k)

  monkeypatch.setattr(sampler, "generate", generate)
  groups = worker.rollout(PAIRS, seed=9)
  learner[0].join()
  assert calls == [3] and worker.last_stats["weight_swaps"] == 1.0
  spans = [s.versions for g in groups for s in g.samples]
  assert all(v in ([0], [1], [0, 1]) for v in spans), spans
  assert [0, 1] in spans and [1] in spans
  fresh = _worker(chunk_rows=2)
  fresh.sampler.update_params(new_model)
  for got, want in zip(_samples(groups), _samples(fresh.rollout(PAIRS, seed=9)), strict=True):
    if got[3] == [1]:
      assert (got[0], got[2]) == (want[0], want[2])  # tokens, finish reason
      np.testing.assert_allclose(got[1], want[1], atol=1e-5)


def test_fair_lock_goes_to_the_waiting_thread_first():
  """The holder that lets go and takes the lock back queues behind a waiting thread
  (threading.Lock may hand it straight back to the holder)."""
  lock, order = worker_lib.FairLock(), []
  lock.acquire()
  waiter = threading.Thread(target=lambda: (lock.acquire(), order.append("waiter"),
                                            lock.release()))
  waiter.start()
  while lock.waiting < 1:
    time.sleep(0.001)
  lock.release()
  lock.acquire()
  order.append("holder")
  lock.release()
  waiter.join()
  assert order == ["waiter", "holder"]
  with pytest.raises(RuntimeError, match="release of an unheld FairLock"):
    lock.release()


def test_bad_process_layout_is_a_clear_error():
  with pytest.raises(ValueError, match="process index 2 is out of range for 2 processes"):
    _worker(process=(2, 2))


def _fake_step(calls):
  """A tool environment: two tool calls per sample, the observation depends on the text."""
  lock = threading.Lock()

  def step(task, text):
    with lock:
      calls.append(text)
    if text.count("\n=") >= 2:
      return StepResult(observation=None, done=True)
    return StepResult(observation=f"={len(text)}", done=False)
  return step


TOOL_PAIRS = [("tools/calc_l1", 3), ("tools/calc_l1", 5), ("arithmetic/add_d1", 7)]


def _transcripts(groups):
  return [(s.text, s.tool_calls, s.turns, s.response_mask, s.reward) for g in groups
          for s in g.samples]


def test_two_processes_split_the_tool_steps_and_continue_identically(monkeypatch):
  calls = []
  monkeypatch.setattr(worker_lib, "_score", _fake_score([]))
  monkeypatch.setattr(worker_lib, "_step", _fake_step(calls))
  single = _worker(process=(0, 1), max_turns=4)
  want = _transcripts(single.rollout(TOOL_PAIRS, seed=3))
  # Only the tools domain steps: 4 samples x (2 tool calls + the final done check).
  assert len(calls) == 12 and single.last_stats["tool_step_fraction"] == 1.0
  assert [t[1] for t in want] == [2, 2, 2, 2, 0, 0]
  assert [t[2] for t in want] == [3, 3, 3, 3, 1, 1]
  assert all("\n=" in t[0] for t in want[:4])
  # Observation tokens are not the model's: masked out of the loss.
  assert all(0 in t[3] for t in want[:4]) and all(set(t[3]) == {1} for t in want[4:])

  calls.clear()
  workers, results = _as_two_processes(
      lambda w: _transcripts(w.rollout(TOOL_PAIRS, seed=3)), max_turns=4)
  assert results[0] == results[1] == want
  assert len(calls) == 12  # every step ran once, on one of the two processes
  assert [w.last_stats["tool_step_fraction"] for w in workers] == [0.5, 0.5]


@pytest.mark.parametrize("chunk_rows", [2, 8])
def test_multi_turn_rows_stream_their_turns_through_one_sampler_call(monkeypatch,
                                                                      chunk_rows):
  """Multi-turn rows stream too (through 2 cache rows, or 8: a row for each): a row
  whose turn ended goes to the environment between rounds and its transcript (tool
  answer included) comes back as its next turn, in the same sampler call. Each model
  token's behaviour log-prob is the model's given the whole transcript before it; tool
  tokens are masked out of the loss."""
  calls = []
  monkeypatch.setattr(worker_lib, "_score", _fake_score([]))
  monkeypatch.setattr(worker_lib, "_step", _fake_step(calls))
  worker = _worker(max_turns=4, chunk_rows=chunk_rows)
  real, seen = worker.sampler.generate, []
  monkeypatch.setattr(worker.sampler, "generate",
                      lambda *a, **k: (seen.append(len(a[0])), real(*a, **k))[1])
  groups = worker.rollout(TOOL_PAIRS, seed=3)
  assert seen == [6]  # one call: the 8 later turns were returned between rounds
  samples = [s for g in groups for s in g.samples]
  assert [s.tool_calls for s in samples] == [2, 2, 2, 2, 0, 0]
  assert [s.turns for s in samples] == [3, 3, 3, 3, 1, 1] and len(calls) == 12
  model = models.create_model(CFG, seed=0)
  for s in samples:
    mask = np.asarray(s.response_mask, bool)
    assert len(mask) == len(s.response_tokens) == len(s.behaviour_logprobs)
    assert mask.all() == (s.tool_calls == 0)
    want = np.asarray(_recomputed_logprobs(model, s))
    np.testing.assert_allclose(np.asarray(s.behaviour_logprobs)[mask], want[mask], atol=2e-4)
    assert not np.asarray(s.behaviour_logprobs)[~mask].any()
  assert 0 < worker.last_stats["decode_occupancy"] <= 1
  # Each next turn went on in its row's slot: the transcript up to the turn's last token
  # came from the cache, only that token and the tool's answer were prefilled.
  reused = total = 0
  for s in samples:
    mask = s.response_mask
    for a in range(1, len(mask)):
      if mask[a - 1] and not mask[a]:  # a tool's answer starts at a
        e = a + mask[a:].index(1) if 1 in mask[a:] else len(mask)
        reused += len(s.prompt_tokens) + a - 1
        total += len(s.prompt_tokens) + e
  assert worker.last_stats["reused_prefix_fraction"] == pytest.approx(reused / total)


def _samples(groups):
  return [(s.response_tokens, s.behaviour_logprobs, s.finish_reason, s.versions)
          for g in groups for s in g.samples]


def test_segments_under_unchanged_weights_resume_and_equal_one_call(monkeypatch):
  """Partial rollouts (segment_tokens) with no weight change in between: every continued
  segment resumes from the kept KV cache and the samples are exactly those of one
  uninterrupted call per chunk (tokens, behaviour log-probs, finish reasons)."""
  monkeypatch.setattr(worker_lib, "_score", _fake_score([]))
  whole = _worker(continuous=False).rollout(PAIRS, seed=5)
  segmented = _worker(segment_tokens=5, continuous=False)
  calls = {"generate": 0, "resume": 0}
  for name in calls:
    real = getattr(segmented.sampler, name)
    monkeypatch.setattr(segmented.sampler, name,
                        lambda *a, _real=real, _name=name, **k: (
                            calls.__setitem__(_name, calls[_name] + 1), _real(*a, **k))[1])
  groups = segmented.rollout(PAIRS, seed=5)
  assert [(t, lp, f) for t, lp, f, _ in _samples(groups)] == [
      (t, lp, f) for t, lp, f, _ in _samples(whole)]
  # 6 rows in chunks of 4 and 2, 12 tokens in segments of 5: 1 generate + up to 2 resumes.
  assert calls["generate"] == 2 and calls["resume"] >= 2
  assert segmented.last_stats["resumed_fraction"] == 1.0


def test_segments_after_a_weight_change_prefill_again_under_the_new_weights(monkeypatch):
  """When the weights change between two segments the kept cache is stale: the next
  segment prefills prompt + response again under the new weights, and each sample
  records the policy version of every segment it spans."""
  monkeypatch.setattr(worker_lib, "_score", _fake_score([]))
  version = [0]
  worker = _worker(segment_tokens=4, version_fn=lambda: version[0], chunk_rows=8)
  sampler = worker.sampler
  real_generate, real_resume = sampler.generate, sampler.resume
  calls = []

  def new_weights_after(result):
    version[0] += 1
    sampler.update_params(models.create_model(CFG, seed=version[0]))  # the learner
    return result

  monkeypatch.setattr(sampler, "generate", lambda *a, **k: (
      calls.append("generate"), new_weights_after(real_generate(*a, **k)))[1])
  monkeypatch.setattr(sampler, "resume", lambda *a, **k: (
      calls.append("resume"), real_resume(*a, **k))[1])
  groups = worker.rollout(PAIRS, seed=5)
  assert "resume" not in calls and calls.count("generate") >= 2
  assert worker.last_stats["resumed_fraction"] == 0.0
  for _, logprobs, _, versions in _samples(groups):
    assert versions[0] == 0 and versions == sorted(versions)
  assert any(len(v) > 1 and v[-1] > v[0] for *_, v in _samples(groups))


@functools.partial(jax.jit, static_argnums=0)
def _forward_logprobs(graphdef, state, tokens_1xT):
  logits = nnx.merge(graphdef, state)(tokens_1xT)[0]
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _recomputed_logprobs(model, sample):
  """log p(token | prefix) of each response token under `model`, without a cache: one
  causal forward over the sequence right-padded to the sampler's max_len (one compile)."""
  seq = sample.prompt_tokens + sample.response_tokens
  tokens = np.zeros((1, MAX_LEN), np.int32)
  tokens[0, :len(seq)] = seq
  logp = np.asarray(_forward_logprobs(*nnx.split(model), tokens))
  n = len(sample.prompt_tokens)
  return [float(logp[n - 1 + t, tok]) for t, tok in enumerate(sample.response_tokens)]


def test_token_budget_carries_unfinished_groups_to_later_calls(monkeypatch):
  """Partial rollouts across steps: each call generates at most 4 tokens per row; a
  group comes back only when all its samples have ended, carried groups continue first
  (under the weights of that call, which each token's behaviour log-prob and the
  sample's versions record) and no group is lost or returned twice."""
  calls = []
  monkeypatch.setattr(worker_lib, "_score", _fake_score(calls))
  version = [0]
  worker = _worker(version_fn=lambda: version[0])
  models_by_version = {0: models.create_model(CFG, seed=0)}
  returned = []
  for step, pairs in enumerate([PAIRS[:2], PAIRS[2:], [], []]):
    groups = worker.rollout(pairs, seed=step, policy_version=step, token_budget=5)
    returned += groups
    for g in groups:
      assert all(s.turns == 1 and s.reward is not None for s in g.samples)
    # After each call: rows still in flight have generated exactly 5 more tokens.
    for *_, samples in worker._carry:
      assert all(len(s.response_tokens) in (5, 10) for s in samples if not s.turns)
    assert worker.last_stats["carried_groups"] == worker.carried
    version[0] += 1
    models_by_version[version[0]] = models.create_model(CFG, seed=version[0])
    worker.sampler.update_params(models_by_version[version[0]])
  # 12 new tokens in calls of 5: a random policy rarely stops, so groups take 3 calls.
  assert worker.carried == 0
  assert sorted((g.domain, g.seed) for g in returned) == sorted(PAIRS)
  assert len(calls) == 2 * len(PAIRS)  # every sample scored exactly once
  assert [g.policy_version for g in returned][:2] == [2, 2]
  for g in returned:
    for s in g.samples:
      assert 1 <= len(s.response_tokens) <= 12 and len(s.versions) in (1, 2, 3)
      assert s.versions == sorted(s.versions)
      # Each call's tokens were drawn from the weights of that call.
      start = 0
      for v in s.versions:
        want = _recomputed_logprobs(models_by_version[v], s)
        n = min(5, len(s.response_tokens) - start)
        np.testing.assert_allclose(s.behaviour_logprobs[start:start + n],
                                   want[start:start + n], atol=2e-4)
        start += n


def test_token_budget_needs_single_turn_domains():
  worker = _worker(max_turns=2)
  with pytest.raises(ValueError, match="need max_turns=1"):
    worker.rollout(PAIRS, seed=0, token_budget=4)


MOE_CFG = CFG.replace(num_layers=2, num_experts=4, num_experts_per_tok=2, ffn_dim=32)


@pytest.mark.parametrize("how", ["stream", "chunks", "segments"])
def test_a_recording_sampler_gives_each_sample_its_transcripts_routing(monkeypatch, how):
  """With a sampler that records routing (routing replay from the rollout), each sample
  holds the experts of the transcript's tokens the sampler fed: multi-turn rows through
  their turns (tool answers included), streamed or in chunks, or paused every 5 tokens
  and resumed from the kept cache. They are those a forward of the transcript chooses,
  and they reach the packed trajectories."""
  monkeypatch.setattr(worker_lib, "_score", _fake_score([]))
  monkeypatch.setattr(worker_lib, "_step", _fake_step([]))
  model = models.create_model(MOE_CFG, seed=0)
  sampler = Sampler(model, max_len=MAX_LEN, record_routing=True)
  resumes = []
  real = sampler.resume
  monkeypatch.setattr(sampler, "resume", lambda *a, **k: (resumes.append(1), real(*a, **k))[1])
  worker = worker_lib.RolloutWorker(sampler, ByteTokenizer(), group_size=2, max_new_tokens=12,
                                    temperature=1.0, chunk_rows=2, max_turns=3,
                                    continuous=how == "stream",
                                    segment_tokens=5 if how == "segments" else 0)
  groups = worker.rollout(TOOL_PAIRS, seed=3)
  samples = [s for g in groups for s in g.samples]
  assert any(s.tool_calls for s in samples)
  assert bool(resumes) == (how == "segments")
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda t: nnx.merge(graphdef, state).hidden_states(
      t, return_routing=True)[1])
  for s in samples:
    seq = s.prompt_tokens + s.response_tokens
    # Everything but the last token; a last tool answer that no turn read is not fed.
    last_model = max(i for i, m in enumerate(s.response_mask) if m)
    assert len(s.prompt_tokens) + last_model <= len(s.routing) <= len(seq) - 1
    want = np.asarray(forward(jnp.asarray([seq[:len(s.routing)]])))[0]
    np.testing.assert_array_equal(s.routing, want)
  trajectories = worker_lib.group_to_trajectories(groups[0], [1.0] * len(groups[0].samples))
  np.testing.assert_array_equal(trajectories[0]["routing"], groups[0].samples[0].routing)
