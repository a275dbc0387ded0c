"""Structured outputs, forced tool calls, logit_bias, chat logprobs, chat n and best_of over
HTTP with the `openai` client: a tiny random-weight model exported with a K3-format test
tokenizer (tests/conftest.py), served from that directory (so the K3 chat template and its
markers), in process (ASGI transport), 20 slots so that the samples of one request share
decode batches.

Default run: the test tokenizer's BPE with the K3 special tokens moved down to just past its
ranks (a 1,024-id vocabulary: every decode step samples over the whole vocabulary, which at
163,840 ids costs about 0.5 s a step on a CPU). Slow run (`-m slow`): the same tests on the
released ids (163,840)."""

import json
from typing import Annotated, Literal

import jsonschema
import numpy as np
import openai
import pydantic
import pytest

from k3_jax.data.chat import template_for
from k3_jax.serve.requests import SamplingParams

MODEL = "k3-structured-test"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
        "sunny": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["hot", "cold", "wet"]}, "maxItems": 2},
    },
    "required": ["city", "temp", "sunny", "tags"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris now?"}]
INSTANT = {"chat_template_kwargs": {"thinking": False}}


class Weather(pydantic.BaseModel):
  city: Literal["Paris", "Rome", "Oslo"]
  temp: Annotated[int, pydantic.Field(ge=-40, le=50)]
  sunny: bool


def compact_k3_tokenizer(k3_tokenizer, out_dir):
  """The test tokenizer's ranks with the K3 special tokens at first + (released id - 163584),
  first = the number of ranks: the same chat format over a 1,024-id vocabulary."""
  from k3_jax.data import bpe
  from k3_jax.data import tokenizers as tk
  first = len(k3_tokenizer.ranks)
  special = {n: first + i - tk.K3_NUM_BASE_TOKENS for n, i in tk.KIMI_SPECIAL_TOKENS.items()}
  return tk.get_tokenizer(bpe.write_kimi_dir(out_dir, k3_tokenizer.ranks, special,
                                             vocab_size=1024))


@pytest.fixture(scope="module", params=["compact", pytest.param("released",
                                                                marks=pytest.mark.slow)])
def served(request, tmp_path_factory, k3_tokenizer):
  from starlette.testclient import TestClient
  from k3_jax.checkpoint import convert
  from k3_jax.config import ServeConfig
  from k3_jax.model import create_model
  import configs
  from k3_jax.config import apply_overrides, validate
  from k3_jax.serve.loader import ServeOptions, build_engine
  from k3_jax.serve.server import build_app
  vocab = 163840
  if request.param == "compact":
    k3_tokenizer = compact_k3_tokenizer(k3_tokenizer, tmp_path_factory.mktemp("compact_tok"))
    vocab = k3_tokenizer.vocab_size
  cfg = validate(apply_overrides(configs.get("k3_tiny"), (      # the config only: one model
      f"vocab_size={vocab}", "num_layers=2", "mla_layers=(2,)", "max_seq_len=1024")))
  out = str(tmp_path_factory.mktemp("k3_structured") / "hf")
  convert.export_model(create_model(cfg, seed=1), out, tokenizer=k3_tokenizer)
  engine, tok, _ = build_engine(ServeOptions(hf_dir=out, model_name=MODEL, serve=ServeConfig(
      max_batch=20, prefix_cache_bytes=0, batch_invariant=True)))   # one decode shape
  app = build_app(engine, tok, MODEL)
  with TestClient(app) as http:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                           max_retries=0)
    yield client, tok, engine, http
    app.state.loop.stop()


def test_json_schema_for_20_seeds(served):
  """n=20 sampled choices of one request (sharing decode batches), each constrained by its
  own grammar: every content is JSON that validates, finish_reason stop."""
  client, *_ = served
  r = client.chat.completions.create(
      model=MODEL, messages=ASK, n=20, seed=5, temperature=1.0, max_tokens=120,
      response_format={"type": "json_schema", "json_schema": {
          "name": "weather", "schema": SCHEMA, "strict": True}}, extra_body=INSTANT)
  assert [c.index for c in r.choices] == list(range(20))
  texts = set()
  for c in r.choices:
    assert c.finish_reason == "stop", c.message.content
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    texts.add(c.message.content)
  assert len(texts) > 10                                   # the seeds differ


def test_parse_with_pydantic_and_completions_json(served):
  client, *_ = served
  r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Weather,
                                    max_tokens=80, temperature=1.0, seed=3,
                                    extra_body=INSTANT)
  parsed = r.choices[0].message.parsed
  assert isinstance(parsed, Weather) and parsed.city in ("Paris", "Rome", "Oslo")
  # /v1/completions: the completion is the JSON, ended by the grammar
  c = client.completions.create(model=MODEL, prompt="The weather as JSON:", max_tokens=80,
                                temperature=1.0, seed=4, extra_body={"response_format": {
                                    "type": "json_schema", "json_schema": {
                                        "name": "w", "schema": SCHEMA}}})
  jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)


