"""The request bodies of the server's POST endpoints as pydantic models: each both validates
the body (`parse`, which every handler calls through `client.Api.route` or
`tokenize_api.register`) and documents it (the schema /openapi.json serves is the models'
own JSON Schema, in validation mode). Every bound is read from limits.py; a rule between
fields that a schema cannot state (best_of >= n, top_logprobs needs logprobs, ...) is a
model validator here. What depends on the loaded model (the context length, the
vocabulary, the chat template, a response_format's JSON Schema) is checked by the handlers.

A body the models refuse is a 400 in OpenAI's form whose `param` is the top-level field
and whose message names the path inside it (`messages[0].content[1]`), never FastAPI's 422.
The models are strict (no "1" for 1, no true for 1) and take what JSON Schema calls an
integer (2.0 is one), so that the schema and the validation agree both ways.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      model_validator)
from k3_jax.data.chat import EFFORTS, ROLES, ChatError, tool_choice_name
from k3_jax.serve import limits
from k3_jax.serve.api_params import ParamError


def _integral(v):
  return int(v) if isinstance(v, float) and v.is_integer() else v


def Int(description: str | None = None, **bounds):
  """An integer field's type (JSON Schema's: 2.0 is one) with bounds (ge, le)."""
  return Annotated[int, Field(description=description, **bounds), BeforeValidator(_integral)]


def Num(bounds: tuple[float, float], low_excluded: bool = False):
  """A number in limits' (low, high)."""
  lo = {"gt" if low_excluded else "ge": bounds[0]}
  return Annotated[float, Field(le=bounds[1], **lo)]


def refuse(param: str, message: str) -> ParamError:
  """The error a model validator raises for a rule between fields (its param named; pydantic
  keeps it as the error's ctx["error"])."""
  return ParamError(message, param)


TokenId = Int(ge=0)
Text = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
  model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(Strict):
  include_usage: bool | None = None


class Sampling(Strict):
  """The sampling parameters both generation endpoints take."""
  model: str | None = Field(None, description="the served model's name (or empty)")
  max_tokens: Int("new tokens; prompt + max_tokens must fit the context", ge=1) | None = None
  max_completion_tokens: Int("max_tokens' newer name (wins over it)", ge=1) | None = None
  temperature: Num(limits.TEMPERATURE) | None = Field(
      None, description=f"default {limits.DEFAULT_TEMPERATURE:g}; 0 is greedy")
  top_p: Num(limits.TOP_P, low_excluded=True) | None = None
  presence_penalty: Num(limits.PENALTY) | None = None
  frequency_penalty: Num(limits.PENALTY) | None = None
  seed: Int(f"taken modulo {limits.SEED_RANGE}") | None = None
  n: Int("choices; a seeded request's samples use seed, seed + 1, ...",
         ge=1, le=limits.MAX_N) | None = None
  logit_bias: Annotated[
      dict[Annotated[str, Field(pattern=r"^\s*[0-9]+\s*$")], Num(limits.LOGIT_BIAS)],
      Field(max_length=limits.MAX_BIAS_ENTRIES, json_schema_extra={
          "additionalProperties": False})] | None = Field(
      None, description="token id (a string) -> bias added to its logit")
  stop: Union[str, Annotated[list[Text], Field(max_length=limits.MAX_STOP)], None] = Field(
      None, description=f"a string or up to {limits.MAX_STOP} non-empty strings")
  stream: bool | None = None
  stream_options: StreamOptions | None = None


class JsonSchemaFormat(Strict):
  name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
  description: str | None = None
  schema_: dict | None = Field(None, alias="schema", description="a JSON Schema")
  strict: bool | None = None


class ResponseFormatText(Strict):
  type: Literal["text"]


class ResponseFormatJsonObject(Strict):
  type: Literal["json_object"]


class ResponseFormatJsonSchema(Strict):
  type: Literal["json_schema"]
  json_schema: JsonSchemaFormat


ResponseFormat = Annotated[Union[ResponseFormatText, ResponseFormatJsonObject,
                                 ResponseFormatJsonSchema], Field(discriminator="type")]

PROMPT = "a string, a list of token ids, or a list of strings and token-id lists"


