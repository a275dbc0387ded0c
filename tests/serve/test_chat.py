"""Chat templates: the released K3 block format (with the K3-format test tokenizer of
tests/conftest.py: a learned BPE, the K3 special tokens at their released ids) and the plain
template of the byte presets."""

import json
import re

import pytest

from k3_jax.data.tokenizers import KIMI_SPECIAL_TOKENS, ByteTokenizer
from k3_jax.data.chat import (BLOCKS, ChatError, K3Template, PlainTemplate, Rendered,
                               parse_assistant, render_conversation, template_for)

MARKER = re.compile(r"(<\|open\|>|<\|close\|>|<\|sep\|>|<\|end_of_msg\|>)")


def spec_ids(tok, text):
  """Ids of text written in the spec's notation: the four markers are their special ids,
  each run of text between them is encoded on its own (independent of chat.py)."""
  out = []
  for part in MARKER.split(text):
    if part in KIMI_SPECIAL_TOKENS:
      out.append(KIMI_SPECIAL_TOKENS[part])
    elif part:
      out += tok.encode(part)
  return out


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call a tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21"},
    {"role": "user", "content": "Thanks!"},
]

RENDERED = (
    '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="user"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|>'         # an earlier turn: its reasoning dropped
    '<|open|>response<|sep|><|close|>response<|sep|>'
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="array"<|sep|>[1,2]<|close|>argument<|sep|>'
    '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="tool"<|sep|>sunny, 21<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="user"<|sep|>Thanks!<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')

PINNED = [
    163587, 351, 295, 257, 560, 34, 163589, 66, 101, 411, 105, 101, 102, 46, 163588, 351,
    163589, 163586, 163587, 351, 295, 257, 564, 34, 163589, 87, 342, 320, 371, 63, 163588, 351,
    163589, 163586, 163587, 351, 295, 257, 525, 34, 163589, 163587, 114, 283, 112, 306, 265,
    163589, 163588, 114, 283, 112, 306, 265, 163589, 163587, 561, 115, 163589, 163587, 99, 97,
    304, 297, 257, 541, 517, 34, 447, 257, 49, 34, 163589, 163587, 282, 103, 309, 301, 452,
    257, 340, 34, 272, 257, 558, 34, 163589, 332, 163588, 282, 103, 309, 301, 163589, 163587,
    282, 103, 309, 301, 452, 257, 539, 34, 272, 257, 522, 34, 163589, 91, 49, 44, 50, 93,
    163588, 282, 103, 309, 301, 163589, 163588, 99, 97, 304, 163589, 163588, 561, 115, 163589,
    163588, 351, 163589, 163586, 163587, 351, 295, 257, 561, 34, 163589, 115, 355, 110, 121,
    44, 32, 511, 163588, 351, 163589, 163586, 163587, 351, 295, 257, 564, 34, 163589, 513, 334,
    107, 115, 33, 163588, 351, 163589, 163586, 163587, 351, 295, 257, 525, 34, 163589, 163587,
    116, 104, 303, 107, 163589]


def test_k3_render_pins_ids(k3_tokenizer):
  """system, user, assistant with reasoning and a tool call, tool result, user: the exact ids
  (pinned), which are the spec's text with the markers as their released special ids."""
  t = template_for(k3_tokenizer)
  assert isinstance(t, K3Template)
  r = t.render(CONVERSATION)
  assert r.ids == spec_ids(k3_tokenizer, RENDERED)
  assert r.ids == PINNED
  assert r.stop_ids == (163586,) and r.thinking
  assert k3_tokenizer.decode(r.ids) == RENDERED           # markers decode as contiguous text


