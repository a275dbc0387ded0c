"""POST /v1/chat/completions: the messages rendered by the chat template (data/chat.py),
`n` choices forked off one prefill, each parsed back (K3: reasoning, content and tool calls)
as its tokens come, answered whole or streamed (server-sent events)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from k3_jax.data.chat import ChatError
from k3_jax.serve import api_params, api_schema, grammar, logprobs
from k3_jax.serve.api_errors import DONE, ApiError, guarded, sse
from k3_jax.serve.client import Api, Run, constraints, finish_reason


@dataclasses.dataclass(eq=False)
class ChatRun(Run):
  """One choice of a chat request: its engine request, the template's parser (K3) and its
  tool calls; `split` turns the new output ids into reasoning, content, tool calls and
  logprobs entries."""
  parser: object = None
  tools: object = None
  k: int | None = None
  tokenizer: object = None
  seen: int = 0

  def split(self, delta, done):
    req = self.req
    ids = req.output_ids[self.seen:]
    lp = None
    if self.k is not None:
      lp = logprobs.chat_content(self.tokenizer, ids, req.token_logprobs[self.seen:][:len(ids)],
                                 req.top_logprobs[self.seen:][:len(ids)])
    self.seen += len(ids)
    if self.parser is None:
      return "", delta, [], lp
    d = self.parser.add(ids)
    r, c, calls = d.reasoning, d.content, self.tools.add(d)
    if done:
      f = self.parser.flush()
      r, c, calls = r + f.reasoning, c + f.content, calls + self.tools.add(f)
    return r, c, calls, lp

  def finish_reason(self):
    return self.tools.finish_reason(finish_reason(self.req))


class Chat:
  """One /v1/chat/completions request."""

  def __init__(self, api: Api, body: dict, req: api_schema.ChatCompletionRequest, http):
    self.api, self.body, self.req, self.http = api, body, req, http
    api_params.refuse_unsupported(body, "chat")
    self.n = 1 if req.n is None else req.n
    # logprobs (a boolean) and top_logprobs -> None (no logprobs) or alternatives per token
    self.k = (req.top_logprobs or 0) if req.logprobs else None
    self.bias = api_params.logit_bias(req.logit_bias, api.engine.cfg.vocab_size)
    self.runs: list[ChatRun] = []

  def constraint(self):
    try:
      return grammar.for_chat(self.api.template, self.rendered, self.body,
                              self.api.engine.cfg.vocab_size)
    except grammar.GrammarError as e:
      raise ApiError(400, str(e), e.param) from None

  async def answer(self):
    api, body = self.api, self.body
    try:           # in a worker thread: image parts are decoded and resized here
      self.rendered = r = await asyncio.to_thread(api.template.render, body.get("messages"),
                                                  **api_params.render_kwargs(body))
    except ChatError as e:
      raise ApiError(400, str(e), e.param) from None
    params = api_params.sampling_from(self.req, api.engine, len(r.ids), stop_extra=r.stop,
                                      stop_ids=tuple(r.stop_ids) + api.eos)
    params = dataclasses.replace(params, logit_bias=self.bias, logprobs=self.k)
    first = await asyncio.to_thread(self.constraint)   # (the first use builds the vocabulary)
    runs = []
    with api.client.cancelling(runs):
      api.client.fan_out(runs, r.ids, params, self.n, constraints(first, self.constraint),
                         images=r.images)
      self.runs = [ChatRun(run.req, run.queue, run.index, api.template.parser(r),
                           api_params.ToolCalls(body), self.k, api.tokenizer) for run in runs]
    self.head = api.head("chatcmpl", "chat.completion.chunk")
    if body.get("stream"):
      return guarded(self.stream())
    out = await api.client.gather(self.runs, self.whole)
    return {**self.head, "object": "chat.completion", "created": int(time.time()),
            "choices": out, "usage": self.usage()}

  def usage(self) -> dict:
    first = self.runs[0].req
    done = sum(len(c.req.output_ids) for c in self.runs)
    return {"prompt_tokens": int(first.prompt.size), "completion_tokens": done,
            "total_tokens": int(first.prompt.size) + done,
            "prompt_tokens_details": {"cached_tokens": int(first.cached_tokens)}}

  def items(self, ch: ChatRun):
    return self.api.client.events(ch, self.http)

  async def stream(self):
    for ch in self.runs:
      yield sse({**self.head, "choices": [{"index": ch.index, "delta": {"role": "assistant",
                                                                         "content": ""},
                                           "logprobs": None, "finish_reason": None}]})
    async for ch, delta, done in self.api.client.merged(self.runs, self.items):
      r, c, calls, lp = ch.split(delta, done)
      d = {}
      if r:
        d["reasoning_content"] = r
      if c:
        d["content"] = c
      if calls:
        d["tool_calls"] = calls
      if d or done or lp:
        yield sse({**self.head, "choices": [{
            "index": ch.index, "delta": d,
            "logprobs": None if lp is None else {"content": lp, "refusal": None},
            "finish_reason": ch.finish_reason() if done else None}]})
    if (self.body.get("stream_options") or {}).get("include_usage"):
      yield sse({**self.head, "choices": [], "usage": self.usage()})
    yield DONE

  async def whole(self, ch: ChatRun):
    reasoning, content, lps = "", "", []
    async for delta, done in self.api.client.events(ch, self.http):
      r, c, _, lp = ch.split(delta, done)
      reasoning, content, lps = reasoning + r, content + c, lps + (lp or [])
    message = {"role": "assistant", "content": content}
    if ch.parser is not None and self.rendered.thinking:
      message["reasoning_content"] = reasoning
    if ch.tools.calls:
      message["tool_calls"] = ch.tools.message()
    return {"index": ch.index, "message": message,
            "logprobs": None if self.k is None else {"content": lps, "refusal": None},
            "finish_reason": ch.finish_reason()}


def register(app, api: Api) -> None:
  api.route(app, "/v1/chat/completions", "chat", api_schema.ChatCompletionRequest, Chat)


__all__ = ["Chat", "ChatRun", "register"]
