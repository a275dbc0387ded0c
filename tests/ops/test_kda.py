"""Tests for k3_jax.ops.kda: chunked vs recurrent KDA, segments, decode, gates.

Tolerances (f32): chunk_kda reassociates the per-token sums into matmuls and
does a blockwise triangular solve, so it agrees with the token-by-token
recurrence to ~1e-6 typically; we assert 1e-4 relative to the largest entry
(rtol=1e-4, atol=1e-4 * max|ref|) so the tests are robust to platform BLAS
differences. Gradients go through the same reassociation (and the backward of
the solve) and get the same bound.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.ops import kda

B, H, K, V = 2, 2, 16, 16
# Tests check numerics, not speed: a low XLA backend optimization level more
# than halves the compile time, which dominates this file on CPU.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _close(actual, ref, rel=1e-4):
  ref = np.asarray(ref, np.float64)
  actual = np.asarray(actual, np.float64)
  assert np.all(np.isfinite(actual)), "non-finite values"
  # Floor: an exactly-zero reference (e.g. d/dg when the state is still zero)
  # gets float32 round-off from the factored exponentials, ~1e-8 absolute.
  scale = max(np.max(np.abs(ref)), 1e-3)
  np.testing.assert_allclose(actual, ref, rtol=rel, atol=rel * scale)


def _inputs(T, seed=0, gate="lower_bound", g_range=None, with_state=False):
  """Random inputs as the model makes them: L2-normalized q, k; sigmoid beta;
  g from one of the gate functions (or uniform in g_range). gate="mixed":
  batch row 0 uses the K3 lower-bound gate, row 1 the Kimi-Linear softplus
  gate, and head 1 of row 1 a strong decay, g uniform in [-20, 0] (in-chunk
  cumulative decay down to ~-1280: the chunk form must not overflow in values
  or gradients). with_state="mixed": row 0 random, row 1 zero."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  q = kda.l2_normalize(jax.random.normal(ks[0], (B, T, H, K)))
  k = kda.l2_normalize(jax.random.normal(ks[1], (B, T, H, K)))
  v = jax.random.normal(ks[2], (B, T, H, V))
  z = jax.random.normal(ks[3], (B, T, H, K)) * 2.0
  lb = kda.kda_gate_lower_bound(z, jax.random.normal(ks[4], (H,)))
  sp = kda.kda_gate_softplus(z, jnp.log(jax.random.uniform(ks[4], (H,), minval=1, maxval=16)))
  strong = jax.random.uniform(ks[3], (B, T, H, K), minval=-20.0, maxval=0.0)
  if g_range is not None:
    g = jax.random.uniform(ks[3], (B, T, H, K), minval=g_range[0], maxval=g_range[1])
  elif gate == "lower_bound":
    g = lb
  elif gate == "softplus":  # Kimi-Linear: A initialized to log U(1, 16)
    g = sp
  else:
    g = jnp.concatenate([lb[:1], sp[1:]], 0)
    g = g.at[1, :, 1].set(strong[1, :, 1])
  beta = jax.nn.sigmoid(jax.random.normal(ks[5], (B, T, H)))
  s0 = jax.random.normal(ks[6], (B, H, K, V)) if with_state else None
  if with_state == "mixed":
    s0 = s0.at[1].set(0.0)
  return q, k, v, g, beta, s0


