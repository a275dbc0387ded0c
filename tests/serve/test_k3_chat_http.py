"""The K3 chat format end to end over HTTP: a tiny random-weight model with K3's vocabulary
(163,840 ids) exported with the K3-format test tokenizer (tests/conftest.py) by `convert`'s
export, served from that directory (`serve --hf_dir` picks the directory's tokenizer, hence
the K3 template), driven by the `openai` client in process (ASGI transport). Forced tool calls
over HTTP are tests/serve/test_structured_http.py's (a compact vocabulary: a forced call is
tens of decode steps, 0.5 s each at 163,840 ids on a CPU)."""

import json

import openai
import pytest

from k3_jax.data.chat import K3Template, template_for

MODEL = "k3-chat-test"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris now?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, k3_tokenizer):
  from starlette.testclient import TestClient
  from k3_jax.checkpoint import convert
  from k3_jax.config import ServeConfig
  from k3_jax.model import create_model
  import configs
  from k3_jax.config import apply_overrides, validate
  from k3_jax.serve.loader import ServeOptions, build_engine
  from k3_jax.serve.server import build_app
  cfg = validate(apply_overrides(configs.get("k3_tiny"), (      # the config only: one model
      "vocab_size=163840", "num_layers=2", "mla_layers=(2,)", "max_seq_len=512")))
  out = str(tmp_path_factory.mktemp("k3_chat") / "hf")
  convert.export_model(create_model(cfg, seed=1), out, tokenizer=k3_tokenizer)
  with open(f"{out}/generation_config.json") as f:
    assert json.load(f)["eos_token_id"] == [163586, 163585]     # <|end_of_msg|>, [EOS]
  engine, tok, _ = build_engine(ServeOptions(hf_dir=out, model_name=MODEL, serve=ServeConfig(
      max_batch=2, prefix_cache_bytes=0)))
  assert tok.encode("Weather in Paris?") == k3_tokenizer.encode("Weather in Paris?")
  app = build_app(engine, tok, MODEL)
  with TestClient(app) as http:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                           max_retries=0)
    yield client, tok, engine, http
    app.state.loop.stop()


def test_k3_chat_and_tokenize_over_http(served):
  """The chat endpoint prefills exactly the template's ids, which /tokenize returns for the
  same body (usage.prompt_tokens, the ids the engine got and their prefix-cache block hashes
  agree), with tools, reasoning_effort and thinking off; an agentic history with reasoning
  comes back rendered; the generated reasoning is returned as reasoning_content (streamed
  too). /tokenize of a completion prompt is what /v1/completions prefills; /detokenize
  reverses ids; bad parameters are 400s naming them."""
  from k3_jax.serve.prefix_cache import block_hashes
  client, tok, engine, http = served
  t = template_for(tok)
  assert isinstance(t, K3Template)
  got = []
  submit = engine.submit

  def spy(ids, *a, **kw):
    got.append([int(i) for i in ids])
    return submit(ids, *a, **kw)
  engine.submit = spy
  try:
    def history(result):
      return ASK + [
          {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
           "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": result}]
    # prompts of 160 and 144 tokens: prefill pieces of 64 and 16 only (docs/serving.md), so
    # the engine compiles two piece lengths and no more
    for extra, stream, result in (
        ({}, False, "sunny 21" + " and sunny" * 5 + "."),
        ({"chat_template_kwargs": {"thinking": False}, "reasoning_effort": "high"}, True,
         "sunny 21" + " and sunny" * 6)):
      messages = history(result)
      r = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0,
                                         messages=messages, extra_body=extra,
                                         stream=stream, stream_options={"include_usage": True}
                                         if stream else None)
      if stream:
        r = list(r)
        reasoning = [getattr(c.choices[0].delta, "reasoning_content", None)
                     for c in r if c.choices]
        usage = r[-1].usage
      else:
        reasoning, usage = [r.choices[0].message.reasoning_content], r.usage
      tk = http.post("/tokenize", json={"model": MODEL, "messages": messages, **extra}).json()
      thinking = extra.get("chat_template_kwargs", {}).get("thinking", True)
      want = t.render(messages, thinking=thinking).ids
      assert tk == {"tokens": want, "count": len(want), "max_model_len": engine.max_len,
                    "token_strs": None}
      assert got[-1] == want and usage.prompt_tokens == len(want) in (160, 144)
      assert block_hashes(got[-1], 16) == block_hashes(tk["tokens"], 16)
      assert any(isinstance(x, str) for x in reasoning) == thinking      # reasoning_content
      assert ("<|open|>think<|sep|>Call the tool.<|close|>think" in tok.decode(want)) == thinking
    # tools, an effort note and a tool-choice note: the same template call as the chat endpoint
    body = {"messages": messages, "tools": TOOLS, "reasoning_effort": "low",
            "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert http.post("/tokenize", json=body).json()["tokens"] == t.render(
        messages, tools=TOOLS, effort="low", tool_choice="required",
        response_format={"type": "json_object"}).ids
    no_prompt = http.post("/tokenize", json={"messages": ASK, "add_generation_prompt": False,
                                              "return_token_strs": True}).json()
    assert no_prompt["tokens"] == t.render(ASK, add_generation_prompt=False).ids
    assert "".join(no_prompt["token_strs"]) == tok.decode(no_prompt["tokens"])
    text = "The weather in Paris today is sunny and 21 degrees. Hello"      # 16 tokens
    c = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    tk = http.post("/tokenize", json={"prompt": text}).json()
    assert tk["tokens"] == got[-1] == tok.encode(text)
    assert c.usage.prompt_tokens == tk["count"]
  finally:
    engine.submit = submit
  assert http.post("/detokenize", json={"tokens": want}).json() == {"prompt": tok.decode(want)}
  for path, body, param in (
      ("/tokenize", {"messages": ASK, "reasoning_effort": "medium"}, "reasoning_effort"),
      ("/tokenize", {"messages": ASK, "chat_template_kwargs": {"thinking": "no"}},
       "chat_template_kwargs"),
      ("/tokenize", {"messages": "hi"}, "messages"),
      ("/tokenize", {}, "messages"),
      ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
      ("/tokenize", {"prompt": [1, 10 ** 12], "return_token_strs": True}, "prompt"),
      ("/tokenize", {"messages": ASK, "tools": TOOLS, "tool_choice": "sometimes"},
       "tool_choice"),
      ("/detokenize", {"tokens": [1, -1]}, "tokens"),
      ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "medium"},
       "reasoning_effort")):
    e = http.post(path, json=body)
    assert e.status_code == 400 and e.json()["error"]["param"] == param, (path, body, e.json())
  with pytest.raises(openai.BadRequestError, match="top_logprobs"):
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, logprobs=True,
                                   top_logprobs=6)
  with pytest.raises(openai.BadRequestError, match="not in tools"):
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, tools=TOOLS,
                                   tool_choice={"type": "function",
                                                "function": {"name": "nope"}})
  with pytest.raises(openai.BadRequestError, match="suffix"):
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, suffix="y")
