"""The analytic costs our Pallas kernels attach to their pallas_calls (pl.CostEstimate),
which the roofline of a compiled TPU step adds for the custom calls XLA cannot see into
(pod/roofline.py). Checked against the kernels themselves: the FLOPs are the
matmuls of the traced kernel body (jaxpr, no compile) times the grid steps, exactly."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.ops import mx
from pallas_kernels import kda as pk
from pallas_kernels.kda_decode import kda_decode_step
from pallas_kernels.mxfp4_gmm import mxfp4_gmm


def _subjaxprs(eqn):
  for p in eqn.params.values():
    for sub in (p if isinstance(p, (tuple, list)) else [p]):
      j = getattr(sub, "jaxpr", sub)
      if hasattr(j, "eqns"):
        yield j


def _dot_flops(jaxpr) -> int:
  """2 x output size x contraction size of every dot_general, through nested jaxprs."""
  total = 0
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      (lc, _), _ = e.params["dimension_numbers"]
      lhs = e.invars[0].aval.shape
      total += 2 * math.prod(e.outvars[0].aval.shape) * math.prod(lhs[i] for i in lc)
    total += sum(_dot_flops(j) for j in _subjaxprs(e))
  return total


def _pallas_calls(jaxpr, out=None):
  out = [] if out is None else out
  for e in jaxpr.eqns:
    if e.primitive.name == "pallas_call":
      out.append(e)
    else:
      for j in _subjaxprs(e):
        _pallas_calls(j, out)
  return out


def _calls(fn, *args):
  return _pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)


def test_kda_chunk_kernels_count_their_matmuls():
  """Forward (with o), the backward's state-only forward (o unused), and the backward: the
  estimate is chunk_matmul_flops x grid, and that is the kernel body's dots x grid."""
  b, t, h, k, v, c = 1, 128, 2, 128, 64, 64
  q = jnp.full((b, t, h, k), 0.1)
  vv = jnp.full((b, t, h, v), 0.2)
  g, beta = -jnp.ones((b, t, h, k)), jnp.full((b, t, h), 0.5)
  loss = lambda *a: jnp.sum(pk.chunk_kda(*a, chunk_size=c, interpret=True)[0])
  calls = _calls(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), q, q, vv, g, beta)
  seen = []
  for e in calls:
    steps = math.prod(e.params["grid_mapping"].grid)
    assert steps == b * h * (t // c)
    body = _dot_flops(e.params["jaxpr"])
    assert e.params["cost_estimate"].flops == body * steps
    nbytes = sum(math.prod(a.aval.shape) * a.aval.dtype.itemsize for a in e.invars)
    nbytes += sum(math.prod(a.shape) * a.dtype.itemsize for a in e.params["out_avals"])
    assert e.params["cost_estimate"].bytes_accessed == nbytes     # each operand and output once
    seen.append((e.params["name"], body))
  assert seen == [("kda_chunk_fwd", pk.chunk_matmul_flops(c, k, v)),
                  ("kda_chunk_fwd", pk.chunk_matmul_flops(c, k, v, emit_out=False)),
                  ("kda_chunk_bwd", pk.chunk_matmul_flops(c, k, v, backward=True))]


def test_kda_decode_and_mxfp4_gmm_estimates():
  b, h, k, v = 2, 4, 128, 128
  q = jnp.full((b, h, k), 0.1, jnp.bfloat16)
  state = jnp.zeros((b, h, k, v), jnp.float32)
  (e,) = _calls(lambda *a: kda_decode_step(*a, interpret=True), q, q,
                jnp.zeros((b, h, v), jnp.bfloat16), q, jnp.full((b, h), 0.5, jnp.bfloat16), state)
  est = e.params["cost_estimate"]
  assert est.flops == b * h * (7 * k * v + 6 * k * k)               # vector work, no matmul
  assert _dot_flops(e.params["jaxpr"]) == 0
  assert est.bytes_accessed == 2 * state.size * 4 + 2 * (3 * b * h * k + 2 * b * h * v + b * h)

  m, l, f, n_exp = 40, 256, 256, 4
  w = mx.quantize(jnp.ones((n_exp, l, f), jnp.float32), "mxfp4", axis=1)
  x = jnp.ones((m, l), jnp.bfloat16)
  (e,) = _calls(lambda x, s: mxfp4_gmm(x, w, s, interpret=True), x,
                jnp.asarray([10, 0, 30, 0], jnp.int32))
  tm, tn = 48, 256                                     # default tiling: rows to 16s, tn 256
  m_pad = -(-m // tm) * tm
  # Every computing visit multiplies one [tm, L] x [L, tn] tile: the estimate counts each
  # row tile once per F tile (a tile straddling two groups computes twice; not counted).
  assert e.params["cost_estimate"].flops == 2 * m_pad * l * f
  assert _dot_flops(e.params["jaxpr"]) * (m_pad // tm) * (f // tn) == 2 * m_pad * l * f
  weights = n_exp * (l // 2 + l // 32) * f
  assert e.params["cost_estimate"].bytes_accessed == (f // tn) * m_pad * l * 2 + weights + \
      m_pad * f * 2
