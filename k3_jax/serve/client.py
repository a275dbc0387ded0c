"""The HTTP side's one way into the engine.

`EngineLoop` steps the engine in a daemon thread while there is work. `EngineClient` is what
every endpoint handler holds: it submits requests from asyncio (`fan_out`: the n samples of
one prompt, seeded seed, seed + 1, ... and forked off the first one's prefill), streams each
request's text as the engine produces it (`events`), fans the streams of several requests in
(`merged`), waits for them all (`gather`), and cancels every request of a run that the
client stopped waiting for (`cancelling`, and on leaving `events` / `merged` early): a
request whose client went away frees its slot at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid

from fastapi import Request as HttpRequest   # at module level: FastAPI resolves annotations

from k3_jax.serve import api_schema
from k3_jax.serve.api_errors import ApiError, request_error
from k3_jax.serve.requests import EngineFatal, QueueFull, Request, RequestError, SamplingParams

log = logging.getLogger("k3_jax.serve")


class EngineLoop:
  """Runs engine.step() in a daemon thread while there is work. With --admit_gap_ms set,
  an idle engine lets a burst of requests arrive before its first step (`settle`)."""

  def __init__(self, engine, on_fatal=None):
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
        delay = settle(eng, time.monotonic())
        if delay > 0:
          eng.lock.wait(timeout=delay)
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


def settle(eng, now: float) -> float:
  """Seconds an idle engine (nothing running, nothing in flight) waits before its first
  step: until no request has arrived for admit_gap_ms, at most admit_window_ms after the
  first one, or none once max_batch are waiting. The requests of a burst (8 clients at
  once: their arrivals spread over 35-60 ms on 2 CPU cores) then share their prefill calls
  where the first used to be prefilled alone while the rest queued behind it; a lone
  request waits admit_gap_ms."""
  serve = eng.serve
  if serve.admit_gap_ms <= 0 or eng.busy() or not eng.waiting \
      or len(eng.waiting) >= eng.max_batch:
    return 0.0
  arrivals = [r.arrival for r in eng.waiting]
  until = min(min(arrivals) + serve.admit_window_ms / 1e3,
              max(arrivals) + serve.admit_gap_ms / 1e3)
  return max(0.0, until - now)


@dataclasses.dataclass(eq=False)
class Run:
  """One engine request of an HTTP request, with the queue its updates arrive on."""
  req: Request
  queue: asyncio.Queue
  index: int = 0                     # its choice index


def seeded(params: SamplingParams, j: int) -> SamplingParams:
  """The j-th sample of a request: seed + j (a seeded request stays reproducible and its
  samples differ)."""
  return params if params.seed is None or j == 0 else dataclasses.replace(
      params, seed=(params.seed + j) % (1 << 31))


def constraints(first, make):
  """The constraint of each run of a request: `first` (built already), then a fresh one
  from `make` per run (None throughout when the request has none)."""
  yield first
  while True:
    yield None if first is None else make()


class EngineClient:
  def __init__(self, engine, metrics: dict):
    self.engine, self.metrics = engine, metrics

  def submit(self, ids, params: SamplingParams, images=None, index: int = 0, **kw) -> Run:
    """Queues one request; its updates arrive on the Run's queue (ApiError: 429 when the
    queue is full, 503 when the engine stopped, 400 for a request it refuses)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_update(r, delta):
      loop.call_soon_threadsafe(queue.put_nowait, (delta, r.state == "done"))

    try:
      req = self.engine.submit(ids, params, on_update=on_update, images=images, **kw)
    except QueueFull as e:
      raise ApiError(429, str(e), type_="rate_limit_error", code="queue_full") from None
    except EngineFatal as e:
      raise ApiError(503, str(e), type_="server_error", code="engine_stopped") from None
    except RequestError as e:
      raise ApiError(400, str(e), "prompt") from None
    return Run(req, queue, index)

  def fan_out(self, runs: list[Run], ids, params: SamplingParams, n: int, constraint,
              first_index: int = 0, **kw) -> None:
    """Appends to `runs` the n samples of prompt `ids` (seeds seed + j), the others forked
    off the first one's prefill; `constraint` (from `constraints`) gives each its own."""
    lead = None
    for j in range(n):
      run = self.submit(ids, seeded(params, j), index=first_index + j,
                        constraint=next(constraint), fork_of=lead, **kw)
      lead = lead or run.req           # the other samples start from its prefill
      runs.append(run)

  @staticmethod
  @contextlib.contextmanager
  def cancelling(runs: list[Run], always: bool = False):
    """On an exception (or always), the runs' requests not done are cancelled."""
    ok = False
    try:
      yield
      ok = True
    finally:
      if always or not ok:
        for run in runs:
          if run.req.state != "done":
            run.req.cancel()

  async def events(self, run: Run, http):
    """(text delta, done) as the engine produces them; cancels the request if the client
    goes away or the consumer stops early."""
    req, queue, m = run.req, run.queue, self.metrics
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
          m["ttft"].observe(req.first_token_at - req.arrival)
        elif last is not None and delta:
          m["itl"].observe(now - last)
        last = now
        if done and req.error:
          raise request_error(req)
        yield delta, done
        if done:
          m["e2e"].observe(now - req.arrival)
          return
    finally:
      if req.state != "done":
        req.cancel()
        with self.engine.lock:
          self.engine.lock.notify_all()

  async def merged(self, runs: list[Run], items):
    """(run, item, done) from every run as its `items(run)` (an async iterator of (item,
    done)) produces them; the first error ends the whole, and leaving early cancels the
    runs not done."""
    out: asyncio.Queue = asyncio.Queue()

    async def pump(run):
      try:
        async for item, done in items(run):
          await out.put((run, item, done))
      except BaseException as e:          # the stream ends with this run's error
        await out.put((run, e, True))
    tasks = [asyncio.create_task(pump(run)) for run in runs]
    with self.cancelling(runs, always=True):
      try:
        left = len(runs)
        while left:
          run, item, done = await out.get()
          if isinstance(item, BaseException):
            raise item
          left -= bool(done)
          yield run, item, done
      finally:
        for t in tasks:
          t.cancel()

  async def gather(self, runs: list[Run], each) -> list:
    """[await each(run) for every run], concurrently; an error cancels them all."""
    with self.cancelling(runs):
      return await asyncio.gather(*[each(run) for run in runs])


