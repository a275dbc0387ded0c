"""Where initial parameter values come from.

Every value is one counter-based draw: element (r, c) of a parameter (its shape flattened
to rows x last dimension) is threefry2x32(key, (r, c)), turned into a float by the same
elementwise formula everywhere (`_values`). The parameter's key is fold_in(seed key, n) for
the n-th parameter drawn; the rows of stacked layers fold in their row index as well
(`children`). So a seed gives the same bits however the draw runs. `Init` has three modes:
  host      drawn eagerly on the host's CPU, in fixed-size blocks of counters through one
            jitted kernel per distribution (compiled once per process, whatever the shapes)
  jax       drawn in the traced program (the sharded initialisation of k3_jax/train.py:
            jit with out_shardings, each device computing its own shard from the counters
            of its elements): bit-identical to host on CPU devices, however many (on
            other platforms the float steps of `_values` may round differently)
  abstract  zeros, used under jax.eval_shape: shapes and dtypes only, nothing allocated
All modes give the same shapes and dtypes, so graph definitions are interchangeable.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

MODES = ("host", "jax", "abstract")
_BLOCK = 1 << 16                    # counters per call of the host kernel
_SQRT2 = np.float32(math.sqrt(2.0))
# truncated normal on [-2, 2]: u uniform on [erf(-2/sqrt2), erf(2/sqrt2)), sqrt2 * erfinv(u)
_ERF_LO, _ERF_HI = np.float32(math.erf(-math.sqrt(2.0))), np.float32(math.erf(math.sqrt(2.0)))
_CLIP_LO = np.nextafter(np.float32(-2.0), np.float32(0.0))
_CLIP_HI = np.nextafter(np.float32(2.0), np.float32(0.0))
# Standard deviation of a standard normal truncated to [-2, 2].
_TRUNC2_STD = 0.8796256610342398


def _values(k0, k1, rows, cols, scale, shift, *, dist: str, then=None):
  """float32 draws at counters (rows, cols) of key (k0, k1): "normal", a normal truncated
  to [-2, 2] times `scale`; "uniform", uniform on [shift, shift + scale), then (when
  `then` = (fn, static items)) fn(x, **static). Elementwise, so any blocking or sharding of
  the counters gives the same values."""
  bits = threefry2x32_p.bind(k0, k1, rows, cols)[0]
  u = lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000),
                               jnp.float32) - np.float32(1.0)          # [0, 1)
  if dist == "uniform":
    x = u * scale + shift
    return x if then is None else then[0](x, **dict(then[1]))
  v = u * (_ERF_HI - _ERF_LO) + _ERF_LO
  x = jnp.clip(_SQRT2 * lax.erf_inv(v), _CLIP_LO, _CLIP_HI)
  return x * scale


@functools.cache
def _host_jit(fn, static: tuple):
  """fn(*args, **dict(static)) jitted on this host's CPU, compiled as the sharded init is on
  CPUs (XLA's lowest backend optimisation level: LLVM's optimisations, e.g. fused
  multiply-adds, change the last bit of some values, so both paths must compile alike)."""
  jitted = jax.jit(lambda *args: fn(*args, **dict(static)),
                   compiler_options={"xla_backend_optimization_level": 0})
  try:
    cpu = jax.local_devices(backend="cpu")[0]    # this process's (multi-host: not process 0's)
  except RuntimeError:                  # no CPU backend: the default device
    return jitted

  def on_cpu(*args):
    with jax.default_device(cpu):
      return jitted(*(jax.device_put(a, cpu) for a in args))
  return on_cpu


def _traced_counters(shape):
  """(rows, cols) uint32 arrays of `shape`: the flattened leading index and the last one."""
  if not shape:
    z = jnp.zeros((), jnp.uint32)
    return z, z
  cols = lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
  rows, stride = jnp.zeros(shape, jnp.uint32), 1
  for d in range(len(shape) - 2, -1, -1):
    rows = rows + lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(stride)
    stride *= shape[d]
  return rows, cols


class Init:
  def __init__(self, seed: int = 0, mode: str = "host", key: jax.Array | None = None):
    if mode not in MODES:
      raise ValueError(f"Init mode {mode!r}: must be one of {', '.join(MODES)}")
    self.mode = mode
    self._key = None
    if mode != "abstract":
      self._key = key if key is not None else jax.random.key(seed)
    self._count = 0

  def children(self):
    """A function index -> Init with a stream of its own, fold_in(k, index) where k is this
    Init's next key (the rows of stacked layers). In jax mode `index` may be a tracer: under
    jax.vmap over the row indices every leaf is drawn as one [R, ...] array, with the same
    values as R host-mode children."""
    if self.mode == "abstract":
      return lambda index: Init(mode="abstract")
    base = self._next_key()
    return lambda index: Init(mode=self.mode, key=jax.random.fold_in(base, index))

  def _next_key(self) -> jax.Array:
    self._count += 1
    return jax.random.fold_in(self._key, self._count)

  def _draw(self, shape, dist: str, scale: float, shift: float, dtype, then=None) -> jax.Array:
    shape = tuple(int(s) for s in shape)
    if self.mode == "abstract":
      return jnp.zeros(shape, dtype)
    if math.prod(shape[:-1]) >= 2**32 or (shape and shape[-1] >= 2**32):
      raise ValueError(f"shape {shape}: too many rows or columns for 32-bit counters")
    k0, k1 = jax.random.key_data(self._next_key())
    scale, shift = np.float32(scale), np.float32(shift)
    if self.mode == "jax":
      rows, cols = _traced_counters(shape)
      # The barriers make the program see scale and shift, and the caller the draws, as
      # the host kernel does (arguments, results): XLA may otherwise rewrite the arithmetic
      # across them into something that rounds differently.
      scale, shift = lax.optimization_barrier((jnp.float32(scale), jnp.float32(shift)))
      x = lax.optimization_barrier(_values(k0, k1, rows, cols, scale, shift, dist=dist,
                                             then=then))
      return x.astype(dtype)
    n, width = math.prod(shape), (shape[-1] if shape else 1)
    out = np.empty(n, np.float32)
    for start in range(0, n, _BLOCK):
      idx = np.arange(start, start + _BLOCK, dtype=np.uint64)
      rows, cols = (idx // width).astype(np.uint32), (idx % width).astype(np.uint32)
      kernel = _host_jit(_values, (("dist", dist), ("then", then)))
      got = kernel(k0, k1, rows, cols, scale, shift)
      out[start:start + _BLOCK] = np.asarray(got)[:min(_BLOCK, n - start)]
    np_dtype = ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)
    return jnp.asarray(out.reshape(shape).astype(np_dtype))

  def normal(self, shape, std: float, dtype=jnp.float32) -> jax.Array:
    """Normal truncated at 2 standard deviations, rescaled to have standard deviation std."""
    return self._draw(shape, "normal", std / _TRUNC2_STD, 0.0, dtype)

  def uniform(self, shape, low: float, high: float, dtype=jnp.float32, then=None,
              **static) -> jax.Array:
    """Uniform on [low, high); with `then` (a module-level function), then(x, **static) in
    the same kernel as the draw (a value derived from draws, e.g. a log, computed apart
    could round differently on the host and in the traced program)."""
    post = None if then is None else (then, tuple(sorted(static.items())))
    return self._draw(shape, "uniform", np.float32(high) - np.float32(low), low, dtype, post)
