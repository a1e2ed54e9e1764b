"""Evaluation on held-out seeds: pass rates per domain and family.

Held-out seeds (`posttrain.tasks.heldout_seed`, odd) never meet the training seeds (even),
by construction.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from posttrain.tasks import heldout_seed, registry


def pass_rates(worker, domains: Sequence[str], *, seeds_per_domain: int,
               first_seed_index: int = 0) -> dict[str, Any]:
  """Greedy pass rate (reward value 1) on `seeds_per_domain` held-out seeds of each domain.

  Returns:
    {"pass_rate": overall, "families": {family: rate}, "domains": {domain: rate},
     "reward": mean reward, "samples": count}
  """
  pairs = [(d, heldout_seed(first_seed_index + i)) for d in domains
           for i in range(seeds_per_domain)]
  groups = worker.rollout(pairs, seed=0, group_size=1, temperature=0.0)
  by_domain: dict[str, list[float]] = defaultdict(list)
  rewards = []
  for g in groups:
    r = float(g.samples[0].reward.value)
    rewards.append(r)
    by_domain[g.domain].append(1.0 if r >= 1.0 else 0.0)
  by_family: dict[str, list[float]] = defaultdict(list)
  for d, v in by_domain.items():
    by_family[registry.get(d).family] += v
  return {
      "pass_rate": float(np.mean([v for vs in by_domain.values() for v in vs])),
      "families": {f: float(np.mean(v)) for f, v in sorted(by_family.items())},
      "domains": {d: float(np.mean(v)) for d, v in sorted(by_domain.items())},
      "reward": float(np.mean(rewards)),
      "samples": len(rewards),
  }
