"""Tests for k3_jax.ops.conv: causal depthwise short convolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.ops.conv import short_conv, short_conv_step

B, T, D, W = 2, 11, 5, 4


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, T, D)).astype(np.float32)
  w = rng.normal(size=(W, D)).astype(np.float32)
  return x, w


def _numpy_conv(x, w, cache=None, doc=None):
  """Explicit loop: y_t = sum_j w[j] x_{t-(W-1)+j}; cache for t' < 0 (doc 0)."""
  Bx, Tx, Dx = x.shape
  if cache is None:
    cache = np.zeros((Bx, W - 1, Dx), np.float32)
  y = np.zeros_like(x, dtype=np.float64)
  for b in range(Bx):
    for t in range(Tx):
      for j in range(W):
        src = t - (W - 1) + j
        if src >= 0:
          if doc is not None and doc[b, src] != doc[b, t]:
            continue
          y[b, t] += w[j] * x[b, src]
        else:
          if doc is not None and doc[b, t] != 0:
            continue
          y[b, t] += w[j] * cache[b, W - 1 + src]
  return y


# f32 throughout; a 4-term sum, so 1e-5 covers rounding.
TOL = dict(rtol=1e-5, atol=1e-5)


def test_matches_numpy_loop():
  x, w = _inputs()
  y, cache = jax.jit(short_conv)(x, w)
  np.testing.assert_allclose(y, _numpy_conv(x, w), **TOL)
  np.testing.assert_array_equal(cache, x[:, -(W - 1):])


def test_with_cache_matches_numpy_loop():
  x, w = _inputs(1)
  cache = np.random.default_rng(2).normal(size=(B, W - 1, D)).astype(np.float32)
  y, _ = short_conv(x, w, cache=cache)
  np.testing.assert_allclose(y, _numpy_conv(x, w, cache=cache), **TOL)


def test_prefill_in_pieces_then_steps_equals_one_shot():
  x, w = _inputs(3)
  y_full, cache_full = short_conv(x, w)
  # Prefill 2 tokens (shorter than the window), then 4, then decode one by one.
  y1, c = short_conv(x[:, :2], w)
  y2, c = short_conv(x[:, 2:6], w, cache=c)
  ys = [y1, y2]
  step = jax.jit(short_conv_step)
  for t in range(6, T):
    y_t, c = step(x[:, t], w, c)
    ys.append(y_t[:, None])
  np.testing.assert_allclose(jnp.concatenate(ys, 1), y_full, **TOL)
  np.testing.assert_allclose(c, cache_full, **TOL)
  # a decoded token's output is bitwise the sequence form's over the same window
  y_seq, _ = jax.jit(short_conv)(x[:, T - 1:], w, cache=jnp.asarray(x[:, T - W:T - 1]))
  y_step, _ = step(x[:, T - 1], w, jnp.asarray(x[:, T - W:T - 1]))
  assert np.array_equal(np.asarray(y_step), np.asarray(y_seq[:, 0]))


@pytest.mark.parametrize("bounds", [[3, 4, 9], [1, 2, 10]])
def test_segment_isolation(bounds):
  """Packed result equals running each document alone from a fresh window."""
  x, w = _inputs(4)
  seg = np.zeros((B, T), np.int32)
  for s in bounds:
    seg[0, s:] += 1
  seg[1, 6:] = 7                                   # second row: one boundary
  y, cache = jax.jit(short_conv)(x, w, seg)
  for b in range(B):
    edges = [0] + [t for t in range(1, T) if seg[b, t] != seg[b, t - 1]] + [T]
    for lo, hi in zip(edges[:-1], edges[1:]):
      y_doc, c_doc = short_conv(x[b:b + 1, lo:hi], w)
      np.testing.assert_allclose(y[b:b + 1, lo:hi], y_doc, **TOL)
    # The cache continues the last document only.
    np.testing.assert_allclose(cache[b:b + 1], c_doc, **TOL)


def test_segments_with_cache_reach_first_document_only():
  x, w = _inputs(5)
  cache = np.random.default_rng(6).normal(size=(B, W - 1, D)).astype(np.float32)
  seg = np.zeros((B, T), np.int32)
  seg[:, 2:] = 1
  doc = seg  # already 0, 1
  y, _ = short_conv(x, w, seg, cache)
  np.testing.assert_allclose(y, _numpy_conv(x, w, cache=cache, doc=doc), **TOL)


def test_bf16_dtype():
  x, w = _inputs(7)
  y, cache = short_conv(jnp.asarray(x, jnp.bfloat16), w)
  assert y.dtype == jnp.bfloat16 and cache.dtype == jnp.bfloat16
  ref = _numpy_conv(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), w)
  # Only the final cast to bf16 rounds: relative 2^-8.
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=1e-2, atol=1e-2)


def _autodiff_conv(x, w, cache, doc):
  """Plain shifted sums (JAX differentiates these itself): the reference for the
  hand-written backward of short_conv. doc [B, T] document index (0 for the cache)."""
  xp = jnp.concatenate([cache, x], axis=1)
  docp = jnp.concatenate([jnp.zeros((B, W - 1), doc.dtype), doc], axis=1)
  return sum(jnp.where((docp[:, j:j + T] == doc)[..., None], w[j] * xp[:, j:j + T], 0.0)
             for j in range(W))


@pytest.mark.parametrize("packed", [False, True])
def test_gradients_match_autodiff(packed):
  """d/dx, d/dw, d/dcache of a nonlinear loss of short_conv (its custom backward: one padded
  dy, one weight reduction) vs JAX's autodiff of the plain shifted sums. Linear op in f32
  with 4-term sums: 1e-5 covers rounding; a wrong shift or a mask applied at the source
  instead of the output token is O(1) off."""
  x, w = _inputs(7)
  cache = np.random.default_rng(8).normal(size=(B, W - 1, D)).astype(np.float32)
  seg = np.zeros((B, T), np.int32)
  if packed:
    seg[0, 3:] = 1
    seg[0, 8:] = 2
    seg[1, 5:] = 4
  doc = np.cumsum(np.concatenate([np.zeros((B, 1), np.int32),
                                  (seg[:, 1:] != seg[:, :-1]).astype(np.int32)], 1), 1)
  r = np.random.default_rng(9).normal(size=(B, T, D)).astype(np.float32)

  def ours(x, w, c):
    return jnp.sum(jnp.sin(short_conv(x, w, seg if packed else None, c)[0]) * r)

  def ref(x, w, c):
    return jnp.sum(jnp.sin(_autodiff_conv(x, w, c, jnp.asarray(doc))) * r)

  got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(x, w, cache)
  want = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(x, w, cache)
  for a, b in zip(got, want):
    assert np.abs(np.asarray(b)).max() > 1e-2                # every gradient is exercised
    np.testing.assert_allclose(a, b, **TOL)
