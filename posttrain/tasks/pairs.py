"""Preference pairs from verifiable domains: a right answer against a wrong one.

    rows = verifier_pairs(["arithmetic/add_d1", "logic/parity_l1"], count=4000, seed=0)

(`python -m launch.pairs` writes them to a file.)

Each row is TRL's explicit-prompt format, `{"prompt", "chosen", "rejected"}`, plus the
task's `"domain"` and `"seed"`: the task's prompt, its demonstration (which the domain's
verifier scores 1) and the demonstration of another task of the same domain whose answer
the verifier rejects here (a plausible wrong answer in the right format). Such pairs train a reward model
(`objective=reward_model`) or a DPO stage whose preferences a program checked. Training
rows use the domains' training seeds and `heldout=True` rows their held-out seeds, so the
two never share a task. Tasks whose wrong answer is not found among a few other tasks'
(a domain with few distinct answers) are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.tasks.base import heldout_seed, train_seed
from posttrain.tasks.catalog import registry

_TRIES = 16  # other tasks tried for a wrong answer


def verifier_pairs(domains: Sequence[str], count: int, seed: int = 0, *,
                   heldout: bool = False) -> list[dict]:
    """`count` pairs drawn round-robin over `domains` (module docstring).

    Args:
        domains: registered domain names (single-turn, with demonstrations).
        count: pairs to make.
        seed: offsets the task indices, so different seeds give different tasks.
        heldout: draw the tasks from the held-out seeds.

    Raises:
        ValueError: no domain, an unknown or multi-turn one, or `count` < 1.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not domains:
        raise ValueError("verifier_pairs needs at least one domain")
    resolved = []
    for name in domains:
        domain = registry.get(name)
        if getattr(domain, "multi_turn", False):
            raise ValueError(f"domain {name!r} is multi-turn: its answers are transcripts, "
                             "not one demonstration")
        resolved.append(domain)
    seed_of = heldout_seed if heldout else train_seed
    rows: list[dict] = []
    attempts = 0
    while len(rows) < count:
        if attempts >= 100 * count:
            raise ValueError(f"found {len(rows)} of {count} pairs in {attempts} tasks of "
                             f"{[d.name for d in resolved]}: too few distinct answers")
        domain = resolved[attempts % len(resolved)]  # round-robin over the attempts
        base = seed * 1_000_003 + attempts
        attempts += 1
        task = domain.sample(seed_of(base))
        chosen = domain.demonstration(task)
        if domain.score(task, chosen).value < 1.0:
            continue
        for k in range(1, _TRIES + 1):
            answer = domain.demonstration(domain.sample(seed_of(base + 7919 * k)))
            if answer != chosen and domain.score(task, answer).value < 1.0:
                rows.append({"prompt": task.prompt, "chosen": chosen, "rejected": answer,
                             "domain": domain.name, "seed": task.seed})
                break
    return rows
