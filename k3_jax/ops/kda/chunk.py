"""KDA in chunkwise-parallel (WY / UT transform) form, in plain JAX: dense work inside
chunks of C tokens, a lax.scan over chunks carrying only the state. Same results as
naive.recurrent_kda up to float32 reassociation and the decay clamp (common.G_CLAMP).
Shapes and semantics: see k3_jax/ops/kda/__init__.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3_jax.ops.kda.common import (G_CLAMP, SUB_TILE, TILE, check_chunk_shapes,
                                   default_scale, doc_index, pad_time)


def _tile_scores(q, k, G, Gprev, with_diag):
  """Scores between the n tiles of t tokens of a block, by dense matmuls.

  q, k, G, Gprev [..., n, t, K]; G the cumulative log decay (non-increasing),
  Gprev = G of the previous token (G - g). Returns Aqk, Akk [..., n, t, n*t]:
  row r in tile i against key s in tile j,
    sum_c x_r[c] k_s[c] exp(G_r[c] - G_s[c]),
  for j < i (with_diag: j <= i; the caller masks s > r), zero elsewhere.

  With m_i = Gprev at tile i's first token (one reference per row tile):
    exp(G_r - G_s) = exp(G_r - m_i) * exp(m_i - G_s).
  The first factor is <= 1; the second is <= 1 for s in an earlier tile, at
  most exp(16 t) (the G_CLAMP bound; callers use t <= 4 here) for s in tile
  i, and masked to 0 before exp for later tiles. Nothing overflows, and a
  factor underflowing to 0 means the exact product is below float32 range.
  Cost: n key matrices [K, n t] per block, one batched matmul.
  """
  *lead, n, t, K = G.shape
  m = Gprev[..., :, 0, :]                                         # [..., n, K]
  rowf = jnp.exp(G - m[..., :, None, :])                          # [..., n, t, K] <= 1
  Gs = G.reshape(*lead, n * t, K)
  ks = k.reshape(*lead, n * t, K)
  tile_of = jnp.arange(n * t) // t
  # One key matrix per row tile i, laid out [K, s] (contraction dim first: a
  # plain batched matmul, ~3x faster on CPU than contracting the minor dims
  # of both operands). Built per i (n is small) rather than by broadcasting,
  # so that the backward pass sums n slices instead of running a
  # broadcast-reduce, which XLA:CPU executes very slowly.
  keys = []
  for i in range(n):
    mask = ((tile_of <= i) if with_diag else (tile_of < i))[:, None]
    E = _masked_exp(mask, m[..., i:i + 1, :] - Gs)                # [..., n t, K]
    keys.append(jnp.swapaxes(ks * E, -1, -2))                     # [..., K, n t]
  keys = jnp.stack(keys, axis=-3)                                 # [..., n, K, n t]
  lhs = jnp.concatenate([q * rowf, k * rowf], axis=-2)            # [..., n, 2t, K]
  A = jnp.matmul(lhs, keys)                                       # [..., n, 2t, n t]
  return A[..., :t, :], A[..., t:, :]


def _intra_chunk_scores(q, k, G, Gprev):
  """Decay-weighted scores inside each chunk, for s <= r (zero above):

    Aqk[r, s] = sum_c q_r[c] k_s[c] exp(G_r[c] - G_s[c])
    Akk[r, s] = sum_c k_r[c] k_s[c] exp(G_r[c] - G_s[c])

  q, k, G, Gprev [..., C, K]. Returns (Aqk, Akk), each [..., C, C].
  Two levels: the chunk in tiles of t1 = gcd(C, 16) tokens (pairs of
  different tiles), each tile in sub-tiles of gcd(t1, 4) tokens (all pairs
  inside a tile, incl. the diagonal); both by _tile_scores.
  """
  *lead, C, K = q.shape
  t1 = math.gcd(C, TILE)
  t2 = math.gcd(t1, SUB_TILE)
  n1, n2 = C // t1, t1 // t2
  # Level 2: inside each tile.
  sub = lambda x: x.reshape(*lead, n1, n2, t2, K)
  Aqk2, Akk2 = _tile_scores(sub(q), sub(k), sub(G), sub(Gprev), True)  # [..., n1, n2, t2, t1]
  causal = jnp.tril(jnp.ones((t1, t1), jnp.bool_))
  Aqk2 = jnp.where(causal, Aqk2.reshape(*lead, n1, t1, t1), 0.0)
  Akk2 = jnp.where(causal, Akk2.reshape(*lead, n1, t1, t1), 0.0)
  if n1 == 1:
    return Aqk2.reshape(*lead, C, C), Akk2.reshape(*lead, C, C)
  # Place the tile-diagonal blocks: [..., n1, t1, t1] -> [..., n1, t1, C].
  eye = jnp.eye(n1, dtype=q.dtype)[:, None, :, None]              # [n1, 1, n1, 1]
  place = lambda a: (a[..., :, :, None, :] * eye).reshape(*lead, n1, t1, C)
  # Level 1: pairs of different tiles.
  tile = lambda x: x.reshape(*lead, n1, t1, K)
  Aqk1, Akk1 = _tile_scores(tile(q), tile(k), tile(G), tile(Gprev), False)  # [..., n1, t1, C]
  Aqk = (Aqk1 + place(Aqk2)).reshape(*lead, C, C)
  Akk = (Akk1 + place(Akk2)).reshape(*lead, C, C)
  return Aqk, Akk


def _masked_exp(mask, x):
  """exp(x) where mask else 0, with the exponent masked BEFORE exp so that
  masked-out (possibly huge) exponents never overflow, also in gradients."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _merge_blocks(blocks, off):
  """Merge neighbouring diagonal blocks [..., 2M, b, b] and the lower-left
  blocks between them off [..., M, b, b] into [..., M, 2b, 2b]:
  [[X, 0], [off, Z]]."""
  X, Z = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
  top = jnp.concatenate([X, jnp.zeros_like(off)], axis=-1)
  bottom = jnp.concatenate([off, Z], axis=-1)
  return jnp.concatenate([top, bottom], axis=-2)


