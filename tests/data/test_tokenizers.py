"""Tokenizers: round trips, non-ASCII text, stream decoding, file errors."""

import base64

import numpy as np
import pytest

from k3_jax.data import tokenizers

TEXTS = [
    "",
    "hello world",
    "def f(x):\n    return x ** 2  # squared\n",
    "héllo wörld, naïve café",
    "中文文本和English混合 123456",
    "emoji 🙂👍🏽 and CJK 日本語",
]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
  """A tiny tiktoken BPE: all 256 bytes plus a few merges, as base64 + rank."""
  merges = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b"ld", b" wor",
            b" world", "é".encode(), "中文".encode(), b"    ", b"re", b"ret"]
  tokens = [bytes([i]) for i in range(256)] + merges
  path = tmp_path_factory.mktemp("tok") / "tiktoken.model"
  path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n"
                          for rank, t in enumerate(tokens)))
  return path


@pytest.fixture(scope="module")
def bpe(bpe_path):
  n = 256 + 14
  return tokenizers.TiktokenTokenizer.from_file(
      bpe_path, special_tokens={"[BOS]": n, "[EOS]": n + 1, "[PAD]": n + 2})


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
  tok = tokenizers.ByteTokenizer()
  ids = tok.encode(text)
  assert ids == list(text.encode("utf-8"))
  assert all(0 <= i < tok.vocab_size for i in ids)
  np.testing.assert_array_equal(tok.encode_array(text), np.array(ids, np.int32))
  assert tok.encode_array(text).dtype == np.int32
  assert tok.decode(ids) == text
  assert tok.decode(np.array(ids, np.int32)) == text


def test_byte_special_ids():
  tok = tokenizers.get_tokenizer("byte")
  assert isinstance(tok, tokenizers.ByteTokenizer)
  assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.pad_id) == (256, 0, None, None)
  # an id past the table (a model with a larger vocabulary sampled it) is a placeholder
  assert tok.decode([104, 300]) == "h<|reserved_token_300|>"
  with pytest.raises(ValueError):
    tok.decode([-1])


def test_byte_decode_replaces_invalid_utf8():
  tok = tokenizers.ByteTokenizer()
  assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # truncated 3-byte character


@pytest.mark.parametrize("text", TEXTS)
def test_tiktoken_round_trip(bpe, text):
  ids = bpe.encode(text)
  assert all(0 <= i < bpe.vocab_size for i in ids)
  assert bpe.decode(ids) == text


def test_tiktoken_uses_merges_and_specials(bpe):
  ids = bpe.encode("hello world")
  assert len(ids) == 2  # "hello" + " world"
  assert bpe.decode([ids[0]]) == "hello"
  assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (270, 271, 272)
  assert bpe.vocab_size == 273
  # Special-token names in text are plain text, never special ids.
  assert 271 not in bpe.encode("a [EOS] b")


def test_tiktoken_pretokenizer_splits_han_from_latin(bpe):
  ids = bpe.encode("中文abc")
  pieces = [bpe.decode_bytes([i]) for i in ids]
  assert "中文".encode() in pieces  # the merge applies inside the Han run


def test_get_tokenizer_path(bpe_path):
  tok = tokenizers.get_tokenizer(str(bpe_path))
  assert isinstance(tok, tokenizers.TiktokenTokenizer)
  assert tok.eos_id is None and tok.decode(tok.encode("héllo")) == "héllo"


def test_missing_file_names_path(tmp_path):
  missing = tmp_path / "nope.model"
  with pytest.raises(FileNotFoundError, match="nope.model"):
    tokenizers.get_tokenizer(str(missing))


def test_special_token_clash_is_an_error(bpe_path):
  with pytest.raises(ValueError, match="collide"):
    tokenizers.TiktokenTokenizer.from_file(bpe_path, special_tokens={"[EOS]": 5})


@pytest.mark.parametrize("make", ["byte", "bpe"])
def test_stream_decoder_never_splits_characters(make, bpe):
  tok = tokenizers.ByteTokenizer() if make == "byte" else bpe
  text = "añb中文🙂 héllo world 日本"
  ids = tok.encode(text)
  dec = tok.stream_decoder()
  pieces = [dec.add(i) for i in ids] + [dec.flush()]
  assert "".join(pieces) == text
  assert all("\ufffd" not in p for p in pieces)
  if make == "byte":
    # The four bytes of 🙂 come out as one piece, at its last byte.
    start = len("añb中文".encode())
    assert pieces[start:start + 4] == ["", "", "", "🙂"]


def test_stream_decoder_flushes_incomplete_tail():
  dec = tokenizers.StreamDecoder(tokenizers.ByteTokenizer())
  assert dec.add([0x61, 0xE4, 0xB8]) == "a"
  assert dec.flush() == "\ufffd"
