"""Chat templates: messages -> prompt token ids, and generated ids -> (reasoning, content).

K3 format (K3_SPEC section 9), used when the tokenizer has the special tokens `<|open|>`,
`<|sep|>`, `<|close|>` and an end-of-message token (`<|eom|>`, else the tokenizer's EOS):

    [<|open|>system<|sep|>reasoning_effort: {low|high|max}<|close|>]      (thinking only)
    <|open|>{role}<|sep|>{content}<|close|><|eom|>                 (system, user, tool)
    <|open|>think<|sep|>{reasoning}<|close|><|open|>response<|sep|>{content}<|close|><|eom|>
                                                                    (assistant)
    then the generation prompt: <|open|>think<|sep|> (thinking) or <|open|>response<|sep|>
    (instant).

Earlier turns' reasoning: an assistant turn BEFORE the last user message is rendered
without its think channel (its reasoning is dropped); assistant turns after the last user
message (an agentic turn still in progress: assistant -> tool -> assistant) keep theirs.
In instant mode no think channel is rendered at all.

Plain format (byte-level presets, no special tokens), documented in the README:

    <|system|>\n{content}\n<|user|>\n{content}\n<|assistant|>\n{content}\n ... <|assistant|>\n

with the stop string "\n<|user|>" (the model would start the next user turn); no reasoning.
"""

from __future__ import annotations

import dataclasses

EFFORTS = ("low", "high", "max")
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
  """Malformed messages (the server answers 400)."""


def _check(messages) -> list[dict]:
  if not isinstance(messages, list) or not messages:
    raise ChatError("messages must be a non-empty list")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise ChatError(f"messages[{i}] needs a role, one of {', '.join(ROLES)}")
    content = m.get("content") or ""
    if isinstance(content, list):          # OpenAI content parts: keep the text ones
      content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
      raise ChatError(f"messages[{i}].content must be a string or a list of text parts")
    out.append({**m, "content": content})
  return out


def _special_ids(tokenizer) -> dict | None:
  enc = getattr(tokenizer, "_encoding", None)
  special = getattr(enc, "_special_tokens", None) if enc is not None else None
  if not special or not all(t in special for t in ("<|open|>", "<|sep|>", "<|close|>")):
    return None
  eom = special.get("<|eom|>", getattr(tokenizer, "eos_id", None))
  if eom is None:
    return None
  return {"open": special["<|open|>"], "sep": special["<|sep|>"],
          "close": special["<|close|>"], "eom": eom}


@dataclasses.dataclass
class Rendered:
  ids: list[int]
  stop: tuple[str, ...] = ()          # stop strings
  stop_ids: tuple[int, ...] = ()
  thinking: bool = False              # generation starts in the think channel


class K3Template:
  name = "k3"

  def __init__(self, tokenizer, ids: dict):
    self.tok, self.sp = tokenizer, ids

  def _msg(self, channel: str, text: str) -> list[int]:
    sp = self.sp
    return [sp["open"], *self.tok.encode(channel), sp["sep"], *self.tok.encode(text), sp["close"]]

  def render(self, messages, thinking: bool = True, effort: str | None = None) -> Rendered:
    messages = _check(messages)
    effort = effort or "max"
    if effort not in EFFORTS:
      raise ChatError(f"reasoning_effort={effort!r} must be one of {', '.join(EFFORTS)}")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    ids = self._msg("system", f"reasoning_effort: {effort}") if thinking else []
    for i, m in enumerate(messages):
      if m["role"] == "assistant":
        reasoning = m.get("reasoning_content") or ""
        if thinking and i > last_user and reasoning:      # kept only inside the current turn
          ids += self._msg("think", reasoning)
        ids += self._msg("response", m["content"])
      else:
        ids += self._msg(m["role"], m["content"])
      ids.append(self.sp["eom"])
    ids += [self.sp["open"], *self.tok.encode("think" if thinking else "response"),
            self.sp["sep"]]
    return Rendered(ids, stop_ids=(self.sp["eom"],), thinking=thinking)

  def parser(self, thinking: bool) -> "ChannelParser":
    return ChannelParser(self.tok, self.sp, "think" if thinking else "response")


class ChannelParser:
  """Generated ids -> text per channel, incrementally: add(ids) -> (reasoning, content)."""

  def __init__(self, tok, sp: dict, channel: str):
    self.tok, self.sp, self.channel = tok, sp, channel
    self.decoder = tok.stream_decoder()
    self.naming: list[int] | None = None      # ids of a channel name being read

  def add(self, ids) -> tuple[str, str]:
    out = {"think": "", "response": ""}
    for t in ids:
      if t == self.sp["open"]:
        out[self.channel] += self.decoder.flush()
        self.naming = []
      elif t == self.sp["sep"] and self.naming is not None:
        self.channel = "think" if self.tok.decode(self.naming).strip() == "think" else "response"
        self.naming = None
      elif self.naming is not None:
        self.naming.append(t)
      elif t in (self.sp["close"], self.sp["eom"]):
        out[self.channel] += self.decoder.flush()
      else:
        out[self.channel] += self.decoder.add(t)
    return out["think"], out["response"]

  def flush(self) -> tuple[str, str]:
    rest = self.decoder.flush()
    return (rest, "") if self.channel == "think" else ("", rest)


class PlainTemplate:
  name = "plain"
  STOP = "\n<|user|>"

  def __init__(self, tokenizer):
    self.tok = tokenizer

  def render(self, messages, thinking: bool = False, effort: str | None = None) -> Rendered:
    messages = _check(messages)
    if effort is not None and effort not in EFFORTS:
      raise ChatError(f"reasoning_effort={effort!r} must be one of {', '.join(EFFORTS)}")
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
    return Rendered(self.tok.encode(text), stop=(self.STOP,))

  def parser(self, thinking: bool):
    return None


def template_for(tokenizer):
  """The K3 template when the tokenizer has its special tokens, else the plain one."""
  ids = _special_ids(tokenizer)
  return K3Template(tokenizer, ids) if ids else PlainTemplate(tokenizer)


__all__ = ["template_for", "K3Template", "PlainTemplate", "ChannelParser", "ChatError",
           "Rendered"]
