"""Expert load balancing for the sigmoid router: Quantile Balancing and the sign update.

Shapes: N tokens, E experts, k experts per token, L layers, B histogram bins.

Quantile Balancing (QB, spec section 5). From one batch of unbiased router
scores s [N, E] and the current bias b [E]:
    1. route with top-(k+1) on s + b; the (k+1)-th biased score of token i is its
       cutoff a_i (the best expert it did NOT take);
    2. margins m_ij = s_ij - a_i; with target load q = floor(N k / E),
       b^_j = -(the (q+1)-th largest of m_1j .. m_Nj);
    3. b <- b^ - mean(b^).
Why: s_ij + b^_j > a_i  <=>  m_ij > m_(q+1),j, which holds for exactly q tokens
(ties aside: every token whose cutoff expert is j itself has m_ij = -b_j exactly, so
when the quantile lands on that value fewer than q tokens are strictly above it). So with bias b^ expert j would beat the old cutoff of exactly q
tokens of this batch: the bias that would have given expert j its target load
if the other experts' routing stayed as it was. The cutoff uses the OLD bias
(this is the spec); the update is a fixed-point iteration that applies from the
next step. Centring leaves every top-k choice unchanged (a shift common to all
experts) and keeps the bias bounded.

Rounding: q = floor(N k / E) (integer division). Since k < E (top-(k+1) must
exist), q <= N - 1 always, so the (q+1)-th largest margin exists; q is clamped
to N - 1 anyway. With N k < E, q = 0 and b^_j = -max_i m_ij.

`quantile_balancing_histogram` is the scalable estimator: per-expert counts of
the margins in B bins over a fixed range, pooled over data/expert shards with
one psum, the quantile read off the pooled counts (see its docstring).

`sign_balancing` is DeepSeek-V3's auxiliary-loss-free update with a fixed step:
    b_j <- b_j + rate * sign(mean(load) - load_j).

None of these are differentiated: every output is under stop_gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _margins(scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
  """m_ij = s_ij - a_i, a_i = (k+1)-th largest of s_i + b. scores [N, E], bias [E] -> [N, E] f32."""
  n, e = scores.shape
  if not 1 <= top_k < e:
    raise ValueError(f"top_k={top_k} must be in [1, num_experts - 1 = {e - 1}] "
                     "(quantile balancing needs a (k+1)-th expert as the cutoff)")
  scores = jax.lax.stop_gradient(scores.astype(jnp.float32))            # [N, E]
  bias = jax.lax.stop_gradient(bias.astype(jnp.float32))                # [E]
  top_vals, _ = jax.lax.top_k(scores + bias[None, :], top_k + 1)       # [N, k+1]
  cutoff = top_vals[:, top_k]                                            # [N]
  return scores - cutoff[:, None]                                        # [N, E]


def _target_load(n_tokens, top_k: int, num_experts: int):
  """q = floor(N k / E), clamped to N - 1. Works for a Python int or a traced int32 N."""
  q = (n_tokens * top_k) // num_experts
  if isinstance(q, int):
    return min(q, n_tokens - 1)
  return jnp.minimum(q, n_tokens - 1)


def _centre(b_hat: jax.Array) -> jax.Array:
  """b <- b^ - mean(b^). [E] -> [E]."""
  return b_hat - jnp.mean(b_hat)


def quantile_balancing(scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
  """Exact Quantile Balancing update from one batch.

  scores [N, E] unbiased sigmoid router scores (cast to f32), bias [E] current bias.
  Returns the new bias [E] f32 (applies from the next step):
      a_i  = (k+1)-th largest of s_i + b            [N]
      m_ij = s_ij - a_i                             [N, E]
      q    = floor(N k / E)
      b^_j = -(q+1)-th largest of m_:j              [E]
      b'   = b^ - mean(b^)
  Requires 1 <= top_k < E. Under stop_gradient (no gradient reaches scores or bias).
  """
  n, e = scores.shape
  margins = _margins(scores, bias, top_k)                                # [N, E]
  q = _target_load(n, top_k, e)
  ascending = jnp.sort(margins, axis=0)                                  # [N, E]
  b_hat = -ascending[n - 1 - q]                                          # [E] (q+1)-th largest
  return jax.lax.stop_gradient(_centre(b_hat))


def quantile_balancing_histogram(scores: jax.Array, bias: jax.Array, top_k: int,
                                 num_bins: int = 1000, axis_name=None,
                                 margin_range: tuple[float, float] = (-2.0, 2.0)) -> jax.Array:
  """Quantile Balancing with the quantile read from pooled per-expert histograms.

  scores [N_local, E], bias [E] (replicated). Margins m_ij (as in
  `quantile_balancing`) are counted in `num_bins` equal bins of width
  w = (hi - lo) / B over margin_range = (lo, hi); values outside are clamped into the
  edge bins, so the range (a static argument) is the SAME on every shard and the
  counts add. counts [E, B] int32 are summed with one `jax.lax.psum` over
  `axis_name` (a name or tuple of names of a shard_map/pmap mesh axis; None: no
  reduction), which pools the global batch across data/expert shards. The global token
  count is read off the pooled counts (every token adds one margin per expert, so each
  row sums to N), so no second reduction is needed; q = floor(N k / E).

  The (q+1)-th largest margin of expert j lies in bin t_j = the highest bin whose
  count-from-the-top C_t = sum_{t' >= t} counts[j, t'] is >= q + 1. We return the
  CENTRE of that bin, lo + (t_j + 0.5) w: within w/2 of the exact quantile when it lies
  in range (tests allow one bin width), so b^ is within w/2 of the exact b^ and the
  centred bias within w. A quantile beyond the range reads as the edge bin's centre,
  which bounds |b^| by max(|lo|, |hi|).

  Range: s in (0, 1) and a_i = s_il + b_l, so m_ij lies in (-1 - max b, 1 - min b).
  Biases are centred and their spread stays within the score range (an expert whose
  bias exceeds another's by more than 1 always wins), so |b| < 1 and the default
  (-2, 2) holds every margin; with B = 1000 the bin width is 0.004.

  Returns the new bias [E] f32, identical on every shard, under stop_gradient.
  """
  lo, hi = float(margin_range[0]), float(margin_range[1])
  if not hi > lo:
    raise ValueError(f"margin_range={margin_range} must have hi > lo")
  if num_bins < 1:
    raise ValueError(f"num_bins={num_bins} must be >= 1")
  _, e = scores.shape
  width = (hi - lo) / num_bins
  margins = _margins(scores, bias, top_k)                                # [N, E]
  bins = jnp.floor((margins - lo) / width).astype(jnp.int32)
  bins = jnp.clip(bins, 0, num_bins - 1)                                 # [N, E]
  expert = jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32)[None, :], bins.shape)
  counts = jnp.zeros((e, num_bins), jnp.int32).at[expert, bins].add(1)   # [E, B]
  if axis_name is not None:
    counts = jax.lax.psum(counts, axis_name)                             # [E, B] global batch
  n_global = jnp.sum(counts[0])                                          # scalar int32
  q = _target_load(n_global, top_k, e)
  from_top = jnp.cumsum(counts[:, ::-1], axis=1)[:, ::-1]                # [E, B] C_t
  # highest bin t with C_t >= q + 1: C_t is non-increasing in t, so count those bins.
  t = jnp.sum(from_top >= q + 1, axis=1) - 1                             # [E]
  quantile = lo + (t.astype(jnp.float32) + 0.5) * width                  # [E] bin centre
  return jax.lax.stop_gradient(_centre(-quantile))


def sign_balancing(bias: jax.Array, expert_load: jax.Array, rate: float = 1e-3) -> jax.Array:
  """DeepSeek-V3's fixed-step update. bias [E], expert_load [E] (tokens routed to each
  expert this step) -> bias [E] f32:
      b_j <- b_j + rate * sign(mean(load) - load_j)
  Overloaded experts move down, underloaded up, balanced ones stay.
  """
  load = jax.lax.stop_gradient(expert_load.astype(jnp.float32))         # [E]
  bias = jax.lax.stop_gradient(bias.astype(jnp.float32))                # [E]
  return bias + rate * jnp.sign(jnp.mean(load) - load)


def load_stats(expert_load: jax.Array) -> dict[str, jax.Array]:
  """Load-balance metrics for expert_load [E] or [L, E] (tokens per expert).

  Returns (scalars for [E], [L] arrays for [L, E], reducing over the expert axis):
    "max_over_mean": max_j load_j / mean_j load_j (1 = perfect; 0 if nothing routed),
    "min_over_mean": min_j load_j / mean_j load_j,
    "num_zero": number of experts with zero load (int32).
  """
  load = jnp.asarray(expert_load).astype(jnp.float32)                   # [..., E]
  mean = jnp.mean(load, axis=-1)                                         # [...]
  safe = jnp.where(mean > 0, mean, 1.0)
  return {
      "max_over_mean": jnp.where(mean > 0, jnp.max(load, axis=-1) / safe, 0.0),
      "min_over_mean": jnp.where(mean > 0, jnp.min(load, axis=-1) / safe, 0.0),
      "num_zero": jnp.sum(load == 0, axis=-1).astype(jnp.int32),
  }
