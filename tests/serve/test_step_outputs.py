"""The decode step's per-slot seam (k3_jax/serve/steps.py): log-probabilities computed in the
step, the per-slot logit bias, and a request's constraint (a token mask before each sample).

Tolerances: the step's log-probabilities are the log-softmax of the very logits it returns
(same f32 array, same device): compared with numpy's log-softmax of those logits to 1e-5
(float32 reductions in a different order). Masks and biases are exact (greedy ids)."""

import numpy as np
import pytest

from k3_jax.serve.engine import RequestError, SamplingParams
from k3_jax.serve.steps import TOP_K
from tests.serve.test_engine import prompt_of


def _log_softmax(x):
  x = x.astype(np.float64)
  m = x.max()
  return x - m - np.log(np.exp(x - m).sum())


class OnlyIds:
  """A toy constraint: the next token must lie in `ids`; done after `n` tokens."""

  def __init__(self, vocab, ids, n):
    self.mask = np.zeros(vocab, bool)
    self.mask[list(ids)] = True
    self.n, self.seen = n, []

  def allowed(self):
    return self.mask

  def advance(self, tid):
    self.seen.append(tid)

  def is_done(self):
    return len(self.seen) >= self.n


class Broken(OnlyIds):
  def allowed(self):
    if self.seen:
      raise ValueError("the grammar broke")
    return self.mask


def test_logprobs_are_the_log_softmax_of_the_models_logits(engine8):
  x = prompt_of(11, 30)
  r = engine8.submit(x, SamplingParams(max_tokens=5, temperature=1.0, seed=4, logprobs=3),
                     record_logits=True)
  engine8.run_until_done([r])
  assert len(r.token_logprobs) == len(r.top_logprobs) == len(r.logits) == 5
  for tid, lp, top, logits in zip(r.output_ids, r.token_logprobs, r.top_logprobs, r.logits):
    ref = _log_softmax(logits)
    assert abs(lp - ref[tid]) < 1e-5
    assert len(top) == 3
    order = np.argsort(-ref, kind="stable")[:3]
    assert [i for i, _ in top] == list(order)
    np.testing.assert_allclose([v for _, v in top], ref[order], atol=1e-5)
  # no logprobs asked: none kept
  q = engine8.submit(x, SamplingParams(max_tokens=2))
  engine8.run_until_done([q])
  assert q.token_logprobs == [] and q.top_logprobs == []


def test_echo_scores_come_from_the_prefill_program(engine8):
  """The echo scorer (steps.score_step: the prefill's model call over a paged cache of its
  own, every position's logits) against the engine's prefill of the same prompt: its row
  at the prompt's last position is the logits the first token was sampled from, to 1e-5
  (one program; the scorer's bucket padding and all-position head may reorder float32
  sums). Then its teacher-forced rows predict the generated tokens the
  decode steps scored (to 1e-4: test_engine's REF_TOL)."""
  x = prompt_of(12, 30)                   # a prefill shape the other tests compile
  r = engine8.submit(x, SamplingParams(max_tokens=3, logprobs=1), record_logits=True)
  engine8.run_until_done([r])
  rows = engine8.scorer().logits(list(x) + r.output_ids[:-1])
  np.testing.assert_allclose(rows[len(x) - 1], r.logits[0], rtol=0, atol=1e-5)
  for i, (tid, lp) in enumerate(zip(r.output_ids, r.token_logprobs)):
    assert abs(_log_softmax(rows[len(x) - 1 + i])[tid] - lp) < 1e-4


def test_logit_bias_and_a_constraint_steer_greedy_picks_beside_a_free_request(engine8):
  v = engine8.cfg.vocab_size
  x, y = prompt_of(12, 25), prompt_of(13, 60)
  free_alone = engine8.submit(y, SamplingParams(max_tokens=6), record_logits=True)
  engine8.run_until_done([free_alone])
  free = engine8.submit(y, SamplingParams(max_tokens=6), record_logits=True)
  biased = engine8.submit(x, SamplingParams(max_tokens=6, logit_bias=((7, 100.0),)))
  con = OnlyIds(v, range(0, v, 3), n=4)
  masked = engine8.submit(x, SamplingParams(max_tokens=6), constraint=con)
  engine8.run_until_done([free, biased, masked])
  assert biased.output_ids == [7] * 6
  assert all(t % 3 == 0 for t in masked.output_ids)
  assert masked.output_ids == con.seen and len(con.seen) == 4
  assert masked.finish_reason == "stop"
  # the free request's logits do not see its neighbours' biases or masks
  assert free.output_ids == free_alone.output_ids
  for a, b in zip(free.logits, free_alone.logits):
    assert np.array_equal(a, b)


def test_a_broken_constraint_fails_its_request_alone(engine8):
  v = engine8.cfg.vocab_size
  y = prompt_of(14, 20)
  ok_alone = engine8.submit(y, SamplingParams(max_tokens=4))
  engine8.run_until_done([ok_alone])
  bad = engine8.submit(y, SamplingParams(max_tokens=4), constraint=Broken(v, range(v), 9))
  ok = engine8.submit(y, SamplingParams(max_tokens=4))
  engine8.run_until_done([bad, ok])
  assert bad.finish_reason == "error" and "grammar broke" in bad.error
  assert ok.finish_reason == "length" and ok.output_ids == ok_alone.output_ids
  assert engine8.fatal is None and len(engine8.free_slots) == engine8.max_batch


@pytest.mark.parametrize("params, match", [
    (SamplingParams(logprobs=TOP_K + 1), "logprobs"),
    (SamplingParams(logit_bias=((10**9, 1.0),)), "not in the vocabulary"),
    (SamplingParams(logit_bias=((3, 101.0),)), r"\[-100, 100\]"),
])
def test_bad_sampling_fields_are_refused(engine8, params, match):
  with pytest.raises(RequestError, match=match):
    engine8.submit(prompt_of(1, 5), params)


def test_samples_forked_off_one_prefill_equal_separate_requests(engine8):
  """n samples of one prompt (Request.fork_of) share its prefill: the other samples copy the
  KDA state and the partial last page and sample from the same logits. Each equals the same
  request run alone, bitwise; the ones that find no free slot (10 samples, 8 slots) queue
  as requests of their own and equal it too."""
  x = prompt_of(21, 45)
  params = [SamplingParams(max_tokens=5, temperature=1.0, seed=100 + j) for j in range(10)]
  solo = []
  for p in params:
    r = engine8.submit(x, p, record_logits=True)
    engine8.run_until_done([r])
    solo.append(r)
  lead = engine8.submit(x, params[0], record_logits=True)
  forks = [engine8.submit(x, p, record_logits=True, fork_of=lead) for p in params[1:]]
  assert len(lead.forks) == 9
  engine8.run_until_done([lead] + forks)
  assert sum(f.cached_tokens == x.size for f in forks) == 7      # 7 forked, 2 queued
  for got, ref in zip([lead] + forks, solo):
    assert got.output_ids == ref.output_ids
    assert all(np.array_equal(a, b) for a, b in zip(got.logits, ref.logits))
  assert len({tuple(r.output_ids) for r in solo}) > 1             # the seeds differ
  assert len(engine8.free_slots) == engine8.max_batch
