"""Training batches from a prepared directory (`python main.py prepare`, k3_jax/data/prepare.py).

The global batch of B rows is read by S streams, S = gcd(num_shards, B): stream s reads
the train shards s, s + S, s + 2S, ... and packs B / S rows of every global batch (rows
s * B/S ... (s+1) * B/S - 1). A stream visits its shards one at a time, in a shuffled order
each epoch, and its documents in a shuffled order within each shard (a block shuffle: Parquet
decodes a shard once, ArrayRecord reads stay local); the pipeline's window shuffle then mixes
windows across documents before packing (k3_jax/data/pipeline.py, the same packing and batch
format as the text path), in a buffer of shuffle_window windows per stream: a process holds
S/P x shuffle_window x (seq_len + 1) int32 tokens in these buffers (8 streams at seq_len 8192:
256 MiB).

Multi-host: process p of P runs the streams p * S/P ... (p+1) * S/P - 1 only, so it opens
only its share of the shards, and its rows are its contiguous slice of the global batch (the
order train.put_batch concatenates them in). The streams do not depend on P: 2 processes
give the same global batches, in the same order, as 1. P must divide S (prepare with more
shards otherwise).

State: {"fingerprint", "streams": {s: grain state of stream s}} over ALL streams: on a
multi-host job `get_state` gathers the other processes' stream states (through `allgather`,
a collective every process calls at the same step, as checkpoint saves are), so the state
process 0 saves resumes every process exactly, on the same or another process count.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

from k3_jax.config import UserError
from k3_jax.data import pipeline, records
from k3_jax.data.prepare import FORMAT_VERSION, MANIFEST, tokenizer_fingerprint
from k3_jax.data.tokenizers import Tokenizer

Batch = pipeline.Batch


def is_prepared(path: str) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def load_manifest(path: str) -> dict:
  mpath = os.path.join(path, MANIFEST)
  try:
    with open(mpath) as f:
      m = json.load(f)
  except FileNotFoundError:
    raise UserError(f"{path!r} is not a prepared dataset (no {MANIFEST}; make one with "
                    f"`python main.py prepare`)") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{mpath}: not valid JSON ({e})") from None
  if m.get("format_version") != FORMAT_VERSION:
    raise UserError(f"{mpath}: format_version {m.get('format_version')!r}, this version "
                    f"reads {FORMAT_VERSION}; prepare the dataset again")
  return m


def check_tokenizer(path: str, manifest: dict, tok: Tokenizer, spec: str) -> None:
  """One-line refusal of a dataset tokenized by another tokenizer than `tok`."""
  theirs = manifest["tokenizer"]
  ours = tokenizer_fingerprint(tok, spec)
  if theirs["fingerprint"] != ours:
    raise UserError(f"--dataset={path} was prepared with tokenizer {theirs['spec']!r} "
                    f"(fingerprint {theirs['fingerprint']}), not --tokenizer={spec!r} "
                    f"(fingerprint {ours}); pass its tokenizer or prepare the data again")


def shard_paths(path: str, manifest: dict, split: str) -> list[str]:
  return [os.path.join(path, f) for f in manifest["splits"][split]["shards"]]


def num_streams(num_shards: int, batch_size: int) -> int:
  return math.gcd(num_shards, batch_size)


class _ShardBlockShuffle(grain.MapDataset):
  """Records of `parent` (shards of `sizes` records laid end to end) in epoch order: shards
  in a shuffled order, each shard's records shuffled, reshuffled every epoch."""

  def __init__(self, parent: grain.MapDataset, sizes: list[int], seed: int, shuffle: bool,
               num_epochs: int | None):
    super().__init__(parent)
    self._sizes = [int(s) for s in sizes]
    self._starts = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)
    self._n = int(self._starts[-1])
    self._seed, self._shuffle, self._epochs = seed, shuffle, num_epochs

  def __len__(self) -> int:
    return sys.maxsize if self._epochs is None else self._n * self._epochs

  def __str__(self) -> str:
    return "ShardBlockShuffle"

  @functools.lru_cache(maxsize=4)
  def _epoch_order(self, epoch: int):
    """(shard order, start of each in the epoch's order) of `epoch`."""
    if not self._shuffle:
      order = np.arange(len(self._sizes))
    else:
      order = np.random.default_rng([self._seed, epoch]).permutation(len(self._sizes))
    sizes = np.asarray(self._sizes)[order]
    return order, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

  @functools.lru_cache(maxsize=8)
  def _within(self, epoch: int, shard: int) -> np.ndarray:
    return np.random.default_rng([self._seed, epoch, shard, 1]).permutation(self._sizes[shard])

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, j = divmod(int(index), self._n)
    order, starts = self._epoch_order(epoch)
    k = int(np.searchsorted(starts, j, side="right")) - 1
    shard, row = int(order[k]), j - int(starts[k])
    if self._shuffle:
      row = int(self._within(epoch, shard)[row])
    return self._parent[int(self._starts[shard]) + row]


