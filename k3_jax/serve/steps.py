"""The serving steps: module-level pure functions over (params, cache, batch).

The engine (engine.py) runs these, jitted by `jit_steps`, and `compile --step=decode` lowers
the same `decode_step` on the same paged cache (k3_jax/compile.py), so the program whose
memory and roofline `compile` reports is the program `serve` runs.

    prefill_step  prompt pieces of R slots, T tokens each: tokens [R, T] at positions
                  pos[i] + [0, T) -> (each row's last logits [R, V], cache)
    score_step    one prompt's every position's logits [T, V], by the prefill's model call
                  over a scratch paged cache (the completions API's echo / logprobs)
    decode_step   one token for every slot (idle ones masked) -> (Sampled, cache, counts)
    first_token   the token sampled from a prompt's last logits (a row of prefill's)
                  -> (Sampled, counts)
    zero_slot / load_slot / save_ckpt   a slot's KDA state: zeroed, loaded from or saved to
                  a prefix-cache checkpoint row
    set_counts    a slot's generated-token counts restored (a preempted request resuming)
    copy_page     one MLA page copied into another in every MLA layer (a prefix-cache hit
                  that ends inside a page: the request continues in its own copy)
    encode        packed images -> projected features (models with a vision tower)
    piece_features  the features of one prefill piece's placeholders (zeros without any)

Sampling happens inside the step (sample_rows): per-slot parameters arrive as a `Sampling`
pytree whose `bias` [B, V] is added to the logits first (the API's logit_bias, and -inf
where a slot's grammar forbids a token); each step also returns, of the model's own
distribution (log-softmax of the unbiased logits), the sampled token's log-probability and
the TOP_K most likely tokens, so logprobs cost no second pass.

`graphdef` (nnx) and `par` (the parallel setup, k3_jax/partitioning.py) are the static
part: jit_steps closes over them, one set of compiled steps per (model, mesh).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.cache import KDAState, ModelCache, PagedMLACache, replace
from k3_jax.serve import kv_pages as kv
from k3_jax.serve import limits
from k3_jax.serve.sampling import sample_rows
from k3_jax.stack import map_cache

TOP_K = limits.TOP_LOGPROBS   # alternatives returned per token


def _pytree(cls):
  return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class Sampling:
  """Per-row sampling parameters, every field [B] (bias [B, V])."""
  seeds: jax.Array          # int32: the request's seed
  steps: jax.Array          # int32: tokens it has generated (the key is seed folded with it)
  temperature: jax.Array    # f32, 0 = greedy
  top_p: jax.Array          # f32
  presence: jax.Array       # f32 penalties over the generated tokens (sampling.penalize)
  frequency: jax.Array
  bias: jax.Array           # f32 [B, V], added to the logits (-inf: never sampled)


@_pytree
class DecodeBatch:
  """One decode step's input: a token per slot."""
  tokens: jax.Array         # int32 [B]: each slot's last token
  pos: jax.Array            # int32 [B]: its position
  tables: jax.Array         # int32 [B, M]: its page table (idle rows: the null page)
  active: jax.Array         # bool [B]: idle slots keep their KDA state
  sampling: Sampling
  prev: jax.Array           # int32 [B]: the previous decode step's ids (kept on the device)
  from_prev: jax.Array      # bool [B]: the slot's token is prev's, not `tokens` (the host
                            # dispatched this step before reading that one: one step ahead)
  slots: jax.Array | None = None   # int32 [R]: with R < the slot count, the step runs R rows
                            # and row i is slot slots[i] (every other field then has R rows,
                            # `prev` keeps one per slot); None: row i is slot i


@_pytree
class Sampled:
  """What a step sampled, per row, with the model's own log-probabilities."""
  ids: jax.Array            # int32 [B]
  logprob: jax.Array        # f32 [B]: log p(ids) under log_softmax(logits)
  top_ids: jax.Array        # int32 [B, TOP_K], most likely first
  top_logprobs: jax.Array   # f32 [B, TOP_K]
  logits: jax.Array         # f32 [B, V]: the model's logits (before bias and penalties)
  by_slot: jax.Array | None = None   # int32 [slots]: a decode step's ids at their slots (the
                            # next step's `prev`; other slots keep the previous one)


