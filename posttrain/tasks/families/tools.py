"""Multi-turn tool use: the model calls a calculator or Python, reads the result, answers.

Protocol (one transcript string, model turns and observations interleaved):

    model:        <tool>calculator: 345*678</tool>
    environment:  <observation>233910</observation>
    model:        <answer>233910</answer>

* A model turn ends at ``</tool>``; the environment runs the *last* tool call of that
  turn and appends ``<observation>...</observation>``. Tools: ``calculator: EXPR`` (exact
  arithmetic, ``posttrain.tasks.calculator``) and ``python: CODE`` (run in the sandbox;
  the observation is its stdout, or ``error: <status>: <last stderr line>``).
* ``domain.step(task, transcript)`` answers the latest model turn (the text after the last
  ``</observation>``): ``StepResult(observation, done=False)`` for a tool call, and
  ``StepResult(None, done=True)`` when the turn holds an answer, holds no tool call, or
  the task's ``max_calls`` is used up.
* Observations escape ``<`` and ``>`` so tool output cannot inject tags into the transcript.
* ``score`` reads the final ``<answer>`` from the model's own text (observations removed)
  and checks every tool call: the tool exists, its argument parses (calculator: evaluates;
  python: compiles), and a calculator observation that follows it is the true result (a
  forged observation makes the call invalid). Python calls are not re-run when scoring.

    value = exact * (0.5 + 0.5 * tool_valid)     tool_valid = valid calls / calls (1 if none)

Demonstrations are full transcripts, observations included; an SFT warm start should
mask the observation tokens out of the loss.
"""

from __future__ import annotations

import ast
import json

from posttrain.tasks import execution
from posttrain.tasks.base import (
    ANSWER_INSTRUCTION,
    MAX_ANSWER_CHARS,
    Domain,
    Reward,
    StepResult,
    Task,
    extract_answer,
    zero_reward,
)
from posttrain.tasks.calculator import calculate
from posttrain.tasks.families.arithmetic import random_expression
from posttrain.tasks.procedural import parse_int

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
OBS_OPEN, OBS_CLOSE = "<observation>", "</observation>"
TOOLS = ("calculator", "python")
MAX_CALLS = 4
MAX_SCORED_CALLS = 64
MAX_OBSERVATION_CHARS = 500
MAX_TOOL_INPUT_CHARS = 4000
PYTHON_TIMEOUT_S = 5.0

_PROTOCOL = "Tools: <tool>{tool}: ...</tool> returns <observation>result</observation>."

# The tools as function schemas, for models that call tools in their own format
# (RolloutWorker(tool_format="native")): one string argument each.
NATIVE_TOOLS = {
    "calculator": {"type": "function", "function": {
        "name": "calculator", "description": "Evaluates an arithmetic expression exactly.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "The expression, e.g. 345*678"}},
            "required": ["expression"]}}},
    "python": {"type": "function", "function": {
        "name": "python", "description": "Runs Python code and returns what it prints.",
        "parameters": {"type": "object", "properties": {"code": {
            "type": "string", "description": "The program; print the result."}},
            "required": ["code"]}}},
}


