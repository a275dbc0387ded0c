"""A KDA layer in a speculative verify step (k3_jax/serve/verify.py): T tokens per row, the
state kept, the window recorded; after acceptance the state of the accepted prefix is made.

The verify step runs the model over B T rows of one token each (row b T + t: token t of
sequence b's window), so every other layer computes exactly what a decode step computes
for that token. A KDA layer is the exception: token t needs the state after tokens < t.
`window_call` folds the rows back to [B, T], runs the three short convolutions over the
window at once (from the cached tails, as a prefill piece does) and the one-step
recurrence of a plain decode token by token, and returns the outputs of every position
while leaving the state and the conv tails untouched: which of the T tokens are kept is
known only after the logits. `keep[b]` of them are kept; `replay` then makes the state and
tails after those, in one of two ways (cache.KDAWindow), chosen per layer by the size of
its state:

  keep states   every position's state is kept in the record and the kept one selected:
                no second pass, T states a row (chosen while one token's state of a layer
                is at most KEEP_STATES_BYTES: small models, where a step's cost is its
                operations, not its bytes);
  replay        what the recurrence read (q, k, v, g, beta) is recorded and the first
                keep[b] tokens are applied again to the kept state: the same one-step
                recurrence on the same inputs, so the state is the one decoding only the
                accepted tokens gives; about V / 4 times less memory than a state a
                position (k3: 18.7 MB a slot and window token against 436 MB).

The tails are the last W - 1 of [old tail, the kept inputs] (the conv inputs are in the
record either way).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3_jax.cache import KDAState, KDAWindow
from k3_jax.ops import kda as kda_ops
from k3_jax.partitioning import SINGLE, Parallel

KEEP_STATES_BYTES = 1 << 20     # a layer's state of one token up to this: keep every position's


def keeps_states(entry: KDAState) -> bool:
  """Whether a verify step keeps every window position's state for this layer (else it
  records the recurrence's inputs and replays): its one-token state [H, K, V] f32 is at
  most KEEP_STATES_BYTES."""
  return math.prod(entry.state.shape[-3:]) * 4 <= KEEP_STATES_BYTES


def empty_window(entry: KDAState, lead: tuple, t: int, keep_states: bool | None = None
                 ) -> KDAWindow:
  """A zero KDAWindow for `entry` (leading axes `lead`: (B,) or (R, B)) and T = t tokens:
  what marks a KDA layer's cache for a verify step (the layer fills it). keep_states: the
  way (module docstring); None: by keeps_states."""
  h, k, v = entry.state.shape[-3:]
  hk = entry.conv_q.shape[-1]
  f = lambda *s: jnp.zeros(lead + (t,) + s, jnp.float32)
  x = lambda: jnp.zeros(lead + (t, hk), entry.conv_q.dtype)
  if keep_states is None:
    keep_states = keeps_states(entry)
  if keep_states:
    return KDAWindow(xq=x(), xk=x(), xv=x(), states=f(h, k, v))
  return KDAWindow(xq=x(), xk=x(), xv=x(), q=f(h, k), k=f(h, k), v=f(h, v), g=f(h, k),
                   beta=f(h))


def window_call(layer, x: jax.Array, cache: KDAState, par: Parallel = SINGLE):
  """x [B T, 1, D] (row b T + t: token t of row b's window) -> (y [B T, 1, D], cache with
  the state and tails as given and `window` the record of the T tokens)."""
  b, t = cache.window.xq.shape[:2]
  fold = lambda a: a.reshape((b, t) + a.shape[1:])       # [B T, 1, ...] -> [B, T, 1, ...]
  xq, xk, xv, zf, gate = layer._inputs(x, par)
  convs, raws = [], []
  for raw, weight, tail in ((xq, layer.q_conv, cache.conv_q), (xk, layer.k_conv, cache.conv_k),
                            (xv, layer.v_conv, cache.conv_v)):
    raw = fold(raw)[:, :, 0]                             # [B, T, H, K]
    y, _ = layer._conv(raw, weight, None, tail, par)     # the window from the cached tail
    convs.append(y)                                      # [B, T, H, K] f32
    raws.append(raw.reshape(b, t, -1))
  q, k = kda_ops.l2_normalize(convs[0]), kda_ops.l2_normalize(convs[1])
  v = convs[2]
  beta = fold(jax.nn.sigmoid(layer.b_proj(x).astype(jnp.float32)))[:, :, 0]   # [B, T, H]
  g = fold(layer._decay(zf))[:, :, 0]                                         # [B, T, H, K]
  w = cache.window

  def step(state, xs):                                   # the decode's one-step recurrence
    o, state = kda_ops.decode_step(*xs, state, backend=par.kernels.kda_backend, par=par)
    return state, (o, state if w.states is not None else None)

  # a loop over the window, not T unrolled steps: its states are made once, in a buffer
  # (unrolled, XLA:CPU fused their recurrence into `replay`'s pick and computed it again
  # there: 0.13 ms a layer of a k3_small verify step)
  _, (outs, states) = jax.lax.scan(step, cache.state,
                                   tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
  o = jnp.moveaxis(outs, 0, 1).reshape((b * t, 1) + outs.shape[2:])   # [B T, 1, H, V]
  y = layer._output(o, gate)
  rec = KDAWindow(xq=raws[0], xk=raws[1], xv=raws[2],
                  **(dict(states=jnp.moveaxis(states, 0, 1)) if w.states is not None else
                     dict(q=q, k=k, v=v, g=g, beta=beta)))
  rec = jax.tree.map(lambda new, old: new.astype(old.dtype), rec, w)
  return y, KDAState(state=cache.state, conv_q=cache.conv_q, conv_k=cache.conv_k,
                     conv_v=cache.conv_v, active=cache.active, window=rec)


def replay(entry: KDAState, keep: jax.Array, backend: str = "reference",
           par: Parallel = SINGLE) -> KDAState:
  """The state and conv tails after the first keep[b] tokens of row b's recorded window
  (0: as they were), window dropped. entry's arrays may carry leading axes (R, B) (a
  scanned unit's); keep is [B]."""
  w = entry.window
  t = w.xq.shape[-2]
  lead = entry.state.shape[:-3]
  n = math.prod(lead)
  flat = lambda a: a.reshape((n,) + a.shape[len(lead):])
  keep = jnp.broadcast_to(keep, lead).reshape(n)
  state = flat(entry.state)
  if w.states is not None:      # the state after token keep - 1 (keep 0: the old one)
    kept = jnp.take_along_axis(flat(w.states), jnp.maximum(keep - 1, 0)[:, None, None, None,
                                                                         None], axis=1)[:, 0]
    state = jnp.where((keep > 0)[:, None, None, None], kept, state)
  else:
    q, kk, vv, g, beta = (flat(a) for a in (w.q, w.k, w.v, w.g, w.beta))
    for i in range(t):
      _, new = kda_ops.decode_step(q[:, i], kk[:, i], vv[:, i], g[:, i], beta[:, i], state,
                                   backend=backend, par=par)
      state = jnp.where((i < keep)[:, None, None, None], new, state)

  def tail(old, raw):           # the last W-1 of [old tail, the kept inputs]
    whole = jnp.concatenate([flat(old), flat(raw).astype(old.dtype)], axis=1)
    idx = keep[:, None] + jnp.arange(old.shape[-2])[None]
    return jnp.take_along_axis(whole, idx[:, :, None], axis=1).reshape(old.shape)

  return KDAState(state=state.reshape(entry.state.shape),
                  conv_q=tail(entry.conv_q, w.xq), conv_k=tail(entry.conv_k, w.xk),
                  conv_v=tail(entry.conv_v, w.xv), active=entry.active)


__all__ = ["KEEP_STATES_BYTES", "keeps_states", "empty_window", "window_call", "replay"]
