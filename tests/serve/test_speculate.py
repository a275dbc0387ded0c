"""Speculative decoding: the acceptance rule (k3_jax/serve/acceptance.py), the prompt-lookup
drafter, and the engine with --speculative=ngram against the plain engine (engine8).

Exactness: greedy output ids must be identical with and without speculation (the verify
step's logits agree with decode's to ~1e-6 on this model, tests/serve/test_verify.py, far
below any argmax gap the prompts meet), logprobs to 1e-4. Sampling: the first and second
emitted tokens' frequencies over N seeds against the target distribution computed here in
numpy (penalties, bias, temperature, top-p), by a chi-square test at a fixed seed count."""

import jax
import numpy as np
import pytest
from scipy import stats

from k3_jax.serve.acceptance import accept
from k3_jax.serve.drafters import NgramDrafter
from k3_jax.serve.engine import SamplingParams
from k3_jax.serve.steps import Sampling

V, T = 6, 3
N = 8000                 # rows of every accept call here (one compile)
ACCEPT = jax.jit(accept)


def rows(n, **kw):
  z = np.zeros(n, np.int32)
  base = dict(seeds=np.arange(n, dtype=np.int32), steps=z + 5,
              temperature=np.zeros(n, np.float32), top_p=np.ones(n, np.float32),
              presence=np.zeros(n, np.float32), frequency=np.zeros(n, np.float32),
              bias=np.zeros((n, V), np.float32))
  base.update({k: np.broadcast_to(np.asarray(v, base[k].dtype), base[k].shape).copy()
               for k, v in kw.items()})
  return Sampling(**base)


def test_ngram_drafter_proposes_what_followed_the_latest_copy():
  d = NgramDrafter(max_n=3)
  assert d.propose(np.array([1, 2, 3, 9, 1, 2, 3, 4, 7, 1, 2, 3]), 2) == [4, 7]
  assert d.propose(np.array([5, 6, 7]), 3) == []
  assert d.propose(np.array([4, 8, 4]), 5) == [8, 4, 8, 4, 8]     # a run: its period
  assert d.propose(np.array([9, 3, 3, 3]), 3) == [3, 3, 3]


def test_greedy_keeps_the_longest_agreeing_prefix():
  raw = np.full((N, T, V), 0.0, np.float32)
  raw[:, 0, 2], raw[:, 1, 4], raw[:, 2, 1] = 5.0, 5.0, 5.0      # argmax: 2, then 4, then 1
  drafts = np.resize(np.array([[2, 4], [2, 3], [0, 4]], np.int32), (N, 2))
  ids, n = ACCEPT(raw, np.zeros((N, V), np.int32), drafts,
                  np.resize(np.array([2, 2, 1], np.int32), N), rows(N))
  assert np.asarray(n)[:3].tolist() == [3, 2, 1]
  assert np.asarray(ids)[0].tolist() == [2, 4, 1]
  assert np.asarray(ids)[1, :2].tolist() == [2, 4]
  assert np.asarray(ids)[2, :1].tolist() == [2]


def target(raw, counts, bias, temp, top_p, pres, freq):
  """numpy: the distribution a plain decode step samples from."""
  x = (raw + bias - freq * counts - pres * (counts > 0)) / temp
  p = np.exp(x - x.max())
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  before = np.cumsum(p[order]) - p[order]
  keep = np.zeros(V, bool)
  keep[order[before < top_p]] = True
  p = np.where(keep, p, 0)
  return p / p.sum()


def chi2_ok(draws, p, n):
  """Pearson's chi-square over the categories p > 0 (none drawn outside them)."""
  obs = np.bincount(draws, minlength=V)
  assert obs[p == 0].sum() == 0, (obs, p)
  exp = p[p > 0] * n
  stat = ((obs[p > 0] - exp) ** 2 / exp).sum()
  return stats.chi2.sf(stat, (p > 0).sum() - 1)


def test_rejection_sampling_keeps_the_target_distribution():
  """8,000 seeds, one draft per position: the first emitted token ~ p_0 and, where the first
  draft was kept, the second ~ p_1 (whose penalties count that draft)."""
  n = N
  rng = np.random.default_rng(0)
  raw = np.broadcast_to(rng.normal(size=(1, T, V)).astype(np.float32), (n, T, V)).copy()
  counts = np.zeros((n, V), np.int32)
  counts[:, 3] = 1
  bias = np.zeros((n, V), np.float32)
  bias[:, 5] = -np.inf                                    # a masked token (logit_bias, grammar)
  drafts = np.broadcast_to(np.array([[1, 2]], np.int32), (n, 2))
  params = dict(temperature=0.8, top_p=0.9, presence=0.3, frequency=0.2, bias=bias)
  ids, kept = ACCEPT(raw, counts, drafts, np.full(n, 2, np.int32), rows(n, **params))
  ids, kept = np.asarray(ids), np.asarray(kept)
  tp = lambda t, c: target(raw[0, t], c, bias[0], 0.8, 0.9, 0.3, 0.2)
  p0 = tp(0, counts[0])
  assert chi2_ok(ids[:, 0], p0, n) > 1e-3
  c1 = counts[0].copy()
  c1[1] += 1
  first = ids[:, 0] == 1
  assert abs(first.mean() - p0[1]) < 4 * np.sqrt(p0[1] * (1 - p0[1]) / n)
  assert chi2_ok(ids[first, 1], tp(1, c1), first.sum()) > 1e-3


# ----- the engine ------------------------------------------------------------------------

