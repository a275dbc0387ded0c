"""Chat templates: the released K3 prompt encoder, rule by rule (with the K3-format test
tokenizer of tests/conftest.py: a learned BPE, the K3 special tokens at their released ids),
its parser, and the plain template of the byte presets.

`spec_ids` is an independent encoder of text written in the format's notation: the four
markers are their special ids; the header between <|open|> and <|sep|> is split as the
release splits it (TAG, then per attribute ` KEY`, `="`, VALUE, `"`), each piece encoded on
its own; any other run of text between markers is one piece."""

import json
import random
import re

import pytest

from k3_jax.data.tokenizers import KIMI_SPECIAL_TOKENS, ByteTokenizer
from k3_jax.data.chat import (BLOCKS, ChatError, K3Template, PlainTemplate, Rendered,
                               parse_assistant, render_conversation, template_for)

MARKER = re.compile(r"(<\|open\|>|<\|close\|>|<\|sep\|>|<\|end_of_msg\|>)")
ATTR = re.compile(r' ([\w-]+)="([^"]*)"')


def spec_ids(tok, text):
  out, header = [], False
  for part in MARKER.split(text):
    if part in KIMI_SPECIAL_TOKENS:
      out.append(KIMI_SPECIAL_TOKENS[part])
      header = part == "<|open|>"
      continue
    if header:
      tag, attrs = part.split(" ")[0], ATTR.findall(part)
      assert part == tag + "".join(f' {k}="{v}"' for k, v in attrs), part
      pieces = [tag] + [p for k, v in attrs for p in (f" {k}", '="', v, '"')]
    else:
      pieces = [part]
    out += [i for p in pieces if p for i in tok.encode(p)]
  return out


T = template_for
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo du jour", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}]
TOOLS_JSON = ('[{"function":{"description":"Météo du jour","name":"get_weather","parameters":'
              '{"properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":'
              '["city"],"type":"object"}},"type":"function"}]')
TOOL_DECLARE = ('<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the '
                'available tools, described in JSONSchema.\n\n```json\n' + TOOLS_JSON +
                '\n```<|close|>message<|sep|><|end_of_msg|>')


def note(kind, body):
  return (f'<|open|>message role="system" type="{kind}"<|sep|>{body}<|close|>message<|sep|>'
          '<|end_of_msg|>')


EFFORT_HIGH = note("thinking-effort", "`thinking_effort` guides on how much to think in your "
                   "thinking channel (not including the response channel), supported values "
                   "include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
                   "with `thinking_effort=high`.")
REQUIRED = note("tool-choice", "The system is invoked with `tool_choice=required`.\nYou MUST "
                "call tools in the next message.")
NONE = note("tool-choice", "The system is invoked with `tool_choice=none`.\nYou MUST NOT call "
            "any tools in the next message.")
JSON_OBJECT = note("response-format", "The system is invoked with `response_format=json_object`."
                   "\nYour response must be raw JSON data without markdown code blocks (```json)"
                   " or any additional formatting.")

CONVERSATION = [
    {"role": "system", "content": "Be brief.", "name": "ops"},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities: two calls.",
     "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": (
             '{"city": "Paris", "days": [1, 2], "ok": true, "n": 1.5, "none": null, '
             '"o": {"a":1,"é":"ü"}}')}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Oslo"'}}]},
    {"role": "tool", "tool_call_id": "c2", "content": "snow, -3"},       # out of call order
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21"},
    {"role": "assistant", "content": "Paris sunny; Oslo snow.", "reasoning": "Both answered."},
    {"role": "user", "content": "Thanks!", "name": "ann"},
    {"role": "assistant", "content": "You're welcome.", "reasoning_content": "  \n"},
    {"role": "user", "content": "Bye"},
]
CALLS = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
         '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
         '<|open|>argument key="days" type="array"<|sep|>[1, 2]<|close|>argument<|sep|>'
         '<|open|>argument key="ok" type="boolean"<|sep|>true<|close|>argument<|sep|>'
         '<|open|>argument key="n" type="number"<|sep|>1.5<|close|>argument<|sep|>'
         '<|open|>argument key="none" type="null"<|sep|>null<|close|>argument<|sep|>'
         '<|open|>argument key="o" type="object"<|sep|>{"a": 1, "é": "ü"}<|close|>argument<|sep|>'
         '<|close|>call<|sep|><|open|>call tool="get_weather" index="2"<|sep|>'
         '<|open|>json type="object"<|sep|>{"city": "Oslo"<|close|>json<|sep|><|close|>call<|sep|>'
         '<|close|>tools<|sep|>')
