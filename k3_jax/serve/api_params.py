"""Request parameters of the OpenAI API that the server handles outside the engine, past what
the request models (api_schema.py) validate: which ones are refused (a 400 naming them);
`logit_bias` against the model's vocabulary; the SamplingParams of a validated request
(against the context length); and the chat endpoint's tools / tool_choice and tool calls.

The handlers call `refuse_unsupported` first, passes `render_kwargs(body)` to the
chat template, and turns the template parser's Deltas into OpenAI fields with `ToolCalls`.
`response_format` is grammar.py's (constrained decoding).
"""

from __future__ import annotations

from k3_jax.serve import limits
from k3_jax.serve.requests import RequestError, SamplingParams


class ParamError(ValueError):
  """A request parameter the server does not support (answered 400, naming it)."""

  def __init__(self, message: str, param: str | None, code: str | None = None):
    super().__init__(message)
    self.param, self.code = param, code


def _set(v) -> bool:
  """Whether a parameter is given with a value that asks for something (not its default)."""
  return v not in (None, False, 0, "", [], {})


# parameter -> (is it asking for something unsupported?, what to say)
_REFUSED = {
    "completions": {
        "suffix": (lambda v: v is not None, "suffix (insertion) is not supported"),
    },
    "chat": {
        "best_of": (lambda v: v is not None, "best_of is a /v1/completions parameter"),
        "functions": (_set, "functions (the deprecated form) is not supported; use tools"),
        "function_call": (_set, "function_call (the deprecated form) is not supported; use "
                          "tool_choice"),
        "audio": (_set, "audio output is not supported"),
        "modalities": (lambda v: v not in (None, ["text"]), "only the text modality is "
                       "supported"),
        "prediction": (_set, "prediction (predicted outputs) is not supported"),
        "web_search_options": (_set, "web_search_options is not supported"),
    },
}


def refuse_lone_surrogates(value, path: str = "") -> None:
  """A JSON string may escape half of a UTF-16 pair ("\\udcff"): Python keeps it as a lone
  surrogate, which no tokenizer can encode. Refused (ParamError naming the field) before any
  work, instead of failing deep in a tokenizer."""
  if isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ParamError(f"{path or 'the body'} holds a lone UTF-16 surrogate "
                       f"({value[e.start]!r} at character {e.start}), which is not valid "
                       "Unicode text", path.split("[")[0].split(".")[0] or None) from None
  elif isinstance(value, dict):
    for k, v in value.items():
      refuse_lone_surrogates(k, path)
      refuse_lone_surrogates(v, f"{path}.{k}" if path else str(k))
  elif isinstance(value, list):
    for i, v in enumerate(value):
      refuse_lone_surrogates(v, f"{path}[{i}]")


def refuse_unsupported(body: dict, endpoint: str) -> None:
  """ParamError naming every parameter of `body` the endpoint ("completions" | "chat") does
  not support with the value given."""
  table = _REFUSED[endpoint]
  bad = [(k, table[k][1]) for k in body if k in table and table[k][0](body[k])]
  if bad:
    raise ParamError("; ".join(m for _, m in bad) + " (unsupported: "
                     + ", ".join(k for k, _ in bad) + ")", bad[0][0])




def logit_bias(lb: dict | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
  """A validated `logit_bias` ({"token id": bias}, api_schema) -> SamplingParams.logit_bias;
  ParamError naming it for an id outside the model's vocabulary."""
  out = []
  for k, v in (lb or {}).items():
    tid = int(k.strip())
    if tid >= vocab_size:
      raise ParamError(f"logit_bias token id {tid} is not in the model's vocabulary "
                       f"[0, {vocab_size})", "logit_bias")
    out.append((tid, float(v)))
  return tuple(sorted(out))


def sampling_from(req, engine, prompt_len: int, stop_extra=(), stop_ids=()):
  """The SamplingParams of a validated request (api_schema; its defaults from limits.py)
  whose prompt has `prompt_len` tokens: ParamError naming the field for what depends on the
  engine (the context length)."""
  max_tokens = req.max_completion_tokens
  if max_tokens is None:
    max_tokens = limits.DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
  room = engine.max_len - prompt_len
  if prompt_len > engine.max_len - 1:
    raise ParamError(f"the prompt has {prompt_len} tokens; this model's context is "
                     f"{engine.max_len} tokens", "prompt", code="context_length_exceeded")
  if max_tokens > room:
    raise ParamError(f"max_tokens={max_tokens} exceeds the context: the prompt has "
                     f"{prompt_len} tokens and the context is {engine.max_len} "
                     f"(at most {room} new tokens)", "max_tokens", code="context_length_exceeded")
  stop = req.stop or []
  if isinstance(stop, str):
    stop = [stop]
  try:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=(limits.DEFAULT_TEMPERATURE if req.temperature is None
                     else req.temperature),
        top_p=1.0 if req.top_p is None else req.top_p,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        seed=None if req.seed is None else req.seed % limits.SEED_RANGE,
        stop=tuple(stop) + tuple(stop_extra), stop_ids=tuple(stop_ids))
    params.validate()
  except RequestError as e:
    raise ParamError(str(e), None) from None
  return params


def render_kwargs(body: dict, tokenize: bool = False) -> dict:
  """The chat template's keyword arguments from a validated chat request (api_schema's
  ChatTemplate): tools, tool_choice, response_format (its note), reasoning_effort and
  chat_template_kwargs.thinking (default true; false: instant, no think channels); with
  `tokenize` (POST /tokenize) also add_generation_prompt (default true)."""
  thinking = (body.get("chat_template_kwargs") or {}).get("thinking")
  out = {"tools": body.get("tools") or None, "tool_choice": body.get("tool_choice"),
         "response_format": body.get("response_format"),
         "thinking": True if thinking is None else thinking,
         "effort": body.get("reasoning_effort")}
  if tokenize:
    agp = body.get("add_generation_prompt")
    out["add_generation_prompt"] = True if agp is None else agp
  return out


class ToolCalls:
  """The tool calls of one choice as the parser completes them, in OpenAI's form: `add(delta)`
  returns the streamed `delta.tool_calls` entries (each call whole, with its index, once),
  `message()` the non-streamed `message.tool_calls`. With parallel_tool_calls false only the
  first call is kept."""

  def __init__(self, body: dict):
    self.limit = 1 if body.get("parallel_tool_calls") is False else None
    self.calls: list[dict] = []

  def add(self, delta) -> list[dict]:
    new = []
    for c in getattr(delta, "tool_calls", ()):
      if self.limit is not None and len(self.calls) >= self.limit:
        break
      c = {**c, "index": len(self.calls)}
      self.calls.append(c)
      new.append(c)
    return new

  def message(self) -> list[dict]:
    return [{k: v for k, v in c.items() if k != "index"} for c in self.calls]

  def finish_reason(self, reason: str) -> str:
    """"tool_calls" when the message ended (stop) after calling tools."""
    return "tool_calls" if self.calls and reason == "stop" else reason


__all__ = ["sampling_from", "ParamError", "refuse_unsupported", "render_kwargs", "ToolCalls",
           "logit_bias"]
