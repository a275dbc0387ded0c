"""The speculative verify step (k3_jax/serve/verify.py) against plain decode steps, on the
5-layer k3_tiny serving variant (KDA in the scanned unit, MLA in and after it, MoE, Attention
Residuals): two slots, slot 0 verifying k = 3 drafts, slot 1 idle.

With every draft accepted the step must equal k + 1 decode steps (every position's logits
and the KDA states after), and with a rejection at draft j it must equal decoding the j + 1
kept tokens; a decode step after each then continues alike (the MLA latents of the kept
positions). Tolerance: the verify step runs the same per-token operations as decode (the
one-step conv and recurrence, the paged decode attention), but over B (k + 1) rows instead
of B, so XLA may order a matmul's sums differently: STATE_TOL / LOGIT_TOL in float32
(observed: bitwise on XLA:CPU, see the asserts' first line)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax import train
from k3_jax.model import create_model
from k3_jax.partitioning import SINGLE
from k3_jax.serve import kv_pages as kv
from k3_jax.serve import steps
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.verify import VerifyBatch, verify_step
from tests.serve.test_engine import tiny_serving_config

K = 3
PROMPT = 21
STATE_TOL = LOGIT_TOL = 1e-5


@pytest.fixture(scope="module")
def setup():
  cfg = tiny_serving_config()
  model = create_model(cfg, seed=3)
  g, p, r = train.split_model(model)
  b, v = 2, cfg.vocab_size
  s = steps.jit_steps(g, SINGLE)
  verify = jax.jit(lambda p, r, c, n, batch: verify_step(g, SINGLE, p, r, c, n, batch))
  cache = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: model.init_paged_cache(b, 5, PAGE)))
  table = np.zeros((b, 2), np.int32)
  table[0] = [3, 1]
  prompt = np.random.default_rng(5).integers(1, 256, PROMPT).astype(np.int32)
  logits, cache = s.prefill(p, r, cache, np.zeros(1, np.int32), prompt[None],
                            np.zeros(1, np.int32), table[:1], np.ones(1, bool))
  first = int(np.argmax(np.asarray(logits[0])))
  return cfg, (p, r), s, verify, cache, table, first


def sampling(b, v, **kw):
  z, zf = np.zeros(b, np.int32), np.zeros(b, np.float32)
  base = dict(seeds=z, steps=z, temperature=zf, top_p=np.ones(b, np.float32), presence=zf,
              frequency=zf, bias=np.zeros((b, v), np.float32))
  base.update(kw)
  return steps.Sampling(**base)


def copy(tree):
  return jax.tree.map(jnp.copy, tree)


def decode_run(s, w, cache, table, tokens, v):
  """Plain decode steps feeding `tokens` to slot 0 -> (logits [n, V], the caches after each)."""
  b = table.shape[0]
  counts = jnp.zeros((b, v), jnp.int32)
  out, caches = [], []
  z = np.zeros(b, np.int32)
  for i, tok in enumerate(tokens):
    batch = steps.DecodeBatch(np.array([tok, 0], np.int32), np.array([PROMPT + i, 0], np.int32),
                              table, np.array([True, False]), sampling(b, v), z,
                              np.zeros(b, bool))
    got, cache, counts = s.decode(*w, cache, counts, batch)
    out.append(np.asarray(got.logits[0]))
    caches.append(copy(cache))
  return np.stack(out), caches


def assert_states(got, want, tol, slot=0):
  """The KDA states and conv tails of `slot` in two caches agree to tol."""
  rows = lambda c: jax.tree.leaves(kv.take_rows(kv.kda_states(c), np.array([slot])))
  diffs = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(rows(got), rows(want))]
  print(f"slot {slot}: max |state diff| {max(diffs)}")
  assert max(diffs) <= tol


def verify_run(verify, w, cache, table, first, drafts, v):
  b = table.shape[0]
  batch = VerifyBatch(np.array([first, 0], np.int32),
                      np.array([drafts, [0] * K], np.int32),
                      np.array([len(drafts), 0], np.int32), np.array([PROMPT, 0], np.int32),
                      table, np.array([True, False]), sampling(b, v))
  got, emitted, cache, counts = verify(*w, copy(cache), jnp.zeros((b, v), jnp.int32), batch)
  return got, np.asarray(emitted), cache


def test_verify_equals_decode_steps(setup):
  cfg, w, s, verify, cache0, table, first = setup
  v = cfg.vocab_size
  # the greedy continuation by plain decode: its tokens are drafts verify must all accept
  toks = [first]
  ref_logits, ref_caches = decode_run(s, w, copy(cache0), table, [first] * 1, v)
  for i in range(K):
    toks.append(int(np.argmax(ref_logits[-1])))
    ref_logits, ref_caches = decode_run(s, w, copy(cache0), table, toks, v)
  got, emitted, cache = verify_run(verify, w, cache0, table, first, toks[1:], v)
  logits = np.asarray(got.logits).reshape(2, K + 1, -1)[0]
  print("all accepted: max |logit diff|", np.abs(logits - ref_logits).max())
  assert emitted.tolist() == [K + 1, 0]
  np.testing.assert_allclose(logits, ref_logits, atol=LOGIT_TOL, rtol=0)
  assert np.asarray(got.ids).reshape(2, K + 1)[0, :K].tolist() == toks[1:]
  assert_states(cache, ref_caches[-1], STATE_TOL)
  # the next decode step from either cache (reads the verified positions' MLA latents)
  nxt = int(np.asarray(got.ids).reshape(2, K + 1)[0, K])
  after_v, _ = decode_run_at(s, w, cache, table, nxt, PROMPT + K + 1, v)
  after_d, _ = decode_run_at(s, w, ref_caches[-1], table, nxt, PROMPT + K + 1, v)
  np.testing.assert_allclose(after_v, after_d, atol=LOGIT_TOL, rtol=0)


def decode_run_at(s, w, cache, table, tok, pos, v):
  b = table.shape[0]
  z = np.zeros(b, np.int32)
  batch = steps.DecodeBatch(np.array([tok, 0], np.int32), np.array([pos, 0], np.int32), table,
                            np.array([True, False]), sampling(b, v), z, np.zeros(b, bool))
  got, cache, _ = s.decode(*w, copy(cache), jnp.zeros((b, v), jnp.int32), batch)
  return np.asarray(got.logits[0]), cache


@pytest.mark.parametrize("j", [0, 2])
def test_rejection_keeps_only_accepted_tokens(setup, j):
  cfg, w, s, verify, cache0, table, first = setup
  v = cfg.vocab_size
  toks = [first]
  for i in range(K):
    ref_logits, _ = decode_run(s, w, copy(cache0), table, toks, v)
    toks.append(int(np.argmax(ref_logits[-1])))
  drafts = toks[1:j + 1] + [(toks[j + 1] + 1 + i) % v for i in range(K - j)]   # wrong at j
  ref_logits, ref_caches = decode_run(s, w, copy(cache0), table, toks[:j + 1], v)
  got, emitted, cache = verify_run(verify, w, cache0, table, first, drafts, v)
  assert emitted.tolist() == [j + 1, 0]
  ids = np.asarray(got.ids).reshape(2, K + 1)[0]
  assert ids[:j + 1].tolist() == toks[1:j + 2]       # the kept drafts, then the target's token
  assert_states(cache, ref_caches[-1], STATE_TOL)
  assert_states(cache, cache0, 0.0, slot=1)          # the idle slot's state is untouched
  after_v, _ = decode_run_at(s, w, cache, table, int(ids[j]), PROMPT + j + 1, v)
  after_d, _ = decode_run_at(s, w, ref_caches[-1], table, int(ids[j]), PROMPT + j + 1, v)
  np.testing.assert_allclose(after_v, after_d, atol=LOGIT_TOL, rtol=0)
