"""OCP Microscaling (MX v1.0) formats in plain JAX: MXFP4 (E2M1), MXFP8 (E4M3, E5M2).

A tensor is cut into blocks of 32 consecutive elements along one axis (the contraction
axis of the matmul that consumes it). Each block shares one E8M0 scale X = 2^s and each
element is stored in the narrow element format (docs/architecture.md section 7):

    s     = clamp(floor(log2(max_i |v_i|)) - emax, -127, 127)      scale byte = s + 127
    p_i   = saturate(round_to_nearest_even(v_i / 2^s))              element code
    v'_i  = p_i * 2^s                                              dequantized value

emax (the exponent of the element format's largest power of two): E2M1 2, E4M3 8, E5M2 15.
Element maxima: E2M1 6, E4M3 448, E5M2 57344; larger values saturate to them (never Inf/NaN).

Project choices where the OCP text leaves a gap:
- An all-zero block has no max exponent: its scale byte is 0 (s = -127) and its codes 0.
- A block holding a NaN or +-Inf gets scale byte 0xFF (E8M0 NaN); it dequantizes to NaN.
- Negative zero keeps its sign (code 0x8 in E2M1, 0x80 in E4M3/E5M2), as IEEE rounding does.
- Inputs are quantized in float32 (bf16 inputs convert exactly). Backends that flush
  float32 subnormals (|v| < 2^-126) treat such inputs as 0; dequantized values that fall
  below 2^-126 (only possible when s <= -124) may flush to 0 the same way.
- Packing: MXFP4 stores two codes per byte along `axis`, the LOW nibble holding the even
  element (index 2j) and the high nibble the odd one (2j + 1). MXFP8 stores one per byte.
- The length along `axis` must be a multiple of 32 (no implicit padding): a ValueError.

`MXArray` keeps codes and scales in the input's layout with `axis` replaced by its packed
length (codes: n / 2 for MXFP4, n for MXFP8; scales: n / 32). `axis` is stored negative, so
slicing or scanning over leading axes (stacked layers) keeps an MXArray valid.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32


class ElementFormat(NamedTuple):
  ebits: int        # exponent bits
  mbits: int        # mantissa bits
  emax: int         # exponent of the largest normal power of two
  max: float        # largest finite magnitude (saturation value)
  bits: int         # storage bits per element (4 or 8)


FORMATS: dict[str, ElementFormat] = {
    "mxfp4": ElementFormat(2, 1, 2, 6.0, 4),
    "mxfp8_e4m3": ElementFormat(4, 3, 8, 448.0, 8),
    "mxfp8_e5m2": ElementFormat(5, 2, 15, 57344.0, 8),
}


def element_format(fmt: str) -> ElementFormat:
  if fmt not in FORMATS:
    raise ValueError(f"unknown MX format {fmt!r}; supported formats: {', '.join(FORMATS)}")
  return FORMATS[fmt]


@dataclasses.dataclass(frozen=True)
class MXArray:
  """A block-scaled tensor. codes uint8 (MXFP4: two per byte along `axis`), scales uint8
  (E8M0, one per 32 elements along `axis`); fmt and axis (negative) are static."""
  codes: jax.Array
  scales: jax.Array
  fmt: str = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical (unpacked) shape."""
    s = list(self.codes.shape)
    s[self.axis] = self.scales.shape[self.axis] * BLOCK
    return tuple(s)

  @property
  def ndim(self) -> int:
    return self.codes.ndim

  @property
  def nbytes(self) -> int:
    """Bytes held in memory: codes plus scales (MXFP4: 4.25 bits per element)."""
    return int(np.prod(self.codes.shape)) + int(np.prod(self.scales.shape))


jax.tree_util.register_dataclass(MXArray)


def _floor_log2(a: jax.Array) -> jax.Array:
  """floor(log2(a)) for finite a > 0 in float32, exact (frexp: a = m 2^e, m in [0.5, 1))."""
  _, e = jnp.frexp(a)
  return e.astype(jnp.int32) - 1


def _pow2(e: jax.Array) -> jax.Array:
  """2^e as float32 for integer e in [-126, 127], built from the exponent bits (exact)."""
  return jax.lax.bitcast_convert_type(((e + 127).astype(jnp.int32) << 23), jnp.float32)


def _decode_table(f: ElementFormat) -> np.ndarray:
  """float32 value of every code of the element format (NaN/Inf where the format has them)."""
  bias = 2 ** (f.ebits - 1) - 1
  n = 1 << f.bits
  out = np.zeros(n, np.float32)
  for c in range(n):
    sign = -1.0 if c >> (f.bits - 1) else 1.0
    ef = (c >> f.mbits) & ((1 << f.ebits) - 1)
    mant = c & ((1 << f.mbits) - 1)
    if ef == 0:
      v = mant * 2.0 ** (1 - bias - f.mbits)
    else:
      v = (2 ** f.mbits + mant) * 2.0 ** (ef - bias - f.mbits)
    if f.ebits == 4 and f.mbits == 3 and (c & 0x7F) == 0x7F:     # E4M3 (fn): S.1111.111 NaN
      v = np.nan
    elif f.ebits == 5 and ef == 31:                               # E5M2: IEEE Inf / NaN
      v = np.inf if mant == 0 else np.nan
    out[c] = sign * v
  return out


