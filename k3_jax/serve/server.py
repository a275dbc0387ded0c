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

import json
import logging
import signal
import threading
import time

from fastapi import Request as HttpRequest   # at module level: FastAPI resolves annotations

from k3_jax.data.chat import template_for
from k3_jax.serve import api_params, api_schema, chat_completions, completions, tokenize_api
from k3_jax.serve.api_errors import ApiError
from k3_jax.serve.client import Api, EngineClient, EngineLoop
from k3_jax.serve.metrics import make_metrics

log = logging.getLogger("k3_jax.serve")


def body_reader(model_name: str):
  """async (http request) -> its JSON body: an object naming this model (or none), with no
  lone surrogate in any string (ApiError / ParamError naming the problem otherwise)."""
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

  return read_body


def _install_guards(app, engine) -> None:
  """The error handlers (ApiError and ParamError as OpenAI's JSON errors) and the limits
  every POST passes first: 503 while draining, 413 over max_body_bytes."""
  from fastapi.responses import JSONResponse

  @app.exception_handler(ApiError)
  async def _api_error(_, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(api_params.ParamError)
  async def _param_error(_, e: api_params.ParamError):
    return JSONResponse(ApiError(400, str(e), e.param, code=e.code).body(), status_code=400)

  def refusal(method: str, size: str | None) -> JSONResponse | None:
    """The response that refuses a request (its content-length header `size`) before its
    handler runs, or None."""
    if method != "POST":
      return None
    if app.state.draining:
      return JSONResponse(ApiError(503, "the server is shutting down; retry on another "
                                   "instance", type_="server_error", code="draining").body(),
                          status_code=503, headers={"Retry-After": "5"})
    limit = engine.serve.max_body_bytes
    if size is not None and size.isdigit() and int(size) > limit:
      return JSONResponse(ApiError(413, f"the request body has {size} bytes; the limit is "
                                   f"{limit} (--max_body_bytes)", code="body_too_large"
                                   ).body(), status_code=413)
    return None

  app.add_middleware(Guard, refusal=refusal)


class Guard:
  """A plain ASGI middleware: `refusal(method, content-length)` answers a request before
  the app sees it, or passes it through untouched. (Starlette's `@app.middleware("http")`
  carries every chunk of a streamed response through a memory stream between two tasks: a
  task switch per token per request.)"""

  def __init__(self, app, refusal):
    self.app, self.refusal = app, refusal

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      size = next((v.decode("latin-1") for k, v in scope["headers"]
                   if k == b"content-length"), None)       # (ASGI: lower-case names)
      out = self.refusal(scope["method"], size)
      if out is not None:
        return await out(scope, receive, send)
    await self.app(scope, receive, send)


def build_app(engine, tokenizer, model_name: str, *, start_loop: bool = True):
  """The FastAPI app over `engine` (serve/engine.py): the error handlers, the body limits,
  one handler per endpoint over one engine client (client.py), and the engine's loop
  thread (unless start_loop is False)."""
  from fastapi import FastAPI
  from fastapi.responses import JSONResponse, Response
  from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

  app = FastAPI(title="k3-jax")
  app.state.draining = False
  app.state.on_fatal = None            # serve() sets it: stop the process
  loop_runner = (EngineLoop(engine, on_fatal=lambda: app.state.on_fatal and
                            app.state.on_fatal()) if start_loop else None)
  template = template_for(tokenizer, engine.cfg.vision)
  registry, metrics = make_metrics(engine)
  created = int(time.time())

  _install_guards(app, engine)

  @app.on_event("shutdown")
  def _stop():
    if loop_runner is not None:
      loop_runner.stop()

  api = Api(engine, EngineClient(engine, metrics), tokenizer, template, model_name,
            () if tokenizer.eos_id is None else (tokenizer.eos_id,), body_reader(model_name))
  completions.register(app, api)          # POST /v1/completions
  chat_completions.register(app, api)     # POST /v1/chat/completions
  tokenize_api.register(app, template, tokenizer, engine, api.read_body)

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
