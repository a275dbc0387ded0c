"""Quantile Balancing (exact and histogram), sign balancing and load stats tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from k3_jax.ops.balance import (load_stats, quantile_balancing, quantile_balancing_histogram,
                                sign_balancing)
from k3_jax.ops.moe import expert_load, select_experts

# jit once per shape: far fewer compiles than op-by-op eager execution.
_qb = jax.jit(quantile_balancing, static_argnums=2)
_qb_hist = jax.jit(quantile_balancing_histogram,
                   static_argnames=("top_k", "num_bins", "axis_name", "margin_range"))


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _random_scores(seed, n, e):
  rng = np.random.default_rng(seed)
  return _np_sigmoid(rng.normal(size=(n, e)) * 2.0).astype(np.float32)


def _brute_force_qb(scores, bias, k, centre=True):
  """Per-token and per-expert Python loops with sorting; float64 except the f32 biased sum."""
  n, e = scores.shape
  biased = scores.astype(np.float32) + bias.astype(np.float32)[None, :]
  cutoff = np.empty(n)
  for i in range(n):
    cutoff[i] = sorted(biased[i].tolist(), reverse=True)[k]      # (k+1)-th largest
  q = min(n * k // e, n - 1)
  b_hat = np.empty(e)
  for j in range(e):
    margins = sorted((scores[i, j] - np.float32(cutoff[i]) for i in range(n)), reverse=True)
    b_hat[j] = -margins[q]                                       # (q+1)-th largest
  return b_hat - b_hat.mean() if centre else b_hat


# --------------------------------------------------------------------------
# Exact update


@pytest.mark.parametrize("n,e,k,bias_scale", [(64, 8, 2, 0.0), (100, 16, 3, 0.3),
                                              (37, 6, 5, 0.5), (5, 16, 1, 0.2)])
def test_exact_matches_brute_force(n, e, k, bias_scale):
  scores = _random_scores(n * e + k, n, e)
  bias = (np.random.default_rng(1).normal(size=e) * bias_scale).astype(np.float32)
  got = _qb(jnp.asarray(scores), jnp.asarray(bias), k)
  assert got.shape == (e,) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), _brute_force_qb(scores, bias, k), atol=1e-6)
  assert abs(float(jnp.mean(got))) < 1e-6                        # centred


def test_exact_gives_target_load_on_same_batch():
  """With b^ (before centring), expert j beats the OLD cutoff of exactly q tokens, ties
  aside: the tokens whose cutoff expert is j itself all have margin exactly -b_j, so we
  check #(m_ij > -b^_j) <= q < #(m_ij >= -b^_j)."""
  n, e, k = 200, 10, 3
  scores = _random_scores(7, n, e)
  bias = np.random.default_rng(2).normal(size=e).astype(np.float32) * 0.2
  b_hat = _brute_force_qb(scores, bias, k, centre=False).astype(np.float32)
  new = np.asarray(_qb(jnp.asarray(scores), jnp.asarray(bias), k))
  np.testing.assert_allclose(new, b_hat - b_hat.mean(), atol=1e-6)
  cutoff = -np.sort(-(scores + bias[None, :]), axis=1)[:, k]    # [N] old-bias cutoff
  margins = scores - cutoff[:, None]                             # [N, E]
  q = n * k // e
  assert np.all((margins > -b_hat).sum(axis=0) <= q)
  assert np.all((margins >= -b_hat).sum(axis=0) >= q + 1)
  assert np.sum((margins > -b_hat).sum(axis=0) == q) >= e // 2  # ties are the exception


def test_exact_rejects_top_k_equal_experts():
  with pytest.raises(ValueError):
    quantile_balancing(jnp.zeros((4, 4)), jnp.zeros(4), 4)


# --------------------------------------------------------------------------
# Balancing a skewed synthetic router


def _skewed_router(e, d):
  rng = np.random.default_rng(0)
  w = rng.normal(size=(d, e)) / np.sqrt(d)
  offsets = np.linspace(-3.0, 3.0, e)                            # strong per-expert preference

  def batch(seed, n=4096):
    x = np.random.default_rng(seed).normal(size=(n, d))
    return jnp.asarray(_np_sigmoid(x @ w + offsets), jnp.float32)
  return batch


@pytest.mark.parametrize("update", ["exact", "histogram"])
def test_qb_balances_skewed_router(update):
  e, k, d = 16, 2, 32
  batch = _skewed_router(e, d)
  fn = _qb if update == "exact" else _qb_hist

  def stats(scores, bias):
    _, ids = select_experts(scores, bias, k)
    st = load_stats(expert_load(ids, e))
    return float(st["max_over_mean"]), int(st["num_zero"])

  bias = jnp.zeros(e, jnp.float32)
  ratio0, _ = stats(batch(1000), bias)
  assert ratio0 > 3.0                                            # no balancing: skewed
  for step in range(5):                                          # fresh batch every step
    bias = fn(batch(step), bias, top_k=k)
  ratio, zeros = stats(batch(1001), bias)                        # held-out batch
  assert ratio < 1.35 and zeros == 0, (ratio, zeros)


