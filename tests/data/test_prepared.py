"""Prepared datasets: ArrayRecord / Parquet sources, `prepare` (shards + manifest), and the
reader `train --dataset=DIR` uses: every transition read once per epoch, the same global
batches for 1 or 2 processes (each opening only its shards), exact resume, and refusal of a
directory made with another tokenizer."""

import base64
import collections
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import configs
from k3_jax.config import UserError
from k3_jax.data import datasets, prepare, prepared, records, tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = tokenizers.ByteTokenizer()
SEQ, BATCH = 32, 8
WIN = 64          # a smaller window-shuffle buffer than training's: a faster first batch


def _docs(n=120, seed=0):
  rng = np.random.default_rng(seed)
  return [f"<{i}>" + "".join(chr(ord("a") + int(c)) for c in
                             rng.integers(0, 26, int(rng.choice([2, 9, 30, 70, 150]))))
          + "é" for i in range(n)]


def _ids(doc):
  return tuple(TOK.encode(doc) + [TOK.eos_id])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  d = tmp_path_factory.mktemp("corpus")
  path = d / "c.jsonl"
  docs = _docs()
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
  out = {"docs": docs, "path": str(path)}
  for fmt in records.FORMATS:
    out[fmt] = str(d / fmt)
    prepare.prepare(str(path), out[fmt], "byte", fmt, num_shards=8, progress=False)
  return out


@pytest.mark.parametrize("fmt", records.FORMATS)
def test_prepare_writes_every_document_once_with_a_manifest(corpus, fmt):
  m = prepared.load_manifest(corpus[fmt])
  assert m["format"] == fmt and m["kind"] == "tokens" and m["num_shards"] == 8
  assert m["documents"] == len(corpus["docs"])
  assert m["tokens"] == sum(len(_ids(t)) for t in corpus["docs"])
  assert m["tokenizer"]["fingerprint"] == prepare.tokenizer_fingerprint(TOK, "byte")
  got = collections.Counter()
  for split, info in m["splits"].items():
    src = records.open_source(fmt, prepared.shard_paths(corpus[fmt], m, split), "tokens")
    assert len(src) == sum(info["documents"])
    assert sum(len(src[i]) for i in range(len(src))) == sum(info["tokens"])
    got.update(tuple(src[i].tolist()) for i in range(len(src)))
  assert got == collections.Counter(_ids(t) for t in corpus["docs"])
  # every 50th document (from the 2nd) is held out
  assert m["splits"]["eval"]["documents"] == [len(range(1, len(corpus["docs"]), 50))]


@pytest.mark.parametrize("fmt", records.FORMATS)
def test_one_epoch_reads_every_transition_once(corpus, fmt):
  m = prepared.load_manifest(corpus[fmt])
  it = prepared.PreparedIterator(corpus[fmt], SEQ, BATCH, seed=0, shuffle_window=WIN,
                                 num_epochs=1)
  assert it.streams == 8
  total = sum(float(b["loss_mask"].sum()) for b in it)
  train = m["splits"]["train"]
  assert total == sum(train["tokens"]) - sum(train["documents"])


@pytest.mark.parametrize("fmt", records.FORMATS)
def test_two_processes_read_their_shards_and_make_the_same_global_batches(corpus, fmt):
  one = prepared.PreparedIterator(corpus[fmt], SEQ, BATCH, seed=5, shuffle_window=WIN)
  two = [prepared.PreparedIterator(corpus[fmt], SEQ, BATCH, seed=5, shuffle_window=WIN,
                                   process_index=p, process_count=2) for p in range(2)]
  files = [{os.path.basename(f) for f in it.shard_files} for it in two]
  assert not files[0] & files[1] and len(files[0]) == len(files[1]) == 4
  for _ in range(5):
    want, got = next(one), [next(it) for it in two]
    for k in want:
      np.testing.assert_array_equal(want[k], np.concatenate([g[k] for g in got]))
  # the global state is the union of the processes' stream states
  merged = {**two[0].get_state()["streams"], **two[1].get_state()["streams"]}
  assert merged == one.get_state()["streams"]


