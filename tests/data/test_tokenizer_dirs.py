"""Tokenizers as users have them: Kimi's directory format (tiktoken.model +
tokenizer_config.json) with the K3 special tokens at their released ids, Hugging Face
tokenizer.json directories, the export transformers' AutoTokenizer loads, and the startup check
that a model's vocabulary and its tokenizer agree."""

import json
import time

import pytest
import tiktoken

from k3_jax.data import bpe, tokenizers as tk

TEXT = ("Hello HTTPServer, it's 12345 degrees; don't   panic.\n\n    def f(x):\n\treturn x\n"
        "你好，世界 ünïcode façade — 🙂 <b>&amp;</b>")


def test_k3_dir_has_the_released_special_ids(k3_tokenizer_dir, k3_tokenizer):
  tok = k3_tokenizer
  assert isinstance(tok, tk.TiktokenTokenizer)
  assert tok.vocab_size == tk.K3_VOCAB_SIZE == 163_840
  for name, i in tk.KIMI_SPECIAL_TOKENS.items():
    assert tok.special_tokens[name] == i
  assert (tok.special_tokens["<|end_of_msg|>"], tok.special_tokens["<|open|>"],
          tok.special_tokens["<|close|>"], tok.special_tokens["<|sep|>"]) == \
      (163586, 163587, 163588, 163589)
  assert tok.special_tokens["<|reserved_token_163592|>"] == 163592
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (163584, 163585, 163839)
  ids = tok.encode(TEXT)
  assert tok.decode(ids) == TEXT and max(ids) < tk.K3_NUM_BASE_TOKENS
  assert len(ids) < len(TEXT.encode())                   # merges were learned
  assert tok.encode("<|open|>") != [163587]              # names in text are plain text
  assert tok.decode([163587, 163590]) == "<|open|>[start_header_id]"
  # the directory loads through every entry point
  assert tk.get_tokenizer(str(k3_tokenizer_dir)).encode(TEXT) == ids
  assert tk.load_tokenizer_dir(k3_tokenizer_dir).encode(TEXT) == ids


def test_k3_pattern_is_the_kimi_pre_tokenizer():
  """The spec's regex (class intersections) splits text as the lookahead form does."""
  ranks = {bytes([i]): i for i in range(256)}
  a, b = (tiktoken.Encoding(f"p{i}", pat_str=p, mergeable_ranks=ranks, special_tokens={})
          for i, p in enumerate((tk.K3_PATTERN, tk.KIMI_STYLE_PATTERN)))
  assert bpe.pieces(TEXT) == ["Hello", " HTTPServer", ",", " it's", " ", "123", "45",
                              " degrees", ";", " don't", "  ", " panic", ".\n\n", "   ",
                              " def", " f", "(x", "):\n", "\treturn", " x", "\n",
                              "你好", "，", "世界", " ünïcode", " façade", " —", " 🙂", " <",
                              "b", ">&", "amp", ";</", "b", ">"]
  assert a.encode_ordinary(TEXT) == b.encode_ordinary(TEXT)


def test_learned_ranks_are_deterministic_and_fast():
  t0 = time.perf_counter()
  r1 = bpe.learn_ranks([TEXT * 3], 60)
  assert time.perf_counter() - t0 < 2
  assert r1 == bpe.learn_ranks([TEXT * 3], 60) and len(r1) == 256 + 60
  assert sorted(r1.values()) == list(range(len(r1)))
  with pytest.raises(ValueError, match="num_merges"):
    bpe.learn_ranks([TEXT], -1)


def test_reserved_ids_decode_to_placeholders(k3_tokenizer):
  """An id no token names decodes to a placeholder instead of raising (what a model with a
  larger vocabulary than its tokenizer can sample)."""
  assert k3_tokenizer.decode([1000]) == "<|reserved_token_1000|>"
  assert tk.ByteTokenizer().decode([104, 467]) == "h<|reserved_token_467|>"


def test_hf_export_loads_in_autotokenizer(tmp_path, k3_tokenizer):
  """save_hf_tokenizer writes what transformers' AutoTokenizer loads with the same ids (the
  special tokens at their ids); our HFTokenizer reads tokenizer.json the same way."""
  from transformers import AutoTokenizer
  out = tmp_path / "export"
  out.mkdir()
  assert set(tk.save_hf_tokenizer(k3_tokenizer, out)) >= {"tokenizer.json",
                                                          "tokenizer_config.json"}
  auto = AutoTokenizer.from_pretrained(str(out))
  ids = k3_tokenizer.encode(TEXT)
  assert auto.encode(TEXT, add_special_tokens=False) == ids
  assert auto.decode(ids) == TEXT
  for name in ("<|open|>", "<|end_of_msg|>", "[PAD]"):
    assert auto.convert_tokens_to_ids(name) == tk.KIMI_SPECIAL_TOKENS[name]
  assert (auto.bos_token_id, auto.eos_token_id) == (163584, 163585)
  (out / "tiktoken.model").unlink()                      # now only tokenizer.json is left
  hf = tk.get_tokenizer(str(out))
  assert isinstance(hf, tk.HFTokenizer) and hf.encode(TEXT) == ids
  assert hf.decode(ids) == TEXT and hf.special_tokens["<|sep|>"] == 163589
  assert hf.vocab_size == 163_840 and hf.eos_id == 163585
  # byte-exact streaming: a multi-byte character split across tokens is held back
  dec = hf.stream_decoder()
  assert "".join(dec.add(i) for i in ids) + dec.flush() == TEXT
  # the byte tokenizer exports too
  byte_dir = tmp_path / "byte"
  byte_dir.mkdir()
  tk.save_hf_tokenizer(tk.ByteTokenizer(), byte_dir)
  assert AutoTokenizer.from_pretrained(str(byte_dir)).encode(
      "héllo", add_special_tokens=False) == list("héllo".encode())


def test_check_covers_refuses_in_one_line(k3_tokenizer):
  tk.check_covers(k3_tokenizer, 163_840)
  tk.check_covers(tk.ByteTokenizer(), 256)
  tk.check_covers(tk.ByteTokenizer(), 512)                 # padded vocabularies pass
  for tok, n, match in ((k3_tokenizer, 256, "index past"),
                        (tk.ByteTokenizer(), 163_840, "does not cover")):
    with pytest.raises(ValueError, match=match) as e:
      tk.check_covers(tok, n)
    assert "\n" not in str(e.value)


def test_directory_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no tokenizer"):
    tk.load_tokenizer_dir(tmp_path)
  (tmp_path / "tiktoken.model").write_text("")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"added_tokens_decoder": {"x": {"content": "[BOS]"}}}))
  with pytest.raises(ValueError, match="added_tokens_decoder"):
    tk.get_tokenizer(str(tmp_path))
