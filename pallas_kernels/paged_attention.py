"""Paged MLA decode attention as a Pallas TPU kernel: the softmax partial of one query per
sequence over its cached latents, read from the page pool through the page table.

Same signature and result as the plain-JAX `k3_jax.ops.attention.paged_decode_partial`
(plus `interpret`), which gathers `block` pages a loop step into a copy, converts it to FP32
and reads it twice (logits, then the weighted sum): about four passes over the latents. Here
each grid step DMAs one page of latents [P, R] and rope keys [P, Pr] from HBM into VMEM
(the page id comes from the table, in SMEM, through the block index map) and both matmuls
read it there: one pass.

Grid (B, M): sequence b, table column j, columns "arbitrary" (in order). The online
softmax state (running max m [H, 1], sum l [H, 1], weighted latents acc [H, R], FP32) lives
in VMEM scratch across the columns of one sequence and is written out after its last
column. A column whose first position the query cannot see (col_pos[j] >= q_pos[b]) does no
work, and its index map repeats the sequence's first page, so after the first such column
no page is fetched for it. Positions past q_pos inside a visible page are masked.

    q_latent [B, H, R] f32, q_rope [B, H, Pr] f32     (absorbed queries)
    pool_c [N, P, R], pool_r [N, P, Pr]  (or stacked [U, N, P, X] with `unit`)
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

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


def _kernel(pages_ref, col_ref, qpos_ref, unit_ref, ql_ref, qr_ref, c_ref, r_ref,
            m_out, l_out, acc_out, m_scr, l_scr, acc_scr, *, scale: float):
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
    c = c_ref[...].astype(_F32)                                        # [P, R]
    k = r_ref[...].astype(_F32)                                        # [P, Pr]
    nt = (((1,), (1,)), ((), ()))
    logits = (jax.lax.dot_general(ql_ref[...], c, nt, precision=_HI, preferred_element_type=_F32)
              + jax.lax.dot_general(qr_ref[...], k, nt, precision=_HI,
                                    preferred_element_type=_F32)) * scale       # [H, P]
    pos = first + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    logits = jnp.where(pos < seen, logits, -jnp.inf)
    m = m_scr[...]                                                     # [H, 1]
    m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
    base = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    p = jnp.exp(logits - base)
    corr = jnp.exp(m - base)                                           # 0 where m = -inf
    l_scr[...] = l_scr[...] * corr + jnp.sum(p, axis=1, keepdims=True)
    acc_scr[...] = acc_scr[...] * corr + jax.lax.dot_general(
        p, c, (((1,), (0,)), ((), ())), precision=_HI, preferred_element_type=_F32)
    m_scr[...] = m_new

  @pl.when(j == pl.num_programs(1) - 1)
  def _out():
    m_out[...] = m_scr[...]
    l_out[...] = l_scr[...]
    acc_out[...] = acc_scr[...]


def cost(b: int, h: int, m: int, page: int, r: int, pr: int, itemsize: int) -> pl.CostEstimate:
  """Every column's page read once (the bound: all columns visible), the queries, and the
  partials written; two matmuls per page."""
  return pl.CostEstimate(
      flops=2 * b * m * h * page * (2 * r + pr), transcendentals=b * m * h * page,
      bytes_accessed=b * m * page * (r + pr) * itemsize + b * h * (r + pr) * 4
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
      functools.partial(_kernel, scale=float(scale)),
      out_shape=out_shape,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(b, m),
          in_specs=[pl.BlockSpec((None, h, r), row), pl.BlockSpec((None, h, pr), row),
                    pl.BlockSpec((None, None, page, r), page_map),
                    pl.BlockSpec((None, None, page, pr), page_map)],
          out_specs=[pl.BlockSpec((None, h, 1), row), pl.BlockSpec((None, h, 1), row),
                     pl.BlockSpec((None, h, r), row)],
          scratch_shapes=[pltpu.VMEM((h, 1), _F32), pltpu.VMEM((h, 1), _F32),
                          pltpu.VMEM((h, r), _F32)]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      cost_estimate=cost(b, h, m, page, r, pr, jnp.dtype(pool_c.dtype).itemsize),
      interpret=interpret,
      name="paged_decode_attention",
  )(pages.astype(jnp.int32), col_pos.astype(jnp.int32), q_pos.astype(jnp.int32), unit,
    q_latent.astype(_F32), q_rope.astype(_F32), pool_c, pool_r)
  return m_[..., 0], l_[..., 0], acc


__all__ = ["paged_decode_partial", "cost"]
