"""Write preference pairs the verifiers checked, for a reward model or a DPO stage.

    python -m launch.pairs --domains='arithmetic/*,logic/parity_*' --levels=1,2 \
        --count=4096 --out=/tmp/pairs.jsonl [--heldout] [--seed=0]

Each JSON line is `{"prompt", "chosen", "rejected", "domain", "seed"}`: a task's
demonstration against another task's answer its verifier rejects
(`posttrain.tasks.pairs.verifier_pairs`). `--heldout` draws from the held-out seeds.
Multi-turn domains are left out.
"""

import json

from absl import app, flags

from launch import common

_DOMAINS = flags.DEFINE_string("domains", None, "Comma-separated domain globs.")
_LEVELS = flags.DEFINE_string("levels", "", "Comma-separated levels (default: all).")
_COUNT = flags.DEFINE_integer("count", None, "Pairs to write.")
_SEED = flags.DEFINE_integer("seed", 0, "Offsets the tasks drawn.")
_HELDOUT = flags.DEFINE_bool("heldout", False, "Draw from the held-out seeds.")
_OUT = flags.DEFINE_string("out", None, "The JSON-lines file to write.")
flags.mark_flags_as_required(["domains", "count", "out"])


def main(argv):
  del argv
  from posttrain.experiment import select_domains
  from posttrain.tasks import registry
  from posttrain.tasks.pairs import verifier_pairs
  try:
    names = [n for n in select_domains(_DOMAINS.value, _LEVELS.value)
             if not getattr(registry.get(n), "multi_turn", False)]
    rows = verifier_pairs(names, _COUNT.value, _SEED.value, heldout=_HELDOUT.value)
    with open(_OUT.value, "w") as fh:
      for row in rows:
        fh.write(json.dumps(row) + "\n")
  except (ValueError, OSError) as e:
    common.fail(e)
  print(f"wrote {len(rows)} pairs over {len(names)} domains to {_OUT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)