# in 16-token prefill pieces (test_verify's and test_overlap's shape), decoded together (a mixed batch: slots with and
# without drafts)
PROMPTS = [np.random.default_rng(s).integers(1, 256, n).astype(np.int32)
           for s, n in enumerate((48, 32, 16))]


def generate(eng, prompts, params):
  reqs = [eng.submit(p, params) for p in prompts]
  eng.run_until_done(reqs)
  return reqs


class Oracle:
  """A test drafter that knows each prompt's plain greedy continuation and proposes it,
  wrong at one draft of every third step: long kept runs and rejections at every depth."""

  def __init__(self, runs):
    self.runs, self.calls = [np.concatenate([r.prompt, r.output_ids]) for r in runs], 0

  def propose(self, tokens, k):
    self.calls += 1
    for full in self.runs:
      n = len(tokens)
      if n < full.size and np.array_equal(full[:n], tokens):
        d = full[n:n + k].tolist()
        if self.calls % 3 == 0 and d:
          j = self.calls % len(d)
          d[j] = (d[j] + 1) % 256
        return d
    return []


def test_greedy_output_is_identical_with_speculation(engine8, speculator8):
  """engine8 plain, then with speculation attached (prefill and decode steps shared), by
  prompt lookup and by the Oracle drafter: the same output ids, logprobs to 1e-4."""
  params = SamplingParams(max_tokens=24, logprobs=2)
  plain = generate(engine8, PROMPTS, params)
  sp = engine8.speculator = speculator8
  try:
    for drafter in (speculator8.drafter, Oracle(plain)):
      sp.drafter, sp.steps, sp.accepted = drafter, 0, 0
      spec = generate(engine8, PROMPTS, params)
      print(f"{type(drafter).__name__}: verify steps {sp.steps}, accepted {sp.accepted}")
      assert sp.steps > 0
      for a, b in zip(plain, spec):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=1e-4)
    assert sp.accepted >= 2 * len(PROMPTS)         # the oracle's runs were kept
  finally:
    engine8.speculator, sp.drafter = None, NgramDrafter()
  assert engine8.resource_counts()["free_slots"] == 8


def test_sampled_requests_with_speculation(engine8, speculator8):
  """Sampling (temperature, top-p, penalties, a logit_bias that forbids the token the
  drafter proposes) through the verify step: every request runs to its length and the
  forbidden token never appears, though it is drafted at every step."""
  class Always:                                    # drafts the forbidden token, k times
    def propose(self, tokens, k):
      return [7] * k

  engine8.speculator, speculator8.drafter = speculator8, Always()
  try:
    reqs = [engine8.submit(p, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9,
                                             presence_penalty=0.5, seed=i,
                                             logit_bias=((7, -100.0),)))
            for i, p in enumerate(PROMPTS)]
    engine8.run_until_done(reqs)
  finally:
    engine8.speculator, speculator8.drafter = None, NgramDrafter()
  for r in reqs:
    assert r.finish_reason == "length" and len(r.output_ids) == 12
    assert 7 not in r.output_ids


@pytest.mark.slow
def test_greedy_output_is_identical_verifying_only_the_busy_slots(engine8, speculator8):
  """Without batch invariance a verify step runs only the slots with requests (3 of 8 here,
  padded to 4 rows; their states are taken out and put back): the same output ids
  as plain decoding, by the Oracle drafter (kept runs and rejections), the idle slots'
  KDA states untouched. (Compiles the 4-row verify step and the decode's row shapes.)"""
  import dataclasses
  from k3_jax.serve import kv_pages as kv
  params = SamplingParams(max_tokens=24)
  plain = generate(engine8, PROMPTS, params)
  serve, sp = engine8.serve, speculator8
  engine8.serve = dataclasses.replace(serve, batch_invariant=False)
  rest = np.array(engine8.free_slots[:-len(PROMPTS)])      # the slots the requests won't take
  idle = jax.tree.map(np.asarray, kv.take_rows(kv.kda_states(engine8.cache), rest))
  engine8.speculator, sp.drafter, sp.steps = sp, Oracle(plain), 0
  try:
    spec = generate(engine8, PROMPTS, params)
  finally:
    engine8.serve, engine8.speculator, sp.drafter = serve, None, NgramDrafter()
  assert sp.steps > 0
  assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
  after = kv.take_rows(kv.kda_states(engine8.cache), rest)
  for a, b in zip(jax.tree.leaves(idle), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_draft_model_drafter_output_is_identical(engine8, speculator8):
  """A draft model (here engine8's own weights, run by a ModelDrafter with its own paged
  cache and checkpoint rows, on engine8's compiled prefill and decode steps): greedy output
  ids identical to plain decoding in a mixed batch, most drafts kept (the draft model is the
  target), and a second round on the same slots restarts each from zero or its checkpoint."""
  from k3_jax.serve.draft_model import ModelDrafter
  run = engine8.runner
  drafter = ModelDrafter(engine8.cfg, run.graphdef, run.params, run.rest, engine8.max_batch,
                         engine8.max_len, piece=16, share=run)
  params = SamplingParams(max_tokens=16)
  plain = generate(engine8, PROMPTS, params)
  sp = speculator8
  engine8.speculator, sp.drafter, sp.drafted, sp.accepted = sp, drafter, 0, 0
  try:
    for _ in range(2):
      spec = generate(engine8, PROMPTS, params)
      assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
  finally:
    engine8.speculator, sp.drafter = None, NgramDrafter()
  print(f"draft model: drafted {sp.drafted}, kept {sp.accepted}")
  assert sp.accepted >= 0.9 * sp.drafted > 0
