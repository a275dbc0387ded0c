"""Speculative decoding: decode tokens per second with and without it, side by side in one run.

  flock /tmp/heavy.lock python -m benchmarks.speculate [--copy_steps 1000] [--new 48] [--k 4]

The model: no trained checkpoint exists in this tree (`python main.py train` was not run
for it), and a random-weight model does not restate its context, so prompt lookup's drafts
would be rejected and only the verify step's price for nothing would show. So the run first
trains a 5-layer k3_tiny (3 KDA + 2 MLA layers as tests/serve use, d_model 32, byte
vocabulary) for --copy_steps AdamW steps on copying: sequences of a random text (16-63
bytes) followed by the text again, loss on the copy (minutes on CPU). --copy_steps 0 keeps
the random weights.

Workload (edit-like): each prompt holds a text (64 random bytes) and restates its first
quarter; the completion continues restating it (48 tokens). Every mode decodes the same prompts, greedy,
and must give the same output ids as `plain` (else the row says so):

  plain    --speculative=off
  ngram    prompt lookup, k = --k
  oracle   drafts the plain run's own continuation (a drafter always right): the ceiling of
           the verify path at k

Per batch (1 and 8 requests at once): decode tokens per second (the time of the same
requests with max_tokens=1, i.e. prefill and first token, subtracted; compiles warmed
first), the ratio to plain, verify steps, drafts kept per request and verify step, and
tokens per request and decode step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import configs
from k3_jax import train
from k3_jax.config import apply_overrides, validate
from k3_jax.model import create_model
from k3_jax.serve.drafters import NgramDrafter
from k3_jax.serve.engine import Engine, SamplingParams
from k3_jax.serve.speculate import Speculator

TEXT = 64
OVERRIDES = ["max_seq_len=2048", "num_layers=5", "mla_layers=(4,5)"]   # 3 KDA + 2 MLA


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


def copy_batch(rng, rows, seq):
  """rows of [text, text] (text of seq // 2 - rng'd length, padded), loss on the copy."""
  inputs = np.zeros((rows, seq), np.int32)
  mask = np.zeros((rows, seq), np.float32)
  for i in range(rows):
    n = int(rng.integers(seq // 8, seq // 2))
    text = rng.integers(1, 256, n)
    row = np.concatenate([text, text])
    inputs[i, :row.size] = row
    mask[i, n:row.size - 1] = 1.0       # predict the copy's tokens from the first one on
  targets = np.concatenate([inputs[:, 1:], np.zeros((rows, 1), np.int32)], axis=1)
  return dict(inputs=inputs, targets=targets, loss_mask=mask,
              segment_ids=np.ones((rows, seq), np.int32))


def train_copier(cfg, steps, seed=0, rows=32, seq=128, lr=1e-2):
  g, p, r = train.split_model(create_model(cfg, seed=3))
  if steps == 0:
    return g, p, r
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(0, lr, min(50, steps // 2), steps, lr / 10),
                    weight_decay=0.0)

  @jax.jit
  def step(p, st, batch):
    def f(p):
      s, n, _ = train.loss_terms(g, p, r, batch)
      return s / n
    loss, grads = jax.value_and_grad(f)(p)
    upd, st = opt.update(grads, st, p)
    return optax.apply_updates(p, upd), st, loss

  st, rng, t0 = opt.init(p), np.random.default_rng(seed), time.perf_counter()
  for i in range(steps):
    p, st, loss = step(p, st, copy_batch(rng, rows, seq))
    if i % 100 == 0 or i == steps - 1:
      print(f"  copy training step {i}: loss {float(loss):.3f} ({time.perf_counter() - t0:.0f} s)",
            flush=True)
  return g, p, r


def prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    text = rng.integers(1, 256, TEXT).astype(np.int32)
    out.append(np.concatenate([text, text[:TEXT // 4]]))
  return out


def run(eng, ps, new):
  params = SamplingParams(max_tokens=new)
  t0 = time.perf_counter()
  reqs = [eng.submit(p, params) for p in ps]
  eng.run_until_done(reqs)
  return reqs, time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--new", type=int, default=48)
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--copy_steps", type=int, default=1000)
  args = ap.parse_args()
  cfg = validate(apply_overrides(configs.get("k3_tiny"), OVERRIDES))
  g, p, r = train_copier(cfg, args.copy_steps)
  print(f"k3_tiny, {'random weights' if args.copy_steps == 0 else f'{args.copy_steps} copy-training steps'}, "
        f"k = {args.k}, {args.new} new tokens a request, prompts {TEXT} + {TEXT // 4} tokens")
  print(f"{'batch':>5} {'mode':>7} {'dec tok/s':>10} {'x plain':>8} {'verify':>7} "
        f"{'kept/req/verify':>16} {'tok/req/step':>13}")
  for batch in (1, 8):
    eng = Engine(cfg, g, p, r, max_batch=batch, prefix_cache_bytes=0, max_len=1024)
    sp = Speculator(eng, "ngram", args.k)
    ps, warm = prompts(batch), prompts(batch, seed=1)
    run(eng, warm, args.new)                                   # compile prefill / decode

    def timed(mode, drafter):
      eng.speculator, sp.drafter = (None, None) if mode == "plain" else (sp, drafter)
      _, t_first = run(eng, ps, 1)                             # prefill + first token
      sp.steps = sp.accepted = sp.tokens = sp.drafted = 0
      step0 = eng.step_no
      got, t = run(eng, ps, args.new)
      steps = eng.step_no - step0
      eng.speculator = None
      return got, t - t_first, steps, sp.steps, sp.accepted

    ref, t_plain, steps, _, _ = timed("plain", None)
    tokens = sum(len(q.output_ids) - 1 for q in ref)          # decode tokens (after the first)
    rows = [("plain", t_plain, steps, 0, 0, True)]
    runs = [np.concatenate([q.prompt, q.output_ids]) for q in ref]
    eng.speculator, sp.drafter = sp, NgramDrafter()
    run(eng, warm, 8)                                          # compile the verify step
    for mode, drafter in (("ngram", NgramDrafter()), ("oracle", Oracle(runs))):
      got, t, steps, vsteps, kept = timed(mode, drafter)
      same = all(a.output_ids == b.output_ids for a, b in zip(ref, got))
      rows.append((mode, t, steps, vsteps, kept, same))
    for mode, t, steps, vsteps, kept, same in rows:
      print(f"{batch:>5} {mode:>7} {tokens / t:>10.1f} {t_plain / t:>8.2f} {vsteps:>7} "
            f"{kept / max(vsteps, 1) / batch:>16.2f} {(tokens + batch) / steps / batch:>13.2f}"
            f"{'' if same else '  OUTPUT DIFFERS'}", flush=True)


if __name__ == "__main__":
  main()