BODY = (
    '<|open|>message role="system" name="ops"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="user"<|sep|>Weather in Paris and Oslo?<|close|>message<|sep|>'
    '<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>Two cities: two '
    'calls.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>' + CALLS +
    '<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny, 21<|close|>message'
    '<|sep|><|end_of_msg|>'
    '<|open|>message role="tool" tool="get_weather" index="2"<|sep|>snow, -3<|close|>message'
    '<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Both answered.<|close|>think<|sep|>'
    '<|open|>response<|sep|>Paris sunny; Oslo snow.<|close|>response<|sep|><|close|>message<|sep|>'
    '<|end_of_msg|><|open|>message role="user" name="ann"<|sep|>Thanks!<|close|>message<|sep|>'
    '<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
    '<|open|>response<|sep|>You\'re welcome.<|close|>response<|sep|><|close|>message<|sep|>'
    '<|end_of_msg|><|open|>message role="user"<|sep|>Bye<|close|>message<|sep|><|end_of_msg|>')
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
RENDERED = TOOL_DECLARE + EFFORT_HIGH + BODY + REQUIRED + JSON_OBJECT + GEN_THINK
KW = dict(tools=TOOLS, effort="high", tool_choice="required",
          response_format={"type": "json_object"})

# the ids of RENDERED on the test tokenizer (1,089 of them), pinned by their digest
PINNED = (1089, "6b429b7c7d24c0722fc7f8d7ca0be9f404a051cbf0a4e58614d5c14a378ed453")
PINNED_HEAD = [163587, 351, 295, 257, 560, 34, 272, 257, 561, 45, 264, 99, 108, 282, 101, 34,
               163589]     # <|open|> message  role ="  system "  type =" tool-declare " <|sep|>


def digest(ids):
  import hashlib
  return len(ids), hashlib.sha256(str(list(ids)).encode()).hexdigest()


def test_k3_render_pins_ids(k3_tokenizer):
  """Every rule at once (tool declaration, effort note, names, every assistant turn's think
  channel with the `reasoning` alias and an empty one for blank reasoning, calls with every
  argument type and a json block, tool results put into call order with tool / index, the
  tool-choice and response-format notes, the generation prompt): the release's ids, pinned,
  equal to the independent encoding of the text."""
  t = T(k3_tokenizer)
  assert isinstance(t, K3Template)
  r = t.render(CONVERSATION, **KW)
  assert k3_tokenizer.decode(r.ids) == RENDERED           # markers decode as contiguous text
  assert r.ids == spec_ids(k3_tokenizer, RENDERED)
  assert digest(r.ids) == PINNED and r.ids[:17] == PINNED_HEAD
  assert r.stop_ids == (163586,) and r.thinking


