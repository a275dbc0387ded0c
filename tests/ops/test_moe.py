"""Router, expert selection and dropless MoE dispatch tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.ops import moe as moe_ops
from k3_jax.ops.moe import (expert_load, moe_dense_reference, moe_dispatch,
                            router_scores, select_experts)


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _expert_weights(seed, e, din, f, dtype=jnp.float32):
  # numpy init: keeps the eager-op compile count (and test time) down.
  rng = np.random.default_rng(seed)
  w_gate = rng.normal(size=(e, din, f)) / np.sqrt(din)
  w_up = rng.normal(size=(e, din, f)) / np.sqrt(din)
  w_down = rng.normal(size=(e, f, din)) / np.sqrt(f)
  return tuple(jnp.asarray(w, dtype) for w in (w_gate, w_up, w_down))


# --------------------------------------------------------------------------
# Router and selection


def test_router_scores_sigmoid_f32():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(10, 16)).astype(np.float32)
  w = rng.normal(size=(16, 6)).astype(np.float32)
  s = router_scores(jnp.asarray(x), jnp.asarray(w))
  assert s.shape == (10, 6) and s.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(s), _np_sigmoid(x @ w), rtol=1e-5, atol=1e-6)
  s_bf16 = router_scores(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
  assert s_bf16.dtype == jnp.float32


def test_select_experts_bias_picks_but_scores_weigh():
  scores = jnp.array([[0.9, 0.8, 0.1, 0.2],
                      [0.3, 0.6, 0.5, 0.4]], jnp.float32)
  bias = jnp.array([0.0, 0.0, 1.0, 0.0], jnp.float32)  # pushes expert 2 into every top-2
  weights, ids = select_experts(scores, bias, top_k=2)
  assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
  np.testing.assert_array_equal(np.sort(np.asarray(ids), axis=-1), [[0, 2], [1, 2]])
  # Weights: the chosen *unbiased* scores, renormalised to sum to 1.
  got = {(i, int(e)): float(w) for i in range(2)
         for e, w in zip(np.asarray(ids[i]), np.asarray(weights[i]))}
  assert got[(0, 0)] == pytest.approx(0.9 / 1.0)
  assert got[(0, 2)] == pytest.approx(0.1 / 1.0)
  assert got[(1, 1)] == pytest.approx(0.6 / 1.1)
  assert got[(1, 2)] == pytest.approx(0.5 / 1.1)
  # Without the bias the plain top-2 is chosen.
  _, ids0 = select_experts(scores, jnp.zeros(4), top_k=2)
  np.testing.assert_array_equal(np.sort(np.asarray(ids0), axis=-1), [[0, 1], [1, 2]])


def test_select_experts_matches_numpy_and_scaling():
  rng = np.random.default_rng(1)
  s = _np_sigmoid(rng.normal(size=(32, 12))).astype(np.float32)
  b = rng.normal(scale=0.3, size=(12,)).astype(np.float32)
  weights, ids = select_experts(jnp.asarray(s), jnp.asarray(b), top_k=3,
                                routed_scaling_factor=2.5)
  want_ids = np.argsort(-(s + b), axis=-1, kind="stable")[:, :3]
  np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), np.sort(want_ids, -1))
  chosen = np.take_along_axis(s, np.asarray(ids), axis=-1)
  np.testing.assert_allclose(np.asarray(weights), 2.5 * chosen / chosen.sum(-1, keepdims=True),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 2.5, rtol=1e-6)


def test_select_experts_gradients():
  rng = np.random.default_rng(2)
  s = jnp.asarray(_np_sigmoid(rng.normal(size=(8, 6))), jnp.float32)
  b = jnp.asarray(rng.normal(scale=0.5, size=(6,)), jnp.float32)
  c = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)

  def loss(s, b):
    w, _ = select_experts(s, b, top_k=2)
    return jnp.sum(w * c)

  gs, gb = jax.grad(loss, argnums=(0, 1))(s, b)
  assert np.all(np.asarray(gb) == 0.0)  # the bias is never differentiated
  # Gradient to scores: only the chosen experts, d/ds_j of s_j / sum(s_T).
  _, ids = select_experts(s, b, top_k=2)
  ids = np.asarray(ids)
  sn = np.asarray(s)
  want = np.zeros_like(sn)
  for i in range(8):
    chosen = sn[i, ids[i]]
    tot = chosen.sum()
    for a in range(2):
      # d(sum_r c_r s_r / tot)/ds_a = c_a / tot - sum_r c_r s_r / tot^2
      want[i, ids[i, a]] = c[i, a] / tot - float(np.dot(c[i], chosen)) / tot**2
  np.testing.assert_allclose(np.asarray(gs), want, rtol=1e-5, atol=1e-6)


def _np_group_limited(biased, n_group, topk_group, k):
  n, e = biased.shape
  g = biased.reshape(n, n_group, e // n_group)
  gscore = np.sort(g, axis=-1)[..., -2:].sum(-1)                    # [N, G]
  keep = np.argsort(-gscore, axis=-1, kind="stable")[:, :topk_group]
  masked = np.full_like(biased, -np.inf)
  for i in range(n):
    for grp in keep[i]:
      sl = slice(grp * e // n_group, (grp + 1) * e // n_group)
      masked[i, sl] = biased[i, sl]
  return np.argsort(-masked, axis=-1, kind="stable")[:, :k], keep


def test_group_limited_routing():
  rng = np.random.default_rng(3)
  n, e, n_group, topk_group, k = 64, 16, 4, 2, 3
  s = _np_sigmoid(rng.normal(size=(n, e))).astype(np.float32)
  b = rng.normal(scale=0.2, size=(e,)).astype(np.float32)
  weights, ids = select_experts(jnp.asarray(s), jnp.asarray(b), top_k=k,
                                n_group=n_group, topk_group=topk_group)
  ids = np.asarray(ids)
  want_ids, keep = _np_group_limited(s + b, n_group, topk_group, k)
  np.testing.assert_array_equal(np.sort(ids, -1), np.sort(want_ids, -1))
  for i in range(n):  # every chosen expert lies in one of the kept groups
    assert set((ids[i] // (e // n_group)).tolist()) <= set(keep[i].tolist())
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
  # Keeping all groups is plain top-k.
  _, ids_all = select_experts(jnp.asarray(s), jnp.asarray(b), top_k=k, n_group=n_group,
                              topk_group=n_group)
  _, ids_flat = select_experts(jnp.asarray(s), jnp.asarray(b), top_k=k)
  np.testing.assert_array_equal(np.asarray(ids_all), np.asarray(ids_flat))


def test_group_limited_excludes_lone_best_expert():
  # Group 0 holds the single best expert but a weak second; group 1 is strong overall.
  s = jnp.array([[0.99, 0.0, 0.0, 0.0, 0.6, 0.6, 0.6, 0.6]], jnp.float32)
  _, ids = select_experts(s, jnp.zeros(8), top_k=2, n_group=2, topk_group=1)
  assert set(np.asarray(ids)[0].tolist()) <= {4, 5, 6, 7}
  _, ids_flat = select_experts(s, jnp.zeros(8), top_k=2)
  assert 0 in np.asarray(ids_flat)[0].tolist()


def test_select_experts_rejects_bad_config():
  s = jnp.zeros((2, 8))
  with pytest.raises(ValueError, match="top_k"):
    select_experts(s, jnp.zeros(8), top_k=9)
  with pytest.raises(ValueError, match="n_group"):
    select_experts(s, jnp.zeros(8), top_k=2, n_group=3)
  with pytest.raises(ValueError, match="topk_group"):
    select_experts(s, jnp.zeros(8), top_k=2, n_group=2, topk_group=3)


def test_expert_load():
  ids = jnp.array([[0, 3], [3, 1], [3, 0]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(expert_load(ids, 5)), [2, 1, 0, 3, 0])
  assert expert_load(ids, 5).dtype == jnp.int32


# --------------------------------------------------------------------------
# Dispatch vs dense reference


def _routing(seed, n, d, e, k, skew):
  """Inputs, router weights and bias; `skew` biases toward few experts."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  w_r = jnp.asarray(rng.normal(size=(d, e)) / np.sqrt(d), jnp.float32)
  bias = np.zeros((e,), np.float32)
  if skew:
    # Experts 0..k-1 are favoured, the last two are never reachable (unless k = E).
    bias[:k] = 0.4
    bias[e - 2:] = -5.0
  return x, w_r, jnp.asarray(bias)


