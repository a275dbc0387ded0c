"""The one-CPU-device KDA decode step (ops/kda/decode_cpu.py) against the reference step.

Tolerance: the fused step computes k^T(e S) as (k e)^T S and the output from the old state
plus the rank-one term, so products associate differently: f32 rounding, ~1e-7 of the
values here; asserted at 1e-5 of the largest entry. Idle rows keep their state exactly
(selected, as the reference does) and a row's results do not depend on the other rows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.ops import kda
from k3_jax.ops.kda.decode_cpu import decode_step_cpu

B, H, K, V = 3, 2, 16, 16
# numerics, not speed: a low backend optimisation level compiles faster (as tests/ops/test_kda)
OPTS = {"xla_backend_optimization_level": 0}


def _inputs(seed):
  """Host arrays (no eager JAX ops: each would compile): unit-norm q, k; decays in (0, 1)."""
  r = np.random.default_rng(seed)
  unit = lambda a: (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)
  f32 = lambda a: np.asarray(a, np.float32)
  q, k = unit(r.standard_normal((B, H, K))), unit(r.standard_normal((B, H, K)))
  v = f32(r.standard_normal((B, H, V)))
  g = f32(-np.log1p(np.exp(r.standard_normal((B, H, K)))))
  beta = f32(1 / (1 + np.exp(-r.standard_normal((B, H)))))
  state = f32(r.standard_normal((2, B, H, K, V)))          # two stacked units
  return q, k, v, g, beta, state


@functools.partial(jax.jit, compiler_options=OPTS)
def _reference(q, k, v, g, beta, state, active):
  o, new = kda.kda_decode_step(q, k, v, g, beta, state)
  return o, jnp.where(active[:, None, None, None], new, state)


def test_fused_step_matches_the_reference_and_keeps_idle_rows():
  q, k, v, g, beta, state = _inputs(0)
  active = np.array([True, False, True])
  ref_o, ref_s = _reference(q, k, v, g, beta, state[1], active)
  step = jax.jit(decode_step_cpu, static_argnames=("layer",), compiler_options=OPTS)
  o, s = step(q, k, v, g, beta, state, active=active, layer=1)
  scale = float(np.max(np.abs(ref_s)))
  np.testing.assert_allclose(s[1], ref_s, atol=1e-5 * scale, rtol=0)
  np.testing.assert_array_equal(s[0], state[0])              # the other unit untouched
  np.testing.assert_array_equal(s[1, 1], state[1, 1])        # the idle row: its own state
  act = np.asarray(active)
  np.testing.assert_allclose(np.asarray(o)[act], np.asarray(ref_o)[act],
                             atol=1e-5 * float(np.max(np.abs(ref_o))), rtol=0)
  # unstacked, no active mask; and row 0 alone gives row 0's bits
  o2, s2 = step(q, k, v, g, beta, state[1])
  np.testing.assert_array_equal(s2[0], s[1, 0])
  o1, s1 = step(q[:1], k[:1], v[:1], g[:1], beta[:1], state[1, :1])
  np.testing.assert_array_equal(s1[0], s2[0])
  np.testing.assert_array_equal(o1[0], o2[0])
  # decode_step takes this path on one CPU device (par SINGLE)
  o3, s3 = jax.jit(kda.decode_step, compiler_options=OPTS)(q, k, v, g, beta, state, active=active, layer=1)
  np.testing.assert_array_equal(s3, s)
