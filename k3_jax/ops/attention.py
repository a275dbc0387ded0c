"""Softmax attention references for Gated MLA: masks, plain and weight-absorbed forms, and
the plain-form latent attention (expand the latent KV, then attend).

Logits, softmax and accumulation in FP32. Both forms also return each head's maximum
pre-softmax logit over the batch (what QK-Clip watches), taken from logits they compute
anyway.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3_jax.ops import rope_pages

_NEG = -1e30


def causal_mask(q_pos: jax.Array, kv_pos: jax.Array, q_seg: jax.Array | None = None,
                kv_seg: jax.Array | None = None) -> jax.Array:
  """[B, T, S] bool: key s is visible to query t if kv_pos <= q_pos (and same segment)."""
  mask = kv_pos[:, None, :] <= q_pos[:, :, None]
  if q_seg is not None:
    mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
  return mask


def _softmax_masked(logits: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """logits [B, H, T, S] f32, mask [B, T, S] -> (probs, per-head max logit [H])."""
  m = mask[:, None]
  logits = jnp.where(m, logits, _NEG)
  max_logit = jnp.max(jnp.where(m, logits, -jnp.inf), axis=(0, 2, 3))
  return jax.nn.softmax(logits, axis=-1), max_logit


def attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
              mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q [B, T, H, Dk], k [B, S, H, Dk], v [B, S, H, Dv], mask [B, T, S]
  -> (o [B, T, H, Dv] in v.dtype, max_logit [H] f32)."""
  logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
  p, max_logit = _softmax_masked(logits, mask)
  o = jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32),
                 preferred_element_type=jnp.float32)
  return o.astype(v.dtype), max_logit


