"""Kimi Delta Attention (KDA): reference implementations in plain JAX.

Layout follows flash-linear-attention:
  q, k  [B, T, H, K]   queries / keys (usually L2-normalized)
  v     [B, T, H, V]   values
  g     [B, T, H, K]   per-channel log decay, g <= 0 (alpha = exp(g))
  beta  [B, T, H]      delta-rule write strength in [0, 1]
  state [B, H, K, V]   float32

Per head and per token (see K3_SPEC.md section 2):
  S   <- Diag(exp(g_t)) S                     (decay the state rows)
  S   <- S + beta_t k_t (v_t - k_t^T S)^T      (delta-rule write)
  o_t  = S^T (q_t * scale)

Two equivalent forms:
  recurrent_kda  a lax.scan over tokens (the definition; also decode).
  chunk_kda      the chunkwise-parallel WY/UT form: dense work inside chunks of
                 C tokens, a lax.scan over chunks carrying only the state.

Packed sequences: `segment_ids` [B, T] (int). A new document starts at token t
whenever segment_ids[t] != segment_ids[t-1]; the state is reset to zero before
such a token, so no information crosses a document boundary. `initial_state`
applies only to the first document of each row (tokens before the first
change); the final state is the state after the last token, i.e. the state of
the last document.

All internal math is in float32 whatever the input dtype; outputs have v's
dtype, states are float32. Decays must satisfy g <= 0 (the stable chunk form
relies on the cumulative log decay being non-increasing within a chunk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Tokens per checkpointed block in recurrent_kda: the backward pass keeps one
# state per block (not per token) and recomputes the block's states.
_RECURRENT_BLOCK = 64


# --------------------------------------------------------------------------
# Small helpers: gates and normalization.
# --------------------------------------------------------------------------


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum(x^2, -1) + eps), computed in float32, returned in x.dtype."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * inv).astype(x.dtype)


def kda_gate_lower_bound(z: jax.Array, a_log: jax.Array,
                         g_min: float = -5.0) -> jax.Array:
  """K3 decay: g = g_min * sigmoid(exp(a_log) * z), in (g_min, 0).

  z [..., H, K] decay logits; a_log [H] per-head log scale. Returns float32.
  """
  a = jnp.exp(a_log.astype(jnp.float32))[:, None]                 # [H, 1]
  return g_min * jax.nn.sigmoid(a * z.astype(jnp.float32))        # [..., H, K]


def kda_gate_softplus(z: jax.Array, a_log: jax.Array) -> jax.Array:
  """Kimi-Linear decay: g = -exp(a_log) * softplus(z), in (-inf, 0).

  z [..., H, K] decay logits; a_log [H] per-head log scale. Returns float32.
  """
  a = jnp.exp(a_log.astype(jnp.float32))[:, None]                 # [H, 1]
  return -a * jax.nn.softplus(z.astype(jnp.float32))              # [..., H, K]


def _default_scale(scale, k_dim):
  return k_dim ** -0.5 if scale is None else scale


def _doc_index(segment_ids: jax.Array) -> jax.Array:
  """Document number of each token: 0 for the first document, +1 per change.

  segment_ids [B, T] -> [B, T] int32. A change is segment_ids[t] != [t-1].
  """
  change = segment_ids[:, 1:] != segment_ids[:, :-1]              # [B, T-1]
  change = jnp.concatenate(
      [jnp.zeros_like(change[:, :1]), change], axis=1)            # [B, T]
  return jnp.cumsum(change.astype(jnp.int32), axis=1)


def _pad_time(x: jax.Array, pad: int, axis: int = 1, mode: str = "constant"):
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, mode=mode)


# --------------------------------------------------------------------------
# Recurrent form (definition) and decode step.
# --------------------------------------------------------------------------


def _delta_step(state, q, k, v, g, beta):
  """One token, float32. state [B, H, K, V]; q, k, g [B, H, K]; v [B, H, V];
  beta [B, H]. q already scaled. Returns (new_state, o [B, H, V])."""
  state = jnp.exp(g)[..., None] * state                           # decay rows
  pred = jnp.einsum("bhk,bhkv->bhv", k, state)                    # k^T S
  delta = beta[..., None] * (v - pred)                            # [B, H, V]
  state = state + k[..., None] * delta[..., None, :]              # += k delta^T
  o = jnp.einsum("bhk,bhkv->bhv", q, state)                       # S^T q
  return state, o


def kda_decode_step(q, k, v, g, beta, state, scale=None):
  """One decode step.

  q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] float32.
  Returns (o [B, H, V] in v.dtype, new_state [B, H, K, V] float32).
  """
  f32 = lambda x: x.astype(jnp.float32)
  scale = _default_scale(scale, q.shape[-1])
  new_state, o = _delta_step(f32(state), f32(q) * scale, f32(k), f32(v),
                             f32(g), f32(beta))
  return o.astype(v.dtype), new_state


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                  output_final_state=False, segment_ids=None):
  """KDA by a scan over tokens (the reference definition).

  q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
  initial_state [B, H, K, V] (float32, zeros if None);
  segment_ids [B, T] int or None: the state is reset to zero before every token
  whose id differs from the previous token's (initial_state only reaches the
  first document).
  Returns (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32 or None).

  The scan runs over blocks of _RECURRENT_BLOCK tokens, each block a
  rematerialized inner scan, so reverse-mode autodiff stores one state per
  block instead of one per token. Padding tokens (k = v = g = beta = 0) leave
  the state unchanged.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  scale = _default_scale(scale, K)
  out_dtype = v.dtype
  f32 = lambda x: x.astype(jnp.float32)
  q, k, v, g, beta = f32(q) * scale, f32(k), f32(v), f32(g), f32(beta)
  if initial_state is None:
    state0 = jnp.zeros((B, H, K, V), jnp.float32)
  else:
    state0 = f32(initial_state)
  if segment_ids is None:
    reset = jnp.zeros((B, T), jnp.bool_)
  else:
    doc = _doc_index(segment_ids)                                 # [B, T]
    reset = jnp.concatenate(
        [jnp.zeros((B, 1), jnp.bool_), doc[:, 1:] != doc[:, :-1]], axis=1)

  blk = min(_RECURRENT_BLOCK, T)
  n_blk = -(-T // blk)
  pad = n_blk * blk - T
  # [B, T, ...] -> [n_blk, blk, B, ...] (time-major for the scans)
  def to_blocks(x):
    x = _pad_time(x, pad)
    x = x.reshape((B, n_blk, blk) + x.shape[2:])
    return jnp.moveaxis(x, (1, 2), (0, 1))
  xs = tuple(to_blocks(x) for x in (q, k, v, g, beta, reset))

  def token_step(state, inp):
    q_t, k_t, v_t, g_t, b_t, r_t = inp
    state = jnp.where(r_t[:, None, None, None], 0.0, state)       # doc boundary
    return _delta_step(state, q_t, k_t, v_t, g_t, b_t)

  @jax.checkpoint
  def block_step(state, inp):
    return jax.lax.scan(token_step, state, inp)

  final_state, o = jax.lax.scan(block_step, state0, xs)           # o [n, blk, B, H, V]
  o = jnp.moveaxis(o, (0, 1), (1, 2)).reshape(B, n_blk * blk, H, V)[:, :T]
  return o.astype(out_dtype), (final_state if output_final_state else None)


# --------------------------------------------------------------------------
# Chunkwise-parallel form.
# --------------------------------------------------------------------------


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


def _intra_chunk_scores(q, k, G):
  """Decay-weighted scores inside each chunk, for s <= r (zero above):

    Aqk[r, s] = sum_c q_r[c] k_s[c] exp(G_r[c] - G_s[c])
    Akk[r, s] = sum_c k_r[c] k_s[c] exp(G_r[c] - G_s[c])

  q, k, G [..., C, K] (G = in-chunk cumulative log decay, non-increasing).
  Returns (Aqk, Akk), each [..., C, C].

  Hierarchical ("secondary chunking"), bottom-up. Write C = base * 2^m. Blocks
  of `base` tokens (base = 1 for a power-of-two C) are done pairwise, with the
  exponent masked to s <= r before exp. Then, repeatedly, two neighbouring
  blocks of b tokens are merged into one of 2b; the only new entries are the
  lower-left b x b block (r in the second half, s in the first), computed as a
  dense matmul by splitting every exponent at the reference
  Gref = G at the last token of the first half:
    exp(G_r - G_s) = exp(G_r - Gref) * exp(Gref - G_s),
  where both factors are <= 1 (G is non-increasing), so nothing overflows for
  any decay (a factor that underflows to 0 means the exact product is below
  float32 range anyway). No [C, C, K] tensor is ever formed.
  """
  *lead, C, K = q.shape
  base = _split_pow2(C)
  m = C // base
  # Base blocks: pairwise [base, base, K] exponents (base = 1: the diagonal).
  qb, kb, Gb = (x.reshape(*lead, m, base, K) for x in (q, k, G))
  causal = jnp.tril(jnp.ones((base, base), jnp.bool_))[:, :, None]
  E = _masked_exp(causal, Gb[..., :, None, :] - Gb[..., None, :, :])  # [..., m, base, base, K]
  Aqk_b = jnp.sum(qb[..., :, None, :] * E * kb[..., None, :, :], -1)  # [..., m, base, base]
  Akk_b = jnp.sum(kb[..., :, None, :] * E * kb[..., None, :, :], -1)
  eye = jnp.eye(m, dtype=q.dtype)[:, None, :, None]               # [m, 1, m, 1]
  Aqk = (Aqk_b[..., :, :, None, :] * eye).reshape(*lead, C, C)    # block diagonal
  Akk = (Akk_b[..., :, :, None, :] * eye).reshape(*lead, C, C)

  b = base
  while b < C:
    M = C // (2 * b)
    qp, kp, Gp = (x.reshape(*lead, M, 2, b, K) for x in (q, k, G))
    ref = Gp[..., 0, -1:, :]                                      # [..., M, 1, K]
    row = jnp.exp(Gp[..., 1, :, :] - ref)                         # [..., M, b, K] <= 1
    col = jnp.exp(ref - Gp[..., 0, :, :])                         # [..., M, b, K] <= 1
    kc = kp[..., 0, :, :] * col                                   # first half, to Gref
    off_qk = jnp.einsum("...rk,...sk->...rs", qp[..., 1, :, :] * row, kc)  # [..., M, b, b]
    off_kk = jnp.einsum("...rk,...sk->...rs", kp[..., 1, :, :] * row, kc)
    Aqk = Aqk + _place_lower_left(off_qk)
    Akk = Akk + _place_lower_left(off_kk)
    b *= 2
  return Aqk, Akk


def _place_lower_left(off):
  """off [..., M, b, b] -> [..., C, C] (C = 2 M b), block m placed at rows
  (2m+1)b.., cols 2mb.., i.e. the lower-left quarter of the m-th 2b x 2b
  diagonal block; zeros elsewhere."""
  *lead, M, b, _ = off.shape
  eye = jnp.eye(M, dtype=off.dtype)[:, None, None, :, None, None]  # [M, 1, 1, M, 1, 1]
  sel = jnp.array([[0., 0.], [1., 0.]], off.dtype)[None, :, None, None, :, None]  # [1, 2, 1, 1, 2, 1]
  full = off[..., :, None, :, None, None, :] * eye * sel          # [..., M, 2, b, M, 2, b]
  return full.reshape(*lead, 2 * M * b, 2 * M * b)


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
  recurrent_kda up to float32 reassociation.

  Shapes and semantics as recurrent_kda. Any T: the sequence is padded to a
  multiple of chunk_size with k = v = q = g = beta = 0 (state unchanged) and
  the outputs are sliced back.

  Per chunk, with G the in-chunk cumulative log decay [C, K] and the state S
  at the chunk start (q already scaled):
    L     = strict_lower(beta * Akk)          A = (I + L)^-1  (triangular solve)
    W     = A (beta * exp(G) * K)             U = A (beta * V)
    Vnew  = U - W S                           (the delta-rule writes u_s)
    O     = (q * exp(G)) S + Aqk Vnew
    S'    = Diag(exp(G_C)) S + (exp(G_C - G) * K)^T Vnew
  Everything but the last three lines is computed for all chunks in parallel;
  a lax.scan over chunks carries S.

  Segments: with doc(t) the document of token t and doc_prev the document of
  the token before the chunk (document 0 for the first chunk, where
  initial_state lives), pairs (r, s) of different documents are masked out of
  Aqk and L; the carried state S reaches token r (the exp(G) terms of W and O)
  only if doc(r) == doc_prev; S' keeps Diag(exp(G_C)) S only if the chunk's
  last token is in doc_prev, and sums k_s Vnew_s only over s in the last
  token's document.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  scale = _default_scale(scale, K)
  out_dtype = v.dtype
  n = -(-T // C)
  pad = n * C - T
  f32 = lambda x: x.astype(jnp.float32)

  # [B, T, H, X] -> [B, H, N, C, X]
  def to_chunks(x):
    x = _pad_time(f32(x), pad)
    x = jnp.swapaxes(x, 1, 2)
    return x.reshape((B, H, n, C) + x.shape[3:])
  q = to_chunks(q) * scale                                        # [B, H, N, C, K]
  k, v, g, beta = (to_chunks(x) for x in (k, v, g, beta))         # beta [B, H, N, C]

  hi = jax.lax.Precision.HIGHEST
  # In-chunk cumulative sum as a matmul with a lower-triangular ones matrix
  # (faster than cumsum on CPU; HIGHEST keeps it exact-ish on TPU too).
  tri = jnp.tril(jnp.ones((C, C), jnp.float32))
  G = jnp.einsum("rs,...sk->...rk", tri, g, precision=hi)        # [B, H, N, C, K]
  G_last = G[..., -1:, :]                                         # [B, H, N, 1, K]
  Aqk, Akk = _intra_chunk_scores(q, k, G)                   # [B, H, N, C, C]
  L = beta[..., :, None] * jnp.tril(Akk, -1)                      # strictly lower

  w_in = k * jnp.exp(G)                                           # decayed from chunk start
  q_in = q * jnp.exp(G)
  k_out = k * jnp.exp(G_last - G)                                 # decayed to chunk end, <= 1
  decay_last = jnp.exp(G_last[..., 0, :])                         # [B, H, N, K]

  if segment_ids is not None:
    doc = _pad_time(_doc_index(segment_ids), pad, mode="edge")    # [B, Tp]
    doc = doc.reshape(B, 1, n, C)                                 # [B, 1, N, C]
    doc_prev = jnp.concatenate(
        [jnp.zeros_like(doc[:, :, :1, -1]), doc[:, :, :-1, -1]], axis=-1)  # [B, 1, N]
    same = (doc[..., :, None] == doc[..., None, :]).astype(jnp.float32)   # [B, 1, N, C, C]
    Aqk = Aqk * same
    L = L * same
    from_prev = (doc == doc_prev[..., None]).astype(jnp.float32)[..., None]  # [B, 1, N, C, 1]
    w_in = w_in * from_prev
    q_in = q_in * from_prev
    to_last = (doc == doc[..., -1:]).astype(jnp.float32)[..., None]   # [B, 1, N, C, 1]
    k_out = k_out * to_last
    keep = (doc[..., -1] == doc_prev).astype(jnp.float32)[..., None]  # [B, 1, N, 1]
    decay_last = decay_last * keep

  # WY / UT transform: one unit-lower-triangular solve for both W and U.
  rhs = jnp.concatenate([beta[..., None] * w_in, beta[..., None] * v], -1)  # [.., C, K+V]
  A = _unit_lower_inverse(L)                                      # [..., C, C]
  wu = jnp.einsum("...rs,...sx->...rx", A, rhs, precision=hi)
  W, U = wu[..., :K], wu[..., K:]                                 # [.., C, K], [.., C, V]

  if initial_state is None:
    state0 = jnp.zeros((B, H, K, V), jnp.float32)
  else:
    state0 = f32(initial_state)

  def chunk_step(S, inp):                                         # S [B, H, K, V]
    W_c, U_c, q_c, Aqk_c, k_c, d_c = inp
    v_new = U_c - jnp.einsum("bhck,bhkv->bhcv", W_c, S)           # [B, H, C, V]
    o = (jnp.einsum("bhck,bhkv->bhcv", q_c, S)
         + jnp.einsum("bhcs,bhsv->bhcv", Aqk_c, v_new))
    S = d_c[..., None] * S + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new)
    return S, o

  xs = tuple(jnp.moveaxis(x, 2, 0)
             for x in (W, U, q_in, Aqk, k_out, decay_last))       # chunk axis first
  final_state, o = jax.lax.scan(chunk_step, state0, xs)           # o [N, B, H, C, V]
  o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, n * C, H, V)[:, :T]
  return o.astype(out_dtype), (final_state if output_final_state else None)
