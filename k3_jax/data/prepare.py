"""`python main.py prepare`: tokenize a text corpus once into ArrayRecord or Parquet shards.

    prepare(input, output, tokenizer="byte", fmt="arrayrecord", num_shards=8)

reads `input` (a .txt file = one document, a .jsonl file = a document per line from its
"text" field, a folder of .txt/.py/.md/.jsonl files, or a glob of them) as a stream,
tokenizes each document as the training pipeline does ([BOS] + ids + [EOS], documents of
fewer than two tokens dropped), and writes

    <output>/train-0000i-of-0000n.<array_record|parquet>   the training documents, record i
                                                           in shard i % n
    <output>/eval-00000-of-00001.<...>                     the held-out documents
    <output>/manifest.json                                 what is there (below)

Every `EVAL_EVERY`-th document (the 2nd, 52nd, 102nd, ...) is held out for evaluation, so a
corpus of two documents or more has an eval split. A corpus of chat conversations (.jsonl
lines with "messages") is stored as the messages' JSON, untokenized (kind "messages"; the
chat template renders them at training time).

The manifest records documents, tokens, shards (names, documents and tokens of each), the
format, the record kind and the tokenizer with its fingerprint (`tokenizer_fingerprint`), by
which `train --dataset=DIR` refuses a directory made with another tokenizer. The shards are
written to `<output>.partial` and moved into place at the end, so an interrupted prepare
leaves no half dataset behind; an existing output is replaced only with force=True, and only
when it is a prepared dataset.
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import json
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

from k3_jax.config import UserError
from k3_jax.data import records, tokenizers

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
EVAL_EVERY = 50
_INPUT_SUFFIXES = (".txt", ".py", ".md", ".jsonl")
# A fixed probe: how the tokenizer splits it is part of its identity (pattern, merges, ...).
_PROBE = ("Hello, World! def f(x): return x**2  # 12345\n\t 你好，世界。 Ünïcödé — "
          "don't HTTPServer 3.14159 [BOS] <|im_end|> \U0001F600")


def tokenizer_fingerprint(tok: tokenizers.Tokenizer, spec: str | None = None) -> str:
  """A short hash of the tokenizer's identity: class, vocabulary size, special ids, the ids
  of a fixed probe text and, when `spec` names a file or folder, the bytes of its files."""
  h = hashlib.sha256()
  ident = {"class": type(tok).__name__, "vocab_size": int(tok.vocab_size),
           "bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id,
           "probe": [int(i) for i in tok.encode(_PROBE)]}
  h.update(json.dumps(ident, sort_keys=True).encode())
  if spec and os.path.exists(spec):
    files = ([spec] if os.path.isfile(spec) else
             sorted(str(p) for p in pathlib.Path(spec).rglob("*")
                    if p.is_file() and "token" in p.name.lower()))
    for f in files:
      h.update(os.path.basename(f).encode())
      with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
          h.update(chunk)
  return h.hexdigest()[:16]


def input_files(spec: str) -> list[str]:
  """The files of `spec`: one file, the .txt/.py/.md/.jsonl files under a folder (sorted),
  or the files matching a glob (sorted)."""
  if os.path.isdir(spec):
    files = sorted(str(p) for p in pathlib.Path(spec).rglob("*")
                   if p.is_file() and p.suffix in _INPUT_SUFFIXES)
  elif os.path.isfile(spec):
    files = [spec]
  else:
    files = sorted(f for f in glob.glob(spec, recursive=True) if os.path.isfile(f))
    if not files and not glob.has_magic(spec):
      raise FileNotFoundError(f"--input={spec!r}: no such file or folder")
  if not files:
    raise UserError(f"--input={spec!r} matches no {'/'.join(_INPUT_SUFFIXES)} files")
  return files


def _documents(files: list[str], on_bytes: Callable[[int], None]) -> Iterator[tuple[str, object]]:
  """(kind, document) of every file, streamed: ("text", str) or ("messages", list)."""
  for path in files:
    if not path.endswith(".jsonl"):
      try:
        with open(path, encoding="utf-8") as f:
          text = f.read()
      except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
      on_bytes(os.path.getsize(path))
      if text:
        yield "text", text
      continue
    with open(path, "rb") as f:
      for line_no, raw in enumerate(f, start=1):
        on_bytes(len(raw))
        if not raw.strip():
          continue
        try:
          rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
          raise UserError(f"{path}:{line_no}: not a JSON line ({e})") from None
        if isinstance(rec, dict) and isinstance(rec.get("text"), str):
          if rec["text"]:
            yield "text", rec["text"]
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
          yield "messages", rec
        else:
          raise UserError(f"{path}:{line_no}: expected a JSON object with a 'text' string or "
                          f"a 'messages' list")


class _Progress:
  """A one-line progress bar on stderr: percent of input bytes, documents, tokens, rate."""

  def __init__(self, total_bytes: int, stream=None, every: float = 0.5):
    self.total, self.done, self.docs, self.tokens = max(total_bytes, 1), 0, 0, 0
    self.stream = stream            # None: no bar
    self.t0 = self.last = time.time()
    self.every = every

  def add_bytes(self, n: int) -> None:
    self.done += n

  def update(self, force: bool = False) -> None:
    now = time.time()
    if self.stream is None or (not force and now - self.last < self.every):
      return
    self.last = now
    frac = min(self.done / self.total, 1.0)
    bar = "#" * int(30 * frac)
    rate = self.tokens / max(now - self.t0, 1e-9)
    self.stream.write(f"\rprepare [{bar:<30}] {100 * frac:5.1f}%  {self.docs:,} documents  "
                      f"{self.tokens:,} tokens  {rate:,.0f} tokens/s")
    self.stream.flush()

  def close(self) -> None:
    self.update(force=True)
    if self.stream is not None:
      self.stream.write("\n")


def _tokenized(tok: tokenizers.Tokenizer, text: str) -> np.ndarray:
  parts = [np.array([tok.bos_id], np.int32)] if tok.bos_id is not None else []
  parts.append(tok.encode_array(text).astype(np.int32, copy=False))
  if tok.eos_id is not None:
    parts.append(np.array([tok.eos_id], np.int32))
  return np.concatenate(parts)


def _check_output(output: str, force: bool) -> None:
  if not os.path.exists(output):
    return
  if os.path.isdir(output) and not os.listdir(output):
    return
  is_prepared = os.path.isfile(os.path.join(output, MANIFEST))
  if not force:
    raise FileExistsError(f"--output={output!r} already exists; pass --force to replace it")
  if not is_prepared:
    raise FileExistsError(f"--output={output!r} exists and is not a prepared dataset (no "
                          f"{MANIFEST}); refusing to delete it even with --force")


def prepare(input: str, output: str, tokenizer: str = "byte", fmt: str = "arrayrecord",
            num_shards: int = 8, force: bool = False, progress=None) -> dict:
  """Tokenizes `input` into shards under `output` (module docstring); returns the manifest.
  progress: a stream for the progress bar (default stderr; False for none)."""
  if fmt not in records.FORMATS:
    raise UserError(f"--format={fmt!r}: expected one of {', '.join(records.FORMATS)}")
  if num_shards < 1:
    raise UserError(f"--num_shards={num_shards}: must be >= 1")
  output = os.path.normpath(output)
  _check_output(output, force)
  files = input_files(input)
  tok = tokenizers.get_tokenizer(tokenizer)
  tmp = output + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  bar = _Progress(sum(os.path.getsize(f) for f in files),
                  stream=sys.stderr if progress is None else (progress or None))
  t0 = time.time()
  kind, writers, n_seen = None, {}, 0
  tokens = {"train": [0] * num_shards, "eval": [0]}
  try:
    for doc_kind, doc in _documents(files, bar.add_bytes):
      if kind is None:
        kind = "tokens" if doc_kind == "text" else "messages"
        writers = {"train": records.ShardWriter(tmp, "train", fmt, kind, num_shards),
                   "eval": records.ShardWriter(tmp, "eval", fmt, kind, 1)}
      elif (doc_kind == "text") != (kind == "tokens"):
        raise UserError(f"--input={input!r} mixes text documents and chat conversations; "
                        f"prepare them separately")
      if kind == "tokens":
        value = _tokenized(tok, doc)
        if len(value) < 2:            # no transition to learn (as the pipeline drops them)
          continue
        count = len(value)
      else:
        value, count = doc, 0
      split = "eval" if n_seen % EVAL_EVERY == 1 else "train"
      n_seen += 1
      tokens[split][writers[split].write(value)] += count
      bar.docs, bar.tokens = bar.docs + 1, bar.tokens + count
      bar.update()
    if kind is None:
      raise UserError(f"--input={input!r} holds no non-empty documents")
    for w in writers.values():
      w.close()
  except BaseException:
    for w in writers.values():
      if w._writers:                    # pylint: disable=protected-access
        w.close()
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    bar.close()
  splits = {name: {"shards": w.files, "documents": w.counts, "tokens": tokens[name]}
            for name, w in writers.items()}
  if not splits["eval"]["documents"][0]:
    for f in writers["eval"].paths:
      os.remove(f)
    del splits["eval"]
  manifest = {
      "format_version": FORMAT_VERSION, "format": fmt, "kind": kind,
      "documents": sum(sum(s["documents"]) for s in splits.values()),
      "tokens": sum(sum(s["tokens"]) for s in splits.values()),
      "num_shards": num_shards, "splits": splits,
      "tokenizer": {"spec": tokenizer, "repr": repr(tok), "vocab_size": int(tok.vocab_size),
                    "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                    "fingerprint": tokenizer_fingerprint(tok, tokenizer)},
      "input": input, "input_files": len(files),
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "seconds": round(time.time() - t0, 3),
  }
  with open(os.path.join(tmp, MANIFEST), "w") as f:
    json.dump(manifest, f, indent=1)
  if os.path.exists(output):
    shutil.rmtree(output)               # checked above: empty, or a prepared dataset + force
  os.replace(tmp, output)
  return manifest