def absorbed_attention(q_latent: jax.Array, q_rope: jax.Array, c_kv: jax.Array,
                       k_rope: jax.Array, scale: float,
                       mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """MLA with W_kvb absorbed into the query: attends directly over the cached latents.

  q_latent [B, T, H, R] (= q_nope . W_kvb_k), q_rope [B, T, H, P], c_kv [B, S, R],
  k_rope [B, S, P] (shared by all heads), mask [B, T, S]
  -> (latent output [B, T, H, R] f32, to be multiplied by W_kvb_v; max_logit [H]).
  """
  logits = (jnp.einsum("bthr,bsr->bhts", q_latent, c_kv, preferred_element_type=jnp.float32)
            + jnp.einsum("bthp,bsp->bhts", q_rope, k_rope,
                         preferred_element_type=jnp.float32)) * scale
  p, max_logit = _softmax_masked(logits, mask)
  o = jnp.einsum("bhts,bsr->bthr", p, c_kv.astype(jnp.float32),
                 preferred_element_type=jnp.float32)
  return o, max_logit


def latent_attention(q_nope, q_rope, c_kv, k_r, w_kvb, scale: float, dtype,
                     q_segment_ids=None, kv_segment_ids=None, q_offset=0):
  """Plain-form MLA attention (training): expand the latent KV with W_kvb and attend.

  q_nope [B, T, H, n], q_rope [B, T, H, p] at positions q_offset + [0, T); c_kv [B, S, R],
  k_r [B, S, p] (shared by all heads) at positions [0, S); w_kvb [R, H, n + v]; segment
  ids [B, T] / [B, S] or None. Causal by position (and same segment).
  Returns (o [B, T, H, v] in dtype, max_logit [H])."""
  b, t, _, n = q_nope.shape
  s = c_kv.shape[1]
  kv = jax.lax.dot_general(c_kv.astype(dtype), w_kvb.astype(dtype), (((2,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(dtype)  # [B, S, H, n + v]
  k_nope, v = kv[..., :n], kv[..., n:]
  k = jnp.concatenate(
      [k_nope, jnp.broadcast_to(k_r[:, :, None, :], k_nope.shape[:3] + (k_r.shape[-1],))],
      axis=-1)
  q = jnp.concatenate([q_nope, q_rope], axis=-1)
  q_pos = jnp.broadcast_to(q_offset + jnp.arange(t)[None], (b, t))
  kv_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
  mask = causal_mask(q_pos, kv_pos, q_segment_ids, kv_segment_ids)
  return attention(q, k, v, scale, mask)


def blockwise_absorbed_attention(q_latent: jax.Array, q_rope: jax.Array, c_kv: jax.Array,
                                 k_rope: jax.Array, scale: float, q_pos: jax.Array,
                                 block_q: int = 1024,
                                 block_k: int = 1024) -> tuple[jax.Array, jax.Array]:
  """`absorbed_attention` under the causal mask "key s is visible to the query at position
  q_pos[b, t] iff s <= q_pos[b, t]", computed block by block (flash-style): queries in
  blocks of block_q, keys in blocks of block_k with an online softmax (running max and
  sum, FP32), and only the key blocks a query block can see (a dynamic trip count). Peak
  memory: one [B, H, block_q, block_k] logit tile instead of [B, H, T, S]; a 1M-token
  prompt's logits would be terabytes.

  q_latent [B, T, H, R], q_rope [B, T, H, P], c_kv [B, S, R], k_rope [B, S, P],
  q_pos [B, T] int (a query at q_pos < 0 sees nothing and gets 0)
  -> (latent output [B, T, H, R] f32, max_logit [H] f32). Equal to absorbed_attention with
  causal_mask(q_pos, arange(S)) up to the order of FP32 sums (tolerances in the tests)."""
  b, t, h, r = q_latent.shape
  s = c_kv.shape[1]
  bq, bk = min(block_q, t), min(block_k, s)
  nq, nk = -(-t // bq), -(-s // bk)
  pad = lambda a, n, axis, value=0: jnp.pad(
      a, [(0, n - a.shape[axis]) if i == axis else (0, 0) for i in range(a.ndim)],
      constant_values=value)
  # Padding: extra queries at position -1 (see nothing), extra keys past every query.
  # Queries are laid out [B, H, bq, X] inside the loop, so every matmul's result is in the
  # order its consumers read (XLA:CPU otherwise transposes each [B, H, bq, bk] logit tile
  # inside the masking and exponential fusions, and recomputes the transpose in both).
  heads_first = lambda a: jnp.swapaxes(a, 2, 3)        # [B, nq, bq, H, X] -> [B, nq, H, bq, X]
  ql = heads_first(pad(q_latent.astype(jnp.float32), nq * bq, 1).reshape(b, nq, bq, h, r))
  qr = heads_first(pad(q_rope.astype(jnp.float32), nq * bq, 1).reshape(b, nq, bq, h, -1))
  qp = pad(q_pos.astype(jnp.int32), nq * bq, 1, -1).reshape(b, nq, bq)
  ck = pad(c_kv, nk * bk, 1).reshape(b, nk, bk, r)
  kr = pad(k_rope, nk * bk, 1).reshape(b, nk, bk, -1)

  def query_block(args):
    ql, qr, qp = args                                  # [B, H, bq, R], [B, H, bq, P], [B, bq]
    # Key blocks this query block can see: those starting at or before its last position.
    n_vis = jnp.clip(jnp.max(qp) // bk + 1, 0, nk)

    def key_block(j, carry):
      m, l, acc = carry                                # [B, H, bq], [B, H, bq], [B, H, bq, R]
      c = jax.lax.dynamic_index_in_dim(ck, j, 1, keepdims=False).astype(jnp.float32)
      kp = jax.lax.dynamic_index_in_dim(kr, j, 1, keepdims=False).astype(jnp.float32)
      logits = (jnp.einsum("bhtr,bsr->bhts", ql, c, preferred_element_type=jnp.float32)
                + jnp.einsum("bhtp,bsp->bhts", qr, kp,
                             preferred_element_type=jnp.float32)) * scale
      visible = (j * bk + jnp.arange(bk))[None, None, :] <= qp[:, :, None]   # [B, bq, bk]
      logits = jnp.where(visible[:, None], logits, -jnp.inf)
      m_new = jnp.maximum(m, logits.max(-1))
      base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(logits - base[..., None])            # masked: exp(-inf) = 0
      corr = jnp.exp(m - base)                         # m = -inf (nothing seen yet): 0
      l = l * corr + p.sum(-1)
      acc = acc * corr[..., None] + jnp.einsum("bhts,bsr->bhtr", p, c,
                                               preferred_element_type=jnp.float32)
      return m_new, l, acc

    init = (jnp.full((b, h, bq), -jnp.inf, jnp.float32), jnp.zeros((b, h, bq), jnp.float32),
            jnp.zeros((b, h, bq, r), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_vis, key_block, init)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.swapaxes(o, 1, 2), m.max(axis=(0, 2))   # [B, bq, H, R], [H]

  blocks = (jnp.moveaxis(ql, 1, 0), jnp.moveaxis(qr, 1, 0), jnp.moveaxis(qp, 1, 0))
  o, max_logit = jax.lax.map(query_block, blocks)      # [nq, B, bq, H, R], [nq, H]
  o = jnp.moveaxis(o, 0, 1).reshape(b, nq * bq, h, r)[:, :t]
  return o, max_logit.max(0)


# ----- paged decode: one query per sequence over its cached pages, flash-decoding style -----

class Partial(NamedTuple):
  """Softmax partials of one query per sequence over some of its keys, the state of an
  online softmax. Partials over disjoint key sets combine exactly (`merge_partials`, or
  across shards with pmax / psum)."""
  m: jax.Array              # [B, H] running max logit, -inf where nothing was seen
  l: jax.Array              # [B, H] sum of exp(logit - m)
  acc: jax.Array            # [B, H, R] exp(logit - m)-weighted sum of the latents


def rescale(m: jax.Array, m_new: jax.Array) -> jax.Array:
  """exp(m - m_new), 0 where m = -inf (nothing seen), whatever m_new."""
  base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  return jnp.exp(m - base)


def merge_partials(a: Partial, b: Partial) -> Partial:
  """The partial over the union of two disjoint key sets."""
  m = jnp.maximum(a[0], b[0])
  ca, cb = rescale(a[0], m), rescale(b[0], m)
  return Partial(m, a[1] * ca + b[1] * cb, a[2] * ca[..., None] + b[2] * cb[..., None])


def finish_partial(p: Partial) -> jax.Array:
  """acc / l: the attention output [B, H, R] (0 for a query that saw nothing)."""
  m, l, acc = p
  return acc / jnp.where(l > 0, l, 1.0)[..., None]


def token_partial(q_latent: jax.Array, q_rope: jax.Array, c_kv: jax.Array, k_rope: jax.Array,
                  scale: float) -> Partial:
  """The partial of each query over one key per sequence (its own token's latents):
  q_latent [B, H, R], q_rope [B, H, P] f32, c_kv [B, R], k_rope [B, P]."""
  c, k = c_kv.astype(jnp.float32), k_rope.astype(jnp.float32)
  logit = (jnp.einsum("bhr,br->bh", q_latent, c, preferred_element_type=jnp.float32)
           + jnp.einsum("bhp,bp->bh", q_rope, k, preferred_element_type=jnp.float32)) * scale
  return Partial(logit, jnp.ones_like(logit), jnp.broadcast_to(c[:, None], q_latent.shape))


def window_partial(q_latent: jax.Array, q_rope: jax.Array, c_kv: jax.Array, k_rope: jax.Array,
                   scale: float, w: int) -> Partial:
  """The partial of each query over its window's keys up to its own: rows b w + t (q_latent
  [B w, H, R], q_rope [B w, H, P] f32; their latents c_kv [B w, R], k_rope [B w, P]) are
  one sequence's consecutive tokens, and row t sees rows t' <= t (token_partial at w = 1)."""
  n, h, r = q_latent.shape
  b = n // w
  c = c_kv.astype(jnp.float32).reshape(b, w, -1)
  k = k_rope.astype(jnp.float32).reshape(b, w, -1)
  logit = (jnp.einsum("bthr,bsr->bths", q_latent.reshape(b, w, h, r), c,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("bthp,bsp->bths", q_rope.reshape(b, w, h, -1), k,
                        preferred_element_type=jnp.float32)) * scale       # [B, w, H, w]
  seen = (jnp.arange(w)[None, :] <= jnp.arange(w)[:, None])[None, :, None]   # s <= t
  logit = jnp.where(seen, logit, -jnp.inf)
  m = logit.max(-1)
  p = jnp.exp(logit - m[..., None])
  acc = jnp.einsum("bths,bsr->bthr", p, c, preferred_element_type=jnp.float32)
  return Partial(m.reshape(n, h), p.sum(-1).reshape(n, h), acc.reshape(n, h, r))


# Pages read per step of the paged decode loop, by target platform: XLA:CPU runs a step's
# small matmuls fastest one 512-token page at a time (benchmarks/serve.py, docs/results.md);
# a TPU pays a fixed cost per loop step, so it takes more pages a step.
PAGES_PER_BLOCK = {"cpu": 1}
DEFAULT_PAGES_PER_BLOCK = 16


def pages_per_block(platform: str) -> int:
  return PAGES_PER_BLOCK.get(platform, DEFAULT_PAGES_PER_BLOCK)


# Query and key blocks of `blockwise_absorbed_attention` in a prompt's attention, by target
# platform. XLA:CPU: 512 (one page) each, not 1,024: a 512-token piece then reads the one
# key block its queries see instead of 1,024 keys half past them, and a long prompt wastes
# half a 512 block on the diagonal instead of half a 1,024 one (the served 15M Kimi-Linear,
# one process, A/B: 4 x 512-token prompts 362 vs 381 ms, one 4,096-token prompt 819 vs
# 897 ms). Elsewhere the function's defaults (compile's TPU roofline was priced with them).
PREFILL_BLOCKS = {"cpu": (512, 512)}


def prefill_blocks(platform: str) -> dict:
  """blockwise_absorbed_attention's block_q / block_k for `platform` ({}: its defaults)."""
  got = PREFILL_BLOCKS.get(platform)
  return {} if got is None else dict(block_q=got[0], block_k=got[1])


def paged_partial(q_latent, q_rope, pool_c, pool_r, pages, col_pos, q_pos, scale, unit=None,
                  block: int = 1, kernel: bool = False) -> Partial:
  """`paged_decode_partial`, or with kernel=True the Pallas TPU kernel of the same
  signature (pallas_kernels/paged_attention.py: each page read once, into VMEM)."""
  if kernel:
    from pallas_kernels.paged_attention import paged_decode_partial as pallas_partial
    return Partial(*pallas_partial(q_latent, q_rope, pool_c, pool_r, pages, col_pos, q_pos,
                                   scale, unit, block))
  return paged_decode_partial(q_latent, q_rope, pool_c, pool_r, pages, col_pos, q_pos, scale,
                              unit, block)


def paged_decode_partial(q_latent: jax.Array, q_rope: jax.Array, pool_c: jax.Array,
                         pool_r: jax.Array, pages: jax.Array, col_pos: jax.Array,
                         q_pos: jax.Array, scale: float, unit: jax.Array | None = None,
                         block: int = 1) -> Partial:
  """The softmax partial of one query per sequence over its cached keys, read from the page
  pool in place: blocks of `block` pages at a time (gathered from the pool, never the whole
  sequence), an online softmax over the blocks (FP32), and only as many blocks as the
  longest sequence needs (a dynamic trip count, so the cost tracks the bytes read).

  q_latent [B, H, R], q_rope [B, H, P] f32; pool_c [N, Pg, R], pool_r [N, Pg / f, f P] (its
  pages folded, k3_jax/ops/rope_pages.py; or, with `unit`, stacked pools [U, N, ...] read at
  that index); pages [B, M] int32 page ids;
  col_pos [M] int32: column j holds positions col_pos[j] + [0, Pg), increasing in j;
  q_pos [B]: key positions < q_pos[b] are visible (the query's own token is not in the
  pool: `token_partial`). Blocks past every query are skipped and partly visible ones
  masked, so a row's result does not depend on the other rows (batch invariance) nor on
  M beyond what it sees."""
  b, h, r = q_latent.shape
  m_cols = pages.shape[1]
  pg = pool_c.shape[-2]
  block = max(1, min(block, m_cols))                   # never more pages a step than columns
  nb = -(-m_cols // block)
  pad = nb * block - m_cols
  if pad:   # padded columns: the null page at a position no query sees
    pages = jnp.pad(pages, ((0, 0), (0, pad)))
    col_pos = jnp.pad(col_pos, (0, pad), constant_values=jnp.iinfo(jnp.int32).max // 2)
  n_vis = jnp.sum(col_pos < jnp.max(q_pos))            # columns any query can see
  trips = (n_vis + block - 1) // block
  lead = () if unit is None else (unit,)

  def step(i, carry):
    ids = jax.lax.dynamic_slice_in_dim(pages, i * block, block, axis=1)     # [B, block]
    first = jax.lax.dynamic_slice_in_dim(col_pos, i * block, block)          # [block]
    c = pool_c[lead + (ids,)].reshape(b, block * pg, r).astype(jnp.float32)
    k = rope_pages.unfold(pool_r[lead + (ids,)], q_rope.shape[-1]).reshape(
        b, block * pg, -1).astype(jnp.float32)
    logits = (jnp.einsum("bhr,bsr->bhs", q_latent, c, preferred_element_type=jnp.float32)
              + jnp.einsum("bhp,bsp->bhs", q_rope, k,
                           preferred_element_type=jnp.float32)) * scale
    kv_pos = (first[:, None] + jnp.arange(pg, dtype=first.dtype)[None]).reshape(-1)
    logits = jnp.where((kv_pos[None] < q_pos[:, None])[:, None], logits, -jnp.inf)
    m, l, acc = carry
    m_new = jnp.maximum(m, logits.max(-1))
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m_new), m_new, 0.0)[..., None])
    corr = rescale(m, m_new)
    return (m_new, l * corr + p.sum(-1),
            acc * corr[..., None] + jnp.einsum("bhs,bsr->bhr", p, c,
                                               preferred_element_type=jnp.float32))

  init = (jnp.full((b, h), -jnp.inf, jnp.float32), jnp.zeros((b, h), jnp.float32),
          jnp.zeros((b, h, r), jnp.float32))
  return Partial(*jax.lax.fori_loop(0, trips, step, init))
