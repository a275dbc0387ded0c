"""Gated Multi-head Latent Attention (docs/architecture.md section 3), NoPE.

    c_q  = RMSNorm(W_qa x);   q = W_qb c_q            (or q = W_q x without q_lora)
    ckv  = W_kva x;  c_kv = RMSNorm(ckv[:R]);  k_r = ckv[R:]   (k_r shared by all heads)
    [k_nope, v] = W_kvb c_kv;  k = [k_nope ; k_r]
    o    = softmax(q k^T / sqrt(nope + rope) + mask) v
    y    = W_o [ sigmoid(W_g x) * o ]                 (no gate in Kimi Linear)

Training runs the plain form. With a cache (prefill and decode) W_kvb is absorbed into the
query and output sides and attention runs over the cached latents: the cache holds only
c_kv and k_r, (R + P) values per token (an MLACache, k3_jax/cache.py).

Paged cache (serving, k3_jax/serve): the latents live in a pool of fixed-size pages shared
by all sequences, with the call's page table (a PagedMLACache), and `pos` is then a
per-sequence [B] position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.cache import MLACache, PagedMLACache
from k3_jax.config import ModelConfig, jnp_dtype
from k3_jax.layers.init import Init
from k3_jax.layers.linear import Linear, few_rows
from k3_jax.layers.norm import RMSNorm
from k3_jax.ops import attention as attn_ops
from k3_jax.ops.mx_gmm import StackedLayer
from k3_jax.ops import rope_pages
from k3_jax.partitioning import SINGLE, Parallel


class MLA(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, init: Init, out_std: float | None = None):
    c, d = cfg.mla, cfg.d_model
    h, n, p, vd, r = (c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                      c.kv_lora_rank)
    dt, pdt = jnp_dtype(cfg.dtype), jnp_dtype(cfg.param_dtype)
    self.c, self.dtype = c, dt
    self.scale = (n + p) ** -0.5
    lin = dict(init=init, dtype=dt, param_dtype=pdt)
    latent_eps = c.latent_norm_eps or cfg.norm_eps
    if c.q_lora_rank:
      self.q_a = Linear(d, c.q_lora_rank, ("embed", "q_lora"), **lin)
      self.q_norm = RMSNorm(c.q_lora_rank, eps=latent_eps, param_dtype=pdt, axis_name="q_lora")
      self.q_b = Linear(c.q_lora_rank, (h, n + p), ("q_lora", "heads", "head_dim"),
                        batch_axes=("heads",), **lin)
    else:
      self.q_proj = Linear(d, (h, n + p), ("embed", "heads", "head_dim"), batch_axes=("heads",),
                           **lin)
    self.kv_a = Linear(d, r + p, ("embed", "kv_lora"), **lin)
    self.kv_norm = RMSNorm(r, eps=latent_eps, param_dtype=pdt, axis_name="kv_lora")
    self.kv_b = Linear(r, (h, n + vd), ("kv_lora", "heads", "head_dim"), batch_axes=("heads",),
                       **lin)
    if c.output_gate:
      self.g_proj = Linear(d, (h, vd), ("embed", "heads", "head_dim"), **lin)
    self.o_proj = Linear((h, vd), d, ("heads", "head_dim", "embed"), std=out_std, **lin)

  def init_cache(self, batch: int, max_len: int) -> MLACache:
    return MLACache(c_kv=jnp.zeros((batch, max_len, self.c.kv_lora_rank), self.dtype),
                    k_r=jnp.zeros((batch, max_len, self.c.qk_rope_head_dim), self.dtype))

  def init_paged_cache(self, num_pages: int, page_size: int) -> PagedMLACache:
    """The page pool of this layer (the page table is attached per call by the engine); the
    rope keys' pages folded to lane width (k3_jax/ops/rope_pages.py)."""
    return PagedMLACache(
        c_kv=jnp.zeros((num_pages, page_size, self.c.kv_lora_rank), self.dtype),
        k_r=jnp.zeros(rope_pages.pool_shape(num_pages, page_size, self.c.qk_rope_head_dim),
                      self.dtype))

  @jax.named_scope("projections")
  def _query(self, x, par: Parallel = SINGLE):
    if self.c.q_lora_rank:     # node decode: q_a's normed output gathered for q_b, split on
      q_low = self.q_norm(par.by_output(self.q_a(x)))                  # its output
      q = par.by_output(self.q_b(par.gathered(q_low, (None, None, "embed"))), heads=True)
      if not par.heads_grouped(q.shape[-2]):    # (grouped heads: by sequence after kv_b's
        q = par.by_batch(q)                     # absorption, `_absorb_query`)
    else:
      q = self.q_proj(x)
    n = self.c.qk_nope_head_dim
    return q[..., :n], q[..., n:]                                      # [B, T, H, n], [.., p]

  @jax.named_scope("projections")
  def _latent(self, x):
    ckv = self.kv_a(x)                                                 # [B, T, R + P]
    r = self.c.kv_lora_rank
    return self.kv_norm(ckv[..., :r]), ckv[..., r:]                    # [B, T, R], [B, T, P]

  @jax.named_scope("output")
  def _output(self, x, o, par: Parallel = SINGLE, heads: bool = False):
    """heads: o [B, T, H, V] comes by token group with its heads split (`heads_grouped`),
    the gate is taken so too and the product gathered within the group on H."""
    if self.c.output_gate:     # node decode: the gate (split on its output) sent by sequence
      g = par.by_output(self.g_proj(x), heads=True)
      g = g if heads else par.by_batch(g)
      o = jax.nn.sigmoid(g.astype(jnp.float32)) * o.astype(jnp.float32)
    if heads:
      return self.o_proj(par.gathered_heads(o.astype(self.dtype)))
    # node decode: gathered whole for o_proj (split on its output, the model dimension)
    return self.o_proj(par.gathered(o.astype(self.dtype), ("batch", None, None, None)))

  @jax.named_scope("mla")
  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
               cache: MLACache | PagedMLACache | None = None, pos: jax.Array | int = 0,
               par: Parallel = SINGLE):
    """x [B, T, D] -> (y [B, T, D], new cache or None, max_logit [H]).

    Without a cache: causal (and segment) masked attention over x itself. With a cache:
    x holds tokens at positions pos..pos+T-1; their latents are written into the cache and
    they attend over cache positions <= their own (segment_ids are not used then).
    par: the parallel setup (k3_jax/partitioning.py).
    """
    b, t, _ = x.shape
    c = self.c
    x = par.gathered(x, ("batch", None, None))   # node decode: once for every projection
    q_nope, q_rope = self._query(x, par)
    c_kv, k_r = self._latent(x)
    if cache is None:
      o, max_logit = self._attention(q_nope, q_rope, c_kv, k_r, segment_ids, par)
      return self._output(x, o), None, max_logit
    if isinstance(cache, PagedMLACache):
      return self._paged(x, q_nope, q_rope, c_kv, k_r, cache, pos, par)
    # Absorbed path over the latent cache.
    new_cache = MLACache(
        c_kv=jax.lax.dynamic_update_slice_in_dim(cache.c_kv, c_kv.astype(self.dtype),
                                                 pos, axis=1),
        k_r=jax.lax.dynamic_update_slice_in_dim(cache.k_r, k_r.astype(self.dtype),
                                                pos, axis=1))
    q_pos = jnp.broadcast_to(pos + jnp.arange(t)[None], (b, t))
    y, max_logit = self._absorbed(x, q_nope, q_rope, new_cache.c_kv, new_cache.k_r, q_pos,
                                  par)
    return y, new_cache, max_logit

  @jax.named_scope("attention")
  def _attention(self, q_nope, q_rope, c_kv, k_r, segment_ids, par: Parallel = SINGLE):
    """The plain (training) form over the sequence itself -> (o [B, T, H, V], max_logit)."""
    q_nope, q_rope = (par.constrain(a, ("batch", "seq", "heads", None)) for a in (q_nope, q_rope))
    attend = par.ops.latent_attention or attn_ops.latent_attention     # sequence-parallel
    return attend(q_nope, q_rope, c_kv, k_r, self.kv_b.w[...], self.scale, self.dtype,
                  segment_ids, segment_ids)

  def _absorb_query(self, q_nope, q_rope, par: Parallel = SINGLE):
    """(q_nope . W_kvb_k [B, T, H, R], q_rope [B, T, H, P]) in f32, and W_kvb_v [R, H, V].
    Node decode of few rows (`few_rows`; kv_b split on R there: compile.weights_by_output):
    q_nope gathered whole, q_lat computed on R's split and sent back by sequence."""
    n, held = self.c.qk_nope_head_dim, self.kv_b.w.get_value()
    if isinstance(held, StackedLayer):     # node decode: each half read in place (model.py)
      r, h, f = held.shape
      half = lambda lo, size: jax.lax.dynamic_slice(
          held.stack, (held.index, 0, 0, lo), (1, r, h, size))[0].astype(jnp.float32)
      w_k, w_v = half(0, n), half(n, f - n)
    else:
      w = self.kv_b.w[...].astype(jnp.float32)                         # [R, H, n + v]
      w_k, w_v = w[..., :n], w[..., n:]
    few = few_rows(q_nope, par)
    if few:
      q_nope = par.gathered(q_nope, ("batch", None, None, None))
    q_lat = jnp.einsum("bthn,rhn->bthr", q_nope.astype(jnp.float32), w_k)
    if few:
      q_lat = par.by_batch(par.by_output(q_lat))
    if par.heads_grouped(q_nope.shape[-2]):     # token groups: absorbed where the heads lie
      q_lat = par.by_batch(par.by_output(q_lat, heads=True))
      q_rope = par.by_batch(q_rope)
    return q_lat, q_rope.astype(jnp.float32), w_v

  @jax.named_scope("absorbed_attention")
  def _absorbed(self, x, q_nope, q_rope, c_kv_all, k_r_all, q_pos, par: Parallel = SINGLE):
    """Absorbed attention of the queries at positions q_pos [B, T] over latents [B, S, R] /
    [B, S, P] (key s visible iff s <= the query's position). One token (decode): one
    masked softmax over the cache. A prompt (prefill): blockwise, never the [H, T, S]
    logits, and on a mesh that splits the sequence each shard takes its own queries
    (sharding/context.py)."""
    b, t = q_pos.shape
    q_lat, q_rope, w_v = self._absorb_query(q_nope, q_rope)
    if t == 1:
      s = c_kv_all.shape[1]
      mask = attn_ops.causal_mask(q_pos, jnp.broadcast_to(jnp.arange(s)[None], (b, s)))
      o_lat, max_logit = attn_ops.absorbed_attention(
          q_lat, q_rope, c_kv_all.astype(jnp.float32), k_r_all.astype(jnp.float32),
          self.scale, mask)
    else:
      q_lat, q_rope = (par.constrain(a, ("batch", "seq", "heads", None))
                       for a in (q_lat, q_rope))
      attend = par.ops.absorbed_attention or functools.partial(
          attn_ops.blockwise_absorbed_attention, **attn_ops.prefill_blocks(par.platform))
      o_lat, max_logit = attend(q_lat, q_rope, c_kv_all, k_r_all, self.scale, q_pos)
    o = jnp.einsum("bthr,rhv->bthv", o_lat, w_v)                       # [B, T, H, V]
    return self._output(x, o), max_logit

  @jax.named_scope("paged_decode_attention")
  def _paged_decode(self, x, q_nope, q_rope, new_c, new_r, pool_c, pool_r, unit, table, pos,
                    par: Parallel = SINGLE, window: int = 1):
    """One token per sequence at positions pos [B]: attention over the cached positions
    < pos read from the pages in place (never a gathered copy of the sequence) merged with
    the token's own latents (new_c [B, 1, R], new_r [B, 1, P]), flash-decoding style. On a
    mesh whose page axis is split, each shard reads its own pages and the partials combine
    across shards (par.ops.paged_attention). window w > 1 (a verify step): rows b w + t
    are one sequence's positions pos[b w] + t, so the pages below pos[b w] are read once
    for a group of its rows (their queries as heads; window_group rows a read) and each
    row's window part (the rows t' <= t) comes from the call's own latents: the same keys,
    summed in another order."""
    q_lat, q_rope, w_v = self._absorb_query(q_nope, q_rope, par)
    q_lat, q_rope = q_lat[:, 0], q_rope[:, 0]                          # [B, H, R], [B, H, P]
    attend = par.ops.paged_attention or paged_attention
    w = window
    if w > 1:   # speculation: a sequence's w rows read its pages below the first row
      g = window_group(w, q_lat.shape[1] * q_lat.shape[2] * 4)
      fold = lambda a: a.reshape((a.shape[0] // g, g * a.shape[1]) + a.shape[2:])
      first = lambda a: jnp.repeat(a[::w], w // g, axis=0)
      cached = attend(fold(q_lat), fold(q_rope), pool_c, pool_r, unit, first(table),
                      first(pos), self.scale, attn_ops.pages_per_block(par.platform),
                      kernel=par.platform == "tpu")
      cached = attn_ops.Partial(*(a.reshape((-1,) + q_lat.shape[1:a.ndim]) for a in cached))
      own = attn_ops.window_partial(q_lat, q_rope, new_c[:, 0], new_r[:, 0], self.scale, w)
    else:
      cached = attend(q_lat, q_rope, pool_c, pool_r, unit, table, pos, self.scale,
                      attn_ops.pages_per_block(par.platform), kernel=par.platform == "tpu")
      own = attn_ops.token_partial(q_lat, q_rope, new_c[:, 0], new_r[:, 0], self.scale)
    part = attn_ops.merge_partials(cached, own)
    o_lat = attn_ops.finish_partial(part)[:, None]                     # [B, 1, H, R]
    heads = par.heads_grouped(o_lat.shape[-2])
    if few_rows(o_lat, par):      # node decode, kv_b split on R: o's partial sums
      o = par.einsum_by_batch("bthr,rhv->bthv", o_lat, w_v,      # reduce-scattered by sequence
                              (None, None, None, "embed"), ("embed", None, None))
    elif heads:                   # token groups: o_lat to its heads' devices, kv_b's there
      o = par.by_output(jnp.einsum("bthr,rhv->bthv", par.by_output(o_lat, heads=True), w_v),
                        heads=True)
    else:
      o = jnp.einsum("bthr,rhv->bthv", o_lat, w_v)
    return self._output(x, o, par, heads), part.m.max(axis=0)

  def _paged(self, x, q_nope, q_rope, c_kv, k_r, cache, pos, par: Parallel = SINGLE):
    """Tokens at per-sequence positions pos[b] + [0, T): write their latents into the pages
    the page table names, then attend over the sequence's pages (gathered in order)."""
    b, t, _ = x.shape
    table = cache.page_table                                           # [B, M] int32
    if table is None:
      raise ValueError("a paged MLA cache needs its page table (kv_pages.with_pages)")
    page_size = cache.c_kv.shape[-2]                                   # P (of [(R,) N, P, X])
    pos = jnp.broadcast_to(jnp.asarray(pos, jnp.int32), (b,))
    q_pos = pos[:, None] + jnp.arange(t, dtype=jnp.int32)[None]        # [B, T]
    m = table.shape[1]
    new_c, new_r = c_kv.astype(self.dtype), k_r.astype(self.dtype)
    lead = () if cache.unit is None else (cache.unit,)
    if cache.deferred:
      # A scanned layer whose pools are written after the scan (model.POOL_WRITES): read
      # them as they are, return only the new latents.
      pool_c, pool_r = cache.c_kv, cache.k_r
      new_cache = PagedMLACache(c_kv=new_c, k_r=new_r, page_table=table, unit=cache.unit,
                                deferred=True)
    else:
      # Write first, then read: the pools (donated; a scanned layer's stacked pools ride in
      # the scan's carry, read and written at this unit's index) are updated in place and
      # only read after, so no step copies a pool whatever its size.
      page, off = page_slots(table, q_pos, page_size)                  # [B, T] each
      pool_c = cache.c_kv.at[lead + (page, off)].set(new_c)            # [(R,) N, P, R]
      pool_r = rope_pages.write(cache.k_r, lead + (page,), off, new_r)  # [(R,) N, P/f, f Pr]
      new_cache = PagedMLACache(c_kv=pool_c, k_r=pool_r, page_table=table, unit=cache.unit)
    if t == 1:   # the pool's copy of the token is not read: it is merged as its own partial
      y, max_logit = self._paged_decode(x, q_nope, q_rope, new_c, new_r, pool_c, pool_r,
                                        cache.unit, table, pos, par, cache.window)
      return y, new_cache, max_logit
    c_all = pool_c[lead + (table,)].reshape(b, m * page_size, -1)      # [B, S = M P, R]
    r_all = rope_pages.unfold(pool_r[lead + (table,)], new_r.shape[-1]).reshape(
        b, m * page_size, -1)                                          # [B, S, Pr]
    if cache.deferred:   # this call's latents at their positions in the gathered view
      rows = jnp.arange(b)[:, None]
      c_all, r_all = c_all.at[rows, q_pos].set(new_c), r_all.at[rows, q_pos].set(new_r)
    y, max_logit = self._absorbed(x, q_nope, q_rope, c_all, r_all, q_pos, par)
    return y, new_cache, max_logit


WINDOW_QUERY_BYTES = 1 << 20    # a verify step's folded queries a paged read at most


def window_group(w: int, row_bytes: int) -> int:
  """How many of a sequence's w window rows share one read of its pages: the largest
  divisor of w whose queries (row_bytes each, f32 [H, R]) fit WINDOW_QUERY_BYTES (the TPU
  kernel holds them, its accumulator alike, in VMEM: k3 at K = 7, 8 x 96 heads of 512, ran
  out), at least 1."""
  return max(d for d in range(1, w + 1) if w % d == 0 and (d == 1 or
                                                            d * row_bytes <= WINDOW_QUERY_BYTES))


def paged_attention(q_latent, q_rope, pool_c, pool_r, unit, table, pos, scale, block=1,
                    kernel=False):
  """One device's paged decode attention: every column of the page table [B, M] (column j
  holds positions j P ... (j + 1) P - 1) over the pool -> the softmax Partial of the
  positions < pos [B] (k3_jax/ops/attention.py paged_decode_partial, `block` pages a step;
  kernel: the Pallas TPU kernel instead)."""
  page_size = pool_c.shape[-2]
  col_pos = jnp.arange(table.shape[1], dtype=jnp.int32) * page_size
  return attn_ops.paged_partial(q_latent, q_rope, pool_c, pool_r, table, col_pos, pos,
                                scale, unit, block, kernel)


def page_slots(table: jax.Array, q_pos: jax.Array, page_size: int):
  """(page [B, T], offset [B, T]) where positions q_pos [B, T] live, by page table [B, M]."""
  page = jnp.take_along_axis(table, q_pos // page_size, axis=1)
  return page, q_pos % page_size
