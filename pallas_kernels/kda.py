"""Pallas TPU kernels for chunked Kimi Delta Attention (KDA): forward and backward.

`chunk_kda` has the signature and semantics of the reference
`k3_jax.ops.kda.chunk.chunk_kda` (plus `interpret`, `store_states`); the entry point
`k3_jax.ops.kda.chunk_kda(..., backend="pallas")` calls it. It is differentiable through a
`jax.custom_vjp` whose backward is a Pallas kernel too.

Layout. The public API takes q, k, g [B, T, H, K], v [B, T, H, V], beta
[B, T, H] (flash-linear-attention layout). The wrapper pads T to a multiple of
the chunk C (k = v = q = g = beta = 0: the state passes through unchanged),
moves heads before time ([B, H, T, X]: a (C, X) block per grid step satisfies
the TPU (8, 128) block rule for any H), clamps g at -16 like the reference and
turns it into the in-chunk cumulative log decay G (float32). Those are cheap
elementwise / cumsum passes in plain JAX, and autodiff of them turns dG into
dg (the reverse in-chunk cumsum) in the backward pass.

Kernels (grid (B, H, N chunks); batch and heads "parallel", chunks
"arbitrary", i.e. sequential on one core):
  _fwd_kernel   chunks in order; the FP32 state S [K, V] lives in a VMEM
                scratch buffer across the chunk axis; writes o, the final state
                and (optionally) every chunk's incoming state.
  _bwd_kernel   chunks in reverse; the FP32 state gradient dS [K, V] lives in
                VMEM scratch; recomputes the chunk's intra-chunk terms from
                q, k, v, G, beta and the chunk's incoming state, and writes
                dq, dk, dv, dG, dbeta and, at the end, d initial_state.

Per chunk (q scaled; see docs/architecture.md section 2 and the reference's docstring):
  Aqk[r,s] = sum_c q_r k_s exp(G_r - G_s) (s <= r),  Akk likewise (s < r)
  L = beta * Akk,  A = (I + L)^-1,  W = A (beta exp(G) K),  U = A (beta V)
  Vn = U - W S,  O = (q exp(G)) S + Aqk Vn,
  S' = Diag(exp(G_C)) S + (exp(G_C - G) K)^T Vn.

Numerics of the intra-chunk scores (no pairwise [C, C, K] tensor, nothing
overflows): two levels of tiles, every factor bounded.
  Level 1, tiles of 16 tokens: row r in tile I against keys s in earlier
    tiles uses the reference m_I = G at tile I's first token:
    exp(G_r - G_s) = exp(G_r - m_I) * exp(m_I - G_s), both factors <= 1.
  Level 2, inside a tile, sub-tiles of 4 tokens: row r in sub-tile j against
    keys s of sub-tiles <= j of the same tile, reference = G at sub-tile j's
    first token: the row factor is <= 1 and the key factor <= exp(3 * 16) (at
    most 3 steps, each clamped at -16), far inside float32 range.
  A factor underflowing to 0 means the exact product is below float32 range.
  Each level is a few [C, K] x [K, C] matmuls with row masks (C/16 - 1 groups
  for level 1, 4 for level 2), every array 2-D (Mosaic-friendly). One level
  of 16-token tiles would suffice for K3's lower-bounded decay (|G| <= 80 over
  a tile); the second level is what keeps Kimi-Linear's unbounded softplus
  decay (clamped at -16 per step, i.e. up to -256 over a tile) finite.

(I + L)^-1 blockwise: the 16 x 16 diagonal blocks D by 15 Jacobi sweeps
X <- I - L_diag X (row r is final after r sweeps and then equals forward
substitution, operation for operation, so it is as stable as a triangular
solve), then the block-lower part by block forward substitution:
(I + L)^-1 = (I + D L_off)^-1 D, with (I + D L_off)^-1 again by Jacobi sweeps
(C/16 - 1 of them, block rows). All matmuls, all FP32 (precision HIGHEST).

Packed sequences (segment_ids): as the reference, pairs of tokens in different
documents are masked out of Aqk and L; the carried state reaches token r only
if r is in the document of the token before the chunk (from_prev); the new
state keeps Diag(exp(G_C)) S only if the chunk's last token is in that
document (keep), and sums k_s Vn_s only over the last token's document
(to_last).

Backward memory: store vs recompute (the `store_states` flag). The backward
needs every chunk's incoming state S_n [K, V] in FP32. Storing them from the
forward costs B * H * (T / C) * K * V * 4 bytes, held from the forward to the
backward: at K3 shapes (K = V = 128, C = 64, T = 65536, 16 heads per chip,
B = 1) that is 1024 chunks * 16 heads * 64 KiB = 1 GiB per KDA layer per chip
(0.5 GiB at 8 heads, 1.5 GiB at 24): 4x the layer's BF16 q (1.3x q, k and v
together), and across dozens of KDA layers it does not fit in HBM. Recomputing them costs
one extra run of the forward kernel (state path only, no o written) inside the
backward, and the states then exist only transiently for one layer. Default:
recompute (store_states=False). store_states=True is the better choice when
the calling layer runs under jax.checkpoint (its forward, including this
kernel, is re-run inside the backward anyway, so stored states are transient
too and the extra state pass is saved) or when T is short.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3_jax.ops.kda.common import (G_CLAMP, SUB_TILE, TILE, check_chunk_shapes, default_scale,
                                   doc_index)
_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


# --------------------------------------------------------------------------
# In-kernel helpers (2-D arrays only, values not refs).
# --------------------------------------------------------------------------


def _dot(a, b):
  """a [M, N] @ b [N, P] in FP32."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HI,
                             preferred_element_type=_F32)