def test_k3_reasoning_history_effort_and_instant(k3_tokenizer):
  t = template_for(k3_tokenizer)
  agentic = CONVERSATION[:4]                 # the tool result answers the current turn's call
  text = k3_tokenizer.decode(t.render(agentic).ids)
  assert "<|open|>think<|sep|>I should call a tool.<|close|>think<|sep|>" in text   # kept
  instant = k3_tokenizer.decode(t.render(agentic, thinking=False).ids)
  assert "think" not in instant and instant.endswith(
      '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
  low = k3_tokenizer.decode(t.render(CONVERSATION[:2], effort="low").ids)
  assert low.startswith('<|open|>message role="system"<|sep|>reasoning_effort: low'
                        '<|close|>message<|sep|><|end_of_msg|>')
  with pytest.raises(ChatError, match="reasoning_effort"):
    t.render(CONVERSATION, effort="extreme")


def test_k3_parser_channels_and_tool_calls(k3_tokenizer):
  """Generated ids, fed one at a time: reasoning, content and the tool calls come back;
  a string argument is raw text, others JSON; attribute values escaped; a literal marker
  written as text stays text."""
  t = template_for(k3_tokenizer)
  r = t.render(CONVERSATION[:2], tools=[{"type": "function", "function": {"name": "f"}}])
  key, raw = 'we"ird & key', 'x = "<|open|>" & y\n'     # raw: a marker's name as text
  args = {key: raw, "n": 1.5, "ok": True, "none": None, "obj": {"a": [1, "b"]}}
  ids = (k3_tokenizer.encode("Thinking <|open|> as text.") + spec_ids(
      k3_tokenizer, '<|close|>think<|sep|><|open|>response<|sep|>Calling.<|close|>response'
      '<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument '
      'key="we&quot;ird &amp; key" type="string"<|sep|>') + k3_tokenizer.encode(raw)
      + spec_ids(k3_tokenizer, "".join(
          f'<|close|>argument<|sep|><|open|>argument key="{k}" type="{ty}"<|sep|>{v}'
          for k, ty, v in (("n", "number", "1.5"), ("ok", "boolean", "true"),
                           ("none", "null", "null"), ("obj", "object", '{"a":[1,"b"]}')))
          + '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="g" index="2"'
          '<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>'
          '<|end_of_msg|>'))
  p = t.parser(r)
  reasoning, content, calls = "", "", []
  for i in ids:
    d = p.add([i])
    reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.tool_calls
  d = p.flush()
  assert (reasoning + d.reasoning, content + d.content) == ("Thinking <|open|> as text.",
                                                            "Calling.")
  assert [c["function"]["name"] for c in calls] == ["f", "g"]
  assert [c["index"] for c in calls] == [0, 1]
  assert json.loads(calls[0]["function"]["arguments"]) == args
  assert json.loads(calls[1]["function"]["arguments"]) == {}
  msg = parse_assistant(t, r, ids)
  assert msg["reasoning_content"] == "Thinking <|open|> as text." and len(msg["tool_calls"]) == 2


def test_k3_tool_round_trip_and_forced_calls(k3_tokenizer):
  """A call rendered into the conversation parses back to the same arguments; tool
  definitions go first as a system tools block; a named tool_choice starts the call in the
  prompt, so the parser (started there) sees a call to that function."""
  t = template_for(k3_tokenizer)
  tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
      "type": "object", "properties": {"city": {"type": "string"}}}}}]
  r = t.render(CONVERSATION[1:2], tools=tools, tool_choice={
      "type": "function", "function": {"name": "get_weather"}})
  text = k3_tokenizer.decode(r.ids)
  assert text.startswith('<|open|>message role="system"<|sep|><|open|>tools<|sep|>'
                         + json.dumps(tools) + '<|close|>tools<|sep|><|close|>message<|sep|>')
  assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
                       '<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>'
                       '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>')
  # what a model continuing the forced call writes = the call as the template renders it
  history = t.render_conversation(CONVERSATION[:3])[0]
  call = spec_ids(k3_tokenizer, '<|open|>argument key="city" type="string"<|sep|>Paris'
                  '<|close|>argument<|sep|><|open|>argument key="days" type="array"<|sep|>'
                  '[1,2]<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
                  '<|close|>message<|sep|><|end_of_msg|>')
  assert history[-len(call):] == call
  msg = parse_assistant(t, r, call)
  assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
  assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == \
      json.loads(CONVERSATION[2]["tool_calls"][0]["function"]["arguments"])
  required = k3_tokenizer.decode(t.render(CONVERSATION[1:2], tools=tools,
                                          tool_choice="required", thinking=False).ids)
  assert required.endswith("<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>")
  none = k3_tokenizer.decode(t.render(CONVERSATION[1:2], tools=tools, tool_choice="none").ids)
  assert "tools" not in none
  for bad, match in (({"type": "function", "function": {"name": "nope"}}, "not in tools"),
                     ("sometimes", "tool_choice")):
    with pytest.raises(ChatError, match=match):
      t.render(CONVERSATION[1:2], tools=tools, tool_choice=bad)
  with pytest.raises(ChatError, match="tools"):
    t.render(CONVERSATION[1:2], tools=[{"type": "function"}])
  # any arguments, escaped attributes included: rendered, then parsed, are the same
  args = {'k"e&y': 'raw "<|sep|>" text', "x": [1, {"y": None}], "b": False, "f": -2.5e-3}
  msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok",
          "reasoning_content": "r", "tool_calls": [{"type": "function", "function": {
              "name": 'to"ol', "arguments": json.dumps(args)}}]}]
  ids, mask = t.render_conversation(msgs)
  body = [i for i, m in zip(ids, mask) if m]
  start = Rendered([], thinking=True, start=(("message", {"role": "assistant"}),), tools=True)
  msg = parse_assistant(t, start, body)
  assert (msg["content"], msg["reasoning_content"]) == ("ok", "r")
  assert msg["tool_calls"][0]["function"]["name"] == 'to"ol'
  assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == args