def test_forced_tool_call_round_trip(served):
  """tool_choice named and required (sampled, constrained, instant mode): a well-formed call
  whose arguments validate, finish_reason tool_calls, streamed as one whole delta.tool_calls
  entry; then the message sent back with the tool's result and the answer."""
  client, tok, *_ = served
  for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=200, temperature=1.0, seed=7,
                                       extra_body=INSTANT)    # (random weights never end a
                                                              # think channel)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
  chunks = list(client.chat.completions.create(   # the same seeded call, streamed: one whole
      model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200,  # entry
      temperature=1.0, seed=7, extra_body=INSTANT, stream=True))
  streamed = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
  assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == \
      [(0, call.function.name, call.function.arguments)]
  assert chunks[-1].choices[0].finish_reason == "tool_calls"
  messages = ASK + [c.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
  r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                     max_tokens=4, temperature=0)
  assert r.usage.prompt_tokens == len(template_for(tok).render(messages, tools=TOOLS).ids)
  assert r.choices[0].message.role == "assistant"


def test_logit_bias_and_chat_logprobs(served):
  """+100 on one id makes greedy pick it (both endpoints); chat logprobs are the log-softmax
  of the model's own logits: the engine's recorded logits of the same greedy request (1e-5),
  with the top alternatives in order and the chosen (greedy) token first."""
  client, tok, engine, _ = served
  target = tok.encode(" Paris")[0]
  r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                     logit_bias={str(target): 100}, logprobs=True,
                                     top_logprobs=2)
  assert r.choices[0].logprobs.content[0].token == tok.decode([target])
  c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0,
                                logit_bias={str(target): 100})
  assert c.choices[0].text.startswith(tok.decode([target]))
  # logprobs against the engine's own logits for the same prompt
  rendered = template_for(tok).render(ASK)
  r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0,
                                     logprobs=True, top_logprobs=3)
  req = engine.submit(rendered.ids, SamplingParams(max_tokens=5, stop_ids=rendered.stop_ids),
                      record_logits=True)
  req.done_event.wait(120)
  content = r.choices[0].logprobs.content
  assert len(content) == len(req.output_ids) == len(req.logits)
  for entry, tid, row in zip(content, req.output_ids, req.logits):
    x = np.asarray(row, np.float64)
    ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
    assert entry.bytes == list(tok.decode_bytes([tid]))
    np.testing.assert_allclose(entry.logprob, ref[tid], atol=1e-5, rtol=0)
    best = np.argsort(-ref, kind="stable")[:3]
    assert [t.token for t in entry.top_logprobs] == [tok.decode([int(i)]) for i in best]
    np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], ref[best], atol=1e-5)
    assert entry.top_logprobs[0].token == entry.token                # greedy


def test_chat_n_stream_and_best_of(served):
  client, *_ = served
  kw = dict(model=MODEL, messages=ASK, max_tokens=4, temperature=1.0, seed=11, n=2,
            extra_body=INSTANT)
  full = client.chat.completions.create(**kw)
  chunks = list(client.chat.completions.create(**kw, stream=True))
  text = {0: "", 1: ""}
  for ch in chunks:
    for c in ch.choices:
      text[c.index] += c.delta.content or ""
  assert text == {c.index: c.message.content for c in full.choices}
  assert full.choices[0].message.content != full.choices[1].message.content
  # best_of=3: the draw (seeds 9, 10, 11) with the highest mean token logprob
  draws = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=1,
                                    seed=9, n=3, logprobs=0)
  means = [np.mean(c.logprobs.token_logprobs) for c in draws.choices]
  best = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=1,
                                   seed=9, n=1, best_of=3)
  assert [c.text for c in best.choices] == [draws.choices[int(np.argmax(means))].text]


def test_bad_parameters_are_400s_naming_them(served):
  _, _, _, http = served
  chat = dict(model=MODEL, messages=ASK, max_tokens=2)
  for body, param in (
      ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
      ({"top_logprobs": 2}, "top_logprobs"),
      ({"logprobs": 3}, "logprobs"),
      ({"logit_bias": {"x": 1}}, "logit_bias"),
      ({"logit_bias": {"5": 101}}, "logit_bias"),
      ({"logit_bias": {"1000000": 1}}, "logit_bias"),
      ({"n": 0}, "n"),
      ({"best_of": 2}, "best_of"),
      ({"response_format": {"type": "xml"}}, "response_format"),
      ({"response_format": {"type": "json_schema", "json_schema": {
          "name": "w", "schema": {"type": "nonsense"}}}}, "response_format"),
      ({"response_format": {"type": "json_object"}, "tools": TOOLS,
        "tool_choice": "required"}, "response_format"),
      ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
          "type": "object", "properties": {"x": {}}}}}], "tool_choice": "required"}, "tools"),
  ):
    r = http.post("/v1/chat/completions", json={**chat, **body})
    assert r.status_code == 400, (body, r.text)
    assert r.json()["error"]["param"] == param, (body, r.json())
  for body, param in (({"best_of": 1, "n": 2}, "best_of"),
                      ({"best_of": 2, "stream": True}, "best_of"),
                      ({"logit_bias": {"1": "a"}}, "logit_bias"),
                      ({"response_format": {"type": "json_schema"}}, "response_format")):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                           **body})
    assert r.status_code == 400, (body, r.text)
    assert r.json()["error"]["param"] == param, (body, r.json())
