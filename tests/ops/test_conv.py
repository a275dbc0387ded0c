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
