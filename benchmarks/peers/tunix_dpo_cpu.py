"""DPO train steps with Tunix (google-tunix 0.1.7) on CPU: the peer of benchmarks.preference.

Run by the Tunix venv's python (it imports nothing from posttrain):

    python3 -m venv /tmp/tunix-venv
    /tmp/tunix-venv/bin/pip install google-tunix==0.1.7 sentencepiece
    /tmp/tunix-venv/bin/python benchmarks/peers/tunix_dpo_cpu.py --steps 8 --json_out t.json

A randomly initialised Tunix Qwen3 (`tunix.models.qwen3.model.Qwen3`) trained by
`tunix.sft.dpo.dpo_trainer.DPOTrainer` (sigmoid DPO, a frozen reference model) with
`optax.adamw`, on random token pairs already tokenized in Tunix's `TrainingInput` format:
prompt ids left-padded `[pairs, prompt_len]`, chosen and rejected ids right-padded
`[pairs, response_len]` (all lengths fixed here, so nothing is padded).

A step is one iteration of `DPOTrainer.train`'s loop: `_prepare_inputs` (concatenating
chosen and rejected into one batch, the attention mask, positions, and the reference
model's log-probs), then the jitted policy update and the trainer's metric bookkeeping.
Steps are timed between consecutive batch requests of the trainer, each mark taken after
the policy's parameters are ready; `_prepare_inputs` is also timed alone (its outputs
blocked on). Prints and dumps seconds per step (the first one compiles).
"""

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from tunix.models.qwen3 import model as qwen3_lib  # noqa: E402
from tunix.sft.dpo import dpo_trainer  # noqa: E402


def random_pairs(seed: int, pairs: int, prompt_len: int, response_len: int, vocab: int):
  """One batch of pairs in Tunix's tokenized format (benchmarks.preference draws the same)."""
  rng = np.random.default_rng(seed)
  prompt, chosen, rejected = (rng.integers(1, vocab, (pairs, n)).astype(np.int32)
                              for n in (prompt_len, response_len, response_len))
  return {"prompt_ids": prompt, "prompt_mask": np.ones_like(prompt),
          "chosen_ids": chosen, "chosen_mask": np.ones_like(chosen),
          "rejected_ids": rejected, "rejected_mask": np.ones_like(rejected)}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--ffn", type=int, default=1024)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv_heads", type=int, default=2)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--vocab", type=int, default=1024)
  p.add_argument("--tied", type=int, default=1, help="tie the input and output embeddings")
  p.add_argument("--pairs", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--response_len", type=int, default=64)
  p.add_argument("--beta", type=float, default=0.1)
  p.add_argument("--lr", type=float, default=1e-5)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--json_out", default="")
  args = p.parse_args()

  load_start = os.getloadavg()[0]
  cfg = qwen3_lib.ModelConfig(
      num_layers=args.layers, vocab_size=args.vocab, embed_dim=args.d_model,
      hidden_dim=args.ffn, num_heads=args.heads, head_dim=args.head_dim,
      num_kv_heads=args.kv_heads, rope_theta=10_000, norm_eps=1e-6,
      use_tied_embedding=bool(args.tied))
  policy = qwen3_lib.Qwen3(cfg, rngs=nnx.Rngs(params=0))
  reference = qwen3_lib.Qwen3(cfg, rngs=nnx.Rngs(params=0))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))
  trainer = dpo_trainer.DPOTrainer(
      model=policy, ref_model=reference, optimizer=optax.adamw(args.lr),
      training_config=dpo_trainer.DPOTrainingConfig(
          algorithm="dpo", beta=args.beta, eval_every_n_steps=1_000_000))

  # Instrumentation: wrappers only, Tunix's code is unchanged.
  prepare_s = []
  prepare = trainer._prepare_inputs

  def timed_prepare(batch):
    start = time.perf_counter()
    out = jax.block_until_ready(prepare(batch))
    prepare_s.append(time.perf_counter() - start)
    return out

  trainer._prepare_inputs = timed_prepare
  marks = []

  def batches():
    for step in range(args.steps):
      jax.block_until_ready(nnx.state(trainer.model, nnx.Param))
      marks.append(time.perf_counter())
      yield random_pairs(step, args.pairs, args.prompt_len, args.response_len, args.vocab)
    jax.block_until_ready(nnx.state(trainer.model, nnx.Param))
    marks.append(time.perf_counter())

  trainer.train(batches())
  step_s = np.diff(marks).tolist()
  try:  # A sanity check: DPO starts at log 2 = 0.693 (policy == reference).
    losses = [round(float(x), 4) for x in trainer.metrics_logger.get_metric_history(
        trainer.metrics_prefix, "loss", "train")]
  except ValueError:
    losses = []
  res = {
      "jax": jax.__version__, "devices": str(jax.devices()),
      "model": "tunix Qwen3 (random init)", "params": int(n_params),
      "layers": args.layers, "d_model": args.d_model, "ffn": args.ffn,
      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
      "vocab": args.vocab, "tied": bool(args.tied), "pairs": args.pairs,
      "prompt_len": args.prompt_len, "response_len": args.response_len, "beta": args.beta,
      "step_s": [round(s, 4) for s in step_s],
      "prepare_inputs_s": [round(s, 4) for s in prepare_s], "loss": losses,
      "step_s_median_warm": round(float(np.median(step_s[1:])), 4) if len(step_s) > 1 else None,
      "loadavg_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
  }
  print("RESULT " + json.dumps(res))
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
