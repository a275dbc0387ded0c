"""Prefill batching (docs/serving.md): with batch_invariant=False the same-size prompt pieces
of several requests run as one prefill call (steps.prefill_step over R rows, a power of
two), and give what one-request-per-call prefill gives.

Tolerance: 1e-5 on float32 logits of O(1). The rows compute the same functions as single
calls, but XLA:CPU blocks a matmul by its row count, so the summation order of a row's dot
products can change with the batch (measured: 1.2e-6 at most); greedy tokens are equal.
With batch_invariant (the default) every prefill call has one row: one shape per piece
size, so a request's logits are bitwise the same whatever else runs
(test_batch_invariance.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.ops.vision import scatter_features
from k3_jax.serve.engine import Engine, SamplingParams
from k3_jax.serve.steps import row_major_features
from tests.serve.test_engine import prompt_of

TOL = 1e-5
# pieces (prefill_chunks.prefill_plan): 20 = 16 + 4, 68 = 64 + 4: round 0 runs the three
# 16-token pieces as calls of 2 and 1 rows (planner.calls: power-of-two counts, no padding
# row) and one 64-token piece; round 1 the four 4-token pieces in one call
LENGTHS = (20, 20, 20, 68)


def _run(eng, prompts, n=4, shapes=None):
  """Runs `prompts` together; `shapes` (a list) gets each prefill call's tokens [R, T]."""
  steps = eng.runner.steps
  if shapes is not None:
    eng.runner.steps = steps._replace(
        prefill=lambda *a: shapes.append(a[4].shape) or steps.prefill(*a))
  try:
    reqs = [eng.submit(q, SamplingParams(max_tokens=n), record_logits=True) for q in prompts]
    eng.run_until_done(reqs)
  finally:
    eng.runner.steps = steps
  return reqs


def test_batched_prefill_matches_one_prompt_per_call(engine8):
  prompts = [prompt_of(40 + i, n) for i, n in enumerate(LENGTHS)]
  solo = [_run(engine8, [q])[0] for q in prompts]
  assert Engine(engine8.cfg, engine8.graphdef, engine8.params, engine8.rest, max_batch=2,
                max_len=512, prefix_cache_bytes=0, batch_invariant=False).prefill_rows == 2
  engine8.prefill_rows = engine8.max_batch
  shapes = []
  try:
    together = _run(engine8, prompts, shapes=shapes)
  finally:
    engine8.prefill_rows = 1
  assert sorted(shapes) == [(1, 16), (1, 64), (2, 16), (4, 4)]
  for a, b in zip(together, solo):
    assert a.output_ids == b.output_ids
    for x, y in zip(a.logits, b.logits):
      np.testing.assert_allclose(x, y, atol=TOL, rtol=0)
  counts = engine8.resource_counts()          # every slot and page given back
  assert counts["free_slots"] == 8 and counts["used_pages"] == 0


def test_invariant_engine_prefills_one_prompt_per_call(engine8):
  shapes = []
  _run(engine8, [prompt_of(60 + i, 20) for i in range(3)], shapes=shapes)
  assert sorted(shapes) == [(1, 4)] * 3 + [(1, 16)] * 3


def test_row_major_features_matches_per_row_scatter():
  """Each row's placeholders take that row's features in order, as scatter_features gives
  for the row alone."""
  rng = np.random.default_rng(0)
  r, t, d, ph = 3, 8, 4, 7
  tokens = rng.integers(0, ph, (r, t)).astype(np.int32)
  tokens[0, [1, 2, 6]] = ph                          # row 1 has no placeholders
  tokens[2, [0, 5]] = ph
  feats = rng.standard_normal((r, t, d)).astype(np.float32)
  x = jnp.asarray(rng.standard_normal((r, t, d)).astype(np.float32))
  got = scatter_features(x, tokens, row_major_features(jnp.asarray(tokens), feats, ph), ph)
  for i in range(r):
    want = scatter_features(x[i:i + 1], tokens[i:i + 1], feats[i], ph)[0]
    assert np.array_equal(np.asarray(got[i]), np.asarray(want))


def test_decode_over_the_decoding_rows_matches_all_slots(engine8):
  """batch_invariant=False: a decode step runs only the decoding slots, padded to a power
  of two (steps.rows_decode_step: their KDA states and counts taken out and put back, the
  previous ids kept per slot for the step-ahead dispatch). Against the all-slots step: the
  same greedy tokens (with penalties and a logit bias in play) and logits within TOL; the
  other slots' state untouched (a second round in the same engine gives the same again)."""
  # 16-token pieces and one page-table column: the prefill shapes engine8 has compiled
  prompts = [prompt_of(60 + i, n) for i, n in enumerate((32, 16))]
  params = [SamplingParams(max_tokens=6, presence_penalty=1.5),
            SamplingParams(max_tokens=3, logit_bias=((5, 3.0),))]

  def run(qs, ps):
    reqs = [engine8.submit(q, p, record_logits=True) for q, p in zip(qs, ps)]
    engine8.run_until_done(reqs)
    return reqs

  full = run(prompts, params)
  rows, decode = [], engine8.runner.steps.decode
  engine8.runner.steps = engine8.runner.steps._replace(
      decode=lambda *a: rows.append(a[-1].tokens.shape[0]) or decode(*a))
  serve = engine8.serve
  engine8.serve = dataclasses.replace(serve, batch_invariant=False)
  try:
    some = run(prompts, params) + run(prompts[:1], params[:1])
    again = run(prompts, params)
  finally:
    engine8.serve, engine8.runner.steps = serve, engine8.runner.steps._replace(decode=decode)
  assert set(rows) == {1, 2}               # 2 requests -> 2 rows; 1 once one finishes; 1 alone
  for got in (some[:2], again, some[2:]):
    for a, b in zip(got, full):
      assert a.output_ids == b.output_ids
      for x, y in zip(a.logits, b.logits):
        np.testing.assert_allclose(x, y, atol=TOL, rtol=0)
  assert engine8.resource_counts()["free_slots"] == 8
