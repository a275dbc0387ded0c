"""Top-p (nucleus) sampling on hand-built logits, against a NumPy nucleus computed here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.serve.sampling import penalize, sample

# Probabilities chosen so no cumulative sum lies near the tested top_p values.
PROBS = np.array([0.05, 0.40, 0.01, 0.15, 0.25, 0.03, 0.10, 0.01])
LOGITS = np.log(PROBS)
N = 4000                              # rows sampled at once (one independent draw per row)


def _nucleus(probs: np.ndarray, top_p: float) -> set[int]:
  """The smallest set of tokens, most probable first, whose mass reaches top_p."""
  order = np.argsort(-probs)
  k = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
  return set(order[:k].tolist())


def _draw(top_p, temperature=1.0, seed=0):
  logits = jnp.tile(jnp.asarray(LOGITS, jnp.float32), (N, 1))          # [N, V]
  return np.asarray(sample(jax.random.key(seed), logits, temperature, top_p))


@pytest.mark.parametrize("top_p,temperature", [(0.7, 1.0), (0.5, 1.0), (0.9, 1.0),
                                               (0.7, 2.0)])
def test_sampled_tokens_stay_inside_the_nucleus(top_p, temperature):
  tempered = PROBS ** (1 / temperature)
  tempered /= tempered.sum()
  nucleus = _nucleus(tempered, top_p)
  ids = _draw(top_p, temperature)
  assert set(ids.tolist()) == nucleus          # never outside; every member is drawn
  # Within the nucleus the draw follows the renormalized probabilities: with N = 4000 the
  # standard error of a frequency is at most 0.008, so 0.04 is a 5-sigma bound.
  members = sorted(nucleus)
  want = tempered[members] / tempered[members].sum()
  got = np.array([(ids == m).mean() for m in members])
  np.testing.assert_allclose(got, want, atol=0.04)


def test_top_p_one_is_plain_sampling_with_the_same_key():
  key = jax.random.key(3)
  logits = jnp.tile(jnp.asarray(LOGITS, jnp.float32), (N, 1))
  for t in (0.5, 1.0):
    want = jax.random.categorical(key, logits / t, axis=-1)
    np.testing.assert_array_equal(np.asarray(sample(key, logits, t, 1.0)), np.asarray(want))


def test_tiny_top_p_and_zero_temperature_are_greedy():
  assert set(_draw(0.01).tolist()) == {1}
  assert set(_draw(0.9, temperature=0.0).tolist()) == {1}


def test_penalties_lower_the_logits_of_generated_tokens():
  logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0]])                       # [B=1, V=4]
  counts = jnp.asarray([[3, 0, 1, 0]])
  out = np.asarray(penalize(logits, counts, frequency_penalty=0.5, presence_penalty=0.25))
  # token 0: 2 - 3 * 0.5 - 0.25; token 2: 0.5 - 0.5 - 0.25; never-generated tokens unchanged
  np.testing.assert_allclose(out, [[0.25, 1.0, -0.25, -1.0]], rtol=0, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(penalize(logits, counts)), np.asarray(logits))
  # A penalty large enough turns a run of one token into another choice under greedy.
  assert int(sample(jax.random.key(0), penalize(logits, counts, 1.0), 0.0)[0]) == 1
