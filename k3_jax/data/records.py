"""Random-access grain data sources over ArrayRecord and Parquet shards, and a shard writer.

Both sources hold one field per record, of one of three kinds:

    text      str                 a document's text
    messages  str                 a conversation as JSON (OpenAI `messages`, kept as written;
                                  rendering it with the chat template is the caller's job)
    tokens    int32 [T]           pre-tokenized ids

ArrayRecord records are bytes: UTF-8 for text and messages, little-endian int32 for tokens.
Parquet shards keep the field in one column (`text` / `messages` as strings, `tokens` as
list<int32>); any other column of a user's file can be named instead.

`ArrayRecordSource` and `ParquetSource` follow grain's RandomAccessDataSource protocol
(`__len__`, `__getitem__`), so `grain.MapDataset.source(src)` reads them. Parquet is not a
random-access format: the source decodes a whole shard's column the first time one of its
records is asked for and keeps the last `cache_shards` shards decoded, so readers should visit
one shard at a time (k3_jax/data/prepared.py does: records are shuffled within a shard, the
shards' order per epoch).
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import threading
from collections.abc import Sequence

import numpy as np

KINDS = ("text", "messages", "tokens")
FORMATS = ("arrayrecord", "parquet")
SUFFIX = {"arrayrecord": ".array_record", "parquet": ".parquet"}
# group_size:1 makes every record its own chunk: random access reads one record, not a group.
ARRAY_RECORD_WRITER_OPTIONS = "group_size:1"


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"record kind must be one of {', '.join(KINDS)}; got {kind!r}")


def encode_record(kind: str, value) -> bytes:
  """One ArrayRecord record of `kind` (see the module docstring)."""
  if kind == "tokens":
    return np.asarray(value, dtype="<i4").tobytes()
  if kind == "messages" and not isinstance(value, str):
    value = json.dumps(value, ensure_ascii=False)
  return value.encode("utf-8")


def decode_record(kind: str, data: bytes):
  if kind == "tokens":
    return np.frombuffer(data, dtype="<i4").astype(np.int32)
  return data.decode("utf-8")


class ArrayRecordSource:
  """Records of `kind` from ArrayRecord files, in file order (grain random access)."""

  def __init__(self, paths: Sequence[str | os.PathLike], kind: str = "tokens"):
    _check_kind(kind)
    paths = [os.fspath(p) for p in paths]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
      raise FileNotFoundError(f"ArrayRecord shard not found: {missing[0]!r}")
    from grain.sources import ArrayRecordDataSource  # needs the array_record package
    self.paths, self.kind = paths, kind
    self._source = ArrayRecordDataSource(paths)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int):
    return decode_record(self.kind, self._source[index])

  def __repr__(self) -> str:
    return f"ArrayRecordSource({len(self.paths)} files, kind={self.kind!r})"


class ParquetSource:
  """Records of one column of Parquet files, in file order (grain random access).

  kind "tokens": a list<integer> column -> int32 arrays; "text": a string column -> str;
  "messages": a string column of JSON (returned as the string) or a list<struct> column
  (returned as its JSON), so a caller always gets the JSON text of the conversation.
  """

  def __init__(self, paths: Sequence[str | os.PathLike], column: str | None = None,
               kind: str = "tokens", cache_shards: int = 2):
    import pyarrow.parquet as pq
    _check_kind(kind)
    self.paths = [os.fspath(p) for p in paths]
    self.kind, self.column = kind, column or kind
    self._cache_shards = max(1, cache_shards)
    sizes = []
    for p in self.paths:
      if not os.path.isfile(p):
        raise FileNotFoundError(f"Parquet shard not found: {p!r}")
      f = pq.ParquetFile(p)
      names = f.schema_arrow.names
      if self.column not in names:
        raise ValueError(f"{p}: no column {self.column!r} (columns: {', '.join(names)})")
      sizes.append(f.metadata.num_rows)
    self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
    self._cache: collections.OrderedDict[int, object] = collections.OrderedDict()
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return self._starts[-1]

  def _shard(self, i: int):
    with self._lock:
      if i in self._cache:
        self._cache.move_to_end(i)
        return self._cache[i]
    data = self._decode(self.paths[i])
    with self._lock:
      self._cache[i] = data
      while len(self._cache) > self._cache_shards:
        self._cache.popitem(last=False)
    return data

  def _decode(self, path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq
    col = pq.read_table(path, columns=[self.column]).column(self.column).combine_chunks()
    if self.kind == "tokens":
      if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValueError(f"{path}: column {self.column!r} is {col.type}, not a list of ids")
      return (col.values.to_numpy(zero_copy_only=False).astype(np.int32),
              col.offsets.to_numpy().astype(np.int64))
    if self.kind == "messages" and not pa.types.is_string(col.type) \
        and not pa.types.is_large_string(col.type):
      return [json.dumps(v, ensure_ascii=False) for v in col.to_pylist()]
    return col.to_pylist()

  def __getitem__(self, index: int):
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"record {index} out of range [0, {len(self)})")
    shard = bisect.bisect_right(self._starts, index) - 1
    data, row = self._shard(shard), index - self._starts[shard]
    if self.kind == "tokens":
      values, offsets = data
      return values[offsets[row]:offsets[row + 1]]
    return data[row]

  def __repr__(self) -> str:
    return f"ParquetSource({len(self.paths)} files, column={self.column!r}, kind={self.kind!r})"


def open_source(fmt: str, paths: Sequence[str], kind: str):
  if fmt == "arrayrecord":
    return ArrayRecordSource(paths, kind)
  if fmt == "parquet":
    return ParquetSource(paths, kind=kind)
  raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")


class ShardWriter:
  """Writes records of one kind to `num_shards` files `<prefix>-0000i-of-0000n<suffix>`,
  record i going to shard i % num_shards (so shards are balanced and reading shard j gives
  every num_shards-th record in order). Parquet shards are written in row groups of
  `row_group_size` records. Use as a context manager, or call close()."""

  def __init__(self, directory: str, prefix: str, fmt: str, kind: str, num_shards: int,
               row_group_size: int = 1024):
    _check_kind(kind)
    if fmt not in FORMATS:
      raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if num_shards < 1:
      raise ValueError(f"num_shards={num_shards} must be >= 1")
    os.makedirs(directory, exist_ok=True)
    self.fmt, self.kind, self.num_shards = fmt, kind, num_shards
    self.files = [f"{prefix}-{i:05d}-of-{num_shards:05d}{SUFFIX[fmt]}" for i in range(num_shards)]
    self.paths = [os.path.join(directory, f) for f in self.files]
    self.counts = [0] * num_shards
    self._row_group = row_group_size
    self._next = 0
    if fmt == "arrayrecord":
      from array_record.python.array_record_module import ArrayRecordWriter
      self._writers = [ArrayRecordWriter(p, ARRAY_RECORD_WRITER_OPTIONS) for p in self.paths]
    else:
      import pyarrow as pa
      import pyarrow.parquet as pq
      field_type = pa.list_(pa.int32()) if kind == "tokens" else pa.string()
      self._schema = pa.schema([(kind, field_type)])
      self._writers = [pq.ParquetWriter(p, self._schema) for p in self.paths]
      self._buffers: list[list] = [[] for _ in range(num_shards)]

  def write(self, value) -> int:
    """Writes one record; returns the shard it went to."""
    i = self._next
    self._next = (i + 1) % self.num_shards
    self.counts[i] += 1
    if self.fmt == "arrayrecord":
      self._writers[i].write(encode_record(self.kind, value))
      return i
    if self.kind == "messages" and not isinstance(value, str):
      value = json.dumps(value, ensure_ascii=False)
    self._buffers[i].append(value)
    if len(self._buffers[i]) >= self._row_group:
      self._flush(i)
    return i

  def _flush(self, i: int) -> None:
    import pyarrow as pa
    buf = self._buffers[i]
    if not buf:
      return
    if self.kind == "tokens":
      lengths = np.fromiter((len(v) for v in buf), np.int64, len(buf))
      offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
      values = (np.concatenate([np.asarray(v, np.int32) for v in buf]) if lengths.sum()
                else np.zeros(0, np.int32))
      column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    else:
      column = pa.array(buf, pa.string())
    self._writers[i].write_table(pa.Table.from_arrays([column], schema=self._schema))
    self._buffers[i] = []

  def close(self) -> None:
    if self.fmt == "parquet":
      for i in range(self.num_shards):
        self._flush(i)
    for w in self._writers:
      w.close()
    self._writers = []

  def __enter__(self) -> "ShardWriter":
    return self

  def __exit__(self, *exc) -> None:
    if self._writers:
      self.close()