def _dot_nt(a, b):
  """a [M, N] @ b[P, N]^T in FP32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI,
                             preferred_element_type=_F32)


def _dot_tn(a, b):
  """a[N, M]^T @ b [N, P] in FP32."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI,
                             preferred_element_type=_F32)


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _row(x, idx):
  """Row idx of x [C, K] as [1, K] (a masked sublane sum: exact, Mosaic-safe)."""
  rid = _iota(x.shape, 0)
  return jnp.sum(jnp.where(rid == idx, x, 0.0), axis=0, keepdims=True)


def _row_to_col(x):
  """[1, K] -> [K, 1] (transpose of a row vector by a masked lane sum)."""
  n = x.shape[1]
  eye = _iota((n, n), 0) == _iota((n, n), 1)
  return jnp.sum(jnp.where(eye, x, 0.0), axis=1, keepdims=True)


def _col_to_row(x):
  """[K, 1] -> [1, K]."""
  n = x.shape[0]
  eye = _iota((n, n), 0) == _iota((n, n), 1)
  return jnp.sum(jnp.where(eye, x, 0.0), axis=0, keepdims=True)


def _div(x, d):
  """x // d for int32 x >= 0 and d a power of two (a shift: Mosaic lowers it
  on every TPU generation, unlike floor division)."""
  return jax.lax.shift_right_logical(x, jnp.int32(d.bit_length() - 1))


def _mod(x, d):
  """x % d for int32 x >= 0 and d a power of two."""
  return jax.lax.bitwise_and(x, jnp.int32(d - 1))


def _masked_exp(mask, x):
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _tiles(C):
  t1 = math.gcd(C, TILE)
  t2 = math.gcd(t1, SUB_TILE)
  return t1, t2


