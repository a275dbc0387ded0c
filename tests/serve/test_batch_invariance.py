"""Batch invariance (docs/serving.md): a request's logits are bitwise identical whatever else
shares the decode batch and whichever slot it takes, so greedy output never drifts with load.

The decode step always runs all `max_batch` slots with fixed shapes; what changes with load is
the other rows' content (and, through the MoE dispatch, how tokens group by expert). Here one
request runs alone, then among 7 others of random lengths, in the first, a middle and the
last of the 8 slots.
Tolerance: none (np.array_equal on float32 logits).
"""

import numpy as np
import pytest

from k3_jax.serve.engine import SamplingParams
from tests.serve.test_engine import prompt_of

SLOTS = 8


@pytest.fixture(scope="module")
def engine(engine8):
  return engine8


def _run(eng, prompts, slots):
  # The engine hands out free slots from the end of its list; order it so that request i
  # is admitted to slots[i] (all are admitted in the same step).
  eng.free_slots = list(reversed(slots)) + [s for s in eng.free_slots if s not in slots]
  reqs = [eng.submit(q, SamplingParams(max_tokens=4), record_logits=True) for q in prompts]
  eng.run_until_done(reqs)
  return reqs


def test_logits_do_not_depend_on_the_batch_or_the_slot(engine):
  x = prompt_of(7, 40)
  solo = _run(engine, [x], [3])[0]
  rng = np.random.default_rng(0)
  for slot in (0, 3, SLOTS - 1):      # the first, a middle and the last slot (suite budget)
    others = [prompt_of(100 + 8 * slot + i, int(rng.integers(5, 120))) for i in range(7)]
    order = [s for s in range(SLOTS) if s != slot]
    reqs = _run(engine, [x] + others, [slot] + order)
    got = reqs[0]
    assert got.slot == slot
    assert got.output_ids == solo.output_ids
    assert len(got.logits) == len(solo.logits)
    for a, b in zip(got.logits, solo.logits):
      assert np.array_equal(a, b), f"slot {slot}: max |diff| {np.max(np.abs(a - b))}"
