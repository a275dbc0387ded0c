"""Request parameters of the OpenAI API that the server handles outside the engine: which ones
are refused (a 400 naming them); `logit_bias`, the chat endpoint's `n`, `logprobs` /
`top_logprobs`, the completions endpoint's `best_of`; and the chat endpoint's tools /
tool_choice and tool calls.

The server (server.py) calls `refuse_unsupported` first, passes `render_kwargs(body)` to the
chat template, and turns the template parser's Deltas into OpenAI fields with `ToolCalls`.
`response_format` is grammar.py's (constrained decoding).
"""

from __future__ import annotations

from k3_jax.data.chat import ChatError, check_effort, check_tools, tool_choice_name
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




def _int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
  """`logit_bias` (OpenAI: {"token id": bias in [-100, 100]}) -> SamplingParams.logit_bias;
  ParamError naming it for anything else (an id outside the model's vocabulary included)."""
  lb = body.get("logit_bias")
  if lb is None:
    return ()
  if not isinstance(lb, dict):
    raise ParamError("logit_bias must be an object mapping token ids (as strings) to biases "
                     "in [-100, 100]", "logit_bias")
  if len(lb) > limits.MAX_BIAS_ENTRIES:
    raise ParamError(f"logit_bias has {len(lb)} entries; at most {limits.MAX_BIAS_ENTRIES}",
                     "logit_bias")
  out = []
  for k, v in lb.items():
    key = str(k).strip()
    if not key.isdigit() or not key.isascii():
      raise ParamError(f"logit_bias key {k!r} is not a token id (a non-negative integer as "
                       "a string)", "logit_bias")
    tid = int(key)
    if tid >= vocab_size:
      raise ParamError(f"logit_bias token id {tid} is not in the model's vocabulary "
                       f"[0, {vocab_size})", "logit_bias")
    lo, hi = limits.LOGIT_BIAS
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
      raise ParamError(f"logit_bias[{key!r}]={v!r} must be a number in [{lo:g}, {hi:g}]",
                       "logit_bias")
    out.append((tid, float(v)))
  return tuple(sorted(out))


def chat_n(body: dict) -> int:
  n = body.get("n")
  if n is None:
    return 1
  if not _int(n) or not 1 <= n <= limits.MAX_N:
    raise ParamError(f"n must be an integer in [1, {limits.MAX_N}], got {n!r}", "n")
  return n


def chat_logprobs(body: dict) -> int | None:
  """Chat `logprobs` (a boolean) and `top_logprobs` (0-20 in OpenAI's API; here up to
  limits.TOP_LOGPROBS) ->
  None (no logprobs) or the number of alternatives per token."""
  lp, top = body.get("logprobs"), body.get("top_logprobs")
  if lp is not None and not isinstance(lp, bool):
    raise ParamError(f"logprobs must be a boolean on /v1/chat/completions, got {lp!r} "
                     "(top_logprobs sets the number of alternatives)", "logprobs")
  if top is not None:
    if not _int(top) or not 0 <= top <= limits.OPENAI_CHAT_TOP_LOGPROBS:
      raise ParamError(f"top_logprobs must be an integer in [0, "
                       f"{limits.OPENAI_CHAT_TOP_LOGPROBS}], got {top!r}", "top_logprobs")
    if top > limits.TOP_LOGPROBS:
      raise ParamError(f"top_logprobs={top}: this server returns at most "
                       f"{limits.TOP_LOGPROBS} alternatives per token", "top_logprobs")
    if not lp:
      raise ParamError("top_logprobs needs logprobs=true", "top_logprobs")
  return (top or 0) if lp else None


def best_of(body: dict, n: int) -> int:
  """Completions `best_of` (the samples drawn per prompt, of which the n with the highest
  mean token log-probability are returned) -> the number to draw."""
  b = body.get("best_of")
  if b is None:
    return n
  if not _int(b) or not 1 <= b <= limits.MAX_N:
    raise ParamError(f"best_of must be an integer in [1, {limits.MAX_N}], got {b!r}",
                     "best_of")
  if b < n:
    raise ParamError(f"best_of={b} must be >= n={n}", "best_of")
  if b > n and body.get("stream"):
    raise ParamError("best_of greater than n cannot be streamed", "best_of")
  return b


def _number(body, name, default, kind=float):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
    raise ParamError(f"{name} must be a number, got {v!r}", name)
  return kind(v)


