"""Packed language-model batches from documents, as a resumable grain pipeline.

    documents (list[str])
      -> this host's shard: documents[process_index::process_count]
      -> shuffle by `seed`, reshuffled each epoch; repeat `num_epochs` times
      -> tokenize lazily, one document at a time ([BOS] + ids + [EOS])
      -> split long documents into windows of at most seq_len + 1 tokens
      -> shuffle windows within a buffer (`shuffle_window`), mixing documents
      -> first-fit pack windows into rows of seq_len + 1 tokens (grain)
      -> inputs = row[:-1], targets = row[1:], segment ids, loss mask
      -> batch (a finite last batch is padded with empty rows)

Batch format (numpy, B = batch_size per host, S = seq_len):

    inputs       int32   [B, S]  token ids (0 where padding)
    targets      int32   [B, S]  next token ids (0 where masked)
    segment_ids  int32   [B, S]  1, 2, 3 ... per packed piece within a row;
                                 0 = padding
    loss_mask    float32 [B, S]  1 where targets[t] is the next token of the
                                 same piece (predicting EOS counts), else 0

Long documents are split into windows that overlap by one token
(tokens[k*S : k*S + S + 1]), so every next-token transition of a document is a
target exactly once per epoch; a window never shares a segment with another.
BOS is prepended only if the tokenizer has one (the byte tokenizer does not);
EOS is appended if it has one. Documents that tokenize to fewer than two
tokens (no transition to learn) are dropped.

The iterator's state (`get_state()`) is a small JSON-serialisable dict (grain's
iterator state plus a fingerprint of the pipeline's arguments);
`set_state(state)` on a freshly built iterator resumes exactly, and refuses a
state from a pipeline built with different arguments.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from k3_jax.data.tokenizers import Tokenizer

Batch = dict[str, np.ndarray]
BATCH_KEYS = ("inputs", "targets", "segment_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class _Tokenize(grain.transforms.Map):
  """text -> int32 [T] = [BOS] + encode(text) + [EOS] (special ids if present)."""

  tokenizer: Tokenizer

  def map(self, text: str) -> np.ndarray:
    ids = self.tokenizer.encode_array(text)
    bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
    parts = ([np.array([bos], np.int32)] if bos is not None else []) + [ids]
    if eos is not None:
      parts.append(np.array([eos], np.int32))
    return np.concatenate(parts).astype(np.int32, copy=False)


@dataclasses.dataclass(frozen=True)
class _SplitIntoWindows(grain.experimental.FlatMapTransform):
  """int32 [T] -> windows of <= seq_len + 1 tokens, overlapping by one token."""

  seq_len: int
  max_fan_out: int = sys.maxsize  # unused by the iterator flat map; no limit

  def flat_map(self, tokens: np.ndarray) -> list[dict[str, np.ndarray]]:
    return [{"tokens": tokens[start:start + self.seq_len + 1]}
            for start in range(0, len(tokens) - 1, self.seq_len)]


def _row_to_example(row: dict[str, np.ndarray]) -> Batch:
  """Packed row of S + 1 tokens -> one unbatched example of length S."""
  tokens, seg = row["tokens"], row["tokens_segment_ids"]  # [S+1] each
  same_piece = (seg[:-1] == seg[1:]) & (seg[:-1] != 0)
  return {
      "inputs": tokens[:-1].astype(np.int32),
      "targets": np.where(same_piece, tokens[1:], 0).astype(np.int32),
      "segment_ids": seg[:-1].astype(np.int32),
      "loss_mask": same_piece.astype(np.float32),
  }


def _pad_batch(batch: Batch, batch_size: int) -> Batch:
  """Pads a short (final) batch with empty rows: all zeros, loss_mask 0."""
  missing = batch_size - batch["inputs"].shape[0]
  if missing == 0:
    return batch
  return {k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)])
          for k, v in batch.items()}


class DataIterator(Iterator[Batch]):
  """A grain iterator of batches with a JSON-serialisable, checked state."""

  def __init__(self, dataset: grain.IterDataset, fingerprint: dict[str, Any]):
    self._iterator = iter(dataset)
    self._fingerprint = fingerprint

  def __iter__(self) -> "DataIterator":
    return self

  def __next__(self) -> Batch:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    return {"fingerprint": dict(self._fingerprint),
            "grain": copy.deepcopy(self._iterator.get_state())}

  def set_state(self, state: dict[str, Any]) -> None:
    theirs = state.get("fingerprint")
    if theirs != self._fingerprint:
      from k3_jax.config import UserError   # a resume with other data settings
      raise UserError("data iterator state is from a different pipeline: "
                       f"saved {theirs}, this one {self._fingerprint}")
    self._iterator.set_state(copy.deepcopy(state["grain"]))


def _check_args(documents: Sequence[str], seq_len: int, batch_size: int,
                process_index: int, process_count: int) -> None:
  if seq_len < 1:
    raise ValueError(f"seq_len={seq_len} must be >= 1")
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
  if len(documents) < process_count:
    raise ValueError(f"{len(documents)} documents cannot be sharded over "
                     f"process_count={process_count} hosts")


def _packed_rows(documents: Sequence[str], tokenizer: Tokenizer, seq_len: int,
                 *, seed: int, shuffle: bool, num_epochs: int | None,
                 process_index: int, process_count: int,
                 num_packing_bins: int, shuffle_window: int) -> grain.IterDataset:
  """Unbatched examples (see `_row_to_example`) of this host's shard."""
  docs = grain.MapDataset.source(documents)[process_index::process_count]
  if shuffle:
    docs = docs.shuffle(seed=seed)
  docs = docs.repeat(num_epochs).map(_Tokenize(tokenizer))
  return pack_token_documents(docs, seq_len, seed=seed, shuffle=shuffle,
                              num_packing_bins=num_packing_bins, shuffle_window=shuffle_window)