@functools.partial(jax.jit, static_argnames=("k", "activation"))
def _both(x, w_r, bias, w_gate, w_up, w_down, k, activation="situ"):
  """(y_dispatch, y_dense, expert_ids) for one routing, in a single compile."""
  weights, ids = select_experts(router_scores(x, w_r), bias, top_k=k)
  y = moe_dispatch(x, weights, ids, w_gate, w_up, w_down, activation=activation)
  y_ref = moe_dense_reference(x, weights, ids, w_gate, w_up, w_down, activation=activation)
  return y, y_ref, ids


CASES = [
    # (n, d, e, f, k, skew)
    (24, 16, 8, 12, 2, False),
    (40, 16, 8, 12, 2, True),     # skewed: some experts get zero tokens
    (17, 8, 6, 10, 1, True),      # k = 1
    (9, 8, 4, 6, 4, False),       # k = E: every expert sees every token
]


@pytest.mark.parametrize("n,d,e,f,k,skew", CASES)
@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_dispatch_matches_dense(n, d, e, f, k, skew, activation):
  x, w_r, bias = _routing(n * 100 + e, n, d, e, k, skew)
  experts = _expert_weights(n + 1, e, d, f)
  # Scale up the inputs so SiTU's clamps are exercised.
  y, y_ref, ids = _both(3.0 * x, w_r, bias, *experts, k=k, activation=activation)
  load = np.bincount(np.asarray(ids).ravel(), minlength=e)
  if skew and k < e:
    assert load[-1] == 0 and load[-2] == 0
  assert y.shape == (n, d) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loop_tile", [64, 2])
