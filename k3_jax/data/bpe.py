"""Learn tiktoken BPE ranks from local text, and write a tokenizer in Kimi's directory format.

The released K3 vocabulary cannot be downloaded here, so tests (and anyone who wants a
K3-format tokenizer of their own) build one: the K3 pre-tokenizer regex
(tokenizers.K3_PATTERN) splits the text into pieces, byte-pair merges are learned on the
pieces (most frequent adjacent pair first; ties broken by the pair's bytes, so the result is
deterministic), and `write_kimi_dir` writes `tiktoken.model` + `tokenizer_config.json` with
the K3 special tokens at their released ids (tokenizers.KIMI_SPECIAL_TOKENS; every other id
from 163584 up to the vocabulary size is `<|reserved_token_N|>`).
"""

from __future__ import annotations

import base64
import collections
import json
import os
from collections.abc import Iterable, Mapping

from k3_jax.data import tokenizers as tk


def pieces(text: str, pattern: str = tk.K3_PATTERN) -> list[str]:
  """The pre-tokenizer's pieces of `text` (what BPE merges never cross)."""
  from tokenizers import Regex, pre_tokenizers  # pylint: disable=g-import-not-at-top
  split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
  return [p for p, _ in split.pre_tokenize_str(text)]


def learn_ranks(texts: Iterable[str], num_merges: int,
                pattern: str = tk.K3_PATTERN) -> dict[bytes, int]:
  """BPE ranks: the 256 single bytes (rank = byte value), then one rank per learned merge in
  the order learned. Stops early when no pair occurs twice."""
  if num_merges < 0:
    raise ValueError(f"num_merges={num_merges} must be >= 0")
  counts = collections.Counter()
  for t in texts:
    counts.update(p.encode("utf-8") for p in pieces(t, pattern))
  words = [[[bytes([b]) for b in w], n] for w, n in counts.items()]
  ranks = {bytes([i]): i for i in range(256)}
  pairs = collections.Counter()
  for syms, n in words:
    for a, b in zip(syms, syms[1:]):
      pairs[a, b] += n
  for _ in range(num_merges):
    if not pairs:
      break
    top = max(pairs.values())
    if top < 2:
      break
    a, b = min(p for p, c in pairs.items() if c == top)
    merged = a + b
    if merged not in ranks:
      ranks[merged] = len(ranks)
    for w in words:
      syms, n = w
      if len(syms) < 2:
        continue
      i, out, changed = 0, [], False
      while i < len(syms):
        if i + 1 < len(syms) and syms[i] == a and syms[i + 1] == b:
          out.append(merged)
          i += 2
          changed = True
        else:
          out.append(syms[i])
          i += 1
      if changed:
        for x, y in zip(syms, syms[1:]):
          pairs[x, y] -= n
          if pairs[x, y] <= 0:
            del pairs[x, y]
        for x, y in zip(out, out[1:]):
          pairs[x, y] += n
        w[0] = out
  return ranks


def write_kimi_dir(out_dir: str | os.PathLike, ranks: Mapping[bytes, int],
                   special_tokens: Mapping[str, int] | None = None,
                   vocab_size: int = tk.K3_VOCAB_SIZE, *, bos_token: str = "[BOS]",
                   eos_token: str = "[EOS]", pad_token: str | None = "[PAD]") -> str:
  """Writes `tiktoken.model` (one `base64(token) rank` line per rank) and
  `tokenizer_config.json` naming every id from tokenizers.K3_NUM_BASE_TOKENS to vocab_size - 1
  (the special tokens, default the K3 ones, and `<|reserved_token_N|>` for the rest). Returns
  out_dir, which load_tokenizer_dir / get_tokenizer load."""
  special = dict(tk.KIMI_SPECIAL_TOKENS if special_tokens is None else special_tokens)
  if ranks and max(ranks.values()) >= min(special.values(), default=vocab_size):
    raise ValueError("BPE ranks reach the special token ids")
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "tiktoken.model"), "w", encoding="ascii") as f:
    for b, r in sorted(ranks.items(), key=lambda x: x[1]):
      f.write(f"{base64.b64encode(b).decode()} {r}\n")
  inv = {i: n for n, i in special.items()}
  first = min(list(special.values()) + [tk.K3_NUM_BASE_TOKENS])
  decoder = {str(i): {"content": inv.get(i, tk.reserved_name(i)), "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False,
                      "special": True}
             for i in range(first, vocab_size)}
  names = {n for n in (bos_token, eos_token, pad_token) if n is not None}
  missing = sorted(names - set(special))
  if missing:
    raise ValueError(f"{missing} are not special tokens")
  config = {"tokenizer_class": "TikTokenTokenizer", "vocab_size": vocab_size,
            "bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token,
            "added_tokens_decoder": decoder}
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=1)
  return out_dir


__all__ = ["pieces", "learn_ranks", "write_kimi_dir"]
