"""The server's errors, as OpenAI answers them: {"error": {"message", "type", "param",
"code"}} with an HTTP status; in a stream, an error event and then [DONE]."""

from __future__ import annotations

import json


class ApiError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None,
               type_: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                   type_, code)

  def body(self):
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def request_error(req) -> ApiError:
  """The ApiError of a request the engine failed: 504 for a timeout, else 500."""
  if req.error_type == "timeout":
    return ApiError(504, req.error, type_="timeout_error", code="request_timeout")
  return ApiError(500, f"the request failed in the engine: {req.error}", type_="server_error",
                  code=req.error_type)


def sse(obj) -> str:
  """One server-sent event holding obj as JSON."""
  return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


async def guarded(gen):
  """A server-sent event stream that ends, on an ApiError, in an error event and [DONE]."""
  try:
    async for chunk in gen:
      yield chunk
  except ApiError as e:
    yield sse(e.body())
    yield DONE


__all__ = ["ApiError", "request_error", "sse", "DONE", "guarded"]