class _Factors:
  """Decay factors of the two tile levels for one chunk (see module doc).

  G [C, K] is the chunk's cumulative log decay (non-increasing down rows).
  groups: list of (row_mask [C, 1] bool, rowf [C, K], keyf [C, K], pair_mask
  [C, C] bool or None). For a group, the scores of rows in row_mask against
  all keys are (x * rowf) @ (y * keyf)^T, valid where pair_mask (None: all
  pairs the key factor lets through).
  """

  def __init__(self, G):
    C, K = G.shape
    t1, t2 = _tiles(C)
    n1, n2 = C // t1, t1 // t2
    rid = _iota((C, K), 0)
    rcol = _iota((C, 1), 0)
    tile_k = _div(rid, t1)                  # [C, K] tile of each row
    sub_k = _div(_mod(rid, t1), t2)         # [C, K] sub-tile inside its tile
    self.groups = []
    # Level 1: row tile I (>= 1) against keys of tiles < I.
    if n1 > 1:
      refs = [_row(G, I * t1) for I in range(n1)]              # [1, K] each
      R1 = refs[0]
      for I in range(1, n1):
        R1 = jnp.where(tile_k == I, refs[I], R1)               # [C, K]
      rowf1 = jnp.exp(G - R1)                                  # <= 1
      for I in range(1, n1):
        keyf = _masked_exp(tile_k < I, refs[I] - G)            # <= 1
        self.groups.append((_div(rcol, t1) == I, rowf1, keyf, None))
    # Level 2: row sub-tile j against keys of sub-tiles <= j, same tile.
    ri, si = _iota((C, C), 0), _iota((C, C), 1)
    same_tile = _div(ri, t1) == _div(si, t1)
    ref2 = []                                # [C, K]: G at sub-tile j of the row's tile
    for j in range(n2):
      R = _row(G, j * t2)
      for I in range(1, n1):
        R = jnp.where(tile_k == I, _row(G, I * t1 + j * t2), R)
      ref2.append(R)
    R2 = ref2[0]
    for j in range(1, n2):
      R2 = jnp.where(sub_k == j, ref2[j], R2)
    rowf2 = jnp.exp(G - R2)                                    # <= 1
    for j in range(n2):
      keyf = _masked_exp(sub_k <= j, ref2[j] - G)              # <= exp(16 (t2-1))
      self.groups.append((_div(_mod(rcol, t1), t2) == j, rowf2, keyf,
                          same_tile))

  def scores(self, x, y):
    """P[r, s] = sum_c x_r[c] y_s[c] exp(G_r[c] - G_s[c]) for s in an earlier
    tile or the same tile (the caller applies the causal mask). [C, C]"""
    P = None
    for rmask, rowf, keyf, pmask in self.groups:
      part = _dot_nt(x * rowf, y * keyf)
      keep = rmask if pmask is None else (rmask & pmask)
      part = jnp.where(keep, part, 0.0)
      P = part if P is None else P + part
    return P

  def scores_bwd(self, dP, x, y):
    """Gradients of sum(dP * scores(x, y)) w.r.t. x and y (dP already masked
    to the pairs the forward kept). Returns dx [C, K], dy [C, K]; the G
    gradient is x * dx - y * dy."""
    dx = dy = None
    for rmask, rowf, keyf, pmask in self.groups:
      keep = rmask if pmask is None else (rmask & pmask)
      dPg = jnp.where(keep, dP, 0.0)                           # [C, C]
      ddx = rowf * _dot(dPg, y * keyf)                         # [C, K]
      ddy = keyf * _dot_tn(dPg, x * rowf)                      # [C, K]
      dx = ddx if dx is None else dx + ddx
      dy = ddy if dy is None else dy + ddy
    return dx, dy


def _unit_lower_inverse(L):
  """(I + L)^-1 for strictly lower triangular L [C, C], blockwise (see module
  doc): Jacobi sweeps on the diagonal tiles, then on the block rows."""
  C = L.shape[0]
  t1, _ = _tiles(C)
  n1 = C // t1
  ri, si = _iota((C, C), 0), _iota((C, C), 1)
  eye = jnp.where(ri == si, 1.0, 0.0).astype(_F32)
  same_tile = _div(ri, t1) == _div(si, t1)
  Ld = jnp.where(same_tile, L, 0.0)
  X = eye
  for _ in range(t1 - 1):
    X = eye - _dot(Ld, X)
  if n1 == 1:
    return X
  N = _dot(X, L - Ld)                      # D L_off, strictly block lower
  Y = eye
  for _ in range(n1 - 1):
    Y = eye - _dot(N, Y)
  return _dot(Y, X)


