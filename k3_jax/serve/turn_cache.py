"""The state after decoded tokens: a finished request's conversation so far (prompt +
generated tokens) joins the prefix cache, so an agent's next turn, which sends the previous
answer back, hits through it rather than only through the previous prompt.

The prefill registers a prompt's blocks and keeps KDA checkpoints at its last grid
boundaries (prefill_chunks.checkpoint_boundaries); decoded tokens pass grid boundaries one token at
a time, and the KDA state after exactly `U * n` tokens (U: the match grid, match_tokens) exists
only right after the decode step that fed token U * n - 1. So, after each decode step is
dispatched, the slots that just reached a boundary copy their KDA state into a per-slot row of `tail` (dispatched in
order with the steps: the copy reads the state of that step, not a later one). When the
request finishes (stop or length), its fed tokens (the prompt, then every generated token but
the last, which was never fed) are hashed on the match grid, the blocks past the prompt's are
registered (their latents are in the request's pages), and the tail row becomes the
checkpoint of the last boundary when it is that boundary's state.

The decoded tokens' latents and state come from the decode step (one token at a time), not
the chunked prefill, so a next turn's hit through them equals a cold prefill of the same
tokens to float rounding (not bitwise, as a hit inside the prompt is).

The next turn renders the previous answer through the chat template (k3_jax/data/chat.py): its
prompt is the previous prompt (which ended in the assistant's generation prompt), then the
answer's ids as the template renders them. Those are the generated ids when the model wrote
each text piece as the tokenizer encodes it and the client sends the reasoning back (with
thinking on, a past assistant message without `reasoning_content` renders an empty think
channel, and the hit then ends at the previous prompt); the blocks match as far as the ids
agree, whatever the cause.
"""

from __future__ import annotations

import jax
import numpy as np

from k3_jax.serve import kv_pages as kv
from k3_jax.serve.prefix_cache import block_hashes


def save_tail(tail, cache, slot):
  return kv.put_rows(tail, slot[None], kv.take_rows(kv.kda_states(cache), slot[None]))


def tail_to_ckpt(ckpts, tail, slot, c):
  return kv.put_rows(ckpts, c[None], kv.take_rows(tail, slot[None]))


class TurnCache:
  def __init__(self, engine):
    self.engine = engine
    self.match_tokens = engine.match_tokens
    self.tail = kv.zeros_rows(kv.kda_states(engine.cache), engine.max_batch)
    self.at: dict[int, tuple] = {}     # slot -> (request id, the boundary its tail row holds)
    self._save = jax.jit(save_tail, donate_argnums=(0,))
    self._to_ckpt = jax.jit(tail_to_ckpt, donate_argnums=(0,))
    self.registered_blocks = 0

  def after_decode(self, reqs, ahead=frozenset()) -> None:
    """A decode step was dispatched, feeding each of `reqs` its position (one past r.pos
    for the id()s in `ahead`, whose last token the host has not read yet): those whose state
    is now after a grid boundary keep it."""
    for r in reqs:
      p = r.pos + (id(r) in ahead)
      if (p + 1) % self.match_tokens == 0:
        self.tail = self._save(self.tail, self.engine.cache, np.int32(r.slot))
        self.at[r.slot] = (r.id, p + 1)

  def on_finish(self, r) -> None:
    """Request r ends (its slot and pages not yet released): its decoded blocks join the
    prefix cache, with the tail checkpoint at the last boundary when it holds that one."""
    e = self.engine
    slot, n = r.slot, r.pos
    owner, at = self.at.pop(slot, (None, -1))
    if owner != r.id:
      at = -1
    if r.images is not None or not r.output_ids or r.feed is None:
      return
    seq = np.concatenate([r.prompt, np.asarray(r.output_ids[:-1], np.int32)])
    if seq.size != n or n // self.match_tokens <= r.registered:
      return
    hashes = block_hashes(seq, block=self.match_tokens)
    last = n // self.match_tokens * self.match_tokens
    before = r.registered
    r.registered, c = e.kv.register(slot, hashes, r.registered, n, e.step_no,
                                    last if at == last else None, state_rows=self.tail)
    self.registered_blocks += max(0, r.registered - before)
    if c is not None:
      e.ckpts = self._to_ckpt(e.ckpts, self.tail, np.int32(slot), np.int32(c))


def attach(engine) -> TurnCache | None:
  """The engine's TurnCache when it has a prefix cache and ServeConfig.cache_decoded (not in
  a multi-host job, whose steps are replayed: these copies are not)."""
  if engine.prefix is None or not engine.serve.cache_decoded or engine.relay is not None:
    return None
  return TurnCache(engine)


__all__ = ["TurnCache", "attach", "save_tail", "tail_to_ckpt"]