def test_tiled_loop_equals_batched_and_differentiates_batched(loop_tile, monkeypatch):
  """The tiled layout's two programs: the loop over used tiles (what a plain call runs)
  equals the batched per-tile matmuls (1e-5: the same products, summed per tile either
  way, only the matmul kernels and the order of a token's k terms differ), with experts
  left empty and a tile size that leaves padding; differentiated, `_moe_tiled` is the
  batched program's gradient exactly. loop_tile 2: tiles above it send each expert's rows
  past its last whole tile (when at most half a tile) to a second loop of 2-row tiles
  (`_split_layout`), as a long prefill's 512-row tiles do with 64-row ones."""
  monkeypatch.setattr(moe_ops, "LOOP_TILE", loop_tile)
  n, d, e, f, k = 40, 16, 8, 12, 2
  x, w_r, bias = _routing(11, n, d, e, k, True)
  experts = _expert_weights(12, e, d, f)
  weights, ids = select_experts(router_scores(3.0 * x, w_r), bias, top_k=k)

  @jax.jit
  def both(x, weights, *ex):
    out = [(moe_ops._moe_tiled(x, weights, ids, *ex, "situ", 4.0, 25.0, tile=tile),
            moe_ops._moe_tiles_batched(x, weights, ids, *ex, "situ", 4.0, 25.0, tile=tile))
           for tile in (3, 8)]
    grad = lambda fn: jax.grad(lambda x, w, *ex: jnp.sum(jnp.sin(
        fn(x, w, ids, *ex, "situ", 4.0, 25.0, tile=8))), argnums=(0, 1, 2, 3, 4))(
            x, weights, *ex)
    return out, grad(moe_ops._moe_tiled), grad(moe_ops._moe_tiles_batched)

  out, g_tiled, g_batched = both(3.0 * x, weights, *experts)
  for loop, batched in out:
    np.testing.assert_allclose(np.asarray(loop), np.asarray(batched), rtol=1e-5, atol=1e-5)
  for a, b in zip(g_tiled, g_batched):
    assert np.array_equal(np.asarray(a), np.asarray(b))


