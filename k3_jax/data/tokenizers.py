"""Tokenizers behind one small interface: raw UTF-8 bytes, or a tiktoken BPE.

`get_tokenizer("byte")` needs no files and is what the default (embedded)
dataset and the tests use. `get_tokenizer("/path/to/tiktoken.model")` loads the
BPE file format the Kimi tokenizers ship (one `base64(token) rank` per line).

Decoding is byte-exact where it can be: `decode_bytes` returns the raw bytes of
the ids, `decode` turns them into text with errors="replace", and
`StreamDecoder` turns a stream of ids into text pieces without ever splitting a
multi-byte UTF-8 character across two pieces (what a token streamer needs).
"""

from __future__ import annotations

import abc
import codecs
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

# Kimi-style pre-tokenizer, one alternative per line (tried in order):
#   1. runs of Han characters (CJK text is split from everything else);
#   2. a word: optional leading non-letter/digit (e.g. a space or a quote),
#      upper-case letters then lower-case ones ("Hello", "HTTPServer" splits
#      as "HTTP" + "Server"), with English contractions ('s, 't, 're, ...);
#   3. the same with the upper-case run required (all-caps words, "ABC");
#   4. numbers, at most three digits per piece ("12345" -> "123", "45");
#   5. punctuation runs with an optional leading space and trailing newlines;
#   6. whitespace ending in newlines, then trailing whitespace that is not
#      followed by a word (so " word" keeps its space), then other whitespace.
# Letters of Han script are excluded from 2-3 by a negative lookahead, which
# tiktoken's regex engine (fancy-regex) supports.
_NOT_HAN = r"(?!\p{Han})"
KIMI_STYLE_PATTERN = "|".join([
    r"\p{Han}+",
    (r"[^\r\n\p{L}\p{N}]?"
     rf"(?:{_NOT_HAN}[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}])*"
     rf"(?:{_NOT_HAN}[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}])+"
     r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"),
    (r"[^\r\n\p{L}\p{N}]?"
     rf"(?:{_NOT_HAN}[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}])+"
     rf"(?:{_NOT_HAN}[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}])*"
     r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"),
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# Special-token names looked up (in order) when ids are not given explicitly.
_BOS_NAMES = ("[BOS]", "<|begin_of_text|>", "<|bos|>", "<s>")
_EOS_NAMES = ("[EOS]", "<|end_of_text|>", "<|endoftext|>", "<|eos|>", "</s>")
_PAD_NAMES = ("[PAD]", "<|pad|>", "<pad>")


class Tokenizer(abc.ABC):
  """Text <-> token ids. `bos_id`, `eos_id` and `pad_id` may be None."""

  vocab_size: int
  bos_id: int | None = None
  eos_id: int | None = None
  pad_id: int | None = None

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special-token names in `text` are plain text."""

  @abc.abstractmethod
  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    """The raw bytes the ids stand for (may end inside a UTF-8 character)."""

  def encode_array(self, text: str) -> np.ndarray:
    """`encode` as an int32 array [T] (overridden where it is faster)."""
    return np.asarray(self.encode(text), dtype=np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of the ids; invalid UTF-8 becomes U+FFFD."""
    return self.decode_bytes(_as_int_list(ids)).decode("utf-8", errors="replace")

  def stream_decoder(self) -> "StreamDecoder":
    return StreamDecoder(self)


class StreamDecoder:
  """Turns ids arriving one (or a few) at a time into text, incrementally.

  Bytes of a multi-byte character split across tokens are held back until the
  character is complete, so concatenating the returned pieces equals
  `tokenizer.decode(all_ids)`.
  """

  def __init__(self, tokenizer: Tokenizer):
    self._tokenizer = tokenizer
    self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def add(self, ids: int | Iterable[int]) -> str:
    """Feeds ids; returns the text that is now complete (maybe '')."""
    if isinstance(ids, (int, np.integer)):
      ids = [int(ids)]
    return self._decoder.decode(self._tokenizer.decode_bytes(_as_int_list(ids)))

  def flush(self) -> str:
    """Returns what is left (an incomplete character becomes U+FFFD)."""
    return self._decoder.decode(b"", final=True)


class ByteTokenizer(Tokenizer):
  """Raw UTF-8 bytes: ids 0..255, vocab_size 256.

  The NUL byte (id 0) doubles as end-of-document: it does not occur in source
  or prose text, so it is free to mark document ends when packing. There is no
  BOS and no pad id (padding is marked by segment id 0, not by a token).
  """

  vocab_size = 256
  bos_id = None
  eos_id = 0
  pad_id = None

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_array(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    ids = _as_int_list(ids)
    bad = [i for i in ids if not 0 <= i < 256]
    if bad:
      raise ValueError(f"ByteTokenizer ids must be in [0, 256); got {bad[:5]}")
    return bytes(ids)

  def __repr__(self) -> str:
    return "ByteTokenizer()"


class TiktokenTokenizer(Tokenizer):
  """A tiktoken BPE (e.g. Kimi's `tiktoken.model`) with optional special tokens."""

  def __init__(self, encoding, *, bos_id: int | None = None,
               eos_id: int | None = None, pad_id: int | None = None,
               vocab_size: int | None = None):
    self._encoding = encoding
    self.vocab_size = int(vocab_size or encoding.n_vocab)
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

  @classmethod
  def from_file(cls, path: str | os.PathLike,
                special_tokens: Mapping[str, int] | None = None,
                pattern: str | None = None, *,
                bos_token: str | None = None, eos_token: str | None = None,
                pad_token: str | None = None,
                vocab_size: int | None = None) -> "TiktokenTokenizer":
    """Loads a BPE file of `base64(token) rank` lines.

    Args:
      path: the BPE file.
      special_tokens: name -> id, e.g. {"[BOS]": 163584, "[EOS]": 163585}; ids
        must not collide with BPE ranks. Default: none.
      pattern: pre-tokenizer regex; default `KIMI_STYLE_PATTERN`.
      bos_token, eos_token, pad_token: names (keys of `special_tokens`) of the
        BOS/EOS/pad tokens; default: the first common name found
        ("[BOS]", "[EOS]", "[PAD]", "<|endoftext|>", ...), else None.
      vocab_size: the model's vocabulary size when larger than the tokenizer's
        (reserved ids); default: largest id + 1.
    """
    import tiktoken  # pylint: disable=g-import-not-at-top
    from tiktoken import load as tiktoken_load  # pylint: disable=g-import-not-at-top

    path = os.fspath(path)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer file not found: {path!r}")
    ranks = tiktoken_load.load_tiktoken_bpe(path)
    special = dict(special_tokens or {})
    clash = sorted(set(special.values()) & set(ranks.values()))
    if clash:
      raise ValueError(f"special token ids {clash[:5]} collide with BPE ranks in {path}")
    encoding = tiktoken.Encoding(
        name=os.path.basename(path), pat_str=pattern or KIMI_STYLE_PATTERN,
        mergeable_ranks=ranks, special_tokens=special)

    def pick(name: str | None, defaults: Sequence[str], role: str) -> int | None:
      if name is not None:
        if name not in special:
          raise ValueError(f"{role}={name!r} is not in special_tokens {sorted(special)}")
        return special[name]
      return next((special[n] for n in defaults if n in special), None)

    return cls(encoding,
               bos_id=pick(bos_token, _BOS_NAMES, "bos_token"),
               eos_id=pick(eos_token, _EOS_NAMES, "eos_token"),
               pad_id=pick(pad_token, _PAD_NAMES, "pad_token"),
               vocab_size=vocab_size)

  def encode(self, text: str) -> list[int]:
    return self._encoding.encode_ordinary(text)

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    return self._encoding.decode_bytes(_as_int_list(ids))

  def __repr__(self) -> str:
    return f"TiktokenTokenizer({self._encoding.name!r}, vocab_size={self.vocab_size})"


def get_tokenizer(spec: str, **kwargs) -> Tokenizer:
  """"byte" -> ByteTokenizer; anything else is a tiktoken BPE file path.

  Extra keyword arguments go to `TiktokenTokenizer.from_file`.
  """
  if spec == "byte":
    if kwargs:
      raise ValueError(f"the byte tokenizer takes no options; got {sorted(kwargs)}")
    return ByteTokenizer()
  if not os.path.isfile(spec):
    raise FileNotFoundError(
        f"tokenizer {spec!r}: no such file (use 'byte' or the path of a "
        "tiktoken BPE file)")
  return TiktokenTokenizer.from_file(spec, **kwargs)


def _as_int_list(ids: Iterable[int]) -> list[int]:
  if isinstance(ids, np.ndarray):
    return ids.astype(np.int64).reshape(-1).tolist()
  return [int(i) for i in ids]
