"""Constrained decoding next to free requests: do free requests slow down when they share
decode batches with grammar-constrained ones (k3_jax/serve/grammar.py)?

  python -m benchmarks.constrained [--quick] [--json out.json] [--vocab 163840]

One engine (k3_tiny, random weights, 8 slots, K3's vocabulary of 163,840 ids by default) and
the K3-format test tokenizer (the same one the tests build). Four free requests (sampled,
temperature 1, `--tokens` new tokens each, no stop) run
  1. alone (the other four slots idle),
  2. beside four more free requests (the same batch occupancy),
  3. beside four constrained requests (response_format json_schema on the K3 template:
     a per-slot mask row every step, built on the host from llguidance's bitmask),
and the free requests' tokens/s (their tokens / the time from their submission, the
neighbours already decoding, until the last of them finished) is compared. Target: 3 is at most 10% slower than 1 (and than 2). Every case runs once for
warm-up (compiles), then `--repeats` timed times, the cases interleaved (the median is
reported); the host time spent in the constraints (allowed / advance) is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from k3_jax import train  # noqa: E402
from k3_jax.data import bpe  # noqa: E402
from k3_jax.data import tokenizers as tk  # noqa: E402
from k3_jax.model import create_model  # noqa: E402
from k3_jax.data import chat  # noqa: E402
from k3_jax.serve import grammar  # noqa: E402
from k3_jax.serve.engine import Engine, SamplingParams  # noqa: E402
from k3_jax.serve.loader import random_weights  # noqa: E402

TEXT = """<|open|>message role="user"<|sep|> <|close|>message<|sep|> role="assistant"
The quick brown fox jumps over the lazy dog. What is the weather in Paris today? It is sunny
{"city": "Paris", "unit": "celsius", "days": [1, 2, 3], "verbose": true}
"""
SCHEMA = {"type": "object", "properties": {
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 12}},
    "n": {"type": "integer"}}, "required": ["notes", "n"], "additionalProperties": False}


def tokenizer(out_dir: str, vocab: int):
  ranks = bpe.learn_ranks([TEXT] * 4, num_merges=200)
  if vocab == tk.K3_VOCAB_SIZE:
    special = None
  else:                   # the K3 markers moved down to just past the ranks
    special = {n: len(ranks) + i - tk.K3_NUM_BASE_TOKENS
               for n, i in tk.KIMI_SPECIAL_TOKENS.items()}
  return tk.get_tokenizer(bpe.write_kimi_dir(out_dir, ranks, special, vocab_size=vocab))


def run(eng, template, prompt, free: int, neighbours: str, tokens: int) -> dict:
  """Free requests (and neighbours: "none" | "free" | "constrained") to completion ->
  the free requests' tokens/s and the host time spent in constraints."""
  body = {"response_format": {"type": "json_schema",
                              "json_schema": {"name": "notes", "schema": SCHEMA}}}
  others, spent = [], [0.0]
  for i in range(free if neighbours != "none" else 0):
    c = None
    if neighbours == "constrained":
      c = Timed(grammar.for_chat(template, prompt, body, eng.cfg.vocab_size), spent)
    others.append(eng.submit(prompt.ids, SamplingParams(max_tokens=4 * tokens,
                                                        temperature=1.0, seed=100 + i),
                             constraint=c))
  while any(not r.output_ids for r in others):      # neighbours prefilled and decoding
    eng.step()
  spent[0] = 0.0
  t0 = time.perf_counter()
  reqs = [eng.submit(prompt.ids, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i))
          for i in range(free)]
  while any(r.state != "done" for r in reqs):
    eng.step()
  dt = time.perf_counter() - t0
  for r in others:
    r.cancel()
  while eng.has_work():
    eng.step()
  done = sum(len(r.output_ids) for r in reqs)
  still = sum(r.finish_reason == "cancelled" for r in others)   # (ran to the end: all)
  return {"tokens_per_s": done / dt, "seconds": dt, "constraint_host_s": spent[0],
          "neighbours_cut_off": still}


class Timed:
  """A constraint whose allowed()/advance() host time is summed into spent[0]."""

  def __init__(self, c, spent):
    self.c, self.spent = c, spent

  def allowed(self):
    t = time.perf_counter()
    try:
      return self.c.allowed()
    finally:
      self.spent[0] += time.perf_counter() - t

  def advance(self, tid):
    t = time.perf_counter()
    self.c.advance(tid)
    self.spent[0] += time.perf_counter() - t

  def is_done(self):
    return self.c.is_done()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="8 new tokens, one repeat")
  ap.add_argument("--json", default=None)
  ap.add_argument("--vocab", type=int, default=tk.K3_VOCAB_SIZE)
  ap.add_argument("--tokens", type=int, default=24)
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args()
  if args.quick:
    args.tokens, args.repeats = 8, 1
  import tempfile
  tok = tokenizer(tempfile.mkdtemp(prefix="k3_bench_tok"), args.vocab)
  cfg, *_ = random_weights("k3_tiny", (f"vocab_size={args.vocab}", "num_layers=2",
                                       "mla_layers=(2,)", "max_seq_len=1024"))
  g, p, r = train.split_model(create_model(cfg, seed=0))
  eng = Engine(cfg, g, p, r, max_batch=8, prefix_cache_bytes=0, max_len=1024, tokenizer=tok)
  template = chat.template_for(tok)
  prompt = template.render([{"role": "user", "content": "Notes on the weather, as JSON."}],
                           thinking=False)
  out = {"vocab_size": args.vocab, "tokens": args.tokens, "cases": {}}
  cases = ("none", "free", "constrained")
  for case in cases:
    run(eng, template, prompt, 4, case, args.tokens)              # warm-up: compiles
  timed = {case: [] for case in cases}
  for _ in range(args.repeats):      # interleaved, so that a drifting machine load (shared
    for case in cases:               # cores) falls on every case alike
      timed[case].append(run(eng, template, prompt, 4, case, args.tokens))
  for case in cases:
    runs = timed[case]
    med = statistics.median(x["tokens_per_s"] for x in runs)
    out["cases"][case] = {"free_tokens_per_s": med, "runs": runs}
    print(f"free requests beside {case:12s}: {med:8.2f} tokens/s "
          f"(constraint host time {runs[0]['constraint_host_s']:.3f} s of "
          f"{runs[0]['seconds']:.2f} s)", flush=True)
  alone = out["cases"]["none"]["free_tokens_per_s"]
  mixed = out["cases"]["constrained"]["free_tokens_per_s"]
  same = out["cases"]["free"]["free_tokens_per_s"]
  out["slowdown_vs_alone"] = 1 - mixed / alone
  out["slowdown_vs_free_neighbours"] = 1 - mixed / same
  print(f"slowdown beside constrained requests: {100 * out['slowdown_vs_alone']:.1f}% vs alone, "
        f"{100 * out['slowdown_vs_free_neighbours']:.1f}% vs free neighbours (target <= 10%)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
