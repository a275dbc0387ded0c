"""The prefix cache's disk tier: one file per cached block in a directory, with its own byte
budget, reloaded by a later server on the same model and tokenizer.

A file `<block hash hex>.k3c` holds

    MAGIC | header length (u32 LE) | header (JSON) | payload

The header names the fingerprint of the model and tokenizer that wrote it (cache_tiers.
fingerprint), the block's hash and its parent's, the shapes and dtypes of the page arrays
(the block's MLA page in every MLA layer) and of the KDA checkpoint arrays (absent when the
block has no checkpoint), and a blake2b digest of the payload (those arrays' raw bytes, in
order). A file is written to a temporary name and renamed, so a crash leaves either the
whole file or none.

At start the directory is scanned (headers only): files of another fingerprint are left
alone and not counted; unreadable ones are skipped, each with a log line. A payload is
checked against its digest when the block is read (promoted); a damaged one is skipped
(the hit ends before it), logged and removed, never served.

Writes run on one background thread: `put` queues the block (kept in memory until the file
is written, so a read before then is served from there) and returns at once. Reads can run
ahead on another thread: `prefetch` starts reading blocks a queued request will promote, and
keeps them (checked) in memory until `get` takes them (at most READY_BYTES, oldest first
out: a block pushed out is read again when needed), so the engine step that admits the request does not wait for the disk.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import struct
import threading
import time

import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 types with numpy)
import numpy as np

log = logging.getLogger("k3_jax.serve")

MAGIC = b"K3PCACHE1\n"
SUFFIX = ".k3c"
READY_BYTES = 1 << 30               # prefetched blocks kept in memory until promoted, at most


@dataclasses.dataclass
class Block:
  """One block's cache entry off the device: its parent, its page's arrays (every MLA
  layer's latents for the 512-token page holding it) and its KDA checkpoint's, if any."""
  parent: bytes | None
  page: list                          # arrays (numpy, or device arrays still copying)
  ckpt: list | None                   # arrays, or None: no checkpoint at this boundary


def nbytes(arrays) -> int:
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays or ())


def spec(arrays):
  """[[shape, dtype name], ...] of arrays, or None (names, not numpy's type strings: a
  bfloat16's is the opaque '<V2'; ml_dtypes, imported here, makes numpy know the names)."""
  return None if arrays is None else [[list(a.shape), np.dtype(a.dtype).name] for a in arrays]


def encode(fp: str, h: bytes, b: Block) -> bytes:
  arrays = [np.ascontiguousarray(np.asarray(a)) for a in b.page + (b.ckpt or [])]
  payload = b"".join(a.tobytes() for a in arrays)
  head = json.dumps({"fingerprint": fp, "hash": h.hex(),
                     "parent": None if b.parent is None else b.parent.hex(),
                     "page": spec(b.page), "ckpt": spec(b.ckpt),
                     "digest": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
  return MAGIC + struct.pack("<I", len(head)) + head + payload


def read_header(f) -> dict:
  if f.read(len(MAGIC)) != MAGIC:
    raise ValueError("not a prefix-cache file (bad magic)")
  (n,) = struct.unpack("<I", f.read(4))
  if n > 1 << 20:
    raise ValueError(f"header of {n} bytes")
  head = json.loads(f.read(n))
  for key in ("fingerprint", "hash", "parent", "page", "ckpt", "digest"):
    if key not in head:
      raise ValueError(f"header lacks {key!r}")
  return head


def _arrays(spec, payload: memoryview, at: int):
  out = []
  for shape, dtype in spec or ():
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    if at + n > len(payload):
      raise ValueError("payload shorter than its header says")
    out.append(np.frombuffer(payload[at:at + n], dt).reshape(shape))
    at += n
  return out, at


def decode(data: bytes, fp: str, h: bytes) -> Block:
  """The block in file bytes `data`; ValueError naming what is wrong with it."""
  import io
  f = io.BytesIO(data)
  head = read_header(f)
  if head["fingerprint"] != fp:
    raise ValueError("written by another model or tokenizer (fingerprint differs)")
  if head["hash"] != h.hex():
    raise ValueError(f"holds block {head['hash']}, not {h.hex()}")
  payload = memoryview(data)[f.tell():]
  if hashlib.blake2b(payload, digest_size=16).hexdigest() != head["digest"]:
    raise ValueError("payload digest mismatch (damaged)")
  page, at = _arrays(head["page"], payload, 0)
  ckpt, at = _arrays(head["ckpt"], payload, at)
  if at != len(payload):
    raise ValueError("payload longer than its header says")
  parent = None if head["parent"] is None else bytes.fromhex(head["parent"])
  return Block(parent, page, ckpt if head["ckpt"] is not None else None)


@dataclasses.dataclass
class DiskEntry:
  parent: bytes | None
  has_ckpt: bool
  nbytes: int                         # the file's size


class DiskTier:
  def __init__(self, directory: str, budget: int, fp: str, page_spec=None, ckpt_spec=None):
    """page_spec / ckpt_spec: [[shape, dtype str], ...] of this engine's arrays (files whose
    arrays differ are skipped at the scan)."""
    self.dir, self.budget, self.fp = directory, budget, fp
    self.page_spec, self.ckpt_spec = page_spec, ckpt_spec
    os.makedirs(directory, exist_ok=True)
    self.index: collections.OrderedDict[bytes, DiskEntry] = collections.OrderedDict()  # LRU
    self.used = 0
    self.lock = threading.Lock()
    self.read_done = threading.Condition(self.lock)     # a prefetch finished
    self.pending: dict[bytes, Block] = {}
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="k3-disk-cache")
    self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="k3-disk-read")
    self.ready: collections.OrderedDict[bytes, Block] = collections.OrderedDict()  # prefetched
    self.ready_bytes = 0
    self.inflight: set[bytes] = set()
    self.prefetched = 0
    self.writes = self.reads = self.skipped = self.evictions = 0
    self.write_seconds = self.read_seconds = 0.0
    self._scan()

  def path(self, h: bytes) -> str:
    return os.path.join(self.dir, h.hex() + SUFFIX)

  def _scan(self) -> None:
    found = []
    for name in os.listdir(self.dir):
      if not name.endswith(SUFFIX):
        continue
      p = os.path.join(self.dir, name)
      try:
        with open(p, "rb") as f:
          head = read_header(f)
        if head["fingerprint"] != self.fp:
          raise ValueError("written by another model or tokenizer (fingerprint differs)")
        if self.page_spec is not None and (head["page"] != self.page_spec or (
            head["ckpt"] is not None and head["ckpt"] != self.ckpt_spec)):
          raise ValueError("its arrays' shapes differ from this engine's")
        h = bytes.fromhex(head["hash"])
        if name != h.hex() + SUFFIX:
          raise ValueError(f"names block {head['hash']}")
        st = os.stat(p)
        parent = None if head["parent"] is None else bytes.fromhex(head["parent"])
        found.append((st.st_mtime, h, DiskEntry(parent, head["ckpt"] is not None, st.st_size)))
      except Exception as e:
        self.skipped += 1
        log.warning("prefix cache disk tier: skipping %s: %s", p, e)
    for _, h, e in sorted(found, key=lambda t: t[0]):     # oldest first = least recent
      self.index[h] = e
      self.used += e.nbytes
    self._shrink()
    if found:
      log.info("prefix cache disk tier: %d blocks (%.1f MiB) reloaded from %s",
               len(self.index), self.used / 2**20, self.dir)

  # ----- reading -------------------------------------------------------------------------
  def peek(self, h: bytes) -> DiskEntry | None:
    with self.lock:
      return self.index.get(h)

  def get(self, h: bytes) -> Block | None:
    """The block, read and checked (None: absent, or damaged, which is logged and removed);
    a prefetched one from memory, one being prefetched once its read is done."""
    with self.lock:
      while h in self.inflight:
        self.read_done.wait()
      if h not in self.index:
        return None
      self.index.move_to_end(h)
      if h in self.ready:
        return self._unready(h)
      if h in self.pending:
        return self.pending[h]
    return self._read(h)

  def _read(self, h: bytes) -> Block | None:
    t0 = time.perf_counter()
    try:
      with open(self.path(h), "rb") as f:
        b = decode(f.read(), self.fp, h)
    except Exception as e:
      log.warning("prefix cache disk tier: skipping %s: %s", self.path(h), e)
      with self.lock:
        self.skipped += 1
        self._drop(h)
      return None
    with self.lock:
      self.reads += 1
      self.read_seconds += time.perf_counter() - t0
    return b

  def prefetch(self, hashes) -> bool:
    """Starts reading the blocks of `hashes` that are only on disk (on the reader thread)
    -> whether any of them is being read now."""
    busy = False
    for h in hashes:
      with self.lock:
        if h in self.inflight:
          busy = True
        if h not in self.index or h in self.pending or h in self.ready or h in self.inflight:
          continue
        self.inflight.add(h)
        busy = True
      self.reader.submit(self._prefetch_one, h)
    return busy

  def _prefetch_one(self, h: bytes) -> None:
    b = None
    try:
      b = self._read(h)
    finally:
      with self.lock:
        self.inflight.discard(h)
        if b is not None and h in self.index:
          self.ready[h] = b
          self.ready_bytes += nbytes(b.page) + nbytes(b.ckpt)
          self.prefetched += 1
          while self.ready_bytes > READY_BYTES:
            self._unready(next(iter(self.ready)))
        self.read_done.notify_all()

  def _unready(self, h: bytes) -> Block:
    b = self.ready.pop(h)
    self.ready_bytes -= nbytes(b.page) + nbytes(b.ckpt)
    return b

  def reading(self, hashes) -> bool:
    """Whether any of `hashes` is being prefetched now."""
    with self.lock:
      return any(h in self.inflight for h in hashes)

  # ----- writing -------------------------------------------------------------------------
  def put(self, h: bytes, b: Block) -> None:
    """Stores the block (a no-op when the tier holds it already, with a checkpoint if this
    one has one); the file is written on the background thread."""
    with self.lock:
      if h in self.index and (b.ckpt is None or self.index[h].has_ckpt):
        self.index.move_to_end(h)
        return
      self._drop(h)                 # (held without the checkpoint this one brings)
      size = len(MAGIC) + 4 + 512 + nbytes(b.page) + nbytes(b.ckpt)    # ~ the file's size
      if size > self.budget:
        return
      self.index[h] = DiskEntry(b.parent, b.ckpt is not None, size)
      self.used += size
      self.pending[h] = b
      self._shrink()
    self.pool.submit(self._write, h, b)

  def _write(self, h: bytes, b: Block) -> None:
    t0 = time.perf_counter()
    try:
      data = encode(self.fp, h, b)
      tmp = self.path(h) + f".tmp{os.getpid()}"
      with open(tmp, "wb") as f:
        f.write(data)
      with self.lock:
        if h not in self.index:           # evicted while it was being written
          os.unlink(tmp)
          return
        os.replace(tmp, self.path(h))
        e = self.index[h]
        self.used += len(data) - e.nbytes
        e.nbytes = len(data)
        self.writes += 1
        self.write_seconds += time.perf_counter() - t0
    except Exception as e:
      log.warning("prefix cache disk tier: writing block %s failed: %s", h.hex(), e)
      with self.lock:
        self._drop(h)
    finally:
      with self.lock:
        if self.pending.get(h) is b:      # (not a newer version of it, queued after)
          del self.pending[h]

  def _drop(self, h: bytes) -> None:
    if h in self.ready:
      self._unready(h)
    e = self.index.pop(h, None)
    if e is None:
      return
    self.used -= e.nbytes
    if h not in self.pending:
      try:
        os.unlink(self.path(h))
      except FileNotFoundError:
        pass

  def _shrink(self) -> None:
    while self.used > self.budget and self.index:
      h = next(iter(self.index))
      self._drop(h)
      self.evictions += 1

  def flush(self) -> None:
    """Waits for the queued writes."""
    self.pool.submit(lambda: None).result()

  def close(self) -> None:
    self.pool.shutdown(wait=True)
    self.reader.shutdown(wait=True)


__all__ = ["Block", "DiskTier", "DiskEntry", "encode", "decode", "nbytes", "spec", "MAGIC",
           "READY_BYTES"]