def test_k3_segments_are_encoded_one_by_one(k3_tokenizer):
  """Each header piece and each text part is its own segment (encoded alone: `Sunny in Pa` +
  `ris` is not `Sunny in Paris`); empty pieces are dropped; attribute values escaped (& first,
  then "); marker names inside text are ordinary tokens; no BOS."""
  from k3_jax.data.chat import CLOSE, EOM, OPEN, SEP
  t = T(k3_tokenizer)
  msgs = [{"role": "user", "name": 'a "b" & c', "content": [
      {"type": "text", "text": "Sunny in Pa"}, {"type": "text", "text": "ris"},
      {"type": "text", "text": ""}, {"type": "text", "text": "<|close|>message<|sep|>"}]}]
  segs = t.segments(msgs, add_generation_prompt=False)
  assert segs == [OPEN, "message", " role", '="', "user", '"', " name", '="',
                  "a &quot;b&quot; &amp; c", '"', SEP, "Sunny in Pa", "ris", "",
                  "<|close|>message<|sep|>", CLOSE, "message", SEP, EOM]
  ids = t.render(msgs, add_generation_prompt=False).ids
  enc = k3_tokenizer.encode
  assert ids == (spec_ids(k3_tokenizer, '<|open|>message role="user" name="a &quot;b&quot; '
                          '&amp; c"<|sep|>') + enc("Sunny in Pa") + enc("ris")
                 + enc("<|close|>message<|sep|>")
                 + spec_ids(k3_tokenizer, "<|close|>message<|sep|><|end_of_msg|>"))
  assert enc("Sunny in Pa") + enc("ris") != enc("Sunny in Paris")
  assert ids.count(163588) == 1 and ids[0] == 163587          # the text's markers are text
  named = [{"role": "assistant", "name": "bot", "content": "x"}, {"role": "user", "name": "",
                                                                  "content": "y"}]
  assert k3_tokenizer.decode(t.render(named, add_generation_prompt=False).ids) == (
      '<|open|>message role="assistant" name="bot"<|sep|><|open|>think<|sep|><|close|>think'
      '<|sep|><|open|>response<|sep|>x<|close|>response<|sep|><|close|>message<|sep|>'
      '<|end_of_msg|><|open|>message role="user"<|sep|>y<|close|>message<|sep|><|end_of_msg|>')


@pytest.mark.parametrize("kw,text", [
    # order and notes: tool declaration, effort note, conversation, tool-choice note
    (dict(tools=TOOLS, effort="low", tool_choice="none"),
     TOOL_DECLARE + EFFORT_HIGH.replace("=high", "=low") + '{ASK}' + NONE + GEN_THINK),
    (dict(tools=TOOLS, tool_choice="auto", effort="max"),
     TOOL_DECLARE + EFFORT_HIGH.replace("=high", "=max") + '{ASK}' + GEN_THINK),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     TOOL_DECLARE + '{ASK}' + GEN_THINK),                      # named: no note, no effort
    # instant: no think channel, no effort note; the generation opens the response
    (dict(thinking=False, effort="high"),
     '{ASK}<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'),
    (dict(add_generation_prompt=False, tool_choice="required", tools=TOOLS),
     TOOL_DECLARE + '{ASK}' + REQUIRED),
    # response formats: json_schema's schema from .schema, else .json_schema, else itself;
    # keys sorted recursively, compact, fenced
    *[(dict(response_format={"type": "json_schema", "json_schema": js}, thinking=False),
       '{ASK}' + note("response-format", "The system is invoked with `response_format="
                      "json_schema`.\nYour response must be raw JSON data without markdown "
                      "code blocks (```json) or any additional formatting.\nThe JSON data must "
                      'match the following schema:\n```json\n{"properties":{"b":{"type":'
                      '"number"},"a":{"type":"string"}},"type":"object"}\n```'.replace(
                          '"b":{"type":"number"},"a":{"type":"string"}',
                          '"a":{"type":"string"},"b":{"type":"number"}'))
       + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
      for js in ({"name": "w", "schema": {"type": "object", "properties": {
          "b": {"type": "number"}, "a": {"type": "string"}}}},
                 {"name": "w", "json_schema": {"type": "object", "properties": {
                     "b": {"type": "number"}, "a": {"type": "string"}}}},
                 {"type": "object", "properties": {"b": {"type": "number"},
                                                   "a": {"type": "string"}}})],
    (dict(response_format={"type": "text"}), '{ASK}' + GEN_THINK),
])
def test_k3_prompt_order_and_notes(k3_tokenizer, kw, text):
  ask = [{"role": "user", "content": "Hi"}]
  text = text.replace("{ASK}", '<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|>'
                      '<|end_of_msg|>')
  assert T(k3_tokenizer).render(ask, **kw).ids == spec_ids(k3_tokenizer, text)


