"""Chat templates: messages -> prompt token ids, and generated ids -> content, reasoning and
tool calls.

K3 format ("XTML", docs/architecture.md section 9), used when the tokenizer has the special
tokens `<|open|>`, `<|close|>`, `<|sep|>` and `<|end_of_msg|>`. Everything is a block

    <|open|>TAG ATTRS<|sep|>BODY<|close|>TAG<|sep|>      ATTRS: key="value" (& and " escaped)

and BLOCKS below is the one description of them that rendering and parsing both use. The
prompt is built as the released K3 prompt encoder builds it: a list of segments, each either
one of the four markers (its special id) or a piece of text BPE-encoded on its own, with no
special tokens (marker names inside user text stay ordinary text); empty pieces are dropped,
no BOS. An open tag is the segments

    <|open|>  TAG  (" KEY"  '="'  ESCAPED-VALUE  '"') per attribute  <|sep|>

and a close tag `<|close|>` TAG `<|sep|>`; a message is a `message` block followed by
`<|end_of_msg|>`. The prompt, in order (docs/serving.md shows one rendered):

  1. the tools, if any: a system message type="tool-declare" holding TOOLS_PREAMBLE and the
     tools array as compact, key-sorted JSON in a fenced `json` block;
  2. with thinking on and a reasoning effort (low, high, max) given: the thinking-effort note;
  3. the conversation: system / user messages (role, name; each text part its own segment,
     an image part its media block naming the image's original size), a system message that
     carries `tools` and no content (more tools declared mid-conversation: NEW_TOOLS_PREAMBLE),
     assistant messages (role, name; with thinking on EVERY one has a think channel, empty
     when it has no `reasoning_content` / `reasoning`; then its response channel; then its
     tool calls), tool messages (role, tool, index; a run of them answering the last
     assistant's calls is put into call order first);
  4. the tool-choice note for tool_choice "required" or "none";
  5. the response-format note for response_format json_object / json_schema;
  6. the generation prompt: `<|open|>message role="assistant"<|sep|>` then `<|open|>think<|sep|>`
     (thinking) or `<|open|>response<|sep|>` (instant, chat_template_kwargs thinking=false).

A tool call is a `call` block (tool, index from 1) inside the assistant's `tools` channel
holding one `argument` block (key, type) per argument: type is string, number, boolean,
null, object or array; a string's body is the raw text, any other value JSON with the default
separators. Arguments that are not valid JSON are kept as written in a `json` block
(type="object"). Generation stops at `<|end_of_msg|>`. A forced tool_choice (required or a
function) is enforced by serve/grammar.py's constraint, not by the prompt.

Plain format (byte-level presets, no special tokens), documented in docs/serving.md:

    <|system|>\n{content}\n<|user|>\n{content}\n<|assistant|>\n{content}\n ... <|assistant|>\n

with the stop string "\n<|user|>" (the model would start the next user turn); no reasoning.

Images (a model with a vision tower): a user message's content may be a list of OpenAI
content parts, {"type": "text", "text": ...} and {"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}. An image part becomes the media tokens and placeholders of
data/images.image_token_ids where it stands; Rendered.images holds the packed images (at most
vision.max_patches patches per request). Only data URLs are accepted: nothing is fetched.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from k3_jax.config import VisionConfig
from k3_jax.data import images as im

EFFORTS = ("low", "high", "max")
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
  """Malformed messages or chat parameters (the server answers 400 naming `param`)."""

  def __init__(self, message: str, param: str = "messages"):
    super().__init__(message)
    self.param = param


@dataclasses.dataclass(frozen=True)
class Image:
  """An image part: its patches and grid (data/images.to_patches) and original size (W, H)."""
  patches: object
  grid: tuple[int, int]
  size: tuple[int, int]


def _image_part(part: dict, where: str, role: str, vision: VisionConfig | None) -> Image:
  if vision is None:
    raise ChatError(f"{where}: this model has no vision tower; it cannot take images")
  if role != "user":
    raise ChatError(f"{where}: images are accepted in user messages only")
  ref = part.get("image_url")
  url = ref.get("url") if isinstance(ref, dict) else ref
  try:
    image = im.decode_data_url(url, f"{where}.image_url")
    return Image(*im.to_patches(image, vision), (image.width, image.height))
  except im.ImageError as e:
    raise ChatError(str(e)) from None


def _content(m: dict, i: int, vision: VisionConfig | None) -> list:
  """A message's content -> pieces: each text part its own string, images as Image."""
  content = m.get("content")
  if content is None:
    return []
  if isinstance(content, str):
    return [content]
  if not isinstance(content, list):
    raise ChatError(f"messages[{i}].content must be a string or a list of content parts")
  pieces = []
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
      pieces.append(part["text"])
    elif kind == "image_url":
      pieces.append(_image_part(part, f"messages[{i}].content[{j}]", m["role"], vision))
    else:
      raise ChatError(f"messages[{i}].content[{j}]: expected a {{\"type\": \"text\", \"text\": "
                      f"...}} or {{\"type\": \"image_url\", ...}} part, got {str(part)[:60]}")
  return pieces


