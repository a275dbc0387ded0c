"""The samples of one prefill (a request's n > 1, Request.fork_of): the first sample's
prompt is prefilled once, and when it is done the others start from it here.

Each fork gets a slot holding the lead's KDA state after the prompt (runner.copy_slot),
shares the prompt's whole pages (KVManager.fork), continues in a copy of the partial last
page, and samples its first token from the lead's logits with its own parameters. One that
finds no slot or pages joins the queue as a request of its own (a cold prefill, prefix
cache permitting); one cancelled before it started ends (Roster.drop_cancelled). A fault
in one fork's start fails that fork alone (the engine's `_own`)."""

from __future__ import annotations

from k3_jax.serve import output
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.requests import Request
from k3_jax.serve.runner import shared


def start(eng, lead: Request, logits, row: int) -> None:
  """Starts the samples waiting on `lead`'s prefill (row `row` of the prefill's `logits`),
  now that its slot holds the state after the prompt."""
  with eng.lock:
    forks, lead.forks = lead.forks, []
  n = lead.prompt.size
  full, part = divmod(n, PAGE)
  for f in forks:
    if f.cancelled:
      eng.roster.drop_cancelled(f)
      continue
    with eng.lock, shared("the page pool bookkeeping"):
      fresh = eng.kv.fork(lead.slot, eng.free_slots[-1], full, n + 1) \
          if eng.free_slots else None
      if fresh is None:
        f.fork_of = None
        eng.waiting.appendleft(f)
        continue
      f.feed, f.pos = lead.feed, n
      f.cached_tokens, f.hashes, f.registered = n, lead.hashes, lead.registered
      eng.roster.seat(f, eng.free_slots.pop(), "decode")
    eng._own(f, _begin, eng, f, lead, logits, row, (full, part, fresh))


def _begin(eng, f: Request, lead: Request, logits, row: int, layout) -> None:
  """Fork f's device state (slot, partial page) and its first token."""
  full, part, fresh = layout
  eng.runner.seat(f.slot)
  eng.runner.copy_slot(lead.slot, f.slot)
  if part:
    eng.runner.copy_page(eng.tables[lead.slot, full], fresh[0])
  f.decoder = eng.tokenizer.stream_decoder() if eng.tokenizer is not None else None
  bias = output.biases([f], eng.cfg.vocab_size)
  eng._take(f, eng.runner.first_token(logits, row, f, bias), 0)