def sampling_from(body, engine, prompt_len: int, stop_extra=(), stop_ids=(),
                  allow_n: bool = False):
  """The request's SamplingParams (ParamError naming a bad field). allow_n: the caller runs
  `n` choices itself (completions); otherwise n other than 1 is refused."""
  max_tokens = _number(body, "max_completion_tokens", None, int)
  if max_tokens is None:
    max_tokens = _number(body, "max_tokens", limits.DEFAULT_MAX_TOKENS, int)
  room = engine.max_len - prompt_len
  if prompt_len > engine.max_len - 1:
    raise ParamError(f"the prompt has {prompt_len} tokens; this model's context is "
                     f"{engine.max_len} tokens", "prompt", code="context_length_exceeded")
  if max_tokens < 1:
    raise ParamError(f"max_tokens={max_tokens} must be >= 1", "max_tokens")
  if max_tokens > room:
    raise ParamError(f"max_tokens={max_tokens} exceeds the context: the prompt has "
                     f"{prompt_len} tokens and the context is {engine.max_len} "
                     f"(at most {room} new tokens)", "max_tokens", code="context_length_exceeded")
  temperature = _number(body, "temperature", limits.DEFAULT_TEMPERATURE)
  lo, hi = limits.TEMPERATURE
  if temperature < lo or temperature > hi:
    raise ParamError(f"temperature={temperature} must lie in [{lo:g}, {hi:g}]", "temperature")
  top_p = _number(body, "top_p", 1.0)
  lo, hi = limits.TOP_P
  if not lo < top_p <= hi:
    raise ParamError(f"top_p={top_p} must lie in ({lo:g}, {hi:g}]", "top_p")

  stop = body.get("stop") or []
  if isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) \
      or len(stop) > limits.MAX_STOP:
    raise ParamError(f"stop must be a non-empty string or a list of at most "
                     f"{limits.MAX_STOP} of them", "stop")
  seed = body.get("seed")
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
    raise ParamError(f"seed must be an integer, got {seed!r}", "seed")
  n = body.get("n", 1)
  if n not in (1, None) and not allow_n:
    raise ParamError("only n=1 is supported here", "n")
  try:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        seed=None if seed is None else seed % limits.SEED_RANGE,
        stop=tuple(stop) + tuple(stop_extra), stop_ids=tuple(stop_ids))
    params.validate()
  except RequestError as e:
    raise ParamError(str(e), None) from None
  return params


def render_kwargs(body: dict, tokenize: bool = False) -> dict:
  """The chat template's keyword arguments from a chat request (checked: ParamError naming
  the parameter): tools, tool_choice, response_format (its note), reasoning_effort (low /
  high / max) and chat_template_kwargs.thinking (false: instant, no think channels);
  with `tokenize` (POST /tokenize) also add_generation_prompt (default true)."""
  kwargs = body.get("chat_template_kwargs")
  if kwargs is None:
    kwargs = {}
  if not isinstance(kwargs, dict):
    raise ParamError("chat_template_kwargs must be an object", "chat_template_kwargs")
  thinking = kwargs.get("thinking", True)
  if not isinstance(thinking, bool):
    raise ParamError(f"chat_template_kwargs.thinking must be true or false, got {thinking!r}",
                     "chat_template_kwargs")
  try:
    tools = check_tools(body.get("tools"))
    tool_choice_name(body.get("tool_choice"), tools)
    check_effort(body.get("reasoning_effort"))
  except ChatError as e:
    raise ParamError(str(e), e.param) from None
  ptc = body.get("parallel_tool_calls")
  if ptc is not None and not isinstance(ptc, bool):
    raise ParamError(f"parallel_tool_calls must be a boolean, got {ptc!r}",
                     "parallel_tool_calls")
  out = {"tools": tools or None, "tool_choice": body.get("tool_choice"),
         "response_format": body.get("response_format"), "thinking": thinking,
         "effort": body.get("reasoning_effort")}
  if tokenize:
    agp = body.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
      raise ParamError(f"add_generation_prompt must be a boolean, got {agp!r}",
                       "add_generation_prompt")
    if body.get("continue_final_message"):
      raise ParamError("continue_final_message is not supported by the K3 chat format",
                       "continue_final_message")
    out["add_generation_prompt"] = agp
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
           "logit_bias", "chat_n", "chat_logprobs", "best_of"]