def _encode(v: jax.Array, f: ElementFormat) -> jax.Array:
  """Rounds v (float32, already divided by the block scale) to the element format with
  round-to-nearest-even and saturation, returning uint8 codes."""
  bias = 2 ** (f.ebits - 1) - 1
  a = jnp.abs(v)
  emin = 1 - bias                                          # exponent of the smallest normal
  e = jnp.maximum(_floor_log2(jnp.where(a > 0, a, 1.0)), emin)
  quantum = _pow2(e - f.mbits)                             # spacing of representable values
  r = jnp.round(a / quantum) * quantum                     # jnp.round: ties to even
  r = jnp.minimum(r, f.max)                                # saturate
  # Bit fields of the rounded magnitude (exact small integers in float32).
  er = _floor_log2(jnp.where(r > 0, r, 1.0))
  normal = r >= 2.0 ** emin
  exp_field = jnp.where(normal, er + bias, 0)
  mant = jnp.where(normal, r / _pow2(er - f.mbits) - 2 ** f.mbits,
                   r / 2.0 ** (emin - f.mbits))
  code = (exp_field << f.mbits) + mant.astype(jnp.int32)
  code = code | (jnp.signbit(v).astype(jnp.int32) << (f.bits - 1))
  return code.astype(jnp.uint8)


def quantize(x: jax.Array, fmt: str, axis: int = -1) -> MXArray:
  """x [..., n, ...] -> MXArray with blocks of 32 along `axis` (n must be a multiple of 32)."""
  element_format(fmt)
  return _quantize_jit(jnp.asarray(x), fmt, axis)


@jax.jit(static_argnames=("fmt", "axis"))
def _quantize_jit(x: jax.Array, fmt: str, axis: int) -> MXArray:
  f = FORMATS[fmt]
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantize expects a floating-point array, got dtype {x.dtype}")
  if x.ndim == 0:
    raise ValueError("quantize needs at least one axis to block along")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis={axis} out of range for an array of shape {x.shape}")
  axis = axis - x.ndim if axis >= 0 else axis
  n = x.shape[axis]
  if n % BLOCK:
    raise ValueError(f"MX quantization needs the length along axis {axis} to be a multiple of "
                     f"{BLOCK}; got shape {x.shape} (pad the array or choose another axis)")
  xm = jnp.moveaxis(x.astype(jnp.float32), axis, -1)                # [..., n]
  lead = xm.shape[:-1]
  blocks = xm.reshape(*lead, n // BLOCK, BLOCK)                      # [..., nb, 32]
  amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)            # [..., nb, 1]
  finite = jnp.isfinite(amax)
  safe = jnp.where(finite & (amax > 0), amax, 1.0)
  s = jnp.clip(_floor_log2(safe) - f.emax, -127, 127)
  s = jnp.where(amax > 0, s, -127)                                   # all-zero block
  # 2^-s with s in [-127, 125] (floor(log2) of a float32 is <= 127 and emax >= 2): normal.
  v = blocks * _pow2(-s)
  codes = _encode(jnp.where(finite, v, 0.0), f)                      # [..., nb, 32]
  scales = jnp.where(finite, s + 127, 255)[..., 0].astype(jnp.uint8)  # [..., nb]
  codes = codes.reshape(*lead, n)
  if f.bits == 4:
    pairs = codes.reshape(*lead, n // 2, 2)
    codes = pairs[..., 0] | (pairs[..., 1] << 4)                     # low nibble: even element
  return MXArray(jnp.moveaxis(codes, -1, axis), jnp.moveaxis(scales, -1, axis), fmt, axis)


def unpack_codes(mx: MXArray) -> jax.Array:
  """One uint8 code per element, in the logical shape (MXFP4 nibbles split)."""
  if FORMATS[mx.fmt].bits == 8:
    return mx.codes
  c = jnp.moveaxis(mx.codes, mx.axis, -1)
  both = jnp.stack([c & 0xF, c >> 4], axis=-1)                       # [..., n/2, 2]
  return jnp.moveaxis(both.reshape(*c.shape[:-1], c.shape[-1] * 2), -1, mx.axis)


def dequantize(mx: MXArray, dtype=jnp.float32) -> jax.Array:
  """MXArray -> values codes * 2^(scale - 127) in `dtype` (scale byte 0xFF -> NaN)."""
  element_format(mx.fmt)
  return _dequantize_jit(mx, jnp.dtype(dtype))


@jax.jit(static_argnames=("dtype",))
def _dequantize_jit(mx: MXArray, dtype) -> jax.Array:
  f = FORMATS[mx.fmt]
  table = jnp.asarray(_decode_table(f))
  vals = table[unpack_codes(mx).astype(jnp.int32)]                   # logical shape, f32
  vm = jnp.moveaxis(vals, mx.axis, -1)
  blocks = vm.reshape(*vm.shape[:-1], -1, BLOCK)                     # [..., nb, 32]
  sb = jnp.moveaxis(mx.scales, mx.axis, -1).astype(jnp.int32)[..., None]
  # 2^(b - 127) as two normal factors, so byte 0 (2^-127) needs no subnormal constant.
  h = (sb - 127) // 2
  out = blocks * _pow2(h) * _pow2(sb - 127 - h)
  out = jnp.where(sb == 255, jnp.nan, out)
  return jnp.moveaxis(out.reshape(vm.shape), -1, mx.axis).astype(dtype)


def fake_quantize(x: jax.Array, fmt: str, axis: int = -1) -> jax.Array:
  """dequantize(quantize(x)) in x.dtype; its gradient is the straight-through identity."""
  element_format(fmt)
  return _ste(fmt, axis, x)


def _ste_impl(fmt, axis, x):
  return dequantize(quantize(x, fmt, axis), x.dtype)


_ste = jax.custom_vjp(_ste_impl, nondiff_argnums=(0, 1))
_ste.defvjp(lambda fmt, axis, x: (_ste_impl(fmt, axis, x), None),
            lambda fmt, axis, _, g: (g,))


__all__ = ["BLOCK", "FORMATS", "ElementFormat", "MXArray", "element_format", "quantize",
           "dequantize", "fake_quantize", "unpack_codes"]