def test_k3_refusals(k3_tokenizer):
  t = T(k3_tokenizer)
  ask = [{"role": "user", "content": "Hi"}]
  call = {"role": "assistant", "content": "", "tool_calls": [
      {"id": "x", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}
  for msgs, kw, match, param in (
      (ask, dict(effort="medium"), "reasoning_effort", "reasoning_effort"),   # listed, refused
      (ask, dict(effort="medium", thinking=False), "reasoning_effort", "reasoning_effort"),
      (ask + [call], {}, "must be a JSON object", "messages"),
      (ask + [{**call, "tool_calls": [{"function": {"name": "f"}}]}, {"role": "tool",
              "content": "r"}, {"role": "tool", "content": "s"}], {},
       "result 2", "messages"),
      ([{"role": "system", "content": "x", "tools": TOOLS}], {}, "has no content", "messages"),
      (ask, dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
       "not in tools", "tool_choice"),
      (ask, dict(tools=[{"type": "function"}]), "tools", "tools"),
      (ask, dict(response_format={"type": "xml"}), "response_format", "response_format"),
      ([{"role": "user", "content": "x", "name": 3}], {}, "name", "messages")):
    with pytest.raises(ChatError, match=match) as e:
      t.render(msgs, **kw)
    assert e.value.param == param


def test_k3_tool_messages_and_new_tools(k3_tokenizer):
  """Tool results: reordered into call order only when every id of the run matches a call
  (each then named by its call); otherwise as sent, named by `tool`, `name` or the N-th
  call; N counts from the last assistant message. A system message carrying tools declares
  more mid-conversation."""
  t = T(k3_tokenizer)
  calls = {"role": "assistant", "content": "", "tool_calls": [
      {"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": ""}}
      for k, n in ((1, "f"), (2, "g"))]}
  head = ('<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response'
          '<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|>'
          '<|open|>call tool="g" index="2"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
          '<|close|>message<|sep|><|end_of_msg|>')

  def tool(name, k, text):
    return (f'<|open|>message role="tool" tool="{name}" index="{k}"<|sep|>{text}<|close|>'
            'message<|sep|><|end_of_msg|>')
  for results, want in (
      ([("c2", None, "G"), ("c1", None, "F")], tool("f", 1, "F") + tool("g", 2, "G")),
      ([("c2", None, "G"), ("zz", None, "F")], tool("f", 1, "G") + tool("g", 2, "F")),
      ([(None, "h", "H"), (None, None, "G")], tool("h", 1, "H") + tool("g", 2, "G")),
  ):
    msgs = [calls] + [{"role": "tool", "content": c, **({"tool_call_id": i} if i else {}),
                       **({"name": n} if n else {})} for i, n, c in results]
    got = t.render(msgs, thinking=False, add_generation_prompt=False).ids
    assert got == spec_ids(k3_tokenizer, head + want), results
  msgs = [{"role": "user", "content": "Hi"}, {"role": "system", "tools": TOOLS},
          {"role": "tool", "tool": "get_weather", "content": "r", "tool_call_id": "q"}]
  assert t.render(msgs, thinking=False, add_generation_prompt=False).ids == spec_ids(
      k3_tokenizer, '<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
      '<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\nThe '
      'system dynamically extends the toolset via lazy-loading.\nYou have access to all '
      'existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n'
      + TOOLS_JSON + '\n```<|close|>message<|sep|><|end_of_msg|>' + tool("get_weather", 1, "r"))


def _image_message(h, w):
  """(vision config, pixels [h, w, 3], a user message: text, the image as a data URL, text)."""
  import base64
  import io
  import numpy as np
  from PIL import Image
  import configs
  v = configs.get_multimodal("k3_tiny").vision
  pixels = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, format="PNG")
  url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
  return v, pixels, [{"role": "user", "content": [
      {"type": "text", "text": "A "}, {"type": "image_url", "image_url": {"url": url}},
      {"type": "text", "text": " B"}]}]