def _np_kda(q, k, v, g, beta, s0=None, seg=None):
  """Literal float64 loop of the spec's per-token rule, with state resets at
  segment changes (initial state only for the first document)."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  Bx, T = q.shape[:2]
  S = np.zeros((Bx, H, K, V)) if s0 is None else np.array(s0, np.float64)
  o = np.zeros((Bx, T, H, V))
  for t in range(T):
    if seg is not None and t > 0:
      S[np.asarray(seg)[:, t] != np.asarray(seg)[:, t - 1]] = 0.0
    S = np.exp(g[:, t])[..., None] * S
    pred = np.einsum("bhk,bhkv->bhv", k[:, t], S)
    S = S + k[:, t][..., None] * (beta[:, t, :, None] * (v[:, t] - pred))[..., None, :]
    o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, S)
  return o, S


@functools.lru_cache(maxsize=None)
def _fwd_grad(kind, chunk_size=None):
  """jit(value and gradient) of a fixed random linear functional of
  (outputs, final state) w.r.t. q, k, v, g, beta, initial_state. Cached so
  tests with the same shapes share one compilation."""
  def op(q, k, v, g, beta, s0, seg):
    if kind == "chunk":
      return kda.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                           chunk_size=chunk_size, segment_ids=seg)
    return kda.recurrent_kda(q, k, v, g, beta, initial_state=s0,
                             output_final_state=True, segment_ids=seg)

  def loss(q, k, v, g, beta, s0, seg):
    o, s = op(q, k, v, g, beta, s0, seg)
    kr = jax.random.split(jax.random.PRNGKey(1))
    r_o = jax.random.normal(kr[0], o.shape)
    r_s = jax.random.normal(kr[1], s.shape)
    return jnp.sum(o * r_o) + jnp.sum(s * r_s), (o, s)

  return _jit(jax.grad(loss, argnums=range(6), has_aux=True))


def _run(kind, args, seg=None, chunk_size=None):
  """-> (o, final_state, grads)."""
  q, k, v, g, beta, s0 = args
  if s0 is None:  # initial_state=None is exercised by the forward-only paths
    s0 = jnp.zeros((B, H, K, V))
  grads, (o, s) = _fwd_grad(kind, chunk_size)(q, k, v, g, beta, s0, seg)
  return o, s, grads


def _check_chunk_vs_recurrent(args, C, seg=None):
  o_r, s_r, g_r = _run("recurrent", args, seg)
  o_c, s_c, g_c = _run("chunk", args, seg, C)
  _close(o_c, o_r)
  _close(s_c, s_r)
  for a, b in zip(g_c, g_r):
    _close(a, b)
  return o_c, s_c


# (T, chunk_size): T not a multiple of C, a partial chunk after full ones;
# the default C = 64 and a small C with more chunks (the same T, so the
# recurrent reference compiles once). Every case mixes both gates, a
# strong-decay head and with/without initial state (see _inputs).
CASES = [(100, 16), (100, 64)]


@pytest.mark.parametrize("T,C", CASES)
def test_chunk_matches_recurrent(T, C):
  args = _inputs(T, seed=T + C, gate="mixed", with_state="mixed")
  o_c, s_c = _check_chunk_vs_recurrent(args, C)
  assert o_c.shape == (B, T, H, V) and s_c.shape == (B, H, K, V)
  assert o_c.dtype == jnp.float32 and s_c.dtype == jnp.float32
  o_n, s_n = _np_kda(*args)   # and against the float64 definition
  _close(o_c, o_n)
  _close(s_c, s_n)


def test_initial_state_none():
  """initial_state=None means zeros; output_final_state=False gives None.
  T < C (a single padded chunk)."""
  q, k, v, g, beta, _ = _inputs(40, seed=2, gate="mixed")
  o_n, _ = _np_kda(q, k, v, g, beta)
  for fn in (functools.partial(kda.chunk_kda, chunk_size=64), kda.recurrent_kda):
    o, s = _jit(fn)(q, k, v, g, beta)
    assert s is None
    _close(o, o_n)


def _segments(T, boundaries):
  """[B, T] ids; row 0 changes at `boundaries`; row 1 at T//3 and at the very
  last token (a one-token document, followed by padding in the chunk form)."""
  seg = np.zeros((B, T), np.int32)
  for t in boundaries:
    seg[0, t:] += 1
  seg[1, T // 3:] = 5
  seg[1, T - 1] = 2
  return jnp.asarray(seg)


def _per_document(args, seg):
  """Reference: every document alone with a fresh state (the first one with
  the initial state), float64 numpy loop on the slices."""
  q, k, v, g, beta, s0 = (None if x is None else np.asarray(x) for x in args)
  seg = np.asarray(seg)
  outs, finals = [], []
  for b in range(B):
    T = seg.shape[1]
    edges = [0] + [t for t in range(1, T) if seg[b, t] != seg[b, t - 1]] + [T]
    row = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
      init = s0[b:b + 1] if (s0 is not None and i == 0) else None
      o, s = _np_kda(*(x[b:b + 1, lo:hi] for x in (q, k, v, g, beta)), init)
      row.append(o)
    outs.append(np.concatenate(row, 1))
    finals.append(s)
  return np.concatenate(outs, 0), np.concatenate(finals, 0)


# Row 0's documents: boundaries mid-chunk, several documents inside one chunk
# (incl. a 1-token document), documents spanning chunks, boundaries exactly on
# chunk edges (16, 32, 64 for C = 16; 64 for C = 64). Gradients are checked
# against the recurrent form for C = 16; C = 64 checks the forward only
# (compile time).
@pytest.mark.parametrize("T,C", CASES)
def test_segment_isolation(T, C):
  args = _inputs(T, seed=21, gate="mixed", with_state=True)
  seg = _segments(T, [t for t in (5, 6, 16, 30, 32, 64) if t < T])
  o_ref, s_ref = _per_document(args, seg)
  if C == 16:
    o_c, s_c = _check_chunk_vs_recurrent(args, C, seg)   # also gradients
  else:
    q, k, v, g, beta, s0 = args
    o_c, s_c = _jit(functools.partial(kda.chunk_kda, chunk_size=C, output_final_state=True))(
        q, k, v, g, beta, initial_state=s0, segment_ids=seg)
  _close(o_c, o_ref)
  _close(s_c, s_ref)


def test_decode_steps_equal_recurrent():
  T = 104
  q, k, v, g, beta, s0 = _inputs(T, seed=7, gate="mixed", with_state="mixed")
  o_n, s_n = _np_kda(q, k, v, g, beta, s0)
  step = _jit(kda.kda_decode_step)
  # Step by step from the initial state (same arithmetic as the definition).
  S, n_steps = s0, 12
  o8, s8 = _np_kda(*(x[:, :n_steps] for x in (q, k, v, g, beta)), s0)
  outs = []
  for t in range(n_steps):
    o, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
    outs.append(o)
  _close(jnp.stack(outs, 1), o8, rel=1e-5)
  _close(S, s8, rel=1e-5)
  # Prefill 100 tokens with chunk_kda (shapes of an earlier case), then decode.
  _, S, _ = _run("chunk", (q[:, :100], k[:, :100], v[:, :100], g[:, :100], beta[:, :100], s0),
                 chunk_size=16)
  for t in range(100, T):
    o, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
  _close(o, o_n[:, -1])
  _close(S, s_n)


def test_bf16_inputs():
  """bf16 inputs: internal math is f32, outputs come back in bf16. Compared
  with the f32 recurrence on the same (bf16-rounded) inputs; the only extra
  error is the final bf16 rounding (2^-8 relative), so 1e-2 of the max."""
  args = _inputs(40, seed=9, with_state=True)
  q, k, v, g, beta, s0 = args
  lo = [x.astype(jnp.bfloat16) for x in (q, k, v, g, beta)]
  o_ref, s_ref = _np_kda(*[x.astype(jnp.float32) for x in lo], s0)
  for fn in (functools.partial(kda.chunk_kda, chunk_size=64), kda.recurrent_kda):
    o, s = _jit(fn, static_argnames="output_final_state")(
        *lo, initial_state=s0, output_final_state=True)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    _close(o.astype(jnp.float32), o_ref, rel=1e-2)
    _close(s, s_ref, rel=1e-4)


def test_gates_and_l2_normalize():
  z = jax.random.normal(jax.random.PRNGKey(0), (3, H, K)) * 10
  a_log = jnp.array([0.0, 1.0])
  g = kda.kda_gate_lower_bound(z, a_log)
  assert g.dtype == jnp.float32
  assert np.all((g >= -5.0) & (g <= 0.0))  # open interval, saturates in f32
  np.testing.assert_allclose(g, -5.0 * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * z), rtol=1e-6)
  g2 = kda.kda_gate_softplus(z.astype(jnp.bfloat16), a_log)
  assert g2.dtype == jnp.float32 and np.all(g2 <= 0.0)
  np.testing.assert_allclose(
      g2, -jnp.exp(a_log)[:, None] * jax.nn.softplus(z.astype(jnp.bfloat16).astype(jnp.float32)),
      rtol=1e-6)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, K)).astype(jnp.bfloat16)
  y = kda.l2_normalize(x)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(jnp.linalg.norm(y.astype(jnp.float32), axis=-1), 1.0, rtol=1e-2)


def test_one_entry_point_all_backends_and_shape_checks():
  """chunk_kda / decode_step(backend=...): "reference" is the plain-JAX chunked form itself,
  "pallas" (the kernels, interpret mode on this CPU host) agrees with it at the module
  tolerance (1e-4 of the largest entry), "auto" resolves to the reference off TPU. A
  mis-shaped argument is refused by every backend with its name."""
  T = 16
  # One sequence, one head: the interpreted kernels cost seconds per grid step to compile.
  q, k, v, g, beta = (x[:1, :, :1] for x in _inputs(T, seed=5, with_state=False)[:5])
  s0 = jax.random.normal(jax.random.PRNGKey(9), (1, 1, K, V)) * 0.1
  kw = dict(initial_state=s0, output_final_state=True, chunk_size=16)
  ref_o, ref_s = kda.chunk_kda_reference(q, k, v, g, beta, **kw)
  o, s = kda.chunk_kda(q, k, v, g, beta, backend="reference", **kw)
  np.testing.assert_array_equal(o, ref_o)
  np.testing.assert_array_equal(s, ref_s)
  assert kda.resolve_backend("auto") == "reference"
  po, ps = jax.jit(functools.partial(kda.chunk_kda, backend="pallas", **kw))(q, k, v, g, beta)
  _close(po, ref_o)
  _close(ps, ref_s)
  step_ref = kda.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
  step_pal = kda.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0,
                             backend="pallas")
  for a, r in zip(step_pal, step_ref):
    _close(a, r)
  for backend in ("reference", "pallas"):
    with pytest.raises(ValueError, match="beta"):
      kda.chunk_kda(q, k, v, g, beta[:, :-1], backend=backend)
    with pytest.raises(ValueError, match="state"):
      kda.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0[..., :1],
                      backend=backend)
  with pytest.raises(ValueError, match="backend"):
    kda.chunk_kda(q, k, v, g, beta, backend="triton")
