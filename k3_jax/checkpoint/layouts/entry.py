"""One entry of a released layout: which tensor(s) on disk hold which part of which model
variable, and how the values are rearranged between the two.

An Entry ties one slice of a model variable, `path` (a path in the flat nnx state) at the
leading indices `index` (the stacked-layer row of a scanned unit, the expert number of a
routed expert, or both), to one or more tensors on disk. `kind` names the rearrangement:

  "linear"  ours [*in, *out] (n_in input axes)  <->  disk [prod(out), prod(in)]  (PyTorch
            Linear weights are [out, in])
  "reshape" the same elements in the same row-major order, another shape (norms, biases,
            A_log [H] <-> [1, 1, H, 1], dt_bias [H, K] <-> [H*K], the embedding table)
  "conv"    ours [W, H, K]  <->  disk [H*K, 1, W] (torch depthwise Conv1d weight; tap W-1
            multiplies the current token in both)
  "mxfp4"   ours [in, out] (one routed expert's matrix)  <->  two tensors: weight_packed
            uint8 [out, in/2] (E2M1 codes, the LOW nibble holding the even input column) and
            weight_scale uint8 [out, in/32] (E8M0, value 2^(s-127)); blocks of 32 along `in`
            (compressed-tensors "mxfp4-pack-quantized"). Lossy on export (quantization);
            import dequantizes exactly; a canonical block (max code 4 or 6, which every block
            our quantizer writes has) re-exports to the same bytes.
  "named"   a transform given with the entry (`transform`, a k3_jax.vision.names Entry: its
            from_ours / to_ours map our variable to its released tensors and back), as the
            vision tower's names module defines them for `vision_tower.*` / `mm_projector.*`
  "gain"    a disk tensor with no variable of its own that folds into `path` by
            multiplication: the AttnRes norm gain g (K3 release `*_res_norm.weight`), since
            w . (g * RMSNorm(v)) = (w * g) . RMSNorm(v). Exported as ones; on import the
            variable is multiplied by it (exact for the ones we write).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from k3_jax.config import UserError

KINDS = ("linear", "reshape", "conv", "mxfp4", "gain", "named")

# safetensors dtype names <-> numpy dtypes
NP_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
             "F16": np.dtype(np.float16), "U8": np.dtype(np.uint8)}
ST_DTYPES = {v: k for k, v in NP_DTYPES.items()}


class LayoutError(UserError):
  """A checkpoint or model the layout cannot map; the message names the tensor or field."""


@dataclasses.dataclass(frozen=True)
class Tensor:
  name: str
  shape: tuple[int, ...]
  dtype: str                       # safetensors dtype: F32, BF16, U8

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * NP_DTYPES[self.dtype].itemsize


@dataclasses.dataclass(frozen=True)
class Entry:
  path: tuple                      # variable path in the flat model state
  index: tuple[int, ...]           # leading indices into the variable
  kind: str
  tensors: tuple[Tensor, ...]      # one, or (weight_packed, weight_scale) for "mxfp4"
  n_in: int = 1                    # "linear": number of input axes of our slice
  transform: object = None         # "named": the vision names Entry (from_ours / to_ours)

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown entry kind {self.kind!r}")


def np_dtype(name: str) -> np.dtype:
  return NP_DTYPES[name]


def st_dtype(dtype) -> str:
  dt = np.dtype(dtype)
  if dt not in ST_DTYPES:
    raise LayoutError(f"dtype {dt} has no safetensors name here")
  return ST_DTYPES[dt]


# ----- our slice -> disk ---------------------------------------------------------------

def to_disk(e: Entry, ours: np.ndarray) -> list[np.ndarray]:
  """Our slice (the variable at e.index) -> the disk arrays of e.tensors, in their dtypes."""
  t0 = e.tensors[0]
  if e.kind == "gain":
    return [np.ones(t0.shape, NP_DTYPES[t0.dtype])]
  if e.kind == "mxfp4":
    codes, scales = _pack_mxfp4(ours)
    return [codes, scales]
  if e.kind == "named":
    return [_cast(np.ascontiguousarray(a), t.dtype, t.name)
            for a, t in zip(e.transform.from_ours(ours), e.tensors)]
  if e.kind == "linear":
    n_in = math.prod(ours.shape[:e.n_in])
    out = ours.reshape(n_in, -1).T
  elif e.kind == "conv":
    w = ours.shape[0]
    out = ours.reshape(w, -1).T[:, None, :]
  else:
    out = ours
  out = np.ascontiguousarray(out.reshape(t0.shape))
  return [_cast(out, t0.dtype, t0.name)]


def _cast(a: np.ndarray, dtype: str, name: str) -> np.ndarray:
  target = NP_DTYPES[dtype]
  if a.dtype == target:
    return a
  if not np.issubdtype(a.dtype, np.floating) and a.dtype != ml_dtypes.bfloat16:
    raise LayoutError(f"{name}: cannot store dtype {a.dtype} as {dtype}")
  return a.astype(target)


def pack_mxfp4_stacked(w) -> tuple[np.ndarray, np.ndarray]:
  """A whole routed-expert variable [..., in, out] -> (codes [..., in/2, out], scales
  [..., in/32, out]) in one call; entry e's tensors are codes[e.index].T, scales[e.index].T
  (the same bytes `to_disk` gives expert by expert)."""
  from k3_jax.ops.mx_gmm import pack_weight
  mx = pack_weight(np.asarray(w))
  return np.asarray(mx.codes), np.asarray(mx.scales)


def _pack_mxfp4(ours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  from k3_jax.ops.mx_gmm import pack_weight   # MXFP4 along axis -2 (the input axis of [in, out])
  mx = pack_weight(np.asarray(ours))
  return (np.ascontiguousarray(np.asarray(mx.codes).T),        # [out, in/2]
          np.ascontiguousarray(np.asarray(mx.scales).T))       # [out, in/32]


# ----- disk -> our slice ---------------------------------------------------------------

def from_disk(e: Entry, arrays: list[np.ndarray], shape: tuple[int, ...], dtype) -> np.ndarray:
  """The disk arrays of e.tensors -> our slice of `shape` (the variable's trailing axes)."""
  dtype = np.dtype(dtype)
  if e.kind == "mxfp4":
    return _unpack_mxfp4(arrays[0], arrays[1], dtype)
  if e.kind == "named":
    return np.ascontiguousarray(np.asarray(e.transform.to_ours(arrays)).reshape(shape)
                                ).astype(dtype)
  a = arrays[0]
  if e.kind in ("reshape", "gain") and a.size > math.prod(shape) and e.tensors[0].name.endswith(
      "A_log"):
    a = a.ravel()[:math.prod(shape)]   # K3 reports disagree on 96 or 128 entries: the first H
  if e.kind == "linear":
    n_in = math.prod(shape[:e.n_in])
    a = a.reshape(-1, n_in).T
  elif e.kind == "conv":
    a = a.reshape(a.shape[0], a.shape[-1]).T                   # [W, H*K]
  return np.ascontiguousarray(a.reshape(shape)).astype(dtype)


def _unpack_mxfp4(packed: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
  import jax.numpy as jnp
  from k3_jax.ops.mx import MXArray, dequantize
  mx = MXArray(jnp.asarray(packed.T), jnp.asarray(scale.T), "mxfp4", -2)
  return np.asarray(dequantize(mx, jnp.float32)).astype(dtype)  # [in, out]


def read_slice(e: Entry, get_slice, shape: tuple[int, ...], dtype,
               sl: tuple[slice, ...]) -> np.ndarray:
  """Our slice `sl` (over the variable's trailing axes, of full `shape`) read from disk,
  touching only the rows / columns of the disk tensor that it needs where the layout allows
  it ("linear" entries and same-shape "reshape" entries); small tensors are read whole.
  get_slice(name) -> a safetensors slice object (supports [a:b, c:d] reads)."""
  dtype = np.dtype(dtype)
  ranges = [range(*s.indices(n)) for s, n in zip(sl, shape)]
  t0 = e.tensors[0]
  if e.kind == "linear" and len(t0.shape) == 2:
    n = e.n_in
    in_idx = _flat_index(ranges[:n], shape[:n])                  # [*in_sel]
    out_idx = _flat_index(ranges[n:], shape[n:])                 # [*out_sel]
    rows, cols = out_idx.ravel(), in_idx.ravel()
    r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    block = np.asarray(get_slice(t0.name)[int(r0):int(r1), int(c0):int(c1)])
    vals = block[np.ix_(rows - r0, cols - c0)].T                 # [in_sel, out_sel]
    return vals.reshape(in_idx.shape + out_idx.shape).astype(dtype)
  if e.kind == "mxfp4" and all(r.step == 1 for r in ranges):
    # disk rows = the output columns we hold; the input range widened to whole 32-blocks
    (i0, i1), (o0, o1) = [(r.start, r.stop) for r in ranges]
    b0, b1 = i0 // 32 * 32, -(-i1 // 32) * 32
    packed = np.asarray(get_slice(t0.name)[o0:o1, b0 // 2:b1 // 2])
    scale = np.asarray(get_slice(e.tensors[1].name)[o0:o1, b0 // 32:b1 // 32])
    return _unpack_mxfp4(packed, scale, dtype)[i0 - b0:i1 - b0]   # [in_sel, out_sel]
  if e.kind == "reshape" and tuple(t0.shape) == tuple(shape):
    return np.asarray(get_slice(t0.name)[sl]).astype(dtype)
  arrays = [np.asarray(get_slice(t.name)[:]) for t in e.tensors]
  return from_disk(e, arrays, shape, dtype)[sl]


def _flat_index(ranges, dims) -> np.ndarray:
  if not ranges:
    return np.zeros((), np.int64)
  grids = np.meshgrid(*[np.asarray(r, np.int64) for r in ranges], indexing="ij")
  return np.ravel_multi_index(grids, dims)
