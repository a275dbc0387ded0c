"""How the engine cuts a prompt's prefill into model calls: whole 512-token blocks, the rest in
pieces of 4^k tokens so that only a few shapes ever compile, every piece ending on the
positions whose KDA state the prefix cache keeps (checkpoint_boundaries)."""

from __future__ import annotations

from k3_jax.serve.kv_pages import PAGE


def prefill_plan(start: int, prompt_len: int, chunk: int, match_tokens: int = PAGE) -> list[int]:
  """Lengths of the model calls of the next prefill segment from position `start`: the
  pieces up to the next position whose KDA state the prefill keeps
  (checkpoint_boundaries(prompt_len, match_tokens)) or to the prompt's end.

  From a block boundary with a whole block (512 tokens) or more before that stop: whole
  blocks, at most `chunk` tokens (a multiple of 512), as one call. Otherwise (less than a
  block to go, or `start` inside a block, as after a hit on a finer match grid): up to the
  stop or the next block boundary, whichever is first, in pieces of 256, 64, 16, 4 and 1
  tokens (one model call each; only five such shapes ever compile). With match_tokens = 512 a
  prefill thus runs whole blocks up to the last block boundary of the prompt (and stops one
  block earlier when the prompt ends exactly on a boundary: that boundary's checkpoint is
  the one an identical prompt can hit, since a hit must leave a token to run), then the
  tail below 512 tokens in at most 15 calls."""
  end = next((b for b in checkpoint_boundaries(prompt_len, match_tokens) if b > start),
             prompt_len)
  if start % PAGE == 0 and end - start >= PAGE:
    return [min(start + chunk, end // PAGE * PAGE) - start]
  rest, pieces, p = min(end, (start // PAGE + 1) * PAGE) - start, [], PAGE // 2
  while rest:
    while rest >= p:
      pieces.append(p)
      rest -= p
    p //= 4
  return pieces


def _last_boundaries(prompt_len: int, match_tokens: int) -> tuple[int, ...]:
  aligned = prompt_len // match_tokens * match_tokens
  if not aligned:
    return ()
  if aligned == prompt_len and aligned > match_tokens:
    return (aligned - match_tokens, aligned)
  return (aligned,)


def checkpoint_boundaries(prompt_len: int, match_tokens: int = PAGE) -> tuple[int, ...]:
  """Positions whose KDA state a prefill keeps. match_tokens = 512: the last block boundary of
  the prompt, and the one before it when the prompt ends exactly on a boundary. A finer grid
  (a power of two dividing 512): the last multiple of `match_tokens` in the prompt (and the one
  before it when the prompt ends exactly on one: a hit must leave a token to run), plus the
  last block boundary (the one a prompt diverging in the last block can hit)."""
  if match_tokens == PAGE:
    return _last_boundaries(prompt_len, PAGE)
  last_block = prompt_len // PAGE * PAGE
  return tuple(sorted(set(_last_boundaries(prompt_len, match_tokens)) |
                      ({last_block} if last_block else set())))


__all__ = ["prefill_plan", "checkpoint_boundaries"]