def _check(messages, vision: VisionConfig | None = None) -> list[dict]:
  """Validated messages; each content becomes a list of pieces (see _content)."""
  if not isinstance(messages, list) or not messages:
    raise ChatError("messages must be a non-empty list")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise ChatError(f"messages[{i}] needs a role, one of {', '.join(ROLES)}")
    for key in ("name", "tool", "tool_call_id", "reasoning_content", "reasoning"):
      if m.get(key) is not None and not isinstance(m[key], str):
        raise ChatError(f"messages[{i}].{key} must be a string")
    out.append({**m, "content": _content(m, i, vision)})
  return out


@dataclasses.dataclass(frozen=True)
class Mark:
  """A marker segment: "open", "close", "sep" or "eom" (MARKERS), or "train" on / off (the
  assistant-mask switch of chat SFT; no token)."""
  name: str
  on: bool = False


class _Prompt:
  """Prompt ids built from segments: Mark (a marker's special id), text, Image (its media
  tokens + placeholders). `joined`: runs of text are encoded together (the plain template, so
  a text-only prompt encodes as one string); otherwise each text segment is encoded on its
  own (the K3 encoder). `mask` marks the ids written while training is switched on."""

  def __init__(self, tokenizer, vision: VisionConfig | None, specials: dict | None = None,
               joined: bool = False):
    self.tok, self.vision, self.sp, self.joined = tokenizer, vision, specials or {}, joined
    self.ids: list[int] = []
    self.mask: list[bool] = []
    self.images: list = []
    self.text = ""
    self.train = False

  def add(self, *pieces) -> "_Prompt":
    for p in pieces:
      if isinstance(p, str):
        self.text += p
        if not self.joined:
          self._flush()
      elif isinstance(p, Mark):
        self._flush()
        if p.name == "train":
          self.train = p.on
        else:
          self._ids([self.sp[p.name]])
      else:
        self._flush()
        self._ids(im.image_token_ids(p.grid, self.vision, self.tok.encode, size=p.size))
        self.images.append((p.patches, p.grid))
    return self

  def _ids(self, ids) -> None:
    self.ids += ids
    self.mask += [self.train] * len(ids)

  def _flush(self) -> None:
    if self.text:
      self._ids(list(self.tok.encode(self.text)))
      self.text = ""

  def rendered(self, **kw) -> "Rendered":
    self._flush()
    packed = None
    if self.images:
      try:
        packed = im.pack_images(self.images, self.vision,
                                max_total_patches=self.vision.max_patches)
      except im.ImageError as e:
        raise ChatError(f"messages: {e} (vision.max_patches, per request)") from None
    return Rendered(self.ids, images=packed, mask=self.mask, **kw)


