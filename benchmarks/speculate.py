"""Speculative decoding: tokens per second with and without it, side by side in one run.

  flock /tmp/heavy.lock python -m benchmarks.speculate [--config k3_tiny] [--new 96]

Workload (edit-like): each prompt holds a text and the completion restates it. No trained
checkpoint exists in this tree, and a random-weight model does not copy its context, so
prompt lookup's drafts are rarely kept on it (its row shows what a miss costs: the verify
step's price for nothing). To time the verify path where drafts are kept, the `oracle` row
drafts the plain run's own greedy continuation (with lookup's shape: up to k tokens from the
request's tokens), i.e. what a drafter whose every guess is right gives: the ceiling of
prompt lookup on text the model restates exactly. Every row decodes the same prompts, greedy,
and must give the same output ids as the plain row.

Per row: batch 1 and 8 (8 prompts at once), tokens/s over the decode (compiles warmed
first), verify steps, accepted drafts per verify step, and tokens emitted per engine decode
step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import configs
from k3_jax import train
from k3_jax.config import apply_overrides, validate
from k3_jax.model import create_model
from k3_jax.serve import engine as eng_mod
from k3_jax.serve.drafters import NgramDrafter
from k3_jax.serve.engine import Engine, SamplingParams
from k3_jax.serve.speculate import Speculator


class Oracle:
  """Drafts the reference run's continuation of the request's tokens."""

  def __init__(self, runs):
    self.runs = runs

  def propose(self, tokens, k):
    for full in self.runs:
      n = len(tokens)
      if n < full.size and np.array_equal(full[:n], tokens):
        return full[n:n + k].tolist()
    return []


def prompts(n, size=192, seed=0):
  """Edit-like prompts: a text (random ids) stated, then its first half again (the model is
  to continue restating it)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    text = rng.integers(1, 256, size).astype(np.int32)
    out.append(np.concatenate([text, text[:size // 2]]))
  return out


def run(eng, ps, new):
  params = SamplingParams(max_tokens=new)
  t0 = time.perf_counter()
  reqs = [eng.submit(p, params) for p in ps]
  eng.run_until_done(reqs)
  return reqs, time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="k3_tiny")
  ap.add_argument("--new", type=int, default=96)
  ap.add_argument("--k", type=int, default=4)
  args = ap.parse_args()
  cfg = validate(apply_overrides(configs.get(args.config), ["max_seq_len=2048"]))
  g, p, r = train.split_model(create_model(cfg, seed=3))
  print(f"model {args.config} (random weights), k = {args.k}, {args.new} new tokens a request")
  print(f"{'batch':>5} {'mode':>7} {'tok/s':>9} {'x plain':>8} {'verify':>7} "
        f"{'kept/verify':>12} {'tok/step':>9}")
  for batch in (1, 8):
    eng = Engine(cfg, g, p, r, max_batch=batch, prefix_cache_bytes=0, max_len=1024)
    sp = Speculator(eng, "ngram", args.k, eng_mod._guard, eng_mod._HostSampled)
    ps = prompts(batch)
    warm = prompts(batch, seed=1)
    run(eng, warm, args.new)                            # compile prefill / decode
    ref, t_plain = run(eng, ps, args.new)
    runs = [np.concatenate([q.prompt, q.output_ids]) for q in ref]
    tokens = sum(len(q.output_ids) for q in ref)
    steps_plain = args.new
    print(f"{batch:>5} {'plain':>7} {tokens / t_plain:>9.1f} {1.0:>8.2f} {0:>7} {'-':>12} "
          f"{tokens / steps_plain / batch:>9.2f}")
    for mode, drafter in (("ngram", NgramDrafter()), ("oracle", Oracle(runs))):
      eng.speculator = sp
      sp.drafter = drafter
      run(eng, warm, 8)                                # compile the verify step
      sp.steps = sp.accepted = sp.tokens = sp.drafted = 0
      step0 = eng.step_no
      got, t = run(eng, ps, args.new)
      eng.speculator = None
      same = all(a.output_ids == b.output_ids for a, b in zip(ref, got))
      dec_steps = eng.step_no - step0
      print(f"{batch:>5} {mode:>7} {tokens / t:>9.1f} {t_plain / t:>8.2f} {sp.steps:>7} "
            f"{sp.accepted / max(sp.steps, 1):>12.2f} {tokens / dec_steps / batch:>9.2f}"
            f"{'' if same else '  OUTPUT DIFFERS'}")


if __name__ == "__main__":
  main()
