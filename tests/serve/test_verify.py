"""The speculative verify step (k3_jax/serve/verify.py) against plain decode steps, on the
5-layer k3_tiny serving variant (KDA in the scanned unit, MLA in and after it, MoE, Attention
Residuals), with engine8's compiled steps and speculator8's verify step (k = 3) on a copy of
its cache (its shapes, so its compiled steps serve): slot 0 verifying, the other slots idle.

With every draft accepted the step must equal k + 1 decode steps (every position's logits
and the KDA states and conv tails after), and with a rejection at draft j it must equal
decoding the j + 1 kept tokens; a decode step after each then continues alike (reading the
kept positions' MLA latents). Tolerance: the verify step runs the same per-token operations
as decode (the one-step conv and recurrence, the paged decode attention over the pages plus
the token's own latents), but over B (k + 1) rows instead of B, and XLA:CPU sums a matmul's
products in another order for another row count: observed 1.4e-6 on logits of O(1), 5e-7
on states, so TOL = 1e-5 in float32. The idle slots' states must stay bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.serve import kv_pages as kv
from k3_jax.serve import steps
from k3_jax.serve.verify import VerifyBatch

K = 3
PROMPT = 48
TOL = 1e-5


@pytest.fixture(scope="module")
def setup(engine8, speculator8):
  e = engine8
  b, v = e.max_batch, e.cfg.vocab_size
  table = np.zeros((b, e.pages_per_slot), np.int32)    # engine8's one column (max_len 512)
  table[0, 0] = 3
  cache, _ = e.runner.jitted.zero_slot(jax.tree.map(jnp.copy, e.runner.cache), jnp.zeros((b, v), jnp.int32),
                                np.int32(0))
  prompt = np.random.default_rng(5).integers(1, 256, PROMPT).astype(np.int32)
  for at in range(0, PROMPT, 16):   # in engine8's 16-token pieces (compiled by test_overlap)
    logits, cache = e.runner.jitted.prefill(*e.runner.weights, cache, np.zeros(1, np.int32),
                                     prompt[None, at:at + 16], np.array([at], np.int32),
                                     table[:1], np.ones(1, bool), None)
  first = int(np.argmax(np.asarray(logits[0])))
  toks, ref_logits, ref_caches = [first], [], [cache]
  for i in range(K + 1):                          # the greedy continuation by plain decode
    got, c = decode(e, ref_caches[-1], table, toks[-1], PROMPT + i)
    ref_logits.append(np.asarray(got.logits[0]))
    ref_caches.append(c)
    toks.append(int(np.argmax(ref_logits[-1])))
  return e, speculator8, table, toks, np.stack(ref_logits), ref_caches


def sampling(e):
  """Greedy rows, with engine8's own bias array (the same argument types as its calls, so
  its compiled steps serve)."""
  b = e.max_batch
  z, zf = np.zeros(b, np.int32), np.zeros(b, np.float32)
  return steps.Sampling(z, z, zf, np.ones(b, np.float32), zf, zf, e.runner.zero_bias(b))


def decode(e, cache, table, tok, pos):
  """One plain decode step of slot 0 (on a copy of `cache`) -> (Sampled, cache)."""
  b, v = e.max_batch, e.cfg.vocab_size
  active = np.arange(b) == 0
  batch = steps.DecodeBatch(np.where(active, tok, 0).astype(np.int32),
                            np.where(active, pos, 0).astype(np.int32), table, active,
                            sampling(e), e.runner.prev, np.zeros(b, bool))
  got, cache, _ = e.runner.jitted.decode(*e.runner.weights, jax.tree.map(jnp.copy, cache),
                                  jnp.zeros((b, v), jnp.int32), batch)
  return got, cache


def verify(e, sp, cache, table, first, drafts):
  b, v = e.max_batch, e.cfg.vocab_size
  window, ndraft = np.zeros((b, K), np.int32), np.zeros(b, np.int32)
  window[0, :len(drafts)], ndraft[0] = drafts, len(drafts)
  active = np.arange(b) == 0
  batch = VerifyBatch(np.where(active, first, 0).astype(np.int32), window, ndraft,
                      np.where(active, PROMPT, 0).astype(np.int32), table, active,
                      sampling(e), np.arange(b, dtype=np.int32))
  got, emitted, cache, _ = sp._verify(*e.runner.weights, jax.tree.map(jnp.copy, cache),
                                      jnp.zeros((b, v), jnp.int32), batch)
  return np.asarray(got.ids).reshape(b, K + 1)[0], np.asarray(got.logits).reshape(
      b, K + 1, -1)[0], np.asarray(emitted), cache


def max_state_diff(got, want, slots):
  rows = lambda c: jax.tree.leaves(kv.take_rows(kv.kda_states(c), np.asarray(slots)))
  return max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(rows(got), rows(want)))


def assert_like_decoding(e, cache, ref_caches, n, table, next_tok):
  """cache (after a verify step that kept n tokens) holds slot 0's state after decoding n
  tokens, the idle slots' untouched, and the next decode step reads the same latents."""
  assert max_state_diff(cache, ref_caches[n], [0]) <= TOL
  assert max_state_diff(cache, ref_caches[0], range(1, e.max_batch)) == 0.0
  after_v, _ = decode(e, cache, table, next_tok, PROMPT + n)
  after_d, _ = decode(e, ref_caches[n], table, next_tok, PROMPT + n)
  np.testing.assert_allclose(np.asarray(after_v.logits[0]), np.asarray(after_d.logits[0]),
                             atol=TOL, rtol=0)


def test_all_accepted_equals_k_plus_1_decode_steps(setup):
  e, sp, table, toks, ref_logits, ref_caches = setup
  ids, logits, emitted, cache = verify(e, sp, ref_caches[0], table, toks[0], toks[1:K + 1])
  print("max |logit diff|", np.abs(logits - ref_logits).max(),
        "max |state diff|", max_state_diff(cache, ref_caches[K + 1], [0]))
  assert emitted.tolist() == [K + 1] + [0] * (e.max_batch - 1)
  assert ids.tolist() == toks[1:K + 2]             # the drafts, then the bonus token
  np.testing.assert_allclose(logits, ref_logits, atol=TOL, rtol=0)
  assert_like_decoding(e, cache, ref_caches, K + 1, table, toks[K + 1])


@pytest.mark.parametrize("j", [0, 2])
def test_rejection_at_j_equals_decoding_the_kept_tokens(setup, j):
  e, sp, table, toks, ref_logits, ref_caches = setup
  v = e.cfg.vocab_size
  drafts = toks[1:j + 1] + [(toks[j + 1] + 1 + i) % v for i in range(K - j)]   # wrong at j
  ids, logits, emitted, cache = verify(e, sp, ref_caches[0], table, toks[0], drafts)
  assert emitted[0] == j + 1
  assert ids[:j + 1].tolist() == toks[1:j + 2]     # the kept drafts, then the target's token
  assert_like_decoding(e, cache, ref_caches, j + 1, table, toks[j + 1])