class _Chunk:
  """Everything about one chunk that does not depend on the carried state."""

  def __init__(self, q, k, v, G, beta, seg):
    C = q.shape[0]
    ri, si = _iota((C, C), 0), _iota((C, C), 1)
    le, lt = si <= ri, si < ri
    if seg is not None:
      doc_c, doc_r, fp, tl = seg               # [C,1], [1,C], [C,1], [C,1]
      same = doc_c == doc_r                    # [C, C]
      le, lt = le & same, lt & same
      keep = jnp.min(fp, axis=0, keepdims=True)  # [1, 1]: last token in doc_prev
    else:
      fp = tl = keep = None
    self.fac = _Factors(G)
    self.le, self.lt = le, lt
    self.Aqk = jnp.where(le, self.fac.scores(q, k), 0.0)
    self.Akk = jnp.where(lt, self.fac.scores(k, k), 0.0)
    self.L = beta * self.Akk
    self.A = _unit_lower_inverse(self.L)
    self.eG = jnp.exp(G)
    self.Glast = _row(G, C - 1)                                # [1, K]
    self.eKout = jnp.exp(self.Glast - G)                       # <= 1
    d = jnp.exp(self.Glast)                                    # [1, K]
    if seg is not None:
      self.eG_in = self.eG * fp
      self.eKout = self.eKout * tl
      d = d * keep
    else:
      self.eG_in = self.eG
    self.d_row = d
    self.d_col = _row_to_col(d)                                # [K, 1]
    self.Kin = k * self.eG_in
    self.Qin = q * self.eG_in
    self.Kout = k * self.eKout
    self.Bk = beta * self.Kin
    self.Bv = beta * v
    self.W = _dot(self.A, self.Bk)                             # [C, K]
    self.U = _dot(self.A, self.Bv)                             # [C, V]


def _load_seg(segc_ref, segr_ref):
  if segc_ref is None:
    return None
  segc = segc_ref[...]                                        # [C, 3] f32
  return (segc[:, 0:1], segr_ref[...], segc[:, 1:2], segc[:, 2:3])


# --------------------------------------------------------------------------
# Kernels.
# --------------------------------------------------------------------------


def _fwd_kernel(*refs, scale, has_seg, emit_out, emit_states):
  it = iter(refs)
  q_ref, k_ref, v_ref, G_ref, b_ref, s0_ref = (next(it) for _ in range(6))
  segc_ref, segr_ref = (next(it), next(it)) if has_seg else (None, None)
  o_ref = next(it) if emit_out else None
  sf_ref = next(it)
  st_ref = next(it) if emit_states else None
  S_scr = next(it)

  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    S_scr[...] = s0_ref[...].astype(_F32)

  S = S_scr[...]                                              # [K, V]
  if emit_states:
    st_ref[...] = S
  q = q_ref[...].astype(_F32) * scale
  k = k_ref[...].astype(_F32)
  v = v_ref[...].astype(_F32)
  ch = _Chunk(q, k, v, G_ref[...], b_ref[...].astype(_F32),
              _load_seg(segc_ref, segr_ref))
  Vn = ch.U - _dot(ch.W, S)                                   # [C, V]
  if emit_out:
    o = _dot(ch.Qin, S) + _dot(ch.Aqk, Vn)
    o_ref[...] = o.astype(o_ref.dtype)
  S_new = ch.d_col * S + _dot_tn(ch.Kout, Vn)                 # [K, V]
  S_scr[...] = S_new

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    sf_ref[...] = S_new


