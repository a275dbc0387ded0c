"""Packed grain pipeline and document sources."""

import collections
import json

import numpy as np
import pytest

from k3_jax.data import pipeline, sources, tokenizers

TOK = tokenizers.ByteTokenizer()
SEQ, BATCH = 32, 4


def make_docs(n=60, seed=0):
  """Documents of varied length (some longer than a row), distinct content."""
  rng = np.random.default_rng(seed)
  docs = []
  for i in range(n):
    length = int(rng.choice([3, 10, 25, 40, 90]))
    body = "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, length))
    docs.append(f"<{i}>{body}é")  # includes a 2-byte character
  return docs


def expected_windows(docs, seq_len=SEQ):
  """Multiset of the windows the pipeline must produce from `docs`."""
  out = collections.Counter()
  for doc in docs:
    ids = TOK.encode(doc) + [TOK.eos_id]
    for start in range(0, len(ids) - 1, seq_len):
      out[tuple(ids[start:start + seq_len + 1])] += 1
  return out


def check_and_collect_windows(batches):
  """Checks the batch invariants and returns the windows (pieces) seen."""
  seen = collections.Counter()
  for b in batches:
    assert set(b) == set(pipeline.BATCH_KEYS)
    assert b["inputs"].shape == b["targets"].shape == (BATCH, SEQ)
    assert b["inputs"].dtype == b["targets"].dtype == b["segment_ids"].dtype == np.int32
    assert b["loss_mask"].dtype == np.float32
    for inp, tgt, seg, mask in zip(b["inputs"], b["targets"], b["segment_ids"], b["loss_mask"]):
      # Segment ids: 1, 2, ... contiguous, then padding 0 at the end only.
      real = seg[seg > 0]
      assert np.all(np.diff(seg[: len(real)]) >= 0) and np.all(seg[len(real):] == 0)
      np.testing.assert_array_equal(np.unique(real), np.arange(1, real.max() + 1) if len(real) else [])
      assert np.all(mask[seg == 0] == 0) and np.all(inp[seg == 0] == 0)
      assert np.all(tgt[mask == 0] == 0)
      for s in np.unique(real):
        pos = np.flatnonzero(seg == s)
        # No target crosses a boundary: inside a segment a target is the next
        # input; only the segment's last position may be unmasked.
        np.testing.assert_array_equal(tgt[pos[:-1]], inp[pos[1:]])
        assert np.all(mask[pos[:-1]] == 1)
        window = [int(inp[pos[0]])] + [int(t) for t in tgt[pos][mask[pos] == 1]]
        if pos[-1] < SEQ - 1:  # the next position is another segment / padding
          assert mask[pos[-1]] == 0
        seen[tuple(window)] += 1
  return seen


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for k in pipeline.BATCH_KEYS:
      np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_epoch_packs_every_window_once(shuffle):
  docs = make_docs()
  it = pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=3, shuffle=shuffle, num_epochs=1)
  batches = list(it)
  assert check_and_collect_windows(batches) == expected_windows(docs)
  # Every next-token transition of every document is a target exactly once.
  n_transitions = sum(len(d.encode()) for d in docs)  # len(ids + eos) - 1
  assert sum(int(b["loss_mask"].sum()) for b in batches) == n_transitions


def test_two_epochs_reshuffle():
  docs = make_docs()
  it = pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=3, num_epochs=2)
  batches = list(it)
  want = expected_windows(docs)
  assert check_and_collect_windows(batches) == want + want


def test_deterministic_and_seed_dependent():
  docs = make_docs()
  a = take(pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=7), 6)
  b = take(pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=7), 6)
  c = take(pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=8), 6)
  assert_batches_equal(a, b)
  assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))


def test_host_shards_are_disjoint_and_cover():
  docs = make_docs(61)
  per_host = []
  for p in range(3):
    it = pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=1, num_epochs=1,
                               process_index=p, process_count=3)
    per_host.append(check_and_collect_windows(list(it)))
  for i in range(3):
    for j in range(i + 1, 3):
      assert not set(per_host[i]) & set(per_host[j])
  assert sum(per_host, collections.Counter()) == expected_windows(docs)


