"""A KDA layer's verify window (k3_jax/layers/kda_window.py), one layer alone: the window's
outputs and, for every number of kept tokens, the state and conv tails after them, by both
ways of making them (keeping every position's state / replaying the recorded inputs),
against the layer's own one-token decode steps. Tolerance: the window's convolution runs
over T tokens at once (the decode's one token at a time) and its projections over B T rows:
the same products, summed in another order: 1e-5 in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax.cache import replace
from k3_jax.layers.init import Init
from k3_jax.layers.kda import KDA
from k3_jax.layers.kda_window import empty_window, keeps_states, replay

CFG = configs.get("k3_tiny")
B, T, TOL = 2, 4, 1e-5


@pytest.mark.parametrize("keep_states", [True, False], ids=["keep_states", "replay"])
def test_window_then_kept_prefix_equals_decoding_it(keep_states):
  layer = KDA(CFG, init=Init(0))
  x = jax.random.normal(jax.random.key(1), (B, T, CFG.d_model), jnp.float32)
  step = nnx.jit(lambda l, x, c: l(x, cache=c))
  keys = iter(jax.random.split(jax.random.key(2), 4))
  start = jax.tree.map(lambda a: 0.3 * jax.random.normal(next(keys), a.shape, a.dtype),
                       layer.init_cache(B))                        # some earlier tokens' state
  ref, caches = [], [start]
  for i in range(T):                                              # one token at a time
    y, c = step(layer, x[:, i:i + 1], caches[-1])
    ref.append(y[:, 0])
    caches.append(c)

  @nnx.jit
  def window(l, rows, cache, keep):
    marked = replace(cache, window=empty_window(cache, (B,), T, keep_states))
    y, out = l(rows, cache=marked)
    return y, replay(out, keep)

  rows = x.reshape(B * T, 1, -1)                                   # row b T + t
  for n in range(T + 1):
    keep = jnp.array([n, T - n], jnp.int32)                        # two prefixes at once
    y, got = window(layer, rows, start, keep)
    np.testing.assert_allclose(y.reshape(B, T, -1), jnp.stack(ref, 1), atol=TOL, rtol=0)
    assert got.window is None
    for b in range(B):
      want = caches[int(keep[b])]
      for name in ("state", "conv_q", "conv_k", "conv_v"):
        np.testing.assert_allclose(getattr(got, name)[b], getattr(want, name)[b], atol=TOL,
                                   rtol=0, err_msg=f"{name}, row {b} keeping {int(keep[b])}")


def test_the_way_follows_the_state_size():
  """A small model's layers keep states; k3's (H 96, K = V = 128: 6 MiB a token) replay."""
  small = KDA(CFG, init=Init(0)).init_cache(1)
  assert keeps_states(small)
  big = jax.ShapeDtypeStruct((1, 96, 128, 128), jnp.float32)
  assert not keeps_states(replace(small, state=big))
