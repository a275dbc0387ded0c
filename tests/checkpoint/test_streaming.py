"""streaming.constant_leaves: a fresh state's leaves as lazy arrays equal to what the init
function computes, without allocating the constant fills; a leaf that depends on the
inputs' values is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3_jax.checkpoint import streaming


def _value(x: streaming.LazyArray) -> np.ndarray:
  if not x.rows:
    return x.row(())
  return np.stack([x.row(i) for i in x.indices()]).reshape(x.shape)


def test_constant_leaves_equal_the_init():
  params = {"w": jax.ShapeDtypeStruct((3, 4, 8), jnp.float32),
            "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16)}
  coeffs = jnp.array([3.4, -4.7, 2.0])                  # a constant that is not a fill

  def init(p):
    return (optax.adamw(1e-3).init(p), coeffs, jnp.full((2, 2), 7, jnp.int32))

  lazy = streaming.constant_leaves(init, params)
  ref = jax.tree.leaves(jax.jit(init)(jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype),
                                                   params)))
  assert len(lazy) == len(ref)
  for x, r in zip(lazy, ref):                          # exact: same values and dtypes
    assert x.shape == r.shape and x.dtype == r.dtype and np.array_equal(_value(x), r)
  moments = [x for x in lazy if x.shape == (3, 4, 8)]
  assert moments and all(x.rows == 1 for x in moments)  # written a matrix at a time


def test_leaf_depending_on_inputs_is_refused():
  with pytest.raises(ValueError, match=r"\['copy'\].*depends on the inputs"):
    streaming.constant_leaves(lambda p: {"copy": p * 2, "zeros": jnp.zeros(3)},
                              jax.ShapeDtypeStruct((4,), jnp.float32))