@dataclasses.dataclass
class Api:
  """What every endpoint handler holds (server.build_app makes it)."""
  engine: object
  client: EngineClient
  tokenizer: object
  template: object                   # the chat template (data/chat.py)
  model_name: str
  eos: tuple                         # the tokenizer's end-of-text id, as stop ids
  read_body: object                  # async (http request) -> its JSON object, checked

  def route(self, app, path: str, name: str, schema, request) -> None:
    """POST `path`: the body read (`read_body`) and validated by `schema` (its pydantic
    model, api_schema.py, which /openapi.json serves), `request(api, body, model,
    http).answer()` -> a JSON object, or server-sent events to stream."""
    from fastapi.responses import StreamingResponse

    async def handler(http: HttpRequest):
      body = await self.read_body(http)
      out = await request(self, body, api_schema.parse(schema, body), http).answer()
      if isinstance(out, dict):
        return out
      return StreamingResponse(out, media_type="text/event-stream")
    handler.__name__ = name
    app.post(path, openapi_extra=api_schema.request_body(schema))(handler)

  def head(self, prefix: str, obj: str) -> dict:
    """The fields every response (or chunk) of one request starts with."""
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": self.model_name}


def finish_reason(req) -> str:
  return {"stop": "stop", "length": "length"}.get(req.finish_reason, req.finish_reason)


__all__ = ["EngineLoop", "EngineClient", "Run", "Api", "seeded", "constraints",
           "finish_reason", "settle"]
