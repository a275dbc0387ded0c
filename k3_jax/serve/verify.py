"""The speculative verify step: each slot's last token and up to k drafts in one model call,
the logits of every position, the drafts accepted (acceptance.py), and the cache left exactly
where decoding only the kept tokens would leave it.

The call runs the model over B (k + 1) rows of one token each: row b T + t (T = k + 1) is
token t of row b's window at position pos[b] + t, with its slot's page table. The B rows
are the slots with requests decoding (padded to a power of two without batch invariance,
as a decode step is; every slot with it). So every layer but KDA computes, per row, what a
decode step computes for that token:

  MLA     each row writes its latents into the slot's pages; a slot's T rows read its pages
          once, below the window (PagedMLACache.window: the T queries as heads of one
          paged attention), and row t attends to the window's rows <= t from the call's own
          latents (layers/mla.py): token t sees what decoding it would. Latents of
          rejected drafts stay in the pages past the slot's position, never read
          (attention stops at the position) and overwritten by the next step. Rows past a slot's drafts (and idle rows) get the
          null page's table, so they write nothing that is read.
  KDA     the layer folds the rows back to [B, T], convolves the window at once from the
          cached tails, runs its one-step recurrence token by token, keeps the state and
          tails as they were and records the window (layers/kda_window.py): every
          position's state where a layer's state is small, else the recurrence's inputs;
          after acceptance `replay` makes the state after the kept tokens (the last token
          and the accepted drafts) by selecting, or by applying them again. Idle rows keep
          0 tokens (and their states are not written back).

So with every draft accepted the step equals k + 1 decode steps, and with a rejection at
position j it equals decoding the j + 1 kept tokens; both are tested
(tests/serve/test_verify.py), with the tolerance the batch shape leaves (B T rows instead of
B: XLA may sum a matmul's products in another order).

Memory per KDA layer and slot: recording, T (4 H K + H) f32 + 3 T H K model-dtype values;
keeping states, T H K V f32 more (docs/serving.md gives the k3 numbers, where the
recording is chosen).
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
  tokens: jax.Array         # int32 [B]: each row's last token (not yet in the cache)
  drafts: jax.Array         # int32 [B, k]: its drafts (row b's first ndraft[b] are real)
  ndraft: jax.Array         # int32 [B]: 0 for a row decoding plainly in this step
  pos: jax.Array            # int32 [B]: the last token's position
  tables: jax.Array         # int32 [B, M]
  active: jax.Array         # bool [B]: idle rows (padding) keep their slot's state
  sampling: Sampling
  slots: jax.Array | None = None   # int32 [B]: row i's slot, a step over fewer rows than
                            # slots; None: row i is slot i, every slot (states in place)


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
  """-> (Sampled over the B T rows (ids: row b T + t is row b's t-th emitted token for
  t < emitted[b]), emitted [B] int32 (0 for idle rows), cache, counts).

  With batch.slots the B rows' slots' KDA states are taken out, verified and put back (idle
  rows' dropped), as steps.on_rows does for a decode step over fewer rows than slots: a
  step's cost follows the requests decoding, not the slot count. Without, every slot runs
  in place (an idle one keeps 0 tokens: its state as it was, bit for bit)."""
  model = nnx.merge(graphdef, params, rest)
  b, k = batch.drafts.shape
  t = k + 1
  tokens, pos, tables = window_rows(batch)
  mark = lambda e, axis: (replace(e, window=empty_window(e, e.state.shape[:axis + 1], t))
                          if isinstance(e, KDAState) else replace(e, window=t))
  states, slots = kv.kda_states(cache), batch.slots
  sub = cache if slots is None else kv.with_kda_states(cache, kv.take_rows(states, slots))
  logits, new, _ = model(tokens, cache=map_cache(mark, kv.with_pages(sub, pos, tables)),
                         par=par)
  raw = logits[:, 0].astype(jnp.float32)                               # [B T, V]
  mine = counts if slots is None else counts[slots]
  ids, emitted = accept(raw.reshape(b, t, -1), mine, batch.drafts, batch.ndraft,
                        batch.sampling)
  emitted = jnp.where(batch.active, emitted, 0)
  backend = par.kernels.kda_backend
  out = map_cache(lambda e, axis: replay(e, emitted, backend, par)
                  if isinstance(e, KDAState) else replace(e, window=1), kv.without_pages(new))
  if slots is not None:
    out = kv.with_kda_states(out, kv.put_slots(states, slots, batch.active,
                                               kv.kda_states(out)))
  out = out.replace(pos=cache.pos)
  hot = jnp.sum(jax.nn.one_hot(ids, counts.shape[-1], dtype=jnp.int32)
                * (jnp.arange(t)[None] < emitted[:, None])[..., None], axis=1)   # [B, V]
  counts = counts + hot if slots is None else counts.at[slots].add(hot)
  return with_logprobs(raw, ids.reshape(-1)), emitted, out, counts


__all__ = ["VerifyBatch", "window_rows", "verify_step"]
