"""Multi-query associative recall (MQAR), the synthetic recall benchmark.

One row of seq_len + 1 tokens (inputs = row[:-1], targets = row[1:]):

    k1 v1 k2 v2 ... kN vN | 0 0 kq vq 0 0 0 kr vr 0 ...
    `----- context -----'   `------------ queries ------------'

The context lists `num_kv_pairs` pairs with distinct keys. The query region
repeats `num_queries` of those keys (distinct, random order) at random
positions, each followed by its value; everything else is the filler token 0.
loss_mask is 1 exactly at the query keys, whose target is the value to recall
(the context and the filler are not trained on).

Vocabulary: 0 = filler, keys in [1, vocab_size // 2), values in
[vocab_size // 2, vocab_size): disjoint ranges. Batches use the same dict
format as `k3_jax.data.pipeline` (segment_ids are all 1: one sequence a row).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from k3_jax.config import UserError

Batch = dict[str, np.ndarray]


def key_value_ranges(vocab_size: int) -> tuple[range, range]:
  """(key ids, value ids): disjoint, neither containing the filler 0."""
  return range(1, vocab_size // 2), range(vocab_size // 2, vocab_size)


def _check(batch_size: int, seq_len: int, vocab_size: int, num_kv_pairs: int,
           num_queries: int) -> None:
  keys, values = key_value_ranges(vocab_size)
  if batch_size < 1:
    raise UserError(f"batch_size={batch_size} must be >= 1")
  if num_kv_pairs < 1 or num_kv_pairs > len(keys):
    raise UserError(f"num_kv_pairs={num_kv_pairs} must be in [1, {len(keys)}] "
                     f"(distinct keys from vocab_size={vocab_size})")
  if not 1 <= num_queries <= num_kv_pairs:
    raise UserError(f"num_queries={num_queries} must be in [1, num_kv_pairs={num_kv_pairs}]")
  if len(values) < 1:
    raise UserError(f"vocab_size={vocab_size} is too small for MQAR")
  if 2 * num_kv_pairs + 2 * num_queries > seq_len + 1:
    raise UserError(
        f"seq_len={seq_len} too short: {num_kv_pairs} pairs and {num_queries} "
        f"queries need {2 * num_kv_pairs + 2 * num_queries - 1} positions")


def mqar_batch(rng: np.random.Generator, batch_size: int, seq_len: int,
               vocab_size: int, num_kv_pairs: int,
               num_queries: int | None = None) -> Batch:
  """One MQAR batch (format in the module docstring).

  Args:
    rng: source of randomness (the batch is a function of its state).
    batch_size, seq_len: B and S of the [B, S] outputs.
    vocab_size: keys and values are drawn from the two halves of it.
    num_kv_pairs: N, the key-value pairs in each context.
    num_queries: keys queried per row; default N (every key, once).
  """
  num_queries = num_kv_pairs if num_queries is None else num_queries
  _check(batch_size, seq_len, vocab_size, num_kv_pairs, num_queries)
  keys_range, values_range = key_value_ranges(vocab_size)
  B, N, Q = batch_size, num_kv_pairs, num_queries
  rows = np.zeros((B, seq_len + 1), np.int32)
  loss_mask = np.zeros((B, seq_len + 1), np.float32)
  # Distinct keys per row (argsort of uniforms = a random permutation).
  key_idx = np.argsort(rng.random((B, len(keys_range))), axis=1)[:, :N]
  keys = keys_range.start + key_idx                                   # [B, N]
  values = rng.integers(values_range.start, values_range.stop, (B, N))  # [B, N]
  rows[:, 0:2 * N:2], rows[:, 1:2 * N:2] = keys, values

  # Queries: Q of the N pairs, placed as (key, value) at random offsets in the
  # L = seq_len + 1 - 2N query slots; choose Q gaps among the L - 2Q fillers.
  query_len = seq_len + 1 - 2 * N
  which = np.argsort(rng.random((B, N)), axis=1)[:, :Q]               # [B, Q]
  for b in range(B):
    fillers_before = np.sort(rng.choice(query_len - 2 * Q + 1, Q, replace=True))
    starts = 2 * N + fillers_before + 2 * np.arange(Q)                 # [Q]
    rows[b, starts] = keys[b, which[b]]
    rows[b, starts + 1] = values[b, which[b]]
    loss_mask[b, starts] = 1.0
  mask = loss_mask[:, :-1]
  return {
      "inputs": rows[:, :-1],
      "targets": np.where(mask > 0, rows[:, 1:], 0).astype(np.int32),
      "segment_ids": np.ones((B, seq_len), np.int32),
      "loss_mask": mask,
  }


class MQARIterator(Iterator[Batch]):
  """Endless MQAR batches; batch i is a function of (seed, process_index, i).

  State is {"seed": ..., "step": ...} (JSON-serialisable).
  """

  def __init__(self, seed: int, process_index: int = 0, **batch_kwargs: Any):
    self._seed, self._process_index = int(seed), int(process_index)
    self._kwargs = batch_kwargs
    self._step = 0
    num_queries = batch_kwargs.get("num_queries")
    _check(batch_kwargs["batch_size"], batch_kwargs["seq_len"],
           batch_kwargs["vocab_size"], batch_kwargs["num_kv_pairs"],
           batch_kwargs["num_kv_pairs"] if num_queries is None else num_queries)

  def __iter__(self) -> "MQARIterator":
    return self

  def __next__(self) -> Batch:
    rng = np.random.default_rng([self._seed, self._process_index, self._step])
    self._step += 1
    return mqar_batch(rng, **self._kwargs)

  def get_state(self) -> dict[str, int]:
    return {"seed": self._seed, "step": self._step}

  def set_state(self, state: dict[str, int]) -> None:
    if state["seed"] != self._seed:
      raise ValueError(f"MQAR state has seed {state['seed']}, iterator has {self._seed}")
    self._step = int(state["step"])


def mqar_dataset(batch_size: int, seq_len: int, vocab_size: int,
                 num_kv_pairs: int, seed: int, num_queries: int | None = None,
                 process_index: int = 0) -> MQARIterator:
  """Endless iterator of `mqar_batch`es with get_state/set_state."""
  return MQARIterator(seed, process_index, batch_size=batch_size,
                      seq_len=seq_len, vocab_size=vocab_size,
                      num_kv_pairs=num_kv_pairs, num_queries=num_queries)
