"""Task sampling + scoring throughput and scheduler overhead, side by side, one core.

    python -m benchmarks.tasks [--quick]

Tables:
  1. Procedural families: tasks sampled and scored per second (one ``sample`` plus one
     ``score`` of a model-like completion, half right and half wrong), per family and for
     all non-code families together, against the 20,000/s goal.
  2. Peer: the same loop for reasoning-gym's own generators and scorers on comparable
     tasks (skipped when reasoning-gym is not installed); ratio = posttrain / gym.
  3. Scheduler: one ``draw(1024)`` and 1,024 ``update`` calls over every registered domain,
     per rule, against numpy's bare ``Generator.choice`` of 1,024 indices (the floor).

All figures are medians over repeats within this one run, timed in CPU seconds of this
process (``time.process_time``) so that other load on a shared machine does not count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from posttrain.tasks import Scheduler, registry, train_seed

GOAL_PER_S = 20_000
NON_CODE = (
    "arithmetic",
    "strings",
    "lists",
    "logic",
    "structure",
    "bases",
    "sequences",
    "equations",
)
GYM_PAIRS = [
    ("arithmetic/expr_l2", "basic_arithmetic"),
    ("strings/reverse_l2", "spell_backward"),
    ("lists/sort_l2", "number_sorting"),
    ("bases/dec2bin_l3", "base_conversion"),
]


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _sample_and_score(domains, seeds_per_domain: int):
    def loop():
        for d in domains:
            for i in range(seeds_per_domain):
                task = d.sample(train_seed(i))
                answer = task.answer if i % 2 else "0"
                d.score(task, f"Let me think step by step.\n<answer>{answer}</answer>")

    return loop


def _gym_loop(dataset, n: int):
    def loop():
        for i in range(n):
            entry = dataset[2 * i]
            answer = entry["answer"] if i % 2 else "0"
            dataset.score_answer(answer, entry)

    return loop


def run(quick: bool) -> list[dict]:
    """Runs every table; returns one dict per row."""
    repeats = 3 if quick else 7
    per_domain = 20 if quick else 100
    rows: list[dict] = []

    all_non_code = []
    for family in NON_CODE:
        domains = registry.filter(family=family)
        all_non_code.extend(domains)
        n = len(domains) * per_domain
        seconds = _median_time(_sample_and_score(domains, per_domain), repeats)
        rows.append(
            {
                "table": "throughput",
                "case": family,
                "per_s": n / seconds,
                "ratio": n / seconds / GOAL_PER_S,
            }
        )
    n = len(all_non_code) * per_domain
    seconds = _median_time(_sample_and_score(all_non_code, per_domain), repeats)
    rows.append(
        {
            "table": "throughput",
            "case": "all non-code",
            "per_s": n / seconds,
            "ratio": n / seconds / GOAL_PER_S,
        }
    )

    try:
        import reasoning_gym
    except ImportError:
        reasoning_gym = None
    if reasoning_gym is not None:
        n = per_domain * 10
        for ours, theirs in GYM_PAIRS:
            dataset = reasoning_gym.create_dataset(theirs, seed=0, size=2 * n + 2)
            ours_s = _median_time(_sample_and_score([registry.get(ours)], n), repeats)
            gym_s = _median_time(_gym_loop(dataset, n), repeats)
            rows.append(
                {
                    "table": "peer",
                    "case": f"{ours} vs gym/{theirs}",
                    "per_s": n / ours_s,
                    "peer_per_s": n / gym_s,
                    "ratio": gym_s / ours_s,
                }
            )

    names = registry.names()
    rng = np.random.default_rng(0)
    rewards = (rng.random((1024, 8)) < 0.5).astype(float)
    probs = np.full(len(names), 1.0 / len(names))
    floor_s = _median_time(
        lambda: np.random.default_rng([0, 1]).choice(len(names), size=1024, p=probs), repeats * 5
    )
    for rule in ("uniform", "learnability", "failure", "bandit"):
        scheduler = Scheduler(
            names, rule=rule, seed=0, novelty=0.1, staleness=0.1, promotion_threshold=0.8
        )
        draw_s = _median_time(lambda s=scheduler: s.draw(1024), repeats * 5)
        pairs = scheduler.draw(1024)

        def update_all(s=scheduler, pairs=pairs):
            for (name, _), r in zip(pairs, rewards):
                s.update(name, r)

        update_s = _median_time(update_all, repeats)
        rows.append(
            {
                "table": "scheduler",
                "case": f"{rule} ({len(names)} domains)",
                "draw_ms": draw_s * 1e3,
                "update_ms": update_s * 1e3,
                "ratio": draw_s / floor_s,
                "floor_ms": floor_s * 1e3,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print("1. tasks sampled + scored per second, one core (ratio = rate / 20,000 goal)")
    print(f"{'family':>40} | {'tasks/s':>10} | {'ratio':>6}")
    for r in rows:
        if r["table"] == "throughput":
            print(f"{r['case']:>40} | {r['per_s']:>10,.0f} | {r['ratio']:>6.2f}")
    peer = [r for r in rows if r["table"] == "peer"]
    if peer:
        print("\n2. peer: reasoning-gym generators + scorers (ratio = posttrain rate / gym rate)")
        print(f"{'case':>52} | {'posttrain/s':>11} | {'gym/s':>9} | {'ratio':>6}")
        for r in peer:
            print(
                f"{r['case']:>52} | {r['per_s']:>11,.0f} | {r['peer_per_s']:>9,.0f} | {r['ratio']:>6.1f}"
            )
    else:
        print("\n2. peer: skipped (reasoning-gym not installed)")
    print("\n3. scheduler, batch of 1,024 (ratio = draw time / bare numpy choice)")
    print(f"{'rule':>40} | {'draw ms':>8} | {'update ms':>9} | {'numpy ms':>8} | {'ratio':>6}")
    for r in rows:
        if r["table"] == "scheduler":
            print(
                f"{r['case']:>40} | {r['draw_ms']:>8.3f} | {r['update_ms']:>9.2f} | "
                f"{r['floor_ms']:>8.3f} | {r['ratio']:>6.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for smoke tests")
    args = parser.parse_args()
    print_table(run(args.quick))


if __name__ == "__main__":
    main()
