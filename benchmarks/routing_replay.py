"""Rollout routing replay: how far the learner's log-probs sit from the sampler's, with and
without the sampler's experts, on a mixture of experts in bfloat16 on CPU.

    python -m benchmarks.routing_replay [--prompts=16] [--group=4] [--new=96] [--quick]

The sampler (`Sampler(record_routing=True)`, bfloat16, a KV cache, one token at a time)
draws `group` samples of `new` tokens for each of `prompts` random prompts at temperature
1 and keeps their behaviour log-probs and the experts every mixture layer chose for every
token it fed. The learner then scores the same sequences in one cache-free pass of the
same weights and dtype, as the trainer's old log-probs do, in two arms:

  none       each mixture layer routes by its own top-k (rl.routing_replay=none)
  rollout    each token takes the sampler's experts (rl.routing_replay=rollout), weighted
             by the learner's router

Printed per arm, over the generated tokens: the share of (token, layer) routings whose
experts taken differ from the sampler's (in `rollout` none can), the share whose experts
the learner's routers chose (would have chosen, in `rollout`) differ from the sampler's
(the trainer's `routing/mismatch`), the mean and 99th percentile
of |learner - sampler| log-prob, the mean k3 estimate of KL(sampler || learner) per token
(what the mismatch costs an importance-weighted update), and the share of tokens whose
ratio leaves PPO's [0.8, 1.2]. And what recording costs the sampler: the median wall time
of `reps` generate calls (compiled before) with and without `record_routing`, the arms
interleaved. The model is a Qwen3-MoE-shaped stack shrunk to CPU: D 256,
8 heads of 32 (2 kv), 4 layers of 32 experts (top 4, F 128), V 1024, random weights
(init_std 0.05), bfloat16 compute with float32 parameters.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import models
from posttrain.sampling import Sampler

CFG = models.ModelConfig(
    vocab_size=1024, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
    ffn_dim=128, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, qk_norm=True,
    dtype="bfloat16", init_std=0.05, architecture="Qwen3MoeForCausalLM")


def _learner_logprobs(model, seqs, routing, replay: bool):
  """Per sequence, the log-probs of its tokens after the first and each (token, layer)'s
  experts, from one cache-free pass (right-padded rows; replay: the sampler's experts)."""
  k = CFG.num_experts_per_tok
  length = max(len(s) for s in seqs)
  tokens = np.zeros((len(seqs), length), np.int32)
  given = np.broadcast_to(np.arange(k, dtype=np.int16),
                          (len(seqs), length, CFG.mixture_layers, k)).copy()
  for i, (s, r) in enumerate(zip(seqs, routing)):
    tokens[i, :len(s)] = s
    given[i, :len(r)] = r
  graphdef, state = nnx.split(model)

  @jax.jit
  def score(tokens, given):
    m = nnx.merge(graphdef, state)
    h, chosen = m.hidden_states(tokens, routing=given if replay else None,
                                return_routing=True)
    logits = jnp.einsum("BTD,DV->BTV", h.astype(jnp.float32), m.unembed().astype(jnp.float32))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0], chosen

  logp, chosen = jax.device_get(score(tokens, given))
  return ([logp[i, :len(s) - 1] for i, s in enumerate(seqs)],
          [chosen[i, :len(r)] for i, r in enumerate(routing)])


def run(quick: bool = False, prompts: int = 16, group: int = 4, new: int = 96,
        prompt_len: int = 24, seed: int = 0, reps: int = 3) -> list[dict]:
  if quick:
    prompts, new, reps = 4, 32, 1
  model = models.create_model(CFG, seed=seed)
  samplers = {rec: Sampler(model, max_len=prompt_len + new, record_routing=rec)
              for rec in (False, True)}
  rng = np.random.default_rng(seed)
  distinct = [rng.integers(1, CFG.vocab_size, prompt_len).tolist() for _ in range(prompts)]
  rows = [p for p in distinct for _ in range(group)]
  kw = dict(max_new_tokens=new, temperature=1.0, seed=seed)
  outs = {rec: s.generate(rows, **kw) for rec, s in samplers.items()}  # compiles
  np.testing.assert_array_equal(outs[True].tokens, outs[False].tokens)
  times = {False: [], True: []}
  for _ in range(reps):
    for rec, s in samplers.items():
      t0 = time.perf_counter()
      s.generate(rows, **kw)
      times[rec].append(time.perf_counter() - t0)
  sample_s = {rec: float(np.median(t)) for rec, t in times.items()}
  out = outs[True]
  seqs = [p + out.tokens[i, :out.lengths[i]].tolist() for i, p in enumerate(rows)]
  results = []
  for arm, replay in (("none", False), ("rollout", True)):
    logps, chosen = _learner_logprobs(model, seqs, out.routing, replay)
    diffs, differ, taken, total = [], 0, 0, 0
    for i, p in enumerate(rows):
      n = int(out.lengths[i])
      learner = logps[i][len(p) - 1:len(p) - 1 + n]
      diffs.append(learner - out.logprobs[i, :n])
      # The generated tokens' positions that were fed (all but the last drawn).
      fed = slice(len(p), len(p) + n - 1)
      a, b = np.sort(chosen[i][fed], -1), np.sort(out.routing[i][fed], -1)
      differ += int(np.any(a != b, axis=-1).sum())
      total += a.shape[0] * a.shape[1]
    taken = 0 if replay else differ  # replaying, every layer takes the sampler's experts
    d = np.concatenate(diffs).astype(np.float64)  # log(learner / sampler)
    ratio = np.exp(d)
    results.append({
        "arm": arm, "tokens": int(d.size),
        "experts taken differ": round(taken / max(total, 1), 4),
        "own choice differs": round(differ / max(total, 1), 4),
        "mean abs dlogp": float(f"{np.mean(np.abs(d)):.3g}"),
        "p99 abs dlogp": float(f"{np.quantile(np.abs(d), 0.99):.3g}"),
        "k3 KL / token": float(f"{np.mean(ratio - 1 - d):.3g}"),
        "ratio outside [0.8, 1.2]": round(float(np.mean((ratio < 0.8) | (ratio > 1.2))), 4),
        "sampler s (recording / not)": f"{sample_s[True]:.2f} / {sample_s[False]:.2f}"})
  base = results[0]["mean abs dlogp"]
  for row in results:
    row["abs dlogp / none"] = round(row["mean abs dlogp"] / base, 3) if base else float("nan")
  return results


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--new", type=int, default=96)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--quick", action="store_true")
  a = p.parse_args(argv)
  from benchmarks.run import table  # the markdown table BENCHMARKS.md uses
  print(table(run(a.quick, prompts=a.prompts, group=a.group, new=a.new, seed=a.seed,
                  reps=a.reps)))


if __name__ == "__main__":
  main()