def test_render_conversation_mask(k3_tokenizer):
  """The assistant mask covers exactly what the assistant wrote: after its message header,
  through its <|end_of_msg|>."""
  ids, mask = render_conversation(k3_tokenizer, CONVERSATION)
  assert len(ids) == len(mask)
  marked = [i for i, m in zip(ids, mask) if m]
  head = spec_ids(k3_tokenizer, '<|open|>message role="assistant"<|sep|>')
  whole = spec_ids(k3_tokenizer, RENDERED)
  at = len(spec_ids(k3_tokenizer, RENDERED.split('<|open|>message role="assistant"')[0]))
  end = whole.index(163586, at) + 1
  assert marked == whole[at + len(head):end]
  assert set(BLOCKS) == {"message", "think", "response", "tools", "call", "argument"}
  ids, mask = render_conversation(ByteTokenizer(), [{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": "Yo"}])
  assert bytes(i for i, m in zip(ids, mask) if m) == b"Yo\n"


def test_plain_template():
  t = template_for(ByteTokenizer())
  assert isinstance(t, PlainTemplate)
  r = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
  assert ByteTokenizer().decode(r.ids) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
  assert r.stop == ("\n<|user|>",)
  for bad in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 3}]):
    with pytest.raises(ChatError):
      t.render(bad)


def test_image_parts_render_in_place(k3_tokenizer):
  """An image part becomes its media tokens + placeholders where it stands (between the text
  parts around it), in the plain and the K3 template; its patches are what to_patches gives;
  a model without a tower refuses it."""
  import base64
  import io
  import numpy as np
  from PIL import Image
  import configs
  from k3_jax.data import images as im
  from k3_jax.serve.prefix_cache import block_hashes, image_salts
  v = configs.get_multimodal("k3_tiny").vision
  pixels = np.random.default_rng(0).integers(0, 256, (28, 56, 3), dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, format="PNG")
  url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
  msg = [{"role": "user", "content": [{"type": "text", "text": "A "},
                                      {"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": " B"}]}]
  tok = ByteTokenizer()
  patches, grid = im.to_patches(pixels, v)
  media = im.image_token_ids(grid, v, tok.encode)
  r = template_for(tok, v).render(msg)
  assert r.ids == tok.encode("<|user|>\nA ") + media + tok.encode(" B\n<|assistant|>\n")
  np.testing.assert_array_equal(r.images["patches"], patches)
  k3 = template_for(k3_tokenizer, v)
  assert isinstance(k3, K3Template)
  ids = k3.render(msg, thinking=False).ids
  assert ids == (spec_ids(k3_tokenizer, '<|open|>message role="user"<|sep|>A ')
                 + im.image_token_ids(grid, v, k3_tokenizer.encode)
                 + spec_ids(k3_tokenizer, ' B<|close|>message<|sep|><|end_of_msg|>'
                            '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'))
  with pytest.raises(ChatError, match="no vision tower"):
    template_for(tok).render(msg)
  # the prefix cache keys a block holding placeholders on the image's content
  other = dict(r.images, patches=r.images["patches"] + 1)
  salted = [block_hashes(r.ids, 16, image_salts(r.ids, x, v.image_token_id, 16))
            for x in (r.images, r.images, other)]
  assert salted[0] == salted[1] and salted[0][0] == block_hashes(r.ids, 16)[0]   # no image
  assert salted[0][-1] != salted[2][-1] and salted[0][-1] != block_hashes(r.ids, 16)[-1]


def test_api_params_refusals_and_tool_calls():
  from k3_jax.serve.api_params import ParamError, ToolCalls, refuse_unsupported, render_kwargs
  from k3_jax.data.chat import Delta
  refuse_unsupported({"logprobs": True, "response_format": {"type": "text"}, "n": 2,
                      "logit_bias": {"5": 1}}, "chat")
  with pytest.raises(ParamError, match="unsupported: audio, best_of") as e:
    refuse_unsupported({"audio": {"voice": "x"}, "best_of": 2}, "chat")
  assert e.value.param == "audio"
  with pytest.raises(ParamError, match="suffix"):
    refuse_unsupported({"suffix": ""}, "completions")
  refuse_unsupported({"echo": True, "logprobs": 5, "n": 3, "best_of": 4},
                     "completions")   # supported
  with pytest.raises(ParamError, match="tools"):
    render_kwargs({"tools": "get_weather"})
  with pytest.raises(ParamError, match="parallel_tool_calls"):
    render_kwargs({"parallel_tool_calls": "yes"})
  calls = ToolCalls({"parallel_tool_calls": False})
  one = {"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
  assert calls.add(Delta(tool_calls=[one, {**one, "id": "b"}])) == [one]
  assert calls.message() == [{k: v for k, v in one.items() if k != "index"}]
  assert (calls.finish_reason("stop"), calls.finish_reason("length")) == ("tool_calls", "length")
  assert ToolCalls({}).finish_reason("stop") == "stop"