def _stream(path: str, manifest: dict, stream: int, streams: int, seq_len: int, rows: int,
            seed: int, shuffle: bool, num_epochs: int | None, shuffle_window: int,
            read_threads: int) -> grain.IterDataset:
  split = manifest["splits"]["train"]
  mine = list(range(stream, len(split["shards"]), streams))
  source = records.open_source(manifest["format"],
                               [os.path.join(path, split["shards"][i]) for i in mine], "tokens")
  docs = _ShardBlockShuffle(grain.MapDataset.source(source),
                            [split["documents"][i] for i in mine],
                            seed=(seed * 1_000_003 + stream) % 2**32, shuffle=shuffle,
                            num_epochs=num_epochs)
  examples = pipeline.pack_token_documents(
      docs, seq_len, seed=(seed + stream) % 2**32, shuffle=shuffle,
      num_packing_bins=4 * rows, shuffle_window=shuffle_window,
      read_options=grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=64))
  return examples.batch(rows, drop_remainder=False).map(
      lambda b: pipeline._pad_batch(b, rows))  # pylint: disable=protected-access


class PreparedIterator(Iterator[Batch]):
  """This process's rows of every global batch of a prepared dataset (module docstring)."""

  def __init__(self, path: str, seq_len: int, batch_size: int, seed: int,
               shuffle: bool = True, num_epochs: int | None = None,
               process_index: int = 0, process_count: int = 1,
               shuffle_window: int = 1024, read_threads: int | None = None,
               allgather: Callable[[str], list[str]] | None = None,
               manifest: dict | None = None):
    self.manifest = manifest or load_manifest(path)
    if self.manifest["kind"] != "tokens":
      raise UserError(f"--dataset={path} holds {self.manifest['kind']!r} records; this "
                      f"reader takes tokenized text (train reads chat directories through "
                      f"k3_jax/data/chat_sft.py)")
    shards = len(self.manifest["splits"]["train"]["shards"])
    self.streams = num_streams(shards, batch_size)
    if self.streams % process_count:
      raise UserError(f"--dataset={path}: its {shards} train shards and batch_size="
                      f"{batch_size} give {self.streams} reading streams (their gcd), which "
                      f"{process_count} processes cannot share evenly; prepare it with "
                      f"more shards (e.g. --num_shards={batch_size})")
    counts = self.manifest["splits"]["train"]["documents"]
    empty = [s for s in range(self.streams) if not sum(counts[s::self.streams])]
    if empty:
      raise UserError(f"--dataset={path}: {sum(counts)} train documents in {shards} shards "
                      f"leave reading stream(s) {empty} of {self.streams} without a document; "
                      f"prepare it with fewer shards (--num_shards)")
    per = self.streams // process_count
    self.mine = list(range(process_index * per, (process_index + 1) * per))
    rows = batch_size // self.streams
    self._rows, self._seq_len = rows, seq_len
    names = self.manifest["splits"]["train"]["shards"]
    self.shard_files = [os.path.join(path, names[i]) for s in self.mine
                        for i in range(s, shards, self.streams)]   # what this process opens
    # Each stream has its own window-shuffle buffer of shuffle_window windows: grain's window
    # shuffle costs ~25 ms a window whatever its size, so small windows would bound the
    # rate. Reading threads do not change the order.
    window = shuffle_window
    threads = read_threads if read_threads is not None else (2 if per <= 8 else 1)
    self._iters = {s: iter(_stream(path, self.manifest, s, self.streams, seq_len, rows, seed,
                                   shuffle, num_epochs, window, threads))
                   for s in self.mine}
    self._allgather = allgather
    self._fingerprint = {"dataset": self.manifest["tokenizer"]["fingerprint"],
                         "documents": self.manifest["documents"],
                         "tokens": self.manifest["tokens"], "shards": shards,
                         "seq_len": seq_len, "batch_size": batch_size, "seed": seed,
                         "shuffle": shuffle, "num_epochs": num_epochs,
                         "shuffle_window": shuffle_window, "streams": self.streams}

  def __iter__(self) -> "PreparedIterator":
    return self

  def __next__(self) -> Batch:
    # With a finite num_epochs a stream that has run out gives empty rows (segment 0, no
    # loss) until the last one ends; training runs forever (num_epochs None).
    parts, live = [], 0
    for s in self.mine:
      try:
        parts.append(next(self._iters[s]))
        live += 1
      except StopIteration:
        parts.append({k: np.zeros((self._rows, self._seq_len),
                                  np.float32 if k == "loss_mask" else np.int32)
                      for k in pipeline.BATCH_KEYS})
    if not live:
      raise StopIteration
    return {k: np.concatenate([p[k] for p in parts]) for k in pipeline.BATCH_KEYS}

  def get_state(self) -> dict[str, Any]:
    own = {str(s): copy.deepcopy(self._iters[s].get_state()) for s in self.mine}
    if self._allgather is not None:
      merged = {}
      for text in self._allgather(json.dumps(own, sort_keys=True)):
        merged.update(json.loads(text))
      own = merged
    return {"fingerprint": dict(self._fingerprint), "streams": own}

  def set_state(self, state: dict[str, Any]) -> None:
    theirs = state.get("fingerprint")
    if theirs != self._fingerprint:
      raise ValueError("data iterator state is from a different pipeline: "
                       f"saved {theirs}, this one {self._fingerprint}")
    missing = [s for s in self.mine if str(s) not in state["streams"]]
    if missing:
      raise ValueError(f"data iterator state lacks streams {missing} (saved by a job that "
                       f"did not gather every process's state)")
    for s in self.mine:
      self._iters[s].set_state(copy.deepcopy(state["streams"][str(s)]))


def eval_batches(path: str, manifest: dict, seq_len: int, batch_size: int, num_batches: int,
                 process_index: int = 0, process_count: int = 1) -> list[Batch]:
  """This process's rows of the fixed eval batches: the global batches built from every eval
  document (the eval split is small), sliced by process."""
  if "eval" not in manifest["splits"]:
    return []
  source = records.open_source(manifest["format"], shard_paths(path, manifest, "eval"),
                               "tokens")
  docs = [source[i] for i in range(len(source))]
  batches = pipeline.eval_batches_from_tokens(docs, seq_len, batch_size, num_batches)
  n = batch_size // process_count
  return [{k: v[process_index * n:(process_index + 1) * n] for k, v in b.items()}
          for b in batches]


def jax_allgather(text: str) -> list[str]:
  """Every process's `text`, in process order (a collective: all processes call it)."""
  from jax.experimental import multihost_utils
  data = np.frombuffer(text.encode("utf-8"), np.uint8)
  lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(data)))).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = data
  every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
  return [every[i, :lengths[i]].tobytes().decode("utf-8") for i in range(len(lengths))]
