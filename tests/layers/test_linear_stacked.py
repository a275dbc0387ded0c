"""layers/linear.apply_stacked: several projections of one input as one matmul must equal the
Linears applied one by one, outputs and gradients (w.r.t. the input and every weight).

Tolerance: both sides compute every output element as the same float32 dot product over
the input width; only XLA's blocking of the wider matmul may reassociate the sums, so a
relative 1e-6 (a few float32 ulps at these widths) bounds them; a swapped or transposed
weight, or a wrong slice, is off by O(1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3_jax.layers.init import Init
from k3_jax.layers.linear import Linear, apply_stacked


def _linears(n, in_shape, out_shape):
  init = Init(0)
  axes = ("a",) * (len(in_shape) + len(out_shape))
  return [Linear(in_shape, out_shape, axes, init=init) for _ in range(n)]


def test_stacked_equals_separate():
  in_shape, out_shape = (4, 8), (3, 8)                  # multi-axis input and output
  lins = nnx.List(_linears(3, in_shape, out_shape))
  x = jax.random.normal(jax.random.key(1), (2, 5) + in_shape, jnp.float32)
  cot = [jax.random.normal(jax.random.key(2 + i), (2, 5) + out_shape) for i in range(3)]
  graphdef, state = nnx.split(lins)

  def loss(state, x, stacked):
    ls = nnx.merge(graphdef, state)
    # small_rows=0: stacked at any size (these 10 rows would take the one-by-one path)
    ys = apply_stacked(x, list(ls), small_rows=0) if stacked else [l(x) for l in ls]
    return sum(jnp.sum(y * c) for y, c in zip(ys, cot)), ys

  vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  (_, ys_s), g_s = vg(state, x, True)
  (_, ys_r), g_r = vg(state, x, False)
  for a, b in zip(ys_s, ys_r):
    assert a.shape == b.shape == (2, 5) + out_shape
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_r)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_stacked_refuses_different_shapes():
  a = _linears(1, (8,), (4,))[0]
  b = _linears(1, (8,), (5,))[0]
  with pytest.raises(ValueError, match="apply_stacked"):
    apply_stacked(jnp.ones((2, 8)), [a, b])
