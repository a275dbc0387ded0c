"""Tokenizers behind one small interface: raw UTF-8 bytes, or a tiktoken BPE.

`get_tokenizer("byte")` needs no files and is what the default (embedded)
dataset and the tests use. `get_tokenizer("/path/to/tiktoken.model")` loads the
BPE file format the Kimi tokenizers ship (one `base64(token) rank` per line).
`get_tokenizer(DIR)` loads a model directory's tokenizer (load_tokenizer_dir):
Kimi's `tiktoken.model` + `tokenizer_config.json` (special tokens and their
ids), else a Hugging Face `tokenizer.json` (the `tokenizers` library).
`save_hf_tokenizer` writes a tokenizer in a form transformers' AutoTokenizer
loads (what `convert` puts into an export).

An id that no token names (a reserved id, or one past the tokenizer's table
that the model's larger vocabulary still has) decodes to the placeholder text
`<|reserved_token_N|>` rather than raising, so a server never fails on what a
model sampled; `check_covers` refuses, in one line, a model whose vocabulary
and tokenizer disagree.

Decoding is byte-exact where it can be: `decode_bytes` returns the raw bytes of
the ids, `decode` turns them into text with errors="replace", and
`StreamDecoder` turns a stream of ids into text pieces without ever splitting a
multi-byte UTF-8 character across two pieces (what a token streamer needs).
"""

from __future__ import annotations

import abc
import codecs
import json
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

# The K3 pre-tokenizer regex exactly as the K3 tokenizer (= Kimi K2's) states it
# (docs/architecture.md section 9): the Han exclusion written as a class
# intersection, which both tiktoken (fancy-regex) and `tokenizers` (Oniguruma)
# accept; the pieces equal KIMI_STYLE_PATTERN's.
K3_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# K3's special tokens at their released ids (ids below 163584 are BPE ranks; the
# ids between the named ones are `<|reserved_token_N|>`, N = the id).
K3_NUM_BASE_TOKENS = 163_584
K3_VOCAB_SIZE = 163_840
KIMI_SPECIAL_TOKENS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|end_of_msg|>": 163586, "<|open|>": 163587,
    "<|close|>": 163588, "<|sep|>": 163589, "[start_header_id]": 163590,
    "[end_header_id]": 163591, "[EOT]": 163593, "<|media_begin|>": 163602,
    "<|media_content|>": 163603, "<|media_end|>": 163604, "<|media_pad|>": 163605,
    "[UNK]": 163838, "[PAD]": 163839,
}


def reserved_name(i: int) -> str:
  """The placeholder text of an id no token names."""
  return f"<|reserved_token_{i}|>"


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
  special_tokens: Mapping[str, int] = {}     # name -> id of the special tokens
  source: str | None = None                  # the file or directory it was loaded from

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
    bad = [i for i in ids if i < 0]
    if bad:
      raise ValueError(f"token ids must be >= 0; got {bad[:5]}")
    if all(i < 256 for i in ids):
      return bytes(ids)
    return b"".join(bytes([i]) if i < 256 else reserved_name(i).encode() for i in ids)

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
    self.special_tokens = dict(encoding._special_tokens)   # pylint: disable=protected-access
    self._known = encoding.n_vocab
    self._decodable = (set(encoding._mergeable_ranks.values())   # pylint: disable=protected-access
                       | set(self.special_tokens.values()))

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

    tok = cls(encoding,
              bos_id=pick(bos_token, _BOS_NAMES, "bos_token"),
              eos_id=pick(eos_token, _EOS_NAMES, "eos_token"),
              pad_id=pick(pad_token, _PAD_NAMES, "pad_token"),
              vocab_size=vocab_size)
    tok.source = path
    return tok

  @property
  def ranks(self) -> dict[bytes, int]:
    return self._encoding._mergeable_ranks      # pylint: disable=protected-access

  @property
  def pattern(self) -> str:
    return self._encoding._pat_str              # pylint: disable=protected-access

  def encode(self, text: str) -> list[int]:
    return self._encoding.encode_ordinary(text)

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    ids = _as_int_list(ids)
    if all(i in self._decodable for i in ids):
      return self._encoding.decode_bytes(ids)
    return b"".join(self._encoding.decode_bytes([i]) if i in self._decodable
                    else reserved_name(i).encode() for i in ids)

  def __repr__(self) -> str:
    return f"TiktokenTokenizer({self._encoding.name!r}, vocab_size={self.vocab_size})"