def _bwd_kernel(*refs, scale, has_seg):
  it = iter(refs)
  q_ref, k_ref, v_ref, G_ref, b_ref, st_ref, do_ref, dsf_ref = (
      next(it) for _ in range(8))
  segc_ref, segr_ref = (next(it), next(it)) if has_seg else (None, None)
  dq_ref, dk_ref, dv_ref, dG_ref, db_ref, ds0_ref = (next(it) for _ in range(6))
  dS_scr = next(it)

  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    dS_scr[...] = dsf_ref[...].astype(_F32)

  dSn = dS_scr[...]                                           # d(state after chunk)
  S = st_ref[...]                                             # state before chunk
  q = q_ref[...].astype(_F32) * scale
  k = k_ref[...].astype(_F32)
  v = v_ref[...].astype(_F32)
  G = G_ref[...]
  beta = b_ref[...].astype(_F32)                              # [C, 1]
  C = q.shape[0]
  ch = _Chunk(q, k, v, G, beta, _load_seg(segc_ref, segr_ref))
  Vn = ch.U - _dot(ch.W, S)
  dO = do_ref[...].astype(_F32)                               # [C, V]

  # O = Qin S + Aqk Vn;  S' = d S + Kout^T Vn;  Vn = U - W S.
  dVn = _dot_tn(ch.Aqk, dO) + _dot(ch.Kout, dSn)          # [C, V]
  dS = _dot_tn(ch.Qin, dO) + ch.d_col * dSn - _dot_tn(ch.W, dVn)
  dQin = _dot_nt(dO, S)                                       # [C, K]
  dKout = _dot_nt(Vn, dSn)                                    # [C, K]
  dAqk = jnp.where(ch.le, _dot_nt(dO, Vn), 0.0)               # [C, C]
  dd = _col_to_row(jnp.sum(S * dSn, axis=1, keepdims=True))   # [1, K]
  dGlast = ch.d_row * dd
  # W = A Bk, U = A Bv.
  dW = -_dot_nt(dVn, S)                                       # [C, K]
  dA = _dot_nt(dW, ch.Bk) + _dot_nt(dVn, ch.Bv)               # [C, C]
  dBk = _dot_tn(ch.A, dW)
  dBv = _dot_tn(ch.A, dVn)
  # A = (I + L)^-1: dL = -A^T dA A^T on the kept (strictly lower) pairs.
  dL = jnp.where(ch.lt, -_dot_nt(_dot_tn(ch.A, dA), ch.A), 0.0)
  dbeta = (jnp.sum(dL * ch.Akk, axis=1, keepdims=True)
           + jnp.sum(dBk * ch.Kin, axis=1, keepdims=True)
           + jnp.sum(dBv * v, axis=1, keepdims=True))         # [C, 1]
  dAkk = beta * dL
  dKin = beta * dBk
  dv = beta * dBv
  dk = dKin * ch.eG_in + dKout * ch.eKout
  dG = dKin * ch.Kin + dQin * ch.Qin - dKout * ch.Kout
  dq = dQin * ch.eG_in
  dGlast = dGlast + jnp.sum(dKout * ch.Kout, axis=0, keepdims=True)
  # Intra-chunk scores.
  dxq, dyq = ch.fac.scores_bwd(dAqk, q, k)
  dxk, dyk = ch.fac.scores_bwd(dAkk, k, k)
  dq = dq + dxq
  dk = dk + dyq + dxk + dyk
  dG = dG + q * dxq - k * dyq + k * dxk - k * dyk
  dG = dG + jnp.where(_iota(dG.shape, 0) == C - 1, dGlast, 0.0)

  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  dG_ref[...] = dG
  db_ref[...] = dbeta.astype(db_ref.dtype)
  dS_scr[...] = dS

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    ds0_ref[...] = dS


# --------------------------------------------------------------------------
# pallas_call builders (kernel layout: [B, H, Tp, X]).
# --------------------------------------------------------------------------


def chunk_matmul_flops(C: int, K: int, V: int, backward: bool = False,
                       emit_out: bool = True) -> int:
  """Matmul FLOPs of one grid step (one chunk of one (batch, head)) of the forward or
  backward kernel, counted from the dots the kernel body runs (_Chunk, _Factors,
  _unit_lower_inverse and the kernels' own; without o the forward's Aqk is unused and
  traced away); tests/pallas check it against the dots of the traced kernel. Elementwise
  work (a few [C, K] and [C, C] passes) is left out."""
  t1, t2 = _tiles(C)
  n1, n2 = C // t1, t1 // t2
  groups = (n1 - 1) + n2                        # _Factors groups: one [C, K] x [K, C] dot each
  cube = 2 * C ** 3                             # one [C, C] x [C, C] dot
  inverse = (t1 - 1) * cube + ((n1 + 1) * cube if n1 > 1 else 0)
  scores = groups * 2 * C * C * K
  chunk = scores + inverse + 2 * C * C * (K + V)                 # Akk, A, W, U
  ckv, ccv, cck = 2 * C * K * V, 2 * C * C * V, 2 * C * C * K
  if not backward:                   # W S, Kout^T Vn; with o: Aqk, Qin S, Aqk Vn (else unused)
    return chunk + 2 * ckv + (scores + ckv + ccv if emit_out else 0)
  # W S; dVn (2); dS (2); dQin; dKout; dAqk; dW; dA (2); dBk; dBv; dL (2 cubes); scores_bwd x 2
  return (chunk + scores + ckv + (ccv + ckv) + 2 * ckv + 2 * ckv + ccv + ckv + (cck + ccv) + cck + ccv
          + 2 * cube + 2 * groups * 2 * cck)