class CompletionRequest(Sampling):
  prompt: Union[Text, Annotated[list[TokenId], Field(min_length=1)],
                Annotated[list[Union[Text, Annotated[list[TokenId], Field(min_length=1)]]],
                          Field(min_length=1, max_length=limits.MAX_PROMPTS)]] = Field(
      ..., description=PROMPT + f" (up to {limits.MAX_PROMPTS} prompts)")
  max_tokens: Int("new tokens; prompt + max_tokens must fit the context; 0 with echo "
                  "scores the prompt", ge=0) | None = None
  logprobs: Int("alternatives per token", ge=0, le=limits.TOP_LOGPROBS) | None = None
  echo: bool | None = None
  best_of: Int(">= n; not streamed", ge=1, le=limits.MAX_N) | None = None
  response_format: ResponseFormat | None = None

  @model_validator(mode="after")
  def _between_fields(self):
    n = 1 if self.n is None else self.n
    if self.best_of is not None and self.best_of < n:
      raise refuse("best_of", f"best_of={self.best_of} must be >= n={n}")
    if self.best_of is not None and self.best_of > n and self.stream:
      raise refuse("best_of", "best_of greater than n cannot be streamed")
    if self.max_tokens == 0 and not self.echo:
      raise refuse("max_tokens", "max_tokens=0 generates nothing; it is only meaningful with "
                   "echo=true (scoring the prompt)")
    if self.max_tokens == 0 and self.stream:
      raise refuse("stream", "max_tokens=0 (scoring) cannot be streamed")
    return self


class TextPart(Strict):
  type: Literal["text"]
  text: str


class ImageUrl(Strict):
  url: str = Field(..., description="a data: URL (PNG/JPEG) for a model with a vision tower")


class ImagePart(Strict):
  type: Literal["image_url"]
  image_url: ImageUrl


class Message(Strict):
  role: Literal[ROLES]
  content: Union[str, list[Annotated[Union[TextPart, ImagePart],
                                     Field(discriminator="type")]], None] = None
  name: str | None = None
  tool_call_id: str | None = None
  reasoning_content: str | None = None
  reasoning: str | None = None
  tool_calls: list[dict] | None = None


class FunctionDef(Strict):
  name: Text
  description: str | None = None
  parameters: dict | None = Field(None, description="a JSON Schema of the arguments")


class Tool(Strict):
  type: Literal["function"]
  function: FunctionDef


class NamedFunction(Strict):
  name: str


class ToolChoiceFunction(Strict):
  type: Literal["function"]
  function: NamedFunction


class ChatTemplateKwargs(Strict):
  thinking: bool | None = Field(None, description="false: instant, no think channels")


class ChatTemplate(Strict):
  """What the chat template takes (the chat endpoint and /tokenize)."""
  chat_template_kwargs: ChatTemplateKwargs | None = None
  reasoning_effort: Literal[EFFORTS] | None = None
  tools: list[Tool] | None = None
  tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceFunction, None] = Field(
      None, description='"none", "auto", "required" or {"type": "function", "function": '
      '{"name": ...}}')
  parallel_tool_calls: bool | None = None
  response_format: ResponseFormat | None = None

  @model_validator(mode="after")
  def _tool_choice_in_tools(self):
    choice = self.tool_choice
    try:
      tool_choice_name(choice if choice is None or isinstance(choice, str)
                       else choice.model_dump(), [t.model_dump() for t in self.tools or ()])
    except ChatError as e:
      raise refuse(e.param, str(e)) from None
    return self


class ChatCompletionRequest(Sampling, ChatTemplate):
  messages: list[Message] = Field(..., min_length=1)
  logprobs: bool | None = None
  top_logprobs: Int(f"needs logprobs=true; OpenAI's API allows up to "
                    f"{limits.OPENAI_CHAT_TOP_LOGPROBS}, this server returns at most "
                    f"{limits.TOP_LOGPROBS}", ge=0, le=limits.TOP_LOGPROBS) | None = None

  @model_validator(mode="after")
  def _between_fields(self):
    if self.top_logprobs is not None and not self.logprobs:
      raise refuse("top_logprobs", "top_logprobs needs logprobs=true")
    return self