# ----- the K3 block table ------------------------------------------------------------------

MARKERS = {"open": "<|open|>", "close": "<|close|>", "sep": "<|sep|>",
           "eom": "<|end_of_msg|>"}
OPEN, CLOSE, SEP, EOM = (Mark(k) for k in MARKERS)


@dataclasses.dataclass(frozen=True)
class Block:
  tag: str
  attrs: tuple[str, ...] = ()        # attribute names, in the order they are written
  inside: tuple[str, ...] = ()       # the blocks it may hold ("message": its channels)
  field: str | None = None           # where the parser puts its text: reasoning / content /
                                     # argument / json (None: no text of its own)


BLOCKS = {b.tag: b for b in (
    # role, then: name (system / user / assistant), type (system: tool-declare or a note's
    # kind), tool and index (tool results)
    Block("message", ("role", "name", "type", "tool", "index"), ("think", "response", "tools")),
    Block("think", field="reasoning"),
    Block("response", field="content"),
    Block("tools", inside=("call",)),
    Block("call", ("tool", "index"), ("argument", "json")),
    Block("argument", ("key", "type"), field="argument"),
    Block("json", ("type",), field="json"),        # arguments that are not valid JSON
)}

ARG_TYPES = ("string", "number", "boolean", "null", "object", "array")


def escape_attr(v: str) -> str:
  return v.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(v: str) -> str:
  return v.replace("&quot;", '"').replace("&amp;", "&")


def _attrs(tag: str, attrs: dict) -> list[tuple[str, str]]:
  spec = BLOCKS[tag]
  extra = set(attrs) - set(spec.attrs)
  if extra:
    raise ValueError(f"block {tag!r} has no attributes {sorted(extra)}")
  return [(k, escape_attr(str(attrs[k]))) for k in spec.attrs if attrs.get(k) is not None]


def open_tag(tag: str, **attrs) -> list:
  """The segments of an open tag, as the release encodes them (each text piece on its own)."""
  out = [OPEN, tag]
  for k, v in _attrs(tag, attrs):
    out += [f" {k}", '="', v, '"']
  return out + [SEP]


def close_tag(tag: str) -> list:
  return [CLOSE, tag, SEP]


def block(tag: str, *body, **attrs) -> list:
  return open_tag(tag, **attrs) + list(body) + close_tag(tag)


def message(*body, **attrs) -> list:
  return block("message", *body, **attrs) + [EOM]


def header(tag: str, **attrs) -> str:
  """The text between <|open|> and <|sep|> (what the grammar matches): TAG key="value" ..."""
  return tag + "".join(f' {k}="{v}"' for k, v in _attrs(tag, attrs))


_ATTR = re.compile(r'\s*([A-Za-z_][\w-]*)="([^"]*)"')


def parse_header(text: str) -> tuple[str, dict]:
  """header() reversed; unknown text after the tag is ignored attribute by attribute."""
  text = text.strip()
  tag, _, rest = text.partition(" ")
  return tag, {m.group(1): unescape_attr(m.group(2)) for m in _ATTR.finditer(rest)}


def arg_type(v) -> str:
  if isinstance(v, str):
    return "string"
  if isinstance(v, bool):
    return "boolean"
  if isinstance(v, (int, float)):
    return "number"
  if v is None:
    return "null"
  return "object" if isinstance(v, dict) else "array"


