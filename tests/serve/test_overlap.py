"""Host overlap (docs/serving.md): with `overlap` (the default) each decode step is dispatched
before the previous step's tokens are read back, the slots still waiting on an unread token
taking it from the device. It must change nothing but timing: the same tokens and bitwise
the same logits as reading every step first, through stop ids (whose ahead row is wasted),
length limits, seeded sampling with penalties, constrained requests (which make the step
wait) and requests joining mid-run.
"""

import numpy as np

from k3_jax.serve.engine import SamplingParams
from tests.serve.test_engine import prompt_of
from tests.serve.test_step_outputs import OnlyIds


def _requests(eng, stop_id):
  v = eng.cfg.vocab_size
  first = [
      (prompt_of(80, 30), SamplingParams(max_tokens=9, stop_ids=(stop_id,)), None),
      (prompt_of(81, 12), SamplingParams(max_tokens=1), None),
      (prompt_of(82, 50), SamplingParams(max_tokens=2), None),
      (prompt_of(83, 20), SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=5,
                                         frequency_penalty=0.5), None),
      (prompt_of(84, 9), SamplingParams(max_tokens=7), None)]
  later = [
      (prompt_of(85, 40), SamplingParams(max_tokens=6), None),
      (prompt_of(86, 25), SamplingParams(max_tokens=5), OnlyIds(v, range(0, v, 5), n=3))]
  return first, later


def _run(eng, overlap, stop_id):
  eng.overlap = overlap
  ahead = []
  steps = eng.runner.steps
  eng.runner.steps = steps._replace(
      decode=lambda *a: ahead.append(bool(a[-1].from_prev.any())) or steps.decode(*a))
  try:
    first, later = _requests(eng, stop_id)
    sub = lambda p, s, c: eng.submit(p, s, record_logits=True, constraint=c)
    reqs = [sub(*x) for x in first]
    for _ in range(3):
      eng.step()
    reqs += [sub(*x) for x in later]
    eng.run_until_done(reqs)
    while eng.has_work():            # the rows dispatched ahead for requests now done
      eng.step()
  finally:
    eng.runner.steps, eng.overlap = steps, True
  return reqs, ahead


def test_overlap_changes_nothing_but_timing(engine8):
  probe = engine8.submit(prompt_of(80, 30), SamplingParams(max_tokens=9))
  engine8.run_until_done([probe])
  stop_id = probe.output_ids[4]          # stops the first request after a few tokens
  sync, sync_ahead = _run(engine8, False, stop_id)
  over, over_ahead = _run(engine8, True, stop_id)
  assert not any(sync_ahead) and sum(over_ahead) >= 3
  assert sync[0].finish_reason == "stop" and sync[0].output_ids[-1] == stop_id
  assert len(sync[1].output_ids) == 1 and len(sync[2].output_ids) == 2
  for a, b in zip(over, sync):
    assert a.finish_reason == b.finish_reason
    assert a.output_ids == b.output_ids
    assert len(a.logits) == len(b.logits)
    for x, y in zip(a.logits, b.logits):
      assert np.array_equal(x, y)
  assert engine8.resource_counts()["free_slots"] == engine8.max_batch
