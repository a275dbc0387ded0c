"""POST /v1/completions: the prompt forms, `n`, `best_of`, `logprobs` and `echo`, and the
handler that runs the choices through the engine client (client.py; logprobs.py holds the
arithmetic).

Prompt forms (OpenAI's): a string, a list of strings, a list of token ids, or a list of
token-id lists; each prompt gives `n` choices, numbered prompt-major (choice index =
prompt index * n + sample). The samples of one prompt run as separate requests with seeds
seed, seed + 1, ... (so a seeded request is reproducible and its samples differ); they share
one prefill: the others fork off the first one's (Request.fork_of).
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
from k3_jax.serve import api_params, api_schema, grammar, logprobs
from k3_jax.serve.api_errors import DONE, ApiError, guarded, sse
from k3_jax.serve.api_params import ParamError
from k3_jax.serve.client import Api, Run, constraints, finish_reason


def prompt_list(prompt, tokenizer, vocab_size: int | None = None) -> list[list[int]]:
  """A validated `prompt` (api_schema's forms) as token-id lists (ParamError naming `prompt`
  for a text prompt without a tokenizer, one that encodes to nothing, or an id past
  `vocab_size`: a scored prompt never reaches the engine's own check)."""
  def ids_of(p) -> list[int]:
    if isinstance(p, str):
      if tokenizer is None:
        raise ParamError("text prompts need a tokenizer; send token ids", "prompt")
      return list(tokenizer.encode(p))
    return list(p)

  if isinstance(prompt, str) or isinstance(prompt[0], int):
    out = [ids_of(prompt)]
  else:
    out = [ids_of(p) for p in prompt]
  for i, ids in enumerate(out):
    if not ids:
      raise ParamError(f"prompt {i} is empty", "prompt")
    if vocab_size is not None and max(ids) >= vocab_size:
      raise ParamError(f"prompt {i} holds token ids outside the model's vocabulary "
                       f"[0, {vocab_size}): {[t for t in ids if t >= vocab_size][:5]}", "prompt")
  return out


@dataclasses.dataclass(frozen=True)
class Options:
  n: int = 1
  logprobs: int | None = None       # None: no logprobs; 0-5: the chosen token (+ top-k)
  echo: bool = False
  score_only: bool = False          # max_tokens=0 with echo: the prompt's log-probabilities


def options(req: api_schema.CompletionRequest) -> Options:
  """The choices' options of a validated request."""
  return Options(n=1 if req.n is None else req.n, logprobs=req.logprobs,
                 echo=bool(req.echo), score_only=req.max_tokens == 0)


def merge_logprobs(a, b):
  """The echoed prompt's logprobs object followed by the completion's."""
  tops = (None if a["top_logprobs"] is None and b["top_logprobs"] is None
          else (a["top_logprobs"] or []) + (b["top_logprobs"] or []))
  return {"tokens": a["tokens"] + b["tokens"],
          "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
          "top_logprobs": tops, "text_offset": a["text_offset"] + b["text_offset"]}


def take_rows(req, start, stop):
  """The recorded logits rows of output tokens [start, stop), released once read."""
  rows = req.logits[start:stop]
  for i in range(start, min(stop, len(req.logits))):
    req.logits[i] = None
  return rows


class Completion:
  """One /v1/completions request: its choices (Run.index = prompt * draws + draw), run
  through the engine client, answered whole or streamed."""

  def __init__(self, api: Api, body: dict, req: api_schema.CompletionRequest, http):
    self.api, self.body, self.req, self.http, tok = api, body, req, http, api.tokenizer
    api_params.refuse_unsupported(body, "completions")
    self.opts = options(req)
    self.draws = req.best_of or self.opts.n    # samples per prompt; n best returned
    self.bias = api_params.logit_bias(req.logit_bias, api.engine.cfg.vocab_size)
    self.prompts = prompt_list(req.prompt, tok, api.engine.cfg.vocab_size)
    self.k = self.opts.logprobs
    self.head = api.head("cmpl", "text_completion")
    self.prompt_tokens = sum(len(ids) for ids in self.prompts)
    self.runs: list[Run] = []

  def constraint(self):
    try:
      return grammar.for_completion(self.api.tokenizer, self.body,
                                    self.api.engine.cfg.vocab_size)
    except grammar.GrammarError as e:
      raise ApiError(400, str(e), e.param) from None

  def logprobs(self, ids, rows, start=0):
    lps, tops = logprobs.entries(self.api.tokenizer, rows, ids, self.k)
    return logprobs.assemble(self.api.tokenizer, ids, lps, tops, self.k, start)

  async def echoed(self, ids):
    """(prompt text, its logprobs object or None) for echo."""
    max_len = self.api.engine.max_len
    if len(ids) > max_len:
      raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is "
                     f"{max_len} tokens", "prompt", code="context_length_exceeded")
    text = self.api.tokenizer.decode(ids)
    if self.k is None:
      return text, None
    rows = await asyncio.to_thread(self.prompt_rows, ids)
    return text, self.logprobs(ids, rows)

  def prompt_rows(self, ids):
    """The rows that predict each prompt token (the first has none), teacher-forced."""
    scores = logprobs.scorer_for(self.api.engine).logits(ids)
    return [None] + list(scores[:-1])

  def usage(self) -> dict:
    done = sum(len(run.req.output_ids) for run in self.runs)
    return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": sum(int(run.req.cached_tokens)
                                                           for run in self.runs)}}

  async def answer(self):
    first = await asyncio.to_thread(self.constraint)
    if self.opts.score_only:            # max_tokens=0 with echo: score the prompts alone
      return await self.scores()
    api, each = self.api, constraints(first, self.constraint)
    with api.client.cancelling(self.runs):
      for i, ids in enumerate(self.prompts):
        params = dataclasses.replace(
            api_params.sampling_from(self.req, api.engine, len(ids), stop_ids=api.eos),
            logit_bias=self.bias, logprobs=0 if self.draws > self.opts.n else None)
        api.client.fan_out(self.runs, ids, params, self.draws, each, i * self.draws,
                           record_logits=self.k is not None,
                           stream=bool(self.body.get("stream")))
    if self.body.get("stream"):
      return guarded(self.stream())
    choices = await api.client.gather(self.runs, self.whole)
    if self.draws > self.opts.n:
      choices = self.best(choices)
    return {**self.head, "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": self.usage()}

  async def scores(self):
    choices, n = [], self.opts.n
    for i, ids in enumerate(self.prompts):
      text, lp = await self.echoed(ids)
      choices += [{"index": i * n + j, "text": text, "logprobs": lp,
                   "finish_reason": "length"} for j in range(n)]
    return {**self.head, "choices": choices,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": 0,
                      "total_tokens": self.prompt_tokens}}

  def ids_of(self, run: Run):
    return self.prompts[run.index // self.draws]

  async def items(self, run: Run):
    """A streamed choice's (text, logprobs) pieces: the echoed prompt, then its deltas."""
    req = run.req
    if self.opts.echo:
      yield await self.echoed(self.ids_of(run)), False
    sent = 0
    async for delta, done in self.api.client.events(run, self.http):
      lp = None
      if self.k is not None:
        new = req.output_ids[sent:]
        lp = self.logprobs(new, take_rows(req, sent, sent + len(new)))
        sent += len(new)
      yield (delta, lp), done

  async def stream(self):
    async for run, (delta, lp), done in self.api.client.merged(self.runs, self.items):
      if delta or done or lp:
        yield sse({**self.head, "choices": [{
            "index": run.index, "text": delta, "logprobs": lp,
            "finish_reason": finish_reason(run.req) if done else None}]})
    if (self.body.get("stream_options") or {}).get("include_usage"):
      yield sse({**self.head, "choices": [], "usage": self.usage()})
    yield DONE

  async def whole(self, run: Run):
    req = run.req
    text = "".join([d async for d, _ in self.api.client.events(run, self.http)])
    lp = None
    if self.k is not None:
      lp = await asyncio.to_thread(self.logprobs, req.output_ids,
                                   take_rows(req, 0, len(req.output_ids)))
    if self.opts.echo:
      ptext, plp = await self.echoed(self.ids_of(run))
      text = ptext + text
      if lp is not None:
        lp = merge_logprobs(plp, {**lp, "text_offset": [o + len(ptext)
                                                        for o in lp["text_offset"]]})
    return {"index": run.index, "text": text, "logprobs": lp,
            "finish_reason": finish_reason(req)}

  def best(self, choices: list) -> list:
    """best_of: the n of each prompt's draws with the highest mean token log-probability."""
    out = []
    for i in range(len(self.prompts)):
      mine = [(c, run.req) for c, run in zip(choices, self.runs)
              if run.index // self.draws == i]
      mine.sort(key=lambda x: -float(np.mean(x[1].token_logprobs or [0.0])))
      out += [{**c, "index": i * self.opts.n + j} for j, (c, _) in enumerate(mine[:self.opts.n])]
    return out


def register(app, api: Api) -> None:
  api.route(app, "/v1/completions", "completions", api_schema.CompletionRequest, Completion)


__all__ = ["prompt_list", "Options", "options", "Completion",
           "register"]