def test_resume_is_exact_on_the_same_or_another_process_count(corpus):
  d = corpus["arrayrecord"]
  one = prepared.PreparedIterator(d, SEQ, BATCH, seed=1, shuffle_window=WIN)
  for _ in range(3):
    next(one)
  state = json.loads(json.dumps(one.get_state()))      # as a checkpoint stores it
  want = [next(one) for _ in range(3)]
  again = prepared.PreparedIterator(d, SEQ, BATCH, seed=1, shuffle_window=WIN)
  again.set_state(state)
  half = prepared.PreparedIterator(d, SEQ, BATCH, seed=1, shuffle_window=WIN,
                                   process_index=1, process_count=2)
  half.set_state(state)
  for w in want:
    g = next(again)
    h = next(half)
    for k in w:
      np.testing.assert_array_equal(w[k], g[k])
      np.testing.assert_array_equal(w[k][BATCH // 2:], h[k])
  other = prepared.PreparedIterator(d, SEQ, BATCH, seed=2, shuffle_window=WIN)
  with pytest.raises(ValueError, match="different pipeline"):
    other.set_state(state)


def test_too_few_streams_for_the_processes_is_refused(corpus):
  with pytest.raises(UserError, match="cannot share evenly"):   # gcd(8 shards, 6 rows) = 2
    prepared.PreparedIterator(corpus["parquet"], SEQ, 6, seed=0, shuffle_window=WIN,
                              process_index=0, process_count=3)


def test_a_stream_without_documents_is_refused(tmp_path):
  path = tmp_path / "one.txt"
  path.write_text("a single document")
  prepare.prepare(str(path), str(tmp_path / "ds"), num_shards=2, progress=False)
  with pytest.raises(UserError, match=r"stream\(s\) \[1\] of 2 without a document"):
    prepared.PreparedIterator(str(tmp_path / "ds"), SEQ, BATCH, seed=0)


def test_train_data_reads_a_prepared_dir_and_refuses_another_tokenizer(corpus, tmp_path):
  cfg = configs.get("k3_tiny")
  tc = dataclasses.replace(configs.get_train("k3_tiny"), dataset=corpus["parquet"],
                           batch_size=BATCH, seq_len=SEQ, eval_batches=2)
  it, evals = datasets.train_data(cfg, tc, 0, 1)
  assert isinstance(it, prepared.PreparedIterator)
  assert next(it)["inputs"].shape == (BATCH, SEQ)
  assert 1 <= len(evals) <= 2 and evals[0]["loss_mask"].sum() > 0   # 3 eval documents
  bpe = tmp_path / "tiktoken.model"
  bpe.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
  with pytest.raises(UserError) as e:
    datasets.train_data(cfg, dataclasses.replace(tc, tokenizer=str(bpe)), 0, 1)
  msg = str(e.value)
  assert "\n" not in msg and "was prepared with tokenizer 'byte'" in msg and str(bpe) in msg


def test_sources_read_text_and_messages_columns(tmp_path):
  chats = [{"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello é"}]},
           {"messages": [{"role": "user", "content": "2+2?"}]}]
  texts = ["one", "twö", "three"]
  for fmt in records.FORMATS:
    with records.ShardWriter(str(tmp_path / fmt), "t", fmt, "text", 2) as w:
      for t in texts:
        w.write(t)
    src = records.open_source(fmt, w.paths, "text")
    assert [src[i] for i in range(len(src))] == ["one", "three", "twö"]  # shard 0, then 1
    with records.ShardWriter(str(tmp_path / fmt), "m", fmt, "messages", 1) as w:
      for c in chats:
        w.write(c["messages"])
    src = records.open_source(fmt, w.paths, "messages")
    assert [json.loads(src[i]) for i in range(len(src))] == [c["messages"] for c in chats]
  # a user's Parquet file: a list<struct> messages column and a text column by name
  import pyarrow as pa
  import pyarrow.parquet as pq
  path = str(tmp_path / "user.parquet")
  pq.write_table(pa.table({"body": ["a", "b"], "messages": [c["messages"] for c in chats]}),
                 path)
  assert records.ParquetSource([path], column="body", kind="text")[1] == "b"
  assert json.loads(records.ParquetSource([path], kind="messages")[0]) == chats[0]["messages"]
  with pytest.raises(ValueError, match="no column 'text'"):
    records.ParquetSource([path], kind="text")


def test_prepare_keeps_chat_conversations_as_json(tmp_path):
  path = tmp_path / "chats.jsonl"
  conv = {"messages": [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "hello"}]}
  path.write_text(json.dumps(conv) + "\n" + json.dumps(conv) + "\n")
  m = prepare.prepare(str(path), str(tmp_path / "out"), fmt="parquet", num_shards=1,
                      progress=False)
  assert m["kind"] == "messages" and m["documents"] == 2
  src = records.open_source("parquet", prepared.shard_paths(str(tmp_path / "out"), m, "train"),
                            "messages")
  assert json.loads(src[0]) == conv
  with pytest.raises(UserError, match="holds 'messages' records"):
    prepared.PreparedIterator(str(tmp_path / "out"), SEQ, 1, seed=0)


def test_prepare_cli_refuses_to_overwrite_without_force(corpus, tmp_path):
  out = str(tmp_path / "ds")
  cmd = [sys.executable, os.path.join(ROOT, "main.py"), "prepare", f"--input={corpus['path']}",
         f"--output={out}", "--format=parquet", "--num_shards=2"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
  assert first.returncode == 0, first.stderr
  assert "100.0%" in first.stderr and f"--dataset={out}" in first.stdout
  again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
  assert again.returncode == 2
  assert again.stderr.strip().splitlines() == [
      f"error: --output={out!r} already exists; pass --force to replace it"]
  forced = subprocess.run(cmd[:-1] + ["--num_shards=3", "--force"], capture_output=True,
                          text=True, env=env, cwd=ROOT)
  assert forced.returncode == 0, forced.stderr
  assert prepared.load_manifest(out)["num_shards"] == 3
  assert sorted(os.listdir(out)) == sorted(
      ["manifest.json", "eval-00000-of-00001.parquet"] +
      [f"train-{i:05d}-of-00003.parquet" for i in range(3)])