def get_tokenizer(spec: str, **kwargs) -> Tokenizer:
  """"byte" -> ByteTokenizer; a directory -> load_tokenizer_dir; a file
  (`tokenizer.json`, else a tiktoken BPE file) -> that tokenizer.

  Extra keyword arguments go to `TiktokenTokenizer.from_file`.
  """
  if spec == "byte":
    if kwargs:
      raise ValueError(f"the byte tokenizer takes no options; got {sorted(kwargs)}")
    return ByteTokenizer()
  if os.path.isdir(spec):
    return load_tokenizer_dir(spec)
  if not os.path.isfile(spec):
    raise FileNotFoundError(
        f"tokenizer {spec!r}: no such file or directory (use 'byte', a model directory "
        "with tiktoken.model or tokenizer.json, or the path of a tiktoken BPE file)")
  if os.path.basename(spec) == "tokenizer.json":
    return HFTokenizer.from_dir(os.path.dirname(spec) or ".")
  return TiktokenTokenizer.from_file(spec, **kwargs)


# ----- model directories ------------------------------------------------------------------

TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json")


def _byte_to_unicode() -> dict[int, str]:
  """GPT-2's byte-level alphabet: each byte as one printable character (what a
  `tokenizers` ByteLevel BPE writes in its vocabulary)."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
  out, extra = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + extra)
      extra += 1
  return out


class HFTokenizer(Tokenizer):
  """A Hugging Face `tokenizer.json` (the `tokenizers` library) with its special tokens.

  Byte-level BPEs decode byte-exactly (each token's bytes through the byte-level
  alphabet), so streaming never splits a character; other models decode through
  the library's decoder.
  """

  def __init__(self, tok, *, config: Mapping | None = None, source: str | None = None):
    self._tok = tok
    self.source = source
    config = dict(config or {})
    added = tok.get_added_tokens_decoder()
    self.special_tokens = {t.content: int(i) for i, t in added.items() if t.special}
    self._added = {int(i): t.content for i, t in added.items()}
    self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
    if self._added:
      self.vocab_size = max(self.vocab_size, max(self._added) + 1)
    spec = json.loads(tok.to_str())
    self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
    self._bytes: dict[int, bytes] = {}
    if self._byte_level:
      inv = {c: b for b, c in _byte_to_unicode().items()}
      for piece, i in tok.get_vocab(with_added_tokens=False).items():
        try:
          self._bytes[int(i)] = bytes(inv[c] for c in piece)
        except KeyError:
          self._bytes[int(i)] = piece.encode()
      for i, content in self._added.items():
        self._bytes[i] = content.encode()

    def pick(key: str, defaults: Sequence[str]) -> int | None:
      v = config.get(key)
      if isinstance(v, dict):
        v = v.get("content")
      if isinstance(v, str):
        i = tok.token_to_id(v)
        if i is None:
          raise ValueError(f"{source}: tokenizer_config.json {key}={v!r} is not a token")
        return int(i)
      return next((int(tok.token_to_id(n)) for n in defaults if tok.token_to_id(n) is not None),
                  None)

    self.bos_id = pick("bos_token", _BOS_NAMES)
    self.eos_id = pick("eos_token", _EOS_NAMES)
    self.pad_id = pick("pad_token", _PAD_NAMES)

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "HFTokenizer":
    from tokenizers import Tokenizer as _Tok  # pylint: disable=g-import-not-at-top
    path = os.fspath(path)
    tok = _Tok.from_file(os.path.join(path, "tokenizer.json"))
    return cls(tok, config=_read_json(os.path.join(path, "tokenizer_config.json")),
               source=path)

  def encode(self, text: str) -> list[int]:
    self._tok.encode_special_tokens = True      # special-token names in text are plain text
    try:
      return self._tok.encode(text, add_special_tokens=False).ids
    finally:
      self._tok.encode_special_tokens = False

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    ids = _as_int_list(ids)
    if self._byte_level:
      return b"".join(self._bytes.get(i) or reserved_name(i).encode() for i in ids)
    out, run = [], []
    for i in ids:
      if self._tok.id_to_token(i) is None:
        out += [self._tok.decode(run, skip_special_tokens=False), reserved_name(i)]
        run = []
      else:
        run.append(i)
    out.append(self._tok.decode(run, skip_special_tokens=False) if run else "")
    return "".join(out).encode()

  def __repr__(self) -> str:
    return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    try:
      out = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(out, dict):
    raise ValueError(f"{path}: expected a JSON object")
  return out


def _token_name(v) -> str | None:
  if isinstance(v, dict):
    v = v.get("content")
  return v if isinstance(v, str) else None


def load_kimi_dir(path: str | os.PathLike) -> TiktokenTokenizer:
  """Kimi's tokenizer format: `tiktoken.model` (BPE ranks) + `tokenizer_config.json`,
  whose `added_tokens_decoder` ({"163584": {"content": "[BOS]", ...}, ...}) names the
  special tokens and ids and whose bos_token / eos_token / pad_token pick among them.
  The pre-tokenizer regex is K3_PATTERN (the one Kimi K2 and K3 share)."""
  path = os.fspath(path)
  config = _read_json(os.path.join(path, "tokenizer_config.json"))
  special = {}
  for i, t in (config.get("added_tokens_decoder") or {}).items():
    name = _token_name(t)
    if name is None or not str(i).isdigit():
      raise ValueError(f"{path}/tokenizer_config.json: added_tokens_decoder[{i!r}] must map an "
                       "id to {\"content\": NAME}")
    special[name] = int(i)
  vocab = config.get("vocab_size")
  tok = TiktokenTokenizer.from_file(
      os.path.join(path, "tiktoken.model"), special, K3_PATTERN,
      bos_token=_token_name(config.get("bos_token")),
      eos_token=_token_name(config.get("eos_token")),
      pad_token=_token_name(config.get("pad_token")),
      vocab_size=vocab if isinstance(vocab, int) else None)
  tok.source = path
  return tok


def load_tokenizer_dir(path: str | os.PathLike) -> Tokenizer:
  """A model directory's tokenizer: `tiktoken.model` (load_kimi_dir) when present, else
  `tokenizer.json` (HFTokenizer); a directory with neither is a FileNotFoundError."""
  path = os.fspath(path)
  if os.path.isfile(os.path.join(path, "tiktoken.model")):
    return load_kimi_dir(path)
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    return HFTokenizer.from_dir(path)
  raise FileNotFoundError(f"{path}: no tokenizer (expected tiktoken.model + "
                          "tokenizer_config.json, or tokenizer.json)")


def has_tokenizer(path: str | os.PathLike) -> bool:
  return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def check_covers(tokenizer: Tokenizer, vocab_size: int) -> None:
  """Refuses (ValueError, one line) a tokenizer whose ids do not fit the model's vocabulary,
  or a model far larger than the tokenizer (a vocabulary the tokenizer does not cover:
  most of what it samples would be placeholders). A model up to 1/8 larger is accepted:
  released vocabularies are padded (reserved ids)."""
  n = tokenizer.vocab_size
  what = f"the tokenizer {tokenizer!r} has {n} ids"
  if n > vocab_size:
    raise ValueError(f"{what} but the model's vocab_size is {vocab_size}: its ids would index "
                     "past the embedding")
  if vocab_size > max(n + n // 8, n + 256):
    raise ValueError(f"{what} but the model's vocab_size is {vocab_size}: the tokenizer does "
                     "not cover the model's vocabulary (pass the model's own tokenizer)")


def _bpe_parts(b: bytes, ranks: Mapping[bytes, int], below: int) -> list[bytes]:
  """tiktoken's merge of `b` using only ranks < below: lowest-rank adjacent pair first."""
  parts = [bytes([x]) for x in b]
  while len(parts) > 1:
    best = None
    for i in range(len(parts) - 1):
      r = ranks.get(parts[i] + parts[i + 1])
      if r is not None and r < below and (best is None or r < best[0]):
        best = (r, i)
    if best is None:
      break
    i = best[1]
    parts[i:i + 2] = [parts[i] + parts[i + 1]]
  return parts