def _cost(flops_per_step: int, steps: int, args, out_shape) -> pl.CostEstimate:
  """A pallas_call's cost: FLOPs per grid step times the steps; bytes = every operand read
  and every output written once (each block is fetched once: the chunk blocks move with the
  grid, the per-(batch, head) state blocks stay put over the chunk axis)."""
  nbytes = lambda a: math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
  return pl.CostEstimate(flops=int(flops_per_step) * steps, transcendentals=0,
                         bytes_accessed=sum(nbytes(a) for a in (*args, *out_shape)
                                            if a is not None))

_PARAMS = pltpu.CompilerParams(
    dimension_semantics=("parallel", "parallel", "arbitrary"))


def _seg_specs(C, reverse_n):
  def cidx(b, h, n):
    return (b, reverse_n(n), 0)

  def ridx(b, h, n):
    return (b, reverse_n(n), 0, 0)
  return [pl.BlockSpec((None, C, 3), cidx),
          pl.BlockSpec((None, None, 1, C), ridx)]


def _fwd_call(q, k, v, G, beta, s0, segc, segr, *, C, scale, emit_out,
              emit_states, interpret):
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  N = Tp // C
  has_seg = segc is not None
  ident = lambda n: n
  tok = lambda X: pl.BlockSpec((None, None, C, X), lambda b, h, n: (b, h, n, 0))
  per_bh = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))
  in_specs = [tok(K), tok(K), tok(V), tok(K), tok(1), per_bh]
  args = [q, k, v, G, beta, s0]
  if has_seg:
    in_specs += _seg_specs(C, ident)
    args += [segc, segr]
  out_specs, out_shape = [], []
  if emit_out:
    out_specs.append(tok(V))
    out_shape.append(jax.ShapeDtypeStruct((B, H, Tp, V), v.dtype))
  out_specs.append(per_bh)
  out_shape.append(jax.ShapeDtypeStruct((B, H, K, V), _F32))
  if emit_states:
    out_specs.append(pl.BlockSpec((None, None, None, K, V),
                                  lambda b, h, n: (b, h, n, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((B, H, N, K, V), _F32))
  kernel = functools.partial(_fwd_kernel, scale=scale, has_seg=has_seg,
                             emit_out=emit_out, emit_states=emit_states)
  outs = pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(B, H, N),
      in_specs=in_specs, out_specs=tuple(out_specs),
      scratch_shapes=[pltpu.VMEM((K, V), _F32)],
      compiler_params=_PARAMS, interpret=interpret,
      cost_estimate=_cost(chunk_matmul_flops(C, K, V, emit_out=emit_out), B * H * N, args,
                          out_shape),
      name="kda_chunk_fwd")(*args)
  outs = list(outs)
  o = outs.pop(0) if emit_out else None
  sf = outs.pop(0)
  states = outs.pop(0) if emit_states else None
  return o, sf, states


def _bwd_call(q, k, v, G, beta, states, do, dsf, segc, segr, *, C, scale,
              interpret):
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  N = Tp // C
  has_seg = segc is not None
  rev = lambda n: N - 1 - n
  tok = lambda X: pl.BlockSpec((None, None, C, X),
                               lambda b, h, n: (b, h, rev(n), 0))
  per_bh = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))
  st = pl.BlockSpec((None, None, None, K, V),
                    lambda b, h, n: (b, h, rev(n), 0, 0))
  in_specs = [tok(K), tok(K), tok(V), tok(K), tok(1), st, tok(V), per_bh]
  args = [q, k, v, G, beta, states, do, dsf]
  if has_seg:
    in_specs += _seg_specs(C, rev)
    args += [segc, segr]
  out_specs = [tok(K), tok(K), tok(V), tok(K), tok(1), per_bh]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct(G.shape, _F32),
               jax.ShapeDtypeStruct(beta.shape, beta.dtype),
               jax.ShapeDtypeStruct((B, H, K, V), _F32)]
  kernel = functools.partial(_bwd_kernel, scale=scale, has_seg=has_seg)
  return pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(B, H, N),
      in_specs=in_specs, out_specs=tuple(out_specs),
      scratch_shapes=[pltpu.VMEM((K, V), _F32)],
      compiler_params=_PARAMS, interpret=interpret,
      cost_estimate=_cost(chunk_matmul_flops(C, K, V, backward=True), B * H * N, args,
                          out_shape),
      name="kda_chunk_bwd")(*args)