class TokenizeRequest(ChatTemplate):
  """POST /tokenize: a chat request's messages (and template fields) or one prompt."""
  model: str | None = None
  messages: Annotated[list[Message], Field(min_length=1)] | None = None
  prompt: Union[Text, Annotated[list[TokenId], Field(min_length=1)], None] = Field(
      None, description="one prompt: a string or a list of token ids")
  add_generation_prompt: bool | None = Field(None, description="default true")
  continue_final_message: bool | None = None
  add_special_tokens: bool | None = None
  return_token_strs: bool | None = None

  @model_validator(mode="after")
  def _one_kind(self):
    if self.continue_final_message:
      raise refuse("continue_final_message", "continue_final_message is not supported by "
                   "the K3 chat format")
    if self.messages is not None and self.prompt is not None:
      raise refuse("prompt", "give either messages (a chat request) or prompt, not both")
    if self.messages is None and self.prompt is None:
      raise refuse("messages", "/tokenize needs messages (a chat request) or prompt")
    return self


class DetokenizeRequest(Strict):
  model: str | None = None
  tokens: list[TokenId]


# ----- a refused body -> a ParamError naming the field ------------------------------------

def _shown(v) -> str:
  r = repr(v)
  return r if len(r) <= 60 else r[:57] + "..."


def _path(loc, body) -> str:
  """The error's place in the body, as `a.b[2]`: the keys and indices the body has (the tags
  pydantic adds for a union's members are not in it)."""
  path, value = "", body
  for key in loc:
    if isinstance(value, dict) and isinstance(key, str) and key in value:
      path, value = (f"{path}.{key}" if path else key), value[key]
    elif isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
      path, value = f"{path}[{key}]", value[key]
  return path


def _message(e: dict, path: str) -> str:
  kind, ctx, msg = e["type"], e.get("ctx", {}), e["msg"]
  if kind == "missing":
    return f"{path + '.' if path else ''}{e['loc'][-1]} is required"
  if kind in ("too_short", "string_too_short") and ctx.get("min_length") == 1:
    return f"{path} is empty"
  if kind == "union_tag_invalid":
    return (f"{path}: expected a {ctx['discriminator']} of {ctx['expected_tags']}, got "
            f"{ctx['tag']!r}")
  if msg.startswith("Input should be"):
    return f"{path} must be{msg[len('Input should be'):]}, got {_shown(e['input'])}"
  return f"{path}: {msg}"


def _mismatch(e: dict) -> bool:
  """An error that only says the input is of another type (or value) than one form wants."""
  return e["type"].endswith("_type") or e["type"] == "literal_error"


def error(model: type[BaseModel], errors: list[dict], body: dict) -> ParamError:
  """The ParamError of a body `model` refused: its first field's most telling error."""
  first = errors[0]
  if isinstance(first.get("ctx", {}).get("error"), ParamError):   # a model validator's
    return first["ctx"]["error"]
  param = first["loc"][0]
  mine = [e for e in errors if e["loc"][:1] == (param,)]
  telling = [e for e in mine if not _mismatch(e)]
  if len(mine) > 1 and not telling:                       # no form of a union fits
    path, field = _path(first["loc"], body), model.model_fields.get(param)
    if path == param and field is not None and field.description:
      return ParamError(f"{param} must be {field.description}, got {_shown(body[param])}",
                        param)
    forms = "; ".join(dict.fromkeys(e["msg"].replace("Input should be ", "") for e in mine))
    return ParamError(f"{path} must be one of: {forms}", param)
  e = (telling or mine)[0]
  return ParamError(_message(e, _path(e["loc"], body)), param)


def parse(model: type[BaseModel], body: dict):
  """`body` (a JSON object) as `model`, or a ParamError naming the field it refuses."""
  try:
    return model.model_validate(body)
  except ValidationError as e:
    raise error(model, e.errors(include_url=False), body) from None


# ----- the schema /openapi.json serves ----------------------------------------------------

def request_body(model: type[BaseModel]) -> dict:
  """openapi_extra for a route: `model` as its required JSON request body (definitions
  inlined under the schema's own $defs)."""
  schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
  defs = schema.pop("$defs", {})
  return {"requestBody": {"required": True,
                          "content": {"application/json": {"schema": schema}}},
          "x-components": defs}


def install(app) -> None:
  """Adds the routes' model definitions to the app's OpenAPI components."""
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


__all__ = ["CompletionRequest", "ChatCompletionRequest", "TokenizeRequest",
           "DetokenizeRequest", "parse", "request_body", "install"]
