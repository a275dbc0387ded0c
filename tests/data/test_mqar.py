"""Synthetic multi-query associative recall batches."""

import json

import numpy as np
import pytest

from k3_jax.data import mqar

KW = dict(batch_size=8, seq_len=64, vocab_size=128, num_kv_pairs=8)


def test_format_and_recall_answers_are_recoverable():
  b = mqar.mqar_batch(np.random.default_rng(0), **KW)
  B, S, N = KW["batch_size"], KW["seq_len"], KW["num_kv_pairs"]
  assert {k: v.shape for k, v in b.items()} == {k: (B, S) for k in b}
  assert b["inputs"].dtype == np.int32 and b["loss_mask"].dtype == np.float32
  assert np.all(b["segment_ids"] == 1)
  keys_range, values_range = mqar.key_value_ranges(KW["vocab_size"])
  for inp, tgt, mask in zip(b["inputs"], b["targets"], b["loss_mask"]):
    keys, values = inp[0:2 * N:2], inp[1:2 * N:2]
    assert len(set(keys.tolist())) == N
    assert all(k in keys_range for k in keys) and all(v in values_range for v in values)
    table = dict(zip(keys.tolist(), values.tolist()))
    pos = np.flatnonzero(mask)
    assert len(pos) == N and np.all(pos >= 2 * N)  # every key queried, after the context
    for t in pos:
      assert tgt[t] == table[int(inp[t])]  # the target is the recalled value
      if t + 1 < S:
        assert inp[t + 1] == tgt[t]
    assert sorted(inp[pos].tolist()) == sorted(keys.tolist())
    rest = np.ones(S, bool)
    rest[:2 * N] = False
    rest[pos] = False
    rest[pos[pos + 1 < S] + 1] = False
    assert np.all(inp[rest] == 0)  # everything else is filler


def test_fewer_queries():
  b = mqar.mqar_batch(np.random.default_rng(1), num_queries=3, **KW)
  assert np.all(b["loss_mask"].sum(axis=1) == 3)


def test_dataset_deterministic_and_resumable():
  a = mqar.mqar_dataset(seed=4, **KW)
  first = [next(a) for _ in range(3)]
  state = json.loads(json.dumps(a.get_state()))
  expected = [next(a) for _ in range(3)]
  b = mqar.mqar_dataset(seed=4, **KW)
  np.testing.assert_array_equal(next(b)["inputs"], first[0]["inputs"])
  b.set_state(state)
  for x, y in zip(expected, [next(b) for _ in range(3)]):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  c = mqar.mqar_dataset(seed=5, **KW)
  assert not np.array_equal(next(c)["inputs"], first[0]["inputs"])


def test_too_short_sequence_is_an_error():
  with pytest.raises(ValueError, match="seq_len"):
    mqar.mqar_batch(np.random.default_rng(0), batch_size=1, seq_len=10,
                    vocab_size=128, num_kv_pairs=8)