@functools.lru_cache(maxsize=None)
def _make_core(C, scale, store_states, interpret):
  """custom_vjp'd kernel-layout KDA: (q, k, v, G, beta, s0, segc, segr) ->
  (o, final_state). segc / segr may be None (no segments)."""

  @jax.custom_vjp
  def core(q, k, v, G, beta, s0, segc, segr):
    o, sf, _ = _fwd_call(q, k, v, G, beta, s0, segc, segr, C=C, scale=scale,
                         emit_out=True, emit_states=False, interpret=interpret)
    return o, sf

  def fwd(q, k, v, G, beta, s0, segc, segr):
    o, sf, states = _fwd_call(q, k, v, G, beta, s0, segc, segr, C=C,
                              scale=scale, emit_out=True,
                              emit_states=store_states, interpret=interpret)
    return (o, sf), (q, k, v, G, beta, s0, segc, segr, states)

  def bwd(res, cts):
    q, k, v, G, beta, s0, segc, segr, states = res
    do, dsf = cts
    if states is None:   # recompute the chunk-boundary states (no o written)
      _, _, states = _fwd_call(q, k, v, G, beta, s0, segc, segr, C=C,
                               scale=scale, emit_out=False, emit_states=True,
                               interpret=interpret)
    dq, dk, dv, dG, dbeta, ds0 = _bwd_call(
        q, k, v, G, beta, states, do.astype(v.dtype), dsf.astype(_F32),
        segc, segr, C=C, scale=scale, interpret=interpret)
    zero = lambda x: None if x is None else jnp.zeros_like(x)
    return (dq, dk, dv, dG, dbeta, ds0.astype(s0.dtype), zero(segc),
            zero(segr))

  core.defvjp(fwd, bwd)
  return core


