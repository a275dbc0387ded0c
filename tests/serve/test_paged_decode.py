"""The paged decode step against the contiguous model path (k3_jax/model.py prefill +
decode_step) on the 5-layer k3_tiny variant of test_engine.py: one MLA layer inside the
scanned unit (pools read in place, latents written after the loop) and one after it (pool
written, then read). The paged side runs the serving steps (steps.prefill_step over the
whole prompt, then steps.decode_step) on shuffled physical pages beside an idle slot; the
same prompt chunk grid on both sides, so only the decode attention's summation order (an
online softmax over pages plus the token's own term, against one softmax over the cache)
differs: logits to 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax import train
from k3_jax.model import create_model, decode_step, prefill
from k3_jax.partitioning import SINGLE
from k3_jax.serve import steps
from k3_jax.serve.kv_pages import PAGE
from tests.serve.test_engine import tiny_serving_config

TOL = 1e-5
PROMPT, NEW, PAGES = 700, 4, 4          # 700 + 4 tokens in 2 pages of a 4-page table


def paged_logits(cfg, model, prompt, num_pages, table, par=SINGLE, place=lambda a: a,
                 jit=jax.jit):
  """Greedy logits [NEW + 1, V] of slot 0 (slot 1 idle) through the serving steps."""
  g, p, r = train.split_model(model)
  b, v = 2, cfg.vocab_size
  cache = place(jax.tree.map(jnp.zeros_like,
                             jax.eval_shape(lambda: model.init_paged_cache(b, num_pages, PAGE))))
  s = steps.jit_steps(g, par, jit)
  counts = jnp.zeros((b, v), jnp.int32)
  logits, cache = s.prefill(p, r, cache, np.int32(0), prompt, np.int32(0), table[0])
  out = [np.asarray(logits)]
  z, zf = np.zeros(b, np.int32), np.zeros(b, np.float32)
  sampling = steps.Sampling(z, z, zf, np.ones(b, np.float32), zf, zf, np.zeros((b, v), np.float32))
  tables = np.zeros_like(table)
  tables[0] = table[0]
  for i in range(NEW):
    tok = np.array([int(np.argmax(out[-1])), 0], np.int32)
    pos = np.array([PROMPT + i, 0], np.int32)
    got, cache, counts = s.decode(p, r, cache, counts,
                                  steps.DecodeBatch(tok, pos, tables, np.array([True, False]),
                                                    sampling))
    out.append(np.asarray(got.logits[0]))
  return np.stack(out)


def test_paged_decode_matches_contiguous_model():
  cfg = tiny_serving_config()
  model = create_model(cfg, seed=3)
  prompt = np.random.default_rng(7).integers(1, 256, PROMPT).astype(np.int32)
  table = np.zeros((2, PAGES), np.int32)
  table[0] = [5, 2, 7, 0]                       # out of order; the last column unused
  got = paged_logits(cfg, model, prompt, 9, table)
  logits, cache = jax.jit(lambda t: prefill(model, t, PAGES * PAGE, last_only=True))(
      jnp.asarray(prompt[None]))
  want = [np.asarray(logits[0, -1])]
  step = jax.jit(lambda c, t: decode_step(model, c, t))
  for _ in range(NEW):
    step_logits, cache = step(cache, jnp.asarray([int(np.argmax(want[-1]))], jnp.int32))
    want.append(np.asarray(step_logits[0]))
  np.testing.assert_allclose(got, np.stack(want), atol=TOL, rtol=0)
