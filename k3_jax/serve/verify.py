"""The speculative verify step: each slot's last token and up to k drafts in one model call,
the logits of every position, the drafts accepted (acceptance.py), and the cache left exactly
where decoding only the kept tokens would leave it.

The call runs the model over B (k + 1) rows of one token each: row b T + t (T = k + 1) is
token t of slot b's window at position pos[b] + t, with slot b's page table. So every layer
but KDA computes, per row, what a decode step computes for that token:

  MLA     each row writes its latents into the slot's pages first, then attends over the
          pool's positions < its own plus its own latents (layers/mla.py, write then read):
          token t sees the window's tokens < t. Latents of rejected drafts stay in the pages
          past the slot's position, never read (attention stops at the position) and
          overwritten by the next step. Rows past a slot's drafts (and idle slots) get the
          null page's table, so they write nothing that is read.
  KDA     the layer folds the rows back to [B, T], runs its one-step decode token by token,
          keeps the state and conv tails as they were and records its inputs
          (layers/kda_window.py); after acceptance `replay` applies the kept tokens (the
          last token and the accepted drafts) to them. Idle slots keep 0 tokens.

So with every draft accepted the step equals k + 1 decode steps, and with a rejection at
position j it equals decoding the j + 1 kept tokens; both are tested
(tests/serve/test_verify.py), with the tolerance the batch shape leaves (B T rows instead of
B: XLA may sum a matmul's products in another order).

Memory (recording, not keeping states): per KDA layer and slot the record is T (4 H K + H)
f32 + 3 T H K model-dtype values, against T H K V f32 for every position's state (docs/
serving.md gives the k3 numbers).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.cache import KDAState, replace
from k3_jax.layers.kda_window import empty_window, replay
from k3_jax.serve import kv_pages as kv
from k3_jax.serve.acceptance import accept
from k3_jax.serve.steps import Sampling, with_logprobs
from k3_jax.stack import map_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyBatch:
  """One verify step's input: every slot's last token and its drafts."""
  tokens: jax.Array         # int32 [B]: each slot's last token (not yet in the cache)
  drafts: jax.Array         # int32 [B, k]: its drafts (row b's first ndraft[b] are real)
  ndraft: jax.Array         # int32 [B]: 0 for a slot decoding plainly in this step
  pos: jax.Array            # int32 [B]: the last token's position
  tables: jax.Array         # int32 [B, M]
  active: jax.Array         # bool [B]
  sampling: Sampling


def window_rows(batch: VerifyBatch):
  """-> (tokens [B T, 1], positions [B T], page tables [B T, M]) of the folded rows: row
  b T + t is token t of slot b's window; rows past its drafts (or of an idle slot) get the
  null page's table."""
  b, k = batch.drafts.shape
  t = k + 1
  tokens = jnp.concatenate([batch.tokens[:, None], batch.drafts], axis=1).reshape(b * t, 1)
  pos = (batch.pos[:, None] + jnp.arange(t)[None]).reshape(-1)
  live = (jnp.arange(t)[None] <= batch.ndraft[:, None]) & batch.active[:, None]
  tables = jnp.where(live[..., None], batch.tables[:, None], 0).reshape(b * t, -1)
  return tokens, pos, tables


def verify_step(graphdef, par, params, rest, cache, counts, batch: VerifyBatch):
  """-> (Sampled over the B T rows (ids: row b T + t is slot b's t-th emitted token for
  t < emitted[b]), emitted [B] int32 (0 for idle slots), cache, counts)."""
  model = nnx.merge(graphdef, params, rest)
  b, k = batch.drafts.shape
  t = k + 1
  tokens, pos, tables = window_rows(batch)
  mark = lambda e, axis: (replace(e, window=empty_window(e, e.state.shape[:axis + 1], t))
                          if isinstance(e, KDAState) else e)
  marked = map_cache(mark, kv.with_pages(cache, pos, tables))
  logits, new, _ = model(tokens, cache=marked, par=par)
  raw = logits[:, 0].astype(jnp.float32)                               # [B T, V]
  ids, emitted = accept(raw.reshape(b, t, -1), counts, batch.drafts, batch.ndraft,
                        batch.sampling)
  emitted = jnp.where(batch.active, emitted, 0)
  backend = par.kernels.kda_backend
  out = map_cache(lambda e, axis: replay(e, emitted, backend, par)
                  if isinstance(e, KDAState) else e, kv.without_pages(new))
  out = out.replace(pos=cache.pos)
  mine = jnp.arange(t)[None] < emitted[:, None]                        # [B, T]
  counts = counts + jnp.sum(jax.nn.one_hot(ids, counts.shape[-1], dtype=jnp.int32)
                            * mine[..., None], axis=1)
  return with_logprobs(raw, ids.reshape(-1)), emitted, out, counts


__all__ = ["VerifyBatch", "window_rows", "verify_step"]