def sample_logits(logits: jax.Array, counts: jax.Array, s: Sampling) -> Sampled:
  """logits [B, V] -> Sampled: penalties over `counts` [B, V], `bias`, temperature / top-p
  with per-row keys (sampling.sample_rows)."""
  raw = logits.astype(jnp.float32)
  ids = sample_rows(raw + s.bias, counts, s.seeds, s.steps, s.temperature, s.top_p,
                    s.presence, s.frequency)
  return with_logprobs(raw, ids)


def with_logprobs(raw: jax.Array, ids: jax.Array) -> Sampled:
  """Sampled of tokens ids [B] drawn from rows of raw [B, V] f32: their log-probabilities
  and the TOP_K most likely under the model's own log_softmax(raw)."""
  lp = jax.nn.log_softmax(raw, axis=-1)
  top_lp, top_ids = jax.lax.top_k(lp, min(TOP_K, lp.shape[-1]))
  chosen = jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]
  return Sampled(ids, chosen, top_ids.astype(jnp.int32), top_lp, raw)


def prefill_step(graphdef, par, params, rest, cache: ModelCache, slots, tokens, pos, tables,
                 valid, feats=None):
  """Prompt pieces of R slots at once, every piece T tokens: row i holds tokens [T] of slot
  slots[i] at positions pos[i] + [0, T), with page-table row tables[i]
  -> (each row's last logits [R, V], cache).

  Rows with valid[i] False pad the call to its compiled row count: they read slot
  slots[i]'s state but write nothing back (their KDA state is dropped; their table row is
  the null page, where their latents go). feats: a model with a vision tower gets, per row,
  the features [T, D] of that piece's image placeholders in order (zeros for a piece
  without any); scatter_features takes them in row-major order over the whole call."""
  logits, out = prefill_rows(graphdef, par, params, rest, cache, slots, tokens, pos, tables,
                             valid, feats, last_only=True)
  return logits[:, -1], out


def prefill_rows(graphdef, par, params, rest, cache: ModelCache, slots, tokens, pos, tables,
                 valid, feats=None, last_only: bool = True):
  """prefill_step's model call -> (logits [R, T or 1, V], cache): every position's logits
  without last_only (score_step), the last position's with it."""
  model = nnx.merge(graphdef, params, rest)
  image_features = None if feats is None else row_major_features(
      tokens, jnp.stack(feats), model.cfg.vision.image_token_id)
  logits, out, _ = on_rows(cache, slots, valid, pos, tables, lambda sub: model(
      tokens, cache=sub, image_features=image_features, last_only=last_only, par=par)[:2])
  return logits, out