def pack_token_documents(docs: grain.MapDataset, seq_len: int, *, seed: int, shuffle: bool,
                         num_packing_bins: int, shuffle_window: int,
                         read_options: grain.ReadOptions | None = None) -> grain.IterDataset:
  """Token documents (int32 [T] each, in reading order) -> unbatched packed examples: split
  into windows, shuffled within `shuffle_window`, first-fit packed (`_row_to_example`)."""
  windows = grain.experimental.FlatMapIterDataset(
      docs.to_iter_dataset(read_options or grain.ReadOptions(num_threads=4,
                                                             prefetch_buffer_size=64)),
      _SplitIntoWindows(seq_len))
  if shuffle and shuffle_window > 1:
    # A long document yields many consecutive windows; without mixing them a batch holds
    # one or two files and training chases whichever file it is reading.
    windows = grain.experimental.WindowShuffleIterDataset(windows, window_size=shuffle_window,
                                                          seed=seed)
  rows = grain.experimental.FirstFitPackIterDataset(
      windows, length_struct={"tokens": seq_len + 1},
      num_packing_bins=num_packing_bins, seed=seed, shuffle_bins=shuffle)
  return rows.map(_row_to_example)


def make_dataset(documents: Sequence[str], tokenizer: Tokenizer, seq_len: int,
                 batch_size: int, seed: int, shuffle: bool = True,
                 num_epochs: int | None = None, process_index: int = 0,
                 process_count: int = 1,
                 num_packing_bins: int | None = None,
                 shuffle_window: int = 1024) -> DataIterator:
  """Iterator of packed training batches (format in the module docstring).

  Args:
    documents: document texts (all hosts pass the same list).
    tokenizer: any `Tokenizer`.
    seq_len: S, tokens per row of `inputs`.
    batch_size: rows per batch on this host.
    seed: shuffle seed in [0, 2**32); the same seed gives the same batches.
    shuffle: shuffle documents (each epoch anew) and packed rows.
    num_epochs: passes over the documents; None = forever. With a finite
      number the last batch is padded with empty rows, then StopIteration.
    process_index, process_count: this host's disjoint shard of documents.
    num_packing_bins: rows packed at once by first-fit (more bins, less
      padding); default 4 * batch_size.
    shuffle_window: with shuffle, windows (pieces of seq_len + 1 tokens) are
      shuffled within a buffer of this many, so a batch mixes many documents.
  """
  _check_args(documents, seq_len, batch_size, process_index, process_count)
  bins = num_packing_bins or 4 * batch_size
  rows = _packed_rows(documents, tokenizer, seq_len, seed=seed, shuffle=shuffle,
                      num_epochs=num_epochs, process_index=process_index,
                      process_count=process_count, num_packing_bins=bins,
                      shuffle_window=shuffle_window)
  batches = rows.batch(batch_size, drop_remainder=False).map(
      lambda b: _pad_batch(b, batch_size))
  fingerprint = {
      "num_documents": len(documents), "tokenizer": repr(tokenizer),
      "seq_len": seq_len, "batch_size": batch_size, "seed": seed,
      "shuffle": shuffle, "num_epochs": num_epochs,
      "process_index": process_index, "process_count": process_count,
      "num_packing_bins": bins, "shuffle_window": shuffle_window,
  }
  return DataIterator(batches, fingerprint)


def eval_batches(documents: Sequence[str], tokenizer: Tokenizer, seq_len: int,
                 batch_size: int, num_batches: int, process_index: int = 0,
                 process_count: int = 1) -> list[Batch]:
  """A fixed list of up to `num_batches` batches, one window of seq_len + 1 tokens per row,
  the windows spread evenly over ALL (this host's) documents.

  A handful of batches read in document order would measure one or two files; spreading
  them keeps a small evaluation representative of the whole split. Fewer batches come
  back only if there are fewer windows than rows; the same arguments always give the
  same batches.
  """
  _check_args(documents, seq_len, batch_size, process_index, process_count)
  tok = _Tokenize(tokenizer)
  return eval_batches_from_tokens([tok.map(d) for d in documents[process_index::process_count]],
                                  seq_len, batch_size, num_batches)


def eval_batches_from_tokens(token_docs: Sequence[np.ndarray], seq_len: int, batch_size: int,
                             num_batches: int) -> list[Batch]:
  """`eval_batches` of already tokenized documents ([BOS] + ids + [EOS] each)."""
  split = _SplitIntoWindows(seq_len)
  windows = [w["tokens"] for doc in token_docs for w in split.flat_map(doc)]
  if not windows:
    return []
  rows = min(num_batches * batch_size, len(windows))
  picked = [windows[i] for i in np.linspace(0, len(windows) - 1, rows).round().astype(int)]
  examples = []
  for w in picked:
    tokens = np.zeros(seq_len + 1, np.int32)
    seg = np.zeros(seq_len + 1, np.int32)
    tokens[:len(w)], seg[:len(w)] = w, 1
    examples.append(_row_to_example({"tokens": tokens, "tokens_segment_ids": seg}))
  batches = []
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    batch = {k: np.stack([e[k] for e in chunk]) for k in BATCH_KEYS}
    batches.append(_pad_batch(batch, batch_size))
  return batches