# (3, 16, 4) and (5, 4, 4) take the same two paths as (1, 16, 4) (gathered) and (8, 16, 4)
# (every expert): slow, for the suite's budget
_SLOW = pytest.mark.slow
@pytest.mark.parametrize("n,e,k", [(1, 16, 4), pytest.param(3, 16, 4, marks=_SLOW), (8, 16, 4),
                                   pytest.param(5, 4, 4, marks=_SLOW)])
def test_small_token_path_matches_dense(n, e, k):
  """moe_small (decode: gathered experts when N k < E, every expert otherwise; with
  pair_loop, XLA:CPU's choice, a loop over the pairs or over small expert tiles) equals the
  dense reference (f32, 1e-5: the same products summed in another order), and a row's
  result does not depend on the other rows (it is computed from that row alone)."""
  d, f = 16, 12
  x, w_r, bias = _routing(n + 7 * e, n, d, e, k, False)
  experts = _expert_weights(n + 2, e, d, f)
  weights, ids = select_experts(router_scores(3.0 * x, w_r), bias, top_k=k)
  y = moe_ops.moe_small(3.0 * x, weights, ids, *experts)
  y_ref = moe_dense_reference(3.0 * x, weights, ids, *experts)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
  one = moe_ops.moe_small(3.0 * x[:1], weights[:1], ids[:1], *experts)
  if n * k < e:       # the gathered path: row 0 alone is bitwise row 0 in the batch
    assert np.array_equal(np.asarray(one[0]), np.asarray(y[0]))
    # the same pairs as a loop over them (XLA:CPU's choice): the same values, and each
    # row still its own (row 0 alone bitwise row 0 in the batch)
    loop = jax.jit(functools.partial(moe_ops.moe_small, pair_loop=True))
    y_loop = loop(3.0 * x, weights, ids, *experts)
    np.testing.assert_allclose(np.asarray(y_loop), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    one = loop(3.0 * x[:1], weights[:1], ids[:1], *experts)
    assert np.array_equal(np.asarray(one[0]), np.asarray(y_loop[0]))
  else:               # the loop over expert tiles: row 0's bits with the other rows redrawn
    loop = jax.jit(functools.partial(moe_ops.moe_small, pair_loop=True))   # and moved
    y_loop = loop(3.0 * x, weights, ids, *experts)
    np.testing.assert_allclose(np.asarray(y_loop), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    x2, w_r2, bias2 = _routing(n + 7 * e + 1, n, d, e, k, False)
    w2, ids2 = select_experts(router_scores(3.0 * x2, w_r2), bias2, top_k=k)
    put = lambda a, b: jnp.concatenate([b[1:-1], a[:1], b[-1:]])     # row 0 -> row n - 2
    other = loop(put(3.0 * x, 3.0 * x2), put(weights, w2), put(ids, ids2), *experts)
    assert np.array_equal(np.asarray(other[n - 2]), np.asarray(y_loop[0]))


def test_dispatch_matches_explicit_loop():
  """Independent numpy check (per token, per chosen expert)."""
  n, d, e, f, k = 6, 4, 3, 5, 2
  x, w_r, bias = _routing(7, n, d, e, k, False)
  w_gate, w_up, w_down = [np.asarray(w) for w in _expert_weights(7, e, d, f)]
  weights, ids = select_experts(router_scores(x, w_r), bias, top_k=k)
  xn, wn, idn = np.asarray(x, np.float64), np.asarray(weights), np.asarray(ids)
  want = np.zeros((n, d))
  for i in range(n):
    for j in range(k):
      ex = idn[i, j]
      g = xn[i] @ w_gate[ex]
      u = xn[i] @ w_up[ex]
      h = (4 * np.tanh(g / 4) * _np_sigmoid(g)) * (25 * np.tanh(u / 25))
      want[i] += wn[i, j] * (h @ w_down[ex])
  y = jax.jit(moe_dispatch)(x, weights, ids, *map(jnp.asarray, (w_gate, w_up, w_down)))
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,d,e,f,k,skew", CASES)
def test_dispatch_gradients_match_dense(n, d, e, f, k, skew):
  x, w_r, bias = _routing(n + e, n, d, e, k, skew)
  x = 2.0 * x
  experts = _expert_weights(n + e + 1, e, d, f)
  cot = jnp.asarray(np.random.default_rng(n).normal(size=(n, d)), jnp.float32)

  def loss(moe_fn, x, w_r, bias, w_gate, w_up, w_down):
    weights, ids = select_experts(router_scores(x, w_r), bias, top_k=k)
    y = moe_fn(x, weights, ids, w_gate, w_up, w_down)
    return jnp.sum(y * cot)

  def both_grads(*args):
    argnums = tuple(range(6))
    return (jax.grad(lambda *a: loss(moe_dispatch, *a), argnums=argnums)(*args),
            jax.grad(lambda *a: loss(moe_dense_reference, *a), argnums=argnums)(*args))

  g, g_ref = jax.jit(both_grads)(x, w_r, bias, *experts)
  names = ["x", "w_router", "bias", "w_gate", "w_up", "w_down"]
  for name, a, b in zip(names, g, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                               err_msg=name)
  assert np.all(np.asarray(g[2]) == 0.0)                      # bias: no gradient
  assert np.any(np.asarray(g[1]) != 0.0)                      # router learns via weights
  if skew and k < e:                                          # unused experts: zero grads
    for w in g[3:]:
      assert np.all(np.asarray(w)[-2:] == 0.0)


def test_dispatch_bf16():
  n, d, e, f, k = 32, 16, 8, 24, 2
  x, w_r, bias = _routing(11, n, d, e, k, True)
  experts = _expert_weights(11, e, d, f, jnp.bfloat16)
  xb = x.astype(jnp.bfloat16)

  @jax.jit
  def run(x, xb, w_r, bias, experts):
    weights, ids = select_experts(router_scores(x, w_r), bias, top_k=k)
    return (moe_dispatch(xb, weights, ids, *experts),
            moe_dense_reference(xb, weights, ids, *experts),
            moe_dense_reference(x, weights, ids, *[w.astype(jnp.float32) for w in experts]))

  y, y_ref, y_f32 = run(x, xb, w_r, bias, experts)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                             rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_f32), rtol=5e-2, atol=5e-2)