# --------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None,
              output_final_state=False, chunk_size=64, segment_ids=None,
              interpret=False, store_states=False):
  """Chunked KDA as Pallas TPU kernels; differentiable (custom_vjp).

  Same signature and results as the reference `k3_jax.ops.kda.chunk.chunk_kda` (same g
  clamp at -16, same segment semantics), plus:
    interpret     run the kernels in the Pallas interpreter (CPU tests).
    store_states  keep every chunk's incoming FP32 state from the forward for
                  the backward (True) or recompute them in the backward
                  (False, default: see the module docstring for the memory
                  numbers at K3 shapes).
  q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state
  [B, H, K, V] or None; segment_ids [B, T] int or None. Inputs may be BF16 or
  FP32 (all math in FP32). Returns (o [B, T, H, V] in v.dtype, final_state
  [B, H, K, V] float32 or None). On TPU, chunk_size should be a multiple of
  16 (BF16 block tiling); any T works (padded to a multiple of chunk_size).
  """
  B, T, H, K, V = check_chunk_shapes(q, k, v, g, beta, initial_state, segment_ids,
                                     chunk_size)
  C = int(chunk_size)
  scale = float(default_scale(scale, K))
  N = -(-T // C)
  if not interpret and N > 1:
    # A (C, X) block must span whole (sublane, 128) tiles: 8 rows for 4-byte,
    # 16 for 2-byte inputs (one chunk covering all of T is always allowed).
    sub = max(8 * max(1, 4 // jnp.dtype(x.dtype).itemsize)
              for x in (q, k, v, beta))
    if C % sub:
      raise ValueError(
          f"chunk_size={C} must be a multiple of {sub} for the TPU kernel "
          f"with inputs of dtype {q.dtype}/{v.dtype} (block tiling), or at "
          f"least T={T}")
  Tp = N * C
  pad = Tp - T

  def to_kernel(x):                       # [B, T, H, X] -> [B, H, Tp, X]
    if pad:
      x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.swapaxes(x, 1, 2)

  qk = to_kernel(q)
  kk = to_kernel(k)
  vk = to_kernel(v)
  g32 = to_kernel(jnp.maximum(g.astype(_F32), G_CLAMP))      # [B, H, Tp, K]
  G = jnp.cumsum(g32.reshape(B, H, N, C, K), axis=3).reshape(B, H, Tp, K)
  bk = to_kernel(beta[..., None])                             # [B, H, Tp, 1]
  if initial_state is None:
    s0 = jnp.zeros((B, H, K, V), _F32)
  else:
    s0 = initial_state.astype(_F32)
  segc = segr = None
  if segment_ids is not None:
    doc = doc_index(segment_ids)                              # [B, T]
    if pad:
      doc = jnp.pad(doc, ((0, 0), (0, pad)), mode="edge")
    doc = doc.reshape(B, N, C)
    doc_prev = jnp.concatenate(
        [jnp.zeros_like(doc[:, :1, -1]), doc[:, :-1, -1]], axis=1)  # [B, N]
    from_prev = doc == doc_prev[..., None]                    # [B, N, C]
    to_last = doc == doc[..., -1:]
    segc = jnp.stack([doc, from_prev, to_last], -1).astype(_F32)
    segc = segc.reshape(B, Tp, 3)                             # [B, Tp, 3]
    segr = doc.astype(_F32)[:, :, None, :]                    # [B, N, 1, C]
  core = _make_core(C, scale, bool(store_states), interpret)
  o, sf = core(qk, kk, vk, G, bk, s0, segc, segr)
  o = jnp.swapaxes(o, 1, 2)[:, :T]                            # [B, T, H, V]
  return o, (sf if output_final_state else None)


# --------------------------------------------------------------------------
# VMEM budget (for benchmarks and reports).
# --------------------------------------------------------------------------


def _tile_bytes(shape, dtype):
  """VMEM bytes of one block buffer: the last two dims padded to the TPU
  tile (8 * packing sublanes, 128 lanes)."""
  itemsize = jnp.dtype(dtype).itemsize
  sub = 8 * max(1, 4 // itemsize)
  *lead, r, c = shape
  r = -(-r // sub) * sub
  c = -(-c // 128) * 128
  return math.prod(lead) * r * c * itemsize


def vmem_bytes(kernel, K=128, V=128, chunk_size=64, dtype=jnp.bfloat16,
               segments=False, store_states=False):
  """VMEM the kernel's pipeline asks for: every block double-buffered (the
  Pallas TPU pipeline's default) plus the FP32 [K, V] scratch. kernel:
  "fwd" (the forward; store_states adds the per-chunk state output),
  "fwd_states" (the backward's state recomputation: no o) or "bwd".
  Mosaic's own temporaries for the kernel body (intermediate [C, K] and
  [C, C] FP32 values) come on top; they fit the default scoped VMEM limit
  on v5e / v5p / v6e (the kernels compile without raising it).
  Returns {"blocks": bytes, "scratch": bytes, "total": bytes}."""
  C = chunk_size
  tok = lambda X, dt=dtype: _tile_bytes((C, X), dt)
  kv = _tile_bytes((K, V), _F32)
  ins = [tok(K), tok(K), tok(V), tok(K, _F32), tok(1)]
  if kernel in ("fwd", "fwd_states"):
    ins.append(kv)                                  # initial state
    outs = [kv]                                     # final state
    if kernel == "fwd":
      outs.append(tok(V))
    if kernel == "fwd_states" or store_states:
      outs.append(kv)
  elif kernel == "bwd":
    ins += [kv, tok(V), kv]                         # state, dO, d final state
    outs = [tok(K), tok(K), tok(V), tok(K, _F32), tok(1), kv]
  else:
    raise ValueError(f"kernel must be 'fwd', 'fwd_states' or 'bwd', got {kernel!r}")
  if segments:
    ins += [_tile_bytes((C, 3), _F32), _tile_bytes((1, C), _F32)]
  blocks = 2 * (sum(ins) + sum(outs))
  return {"blocks": blocks, "scratch": kv, "total": blocks + kv}
