"""posttrain.tasks: verifiable task domains, their registry, and the curriculum scheduler.

    from posttrain.tasks import registry, Scheduler
    domain = registry.get("arithmetic/add_d1")
    task = domain.sample(seed)
    reward = domain.score(task, completion)   # Reward(value, components, verdict)

    scheduler = Scheduler(registry.names(level=1), rule="learnability")
    for name, seed in scheduler.draw(64): ...
    scheduler.update(name, rewards)

Families: arithmetic, strings, lists, logic, structure, bases, sequences, equations
(single-turn, answer in ``<answer></answer>``), code (a ```python block run against
hidden tests in the sandbox) and tools (multi-turn: ``domain.step(task, transcript)``).
Code and tool domains use ``set_sandbox(sandbox)`` or a default sandbox built on first use.

Optional adapters live in submodules: ``posttrain.tasks.jsonl`` (user task files),
``posttrain.tasks.gym`` (reasoning-gym), ``posttrain.tasks.mathcheck`` (math-verify);
``posttrain.tasks.shaping`` (reward shaping), ``posttrain.tasks.replay`` (failure replay).
"""

from posttrain.tasks.base import (
    ANSWER_INSTRUCTION,
    Domain,
    Reward,
    StepResult,
    Task,
    extract_answer,
    heldout_seed,
    is_heldout_seed,
    train_seed,
)
from posttrain.tasks.catalog import Registry, registry
from posttrain.tasks.execution import set_sandbox
from posttrain.tasks.families import builtin_domains
from posttrain.tasks.reward_model import ModelScoredDomain, RewardModelScorer
from posttrain.tasks.scheduler import DynamicBatch, Scheduler, SchedulerConfig, dynamic_sample
from posttrain.tasks.shaping import DomainNormalizer, RewardShaper, overlong_penalty

for _domain in builtin_domains():
    registry.register(_domain)
del _domain

__all__ = [
    "ANSWER_INSTRUCTION",
    "Domain",
    "DomainNormalizer",
    "DynamicBatch",
    "ModelScoredDomain",
    "Registry",
    "Reward",
    "RewardModelScorer",
    "RewardShaper",
    "Scheduler",
    "SchedulerConfig",
    "StepResult",
    "Task",
    "builtin_domains",
    "dynamic_sample",
    "extract_answer",
    "heldout_seed",
    "is_heldout_seed",
    "overlong_penalty",
    "registry",
    "set_sandbox",
    "train_seed",
]
