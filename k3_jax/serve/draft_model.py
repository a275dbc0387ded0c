"""A draft model as a drafter (`serve --speculative=draft --draft_dir=DIR`): a smaller model
with the target's tokenizer proposes each request's next k tokens by greedy decoding, run
by the serving machinery (its own Runner: a paged cache, the jitted prefill / decode steps,
a KDA checkpoint row per slot).

Draft slot s follows target slot s. What it holds is kept in step with the request's
accepted tokens, never with its own rejected guesses:

  fed[s]      the tokens whose state the slot's checkpoint row holds (all but the request's
              last token): the slot's KDA state after them is saved there before drafting
  drafting    k greedy decode steps from the last token (each step takes the previous one's
              token on the device: no read back between them); they write the slot's MLA
              latents past fed[s] and move its KDA state past it
  next call   the request's tokens now (fed[s], the drafts it kept, the target's token):
              the state is restored from the checkpoint row (the drafts' moves dropped, as
              a rejected draft's state must be) and the tokens past fed[s] are fed, which
              rewrites every latent position a draft wrote and a kept token now holds.
              A slot whose fed[s] is not a prefix of its request's tokens (a new request,
              a preempted one) starts over from a zero state.

So a draft is always the draft model's greedy continuation of the request's exact tokens.
Feeding: whole `piece`-token prefill pieces (one row a call), the rest by decode steps of
every slot at once. Pages: slot s owns its pages (1 + s M ... (s + 1) M for M pages a slot),
so no other slot or cache ever writes them.

Cost per target step: (kept drafts + 1) feeding decode steps and k drafting decode steps
of the draft model, for every drafting request at once.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from k3_jax.serve import kv_pages as kv
from k3_jax.serve import steps
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.runner import Runner, bucket


class ModelDrafter:
  def __init__(self, cfg, graphdef, params, rest, max_batch: int, max_len: int,
               piece: int = 64, share: Runner | None = None):
    """The draft model (cfg, graphdef, params, rest) for a target engine of max_batch slots
    and max_len tokens a sequence. piece: prefill piece size (tokens) for feeding long
    prompts. share: a Runner of the same model and shapes whose compiled steps to use (a
    test's; None: its own)."""
    self.cfg, self.max_batch, self.piece = cfg, max_batch, piece
    self.pages_per_slot = math.ceil(max_len / PAGE)
    self.run = Runner(cfg, graphdef, params, rest, max_batch)
    self.run.allocate(kv.pool_pages(max_batch, self.pages_per_slot), max_batch)
    if share is not None:
      self.run.steps, self.run.weights = share.steps, share.weights
    m = self.pages_per_slot
    self.tables = (1 + np.arange(max_batch)[:, None] * m + np.arange(m)[None]).astype(np.int32)
    self.fed: list[np.ndarray | None] = [None] * max_batch
    self.greedy = steps.Sampling(*(np.zeros(max_batch, d) for d in (np.int32, np.int32,
                                                                    np.float32)),
                                 np.ones(max_batch, np.float32),
                                 *(np.zeros(max_batch, np.float32) for _ in range(2)),
                                 self.run.zero_bias(max_batch))

  def propose(self, tokens, k):
    raise TypeError("a draft model drafts for a request's slot: propose_batch")

  def propose_batch(self, items: list[tuple[int, np.ndarray, int]]) -> list[list[int]]:
    """items: (slot, the request's tokens so far [n >= 1], k) -> each one's k drafts."""
    if not items:
      return []
    run = self.run
    feed = {}
    for s, toks, _ in items:
      toks = np.asarray(toks, np.int32)
      old = self.fed[s]
      if old is not None and old.size <= toks.size - 1 and np.array_equal(toks[:old.size], old):
        run.cache = run.steps.load_slot(run.cache, run.ckpts, np.int32(s), np.int32(s))
        start = old.size
      else:                                          # a new request (or resumed): from zero
        run.seat(s)
        start = 0
      feed[s] = (toks, start)
    self._feed(feed)
    for s, (toks, _) in feed.items():
      run.save_ckpt(s, s)
      self.fed[s] = toks[:-1].copy()
    return self._draft([(s, feed[s][0], k) for s, _, k in items])

  def _feed(self, feed: dict) -> None:
    """Feeds each slot's tokens [start, n - 1): whole pieces by prefill, the rest by decode
    steps of every slot at once."""
    run, todo = self.run, {}
    for s, (toks, start) in feed.items():
      end = toks.size - 1
      while end - start >= self.piece:                # one prefill piece a call
        width = bucket(start + self.piece, self.pages_per_slot)
        _, run.cache = run.steps.prefill(
            *run.weights, run.cache, np.array([s], np.int32),
            toks[None, start:start + self.piece], np.array([start], np.int32),
            self.tables[s:s + 1, :width], np.ones(1, bool), None)
        start += self.piece
      todo[s] = (toks, start, end)
    for i in range(max((end - start for _, start, end in todo.values()), default=0)):
      rows = {s: (toks[start + i], start + i) for s, (toks, start, end) in todo.items()
              if start + i < end}
      self._step(rows)

  def _step(self, rows: dict, from_prev: bool = False):
    """One draft decode step over every slot: rows {slot: (token, position)} active (with
    from_prev, the token is the previous step's on the device)."""
    run, b = self.run, self.max_batch
    tokens, pos = np.zeros(b, np.int32), np.zeros(b, np.int32)
    active = np.zeros(b, bool)
    for s, (t, p) in rows.items():
      tokens[s], pos[s], active[s] = t, p, True
    width = bucket(int(pos.max()) + 1, self.pages_per_slot)
    table = np.where(active[:, None], self.tables[:, :width], 0).astype(np.int32)
    batch = steps.DecodeBatch(tokens, pos, table, active, self.greedy, run.prev,
                              active & from_prev)
    got, run.cache, run.counts = run.steps.decode(*run.weights, run.cache, run.counts, batch)
    run.prev = got.by_slot
    return got.ids

  def _draft(self, items) -> list[list[int]]:
    """k greedy decode steps from each item's last token (the slot's state after the rest)."""
    k = max(k for _, _, k in items)
    ids = []
    for j in range(k):
      rows = {s: (toks[-1], toks.size - 1 + j) for s, toks, n in items if j < n}
      ids.append(self._step(rows, from_prev=j > 0))
    got = np.stack([np.asarray(a) for a in jax.device_get(ids)], axis=1)   # [slots, k]
    return [got[s, :n].tolist() for s, _, n in items]


def load(draft_dir: str, engine) -> ModelDrafter:
  """The ModelDrafter of a training workdir's model for `engine` (the target's). The two
  must share the tokenizer: the same vocabulary size and the same tokenizer setting."""
  from k3_jax.checkpoint.inference import load_for_inference
  from k3_jax.config import UserError
  from sharding.mesh import make_mesh
  got = load_for_inference(draft_dir, make_mesh(devices=jax.devices()[:1]), None,
                           lambda m: None)
  cfg, g, p, r = got.cfg, got.graphdef, got.params, got.rest
  if cfg.vocab_size != engine.cfg.vocab_size:
    raise UserError(f"--draft_dir={draft_dir}: the draft model's vocabulary "
                    f"({cfg.vocab_size}) is not the served model's ({engine.cfg.vocab_size}); "
                    "a draft model needs the same tokenizer")
  if cfg.max_seq_len < engine.max_len:
    raise UserError(f"--draft_dir={draft_dir}: the draft model's max_seq_len "
                    f"({cfg.max_seq_len}) is shorter than the served max_len ({engine.max_len})")
  return ModelDrafter(cfg, g, p, r, engine.max_batch, engine.max_len)


__all__ = ["ModelDrafter", "load"]
