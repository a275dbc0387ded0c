"""OpenAI-compatible HTTP server over the batched engine (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events
ending in `data: [DONE]`, `stream_options.include_usage`; image_url content parts with data
URLs for a model with a vision tower, see chat.py), GET /v1/models, GET /health,
GET /metrics (Prometheus). The engine steps in one background thread; each HTTP request
submits to it and waits on its own asyncio queue. Bad input gets an OpenAI-style JSON error
({"error": {"message", "type", "param", "code"}}) and never reaches the engine; a client
that goes away cancels its request, which frees its slot at the engine's next step.

Faults (docs/faults.md, Serving): a request the engine failed answers 500 naming the cause
(504 for a timeout; streaming: an error event, then [DONE]); when the engine stopped
(Engine.fatal) /health answers 503 and the process exits with status 1. SIGTERM drains:
new requests get 503 with Retry-After, in-flight ones finish (up to drain_timeout), then
the process exits 0. A body over max_body_bytes gets 413.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import threading
import time
import uuid

import numpy as np
from fastapi import Request as HttpRequest   # at module level: FastAPI resolves annotations

from k3_jax.serve import api_params, api_schema, grammar, logprobs, tokenize_api
from k3_jax.serve import completions as cmpl
from k3_jax.data.chat import ChatError, template_for
from k3_jax.serve.engine import Engine
from k3_jax.serve.scheduler import EngineFatal, QueueFull, RequestError, SamplingParams

log = logging.getLogger("k3_jax.serve")


class EngineLoop:
  """Runs engine.step() in a daemon thread while there is work."""

  def __init__(self, engine: Engine, on_fatal=None):
    self.engine = engine
    self.stopped = False
    self.error: str | None = None
    self.on_fatal = on_fatal           # called once (in this thread) when the engine stops
    self.thread = threading.Thread(target=self._run, name="k3-engine", daemon=True)
    self.thread.start()

  def _run(self):
    eng = self.engine
    while not self.stopped:
      with eng.lock:
        if not eng.has_work():
          eng.lock.wait(timeout=0.1)
          continue
      try:
        eng.step()
      except Exception as e:           # fatal (Engine.step contains per-request faults):
        log.exception("engine stopped")  # step failed every request; stop stepping
        self.error = f"{type(e).__name__}: {e}"
        self.stopped = True
        if self.on_fatal is not None:
          self.on_fatal()

  def stop(self):
    self.stopped = True


# ----- metrics -------------------------------------------------------------------------

def make_metrics(engine: Engine):
  from prometheus_client import CollectorRegistry, Gauge, Histogram
  from prometheus_client.core import CounterMetricFamily

  reg = CollectorRegistry()
  buckets = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)
  m = {
      "ttft": Histogram("k3_time_to_first_token_seconds", "time to first token", registry=reg,
                        buckets=buckets),
      "itl": Histogram("k3_inter_token_latency_seconds", "time between streamed tokens",
                       registry=reg, buckets=buckets),
      "e2e": Histogram("k3_request_latency_seconds", "arrival to last token", registry=reg,
                       buckets=buckets),
  }
  Gauge("k3_num_requests_running", "requests holding a slot", registry=reg).set_function(
      lambda: len(engine.running))
  Gauge("k3_num_requests_waiting", "requests queued for a slot", registry=reg).set_function(
      lambda: len(engine.waiting))

  class EngineCounters:
    def collect(self):
      stats = engine.prefix.stats() if engine.prefix is not None else {}
      for name, doc, value in (
          ("k3_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
           stats.get("queries", 0)),
          ("k3_prefix_cache_hits", "prompt tokens served from the prefix cache",
           stats.get("hits", 0)),
          ("k3_prefix_cache_evictions", "prefix cache entries evicted",
           stats.get("evictions", 0)),
          ("k3_generation_tokens", "generated tokens", engine.generated_tokens),
          ("k3_preemptions", "requests preempted when the KV cache ran out (recomputed later)",
           engine.kv.preemptions),
          ("k3_request_success", "finished requests", engine.finished_requests),
          ("k3_request_failure", "requests that failed (an error or a timeout)",
           engine.failed_requests),
          *(() if engine.relay is None else (      # multi-host: the plans sent (relay.py)
              ("k3_relay_plans", "step plans published to the other processes",
               engine.relay.seq),
              ("k3_relay_plan_bytes", "bytes of the published plans", engine.relay.sent_bytes),
              ("k3_relay_send_seconds", "seconds spent publishing plans",
               engine.relay.send_seconds)))):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], value)
        yield c

  for key, doc in (("free_slots", "sequence slots free"),
                   ("used_pages", "KV pages in use (requests and the prefix cache)"),
                   ("free_pages", "KV pages free"),
                   ("cached_pages", "KV pages held by the prefix cache"),
                   ("pinned_blocks", "prefix-cache blocks pinned by running requests"),
                   ("pinned_checkpoints", "prefix-cache KDA checkpoint pins")):
    Gauge(f"k3_{key}", doc, registry=reg).set_function(
        lambda key=key: engine.resource_counts()[key])
  reg.register(EngineCounters())
  if getattr(engine, "tiers", None) is not None:      # cache tiers: per-tier counters
    from k3_jax.serve.cache_tiers import TierMetrics
    reg.register(TierMetrics(engine))
  return reg, m


# ----- errors --------------------------------------------------------------------------

class ApiError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None,
               type_: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                   type_, code)

  def body(self):
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def _number(body, name, default, kind=float):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
    raise ApiError(400, f"{name} must be a number, got {v!r}", name)
  return kind(v)


def sampling_from(body, engine: Engine, prompt_len: int, stop_extra=(), stop_ids=(),
                  allow_n: bool = False):
  """The request's SamplingParams (ApiError naming a bad field). allow_n: the caller runs
  `n` choices itself (completions); otherwise n other than 1 is refused."""
  max_tokens = _number(body, "max_completion_tokens", None, int)
  if max_tokens is None:
    max_tokens = _number(body, "max_tokens", 16, int)
  room = engine.max_len - prompt_len
  if prompt_len > engine.max_len - 1:
    raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                   f"{engine.max_len} tokens", "prompt", code="context_length_exceeded")
  if max_tokens < 1:
    raise ApiError(400, f"max_tokens={max_tokens} must be >= 1", "max_tokens")
  if max_tokens > room:
    raise ApiError(400, f"max_tokens={max_tokens} exceeds the context: the prompt has "
                   f"{prompt_len} tokens and the context is {engine.max_len} "
                   f"(at most {room} new tokens)", "max_tokens", code="context_length_exceeded")
  temperature = _number(body, "temperature", 1.0)
  if temperature < 0 or temperature > 2:
    raise ApiError(400, f"temperature={temperature} must lie in [0, 2]", "temperature")
  top_p = _number(body, "top_p", 1.0)
  if not 0 < top_p <= 1:
    raise ApiError(400, f"top_p={top_p} must lie in (0, 1]", "top_p")
  stop = body.get("stop") or []
  if isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) \
      or len(stop) > 4:
    raise ApiError(400, "stop must be a non-empty string or a list of at most 4 of them",
                   "stop")
  seed = body.get("seed")
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
    raise ApiError(400, f"seed must be an integer, got {seed!r}", "seed")
  n = body.get("n", 1)
  if n not in (1, None) and not allow_n:
    raise ApiError(400, "only n=1 is supported here", "n")
  try:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        seed=None if seed is None else seed % (1 << 31),
        stop=tuple(stop) + tuple(stop_extra), stop_ids=tuple(stop_ids))
    params.validate()
  except RequestError as e:
    raise ApiError(400, str(e)) from None
  return params


# ----- the app -------------------------------------------------------------------------

def request_error(req) -> "ApiError":
  """The ApiError of a request the engine failed: 504 for a timeout, else 500."""
  if req.error_type == "timeout":
    return ApiError(504, req.error, type_="timeout_error", code="request_timeout")
  return ApiError(500, f"the request failed in the engine: {req.error}", type_="server_error",
                  code=req.error_type)


async def guarded(gen):
  """A server-sent event stream that ends, on an ApiError, in an error event and [DONE]."""
  try:
    async for chunk in gen:
      yield chunk
  except ApiError as e:
    yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


def build_app(engine: Engine, tokenizer, model_name: str, *, start_loop: bool = True):
  from fastapi import FastAPI
  from fastapi.responses import JSONResponse, Response, StreamingResponse
  from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

  app = FastAPI(title="k3-jax")
  app.state.draining = False
  app.state.on_fatal = None            # serve() sets it: stop the process
  loop_runner = (EngineLoop(engine, on_fatal=lambda: app.state.on_fatal and
                            app.state.on_fatal()) if start_loop else None)
  template = template_for(tokenizer, engine.cfg.vision)
  registry, metrics = make_metrics(engine)
  created = int(time.time())
  eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)

  @app.exception_handler(ApiError)
  async def _api_error(_, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(api_params.ParamError)
  async def _param_error(_, e: api_params.ParamError):
    return JSONResponse(ApiError(400, str(e), e.param).body(), status_code=400)

  @app.middleware("http")
  async def _limits(http: HttpRequest, call_next):
    if http.method == "POST":
      if app.state.draining:
        return JSONResponse(ApiError(503, "the server is shutting down; retry on another "
                                     "instance", type_="server_error",
                                     code="draining").body(),
                            status_code=503, headers={"Retry-After": "5"})
      size = http.headers.get("content-length")
      limit = engine.serve.max_body_bytes
      if size is not None and size.isdigit() and int(size) > limit:
        return JSONResponse(ApiError(413, f"the request body has {size} bytes; the limit is "
                                     f"{limit} (--max_body_bytes)", code="body_too_large"
                                     ).body(), status_code=413)
    return await call_next(http)

  @app.on_event("shutdown")
  def _stop():
    if loop_runner is not None:
      loop_runner.stop()

  async def read_body(http: HttpRequest) -> dict:
    raw = await http.body()
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object")
    api_params.refuse_lone_surrogates(body)     # a 400 naming the field, not a tokenizer's 500
    model = body.get("model")
    if model not in (model_name, None, ""):
      raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                     f"{model_name!r}", "model", code="model_not_found")
    return body

  def submit(ids, params, images=None, **kw):
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_update(r, delta):
      loop.call_soon_threadsafe(queue.put_nowait, (delta, r.state == "done"))

    try:
      req = engine.submit(ids, params, on_update=on_update, images=images, **kw)
    except QueueFull as e:
      raise ApiError(429, str(e), type_="rate_limit_error", code="queue_full") from None
    except EngineFatal as e:
      raise ApiError(503, str(e), type_="server_error", code="engine_stopped") from None
    except RequestError as e:
      raise ApiError(400, str(e), "prompt") from None
    return req, queue

  async def events(req, queue, http):
    """(text delta, done) as the engine produces them; cancels the request if the client
    goes away or the consumer stops early."""
    last = None
    try:
      while True:
        try:         # (what is queued already is taken without a timer and a task)
          delta, done = queue.get_nowait() if not queue.empty() else \
              await asyncio.wait_for(queue.get(), timeout=0.5)
        except asyncio.TimeoutError:
          if await http.is_disconnected():
            return
          if req.state == "done" and req.error:
            raise request_error(req)
          continue
        now = time.monotonic()
        if last is None and req.first_token_at is not None:
          metrics["ttft"].observe(req.first_token_at - req.arrival)
        elif last is not None and delta:
          metrics["itl"].observe(now - last)
        last = now
        if done and req.error:
          raise request_error(req)
        yield delta, done
        if done:
          metrics["e2e"].observe(now - req.arrival)
          return
    finally:
      if req.state != "done":
        req.cancel()
        with engine.lock:
          engine.lock.notify_all()

  def seeded(params, j):
    """The j-th sample of a request: seed + j (a seeded request stays reproducible and its
    samples differ)."""
    return params if params.seed is None or j == 0 else dataclasses.replace(
        params, seed=(params.seed + j) % (1 << 31))

  def finish_reason(req):
    return {"stop": "stop", "length": "length"}.get(req.finish_reason, req.finish_reason)

  def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"

  # ----- /v1/completions ---------------------------------------------------------------
  def completion_logprobs(ids, rows, k, start=0):
    lps, tops = logprobs.entries(tokenizer, rows, ids, k)
    return logprobs.assemble(tokenizer, ids, lps, tops, k, start)

  def prompt_rows(ids):
    """The rows that predict each prompt token (the first has none), teacher-forced."""
    scores = logprobs.scorer_for(engine).logits(ids)
    return [None] + list(scores[:-1])

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

  @app.post("/v1/completions", openapi_extra=api_schema.request_body(
      api_schema.CompletionRequest))
  async def completions(http: HttpRequest):
    body = await read_body(http)
    api_params.refuse_unsupported(body, "completions")
    opts = cmpl.options(body)
    draws = api_params.best_of(body, opts.n)     # samples per prompt; the n best are returned
    bias = api_params.logit_bias(body, engine.cfg.vocab_size)
    prompts = cmpl.prompt_list(body.get("prompt"), tokenizer)
    k = opts.logprobs

    def constraint():
      try:
        return grammar.for_completion(tokenizer, body, engine.cfg.vocab_size)
      except grammar.GrammarError as e:
        raise ApiError(400, str(e), e.param) from None
    first = await asyncio.to_thread(constraint)
    rid = f"cmpl-{uuid.uuid4().hex}"
    head = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model_name}
    prompt_tokens = sum(len(ids) for ids in prompts)

    async def echoed(ids):
      """(prompt text, its logprobs object or None) for echo."""
      if len(ids) > engine.max_len:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is "
                       f"{engine.max_len} tokens", "prompt", code="context_length_exceeded")
      text = tokenizer.decode(ids)
      if k is None:
        return text, None
      rows = await asyncio.to_thread(prompt_rows, ids)
      return text, completion_logprobs(ids, rows, k)

    if opts.score_only:                 # max_tokens=0 with echo: score the prompts alone
      choices = []
      for i, ids in enumerate(prompts):
        text, lp = await echoed(ids)
        choices += [{"index": i * opts.n + j, "text": text, "logprobs": lp,
                     "finish_reason": "length"} for j in range(opts.n)]
      return {**head, "choices": choices,
              "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                        "total_tokens": prompt_tokens}}
    runs = []                           # (choice index, prompt ids, request, queue)
    try:
      for i, ids in enumerate(prompts):
        params = dataclasses.replace(
            sampling_from(body, engine, len(ids), stop_ids=eos, allow_n=True),
            logit_bias=bias, logprobs=0 if draws > opts.n else None)
        for j in range(draws):
          c = first if not runs else (None if first is None else constraint())
          req, queue = submit(ids, seeded(params, j), record_logits=k is not None,
                              constraint=c, fork_of=lead if j else None,
                              stream=bool(body.get("stream")))
          lead = req if j == 0 else lead      # the other draws start from its prefill
          runs.append((i * draws + j, ids, req, queue))
    except BaseException:
      for *_, req, _ in runs:
        req.cancel()
      raise

    def run_usage():
      return {"prompt_tokens": prompt_tokens,
              "completion_tokens": sum(len(r.output_ids) for _, _, r, _ in runs),
              "total_tokens": prompt_tokens + sum(len(r.output_ids) for _, _, r, _ in runs),
              "prompt_tokens_details": {"cached_tokens": sum(int(r.cached_tokens)
                                                             for _, _, r, _ in runs)}}

    if body.get("stream"):
      include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
      out: asyncio.Queue = asyncio.Queue()

      async def pump(index, ids, req, queue):
        try:
          if opts.echo:
            text, lp = await echoed(ids)
            await out.put((index, req, text, lp, False))
          sent = 0
          async for delta, done in events(req, queue, http):
            lp = None
            if k is not None:
              new = req.output_ids[sent:]
              lp = completion_logprobs(new, take_rows(req, sent, sent + len(new)), k)
              sent += len(new)
            await out.put((index, req, delta, lp, done))
        except BaseException as e:       # the stream ends with this run's error
          await out.put((index, req, e, None, True))

      async def gen():
        tasks = [asyncio.create_task(pump(*r)) for r in runs]
        try:
          left = len(runs)
          while left:
            index, req, delta, lp, done = await out.get()
            if isinstance(delta, BaseException):
              raise delta
            if delta or done or lp:
              yield sse({**head, "choices": [{"index": index, "text": delta, "logprobs": lp,
                                              "finish_reason": finish_reason(req) if done
                                              else None}]})
            left -= bool(done)
          if include_usage:
            yield sse({**head, "choices": [], "usage": run_usage()})
          yield "data: [DONE]\n\n"
        finally:
          for t in tasks:
            t.cancel()
          for *_, req, _ in runs:
            if req.state != "done":
              req.cancel()
      return StreamingResponse(guarded(gen()), media_type="text/event-stream")

    async def finish(index, ids, req, queue):
      text = "".join([d async for d, _ in events(req, queue, http)])
      lp = None
      if k is not None:
        lp = await asyncio.to_thread(completion_logprobs, req.output_ids,
                                     take_rows(req, 0, len(req.output_ids)), k)
      if opts.echo:
        ptext, plp = await echoed(ids)
        text = ptext + text
        if lp is not None:
          lp = merge_logprobs(plp, {**lp, "text_offset": [o + len(ptext)
                                                          for o in lp["text_offset"]]})
      return {"index": index, "text": text, "logprobs": lp,
              "finish_reason": finish_reason(req)}

    try:
      choices = await asyncio.gather(*[finish(*r) for r in runs])
    except BaseException:
      for *_, req, _ in runs:
        req.cancel()
      raise
    if draws > opts.n:                  # best_of: the n of each prompt's draws with the
      best = []                         # highest mean token log-probability
      for i in range(len(prompts)):
        mine = [(c, r[2]) for c, r in zip(choices, runs) if r[0] // draws == i]
        mine.sort(key=lambda x: -float(np.mean(x[1].token_logprobs or [0.0])))
        best += [{**c, "index": i * opts.n + j} for j, (c, _) in enumerate(mine[:opts.n])]
      choices = best
    return {**head, "choices": sorted(choices, key=lambda c: c["index"]), "usage": run_usage()}

  # ----- /v1/chat/completions ----------------------------------------------------------
  class ChatChoice:
    """One choice of a chat request: its engine request, the template's parser (K3) and
    its tool calls; `split` turns the new output ids into reasoning, content, tool calls and
    logprobs entries."""

    def __init__(self, index, req, queue, parser, tools, k):
      self.index, self.req, self.queue, self.parser, self.tools, self.k = (
          index, req, queue, parser, tools, k)
      self.seen = 0

    def split(self, delta, done):
      req = self.req
      ids = req.output_ids[self.seen:]
      lp = None
      if self.k is not None:
        lp = logprobs.chat_content(tokenizer, ids, req.token_logprobs[self.seen:][:len(ids)],
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

  def chat_usage(choices):
    first = choices[0].req
    done = sum(len(c.req.output_ids) for c in choices)
    return {"prompt_tokens": int(first.prompt.size), "completion_tokens": done,
            "total_tokens": int(first.prompt.size) + done,
            "prompt_tokens_details": {"cached_tokens": int(first.cached_tokens)}}

  async def merged(choices, http):
    """(choice, text delta, done) from every choice as the engine produces them."""
    out: asyncio.Queue = asyncio.Queue()

    async def pump(ch):
      try:
        async for delta, done in events(ch.req, ch.queue, http):
          await out.put((ch, delta, done))
      except BaseException as e:          # the stream ends with this choice's error
        await out.put((ch, e, True))
    tasks = [asyncio.create_task(pump(ch)) for ch in choices]
    try:
      left = len(choices)
      while left:
        ch, delta, done = await out.get()
        if isinstance(delta, BaseException):
          raise delta
        left -= bool(done)
        yield ch, delta, done
    finally:
      for t in tasks:
        t.cancel()
      for ch in choices:
        if ch.req.state != "done":
          ch.req.cancel()

  @app.post("/v1/chat/completions", openapi_extra=api_schema.request_body(
      api_schema.ChatCompletionRequest))
  async def chat(http: HttpRequest):
    body = await read_body(http)
    api_params.refuse_unsupported(body, "chat")
    n = api_params.chat_n(body)
    k = api_params.chat_logprobs(body)
    bias = api_params.logit_bias(body, engine.cfg.vocab_size)
    try:           # in a worker thread: image parts are decoded and resized here
      rendered = await asyncio.to_thread(template.render, body.get("messages"),
                                         **api_params.render_kwargs(body))
    except ChatError as e:
      raise ApiError(400, str(e), e.param) from None
    params = sampling_from(body, engine, len(rendered.ids), stop_extra=rendered.stop,
                           stop_ids=tuple(rendered.stop_ids) + eos, allow_n=True)
    params = dataclasses.replace(params, logit_bias=bias, logprobs=k)

    def constraint():
      try:
        return grammar.for_chat(template, rendered, body, engine.cfg.vocab_size)
      except grammar.GrammarError as e:
        raise ApiError(400, str(e), e.param) from None
    first = await asyncio.to_thread(constraint)   # (the first use builds the vocabulary)
    choices = []
    try:
      for j in range(n):
        c = first if j == 0 else (None if first is None else constraint())
        req, queue = submit(rendered.ids, seeded(params, j), rendered.images, constraint=c,
                            fork_of=choices[0].req if j else None)   # one shared prefill
        choices.append(ChatChoice(j, req, queue, template.parser(rendered),
                                  api_params.ToolCalls(body), k))
    except BaseException:
      for ch in choices:
        ch.req.cancel()
      raise
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model_name}

    if body.get("stream"):
      include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

      async def gen():
        for ch in choices:
          yield sse({**head, "choices": [{"index": ch.index, "delta": {"role": "assistant",
                                                                       "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
        async for ch, delta, done in merged(choices, http):
          r, c, calls, lp = ch.split(delta, done)
          d = {}
          if r:
            d["reasoning_content"] = r
          if c:
            d["content"] = c
          if calls:
            d["tool_calls"] = calls
          if d or done or lp:
            yield sse({**head, "choices": [{
                "index": ch.index, "delta": d,
                "logprobs": None if lp is None else {"content": lp, "refusal": None},
                "finish_reason": ch.finish_reason() if done else None}]})
        if include_usage:
          yield sse({**head, "choices": [], "usage": chat_usage(choices)})
        yield "data: [DONE]\n\n"
      return StreamingResponse(guarded(gen()), media_type="text/event-stream")

    async def finish(ch):
      reasoning, content, lps = "", "", []
      async for delta, done in events(ch.req, ch.queue, http):
        r, c, _, lp = ch.split(delta, done)
        reasoning, content, lps = reasoning + r, content + c, lps + (lp or [])
      message = {"role": "assistant", "content": content}
      if ch.parser is not None and rendered.thinking:
        message["reasoning_content"] = reasoning
      if ch.tools.calls:
        message["tool_calls"] = ch.tools.message()
      return {"index": ch.index, "message": message,
              "logprobs": None if k is None else {"content": lps, "refusal": None},
              "finish_reason": ch.finish_reason()}

    try:
      out = await asyncio.gather(*[finish(ch) for ch in choices])
    except BaseException:
      for ch in choices:
        ch.req.cancel()
      raise
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "choices": out, "usage": chat_usage(choices)}

  tokenize_api.register(app, template, tokenizer, engine, read_body)

  # ----- the rest ------------------------------------------------------------------------
  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "k3-jax", "max_model_len": engine.max_len}]}

  @app.get("/health")
  async def health():
    if engine.fatal is not None:
      return JSONResponse({"status": "error", "error": f"{type(engine.fatal).__name__}: "
                           f"{engine.fatal}"}, status_code=503)
    if app.state.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok", "running": len(engine.running), "waiting": len(engine.waiting),
            "free_slots": len(engine.free_slots)}

  @app.get("/metrics")
  async def prom():
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

  api_schema.install(app)
  app.state.engine, app.state.loop = engine, loop_runner
  return app


FATAL_EXIT_DELAY = 2.0     # seconds /health answers 503 before a stopped engine's process exits


def serve(app, host: str, port: int) -> None:
  """Runs the app with uvicorn. SIGTERM drains (docs/faults.md, Serving) and exits 0; a
  stopped engine (Engine.fatal) exits with status 1 so that a supervisor restarts it."""
  import uvicorn
  engine = app.state.engine
  if not log.handlers:                 # one line per request, compile and shutdown event
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

  class Server(uvicorn.Server):
    def handle_exit(self, sig, frame):
      if sig != signal.SIGTERM or app.state.draining:
        return super().handle_exit(sig, frame)
      app.state.draining = True
      timeout = engine.serve.drain_timeout
      log.warning("SIGTERM: draining %d running and %d waiting requests (up to %g s)",
                  len(engine.running), len(engine.waiting), timeout)

      def drain():
        deadline = time.monotonic() + timeout
        while engine.has_work() and time.monotonic() < deadline and engine.fatal is None:
          time.sleep(0.05)
        left = len(engine.running) + len(engine.waiting)
        log.warning("drained%s; shutting down", f" ({left} requests cut off)" if left else "")
        if getattr(engine, "tiers", None) is not None and not engine.has_work():
          with engine.lock:                  # cache tiers: the next server starts with them
            log.warning("prefix cache: %d blocks written to the disk tier",
                        engine.tiers.persist())
        self.should_exit = True
      threading.Thread(target=drain, name="k3-drain", daemon=True).start()

  server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                 timeout_graceful_shutdown=2))

  def on_fatal():
    threading.Timer(FATAL_EXIT_DELAY, lambda: setattr(server, "should_exit", True)).start()
  app.state.on_fatal = on_fatal
  server.run()
  if app.state.loop is not None:
    app.state.loop.stop()
  if engine.fatal is not None:
    log.error("exiting with status 1: the engine stopped (%s)", engine.fatal)
    raise SystemExit(1)
  log.warning("server stopped")


__all__ = ["build_app", "serve", "EngineLoop", "ApiError"]
