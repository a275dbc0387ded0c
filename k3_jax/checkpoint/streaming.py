"""Orbax checkpoints written piece by piece: a leaf whose value is produced on demand, one
leading row at a time, so that saving a tree of them never holds more than one row in host
memory.

A `LazyArray` stands in a pytree for an array of `shape` / `dtype`: `produce(idx)` returns
the row value[idx] (idx over the first `rows` axes; rows=0: the whole array). Its Orbax type
handler opens the same tensorstore array (zarr under OCDBT) that Orbax's own numpy handler
would, with the chunk grid aligned to those rows, and writes the rows one after another,
each awaited before the next is produced. The checkpoint on disk is an ordinary Orbax
PyTree checkpoint: every existing restore path (StandardRestore, partial PyTreeRestore)
reads it as if the arrays had been saved whole.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import math
import os
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath


BATCH_BYTES = 16 << 20


class LazyArray:
  """shape / dtype of the array; produce(idx) -> np.ndarray of shape[rows:] for each idx in
  the product of range(shape[i]) over the first `rows` axes."""

  def __init__(self, shape, dtype, produce: Callable[[tuple], np.ndarray], rows: int = 0):
    self.shape, self.dtype = tuple(int(n) for n in shape), np.dtype(dtype)
    self.produce, self.rows = produce, rows
    if not 0 <= rows <= len(self.shape):
      raise ValueError(f"rows={rows} for an array of shape {self.shape}")

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * self.dtype.itemsize

  @property
  def row_shape(self) -> tuple[int, ...]:
    return (1,) * self.rows + self.shape[self.rows:]

  def indices(self):
    return itertools.product(*(range(n) for n in self.shape[:self.rows]))

  def row(self, idx: tuple) -> np.ndarray:
    a = np.asarray(self.produce(idx))
    want = self.shape[self.rows:]
    if tuple(a.shape) != want or a.dtype != self.dtype:
      raise ValueError(f"lazy array row {idx}: produced {a.dtype}{list(a.shape)}, expected "
                       f"{self.dtype}{list(want)}")
    return a

  def __repr__(self) -> str:
    return f"LazyArray({self.dtype}{list(self.shape)}, rows={self.rows})"


def constant(shape, dtype, value) -> LazyArray:
  """A lazy array filled with `value` (e.g. a fresh optimizer moment), one row at a time."""
  shape = tuple(shape)
  rows = max(0, len(shape) - 2)               # rows of at most a matrix
  return LazyArray(shape, dtype, lambda idx: np.full(shape[rows:], value, dtype), rows)


class LazyArrayHandler(ocp.type_handlers.NumpyHandler):
  """Writes LazyArray leaves row by row; reads back as numpy arrays (the format is the numpy
  handler's, so the restore side needs nothing of this module). batch_bytes: rows are
  committed in groups of about this many bytes (the host memory the write holds beyond
  one row)."""

  def __init__(self, batch_bytes: int = BATCH_BYTES):
    super().__init__(deepcopy_host_arrays=False)
    self.batch_bytes = batch_bytes

  async def serialize(self, values, infos, args=None):
    args = args or [ocp.type_handlers.SaveArgs()] * len(values)
    ocp.type_handlers.check_input_arguments(values, infos, args)
    return [ocp.future.CommitFutureAwaitingContractedSignals(
        self._write_rows(values, infos, args), name="lazy_array_handler")]

  async def _write_rows(self, values, infos, args):
    if jax.process_index() != 0:              # one writer (the values are host data)
      return
    specs = []
    for value, info, arg in zip(values, infos, args):
      await info.await_path_creation()
      use_ocdbt = bool(info.is_ocdbt_checkpoint)
      specs.append(ocp.type_handlers.get_json_tspec_write(
          info, use_ocdbt=use_ocdbt, global_shape=value.shape, local_shape=value.row_shape,
          dtype=value.dtype, process_index=jax.process_index() if use_ocdbt else None,
          arg=arg))
    # the arrays' metadata, all at once (as Orbax's own handlers do); no data yet
    stores = await asyncio.gather(*[
        ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
        for spec, info in zip(specs, infos)])
    # Rows go into one tensorstore transaction, committed whenever it holds batch_bytes (a
    # commit per row would rewrite the OCDBT tree thousands of times): the transaction's
    # buffered rows are the write's working set.
    txn, pending = ts.Transaction(), 0
    for value, t in zip(values, stores):
      for idx in value.indices():
        row = value.row(idx)                  # [*shape[rows:]]
        await t.with_transaction(txn)[idx].write(row)
        pending += row.nbytes
        del row
        if pending >= self.batch_bytes:
          await txn.commit_async()
          release_freed_memory()
          txn, pending = ts.Transaction(), 0
    await txn.commit_async()
    release_freed_memory()


class StoredArrays:
  """The arrays of a saved Orbax PyTree item (e.g. a step's `state` directory, as `save`
  and `save_streamed` write it: zarr arrays, under OCDBT or not), read with tensorstore a
  row at a time, never whole: `read(keys, idx)` -> array[idx]. keys: the leaf's tree path
  as strings (("params", "embed", "table", "value")). Opening reads only metadata."""

  def __init__(self, item_dir: str):
    with open(os.path.join(item_dir, "_METADATA")) as f:
      meta = json.load(f)
    self.dir = item_dir
    self._use_ocdbt = bool(meta.get("use_ocdbt", True))
    self._ctx = ocp.type_handlers.get_ts_context(use_ocdbt=self._use_ocdbt)
    self._info = lambda name: ocp.type_handlers.ParamInfo(
        name=name, parent_dir=epath.Path(item_dir), is_ocdbt_checkpoint=self._use_ocdbt,
        use_zarr3=bool(meta.get("use_zarr3", False)), ts_context=self._ctx)
    self._leaves = {
        tuple(k["key"] for k in v["key_metadata"]): ".".join(k["key"] for k in v["key_metadata"])
        for v in meta["tree_metadata"].values()
        if not v.get("value_metadata", {}).get("skip_deserialize")}
    self._stores: dict[tuple, ts.TensorStore] = {}

  def keys(self) -> list[tuple]:
    return list(self._leaves)

  def __contains__(self, keys) -> bool:
    return tuple(keys) in self._leaves

  def _store(self, keys: tuple) -> ts.TensorStore:
    keys = tuple(keys)
    if keys not in self._stores:
      if keys not in self._leaves:
        raise KeyError(f"{self.dir} holds no array {'/'.join(keys)}")
      spec = ocp.type_handlers.get_json_tspec_read(self._info(self._leaves[keys]),
                                                    use_ocdbt=self._use_ocdbt)
      self._stores[keys] = ts.open(ts.Spec(spec), open=True, read=True,
                                   context=self._ctx).result()
    return self._stores[keys]

  def shape(self, keys) -> tuple[int, ...]:
    return tuple(self._store(keys).shape)

  def read(self, keys, idx: tuple = ()) -> np.ndarray:
    """array[idx] (idx: ints over leading axes), read from disk now."""
    t = self._store(keys)
    return np.asarray(t[tuple(int(i) for i in idx)].read().result() if idx else
                      t.read().result())

  def rows(self, keys):
    """Leading indices that cut the array into pieces of at most a matrix."""
    shape = self.shape(keys)
    return itertools.product(*(range(n) for n in shape[:max(0, len(shape) - 2)]))

  def all_finite(self, prefix: tuple = ()) -> bool:
    """Whether every float array under `prefix` is finite, checked one row at a time."""
    for keys in self.keys():
      if keys[:len(prefix)] != tuple(prefix):
        continue
      if not jax.numpy.issubdtype(self._store(keys).dtype.numpy_dtype, jax.numpy.inexact):
        continue
      for idx in self.rows(keys):
        if not np.isfinite(self.read(keys, idx)).all():
          return False
    return True


def release_freed_memory() -> None:
  """Hands freed heap memory back to the OS (glibc's malloc_trim; nothing elsewhere). The
  rows pass through many threads' malloc arenas, which otherwise keep what they freed: the
  process's RSS would grow by about the model's size though only one batch is ever live."""
  try:
    ctypes.CDLL(None).malloc_trim(0)
  except (OSError, AttributeError):
    pass


def constant_leaves(fn: Callable, *abstract_args) -> list:
  """The leaves of fn(*args) as LazyArrays, when none depends on the values of args
  (ShapeDtypeStructs): e.g. a fresh optimizer state. Its jaxpr shows that no output depends
  on an input (else a ValueError naming the leaf); one compiled call returns each leaf's min
  and max, and a leaf whose are equal (the moments: zeros) is written as that constant fill,
  one row at a time, never allocated whole. Any other leaf (e.g. Muon's few Newton-Schulz
  coefficients) is computed by a second call that returns only those leaves."""
  import jax.numpy as jnp
  from jax.extend.core import Literal
  closed, out_shapes = jax.make_jaxpr(fn, return_shape=True)(*abstract_args)
  dependent = set(closed.jaxpr.invars)
  for eqn in closed.jaxpr.eqns:
    if any(not isinstance(v, Literal) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  shapes = jax.tree_util.tree_flatten_with_path(out_shapes)[0]
  names = [jax.tree_util.keystr(p) for p, _ in shapes]
  for name, v in zip(names, closed.jaxpr.outvars):
    if not isinstance(v, Literal) and v in dependent:
      raise ValueError(f"{name}: its initial value depends on the inputs' values, so it "
                       f"cannot be written without them")

  def leaves(which=None):
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_args)
    out = jax.tree.leaves(fn(*zeros))
    if which is not None:                     # only these leaves (XLA drops the rest)
      return [out[i] for i in which]
    return [(jnp.min(x), jnp.max(x)) if x.size else (jnp.zeros(()), jnp.zeros(()))
            for x in out]

  result: list = [None] * len(shapes)
  other = []
  for i, ((_, a), (lo, hi)) in enumerate(zip(shapes, jax.jit(leaves)())):
    lo, hi = np.asarray(lo), np.asarray(hi)
    if a.size and lo == hi:
      result[i] = constant(a.shape, a.dtype, lo.item())
    else:
      other.append(i)
  if other:
    for i, v in zip(other, jax.jit(lambda: leaves(other))()):
      v = np.asarray(v)
      result[i] = LazyArray(v.shape, v.dtype, lambda idx, v=v: v)
  return result


def largest_row_bytes(tree) -> int:
  """The most bytes one produced row of the tree's lazy leaves takes (the write's working
  set, besides the reader's own buffers)."""
  return max((math.prod(x.shape[x.rows:]) * x.dtype.itemsize
              for x in jax.tree.leaves(tree) if isinstance(x, LazyArray)), default=0)


__all__ = ["LazyArray", "LazyArrayHandler", "StoredArrays", "constant", "constant_leaves",
           "largest_row_bytes"]
