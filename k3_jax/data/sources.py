"""Document sources: the embedded default corpus and user-given text files.

The default corpus needs no download: it is the Python standard library's own
`.py` sources of the running interpreter (about 580 files, 11 MB on CPython
3.11). Left out: site-packages, every `test`/`tests` directory (large, full of
odd encodings and generated data), and the demo/tool packages idlelib,
turtledemo and lib2to3. Files that are not valid UTF-8 or are empty are
skipped. Documents are sorted by relative path and split into train/eval by a
stable hash of that path (`EVAL_FRACTION` go to eval), so the split does not
depend on the machine, the file order on disk, or PYTHONHASHSEED.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import sysconfig

from k3_jax.config import UserError

EVAL_FRACTION = 0.02
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests",
                        "idlelib", "turtledemo", "lib2to3", "__pycache__"})
_TEXT_SUFFIXES = (".txt", ".py", ".md")


def stdlib_root() -> pathlib.Path:
  """Directory of the running interpreter's standard library."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _stdlib_named_documents() -> tuple[tuple[str, str], ...]:
  root = stdlib_root()
  docs = []
  for path in root.rglob("*.py"):
    rel = path.relative_to(root)
    if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
      continue
    text = _read_utf8(path)
    if text:
      docs.append((rel.as_posix(), text))
  docs.sort()
  if not docs:
    raise FileNotFoundError(f"no standard library .py files found under {root}")
  return tuple(docs)


def is_eval_name(name: str, eval_fraction: float = EVAL_FRACTION) -> bool:
  """Stable split: the first 8 bytes of sha256(name) as a fraction in [0, 1)."""
  digest = hashlib.sha256(name.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64 < eval_fraction


def stdlib_named_documents(split: str) -> list[tuple[str, str]]:
  """(relative path, text) of the stdlib documents of `split` ("train"/"eval")."""
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  want_eval = split == "eval"
  return [(n, t) for n, t in _stdlib_named_documents() if is_eval_name(n) == want_eval]


def stdlib_documents(split: str) -> list[str]:
  """Texts of the stdlib documents of `split` ("train" or "eval"), sorted by path."""
  return [text for _, text in stdlib_named_documents(split)]


def text_documents(path: str | os.PathLike) -> list[str]:
  """Documents from a user path.

  - a `.jsonl` file: one document per line, from its "text" field;
  - any other file (e.g. `.txt`): the whole file is one document;
  - a directory: every .txt/.py/.md file under it (recursive, sorted by
    relative path), one document each; undecodable files are skipped.

  Raises FileNotFoundError if `path` does not exist and ValueError if it holds
  no non-empty document.
  """
  p = pathlib.Path(path)
  if not p.exists():
    raise FileNotFoundError(f"data path not found: {str(p)!r}")
  if p.is_dir():
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _TEXT_SUFFIXES)
    docs = [t for t in (_read_utf8(f) for f in files) if t]
  elif p.suffix == ".jsonl":
    docs = _jsonl_texts(p)
  else:
    try:
      text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
      raise UserError(f"data file {str(p)!r} is not UTF-8 text (byte {e.start}: "
                       f"{e.reason}); convert it to UTF-8") from None
    docs = [text] if text else []
  if not docs:
    kinds = "/".join(_TEXT_SUFFIXES)
    raise UserError(f"data path {str(p)!r} holds no non-empty documents "
                     f"(expected a .txt/.jsonl file or a folder of {kinds} files)")
  return docs


def _jsonl_texts(path: pathlib.Path) -> list[str]:
  docs = []
  try:
    with path.open(encoding="utf-8") as f:
      lines = list(f)
  except UnicodeDecodeError as e:
    raise UserError(f"data file {str(path)!r} is not UTF-8 text (byte {e.start}: "
                     f"{e.reason}); convert it to UTF-8") from None
  for line_no, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      text = record["text"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise UserError(f"{path}:{line_no}: expected a JSON object with a "
                      f"'text' field ({type(e).__name__}: {e})") from e
    if not isinstance(text, str):
      raise UserError(f"{path}:{line_no}: 'text' must be a string, "
                      f"got {type(text).__name__}")
    if text:
      docs.append(text)
  return docs


def _read_utf8(path: pathlib.Path) -> str | None:
  try:
    return path.read_text(encoding="utf-8")
  except (UnicodeDecodeError, OSError):
    return None


def size_warnings(name: str, train_docs: list[str], eval_docs: list[str], tokenizer,
                  seq_len: int) -> list[str]:
  """Warnings for a dataset too small to train or evaluate on meaningfully: fewer tokens
  than one sequence (seq_len + 1), or no held-out documents (no eval_loss)."""
  out = []
  # Any tokenizer here yields at most one token per UTF-8 byte (plus BOS/EOS), so only a
  # small dataset needs tokenizing to know.
  nbytes = sum(len(d.encode("utf-8")) for d in train_docs)
  if nbytes <= 4 * (seq_len + 1):
    ntok = sum(len(tokenizer.encode(d)) + 2 for d in train_docs)
    if ntok < seq_len + 1:
      out.append(f"dataset {name!r} holds about {ntok} tokens, fewer than one sequence "
                 f"(seq_len + 1 = {seq_len + 1}): every batch repeats it, mostly padding")
  if not eval_docs:
    out.append(f"dataset {name!r} has too few documents to hold one out for evaluation; "
               f"eval_loss will not be reported")
  return out
