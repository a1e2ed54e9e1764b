"""posttrain.tasks: verifiable task domains, their registry, and the curriculum scheduler.

    from posttrain.tasks import registry
    domain = registry.get("arithmetic/add_d1")
    task = domain.sample(seed)
    reward = domain.score(task, completion)   # Reward(value, components, verdict)
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
from posttrain.tasks.families import builtin_domains

for _domain in builtin_domains():
    registry.register(_domain)
del _domain