def native_call_text(name, arguments) -> str:
    """A call in a model's own format (a function name and its arguments) as this
    protocol's ``<tool>name: argument</tool>``; a call that names no tool or gives no single
    string argument comes out malformed, as the model wrote it wrong."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if isinstance(arguments, dict) and len(arguments) == 1:
        (arguments,) = arguments.values()
    if not isinstance(name, str) or not isinstance(arguments, str):
        return f"{TOOL_OPEN}malformed call{TOOL_CLOSE}"
    return f"{TOOL_OPEN}{name}: {arguments}{TOOL_CLOSE}"


def parse_call(text: str) -> tuple[str, str] | None:
    """``"calculator: 1+2"`` -> ``("calculator", "1+2")``; None if malformed."""
    name, sep, arg = text.partition(":")
    name = name.strip()
    if not sep or name not in TOOLS:
        return None
    return name, arg.strip()


def iter_blocks(text: str, open_tag: str, close_tag: str, limit: int):
    """(start, end, content) of complete ``open...close`` blocks, left to right, linear time."""
    pos = 0
    for _ in range(limit):
        start = text.find(open_tag, pos)
        if start < 0:
            return
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return
        yield start, end + len(close_tag), text[start + len(open_tag) : end]
        pos = end + len(close_tag)


def without_blocks(text: str, open_tag: str, close_tag: str) -> str:
    """``text`` with its complete ``open...close`` blocks removed."""
    parts, pos = [], 0
    for start, end, _ in iter_blocks(text, open_tag, close_tag, len(text)):
        parts.append(text[pos:start])
        pos = end
    parts.append(text[pos:])
    return "".join(parts)


def model_text(transcript: str) -> str:
    """The transcript without environment observations."""
    return without_blocks(transcript, OBS_OPEN, OBS_CLOSE)


def _escape(text: str) -> str:
    return text.replace("<", "&lt;").replace(">", "&gt;")


def run_tool(name: str, arg: str) -> str:
    """The observation body for one tool call (never raises)."""
    if len(arg) > MAX_TOOL_INPUT_CHARS:
        return "error: tool input too long"
    if name == "calculator":
        return calculate(arg)
    try:
        from posttrain.sandbox import ExecRequest

        result = execution.get_sandbox().run(
            ExecRequest(code=arg, timeout_s=PYTHON_TIMEOUT_S, max_output_bytes=1 << 16)
        )
    except Exception as e:  # noqa: BLE001 - a missing sandbox is an observation, not a crash
        return f"error: sandbox unavailable: {type(e).__name__}"
    if str(result.status) == "ok":
        out = result.stdout.strip()
        return out[-MAX_OBSERVATION_CHARS:] if out else "(no output)"
    last = (result.stderr.strip().splitlines() or [""])[-1]
    return f"error: {result.status}: {last[-200:]}"


def _call_is_valid(name: str, arg: str, observation: str | None) -> bool:
    if not arg or len(arg) > MAX_TOOL_INPUT_CHARS:
        return False
    if name == "calculator":
        result = calculate(arg)
        if result.startswith("error:"):
            return False
        return observation is None or observation.strip() == result
    try:
        ast.parse(arg)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def _observation_after(transcript: str, end: int) -> str | None:
    """The observation answering the call that ends at ``end``: the next observation block,
    unless another tool call starts first (rollout workers put newlines around it)."""
    start = transcript.find(OBS_OPEN, end)
    if start < 0:
        return None
    next_call = transcript.find(TOOL_OPEN, end, start)
    close = transcript.find(OBS_CLOSE, start)
    if next_call >= 0 or close < 0:
        return None
    return transcript[start + len(OBS_OPEN) : close]


def tool_step(task: Task, transcript: str, tools: tuple[str, ...] = TOOLS) -> StepResult:
    """The environment's reply to the latest model turn of a transcript in this protocol:
    the observation of its last call (of one of ``tools``), or done when the turn answers,
    calls nothing, or the task's ``max_calls`` is used up. Never raises."""
    try:
        turn = (
            transcript[transcript.rfind(OBS_CLOSE) + len(OBS_CLOSE) :]
            if OBS_CLOSE in transcript
            else transcript
        )
        if extract_answer(turn) is not None:
            return StepResult(None, True)
        calls = list(iter_blocks(turn, TOOL_OPEN, TOOL_CLOSE, MAX_SCORED_CALLS))
        if not calls:
            return StepResult(None, True)
        made = sum(
            1 for _ in iter_blocks(model_text(transcript), TOOL_OPEN, TOOL_CLOSE, MAX_SCORED_CALLS)
        )
        if made > int(task.metadata.get("max_calls", MAX_CALLS)):
            return StepResult(None, True)
        parsed = parse_call(calls[-1][2])
        if parsed is None or parsed[0] not in tools:
            body = f"error: unknown tool; use one of {', '.join(tools)}"
        else:
            body = run_tool(*parsed)
        return StepResult(f"{OBS_OPEN}{_escape(body[:MAX_OBSERVATION_CHARS])}{OBS_CLOSE}", False)
    except Exception as e:  # noqa: BLE001 - the environment must not crash a rollout
        return StepResult(f"{OBS_OPEN}error: {type(e).__name__}{OBS_CLOSE}", False)


