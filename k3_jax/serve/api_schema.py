"""The request bodies of the OpenAI-compatible endpoints as pydantic models, for the OpenAPI
schema (/openapi.json) only, with the bounds of limits.py: the handlers keep parsing the
raw JSON themselves (api_params.sampling_from, chat.py), so a body outside this schema
still gets the handlers' own 400 naming the field, never FastAPI's 422. The schema states
what the server accepts, so that an API fuzzer (tests/serve/test_fuzz.py) can generate real requests from it."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from k3_jax.serve import limits

Penalty = Field(None, ge=limits.PENALTY[0], le=limits.PENALTY[1])


class StreamOptions(BaseModel):
  include_usage: bool | None = None


class _Sampling(BaseModel):
  model_config = ConfigDict(extra="allow")
  model: str | None = Field(None, description="the served model's name (or empty)")
  max_tokens: int | None = Field(None, ge=1, description="new tokens; prompt + max_tokens "
                                 "must fit the context")
  max_completion_tokens: int | None = Field(None, ge=1)
  temperature: float | None = Field(None, ge=limits.TEMPERATURE[0],
                                     le=limits.TEMPERATURE[1])
  top_p: float | None = Field(None, gt=limits.TOP_P[0], le=limits.TOP_P[1])
  presence_penalty: float | None = Penalty
  frequency_penalty: float | None = Penalty
  seed: int | None = None
  n: int | None = Field(None, ge=1, le=limits.MAX_N, description="choices; a seeded request's samples "
                        "use seed, seed + 1, ...")
  logit_bias: dict[str, Annotated[float, Field(ge=limits.LOGIT_BIAS[0],
                                                le=limits.LOGIT_BIAS[1])]] | None = Field(
      None, description="token id (a string) -> bias added to its logit")
  stop: Union[str, list[str], None] = Field(
      None, description=f"up to {limits.MAX_STOP} non-empty strings")
  stream: bool | None = None
  stream_options: StreamOptions | None = None


class JsonSchemaFormat(BaseModel):
  name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
  description: str | None = None
  schema_: dict | None = Field(None, alias="schema", description="a JSON Schema")
  strict: bool | None = None


class ResponseFormatText(BaseModel):
  type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
  type: Literal["json_object"]


class ResponseFormatJsonSchema(BaseModel):
  type: Literal["json_schema"]
  json_schema: JsonSchemaFormat


ResponseFormat = Union[ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema]


class CompletionRequest(_Sampling):
  prompt: Union[str, list[int], list[str]] = Field(
      ..., description="a string, a one-string list, or token ids")
  logprobs: int | None = Field(None, ge=0, le=limits.TOP_LOGPROBS)
  echo: bool | None = None
  best_of: int | None = Field(None, ge=1, le=limits.MAX_N, description=">= n; not streamed")
  response_format: ResponseFormat | None = None


class TextPart(BaseModel):
  type: Literal["text"]
  text: str


class ImageUrl(BaseModel):
  url: str = Field(..., description="a data: URL (PNG/JPEG) for a model with a vision tower")


class ImagePart(BaseModel):
  type: Literal["image_url"]
  image_url: ImageUrl


class Message(BaseModel):
  model_config = ConfigDict(extra="allow")
  role: Literal["system", "user", "assistant", "tool"]
  content: Union[str, list[Union[TextPart, ImagePart]], None] = None


class ChatTemplateKwargs(BaseModel):
  thinking: bool | None = None


class ChatCompletionRequest(_Sampling):
  messages: list[Message] = Field(..., min_length=1)
  chat_template_kwargs: ChatTemplateKwargs | None = None
  reasoning_effort: Literal["low", "high", "max"] | None = None
  logprobs: bool | None = None
  top_logprobs: int | None = Field(None, ge=0, le=limits.TOP_LOGPROBS,
                                   description="needs logprobs=true")
  response_format: ResponseFormat | None = None


def request_body(model: type[BaseModel]) -> dict:
  """openapi_extra for a route: `model` as its required JSON request body (definitions
  inlined under the schema's own $defs)."""
  schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
  defs = schema.pop("$defs", {})
  return {"requestBody": {"required": True,
                          "content": {"application/json": {"schema": schema}}},
          "x-components": defs}


def install(app, models=(CompletionRequest, ChatCompletionRequest)) -> None:
  """Adds the models' definitions to the app's OpenAPI components."""
  base = app.openapi

  def openapi():
    if app.openapi_schema is None:
      spec = base()
      comps = spec.setdefault("components", {}).setdefault("schemas", {})
      for path in spec.get("paths", {}).values():
        for op in path.values():
          comps.update(op.pop("x-components", {}))
      app.openapi_schema = spec
    return app.openapi_schema
  app.openapi = openapi


__all__ = ["CompletionRequest", "ChatCompletionRequest", "request_body", "install"]
