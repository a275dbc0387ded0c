"""Paged MLA decode attention as a Pallas TPU kernel: the softmax partial of one query per
sequence over its cached latents, read from the page pool through the page table.

Same signature and result as the plain-JAX `k3_jax.ops.attention.paged_decode_partial`
(plus `interpret`), which gathers `block` pages a loop step into a copy, converts it to FP32
and reads it twice (logits, then the weighted sum): about four passes over the latents. Here
each grid step DMAs one page of latents [P, R] and rope keys from HBM into VMEM (the page
id comes from the table, in SMEM, through the block index map) and both matmuls read it
there: one pass. The rope keys' pages are folded to lane width ([P / f, f Pr], lane block i
holding positions i P / f ... (i + 1) P / f - 1; k3_jax/ops/rope_pages.py); the kernel takes
the page in f runs of P / f positions, each run's latent rows against the queries' i-th
zero-padded rope block (rope_pages.fold_queries), so no lane is sliced.

Grid (B, M): sequence b, table column j, columns "arbitrary" (in order). The online
softmax state (running max m [H, 1], sum l [H, 1], weighted latents acc [H, R], FP32) lives
in VMEM scratch across the columns of one sequence and is written out after its last
column. A column whose first position the query cannot see (col_pos[j] >= q_pos[b]) does no
work, and its index map repeats the sequence's first page, so after the first such column
no page is fetched for it. Positions past q_pos inside a visible page are masked.

    q_latent [B, H, R] f32, q_rope [B, H, Pr] f32     (absorbed queries)
    pool_c [N, P, R], pool_r [N, P / f, f Pr]  (or stacked [U, N, ...] with `unit`)
    pages [B, M] int32 page ids; col_pos [M] int32 first position of each column
    q_pos [B] int32: positions < q_pos[b] are visible
    returns (m [B, H], l [B, H], acc [B, H, R]) FP32

Numerics: FP32 throughout (pages converted in VMEM, matmuls at HIGHEST precision), the
same online-softmax recurrence as the reference with one page a step, so the two differ by
float32 rounding of the matmul sums only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3_jax.ops import rope_pages

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


def _kernel(pages_ref, col_ref, qpos_ref, unit_ref, ql_ref, qr_ref, c_ref, r_ref,
            m_out, l_out, acc_out, m_scr, l_scr, acc_scr, *, scale: float, fold: int):
  del pages_ref, unit_ref
  b, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, _F32)
    l_scr[...] = jnp.zeros(l_scr.shape, _F32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, _F32)

  first, seen = col_ref[j], qpos_ref[b]

  @pl.when(first < seen)
  def _step():
    k = r_ref[...].astype(_F32)                                        # [P/f, f Pr]
    n = k.shape[0]
    nt = (((1,), (1,)), ((), ()))
    parts = []
    for i in range(fold):      # lane block i of the rope keys: positions i n ... (i + 1) n - 1
      c = c_ref[i * n:(i + 1) * n, :].astype(_F32)                     # [n, R]
      logits = (jax.lax.dot_general(ql_ref[...], c, nt, precision=_HI,
                                    preferred_element_type=_F32)
                + jax.lax.dot_general(qr_ref[i], k, nt, precision=_HI,
                                      preferred_element_type=_F32)) * scale    # [H, n]
      pos = first + i * n + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
      parts.append((jnp.where(pos < seen, logits, -jnp.inf), c))
    m = m_scr[...]                                                     # [H, 1]
    m_new = m
    for logits, _ in parts:
      m_new = jnp.maximum(m_new, jnp.max(logits, axis=1, keepdims=True))
    base = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    corr = jnp.exp(m - base)                                           # 0 where m = -inf
    l_new, acc_new = l_scr[...] * corr, acc_scr[...] * corr
    for logits, c in parts:
      p = jnp.exp(logits - base)
      l_new = l_new + jnp.sum(p, axis=1, keepdims=True)
      acc_new = acc_new + jax.lax.dot_general(p, c, (((1,), (0,)), ((), ())), precision=_HI,
                                              preferred_element_type=_F32)
    l_scr[...] = l_new
    acc_scr[...] = acc_new
    m_scr[...] = m_new

  @pl.when(j == pl.num_programs(1) - 1)
  def _out():
    m_out[...] = m_scr[...]
    l_out[...] = l_scr[...]
    acc_out[...] = acc_scr[...]


def cost(b: int, h: int, m: int, page: int, r: int, pr: int, itemsize: int,
         fold: int = 1) -> pl.CostEstimate:
  """Every column's page read once (the bound: all columns visible), the queries, and the
  partials written; two matmuls per page (the rope keys' over the f-fold queries, whose
  zero lanes the kernel multiplies too)."""
  return pl.CostEstimate(
      flops=2 * b * m * h * page * (2 * r + fold * pr), transcendentals=b * m * h * page,
      bytes_accessed=b * m * page * (r + pr) * itemsize + b * h * (r + fold * fold * pr) * 4
      + b * h * (r + 2) * 4)


def paged_decode_partial(q_latent, q_rope, pool_c, pool_r, pages, col_pos, q_pos, scale,
                         unit=None, block=1, interpret=False):
  """See the module docstring. `block` (pages a loop step in the reference) is accepted for
  the same signature; the kernel always fetches one page a grid step, double-buffered."""
  del block
  b, h, r = q_latent.shape
  pr = q_rope.shape[-1]
  if pool_c.ndim == 3:                                 # one layer's pools: a free reshape
    pool_c, pool_r = pool_c[None], pool_r[None]
    unit = jnp.zeros((), jnp.int32)
  page = pool_c.shape[-2]
  n, width = pool_r.shape[-2:]                         # folded rope pages [P / f, f Pr]
  fold = width // pr
  m = pages.shape[1]
  unit = jnp.asarray(unit, jnp.int32).reshape(1)

  def page_map(bi, j, pages_ref, col_ref, qpos_ref, unit_ref):
    visible = col_ref[j] < qpos_ref[bi]
    pid = jnp.where(visible, pages_ref[bi, j], pages_ref[bi, 0])     # unseen: no new fetch
    return unit_ref[0], pid, 0, 0

  row = lambda bi, j, *refs: (bi, 0, 0)
  out_shape = (jax.ShapeDtypeStruct((b, h, 1), _F32), jax.ShapeDtypeStruct((b, h, 1), _F32),
               jax.ShapeDtypeStruct((b, h, r), _F32))
  m_, l_, acc = pl.pallas_call(
      functools.partial(_kernel, scale=float(scale), fold=fold),
      out_shape=out_shape,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(b, m),
          in_specs=[pl.BlockSpec((None, h, r), row),
                    pl.BlockSpec((None, fold, h, width), lambda bi, j, *refs: (bi, 0, 0, 0)),
                    pl.BlockSpec((None, None, page, r), page_map),
                    pl.BlockSpec((None, None, n, width), page_map)],
          out_specs=[pl.BlockSpec((None, h, 1), row), pl.BlockSpec((None, h, 1), row),
                     pl.BlockSpec((None, h, r), row)],
          scratch_shapes=[pltpu.VMEM((h, 1), _F32), pltpu.VMEM((h, 1), _F32),
                          pltpu.VMEM((h, r), _F32)]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      cost_estimate=cost(b, h, m, page, r, pr, jnp.dtype(pool_c.dtype).itemsize, fold),
      interpret=interpret,
      name="paged_decode_attention",
  )(pages.astype(jnp.int32), col_pos.astype(jnp.int32), q_pos.astype(jnp.int32), unit,
    q_latent.astype(_F32), rope_pages.fold_queries(q_rope.astype(_F32), fold), pool_c, pool_r)
  return m_[..., 0], l_[..., 0], acc


__all__ = ["paged_decode_partial", "cost"]