def arg_body(v) -> str:
  """An argument block's body: a string raw, any other value JSON with the default
  separators (", " and ": ") and non-ASCII kept, as the release writes it."""
  return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def compact_json(v) -> str:
  """Tool declarations and schemas: compact, keys sorted recursively, non-ASCII kept."""
  return json.dumps(v, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def fenced(v) -> str:
  return "```json\n" + compact_json(v) + "\n```"


TOOLS_PREAMBLE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
NEW_TOOLS_PREAMBLE = ("## New Tools Available\nThe system dynamically extends the toolset via "
                      "lazy-loading.\nYou have access to all existing and extended tools.\n"
                      "Here are the specs for the extended tools.\n\n")
# The release's note lists `medium` but refuses it (EFFORTS); both reproduced.
EFFORT_NOTE = ("`thinking_effort` guides on how much to think in your thinking channel (not "
               "including the response channel), supported values include `low`, `medium`, "
               "`high`, and `max`.\nNow the system is invoked with `thinking_effort={}`.")
TOOL_CHOICE_NOTES = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in "
                "the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in "
            "the next message.",
}
FORMAT_NOTE = ("The system is invoked with `response_format={}`.\nYour response must be raw "
               "JSON data without markdown code blocks (```json) or any additional formatting.")
SCHEMA_NOTE = "\nThe JSON data must match the following schema:\n"


def note(kind: str, body: str) -> list:
  """An internal note: a system message of type KIND with the body (stripped)."""
  return message(body.strip(), role="system", type=kind)


def _special_ids(tokenizer) -> dict | None:
  special = getattr(tokenizer, "special_tokens", None) or {}
  if not all(t in special for t in MARKERS.values()):
    return None
  return {k: special[t] for k, t in MARKERS.items()}


@dataclasses.dataclass
class Rendered:
  ids: list[int]
  stop: tuple[str, ...] = ()          # stop strings
  stop_ids: tuple[int, ...] = ()
  thinking: bool = False              # generation starts in the think channel
  images: dict | None = None          # packed images for the placeholders (data/images.py)
  mask: list[bool] | None = None      # per id: written by the assistant (chat SFT targets)
  start: tuple = ()                   # K3: the open blocks where generation starts
  tools: bool = False                 # K3: parse tool calls out of the output


def call_arguments(args, where: str):
  """A call's `function.arguments` -> a dict, or the text as written when it is not valid
  JSON (rendered as a `json` block). A string is parsed (empty: no arguments); JSON that is
  not an object is an error."""
  if args is None or args == "":
    return {}
  if isinstance(args, str):
    try:
      args = json.loads(args)
    except json.JSONDecodeError:
      return str(args)
  if not isinstance(args, dict):
    raise ChatError(f"{where}.function.arguments must be a JSON object")
  return args


