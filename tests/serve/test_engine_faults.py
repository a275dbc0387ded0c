"""Fault containment in the engine (docs/faults.md, Serving): a fault while handling one of
several concurrent requests fails that request alone (its slot, pages and prefix-cache pins
freed) while the others finish with exactly their solo outputs; a fault of the device step
stops the engine (Engine.fatal) and fails everything. Reuses the tiny 5-layer k3_tiny engine
of test_engine.py (greedy decoding, so "equal" is exact)."""

import numpy as np
import pytest

import configs
from k3_jax.config import apply_overrides, validate
from k3_jax.data.tokenizers import ByteTokenizer
from k3_jax.serve.engine import Engine, SamplingParams
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.requests import EngineFatal
from k3_jax import train
from k3_jax.model import create_model



def tiny_serving_config():
  return validate(apply_overrides(configs.get("k3_tiny"),
                                  ["max_seq_len=2048", "num_layers=5", "mla_layers=(4,5)"]))


def prompt_of(seed, n):
  return np.random.default_rng(seed).integers(1, 256, n).astype(np.int32)


@pytest.fixture(scope="module")
def eng():
  cfg = tiny_serving_config()
  g, p, r = train.split_model(create_model(cfg, seed=3))
  # batch invariant: one step shape per piece (fewer compiles; the default's row buckets
  # are tested in test_prefill_batching.py and through test_server.py's server)
  return Engine(cfg, g, p, r, max_batch=3, max_len=PAGE * 2, prefix_cache_bytes=1 << 22,
                tokenizer=ByteTokenizer(), batch_invariant=True)


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
