"""Every request limit and default comes from serve/limits.py: the schema /openapi.json
serves, the HTTP parameter checks, the engine's own check and the serving step each take
the bound from there (each accepts the bound itself and refuses one step past it). No
model is built: the checks run on plain bodies (exact comparisons)."""

import types

import pytest

from k3_jax.serve import api_params, api_schema, completions, limits, steps
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
  bias = schema(comp, "logit_bias")["additionalProperties"]
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


def test_the_handlers_check_the_same_limits():
  s = lambda **body: api_params.sampling_from(body, ENGINE, 10, allow_n=True)
  lo, hi = limits.TEMPERATURE
  assert not refused(s, temperature=hi) and refused(s, temperature=hi + 0.01)
  assert refused(s, temperature=lo - 0.01)
  assert not refused(s, top_p=limits.TOP_P[1]) and refused(s, top_p=limits.TOP_P[0])
  lo, hi = limits.PENALTY
  assert not refused(s, presence_penalty=hi) and refused(s, presence_penalty=hi + 0.01)
  assert refused(s, frequency_penalty=lo - 0.01)
  assert not refused(s, stop=["a"] * limits.MAX_STOP)
  assert refused(s, stop=["a"] * (limits.MAX_STOP + 1))
  got = s()
  assert got.max_tokens == limits.DEFAULT_MAX_TOKENS
  assert got.temperature == limits.DEFAULT_TEMPERATURE
  assert s(seed=limits.SEED_RANGE + 3).seed == 3
  # logit_bias
  hi = limits.LOGIT_BIAS[1]
  assert api_params.logit_bias({"logit_bias": {"1": hi}}, 10) == ((1, hi),)
  assert refused(api_params.logit_bias, {"logit_bias": {"1": hi + 1}}, 10)
  many = {str(i): 0 for i in range(limits.MAX_BIAS_ENTRIES + 1)}
  assert refused(api_params.logit_bias, {"logit_bias": many}, 10 ** 6)
  # n, best_of, logprobs, prompts
  n = limits.MAX_N
  assert completions.options({"n": n}).n == n and refused(completions.options, {"n": n + 1})
  assert api_params.chat_n({"n": n}) == n and refused(api_params.chat_n, {"n": n + 1})
  assert api_params.best_of({"best_of": n}, 1) == n
  assert refused(api_params.best_of, {"best_of": n + 1}, 1)
  k = limits.TOP_LOGPROBS
  assert completions.options({"logprobs": k}).logprobs == k
  assert refused(completions.options, {"logprobs": k + 1})
  assert api_params.chat_logprobs({"logprobs": True, "top_logprobs": k}) == k
  assert refused(api_params.chat_logprobs, {"logprobs": True, "top_logprobs": k + 1})
  assert refused(api_params.chat_logprobs,
                 {"logprobs": True, "top_logprobs": limits.OPENAI_CHAT_TOP_LOGPROBS + 1})
  assert len(completions.prompt_list([[1]] * limits.MAX_PROMPTS, None)) == limits.MAX_PROMPTS
  assert refused(completions.prompt_list, [[1]] * (limits.MAX_PROMPTS + 1), None)


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