def _tiktoken_to_hf(tok: TiktokenTokenizer | ByteTokenizer):
  """A `tokenizers` byte-level BPE with the same ids as a tiktoken BPE (or the byte
  tokenizer): vocabulary = ranks in the byte-level alphabet, merges recovered from the
  ranks (a token's merge is the split of it whose two halves have the lowest ranks),
  the same pre-tokenizer regex, the special tokens as added tokens."""
  from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer as _Tok  # pylint: disable=g-import-not-at-top
  if isinstance(tok, ByteTokenizer):
    ranks, pattern, special = {bytes([i]): i for i in range(256)}, K3_PATTERN, {}
  else:
    ranks, pattern, special = tok.ranks, tok.pattern, tok.special_tokens
  b2u = _byte_to_unicode()
  text = lambda b: "".join(b2u[x] for x in b)
  vocab = {text(b): r for b, r in ranks.items()}
  vocab.update(special)                  # at their own ids (gaps allowed), then marked special
  merges = []
  for b, r in ranks.items():
    if len(b) < 2:
      continue
    parts = _bpe_parts(b, ranks, r)
    if len(parts) != 2:
      raise ValueError(f"BPE token {b!r} (rank {r}) is not a merge of two lower ranks")
    best = (r, *parts)
    merges.append((r, text(best[1]), text(best[2])))
  merges.sort()
  hf = _Tok(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges],
                       ignore_merges=False))
  hf.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  hf.decoder = decoders.ByteLevel()
  hf.add_special_tokens([AddedToken(n, special=True, normalized=False)
                         for n, _ in sorted(special.items(), key=lambda x: x[1])])
  for n, i in special.items():
    if hf.token_to_id(n) != i:
      raise ValueError(f"special token {n!r} got id {hf.token_to_id(n)} instead of {i}")
  return hf


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: str | os.PathLike,
                      chat_template: str | None = None) -> list[str]:
  """Writes `tokenizer` into out_dir so transformers' AutoTokenizer.from_pretrained loads it
  with the same ids: tokenizer.json + tokenizer_config.json (+ special_tokens_map.json), and
  for a tiktoken BPE also Kimi's own tiktoken.model (the config's added_tokens_decoder
  names the special ids). Returns the file names written."""
  import base64  # pylint: disable=g-import-not-at-top
  out_dir = os.fspath(out_dir)
  if isinstance(tokenizer, HFTokenizer):
    hf = tokenizer._tok                           # pylint: disable=protected-access
  elif isinstance(tokenizer, (TiktokenTokenizer, ByteTokenizer)):
    hf = _tiktoken_to_hf(tokenizer)
  else:
    raise TypeError(f"cannot export tokenizer {tokenizer!r}")
  written = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
  hf.save(os.path.join(out_dir, "tokenizer.json"))
  inv = {i: n for n, i in tokenizer.special_tokens.items()}
  roles = {}
  for key, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                 ("pad_token", tokenizer.pad_id)):
    if i is not None:
      roles[key] = inv.get(i) or hf.id_to_token(i)
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30, **roles,
            "added_tokens_decoder": {str(i): {"content": n, "special": True, "lstrip": False,
                                              "rstrip": False, "normalized": False,
                                              "single_word": False}
                                     for i, n in sorted(inv.items())}}
  if chat_template:
    config["chat_template"] = chat_template
  if isinstance(tokenizer, TiktokenTokenizer):
    config["vocab_size"] = tokenizer.vocab_size
    with open(os.path.join(out_dir, "tiktoken.model"), "w", encoding="ascii") as f:
      for b, r in sorted(tokenizer.ranks.items(), key=lambda x: x[1]):
        f.write(f"{base64.b64encode(b).decode()} {r}\n")
    written.append("tiktoken.model")
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
  with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
    json.dump(roles, f, indent=2, ensure_ascii=False)
  return written


def _as_int_list(ids: Iterable[int]) -> list[int]:
  if isinstance(ids, np.ndarray):
    return ids.astype(np.int64).reshape(-1).tolist()
  return [int(i) for i in ids]