def test_k3_image_block_names_the_original_size(k3_tokenizer):
  from k3_jax.data import images as im
  v, pixels, msg = _image_message(30, 50)
  _, grid = im.to_patches(pixels, v)
  r = T(k3_tokenizer, v).render(msg, thinking=False)
  media = ([v.media_begin_id] + k3_tokenizer.encode("image 50x30") + [v.media_content_id]
           + [v.image_token_id] * im.num_image_tokens(grid, v) + [v.media_end_id])
  assert r.ids == (spec_ids(k3_tokenizer, '<|open|>message role="user"<|sep|>A ') + media
                   + spec_ids(k3_tokenizer, ' B<|close|>message<|sep|><|end_of_msg|>'
                              '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'))
  assert grid[0] * v.patch_size != 30 or grid[1] * v.patch_size != 50   # resized, named as sent


def _feed(parser, ids, chunks):
  """ids fed in pieces of the given sizes (cycled) -> (reasoning, content, calls)."""
  r, c, calls, i, k = "", "", [], 0, 0
  while i < len(ids):
    n = chunks[k % len(chunks)]
    d = parser.add(ids[i:i + n])
    r, c, calls, i, k = r + d.reasoning, c + d.content, calls + d.tool_calls, i + n, k + 1
  d = parser.flush()
  return r + d.reasoning, c + d.content, calls + d.tool_calls


