"""The decode caches as types: registered pytree dataclasses, their shapes given here once.

One entry per decoder layer, by its mixer:

    KDAState        KDA layer: the delta-rule state and the short convolutions' windows
        state             [B, H, K, V] f32
        conv_q/k/v        [B, W-1, H*K]   (the last W-1 inputs of each causal conv)
        active            None, or [B] bool during a serving decode step: rows whose
                          state the step may change (an idle slot's is kept, in the layer)
        unit              None, or (a scanned unit's layer in a serving decode step) the
                          index of its state in `state`, then the whole stacked [R, B, H,
                          K, V] state, updated in place there (the windows are the layer's)
        window            None, or a KDAWindow during a speculative verify step
                          (k3_jax/layers/kda_window.py): the layer then runs T tokens a
                          row, keeps the state and tails as they were, and records here
                          what making the accepted tokens' state needs
    MLACache        MLA layer, contiguous (prefill / decode): the latents of every position
        c_kv              [B, S, R]
        k_r               [B, S, Pr]     (R = kv_lora_rank, Pr = qk_rope_head_dim)
    PagedMLACache   MLA layer, serving (k3_jax/serve): a pool of N pages of P tokens shared
                    by all sequences, and the page table of the call
        c_kv              [N, P, R]
        k_r               [N, P / f, f Pr]  (each page's rope keys folded to 128 lanes,
                          f = 128 / Pr; k3_jax/ops/rope_pages.py)
        page_table        [B, M] int32, or None between calls (the engine attaches it):
                          row b lists sequence b's pages in order, so logical position s
                          lives in page page_table[b, s // P] at offset s % P
        unit              None, or (a scanned unit's layer) the index of its pool in the
                          stacked [R, N, P, X] pools it reads in place
        deferred          (static) a scanned unit's layer whose pools are written after the
                          scan (model.POOL_WRITES "after_scan"): the layer only reads them
                          and returns its new latents [B, T, X] as c_kv / k_r

    ModelCache      the whole model's: `pos` and one entry per layer, grouped as the layer
                    stack is (k3_jax/stack.py): `prefix` and `suffix` tuples of entries, and
                    `units` (None without a scanned unit) a tuple of one entry per layer of
                    the unit whose arrays carry a leading [R] repeat axis ([R, B, ...]).
        pos               int32 [] (contiguous) | [B] (paged: per-sequence positions)

A view that keeps some entries only (kv_pages.kda_states) holds None in place of the others
and may hold None as pos. Which entry a layer has is its type (isinstance), never its keys.
"""

from __future__ import annotations

import dataclasses

import jax


def _pytree(cls):
  return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class KDAState:
  state: jax.Array          # [B, H, K, V] f32
  conv_q: jax.Array         # [B, W-1, H*K]
  conv_k: jax.Array
  conv_v: jax.Array
  active: jax.Array | None = None   # [B] bool (serving decode), else None
  unit: jax.Array | None = None     # (a scanned layer's decode) state is the [R, ...] stack
  window: "KDAWindow | None" = None  # speculative verify step (layers/kda_window.py)


@_pytree
class KDAWindow:
  """A verify step's record of one KDA layer over the T tokens of each row's window, from
  which the state after the accepted prefix is made once acceptance is known
  (layers/kda_window.py): the conv inputs (the tails are made of them) and either every
  position's state (`states`, kept where a layer's state is small) or what the recurrence
  read (q, k, v, g, beta, replayed onto the kept state otherwise)."""
  xq: jax.Array             # [B, T, H*K] the convolutions' inputs
  xk: jax.Array
  xv: jax.Array
  states: jax.Array | None = None   # [B, T, H, K, V] f32: the state after token t
  q: jax.Array | None = None        # [B, T, H, K] f32 (after conv, SiLU, L2 norm)
  k: jax.Array | None = None        # [B, T, H, K] f32
  v: jax.Array | None = None        # [B, T, H, V] f32
  g: jax.Array | None = None        # [B, T, H, K] f32 log decay
  beta: jax.Array | None = None     # [B, T, H] f32


@_pytree
class MLACache:
  c_kv: jax.Array           # [B, S, R]
  k_r: jax.Array            # [B, S, Pr]

  SEQ_AXIS = 1              # (of an unstacked entry) the axis of cache positions


@_pytree
class PagedMLACache:
  c_kv: jax.Array           # [N, P, R]
  k_r: jax.Array            # [N, P / f, f Pr] (ops/rope_pages.py)
  page_table: jax.Array | None = None   # [B, M] int32
  # Inside the scan over repeated units (model._run_units): c_kv / k_r are the whole
  # stacked pools [R, N, P, X], written and read in place at this unit index; deferred:
  # only read, the layer returns the call's new latents [B, T, X] and the scan writes them
  # after the loop.
  unit: jax.Array | None = None
  deferred: bool = dataclasses.field(default=False, metadata=dict(static=True))
  # (static) a speculative verify step's rows per sequence: rows b w ... b w + w - 1 of a
  # one-token call are consecutive positions of one sequence (layers/mla.py reads its pages
  # once for all w rows)
  window: int = dataclasses.field(default=1, metadata=dict(static=True))


@_pytree
class ModelCache:
  pos: jax.Array | None
  prefix: tuple = ()
  units: tuple | None = None
  suffix: tuple = ()

  def replace(self, **kw) -> "ModelCache":
    return dataclasses.replace(self, **kw)


def replace(entry, **kw):
  """A copy of a cache entry (or ModelCache) with fields replaced."""
  return dataclasses.replace(entry, **kw)


__all__ = ["KDAState", "KDAWindow", "MLACache", "PagedMLACache", "ModelCache", "replace"]