def test_resume_from_state_is_exact():
  docs = make_docs()
  it = pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=5)
  take(it, 5)  # mid-epoch, mid packed group
  state = json.loads(json.dumps(it.get_state()))  # must survive JSON
  expected = take(it, 40)  # crosses epoch boundaries (about 12 batches each)
  resumed = pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=5)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 40), expected)


def test_state_from_other_pipeline_is_rejected():
  docs = make_docs()
  state = pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=5).get_state()
  other = pipeline.make_dataset(docs, TOK, SEQ, BATCH, seed=6)
  with pytest.raises(ValueError, match="different pipeline"):
    other.set_state(state)


def test_long_document_split_into_windows():
  doc = "x" * (3 * SEQ + 5)
  batches = list(pipeline.make_dataset([doc], TOK, SEQ, BATCH, seed=0, shuffle=False, num_epochs=1))
  assert check_and_collect_windows(batches) == expected_windows([doc])
  assert sum(int(b["loss_mask"].sum()) for b in batches) == len(doc)


def test_eval_batches_fixed_and_padded():
  docs = make_docs(10)
  a = pipeline.eval_batches(docs, TOK, SEQ, BATCH, num_batches=100)
  b = pipeline.eval_batches(docs, TOK, SEQ, BATCH, num_batches=100)
  assert_batches_equal(a, b)
  assert 0 < len(a) < 100  # ran out of documents: one pass only
  assert check_and_collect_windows(a) == expected_windows(docs)
  assert len(pipeline.eval_batches(docs, TOK, SEQ, BATCH, num_batches=2)) == 2


def test_bad_arguments():
  with pytest.raises(ValueError, match="process_index"):
    pipeline.make_dataset(["a"], TOK, SEQ, BATCH, seed=0, process_index=1, process_count=1)
  with pytest.raises(ValueError, match="seq_len"):
    pipeline.make_dataset(["a"], TOK, 0, BATCH, seed=0)


def test_stdlib_split_deterministic_disjoint_nonempty():
  train = sources.stdlib_named_documents("train")
  evals = sources.stdlib_named_documents("eval")
  assert len(train) > 100 and len(evals) > 0
  names_train, names_eval = [n for n, _ in train], [n for n, _ in evals]
  assert not set(names_train) & set(names_eval)
  assert names_train == sorted(names_train)
  assert not any("site-packages" in n or n.startswith("test/") for n in names_train)
  assert sources.stdlib_documents("eval") == [t for _, t in evals]
  assert all(sources.is_eval_name(n) for n in names_eval)
  with pytest.raises(ValueError):
    sources.stdlib_documents("validation")


def test_stdlib_pipeline_first_batch():
  docs = sources.stdlib_documents("train")
  batch = next(pipeline.make_dataset(docs, TOK, 256, 8, seed=0))
  assert batch["inputs"].shape == (8, 256)
  assert batch["loss_mask"].mean() > 0.9  # little padding


def test_text_documents(tmp_path):
  (tmp_path / "a.txt").write_text("plain text")
  (tmp_path / "d.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
  folder = tmp_path / "folder"
  (folder / "sub").mkdir(parents=True)
  (folder / "x.md").write_text("# md")
  (folder / "sub" / "y.py").write_text("print(1)")
  (folder / "skip.bin").write_bytes(b"\x00\x01")
  assert sources.text_documents(tmp_path / "a.txt") == ["plain text"]
  assert sources.text_documents(tmp_path / "d.jsonl") == ["one", "two"]
  assert sources.text_documents(folder) == ["print(1)", "# md"]  # sorted by path
  with pytest.raises(FileNotFoundError, match="missing"):
    sources.text_documents(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="no non-empty"):
    sources.text_documents(tmp_path / "empty")
  (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
  with pytest.raises(ValueError, match="bad.jsonl:1"):
    sources.text_documents(tmp_path / "bad.jsonl")


def test_eval_batches_spread_over_all_documents():
  docs = [f"{i:02d}" * (3 * SEQ) for i in range(20)]          # long, distinct documents
  batches = pipeline.eval_batches(docs, TOK, SEQ, BATCH, num_batches=1)
  firsts = {bytes(row[:2].astype(np.uint8)).decode() for row in batches[0]["inputs"]}
  # One batch of BATCH rows drawn evenly over 20 documents: every row from another document.
  assert len(firsts) == BATCH