# --------------------------------------------------------------------------
# Histogram estimator


@pytest.mark.parametrize("n,e,k,num_bins", [(512, 16, 2, 1000), (300, 8, 3, 200),
                                            (1000, 32, 4, 50)])
def test_histogram_within_one_bin_of_exact(n, e, k, num_bins):
  """Compared AFTER centring. The histogram returns the centre of the bin holding the
  exact quantile, so each b^_j is off by at most w/2, and centring (subtracting the mean
  of these errors) at most doubles that: |centred difference| <= w."""
  scores = jnp.asarray(_random_scores(n + e, n, e))
  bias = jnp.asarray(np.random.default_rng(3).normal(size=e) * 0.3, jnp.float32)
  exact = _qb(scores, bias, k)
  hist = _qb_hist(scores, bias, top_k=k, num_bins=num_bins)
  width = 4.0 / num_bins
  assert float(jnp.max(jnp.abs(hist - exact))) <= width + 1e-6
  assert abs(float(jnp.mean(hist))) < 1e-6


def test_histogram_clamps_to_range():
  """A quantile beyond margin_range reads as the edge bin's centre (bounded update)."""
  scores = jnp.asarray(_random_scores(5, 64, 8))
  bias = jnp.zeros(8).at[0].set(5.0)                             # expert 0 margins << -1
  hist = _qb_hist(scores, bias, top_k=2, num_bins=10, margin_range=(-1.0, 1.0))
  assert bool(jnp.all(jnp.isfinite(hist)))
  # Before centring every b^_j is minus a bin centre, so within (-1, 1).
  assert float(jnp.max(hist) - jnp.min(hist)) < 2.0


def test_histogram_shard_map_equals_unsharded():
  devices = jax.devices()
  assert len(devices) == 8
  mesh = Mesh(np.array(devices), ("data",))
  n, e, k = 8 * 96, 16, 3
  scores = jnp.asarray(_random_scores(11, n, e))
  bias = jnp.asarray(np.random.default_rng(4).normal(size=e) * 0.2, jnp.float32)

  sharded = jax.jit(jax.shard_map(
      functools.partial(quantile_balancing_histogram, top_k=k, axis_name="data"),
      mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))
  got = sharded(scores, bias)
  want = _qb_hist(scores, bias, top_k=k)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-7, rtol=0)
  # One shard alone sees 96 tokens, not the global batch: the psum matters.
  local = _qb_hist(scores[:n // 8], bias, top_k=k)
  assert not np.allclose(np.asarray(local), np.asarray(want))


# --------------------------------------------------------------------------
# No gradient


@pytest.mark.parametrize("fn", [quantile_balancing, quantile_balancing_histogram])
def test_update_has_no_gradient(fn):
  scores = jnp.asarray(_random_scores(9, 32, 8))
  bias = jnp.asarray(np.linspace(-0.2, 0.2, 8), jnp.float32)
  probe = jnp.arange(8, dtype=jnp.float32)
  loss = jax.jit(lambda s, b: jnp.sum(fn(s, b, 2) * probe))
  g_s, g_b = jax.grad(loss, argnums=(0, 1))(scores, bias)
  assert not np.any(np.asarray(g_s)) and not np.any(np.asarray(g_b))


# --------------------------------------------------------------------------
# Sign update and load stats


def test_sign_balancing_direction():
  bias = jnp.array([0.1, 0.0, -0.1, 0.0], jnp.float32)
  load = jnp.array([10, 2, 4, 4], jnp.int32)                     # mean 5
  new = sign_balancing(bias, load, rate=0.01)
  assert new.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(new), [0.09, 0.01, -0.09, 0.01], atol=1e-7)
  balanced = sign_balancing(bias, jnp.full(4, 3), rate=0.01)
  np.testing.assert_array_equal(np.asarray(balanced), np.asarray(bias))


def test_load_stats_vector_and_layers():
  st = load_stats(jnp.array([4, 0, 2, 2]))
  assert float(st["max_over_mean"]) == 2.0 and int(st["num_zero"]) == 1
  assert float(st["min_over_mean"]) == 0.0
  st = load_stats(jnp.array([[4, 0, 2, 2], [2, 2, 2, 2], [0, 0, 0, 0]]))
  np.testing.assert_allclose(np.asarray(st["max_over_mean"]), [2.0, 1.0, 0.0])
  np.testing.assert_array_equal(np.asarray(st["num_zero"]), [1, 0, 4])
  assert st["max_over_mean"].shape == (3,)
