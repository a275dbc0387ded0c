"""A KDA layer in a speculative verify step (k3_jax/serve/verify.py): T tokens per row, the
state kept, the inputs recorded; after acceptance the accepted prefix is replayed.

The verify step runs the model over B T rows of one token each (row b T + t: token t of
sequence b's window), so every other layer computes exactly what a decode step computes
for that token. A KDA layer is the exception: token t needs the state after tokens < t.
`window_call` folds the rows back to [B, T], runs the layer's own decode pieces token by
token (the one-step short convolution and recurrence of a plain decode, in order), and
returns the outputs of every position while leaving the state and the conv tails untouched:
which of the T tokens are kept is known only after the logits. What the recurrence and the
convolutions read is recorded instead (cache.KDAWindow), and `replay` applies the first
n[b] tokens of it to the kept state: the same one-step recurrence on the same inputs, so
the state is the one decoding only the accepted tokens gives.

Memory: the record is 4 H K f32 + H f32 + 3 H K (conv inputs, model dtype) per token and
layer, about V / 4 times less than keeping the [H, K, V] f32 state of every position.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3_jax.cache import KDAState, KDAWindow
from k3_jax.ops import kda as kda_ops
from k3_jax.partitioning import SINGLE, Parallel


def empty_window(entry: KDAState, lead: tuple, t: int) -> KDAWindow:
  """A zero KDAWindow for `entry` (leading axes `lead`: (B,) or (R, B)) and T = t tokens:
  what marks a KDA layer's cache for a verify step (the layer fills it)."""
  h, k, v = entry.state.shape[-3:]
  hk = entry.conv_q.shape[-1]
  f = lambda *s: jnp.zeros(lead + (t,) + s, jnp.float32)
  x = lambda: jnp.zeros(lead + (t, hk), entry.conv_q.dtype)
  return KDAWindow(q=f(h, k), k=f(h, k), v=f(h, v), g=f(h, k), beta=f(h), xq=x(), xk=x(),
                   xv=x())


def window_call(layer, x: jax.Array, cache: KDAState, par: Parallel = SINGLE):
  """x [B T, 1, D] (row b T + t: token t of row b's window) -> (y [B T, 1, D], cache with
  the state and tails as given and `window` the record of the T tokens)."""
  b, t = cache.window.beta.shape[:2]
  fold = lambda a: a.reshape((b, t) + a.shape[1:])       # [B T, 1, ...] -> [B, T, 1, ...]
  xq, xk, xv, zf, gate = layer._inputs(x, par)
  convs, raws = [], []
  for raw, weight, tail in ((xq, layer.q_conv, cache.conv_q), (xk, layer.k_conv, cache.conv_k),
                            (xv, layer.v_conv, cache.conv_v)):
    raw = fold(raw)                                      # [B, T, 1, H, K]
    ys = []
    for i in range(t):                                   # the decode's one-step convolution
      y, tail = layer._conv(raw[:, i], weight, None, tail, par)
      ys.append(y)
    convs.append(jnp.stack(ys, axis=1))                  # [B, T, 1, H, K] f32
    raws.append(raw.reshape(b, t, -1))
  q, k = kda_ops.l2_normalize(convs[0]), kda_ops.l2_normalize(convs[1])
  v = convs[2]
  beta = fold(jax.nn.sigmoid(layer.b_proj(x).astype(jnp.float32)))    # [B, T, 1, H]
  g = fold(layer._decay(zf))                                           # [B, T, 1, H, K]
  state, outs = cache.state, []
  for i in range(t):                                     # the decode's one-step recurrence
    o, state = kda_ops.decode_step(q[:, i, 0], k[:, i, 0], v[:, i, 0], g[:, i, 0],
                                   beta[:, i, 0], state, backend=par.kernels.kda_backend,
                                   par=par)
    outs.append(o)
  o = jnp.stack(outs, axis=1).reshape((b * t, 1) + outs[0].shape[1:])   # [B T, 1, H, V]
  y = layer._output(o, gate)
  rec = KDAWindow(q=q[:, :, 0], k=k[:, :, 0], v=v[:, :, 0], g=g[:, :, 0], beta=beta[:, :, 0],
                  xq=raws[0], xk=raws[1], xv=raws[2])
  rec = jax.tree.map(lambda new, old: new.astype(old.dtype), rec, cache.window)
  return y, KDAState(state=cache.state, conv_q=cache.conv_q, conv_k=cache.conv_k,
                     conv_v=cache.conv_v, active=cache.active, window=rec)


def replay(entry: KDAState, keep: jax.Array, backend: str = "reference",
           par: Parallel = SINGLE) -> KDAState:
  """The state and conv tails after the first keep[b] tokens of row b's recorded window
  (0: as they were), window dropped. entry's arrays may carry leading axes (R, B) (a
  scanned unit's); keep is [B]."""
  w = entry.window
  h, k, v = entry.state.shape[-3:]
  t = w.beta.shape[-2]
  lead = entry.state.shape[:-3]
  n = math.prod(lead)
  flat = lambda a: a.reshape((n,) + a.shape[len(lead):])
  keep = jnp.broadcast_to(keep, lead).reshape(n)
  state = flat(entry.state)
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


__all__ = ["empty_window", "window_call", "replay"]
