"""Every request limit and default comes from serve/limits.py: the request models (which
both validate the bodies and give the schema /openapi.json serves), the handlers' defaults,
the engine's own check and the serving step each take the bound from there (each accepts
the bound itself and refuses one step past it), and the schema served refuses exactly what
the validation refuses. No model is built: the checks run on plain bodies (exact
comparisons)."""

import types

import pytest

from k3_jax.serve import api_params, api_schema, limits, steps
from k3_jax.serve.api_params import ParamError
from k3_jax.serve.requests import RequestError, SamplingParams

ENGINE = types.SimpleNamespace(max_len=4096)     # what sampling_from reads of the engine


def schema(model, field):
  props = model.model_json_schema()["properties"][field]
  return next((p for p in props.get("anyOf", [props]) if p.get("type") != "null"), props)


def test_the_schema_states_the_limits():
  comp, chat = api_schema.CompletionRequest, api_schema.ChatCompletionRequest
  assert schema(comp, "temperature")["minimum"] == limits.TEMPERATURE[0]
  assert schema(comp, "temperature")["maximum"] == limits.TEMPERATURE[1]
  assert schema(comp, "top_p")["exclusiveMinimum"] == limits.TOP_P[0]
  assert schema(comp, "top_p")["maximum"] == limits.TOP_P[1]
  for name in ("presence_penalty", "frequency_penalty"):
    assert (schema(chat, name)["minimum"], schema(chat, name)["maximum"]) == limits.PENALTY
  lb = schema(comp, "logit_bias")        # only token ids (digits) as keys
  assert lb["additionalProperties"] is False and lb["maxProperties"] == limits.MAX_BIAS_ENTRIES
  (bias,) = lb["patternProperties"].values()
  assert (bias["minimum"], bias["maximum"]) == limits.LOGIT_BIAS
  assert schema(comp, "n")["maximum"] == schema(comp, "best_of")["maximum"] == limits.MAX_N
  assert schema(comp, "logprobs")["maximum"] == limits.TOP_LOGPROBS
  assert schema(chat, "top_logprobs")["maximum"] == limits.TOP_LOGPROBS


def refused(fn, *args, **kw) -> bool:
  try:
    fn(*args, **kw)
    return False
  except (ParamError, RequestError):
    return True