class ToolDomain(Domain):
    """A multi-turn domain whose tasks are meant to be solved with a tool."""

    multi_turn = True

    def __init__(self, op: str, level: int, generate, tool: str):
        super().__init__(f"tools/{op}_l{level}", "tools", level)
        self._generate = generate
        self.tool = tool

    def _sample(self, rng, seed):
        question, answer, call = self._generate(rng, self.level)
        prompt = f"{question}\n{_PROTOCOL.format(tool=self.tool)}\n{ANSWER_INSTRUCTION}"
        metadata = {"tool": self.tool, "call": call, "max_calls": MAX_CALLS}
        return Task(self.name, seed, prompt, answer, metadata, self.level, self.family)

    def native_tools(self, task: Task) -> tuple[str, list[dict]]:
        """The task's prompt without this protocol's instructions, and its tool as a
        function schema: what a model calling tools in its own format is given."""
        prompt = task.prompt.replace(_PROTOCOL.format(tool=self.tool) + "\n", "")
        return prompt, [NATIVE_TOOLS[self.tool]]

    def native_demonstration(self, task: Task) -> list[dict]:
        """The demonstration as the turns of a model calling the tool in its own format: the
        call (the message's structured ``tool_calls``, which each chat format renders as
        its template does), the tool's answer, the answer."""
        schema = NATIVE_TOOLS[self.tool]["function"]
        (param,) = schema["parameters"]["properties"]
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": schema["name"],
                                              "arguments": {param: task.metadata["call"]}}}]}
        return [call,
                {"role": "tool", "content": str(task.answer)},
                {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]

    def demonstration(self, task):
        return (
            f"{TOOL_OPEN}{task.metadata['tool']}: {task.metadata['call']}{TOOL_CLOSE}"
            f"{OBS_OPEN}{task.answer}{OBS_CLOSE}<answer>{task.answer}</answer>"
        )

    def step(self, task: Task, transcript: str) -> StepResult:
        """The environment's reply to the latest model turn (see the module docstring)."""
        return tool_step(task, transcript)

    def _score(self, task, completion):
        text = model_text(completion)
        raw = extract_answer(text)
        calls, valid = 0, 0
        for _, end, content in iter_blocks(completion, TOOL_OPEN, TOOL_CLOSE, MAX_SCORED_CALLS):
            calls += 1
            observation = _observation_after(completion, end)
            parsed = parse_call(content)
            valid += parsed is not None and _call_is_valid(*parsed, observation)
        tool_valid = valid / calls if calls else 1.0
        extra = {"tool_valid": tool_valid, "tool_calls": float(calls)}
        if raw is None:
            return zero_reward("no_answer", **extra)
        if len(raw) > MAX_ANSWER_CHARS:
            return zero_reward("answer_too_long", **extra)
        pred = parse_int(raw)
        if pred is None:
            return zero_reward("unparseable", **extra)
        exact = float(pred == int(task.answer))
        value = exact * (0.5 + 0.5 * tool_valid)
        verdict = "correct" if exact else "wrong"
        if exact and tool_valid < 1.0:
            verdict = "correct, invalid tool calls"
        return Reward(value, {"format": 1.0, "exact": exact, **extra}, verdict)


# -- task generators: (question, integer answer, a tool call that computes it) ---------------

_CALC_SHAPE = {
    1: (1, 99, False),
    2: (1, 999, False),
    3: (2, 9999, False),
    4: (3, 99999, True),
    5: (4, 999999, True),
}


def _calc(rng, level):
    n_ops, max_operand, parens = _CALC_SHAPE[level]
    expr, value = random_expression(rng, n_ops, max_operand, parens)
    return f"What is {expr}?", str(value), expr


def _python(rng, level):
    if level == 1:
        k = rng.randint(20, 60)
        return f"What is 2**{k}?", str(2**k), f"print(2**{k})"
    if level == 2:
        a, b = rng.randint(2, 9), rng.randint(20, 80)
        code = f"print(sum(int(d) for d in str({a}**{b})))"
        return (
            f"What is the sum of the digits of {a}**{b}?",
            str(sum(int(d) for d in str(a**b))),
            code,
        )
    if level == 3:
        n = rng.randint(1000, 20000)
        code = f"print(sum(all(p % q for q in range(2, int(p**0.5) + 1)) for p in range(2, {n})))"
        return f"How many primes are smaller than {n}?", str(_count_primes(n)), code
    if level == 4:
        n, m = rng.randint(1000, 100000), rng.choice([97, 1000, 10007])
        code = f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, (a + b) % {m}\nprint(a)"
        return (
            f"What is the {n}-th Fibonacci number (F(0)=0, F(1)=1) modulo {m}?",
            str(_fib_mod(n, m)),
            code,
        )
    n = rng.randint(10**5, 10**6)
    a, b, c = rng.sample([2, 3, 5, 7, 11, 13], 3)
    # Inclusion-exclusion over distinct primes: |A or B| - |(A or B) and C|.
    count = n // a + n // b - n // (a * b) - (n // (a * c) + n // (b * c) - n // (a * b * c))
    code = f"print(sum(1 for i in range(1, {n} + 1) if (i % {a} == 0 or i % {b} == 0) and i % {c}))"
    q = f"How many integers from 1 to {n} are divisible by {a} or {b} but not by {c}?"
    return q, str(count), code


def _count_primes(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[0:2] = b"\x00\x00"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n, i)))
    return sum(sieve)


def _fib_mod(n: int, m: int) -> int:
    """F(n) mod m by fast doubling: F(2k) = F(k)(2F(k+1) - F(k)), F(2k+1) = F(k)^2 + F(k+1)^2."""
    a, b = 0, 1  # F(k), F(k+1) for k = the bits of n read so far
    for bit in bin(n)[2:]:
        a, b = a * (2 * b - a) % m, (a * a + b * b) % m
        if bit == "1":
            a, b = b, (a + b) % m
    return a


def domains():
    return [ToolDomain("calc", level, _calc, "calculator") for level in range(1, 6)] + [
        ToolDomain("python", level, _python, "python") for level in range(1, 6)
    ]