def _tool_calls(m: dict, i: int) -> list[tuple[str, dict | str]]:
  """An assistant message's tool_calls -> [(name, arguments dict or raw text)]."""
  out = []
  calls = m.get("tool_calls") or []
  if not isinstance(calls, list):
    raise ChatError(f"messages[{i}].tool_calls must be a list")
  for j, c in enumerate(calls):
    fn = c.get("function") if isinstance(c, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
      raise ChatError(f"messages[{i}].tool_calls[{j}] needs function.name")
    out.append((name, call_arguments(fn.get("arguments"), f"messages[{i}].tool_calls[{j}]")))
  return out


def check_tools(tools) -> list[dict]:
  """OpenAI `tools` -> the list (each {"type": "function", "function": {"name": ...}})."""
  if tools is None:
    return []
  if not isinstance(tools, list):
    raise ChatError("tools must be a list of {\"type\": \"function\", \"function\": {...}}",
                    "tools")
  for j, t in enumerate(tools):
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
        or not isinstance(fn.get("name"), str) or not fn["name"]:
      raise ChatError(f"tools[{j}] must be {{\"type\": \"function\", \"function\": "
                      "{\"name\": ..., \"parameters\": ...}}", "tools")
  return tools


def tool_choice_name(tool_choice, tools: list[dict]):
  """tool_choice -> "none" | "auto" | "required" | a function name (checked against tools)."""
  if tool_choice is None:
    return "auto" if tools else "none"
  if tool_choice in ("none", "auto", "required"):
    if tool_choice != "none" and not tools:
      raise ChatError(f"tool_choice={tool_choice!r} needs tools", "tool_choice")
    return tool_choice
  fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
  name = fn.get("name") if isinstance(fn, dict) else None
  if not isinstance(name, str):
    raise ChatError("tool_choice must be \"none\", \"auto\", \"required\" or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
  if name not in [t["function"]["name"] for t in tools]:
    raise ChatError(f"tool_choice names the function {name!r}, which is not in tools",
                    "tool_choice")
  return name


def check_effort(effort) -> str | None:
  if effort is not None and effort not in EFFORTS:
    raise ChatError(f"reasoning_effort={effort!r} must be one of {', '.join(EFFORTS)}",
                    "reasoning_effort")
  return effort


def format_note(response_format) -> list:
  """The response-format note of `response_format` (none for text / None)."""
  if response_format is None:
    return []
  kind = response_format.get("type") if isinstance(response_format, dict) else None
  if kind in (None, "text"):
    return []
  if kind == "json_object":
    return note("response-format", FORMAT_NOTE.format("json_object"))
  if kind != "json_schema":
    raise ChatError(f"response_format.type={kind!r} must be \"text\", \"json_object\" or "
                    "\"json_schema\"", "response_format")
  js = response_format.get("json_schema")
  if not isinstance(js, dict):
    raise ChatError("response_format.json_schema must be an object with name and schema",
                    "response_format")
  schema = js.get("schema", js.get("json_schema", js))
  return note("response-format", FORMAT_NOTE.format("json_schema") + SCHEMA_NOTE
              + fenced(schema))


def order_tool_results(messages: list[dict]) -> list[dict]:
  """Each run of tool messages whose tool_call_ids all name calls of the last assistant
  message, put into call order, each given its call's function name; other runs as sent."""
  out, calls, i = list(messages), [], 0
  while i < len(out):
    m = out[i]
    if m["role"] == "assistant":
      calls = [c for c in (m.get("tool_calls") or []) if isinstance(c, dict)]
    if m["role"] != "tool":
      i += 1
      continue
    j = i
    while j < len(out) and out[j]["role"] == "tool":
      j += 1
    ids = [c.get("id") for c in calls]
    run = out[i:j]
    if all(isinstance(t.get("tool_call_id"), str) and t["tool_call_id"] in ids for t in run):
      at = [ids.index(t["tool_call_id"]) for t in run]
      out[i:j] = [{**t, "name": calls[k]["function"]["name"]}
                  for k, t in sorted(zip(at, run), key=lambda x: x[0])]
    i = j
  return out


class K3Template:
  name = "k3"

  def __init__(self, tokenizer, ids: dict, vision: VisionConfig | None = None):
    self.tok, self.sp, self.vision = tokenizer, ids, vision

  def segments(self, messages, *, thinking: bool = True, effort: str | None = None,
               tools=None, tool_choice=None, response_format=None,
               add_generation_prompt: bool = True) -> list:
    """The prompt as the release's segments (Mark / text / Image), in its order."""
    tools = check_tools(tools)
    tool_choice_name(tool_choice, tools)
    effort = check_effort(effort)
    messages = order_tool_results(_check(messages, self.vision))
    out = []
    if tools:
      out += message(TOOLS_PREAMBLE + fenced(tools), role="system", type="tool-declare")
    if thinking and effort:
      out += note("thinking-effort", EFFORT_NOTE.format(effort))
    calls, n_tool = [], 0
    for i, m in enumerate(messages):
      role, name = m["role"], m.get("name") or None
      if role == "assistant":
        calls, n_tool = _tool_calls(m, i), 0
        out += [*open_tag("message", role=role, name=name), Mark("train", True)]
        out += self._assistant(m, i, calls, thinking)
        out += [*close_tag("message"), EOM, Mark("train", False)]
      elif role == "tool":
        n_tool += 1
        tool = m.get("tool") or m.get("name") or (
            calls[n_tool - 1][0] if n_tool <= len(calls) else None)
        if tool is None:
          raise ChatError(f"messages[{i}]: a tool message needs a tool_call_id naming a call of "
                          f"the assistant message before it (it is result {n_tool}, and that "
                          f"message has {len(calls)} calls), or a name")
        out += message(*self._text(m, i), role=role, tool=tool, index=n_tool)
      elif role == "system" and m.get("tools"):
        if m["content"]:
          raise ChatError(f"messages[{i}]: a system message declaring tools has no content")
        more = check_tools(m["tools"])
        out += message(NEW_TOOLS_PREAMBLE + fenced(more), role="system", type="tool-declare")
      else:
        out += message(*m["content"], role=role, name=name)
    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_NOTES:   # as sent
      out += note("tool-choice", TOOL_CHOICE_NOTES[tool_choice])
    out += format_note(response_format)
    if add_generation_prompt:
      out += open_tag("message", role="assistant")
      out += open_tag("think" if thinking else "response")
    return out

  @staticmethod
  def _text(m: dict, i: int) -> list[str]:
    if any(not isinstance(p, str) for p in m["content"]):
      raise ChatError(f"messages[{i}]: images are accepted in user messages only")
    return m["content"]

  def _assistant(self, m: dict, i: int, calls, thinking: bool) -> list:
    out = []
    if thinking:
      reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
      out += block("think", *([reasoning] if reasoning.strip() else []))
    out += block("response", *self._text(m, i))
    if calls:
      out += open_tag("tools")
      for k, (name, args) in enumerate(calls, start=1):
        out += open_tag("call", tool=name, index=k)
        if isinstance(args, str):
          out += block("json", args, type="object")
        else:
          for key, v in args.items():
            out += block("argument", arg_body(v), key=key, type=arg_type(v))
        out += close_tag("call")
      out += close_tag("tools")
    return out

  def render(self, messages, thinking: bool = True, effort: str | None = None,
             tools=None, tool_choice=None, response_format=None,
             add_generation_prompt: bool = True) -> Rendered:
    segs = self.segments(messages, thinking=thinking, effort=effort, tools=tools,
                         tool_choice=tool_choice, response_format=response_format,
                         add_generation_prompt=add_generation_prompt)
    choice = tool_choice_name(tool_choice, check_tools(tools))
    channel = "think" if thinking else "response"
    return _Prompt(self.tok, self.vision, self.sp).add(*segs).rendered(
        stop_ids=(self.sp["eom"],), thinking=thinking, tools=choice != "none",
        start=(("message", {"role": "assistant"}), (channel, {})))

  def render_conversation(self, messages, tools=None, thinking: bool = True,
                          effort: str | None = None) -> tuple[list[int], list[bool]]:
    segs = self.segments(messages, thinking=thinking, effort=effort, tools=tools,
                         add_generation_prompt=False)
    r = _Prompt(self.tok, self.vision, self.sp).add(*segs).rendered()
    return r.ids, r.mask

  def parser(self, rendered: "Rendered | bool") -> "MessageParser":
    if isinstance(rendered, bool):
      rendered = Rendered([], thinking=rendered, start=(
          ("message", {"role": "assistant"}), ("think" if rendered else "response", {})),
          tools=True)
    return MessageParser(self.tok, self.sp, rendered.start, rendered.tools)


@dataclasses.dataclass
class Delta:
  reasoning: str = ""
  content: str = ""
  tool_calls: list = dataclasses.field(default_factory=list)   # completed calls, OpenAI form

  def __iter__(self):                 # (reasoning, content), as before tool calls existed
    return iter((self.reasoning, self.content))


class MessageParser:
  """Generated ids -> reasoning, content and tool calls, incrementally, through BLOCKS.

  Works on ids, not on decoded text, so a marker is a marker only when the model wrote the
  special token (the literal text "<|open|>" in an answer stays text), and ids may arrive in
  any pieces (a header split over deltas is read whole). add(ids) returns a Delta of the new
  reasoning / content text and the tool calls completed in these ids. Opening a channel of
  the message (think, response, tools) closes the channel still open: a tools block written
  straight after an unclosed think channel is a tool call like any other."""

  def __init__(self, tok, sp: dict, start, tools: bool = True):
    self.tok, self.sp, self.tools = tok, sp, tools
    self.stack = [(t, dict(a)) for t, a in start]
    self.decoder = tok.stream_decoder()
    self.reading: tuple[str, list[int]] | None = None     # ("open"|"close", header ids)
    self.calls: list[dict] = []
    self.call: dict | None = None
    self.text: list[str] | None = None                    # the open argument / json body
    for tag, attrs in self.stack:
      self._opened(tag, attrs)

  def _field(self) -> str | None:
    return BLOCKS[self.stack[-1][0]].field if self.stack and self.stack[-1][0] in BLOCKS \
        else None

  def _text(self, d: Delta, text: str) -> None:
    """Text goes to the innermost block's field; text between blocks is dropped."""
    f = self._field()
    if not text or f is None:
      return
    if f == "reasoning":
      d.reasoning += text
    elif f == "content":
      d.content += text
    elif self.text is not None:
      self.text.append(text)

  def _opened(self, tag: str, attrs: dict) -> None:
    if tag == "call":
      self.call = {"name": attrs.get("tool", ""), "args": {}, "json": None}
    elif tag in ("argument", "json"):
      self.text = []

  def _closed(self, d: Delta, tag: str, attrs: dict) -> None:
    if tag in ("argument", "json") and self.call is not None and self.text is not None:
      body = "".join(self.text)
      self.text = None
      if tag == "json":
        self.call["json"] = (self.call["json"] or "") + body
        return
      value = body
      if attrs.get("type", "string") != "string":
        try:
          value = json.loads(body)
        except json.JSONDecodeError:
          pass                               # not JSON after all: kept as the text written
      self.call["args"][attrs.get("key", "")] = value
    elif tag == "call" and self.call is not None:
      if self.tools and self.call["name"]:
        raw, args = self.call["json"], self.call["args"]
        if raw is None or args:
          raw = json.dumps(args, ensure_ascii=False)
        c = {"index": len(self.calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": self.call["name"], "arguments": raw}}
        self.calls.append(c)
        d.tool_calls.append(c)
      self.call = None

  def add(self, ids) -> Delta:
    d = Delta()
    for t in ids:
      t = int(t)
      if self.reading is not None:
        if t == self.sp["sep"]:
          self._header_done(d)
          continue
        if t in (self.sp["open"], self.sp["close"], self.sp["eom"]):
          self.reading = None                     # a malformed header: dropped
        else:
          self.reading[1].append(t)
          continue
      if t in (self.sp["open"], self.sp["close"]):
        self._text(d, self.decoder.flush())
        self.reading = ("open" if t == self.sp["open"] else "close", [])
      elif t == self.sp["eom"]:
        self._text(d, self.decoder.flush())
      elif t != self.sp["sep"]:                   # a stray <|sep|> is dropped
        self._text(d, self.decoder.add(t))
    return d

  def _close_to(self, d: Delta, tag: str) -> None:
    """Close the open blocks down to and including the innermost `tag`."""
    while self.stack:
      top, top_attrs = self.stack.pop()
      self._closed(d, top, top_attrs)
      if top == tag:
        break

  def _header_done(self, d: Delta) -> None:
    kind, hid = self.reading
    self.reading = None
    tag, attrs = parse_header(self.tok.decode(hid))
    tags = [s[0] for s in self.stack]
    if kind == "open":
      if tag in BLOCKS["message"].inside and "message" in tags:
        while self.stack[-1][0] != "message":      # a new channel closes the open one
          self._close_to(d, self.stack[-1][0])
      self.stack.append((tag, attrs))
      self._opened(tag, attrs)
    elif tag in tags:                              # else it closes nothing open: ignored
      self._close_to(d, tag)

  def flush(self) -> Delta:
    """The rest of the text; a call still open (the output was cut off by max_tokens) is
    closed with the arguments complete so far, so a forced call always comes back."""
    d = Delta()
    self._text(d, self.decoder.flush())
    if self.call is not None:
      self._close_to(d, "call")
    return d


ChannelParser = MessageParser


def parse_assistant(template: "K3Template", rendered: Rendered, ids) -> dict:
  """Generated ids -> an OpenAI assistant message (content, reasoning_content, tool_calls)."""
  p = template.parser(rendered)
  a, b = p.add(ids), p.flush()
  msg = {"role": "assistant", "content": a.content + b.content}
  if rendered.thinking:
    msg["reasoning_content"] = a.reasoning + b.reasoning
  if p.calls:
    msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in p.calls]
  return msg


class PlainTemplate:
  name = "plain"
  STOP = "\n<|user|>"

  def __init__(self, tokenizer, vision: VisionConfig | None = None):
    self.tok, self.vision = tokenizer, vision

  def _conversation(self, messages, effort, tools) -> _Prompt:
    messages = _check(messages, self.vision)
    check_effort(effort)
    if tools or any(m.get("tool_calls") for m in messages):
      raise ChatError("tools: this model's tokenizer has no K3 special tokens, and tool calls "
                      "need the K3 chat format (serve a model directory with its tokenizer)")
    out = _Prompt(self.tok, self.vision, joined=True)
    for m in messages:
      out.add(f"<|{m['role']}|>\n", Mark("train", m["role"] == "assistant"), *m["content"],
              "\n", Mark("train", False))
    return out

  def render(self, messages, thinking: bool = False, effort: str | None = None,
             tools=None, tool_choice=None, response_format=None,
             add_generation_prompt: bool = True) -> Rendered:
    if tool_choice not in (None, "none", "auto"):
      raise ChatError("tool_choice: this model's chat format (plain) has no tool calls",
                      "tool_choice")
    out = self._conversation(messages, effort, tools)
    return out.add("<|assistant|>\n" if add_generation_prompt else "").rendered(
        stop=(self.STOP,))

  def render_conversation(self, messages, tools=None, thinking: bool = False,
                          effort: str | None = None) -> tuple[list[int], list[bool]]:
    r = self._conversation(messages, effort, tools).rendered()
    return r.ids, r.mask

  def parser(self, rendered):
    return None


def template_for(tokenizer, vision: VisionConfig | None = None):
  """The K3 template when the tokenizer has its special tokens, else the plain one. vision:
  the model's tower (ModelConfig.vision), without which image parts are refused."""
  ids = _special_ids(tokenizer)
  return K3Template(tokenizer, ids, vision) if ids else PlainTemplate(tokenizer, vision)


def render_conversation(tokenizer, messages, tools=None, thinking: bool = True,
                        effort: str | None = None, vision: VisionConfig | None = None
                        ) -> tuple[list[int], list[bool]]:
  """A whole conversation (no generation prompt) -> (ids, assistant_mask): mask[i] is True
  where ids[i] is the assistant's own writing (K3: everything after an assistant message's
  `<|open|>message role="assistant"<|sep|>` up to and including its `<|end_of_msg|>`; plain:
  the assistant content and its newline), the targets of chat fine-tuning."""
  return template_for(tokenizer, vision).render_conversation(messages, tools, thinking, effort)


__all__ = ["template_for", "K3Template", "PlainTemplate", "MessageParser", "ChannelParser",
           "ChatError", "Rendered", "BLOCKS", "Delta", "render_conversation",
           "parse_assistant", "check_tools", "tool_choice_name", "check_effort",
           "order_tool_results", "call_arguments"]
