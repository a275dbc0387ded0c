"""The K3 chat format end to end over HTTP: a tiny random-weight model with K3's vocabulary
(163,840 ids) exported with the K3-format test tokenizer (tests/conftest.py) by `convert`'s
export, served from that directory (`serve --hf_dir` picks the directory's tokenizer, hence
the K3 template), driven by the `openai` client in process (ASGI transport)."""

import json

import openai
import pytest

from k3_jax.data.chat import K3Template, template_for

MODEL = "k3-chat-test"
# The prompts are 160 and 224 tokens with the test tokenizer: pieces of 64 and 16 tokens
# only, so the engine compiles two prefill piece lengths (docs/serving.md) and no more.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris now?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, k3_tokenizer):
  from starlette.testclient import TestClient
  from k3_jax.checkpoint import convert
  from k3_jax.config import ServeConfig
  from k3_jax.model import create_model
  from k3_jax.serve.loader import ServeOptions, build_engine, random_weights
  from k3_jax.serve.server import build_app
  cfg, *_ = random_weights("k3_tiny", ("vocab_size=163840", "num_layers=2", "mla_layers=(2,)",
                                       "max_seq_len=512"))
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
    yield client, tok
    app.state.loop.stop()


def test_k3_tool_calls_over_http(served):
  """A named tool_choice: the call comes back as tool_calls (parsed from the generated tools
  channel), streamed as delta.tool_calls with the same name and arguments. Then call, tool
  message, answer: the tool result is rendered back into the conversation (the prompt is the
  template's). Unsupported parameters are a 400 naming them."""
  client, tok = served
  t = template_for(tok)
  assert isinstance(t, K3Template)
  kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
  r = client.chat.completions.create(**kw)
  choice = r.choices[0]
  assert r.usage.prompt_tokens == len(t.render(ASK, tools=TOOLS, tool_choice=kw[
      "tool_choice"]).ids)
  call = choice.message.tool_calls[0]
  assert call.function.name == "get_weather" and call.type == "function"
  assert isinstance(json.loads(call.function.arguments), dict)
  assert choice.finish_reason in ("length", "tool_calls")
  chunks = list(client.chat.completions.create(**kw, stream=True))
  streamed = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
  assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == \
      [(i, c.function.name, c.function.arguments) for i, c in
       enumerate(choice.message.tool_calls)]
  assert chunks[-1].choices[0].finish_reason == choice.finish_reason
  messages = ASK + [
      {"role": "assistant", "content": "", "tool_calls": [{
          "id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny 21"}]
  r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                     max_tokens=3, temperature=0)
  assert r.usage.prompt_tokens == len(template_for(tok).render(messages, tools=TOOLS).ids)
  assert isinstance(r.choices[0].message.reasoning_content, str)    # thinking by default
  with pytest.raises(openai.BadRequestError, match="top_logprobs"):
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, logprobs=True,
                                   top_logprobs=6)
  with pytest.raises(openai.BadRequestError, match="not in tools"):
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, tools=TOOLS,
                                   tool_choice={"type": "function",
                                                "function": {"name": "nope"}})
  with pytest.raises(openai.BadRequestError, match="suffix"):
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, suffix="y")