def _split_pow2(C):
  """C = base * 2^m with base odd."""
  base = C
  while base % 2 == 0:
    base //= 2
  return base


def _unit_lower_inverse(L):
  """(I + L)^-1 for strictly lower triangular L [..., C, C] (C a power of two
  times an odd size is fine; any C works).

  Block forward substitution, bottom-up: starting from the 1x1 diagonal
  blocks (all 1), merge neighbouring diagonal blocks of size b into blocks of
  size 2b with
    inv([[X, 0], [Y, Z]]) = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]].
  All work is small batched matmuls (numerically this is the triangular solve
  done blockwise), which is much faster than a batched triangular_solve on CPU.
  """
  *lead, C, _ = L.shape
  hi = jax.lax.Precision.HIGHEST
  # C = base * 2^m: start from exact inverses of the odd-sized base blocks.
  base = _split_pow2(C)
  Ld = _diag_blocks(L, base)                                      # [..., C/base, base, base]
  inv = jnp.broadcast_to(jnp.eye(base, dtype=L.dtype), Ld.shape)
  for r in range(1, base):                                        # row-by-row substitution
    row = -jnp.einsum("...s,...sc->...c", Ld[..., r, :r], inv[..., :r, :],
                      precision=hi)
    inv = inv.at[..., r, :r].set(row[..., :r])
  b = base
  while b < C:
    Lb = _diag_blocks(L, 2 * b)                                   # [..., M, 2b, 2b]
    X, Z = inv[..., 0::2, :, :], inv[..., 1::2, :, :]             # [..., M, b, b]
    Y = Lb[..., b:, :b]
    off = -jnp.einsum("...ij,...jk,...kl->...il", Z, Y, X, precision=hi)
    inv = _merge_blocks(inv, off)                                 # [..., M, 2b, 2b]
    b *= 2
  return inv[..., 0, :, :]