COMP = {"prompt": "hi"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def at_and_past():
  """(model, base body, field, {field: value at a limit}, {field: one step past it}) for
  every bound of limits.py a request carries."""
  comp, chat = api_schema.CompletionRequest, api_schema.ChatCompletionRequest
  (tlo, thi), (plo, phi), (blo, bhi) = limits.TEMPERATURE, limits.PENALTY, limits.LOGIT_BIAS
  n, k, e = limits.MAX_N, limits.TOP_LOGPROBS, limits.MAX_BIAS_ENTRIES
  lp = {"logprobs": True}
  return [
      (comp, COMP, "temperature", {"temperature": thi}, {"temperature": thi + 0.01}),
      (chat, CHAT, "temperature", {"temperature": tlo}, {"temperature": tlo - 0.01}),
      (comp, COMP, "top_p", {"top_p": limits.TOP_P[1]}, {"top_p": limits.TOP_P[1] + 0.01}),
      (chat, CHAT, "top_p", {"top_p": limits.TOP_P[0] + 0.01}, {"top_p": limits.TOP_P[0]}),
      (comp, COMP, "presence_penalty", {"presence_penalty": phi},
       {"presence_penalty": phi + 0.01}),
      (chat, CHAT, "frequency_penalty", {"frequency_penalty": plo},
       {"frequency_penalty": plo - 0.01}),
      (comp, COMP, "logit_bias", {"logit_bias": {"1": bhi}}, {"logit_bias": {"1": bhi + 1}}),
      (chat, CHAT, "logit_bias", {"logit_bias": {"1": blo}}, {"logit_bias": {"1": blo - 1}}),
      (comp, COMP, "logit_bias", {"logit_bias": {str(i): 0 for i in range(e)}},
       {"logit_bias": {str(i): 0 for i in range(e + 1)}}),
      (comp, COMP, "stop", {"stop": ["a"] * limits.MAX_STOP},
       {"stop": ["a"] * (limits.MAX_STOP + 1)}),
      (chat, CHAT, "stop", {"stop": ["a"]}, {"stop": [""]}),
      (comp, COMP, "n", {"n": n}, {"n": n + 1}),
      (chat, CHAT, "n", {"n": 1}, {"n": 0}),
      (comp, COMP, "best_of", {"best_of": n}, {"best_of": n + 1}),
      (comp, COMP, "logprobs", {"logprobs": k}, {"logprobs": k + 1}),
      (chat, CHAT, "top_logprobs", {**lp, "top_logprobs": k}, {**lp, "top_logprobs": k + 1}),
      (chat, CHAT, "top_logprobs", {**lp, "top_logprobs": 0},
       {**lp, "top_logprobs": limits.OPENAI_CHAT_TOP_LOGPROBS + 1}),
      (comp, {}, "prompt", {"prompt": [[1]] * limits.MAX_PROMPTS},
       {"prompt": [[1]] * (limits.MAX_PROMPTS + 1)}),
      (comp, COMP, "max_tokens", {"max_tokens": 1}, {"max_tokens": -1}),
      (chat, CHAT, "max_tokens", {"max_tokens": 1}, {"max_tokens": 0}),
  ]


def served_schema(model) -> dict:
  """The request body's schema as /openapi.json serves it (api_schema.request_body), with
  its components, as one JSON Schema document."""
  extra = api_schema.request_body(model)
  schema = extra["requestBody"]["content"]["application/json"]["schema"]
  return {**schema, "components": {"schemas": extra["x-components"]}}


@pytest.mark.parametrize("case", at_and_past(), ids=lambda c: c[2])
def test_the_schema_served_is_the_one_that_validates(case):
  """Each limit: the body at it passes both the served schema and the handlers' validation
  (api_schema.parse), the body one step past it fails both, naming the field."""
  import jsonschema
  model, base, field, ok, bad = case
  check = jsonschema.Draft202012Validator(served_schema(model))
  assert check.is_valid({**base, **ok}) and api_schema.parse(model, {**base, **ok})
  assert not check.is_valid({**base, **bad})
  with pytest.raises(ParamError) as e:
    api_schema.parse(model, {**base, **bad})
  assert e.value.param == field and field in str(e.value)


def test_the_handlers_take_the_defaults_and_the_context():
  s = lambda **body: api_params.sampling_from(
      api_schema.parse(api_schema.CompletionRequest, {**COMP, **body}), ENGINE, 10)
  got = s()
  assert got.max_tokens == limits.DEFAULT_MAX_TOKENS
  assert got.temperature == limits.DEFAULT_TEMPERATURE
  assert s(seed=limits.SEED_RANGE + 3).seed == 3
  assert s(max_tokens=ENGINE.max_len - 10).max_tokens == ENGINE.max_len - 10
  assert refused(s, max_tokens=ENGINE.max_len - 9)                 # past the context
  # logit_bias: token ids past the model's vocabulary
  assert api_params.logit_bias({"9": 1.0}, 10) == ((9, 1.0),)
  assert refused(api_params.logit_bias, {"10": 1.0}, 10)


def test_the_engine_and_the_step_share_them():
  assert steps.TOP_K == limits.TOP_LOGPROBS
  assert SamplingParams().max_tokens == limits.DEFAULT_MAX_TOKENS
  SamplingParams(logprobs=limits.TOP_LOGPROBS).validate()
  with pytest.raises(RequestError, match="logprobs"):
    SamplingParams(logprobs=limits.TOP_LOGPROBS + 1).validate()
  hi = limits.PENALTY[1]
  SamplingParams(presence_penalty=hi).validate()
  with pytest.raises(RequestError, match="presence_penalty"):
    SamplingParams(presence_penalty=hi + 0.01).validate()
  SamplingParams(presence_penalty=hi + 5).validate(openai_ranges=False)   # any finite value
  with pytest.raises(RequestError, match="logit_bias"):
    SamplingParams(logit_bias=((1, limits.LOGIT_BIAS[1] + 1),)).validate()
  with pytest.raises(RequestError, match="top_p"):
    SamplingParams(top_p=limits.TOP_P[0]).validate()


def test_one_page_size():
  from k3_jax.config import SERVE_PAGE
  from k3_jax.serve import kv_pages
  assert kv_pages.PAGE is SERVE_PAGE or kv_pages.PAGE == SERVE_PAGE
  import inspect
  assert "SERVE_PAGE" in inspect.getsource(kv_pages).split("PAGE =")[1].splitlines()[0]