def _strip_ids(calls):
  return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_k3_parser_what_the_model_writes(k3_tokenizer):
  """Generated ids in any pieces (one at a time, splitting every header; random sizes) give
  the same reasoning, content and OpenAI tool_calls: every argument type (a string raw, the
  rest JSON; an attribute value unescaped), a `json` block kept as written, a tools block
  straight after an unclosed think channel (no response), a literal marker in text."""
  t = T(k3_tokenizer)
  r = t.render([{"role": "user", "content": "go"}], tools=TOOLS)
  raw = 'x = "<|open|>" & y\n'
  before = ('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
            '<|open|>argument key="we&quot;ird &amp; key" type="string"<|sep|>')
  after = (
      '<|close|>argument<|sep|>'
      '<|open|>argument key="n" type="number"<|sep|>1.5<|close|>argument<|sep|>'
      '<|open|>argument key="ok" type="boolean"<|sep|>true<|close|>argument<|sep|>'
      '<|open|>argument key="none" type="null"<|sep|>null<|close|>argument<|sep|>'
      '<|open|>argument key="l" type="array"<|sep|>[1, "b"]<|close|>argument<|sep|>'
      '<|open|>argument key="obj" type="object"<|sep|>{"a": {"é": null}}<|close|>argument<|sep|>'
      '<|close|>call<|sep|><|open|>call tool="g" index="2"<|sep|><|open|>json type="object"<|sep|>'
      '{"q": 1,<|close|>json<|sep|><|close|>call<|sep|><|open|>call tool="h" index="3"<|sep|>'
      '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
  enc = k3_tokenizer.encode            # text holding a marker's name: ordinary tokens
  ids = (enc("Thinking <|open|> as text.") + spec_ids(k3_tokenizer, before) + enc(raw)
         + spec_ids(k3_tokenizer, after))
  want_args = {'we"ird & key': raw, "n": 1.5, "ok": True, "none": None, "l": [1, "b"],
               "obj": {"a": {"é": None}}}
  rng = random.Random(0)
  results = [_feed(t.parser(r), ids, chunks) for chunks in (
      [1], [len(ids)], [rng.randint(1, 7) for _ in range(50)], [2, 3])]
  for reasoning, content, calls in results:
    assert (reasoning, content) == ("Thinking <|open|> as text.", "")
    assert [c["index"] for c in calls] == [0, 1, 2]
    assert [c["function"]["name"] for c in calls] == ["f", "g", "h"]
    assert json.loads(calls[0]["function"]["arguments"]) == want_args
    assert calls[1]["function"]["arguments"] == '{"q": 1,'            # kept as written
    assert calls[2]["function"]["arguments"] == "{}"
  assert len({str(_strip_ids(x[2])) for x in results}) == 1
  msg = parse_assistant(t, r, ids)
  assert msg["reasoning_content"] == "Thinking <|open|> as text." and len(msg["tool_calls"]) == 3
  # a response opened over an unclosed think; tool_choice none: calls are not returned
  ids = spec_ids(k3_tokenizer, 'Hmm<|open|>response<|sep|>Hi<|close|>response<|sep|><|open|>'
                 'tools<|sep|><|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|>')
  assert _feed(t.parser(r), ids, [1])[:2] == ("Hmm", "Hi")
  assert _feed(t.parser(t.render([{"role": "user", "content": "go"}], tools=TOOLS,
                                 tool_choice="none")), ids, [1])[2] == []
  # cut off inside a call (max_tokens): the call comes back with the arguments so far
  cut = spec_ids(k3_tokenizer, '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                 '<|open|>argument key="a" type="number"<|sep|>2<|close|>argument<|sep|>'
                 '<|open|>argument key="b" type="string"<|sep|>par')
  (call,) = _feed(t.parser(r), cut, [1])[2]
  assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": "par"}


def test_k3_render_parse_round_trip(k3_tokenizer):
  """An assistant message rendered into a conversation, its masked ids parsed back, is the
  same message: content, reasoning, calls with any arguments (escaped keys and names,
  nested values, non-ASCII, a string that looks like JSON, invalid JSON kept as written)."""
  t = T(k3_tokenizer)
  argsets = [{'k"e&y': 'raw "<|sep|>" text', "x": [1, {"y": None}], "b": False, "f": -2.5e-3,
              "s": '{"not": "parsed"}', "u": "Ünïcode façade"}, {}, '{"broken": ']
  msgs = [{"role": "user", "content": "go"}, {
      "role": "assistant", "content": "ok", "reasoning_content": "r", "tool_calls": [
          {"id": str(k), "type": "function", "function": {
              "name": f'to"ol{k}', "arguments": a if isinstance(a, str) else json.dumps(a)}}
          for k, a in enumerate(argsets)]}]
  ids, mask = t.render_conversation(msgs)
  body = [i for i, m in zip(ids, mask) if m]
  msg = parse_assistant(t, Rendered([], thinking=True, start=(
      ("message", {"role": "assistant"}),), tools=True), body)
  assert (msg["content"], msg["reasoning_content"]) == ("ok", "r")
  got = [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
  assert [n for n, _ in got] == ['to"ol0', 'to"ol1', 'to"ol2']
  assert json.loads(got[0][1]) == argsets[0] and json.loads(got[1][1]) == {}
  assert got[2][1] == argsets[2]
  # the parsed message sent back renders the same ids
  back = [msgs[0], {**msg, "tool_calls": msg["tool_calls"]}]
  assert t.render_conversation(back)[0] == ids


def test_render_conversation_mask(k3_tokenizer):
  """The assistant mask covers exactly what each assistant turn wrote: after its message
  header, through its <|end_of_msg|>, think channel included."""
  ids, mask = render_conversation(k3_tokenizer, CONVERSATION, TOOLS)
  whole = spec_ids(k3_tokenizer, TOOL_DECLARE + BODY)
  assert ids == whole and len(mask) == len(ids)
  head = spec_ids(k3_tokenizer, '<|open|>message role="assistant"<|sep|>')
  want, at = [False] * len(ids), 0
  while True:
    at = next((i for i in range(at, len(ids)) if ids[i:i + len(head)] == head), None)
    if at is None:
      break
    end = ids.index(163586, at) + 1
    want[at + len(head):end] = [True] * (end - at - len(head))
    at = end
  assert mask == want and sum(want) > 0
  assert set(BLOCKS) == {"message", "think", "response", "tools", "call", "argument", "json"}
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
  parts around it), in the plain template (the K3 one: test_k3_image_block_names_the_original_size); its
  patches are what to_patches gives;
  a model without a tower refuses it."""
  import numpy as np
  from k3_jax.data import images as im
  from k3_jax.serve.prefix_cache import block_hashes, image_salts
  v, pixels, msg = _image_message(28, 56)
  tok = ByteTokenizer()
  patches, grid = im.to_patches(pixels, v)
  media = im.image_token_ids(grid, v, tok.encode, size=(56, 28))
  r = template_for(tok, v).render(msg)
  assert r.ids == tok.encode("<|user|>\nA ") + media + tok.encode(" B\n<|assistant|>\n")
  np.testing.assert_array_equal(r.images["patches"], patches)
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
  from k3_jax.serve.api_schema import ChatCompletionRequest, TokenizeRequest, parse
  ask = {"messages": [{"role": "user", "content": "hi"}]}
  tools = [{"type": "function", "function": {"name": "f"}}]
  for model, body, param in (
      (ChatCompletionRequest, {"tools": "get_weather"}, "tools"),
      (ChatCompletionRequest, {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
      (ChatCompletionRequest, {"tool_choice": "required"}, "tool_choice"),
      (ChatCompletionRequest, {"tools": tools, "tool_choice": {
          "type": "function", "function": {"name": "g"}}}, "tool_choice"),
      (TokenizeRequest, {"continue_final_message": True}, "continue_final_message")):
    with pytest.raises(ParamError, match=param) as e:
      parse(model, {**ask, **body})
    assert e.value.param == param
  got = render_kwargs({**ask, "tools": tools}, tokenize=True)
  assert got["tools"] == tools and got["thinking"] and got["add_generation_prompt"]
  calls = ToolCalls({"parallel_tool_calls": False})
  one = {"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
  assert calls.add(Delta(tool_calls=[one, {**one, "id": "b"}])) == [one]
  assert calls.message() == [{k: v for k, v in one.items() if k != "index"}]
  assert (calls.finish_reason("stop"), calls.finish_reason("length")) == ("tool_calls", "length")
  assert ToolCalls({}).finish_reason("stop") == "stop"


def test_serving_doc_example_is_what_the_template_renders(k3_tokenizer):
  """docs/serving.md's agentic conversation, rendered there, is the template's output (its
  line breaks after each message added for reading), 601 ids on the test tokenizer."""
  import pathlib
  doc = (pathlib.Path(__file__).parents[2] / "docs" / "serving.md").read_text()
  shown = doc.split("````\n")[1].replace("<|end_of_msg|>\n", "<|end_of_msg|>")
  tools = [{"type": "function", "function": {
      "name": "get_weather", "description": "Current weather", "parameters": {
          "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
  messages = [
      {"role": "system", "content": "You are a concise assistant."},
      {"role": "user", "content": "Weather in Paris and Oslo?"},
      {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.",
       "tool_calls": [{"id": f"call_{k}", "type": "function", "function": {
           "name": "get_weather", "arguments": json.dumps({"city": c})}}
           for k, c in (("a", "Paris"), ("b", "Oslo"))]},
      {"role": "tool", "tool_call_id": "call_b", "content": "snow, -3"},
      {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21"}]
  r = T(k3_tokenizer).render(messages, tools=tools, effort="high")
  assert k3_tokenizer.decode(r.ids) + "\n" == shown and len(r.ids) == 601