def test_dispatch_uses_grouped_matmul_and_custom_gmm():
  n, d, e, f, k = 20, 8, 5, 6, 2
  x, w_r, bias = _routing(5, n, d, e, k, True)
  experts = _expert_weights(5, e, d, f)
  weights, ids = select_experts(router_scores(x, w_r), bias, top_k=k)

  ragged = functools.partial(moe_dispatch, gmm=moe_ops.default_gmm("ragged_dot"))
  jaxpr = str(jax.make_jaxpr(ragged)(x, weights, ids, *experts))
  assert jaxpr.count("ragged_dot") >= 3
  # On a CPU backend the default is the tiled grouped matmul (no ragged_dot lowering there).
  assert "ragged_dot" not in str(jax.make_jaxpr(moe_dispatch)(x, weights, ids, *experts))

  calls = []

  def gather_gmm(lhs, rhs, group_sizes):
    # Same contract as ragged_dot_gmm, implemented by gathering each row's weight.
    calls.append((lhs.shape, rhs.shape, group_sizes.shape))
    row_group = jnp.repeat(jnp.arange(rhs.shape[0]), group_sizes,
                           total_repeat_length=lhs.shape[0])       # [M]
    return jnp.einsum("mk,mkn->mn", lhs, rhs[row_group],
                      preferred_element_type=jnp.float32)

  y = jax.jit(functools.partial(moe_dispatch, gmm=gather_gmm))(x, weights, ids, *experts)
  y_ref = jax.jit(moe_dispatch)(x, weights, ids, *experts)
  assert len(calls) == 3
  assert calls[0] == ((n * k, d), (e, d, f), (e,))
  assert calls[2] == ((n * k, f), (e, f, d), (e,))
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)


