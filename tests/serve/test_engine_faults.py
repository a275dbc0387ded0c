"""Fault containment in the engine (docs/faults.md, Serving): a fault while handling one of
several concurrent requests fails that request alone (its slot, pages and prefix-cache pins
freed) while the others finish with exactly their solo outputs; a fault of the device step
stops the engine (Engine.fatal) and fails everything. An engine of its own (a prefix cache,
and it ends fatal) on the session's 8-slot engine's model and shapes, whose compiled steps
it shares (conftest engine8; greedy decoding, so "equal" is exact)."""

import numpy as np
import pytest

from k3_jax.data.tokenizers import ByteTokenizer
from k3_jax.serve.engine import Engine, SamplingParams
from k3_jax.serve.requests import EngineFatal


def prompt_of(seed, n):
  return np.random.default_rng(seed).integers(1, 256, n).astype(np.int32)


@pytest.fixture(scope="module")
def eng(engine8):
  # batch invariant, engine8's slots, context and pool (its byte budget given exactly, the
  # prefix cache's pages included), so its steps' shapes are engine8's: no compile of its own
  # (the default's row buckets are tested in test_prefill_batching.py and through
  # test_server.py's server)
  e8 = engine8
  eng = Engine(e8.cfg, e8.graphdef, e8.params, e8.rest, max_batch=e8.max_batch,
               max_len=e8.max_len, prefix_cache_bytes=1 << 22,
               kv_cache_bytes=e8.num_pages * e8.page_bytes, tokenizer=ByteTokenizer(),
               batch_invariant=True)
  assert eng.num_pages == e8.num_pages and eng.prefix is not None
  eng.runner.steps = e8.runner.steps
  return eng


def idle(eng):
  c = eng.resource_counts()
  assert c["free_slots"] == eng.max_batch and c["running"] == c["waiting"] == 0, c
  assert c["used_pages"] == c["cached_pages"], c
  assert c["pinned_blocks"] == 0 and c["pinned_checkpoints"] == 0, c


def solo(eng, prompt, n=6):
  req = eng.submit(prompt, SamplingParams(max_tokens=n))
  eng.run_until_done([req])
  assert req.error is None, req.error
  return list(req.output_ids)


def test_one_failing_request_leaves_the_others(eng, monkeypatch):
  prompts = [prompt_of(i, 16) for i in range(3)]
  want = [solo(eng, p) for p in prompts]
  idle(eng)
  bad_ids = set()
  real = ByteTokenizer.stream_decoder

  def decoder(self):
    d = real(self)
    add = d.add
    rid = len(bad_ids)   # the decoder created second (the middle request's) fails
    bad_ids.add(rid)

    def failing_add(t):
      if rid == 1:
        raise ValueError("injected decode fault")
      return add(t)
    d.add = failing_add
    return d
  monkeypatch.setattr(ByteTokenizer, "stream_decoder", decoder)
  reqs = [eng.submit(p, SamplingParams(max_tokens=6)) for p in prompts]
  eng.run_until_done(reqs)
  assert eng.fatal is None
  assert reqs[1].finish_reason == "error" and "injected decode fault" in reqs[1].error
  assert [list(r.output_ids) for i, r in enumerate(reqs) if i != 1] == [want[0], want[2]]
  idle(eng)
  monkeypatch.undo()
  assert solo(eng, prompts[1]) == want[1]          # the engine still serves that prompt


def test_out_of_vocab_id_reads_as_replacement(eng, monkeypatch):
  # the bug of issue 28: a model vocabulary larger than the byte tokenizer's made the
  # tokenizer raise inside the engine loop; now no id is decodable and each reads as U+FFFD
  monkeypatch.setattr(ByteTokenizer, "vocab_size", 0)
  req = eng.submit(prompt_of(7, 16), SamplingParams(max_tokens=5))
  eng.run_until_done([req])
  assert req.error is None and req.finish_reason == "length"
  assert req.text == "\ufffd" * 5
  idle(eng)


def test_timeout_fails_the_request(eng):
  req = eng.submit(prompt_of(8, 16), SamplingParams(max_tokens=50), timeout=0.0)
  other = eng.submit(prompt_of(9, 16), SamplingParams(max_tokens=3))
  eng.run_until_done([req, other])
  assert req.error_type == "timeout" and "timeout" in req.error
  assert other.error is None and len(other.output_ids) == 3
  idle(eng)


def test_device_fault_is_fatal(eng, monkeypatch):
  # last in the module: it stops the engine
  def broken(*a):
    raise RuntimeError("injected device fault")
  import k3_jax.serve.runner as runner_mod
  monkeypatch.setattr(eng.runner, "steps", eng.runner.steps._replace(
      decode=runner_mod.guard("decode", broken, set())))
  reqs = [eng.submit(prompt_of(i, 16), SamplingParams(max_tokens=4)) for i in range(2)]
  with pytest.raises(EngineFatal, match="injected device fault"):
    eng.run_until_done(reqs)
  assert isinstance(eng.fatal, EngineFatal)
  assert all(r.state == "done" and r.error_type == "engine_error" for r in reqs)
  with pytest.raises(EngineFatal):
    eng.submit(prompt_of(1, 5), SamplingParams(max_tokens=2))
