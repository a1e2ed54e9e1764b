"""Tools for any domain: tool-integrated reasoning, the model running Python (or a
calculator) mid-solution, on domains that have no tools of their own.

    domain = WithTools(registry.get("jsonl/gsm8k"), tools=("python",))   # jsonl/gsm8k/tools

A run gets these from its config: ``tasks.tools=python`` and ``tasks.tool_domains=
'jsonl/*'`` register ``<domain>/tools`` beside each single-turn domain the globs match,
which ``tasks.domains`` then selects (``'jsonl/*/tools'``).

The tasks are the inner domain's, their prompt followed by the tool protocol of
``posttrain.tasks.families.tools`` (``<tool>python: CODE</tool>`` ends the turn and is
answered by ``<observation>what it printed</observation>``; Python runs in the sandbox).
Models that call tools in their own format (``rollout.tool_format=native``) get the tools
as function schemas instead. Rollouts become multi-turn: ``rollout.max_turns`` bounds the
turns and ``max_calls`` the calls.

The reward is the inner domain's verdict on the model's own text with its calls and the
observations removed: a tool is a means, neither rewarded nor required, and an answer
printed by a tool counts only once the model writes it. ``tool_calls`` is added to the
reward's components.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from posttrain.tasks.base import Domain, Reward, Task
from posttrain.tasks.families.tools import (
    MAX_CALLS,
    MAX_SCORED_CALLS,
    NATIVE_TOOLS,
    TOOL_CLOSE,
    TOOL_OPEN,
    TOOLS,
    iter_blocks,
    model_text,
    tool_step,
    without_blocks,
)

SUFFIX = "tools"
_USAGE = {
    "python": f"{TOOL_OPEN}python: CODE{TOOL_CLOSE} runs Python CODE and returns what it prints",
    "calculator": f"{TOOL_OPEN}calculator: EXPRESSION{TOOL_CLOSE} evaluates arithmetic exactly",
}


def instructions(tools: Sequence[str]) -> str:
    """The line a prompt gets: how to call each tool and how the answer comes back."""
    usage = "; ".join(_USAGE[t] for t in tools)
    return (f"You may call a tool, one per turn, and end your turn: {usage}. The result "
            "comes back in <observation></observation>.")


def own_text(completion: str) -> str:
    """What the model wrote, without its tool calls and the observations answering them."""
    return without_blocks(model_text(completion), TOOL_OPEN, TOOL_CLOSE)


class WithTools(Domain):
    """``inner``'s tasks, solved with ``tools`` at hand (see the module docstring)."""

    multi_turn = True

    def __init__(self, inner: Domain, tools: Sequence[str] = ("python",),
                 max_calls: int = MAX_CALLS, name: str | None = None):
        tools = tuple(tools)
        unknown = sorted(set(tools) - set(TOOLS))
        if not tools or unknown or len(set(tools)) != len(tools):
            raise ValueError(f"tools must be distinct names from {TOOLS}, got {list(tools)}")
        if inner.multi_turn or hasattr(inner, "step"):
            raise ValueError(f"{inner.name} is multi-turn already; it has tools of its own")
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError(f"max_calls must be an int >= 1, got {max_calls!r}")
        super().__init__(name or f"{inner.name}/{SUFFIX}", inner.family, inner.level)
        self.inner, self.tools, self.max_calls = inner, tools, max_calls
        self._line = instructions(tools)

    def sample(self, seed):
        task = self.inner.sample(seed)
        metadata = {**task.metadata, "max_calls": self.max_calls, "tools": list(self.tools)}
        return Task(self.name, task.seed, f"{task.prompt.rstrip()}\n{self._line}", task.answer,
                    metadata, task.level, task.family)

    def _inner_task(self, task: Task) -> Task:
        return self.inner.sample(task.seed)

    def step(self, task, transcript):
        return tool_step(task, transcript, self.tools)

    def native_tools(self, task: Task) -> tuple[str, list[dict]]:
        """The prompt without this protocol's line, and the tools as function schemas."""
        return task.prompt.replace("\n" + self._line, ""), [NATIVE_TOOLS[t] for t in self.tools]

    def demonstration(self, task):
        return self.inner.demonstration(self._inner_task(task))

    def native_demonstration(self, task: Task) -> list[dict]:
        """The inner domain's demonstration, which calls no tool."""
        return [{"role": "assistant", "content": self.demonstration(task)}]

    def _score(self, task, completion):
        return self.score_many([task], [completion])[0]

    def score_many(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[Reward]:
        """The inner domain's rewards (its own batching: a sandbox's run_many) on the model's
        own text; never raises."""
        if len(tasks) != len(completions):
            raise ValueError(f"got {len(tasks)} tasks but {len(completions)} completions")
        out: list[Reward | None] = [None] * len(tasks)
        valid = []
        for i, (task, completion) in enumerate(zip(tasks, completions)):
            if (isinstance(task, Task) and task.domain == self.name
                    and isinstance(completion, str)):
                valid.append(i)
            else:
                out[i] = self.score(task, completion)  # the base class's zero reward
        if valid:
            try:
                inner = [self._inner_task(tasks[i]) for i in valid]
                rewards = self.inner.score_many(inner, [own_text(completions[i]) for i in valid])
            except Exception as e:  # noqa: BLE001 - scoring never raises
                rewards = [Reward(0.0, {"format": 0.0, "exact": 0.0},
                                  f"error: {type(e).__name__}: {str(e)[:200]}")] * len(valid)
            for i, reward in zip(valid, rewards):
                calls = sum(1 for _ in iter_blocks(model_text(completions[i]), TOOL_OPEN,
                                                   TOOL_CLOSE, MAX_SCORED_CALLS))
                out[i] = dataclasses.replace(
                    reward, components={**reward.components, "tool_calls": float(calls)})
        return out
