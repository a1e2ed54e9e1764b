"""Host-side rollouts: task -> chat prompt -> samples -> rewards -> trajectory groups.

Generation runs on the devices; scoring (pure Python, or the sandbox for code) runs on a
thread pool. Single-turn rollouts are continuously batched: every row streams through the
sampler's cache rows in one call and is scored as soon as it stops, while the others
decode. Otherwise rows run in chunks, and chunk i is scored while chunk i+1 is generated.
Multi-turn domains (those with `step(task, transcript)`) get their observations appended
as tool turns, whose tokens are masked out of the loss.

With several processes (one per host) every process holds every completion (the sampler
gathers them); each process scores only the samples i with i % num_processes ==
process_index, on its own host's threads and sandbox, and the rewards are then exchanged
so that every process builds the same batch.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from posttrain import distributed
from posttrain.data import reasoning as reasoning_lib
from posttrain.data.tokenizer import Tokenizer
from posttrain.tasks import Reward, StepResult, Task, registry
from posttrain.tasks.families.tools import OBS_CLOSE, OBS_OPEN, native_call_text

# How multi-turn domains' tools are called: "text", the domain's own protocol in the
# prompt; "native", the model's own format (its chat template's tool schemas and calls,
# translated to and from the domain's protocol; Qwen's ChatML, Llama 3.1+, harmony).
TOOL_FORMATS = ("text", "native")


@dataclasses.dataclass
class Sample:
  """One completion of one prompt.

  response_tokens holds everything after the prompt (model turns and, in multi-turn
  domains, tool observations); response_mask is 1 on the model's own tokens.

  text is what the domain scores: each model turn's content (its reasoning left out, as
  the worker's `reasoning` reads it) and, between turns, the tools' answers. reasoning: the
  turns' reasoning; reasoning_tokens: the tokens it took; reasoning_closed: False when the
  last turn was still reasoning at its last token (it has no content).
  """

  prompt_tokens: list[int]
  response_tokens: list[int]
  response_mask: list[int]
  behaviour_logprobs: list[float]
  text: str
  finish_reason: str
  reward: Reward | None = None
  tool_calls: int = 0
  turns: int = 1
  versions: list[int] = dataclasses.field(default_factory=list)
  reasoning: str = ""
  reasoning_tokens: int = 0
  reasoning_closed: bool = True
  # Where the model turn being generated began in response_tokens (it is read once whole).
  turn_start: int = dataclasses.field(default=0, repr=False)
  # The function the last model turn called as a message of its own (harmony's native
  # calls), which the tool's answer names; None where the format's calls are text.
  called: str | None = dataclasses.field(default=None, repr=False)
  # A sampler that records routing (routing replay): the experts its mixture layers chose
  # for the transcript's tokens it fed, [tokens, layers, k] (`Completions.routing`).
  routing: np.ndarray | None = dataclasses.field(default=None, repr=False)

  @property
  def oldest_version(self) -> int:
    return min(self.versions) if self.versions else 0

  @property
  def num_generated(self) -> int:
    return int(sum(self.response_mask))


@dataclasses.dataclass
class TrajectoryGroup:
  """group_size samples of one task, with the policy version that produced them.

  baseline: ReMax's greedy completion of the same prompt by the rollout policy, scored
  like the samples; its reward is the samples' baseline, and it is never trained on (None
  for the other estimators).
  """

  domain: str
  seed: int
  task: Task
  samples: list[Sample]
  policy_version: int
  baseline: Sample | None = None

  @property
  def rewards(self) -> np.ndarray:
    return np.asarray([s.reward.value if s.reward else 0.0 for s in self.samples], np.float64)


class RolloutWorker:
  """Turns scheduler draws into scored TrajectoryGroups with a Sampler.

  Args:
    sampler: a posttrain.sampling.Sampler.
    tokenizer: builds chat prompts and decodes completions.
    group_size: samples per task.
    max_new_tokens: generation budget per model turn.
    temperature, top_p, top_k: sampling settings.
    chunk_rows: rows the sampler decodes at once (the KV cache's rows).
    continuous: rollouts of more rows than `chunk_rows` stream every row through
      `chunk_rows` cache rows in one sampler call (continuous batching): a row that stops
      hands its cache row to the next, and is scored while the others decode. Between
      two rounds of decode steps (at most `segment_tokens` steps each, when set) the
      environment answers the rows whose turn ended (multi-turn domains; the answered
      transcript is the row's next turn, prefilled ahead of the waiting prompts) and the
      sampler lock is released, so new weights land mid-rollout: the rows that follow
      are prefilled under them and the live rows go on under them. Otherwise (False, or
      rows that fit `chunk_rows`, single-turn without segments apart) the rows run in
      chunks of `chunk_rows`, each chunk as long as its longest row, scored while the
      next chunk generates.
    scoring_threads: threads that score (and run sandboxes) concurrently.
    max_turns: model turns per sample for multi-turn domains.
    system_prompt: optional system message.
    segment_tokens: generate at most this many tokens per sampler call, releasing the
      sampler lock between calls so weights can change mid-generation (partial rollouts);
      0 = the whole turn in one call.
    lock: guards the sampler against a concurrent `update_params` (disaggregated runs);
      a `FairLock`, so the learner waiting on it gets it whenever the worker lets go.
    version_fn: returns the policy version the sampler currently holds.
    process: (index, count) of this process among those sharing the scoring (default:
      `jax.process_index()`, `jax.process_count()`).
    exchange: gathers one JSON-able object from every process, in process order (default:
      `distributed.allgather_json`, through the coordination service); only called with
      several processes.
  """

  _instances = 0  # Workers are built in the same order on every process: tags match.

  def __init__(self, sampler, tokenizer: Tokenizer, *, group_size: int, max_new_tokens: int,
               temperature: float = 1.0, top_p: float | None = None, top_k: int | None = None,
               chunk_rows: int = 64, scoring_threads: int = 4, max_turns: int = 1,
               system_prompt: str | None = None, segment_tokens: int = 0, lock=None,
               version_fn=None, process: tuple[int, int] | None = None,
               exchange: Callable[[Any], list[Any]] | None = None, continuous: bool = True,
               reasoning: str = "auto", thinking: bool | str | None = None,
               tool_format: str = "text"):
    self.sampler, self.tok = sampler, tokenizer
    if tool_format not in TOOL_FORMATS:
      raise ValueError(f"tool_format={tool_format!r}; expected one of {TOOL_FORMATS}")
    if tool_format == "native":
      tokenizer.chat.check_tools([{}])  # here, not at the first multi-turn rollout
    self.tool_format = tool_format
    if reasoning not in reasoning_lib.MODES:
      raise ValueError(f"reasoning={reasoning!r}; expected one of {reasoning_lib.MODES}")
    self.reasoning, self.thinking = reasoning, thinking
    tokenizer.chat.check_thinking(thinking)  # here, not at the first rollout
    self.group_size, self.max_new_tokens = int(group_size), int(max_new_tokens)
    self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
    self.chunk_rows, self.max_turns = max(int(chunk_rows), 1), max(int(max_turns), 1)
    self.system_prompt = system_prompt
    self.segment_tokens = max(int(segment_tokens), 0)
    self.continuous = bool(continuous)
    self._lock = lock if lock is not None else contextlib.nullcontext()
    self._shared = lock is not None  # another thread may swap the sampler's weights
    self._version_fn = version_fn or (lambda: 0)
    self.last_stats: dict[str, float] = {}
    self._tool_steps = [0, 0]  # environment steps run here, and in all, this rollout
    self._pool = cf.ThreadPoolExecutor(max_workers=max(1, scoring_threads),
                                       thread_name_prefix="score")
    if process is None:
      import jax
      process = (jax.process_index(), jax.process_count())
    self.process_index, self.process_count = (int(x) for x in process)
    if not 0 <= self.process_index < self.process_count:
      raise ValueError(f"process index {self.process_index} is out of range for "
                       f"{self.process_count} processes")
    self._exchange = exchange or self._store_exchange
    RolloutWorker._instances += 1
    self._tag = f"posttrain/rollout_worker_{RolloutWorker._instances}"
    self._exchanges = 0
    self._segments = [0, 0]  # continued segments: resumed from the kept cache, all
    self._decode_rows = [0, 0]  # tokens generated, row-steps decoded (slots x steps)
    self._swaps = 0  # weight swaps while a streamed rollout decoded
    self._reuse = [0, 0]  # later turns' prompt tokens: read from the KV cache, all
    # Partial rollouts across calls (rollout(..., token_budget=N)): groups with a sample
    # still generating, as (domain, seed, task, samples); they continue in the next call.
    self._carry: list[tuple[str, int, Task, list[Sample]]] = []

  def _store_exchange(self, obj: Any) -> list[Any]:
    self._exchanges += 1
    out = distributed.allgather_json(obj, f"{self._tag}/{self._exchanges}")
    # Every process has read exchange n-2 once this one is complete (each wrote its part
    # of n-1 only after reading all of n-2), so this process's key there can go.
    if self._exchanges > 2:
      distributed.delete_key(f"{self._tag}/{self._exchanges - 2}/{self.process_index}")
    return out

  def close(self):
    self._pool.shutdown(wait=True)

  def messages(self, task: Task) -> list[dict[str, str]]:
    return task_messages(task, self.system_prompt)

  def prompt_tokens(self, task: Task) -> list[int]:
    domain = registry.get(task.domain)
    if self.tool_format == "native" and hasattr(domain, "native_tools"):
      # The model calls the task's tools in its own format: their schemas in the prompt,
      # the question without the domain's text protocol.
      prompt, tools = domain.native_tools(task)
      messages = task_messages(dataclasses.replace(task, prompt=prompt), self.system_prompt)
      return self.tok.encode_chat(messages, add_generation_prompt=True,
                                  thinking=self.thinking, tools=tools)[0]
    return self.tok.encode_chat(self.messages(task), add_generation_prompt=True,
                                thinking=self.thinking)[0]

  @property
  def reads_reasoning(self) -> bool:
    """Whether completions are split into reasoning and content before scoring."""
    return self.reasoning == "think" or (self.reasoning == "auto"
                                         and self.tok.chat.reasoning is not None)

  def split(self, tokens: Sequence[int], prompt: Sequence[int] | None = None
            ) -> reasoning_lib.Response:
    """One model turn's content and reasoning (`reasoning`: auto, the tokenizer's chat
    format's reading, given the transcript before the turn, `prompt`; none, all content;
    think, <think> blocks in any tokenizer)."""
    if self.reasoning == "none":
      return reasoning_lib.split_plain(self.tok, tokens)
    if self.reasoning == "think":
      open_id, close_id = getattr(self.tok.chat, "think_ids", None) or (None, None)
      return reasoning_lib.split_think(self.tok, tokens, open_id=open_id, close_id=close_id)
    return self.tok.split_response(tokens, prompt)

  def _end_turn(self, sample: Sample) -> None:
    """Reads the model turn that just ended into the sample's text and reasoning."""
    if sample.turn_start >= len(sample.response_tokens):
      return  # read already (or the turn wrote nothing)
    r = self.split(sample.response_tokens[sample.turn_start:],
                   sample.prompt_tokens + sample.response_tokens[:sample.turn_start])
    sample.turn_start = len(sample.response_tokens)
    content = r.content
    if self.tool_format == "native":  # the model's own calls, as the domain reads calls
      for start, end, name, arguments in reversed(self.tok.chat.read_tool_calls(content)):
        content = content[:start] + native_call_text(name, arguments) + content[end:]
      # Calls written as messages of their own (harmony's) follow the turn's content.
      content += "".join(native_call_text(name, arguments) for name, arguments in r.calls)
      sample.called = r.calls[-1][0] if r.calls else None
    sample.text += content
    if r.reasoning:
      sample.reasoning += ("\n\n" if sample.reasoning else "") + r.reasoning
    sample.reasoning_tokens += r.reasoning_tokens
    sample.reasoning_closed = r.closed

  @property
  def carried(self) -> int:
    """Groups paused by the token budget of earlier `rollout` calls, still generating."""
    return len(self._carry)

  def drop_carried(self) -> int:
    """Discards the groups still in flight (partial rollouts with placement.partial=drop);
    returns how many."""
    n, self._carry = len(self._carry), []
    return n

  def rollout(self, pairs: Sequence[tuple[str, int]], *, seed: int, policy_version: int = 0,
              group_size: int | None = None, temperature: float | None = None,
              token_budget: int = 0) -> list[TrajectoryGroup]:
    """Samples and scores `group_size` completions for each (domain, seed) pair.

    With `token_budget` > 0 (partial rollouts, single-turn domains): every row generates
    at most that many tokens in this call. Groups whose samples have all ended are scored
    and returned; the others are kept (`carried`) and continue in the next call, under the
    sampler's weights of that call, ahead of that call's new pairs. A long straggler then
    holds back only its own group, not the step.
    """
    g = self.group_size if group_size is None else int(group_size)
    temp = self.temperature if temperature is None else temperature
    if token_budget:
      return self._rollout_partial(pairs, seed=seed, policy_version=policy_version, g=g,
                                   temperature=temp, budget=int(token_budget))
    tasks = [registry.get(d).sample(s) for d, s in pairs]
    rows = [(i, self.prompt_tokens(t)) for i, t in enumerate(tasks) for _ in range(g)]
    samples: list[Sample | None] = [None] * len(rows)
    futures: list[tuple[int, cf.Future]] = []
    mine = lambda idx: idx % self.process_count == self.process_index  # noqa: E731
    self._tool_steps = [0, 0]
    self._segments = [0, 0]
    self._decode_rows = [0, 0]
    self._swaps = 0
    self._reuse = [0, 0]
    room = self.sampler.max_len - max((len(p) for _, p in rows), default=0)
    # Rows that fit the cache at once run as one sampler call: without rounds (a chunk)
    # when single-turn, in rounds when later turns come back between them. Rows that fit
    # and pause every segment_tokens steps run as segments (`_chunks`).
    streams = len(rows) > self.sampler.slot_rows(self.chunk_rows)
    if rows and self.continuous and room >= 1 and (streams or not self.segment_tokens):
      self._stream(rows, tasks, samples, futures, mine, seed=seed * 1_000_003,
                   temperature=temp, max_new_tokens=min(self.max_new_tokens, room),
                   streams=streams)
    else:
      self._chunks(rows, tasks, samples, futures, mine, seed=seed, temperature=temp)
    # Scoring overlaps generation; what is left after the last row is the scoring stall.
    self._collect_rewards(samples, futures)
    groups = []
    for i, ((domain, s), task) in enumerate(zip(pairs, tasks)):
      groups.append(TrajectoryGroup(domain, s, task, samples[i * g:(i + 1) * g], policy_version))
    return groups

  def _stream(self, rows, tasks, samples, futures, mine, *, seed: int, temperature: float,
              max_new_tokens: int, streams: bool) -> None:
    """Generates every row in one continuously batched sampler call; each row is scored
    (on this process's share) as soon as its transcript ends, while the others decode.

    Multi-turn domains: a row whose turn ended goes to the environment between two
    rounds (every process runs its share of the steps and they exchange the
    results, at the same point on every process); a tool's answer is appended (masked
    out of the loss) and the transcript comes back to the sampler as the row's next
    turn, ahead of the prompts still waiting. The environment runs while the sampler
    lock is let go. A next turn goes on in its row's slot, from the KV cache the turn
    built (the sampler's `reuse_cache`), unless new weights landed since the row began.

    `streams`: more rows than the cache holds (else, single-turn, one call without
    rounds). Between rounds the lock is let go (a learner waiting for it swaps in its weights);
    each sample's `versions` are those its tokens were drawn under: per turn, the
    version when it was prefilled, then each one swapped in while it decoded.
    """
    current = 0  # the version of the sampler's weights: rows prefilled next draw under it
    spans: dict[int, list[int]] = {}  # versions of sampler rows seen decoding
    owner = list(range(len(rows)))  # the sampler's prompt j is a turn of rollout row owner[j]
    states = [Sample(prompt_tokens=list(p), response_tokens=[], response_mask=[],
                     behaviour_logprobs=[], text="", finish_reason="length", turns=0)
              for _, p in rows]
    stepping: list[int] = []  # rows whose turn ended: the environment's turn
    row_tasks = [tasks[t] for t, _ in rows]
    stepper = lambda i: hasattr(registry.get(row_tasks[i].domain), "step")  # noqa: E731

    def done(i: int) -> None:
      samples[i] = states[i]
      if mine(i):
        futures.append((i, self._pool.submit(_score, row_tasks[i], states[i])))

    def finished(j: int, tokens: np.ndarray, logprobs: np.ndarray, reason: str,
                 routing: np.ndarray | None = None) -> None:
      i, toks = owner[j], tokens.tolist()
      st = states[i]
      if routing is not None:  # this turn's: the whole transcript so far
        st.routing = routing
      st.response_tokens += toks
      st.response_mask += [1] * len(toks)
      st.behaviour_logprobs += logprobs.astype(float).tolist()
      self._end_turn(st)
      st.finish_reason, st.turns = reason, st.turns + 1
      # A row never seen between rounds began and ended within the current version's.
      st.versions += spans.pop(j, [current])
      room = self.sampler.max_len - len(st.prompt_tokens) - len(st.response_tokens)
      if st.turns < self.max_turns and room > 0 and stepper(i):
        stepping.append(i)  # the turn ended (a stop, or max_new_tokens): the tool's turn
      else:
        done(i)

    def between_rounds(live: np.ndarray):
      nonlocal current
      live = live.tolist()
      for j in live:  # first seen now: prefilled after the previous round, under `current`
        spans.setdefault(j, [current])
      if shared:
        self._lock.release()  # the learner's sync, if it waits, runs here
      try:  # every process has the same rows stepping: the exchange runs on all or none
        steps = self._environment_steps(stepping, row_tasks, states, 0) if stepping else {}
      finally:
        if shared:
          self._lock.acquire()
      version = self._version_fn()
      if version != current:
        current = version
        for j in live:
          spans[j].append(version)
      turns = []
      for i in sorted(stepping):
        st, step = states[i], steps.get(i)
        if step is None or step.done or step.observation is None:
          done(i)
          continue
        self._answer(st, step.observation)
        transcript = st.prompt_tokens + st.response_tokens
        if len(transcript) >= self.sampler.max_len:  # no room left for another turn
          done(i)
          continue
        owner.append(i)
        turns.append(transcript)
        self._reuse[1] += len(transcript)
      stepping.clear()
      return turns

    shared = self._shared
    multi = self.max_turns > 1
    with self._lock:
      current = self._version_fn()
      out = self.sampler.generate(
          [p for _, p in rows], max_new_tokens=max_new_tokens, temperature=temperature,
          top_k=self.top_k, top_p=self.top_p, stop_token_ids=self.tok.stop_ids, seed=seed,
          slots=self.chunk_rows, on_finish=finished,
          between_rounds=between_rounds if multi or (shared and streams) else None,
          round_steps=(self.segment_tokens or None) if shared else None,
          max_prompt_len=self.sampler.max_len - 1 if multi else None)
    self._count_decode(out)
    self._swaps += int(out.stats.get("weight_swaps", 0))
    self._reuse[0] += int(out.stats.get("reused_tokens", 0))

  def _chunks(self, rows, tasks, samples, futures, mine, *, seed: int,
              temperature: float) -> None:
    """Generates the rows `chunk_rows` at a time; a chunk is scored while the next one
    generates."""
    for start in range(0, len(rows), self.chunk_rows):
      chunk = rows[start:start + self.chunk_rows]
      # One seed for every chunk, rows keyed by their index in the rollout: single-turn
      # chunks draw what the continuously batched call draws.
      done = self._generate(chunk, tasks, seed=seed * 1_000_003, temperature=temperature,
                            offset=start)
      for j, sample in enumerate(done):
        task = tasks[chunk[j][0]]
        samples[start + j] = sample
        if mine(start + j):
          futures.append((start + j, self._pool.submit(_score, task, sample)))

  def _count_decode(self, out) -> None:
    """Adds a sampler call's generated tokens and decoded row-steps to the occupancy."""
    self._decode_rows[0] += int(out.stats.get("decoded", 0))
    self._decode_rows[1] += (int(out.stats.get("decode_steps", 0))
                             * int(out.stats.get("batch", 0)))

  def _collect_rewards(self, samples: list[Sample], futures: list[tuple[int, cf.Future]]):
    """Waits for this process's scoring `futures` ((sample index, future)), exchanges the
    rewards with the other processes, and sets `last_stats` for the rollout."""
    t_wait = time.perf_counter()
    for idx, fut in futures:
      samples[idx].reward = fut.result()
    if self.process_count > 1:
      local = {str(idx): samples[idx].reward.to_dict() for idx, _ in futures}
      for part in self._exchange(local):
        for idx, reward in part.items():
          samples[int(idx)].reward = Reward.from_dict(reward)
      missing = [i for i, smp in enumerate(samples) if smp.reward is None]
      if missing:
        raise RuntimeError(f"rewards of samples {missing[:5]} came back from no process")
    self.last_stats = {"scoring_wait_s": time.perf_counter() - t_wait,
                       "scored_fraction": len(futures) / max(len(samples), 1)}
    if self._tool_steps[1]:
      self.last_stats["tool_step_fraction"] = self._tool_steps[0] / self._tool_steps[1]
    if self._decode_rows[1]:
      # Generated tokens per decoded row-step: the share of decode work that was not spent
      # on rows that had already stopped (or padding rows).
      self.last_stats["decode_occupancy"] = self._decode_rows[0] / self._decode_rows[1]
    if self._swaps:  # weights swapped in while a streamed rollout decoded
      self.last_stats["weight_swaps"] = float(self._swaps)
    if self._reuse[1]:
      # Later turns' prompt tokens that went on from the row's KV cache in its slot
      # (the rest were prefilled again: after a weight swap, or with no slot to go on in).
      self.last_stats["reused_prefix_fraction"] = self._reuse[0] / self._reuse[1]
    if self._segments[1]:
      # Continued segments that resumed from the kept KV cache (the rest ran under new
      # weights and prefilled prompt + response again).
      self.last_stats["resumed_fraction"] = self._segments[0] / self._segments[1]

  def _rollout_partial(self, pairs, *, seed: int, policy_version: int, g: int,
                       temperature: float, budget: int) -> list[TrajectoryGroup]:
    if self.max_turns != 1:
      raise ValueError("partial rollouts across steps (a token budget) need max_turns=1")
    groups = list(self._carry)
    for domain, s in pairs:
      task = registry.get(domain).sample(s)
      prompt = self.prompt_tokens(task)
      groups.append((domain, s, task, [
          Sample(prompt_tokens=list(prompt), response_tokens=[], response_mask=[],
                 behaviour_logprobs=[], text="", finish_reason="length", turns=0)
          for _ in range(g)]))
    # Rows still generating (turns == 0), carried groups first: the oldest finish first.
    rows = [smp for *_, samples in groups for smp in samples if not smp.turns]
    self._tool_steps, self._segments, self._decode_rows = [0, 0], [0, 0], [0, 0]
    self._swaps, self._reuse = 0, [0, 0]
    for start in range(0, len(rows), self.chunk_rows):
      chunk = rows[start:start + self.chunk_rows]
      ended = self._generate_turn(chunk, list(range(len(chunk))),
                                  seed=seed * 1_000_003 + start, temperature=temperature,
                                  cap=budget)
      for k, smp in enumerate(chunk):
        # A row with no room left in the sampler's max_len cannot continue: it ends here.
        full = len(smp.prompt_tokens) + len(smp.response_tokens) >= self.sampler.max_len
        smp.turns = int(ended[k] or full)
        if full and not ended[k]:
          self._end_turn(smp)
    done = [grp for grp in groups if all(smp.turns for smp in grp[3])]
    self._carry = [grp for grp in groups if not all(smp.turns for smp in grp[3])]
    samples = [smp for *_, smps in done for smp in smps]
    tasks = [grp[2] for grp in done for _ in grp[3]]
    self._collect_rewards(samples, [
        (i, self._pool.submit(_score, tasks[i], samples[i])) for i in range(len(samples))
        if i % self.process_count == self.process_index])
    self.last_stats["carried_groups"] = float(len(self._carry))
    return [TrajectoryGroup(domain, s, task, smps, policy_version)
            for domain, s, task, smps in done]

  def _generate(self, chunk, tasks, *, seed: int, temperature: float,
                offset: int = 0) -> list[Sample]:
    """Generates (possibly several turns of) the rows of one chunk (rows `offset`... of
    the rollout)."""
    states = [Sample(prompt_tokens=list(p), response_tokens=[], response_mask=[],
                     behaviour_logprobs=[], text="", finish_reason="length", turns=0)
              for _, p in chunk]
    active = list(range(len(chunk)))
    for turn in range(self.max_turns):
      if not active:
        break
      ended = self._generate_turn(states, active, seed=seed + 7919 * turn,
                                  temperature=temperature, row_offset=offset)
      steps = {}
      if turn + 1 < self.max_turns:
        stepping = [i for i in active if ended[i]
                    and hasattr(registry.get(tasks[chunk[i][0]].domain), "step")]
        steps = self._environment_steps(stepping, [tasks[c[0]] for c in chunk], states,
                                        offset)
      still = []
      for i in active:
        st = states[i]
        st.turns += 1
        if not ended[i]:
          self._end_turn(st)  # no room left in the sampler's max_len: the turn is over
          continue
        step = steps.get(i)
        if step is not None and not step.done and step.observation is not None:
          self._answer(st, step.observation)
          still.append(i)
      active = still
    return states

  def _answer(self, sample: Sample, observation: str) -> None:
    """Appends a tool's answer to a sample's transcript, masked out of the loss."""
    sample.tool_calls += 1
    stops = self.tok.stop_ids
    ended = bool(sample.response_tokens) and sample.response_tokens[-1] in stops
    message = {"role": "tool", "content": observation}
    if self.tool_format == "native":  # a tool message holds the result alone
      message["content"] = observation.removeprefix(OBS_OPEN).removesuffix(OBS_CLOSE)
      if sample.called is not None:  # and names the function it answers (harmony)
        message["name"] = sample.called
    obs = self.tok.chat.continuation([message], ended=ended, thinking=self.thinking)
    sample.response_tokens += obs
    sample.turn_start = len(sample.response_tokens)
    sample.response_mask += [0] * len(obs)
    sample.behaviour_logprobs += [0.0] * len(obs)
    sample.text += "\n" + observation + "\n"

  def _environment_steps(self, rows: list[int], tasks: list[Task], states: list[Sample],
                         offset: int) -> dict[int, StepResult]:
    """The environment's answer to the latest turn of each of `rows` (tool calls run here).

    Each process runs the steps of rows with (offset + row) % processes == its index,
    concurrently on the scoring threads, and the processes exchange the results, so a
    tool call runs once and every process continues the transcript with the same
    observation (a sandbox timeout on one host cannot make the hosts' inputs diverge).
    Called by every process at the same points: the exchange is a collective.
    """
    mine = [i for i in rows if (offset + i) % self.process_count == self.process_index]
    futures = {i: self._pool.submit(_step, tasks[i], states[i].text) for i in mine}
    results = {i: f.result() for i, f in futures.items()}
    self._tool_steps[0] += len(mine)
    self._tool_steps[1] += len(rows)
    if self.process_count > 1:
      local = {str(i): [r.observation, r.done] for i, r in results.items()}
      for part in self._exchange(local):
        for i, (obs, done) in part.items():
          results[int(i)] = StepResult(observation=obs, done=bool(done))
      missing = sorted(set(rows) - set(results))
      if missing:
        raise RuntimeError(f"environment steps of rows {missing[:5]} came back from no "
                           "process")
    return results

  def _generate_turn(self, states, rows, *, seed: int, temperature: float,
                     cap: int = 0, row_offset: int = 0) -> dict[int, bool]:
    """One model turn for `rows`, in segments of `segment_tokens` when set.

    Between segments the sampler lock is released, so the learner can swap in new weights;
    unfinished rows then resume under the new policy (their behaviour log-probs record
    what actually sampled each token). Returns row -> whether the turn ended in budget.
    With `cap` (partial rollouts, single turn) at most `cap` tokens are generated in this
    call, continuing rows that earlier calls paused; rows not ended are paused again.
    """
    budget_left = {i: self.max_new_tokens - (len(states[i].response_tokens) if cap else 0)
                   for i in rows}
    spent = 0
    ended = {i: False for i in rows}
    active, segment = list(rows), 0
    # Between segments the KV cache is kept; a segment under unchanged weights resumes
    # from it instead of prefilling prompt + response again.
    paused, paused_row = None, {}
    while active and not (cap and spent >= cap):
      inputs = [states[i].prompt_tokens + states[i].response_tokens for i in active]
      room = self.sampler.max_len - max(len(x) for x in inputs)
      if room < 1:
        break
      want = max(budget_left[i] for i in active)
      n_new = min(want, room, self.segment_tokens or want, (cap - spent) if cap else want)
      spent += n_new
      with self._lock:
        version = self._version_fn()
        if paused is not None and paused.params_version == self.sampler.params_version:
          out = self.sampler.resume(paused, [paused_row[i] for i in active],
                                    max_new_tokens=n_new)
          self._segments[0] += 1
        else:
          out = self.sampler.generate(
              inputs, max_new_tokens=n_new, temperature=temperature, top_k=self.top_k,
              top_p=self.top_p, stop_token_ids=self.tok.stop_ids,
              seed=seed + 104_729 * segment, keep_cache=n_new < min(want, room),
              reserve_tokens=min(want, room), row_offset=row_offset)
          paused_row = {i: k for k, i in enumerate(active)}
        paused = out.resume_state
      self._count_decode(out)
      self._segments[1] += segment > 0  # continuations of paused rows
      segment += 1
      still = []
      for k, i in enumerate(active):
        st = states[i]
        n = min(int(out.lengths[k]), budget_left[i])
        toks = out.tokens[k, :n].tolist()
        recorded = getattr(out, "routing", None)
        if recorded is not None:  # the transcript's fed tokens, this segment's included
          st.routing = recorded[k][:len(inputs[k]) + n - 1]
        st.response_tokens += toks
        st.response_mask += [1] * n
        st.behaviour_logprobs += out.logprobs[k, :n].astype(float).tolist()
        st.versions.append(version)
        budget_left[i] -= n
        stopped = out.finish_reasons[k] == "stop" and n == int(out.lengths[k])
        st.finish_reason = "stop" if stopped else "length"
        if stopped or budget_left[i] <= 0:
          ended[i] = True
          self._end_turn(st)
        else:
          still.append(i)
      active = still
    return ended


class FairLock:
  """A lock that goes to the threads waiting for it in the order they came.

  `threading.Lock` lets the thread that releases it take it straight back, so a rollout
  thread that lets go between rounds could starve a learner waiting to swap weights.
  Here an `acquire` queues behind every thread already waiting.
  """

  def __init__(self):
    self._cv = threading.Condition(threading.Lock())
    self._queue: collections.deque = collections.deque()
    self._held = False

  @property
  def waiting(self) -> int:
    """Threads waiting to acquire."""
    with self._cv:
      return len(self._queue)

  def acquire(self) -> bool:
    me = object()
    with self._cv:
      self._queue.append(me)
      self._cv.wait_for(lambda: not self._held and self._queue[0] is me)
      self._queue.popleft()
      self._held = True
    return True

  def release(self) -> None:
    with self._cv:
      if not self._held:
        raise RuntimeError("release of an unheld FairLock")
      self._held = False
      self._cv.notify_all()

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def task_messages(task: Task, system_prompt: str | None = None) -> list[dict[str, str]]:
  """The conversation a task's rollouts (and SFT demonstrations) open with: the task's own
  chat messages (`task.metadata["messages"]`, a task file's chat prompt; the last user
  message is the task's prompt, which wrappers may extend) or its prompt as the user's
  message, after `system_prompt` unless the task brings a system message."""
  given = task.metadata.get("messages") if isinstance(task.metadata, dict) else None
  msgs = ([{"role": m["role"], "content": m["content"]} for m in given] if given
          else [{"role": "user", "content": task.prompt}])
  if given and msgs[-1]["role"] == "user":
    msgs[-1]["content"] = task.prompt  # the prompt is the last user message, as amended
  if system_prompt and msgs[0]["role"] != "system":
    msgs = [{"role": "system", "content": system_prompt}] + msgs
  return msgs


def _score(task: Task, sample: Sample) -> Reward:
  return registry.get(task.domain).score(task, sample.text)


def _step(task: Task, text: str) -> StepResult:
  return registry.get(task.domain).step(task, text)


def group_to_trajectories(group: TrajectoryGroup, advantages: Sequence[float]
                          ) -> list[dict[str, Any]]:
  """Packing inputs (posttrain.rl.packing schema) for one group with per-sample advantages."""
  out = []
  for sample, adv in zip(group.samples, advantages):
    out.append({
        "prompt_tokens": np.asarray(sample.prompt_tokens, np.int32),
        "response_tokens": np.asarray(sample.response_tokens, np.int32),
        "response_mask": np.asarray(sample.response_mask, np.int32),
        "behaviour_logprobs": np.asarray(sample.behaviour_logprobs, np.float32),
        "advantages": np.float32(adv),
        "rewards": np.float32(sample.reward.value if sample.reward else 0.0),
        **({} if sample.routing is None else {"routing": sample.routing}),
    })
  return out