def _diag_blocks(x, b):
  """Diagonal b x b blocks of x [..., C, C] -> [..., C/b, b, b]."""
  *lead, C, _ = x.shape
  m = C // b
  x = x.reshape(*lead, m, b, m, b)
  x = jnp.diagonal(x, axis1=-4, axis2=-2)                         # [..., b, b, m]
  return jnp.moveaxis(x, -1, -3)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None,
              output_final_state=False, chunk_size=64, segment_ids=None):
  """KDA in chunkwise-parallel (WY / UT transform) form; same results as
  recurrent_kda up to float32 reassociation (and the decay clamp below).

  Shapes and semantics as recurrent_kda. Any T: the sequence is padded to a
  multiple of chunk_size with k = v = q = g = beta = 0 (state unchanged) and
  the outputs are sliced back. g is clamped at G_CLAMP = -16 per step (a
  decay of 1e-7, i.e. a full erase in float32; see G_CLAMP).

  Per chunk, with G the in-chunk cumulative log decay [C, K] and the state S
  at the chunk start (q already scaled):
    L     = strict_lower(beta * Akk)          A = (I + L)^-1
    W     = A (beta * exp(G) * K)             U = A (beta * V)
    Vnew  = U - W S                           (the delta-rule writes u_s)
    O     = (q * exp(G)) S + Aqk Vnew
    S'    = Diag(exp(G_C)) S + (exp(G_C - G) * K)^T Vnew
  Everything but Vnew and S' is computed for all chunks in parallel, laid out
  [N, B, H, C, X] (chunk axis first, so the scan needs no transposes); a
  lax.scan over chunks carries S and emits S and Vnew; O is then one more
  parallel step.

  Segments: with doc(t) the document of token t and doc_prev the document of
  the token before the chunk (document 0 for the first chunk, where
  initial_state lives), pairs (r, s) of different documents are masked out of
  Aqk and L; the carried state S reaches token r (the exp(G) terms of W and O)
  only if doc(r) == doc_prev; S' keeps Diag(exp(G_C)) S only if the chunk's
  last token is in doc_prev, and sums k_s Vnew_s only over s in the last
  token's document.
  """
  B, T, H, K, V = check_chunk_shapes(q, k, v, g, beta, initial_state, segment_ids,
                                     chunk_size)
  C = chunk_size
  scale = default_scale(scale, K)
  out_dtype = v.dtype
  n = -(-T // C)
  pad = n * C - T
  f32 = lambda x: x.astype(jnp.float32)

  # [B, T, H, X] -> [N, B, H, C, X]
  def to_chunks(x):
    x = pad_time(f32(x), pad)
    x = x.reshape((B, n, C, H) + x.shape[3:])
    return jnp.moveaxis(x, (1, 2), (0, 3))
  q = to_chunks(q) * scale                                        # [N, B, H, C, K]
  k, v = to_chunks(k), to_chunks(v)
  g = to_chunks(jnp.maximum(f32(g), G_CLAMP))
  beta = to_chunks(beta)                                          # [N, B, H, C]

  hi = jax.lax.Precision.HIGHEST
  # In-chunk cumulative decay: a plain cumsum over the chunk axis (float32 adds on every
  # backend). Issue #17 measured it against the earlier triangular-ones einsum, whose
  # backward ran as transposing copies on CPU: the chunk_kda fwd+bwd ~20% shorter.
  G = jnp.cumsum(g, axis=-2)                                      # [N, B, H, C, K]
  G_last = G[..., -1:, :]                                         # [N, B, H, 1, K]
  Aqk, Akk = _intra_chunk_scores(q, k, G, G - g)                  # [N, B, H, C, C]
  L = beta[..., :, None] * jnp.tril(Akk, -1)                      # strictly lower

  eG = jnp.exp(G)
  w_in = k * eG                                                   # decayed from chunk start
  q_in = q * eG
  k_out = k * jnp.exp(G_last - G)                                 # decayed to chunk end, <= 1
  decay_last = jnp.exp(G_last[..., 0, :])                         # [N, B, H, K]

  if segment_ids is not None:
    doc = pad_time(doc_index(segment_ids), pad, mode="edge")    # [B, Tp]
    doc = jnp.moveaxis(doc.reshape(B, n, C), 1, 0)[:, :, None]    # [N, B, 1, C]
    doc_prev = jnp.concatenate(
        [jnp.zeros_like(doc[:1, ..., -1]), doc[:-1, ..., -1]], axis=0)  # [N, B, 1]
    same = (doc[..., :, None] == doc[..., None, :]).astype(jnp.float32)   # [N, B, 1, C, C]
    Aqk = Aqk * same
    L = L * same
    from_prev = (doc == doc_prev[..., None]).astype(jnp.float32)[..., None]  # [N, B, 1, C, 1]
    w_in = w_in * from_prev
    q_in = q_in * from_prev
    to_last = (doc == doc[..., -1:]).astype(jnp.float32)[..., None]   # [N, B, 1, C, 1]
    k_out = k_out * to_last
    keep = (doc[..., -1] == doc_prev).astype(jnp.float32)[..., None]  # [N, B, 1, 1]
    decay_last = decay_last * keep

  # WY / UT transform: one (I + L)^-1 for both W and U.
  rhs = jnp.concatenate([beta[..., None] * w_in, beta[..., None] * v], -1)  # [.., C, K+V]
  A = _unit_lower_inverse(L)                                      # [..., C, C]
  wu = jnp.matmul(A, rhs, precision=hi)
  W, U = wu[..., :K], wu[..., K:]                                 # [.., C, K], [.., C, V]

  if initial_state is None:
    state0 = jnp.zeros((B, H, K, V), jnp.float32)
  else:
    state0 = f32(initial_state)

  def chunk_step(S, inp):                                         # S [B, H, K, V]
    W_c, U_c, k_c, d_c = inp
    v_new = U_c - jnp.matmul(W_c, S, precision=hi)                # [B, H, C, V]
    S_next = d_c[..., None] * S + jnp.einsum(
        "bhck,bhcv->bhkv", k_c, v_new, precision=hi)
    return S_next, (S, v_new)

  final_state, (S_all, v_new) = jax.lax.scan(
      chunk_step, state0, (W, U, k_out, decay_last))              # [N, B, H, K|C, V]
  o = (jnp.matmul(q_in, S_all, precision=hi)
       + jnp.matmul(Aqk, v_new, precision=hi))                    # [N, B, H, C, V]
  o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(B, n * C, H, V)[:, :T]
  return o.astype(out_dtype), (final_state if output_final_state else None)


__all__ = ["chunk_kda"]