def test_dispatch_unknown_activation():
  x, w_r, bias = _routing(9, 12, 8, 4, 2, False)
  experts = _expert_weights(9, 4, 8, 6)
  weights, ids = select_experts(router_scores(x, w_r), bias, top_k=2)
  with pytest.raises(ValueError, match="unknown GLU activation"):
    jax.eval_shape(functools.partial(moe_dispatch, activation="gelu"),
                   x, weights, ids, *experts)


@pytest.mark.parametrize("tile", [None, 8, 32])
def test_tiled_gmm_equals_ragged_dot(tile):
  rng = np.random.default_rng(5)
  sizes = np.array([0, 13, 1, 40, 0, 9, 33], np.int32)          # empty and odd-sized groups
  m = int(sizes.sum())
  lhs = jnp.asarray(rng.standard_normal((m, 12)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((len(sizes), 12, 5)), jnp.float32)
  gs = jnp.asarray(sizes)
  want = moe_ops.ragged_dot_gmm(lhs, rhs, gs)
  got = jax.jit(lambda a, b, c: moe_ops.tiled_gmm(a, b, c, tile))(lhs, rhs, gs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Gradients too (the tiled form scatters into padded tiles and gathers back).
  f = lambda fn: jax.grad(lambda a, b: jnp.sum(jnp.sin(fn(a, b, gs))), argnums=(0, 1))(lhs, rhs)
  for a, b in zip(f(lambda a, b, c: moe_ops.tiled_gmm(a, b, c, tile)), f(moe_ops.ragged_dot_gmm)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_dot_tpu_gmm_gradients_equal_ragged_dot(dtype):
  """The TPU training gmm (ragged_dot forward and input gradient, the grouped transposed
  kernel for the weight gradient; the kernel in Pallas interpret mode here) has the value
  and both gradients of jax.lax.ragged_dot, with an empty group and rows past the groups."""
  from k3_jax.ops.moe import ragged_dot_gmm, ragged_dot_tpu_gmm
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(k1, (256, 128)).astype(dtype)
  rhs = jax.random.normal(k2, (4, 128, 256)).astype(dtype)
  ct = jax.random.normal(k3, (256, 256))
  sizes = jnp.array([70, 0, 130, 40], jnp.int32)             # 240 of 256 rows grouped

  def loss(gmm):
    return lambda a, b: (gmm(a, b, sizes) * ct).sum()
  want_v, want_g = jax.value_and_grad(loss(ragged_dot_gmm), argnums=(0, 1))(lhs, rhs)
  got_v, got_g = jax.value_and_grad(
      loss(lambda a, b, s: ragged_dot_tpu_gmm(a, b, s, interpret=True)), argnums=(0, 1))(
          lhs, rhs)
  tol = dict(rtol=1e-5, atol=1e-4) if dtype == jnp.float32 else dict(rtol=2e-2, atol=0.5)
  np.testing.assert_allclose(got_v, want_v, rtol=1e-6)
  for g, w in zip(got_g, want_g):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)
