"""Request parameters of the OpenAI API that the server handles outside the engine: which ones
are refused (a 400 naming them), and the chat endpoint's tools / tool_choice and tool calls.

The server (server.py) calls `refuse_unsupported` first, passes `render_kwargs(body)` to the
chat template, and turns the template parser's Deltas into OpenAI fields with `ToolCalls`.
"""

from __future__ import annotations

from k3_jax.serve.chat import ChatError, check_tools, tool_choice_name


class ParamError(ValueError):
  """A request parameter the server does not support (answered 400, naming it)."""

  def __init__(self, message: str, param: str):
    super().__init__(message)
    self.param = param


def _set(v) -> bool:
  """Whether a parameter is given with a value that asks for something (not its default)."""
  return v not in (None, False, 0, "", [], {})


# parameter -> (is it asking for something unsupported?, what to say)
_COMMON = {
    "logit_bias": (_set, "logit_bias is not supported"),
    "best_of": (lambda v: v not in (None, 1), "best_of other than 1 is not supported"),
}
_REFUSED = {
    "completions": {
        **_COMMON,
        "suffix": (lambda v: v is not None, "suffix (insertion) is not supported"),
    },
    "chat": {
        **_COMMON,
        "logprobs": (_set, "logprobs is not supported"),
        "top_logprobs": (lambda v: v is not None, "top_logprobs is not supported"),
        "response_format": (lambda v: v is not None and not (isinstance(v, dict) and
                                                             v.get("type") == "text"),
                            "response_format other than {\"type\": \"text\"} is not "
                            "supported"),
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


def refuse_unsupported(body: dict, endpoint: str) -> None:
  """ParamError naming every parameter of `body` the endpoint ("completions" | "chat") does
  not support with the value given."""
  table = _REFUSED[endpoint]
  bad = [(k, table[k][1]) for k in body if k in table and table[k][0](body[k])]
  if bad:
    raise ParamError("; ".join(m for _, m in bad) + " (unsupported: "
                     + ", ".join(k for k, _ in bad) + ")", bad[0][0])


def render_kwargs(body: dict) -> dict:
  """The chat template's tools / tool_choice from the request (checked: ParamError)."""
  try:
    tools = check_tools(body.get("tools"))
    tool_choice_name(body.get("tool_choice"), tools)
  except ChatError as e:
    raise ParamError(str(e), "tool_choice" if "tool_choice" in str(e) else "tools") from None
  ptc = body.get("parallel_tool_calls")
  if ptc is not None and not isinstance(ptc, bool):
    raise ParamError(f"parallel_tool_calls must be a boolean, got {ptc!r}",
                     "parallel_tool_calls")
  return {"tools": tools or None, "tool_choice": body.get("tool_choice")}


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


__all__ = ["ParamError", "refuse_unsupported", "render_kwargs", "ToolCalls"]