def score_step(graphdef, par, params, rest, tokens):
  """Teacher-forced logits of one prompt, tokens [T] -> [T, V] f32 (row i: the logits after
  token i): the prefill's model call (prefill_rows) from position 0 over a paged cache of
  its own (one slot, its ceil(T / PAGE) pages after the null page, zeros), with every
  position's logits. The engine's cache is not touched (the completions API's echo)."""
  model = nnx.merge(graphdef, params, rest)
  pages = -(-tokens.shape[0] // kv.PAGE)
  cache = model.init_paged_cache(1, pages + 1, kv.PAGE)
  table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
  zero = jnp.zeros((1,), jnp.int32)
  logits, _ = prefill_rows(graphdef, par, params, rest, cache, zero, tokens[None], zero,
                           table, jnp.ones((1,), jnp.bool_), last_only=False)
  return logits[0].astype(jnp.float32)


def on_rows(cache: ModelCache, slots, valid, pos, tables, run):
  """run(sub) over the R slots `slots` (sub: the cache with those slots' KDA states and the
  rows' positions and page tables) -> (run's output, cache, keep): the rows' new KDA states
  are put back where valid (keep: each row's slot, past the batch where not, so dropped)."""
  states = kv.kda_states(cache)
  sub = kv.with_pages(kv.with_kda_states(cache, kv.take_rows(states, slots)), pos, tables)
  got, new = run(sub)
  new = kv.without_pages(new)
  keep = jnp.where(valid, slots, jnp.iinfo(jnp.int32).max)      # out of range: dropped
  out = kv.with_kda_states(new, kv.put_rows(states, keep, kv.kda_states(new)))
  return got, out.replace(pos=cache.pos), keep


def row_major_features(tokens, feats, placeholder_id: int):
  """Per-row placeholder features feats [R, T, D] (row i's placeholders take its rows in
  order) -> [R T, D] in the row-major placeholder order scatter_features reads."""
  r, t = tokens.shape
  mask = tokens == placeholder_id                                  # [R, T]
  local = jnp.clip(jnp.cumsum(mask, axis=1) - 1, 0, t - 1)         # rank within the row
  rank = jnp.cumsum(mask.reshape(-1)) - 1                          # rank within the call
  picked = jnp.take_along_axis(feats, local[..., None], axis=1).reshape(r * t, -1)
  dest = jnp.where(mask.reshape(-1), rank, r * t)                  # others: dropped
  return jnp.zeros_like(picked).at[dest].set(picked, mode="drop")


def decode_step(graphdef, par, params, rest, cache: ModelCache, counts, batch: DecodeBatch):
  """One token for every slot -> (Sampled [B], cache, counts). Idle slots keep their KDA
  state and write their MLA latents to the null page; `counts` [B, V] (each slot's
  generated-token counts, for the penalties) gains the active slots' new tokens.

  With batch.slots, only those R slots run (rows_decode_step): a step's cost follows the
  requests decoding, not the slot count."""
  if batch.slots is not None:
    return rows_decode_step(graphdef, par, params, rest, cache, counts, batch)
  model = nnx.merge(graphdef, params, rest)
  tokens = jnp.where(batch.from_prev, batch.prev, batch.tokens)
  # Each KDA layer keeps its idle rows' state as it writes the new one (KDAState.active):
  # a select over the whole stacked states after the model read them twice more and
  # needed a copy of the old ones (k3, 1,024 x 32K: ~33 GB per chip a step).
  mark = lambda e, axis: (replace(e, active=jnp.broadcast_to(batch.active,
                                                             e.state.shape[:axis + 1]))
                          if isinstance(e, KDAState) else e)
  marked = map_cache(mark, kv.with_pages(cache, batch.pos, batch.tables))
  logits, new, _ = model(tokens[:, None], cache=marked, par=par)
  out = map_cache(lambda e, axis: replace(e, active=None) if isinstance(e, KDAState) else e,
                  kv.without_pages(new))
  out = out.replace(pos=cache.pos)
  got = sample_logits(logits[:, 0], counts, batch.sampling)
  counts = counts.at[jnp.arange(got.ids.shape[0]), got.ids].add(batch.active.astype(jnp.int32))
  return dataclasses.replace(got, by_slot=got.ids), out, counts


def rows_decode_step(graphdef, par, params, rest, cache: ModelCache, counts,
                     batch: DecodeBatch):
  """decode_step over R rows, row i being slot batch.slots[i]: the rows' KDA states and
  counts are taken out, run like a batch of R, and put back (rows not active write nothing;
  their latents go to the null page). Each row computes the full step's functions, but
  XLA:CPU's matmul summation order follows the row count, so the logits agree to float
  rounding, not bitwise (test_prefill_batching.py: 1e-5): hence only without batch
  invariance."""
  model = nnx.merge(graphdef, params, rest)
  slots = batch.slots
  tokens = jnp.where(batch.from_prev, batch.prev[slots], batch.tokens)
  logits, out, keep = on_rows(cache, slots, batch.active, batch.pos, batch.tables,
                              lambda sub: model(tokens[:, None], cache=sub, par=par)[:2])
  got = sample_logits(logits[:, 0], counts[slots], batch.sampling)
  counts = counts.at[slots, got.ids].add(batch.active.astype(jnp.int32))
  by_slot = batch.prev.at[keep].set(got.ids, mode="drop")
  return dataclasses.replace(got, by_slot=by_slot), out, counts


def first_token(logits, row, counts, slot, sampling: Sampling):
  """The token sampled from a prompt's last logits, row `row` of a prefill's [R, V]
  (nothing generated yet, so no penalty applies; `sampling` has one row), counted in the
  slot's generated-token counts like every later one. -> (Sampled [1], counts)."""
  got = sample_logits(logits[row][None], jnp.zeros((1, logits.shape[-1]), jnp.int32), sampling)
  return got, counts.at[slot, got.ids[0]].add(1)


def load_slot(cache, ckpts, slot, c):
  states = kv.put_rows(kv.kda_states(cache), slot[None], kv.take_rows(ckpts, c[None]))
  return kv.with_kda_states(cache, states)


def zero_slot(cache, counts, slot):
  states = kv.kda_states(cache)
  states = kv.put_rows(states, slot[None], kv.zeros_rows(states, 1))
  return kv.with_kda_states(cache, states), counts.at[slot].set(0)


def set_counts(counts, slot, row):
  """The slot's generated-token counts := row [V] (a preempted request resuming)."""
  return counts.at[slot].set(row)


def copy_slot(cache, src, dst):
  """Slot dst's KDA state := slot src's (a fork: another sample of the same prompt)."""
  states = kv.kda_states(cache)
  return kv.with_kda_states(cache, kv.put_rows(states, dst[None],
                                               kv.take_rows(states, src[None])))


def save_ckpt(ckpts, cache, slot, c):
  return kv.put_rows(ckpts, c[None], kv.take_rows(kv.kda_states(cache), slot[None]))


def copy_page(cache, src, dst):
  """cache with page `dst` of every MLA layer's pool set to page `src` (bit copy)."""
  def cp(e, axis):
    if not isinstance(e, PagedMLACache):
      return e
    def one(a):
      return a.at[dst].set(a[src]) if axis == 0 else a.at[:, dst].set(a[:, src])
    return replace(e, c_kv=one(e.c_kv), k_r=one(e.k_r))
  return map_cache(cp, cache)


def encode(graphdef, params, rest, images):
  """packed images -> projected features [M, D] f32 (one dtype for every prefill)."""
  return nnx.merge(graphdef, params, rest).vision(images).astype(jnp.float32)


def piece_features(d_model, feats, rows):
  """rows [T] of the request's image features feats [M, D] (the piece's placeholders, in
  order); feats None: zeros [T, d_model] (a piece without placeholders)."""
  if feats is None:
    return jnp.zeros((rows.shape[0], d_model), jnp.float32)
  return feats[rows]


class ServeSteps(NamedTuple):
  """The jitted steps of one (model, parallel setup); the cache arguments are donated."""
  prefill: Callable
  decode: Callable
  first_token: Callable
  load_slot: Callable
  copy_slot: Callable
  zero_slot: Callable
  save_ckpt: Callable
  encode: Callable
  copy_page: Callable
  piece_features: Callable
  set_counts: Callable


def bind(fn, *static):
  """fn with its leading static arguments bound (a plain function, for jax.jit)."""
  def bound(*args):
    return fn(*static, *args)
  bound.__name__ = fn.__name__
  return bound


def flat_params(fn, treedefs):
  """fn(params, rest, *args) as f(params' leaves, rest's leaves, *args): jit flattens a list
  of arrays in C++, where an nnx Variable tree costs Python work on every call (~0.4 ms a
  step for a small model, a fifth of its decode step)."""
  if treedefs is None:
    return fn
  p_def, r_def = treedefs

  def f(p_leaves, r_leaves, *args):
    return fn(p_def.unflatten(p_leaves), r_def.unflatten(r_leaves), *args)
  f.__name__ = fn.__name__
  return f


def jit_steps(graphdef, par, jit=jax.jit, treedefs=None) -> ServeSteps:
  """The serving steps of `graphdef` under `par`, jitted with the cache donated. `jit` may
  add shardings (compile passes one with in/out shardings). treedefs: (params', rest's):
  prefill, decode and encode then take the two trees' leaves (flat_params)."""
  return ServeSteps(
      prefill=jit(flat_params(bind(prefill_step, graphdef, par), treedefs), donate_argnums=(2,)),
      decode=jit(flat_params(bind(decode_step, graphdef, par), treedefs),
                 donate_argnums=(2, 3)),
      first_token=jit(first_token, donate_argnums=(2,)),
      load_slot=jit(load_slot, donate_argnums=(0,)),
      copy_slot=jit(copy_slot, donate_argnums=(0,)),
      zero_slot=jit(zero_slot, donate_argnums=(0, 1)),
      save_ckpt=jit(save_ckpt, donate_argnums=(0,)),
      encode=jit(flat_params(bind(encode, graphdef), treedefs)),
      copy_page=jit(copy_page, donate_argnums=(0,)),
      piece_features=jit(piece_features, static_argnums=(0,)),
      set_counts=jit(set_counts, donate_argnums=(0,)))


__all__ = ["TOP_K", "Sampling", "DecodeBatch", "Sampled", "sample_logits", "with_logprobs",
           "prefill_step", "prefill_rows", "score_step", "decode_step", "rows_decode_step",
           "on_rows", "row_major_features",
           "first_token", "load_slot", "copy_slot", "zero_slot", "save_ckpt", "encode",
           "copy_page", "piece_features", "set_counts", "ServeSteps", "flat_params", "jit_steps"]
