"""Speculative decoding in the engine: drafts per request, one verify step for the batch,
several tokens emitted a step (ServeConfig.speculative / num_speculative_tokens).

Per engine step `Speculator.decode` asks the drafter for each decoding request's drafts
(drafters.py: prompt lookup; draft_model.py: a smaller model, every request at once) and
runs the verify step (verify.py) in place of the decode step, over the slots with requests
(padded to a power of two like a decode step; every slot with ServeConfig.batch_invariant):
a slot without drafts is a plain decode row of it (mixed batches), an idle slot keeps its
state. Each request then emits its kept drafts and the model's next token in order, through
the engine's own _take (logprobs, stop ids and strings, max_tokens, streaming: a stream gets
all of them in one step). With batch_invariant every decode step is a verify step over
every slot, drafts or not: the verify step's rows are B (k + 1) where the decode step's are
B, and XLA moves a row's logits in the last bits with the row count (the plain decode step
itself does, 8 against 32 slots: 4.8e-7), so a request's logits would otherwise depend on
whether another request drafted. Without it the plain decode step runs when no request has
drafts (cheaper).

What it leaves as it was:
- the prefix cache: the prefill registers prompt blocks; a finished request's decoded
  blocks (turn_cache.py) are its accepted tokens' latents, exact, and no KDA checkpoint is
  taken inside a verify step, so no checkpoint can hold a rejected draft; the KDA state
  after a verify step is the state of the kept tokens (verify.py), so later prefill pieces
  or forks start from an exact one;
- a request's output: greedy equals plain decoding's (to the verify step's float tolerance,
  tests/serve/test_speculate.py); sampled output has the target's distribution
  (acceptance.py), each token drawn with its token index's key;
- batch invariance (with it): drafts depend on the request's own tokens only, and every
  row of the verify step on its own slot.

Not speculated (they decode plainly inside the step): requests with a grammar constraint
(their bias row would need the grammar advanced through each draft). With overlap on, a
step that verifies first reads the previous step's tokens (the drafts need them).
"""

from __future__ import annotations

import jax
import numpy as np

from k3_jax.serve import draft_model, output, planner, steps
from k3_jax.serve import verify as vf
from k3_jax.serve.drafters import make_drafter
from k3_jax.serve.runner import bucket, guard


class Speculator:
  def __init__(self, engine, kind: str, k: int):
    self.k = k
    self.drafter = (draft_model.load(engine.serve.draft_dir, engine) if kind == "draft"
                    else make_drafter(kind))
    run = engine.runner
    (_, p_def), (_, r_def) = (jax.tree.flatten(t) for t in (run.params, run.rest))
    fn = jax.jit(steps.flat_params(steps.bind(vf.verify_step, run.graphdef, run.par),
                                   (p_def, r_def)),
                 donate_argnums=(2, 3))
    self._verify = guard("verify", run.relayed("verify", fn), run.compiled)
    # totals (/metrics, benchmarks): verify steps, requests in them, tokens emitted,
    # drafts verified and kept
    self.steps = self.rows = self.tokens = self.drafted = self.accepted = 0

  def ask(self, r):
    """(r's tokens so far, how many drafts it may take), or None: no drafts for a
    constrained request or one at its last token."""
    room = r.params.max_tokens - len(r.output_ids) - 1
    if r.constraint is not None or room <= 0:
      return None
    return np.concatenate([r.prompt, np.asarray(r.output_ids, np.int32)]), min(self.k, room)

  def propose(self, eng, dec: list) -> dict:
    """id(r) -> r's drafts this step, for the requests of `dec` (a request's own fault in
    asking fails it alone; a draft model drafts every request at once)."""
    asks = {}
    for r in dec:
      eng._own(r, lambda: asks.__setitem__(id(r), self.ask(r)))
    live = [r for r in dec if r.state == "decode" and asks.get(id(r)) is not None]
    drafts = {id(r): [] for r in dec}
    if hasattr(self.drafter, "propose_batch"):
      got = self.drafter.propose_batch([(r.slot, *asks[id(r)]) for r in live])
      drafts.update({id(r): d[:asks[id(r)][1]] for r, d in zip(live, got)})
    else:
      for r in live:
        eng._own(r, lambda: drafts.__setitem__(
            id(r), self.drafter.propose(*asks[id(r)])[:asks[id(r)][1]]))
    return drafts

  def decode(self, eng, dec: list) -> list | None:
    """This step's decode for `dec`: a verify step when some request has drafts (-> None),
    else the requests the engine's plain decode step should run (-> list)."""
    if eng._pending is not None:          # the drafts need the unread tokens
      pend, eng._pending = eng._pending, None
      eng._read_decode(pend)
      dec = [r for r in dec if r.state == "decode"]
    drafts = self.propose(eng, dec)
    dec = [r for r in dec if r.state == "decode"]
    if not dec or (not eng.serve.batch_invariant and not any(drafts.get(id(r)) for r in dec)):
      return dec
    now = eng._grow(dec, lambda r: r.pos + 1 + len(drafts[id(r)]))
    biases = {}
    now = [r for r in now if eng._own(
        r, lambda: biases.update(output.biases([r], eng.cfg.vocab_size)))]
    if now:
      self._run(eng, now, drafts, biases)
    return None

  def _run(self, eng, now, drafts, biases) -> None:
    """One verify step over the slots of `now` (padded with idle ones to a power of two, as
    planner.decode_slots pads a decode step; all slots with batch_invariant)."""
    run, k, t = eng.runner, self.k, self.k + 1
    slots = planner.decode_slots([r.slot for r in now], eng.max_batch,
                                 eng.serve.batch_invariant)
    rows = np.arange(eng.max_batch, dtype=np.int32) if slots is None else slots
    b, row = rows.size, {int(s): i for i, s in enumerate(rows)}
    tokens, pos, ndraft = (np.zeros(b, np.int32) for _ in range(3))
    window, active = np.zeros((b, k), np.int32), np.zeros(b, bool)
    tables = np.zeros((b, eng.tables.shape[1]), eng.tables.dtype)
    for r in now:
      i, d = row[r.slot], drafts[id(r)]
      tokens[i], pos[i], ndraft[i], active[i], tables[i] = r.last_token, r.pos, len(d), True, \
          eng.tables[r.slot]
      window[i, :len(d)] = d
    width = bucket(int(pos.max()) + t, eng.pages_per_slot)
    sampling = run.sampling(now, eng.max_batch, biases)
    if slots is not None:
      sampling = run.sampling_rows(sampling, slots, bool(biases))
    batch = vf.VerifyBatch(tokens, window, ndraft, pos, tables[:, :width], active, sampling,
                           slots)
    got, emitted, run.cache, run.counts = self._verify(*run.weights, run.cache, run.counts,
                                                       batch)
    host = output.HostSampled(got, now, run.fetch)
    emitted = np.asarray(run.fetch(emitted))
    self.steps += 1
    self.rows += len(now)
    for r in now:
      s, i = r.slot, row[r.slot]
      self.drafted += int(ndraft[i])
      self.accepted += int(emitted[i]) - 1
      for j in range(int(emitted[i])):
        if r.state != "decode" or r.slot != s:      # ended (stop, length, its own fault)
          break
        r.pos += 1
        self.tokens += 1
        eng._own(r, eng._take, r, host, i * t + j)


def for_engine(engine):
  """The engine's Speculator, or None when ServeConfig.speculative is 'off'."""
  s = engine.serve
  return None if s.speculative == "off" else Speculator(engine, s.speculative,
                                                        s.num_speculative_tokens)


__all__ = ["Speculator", "for_engine"]
