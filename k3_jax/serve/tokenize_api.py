"""POST /tokenize and POST /detokenize, with vLLM's request and response shapes.

/tokenize takes either a chat request body (`messages`, and `tools`, `tool_choice`,
`response_format`, `reasoning_effort`, `chat_template_kwargs` {"thinking": ...},
`add_generation_prompt` (default true) as /v1/chat/completions takes them) or a completion
`prompt` (a string or a list of token ids), and answers the ids the server would prefill for
it, rendered by the same template call:

    {"tokens": [...], "count": N, "max_model_len": L, "token_strs": null | ["...", ...]}

(`return_token_strs`: each id's text). /detokenize takes {"tokens": [ids]} and answers
{"prompt": text}, the markers written as their names (nothing skipped).
"""

from __future__ import annotations

import asyncio

from fastapi import Request   # at module level: FastAPI resolves the annotations

from k3_jax.data.chat import ChatError
from k3_jax.serve import api_params
from k3_jax.serve import completions as cmpl
from k3_jax.serve.api_params import ParamError


def chat_ids(template, body: dict) -> list[int]:
  """The prompt ids of a chat request body (what /v1/chat/completions prefills)."""
  try:
    return template.render(body.get("messages"),
                           **api_params.render_kwargs(body, tokenize=True)).ids
  except ChatError as e:
    raise ParamError(str(e), e.param) from None


def completion_ids(tokenizer, body: dict) -> list[int]:
  """The prompt ids of a completion `prompt` (one prompt, as /v1/completions encodes it)."""
  prompts = cmpl.prompt_list(body.get("prompt"), tokenizer)
  if len(prompts) != 1:
    raise ParamError("/tokenize takes one prompt (a string or a list of token ids)", "prompt")
  return prompts[0]


def _flag(body: dict, name: str, default: bool) -> bool:
  v = body.get(name, default)
  if not isinstance(v, bool):
    raise ParamError(f"{name} must be a boolean, got {v!r}", name)
  return v


def tokenize(template, tokenizer, body: dict, max_len: int) -> dict:
  if "messages" in body:
    if "prompt" in body:
      raise ParamError("give either messages (a chat request) or prompt, not both", "prompt")
    ids = chat_ids(template, body)
  elif "prompt" in body:
    _flag(body, "add_special_tokens", True)       # the completions endpoint adds none
    ids = completion_ids(tokenizer, body)
  else:
    raise ParamError("/tokenize needs messages (a chat request) or prompt", "messages")
  strs = [tokenizer.decode([i]) for i in ids] if _flag(body, "return_token_strs",
                                                        False) else None
  return {"tokens": ids, "count": len(ids), "max_model_len": max_len, "token_strs": strs}


def detokenize(tokenizer, body: dict, vocab_size: int) -> dict:
  ids = body.get("tokens")
  if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          and 0 <= t < vocab_size for t in ids):
    raise ParamError(f"tokens must be a list of token ids in [0, {vocab_size})", "tokens")
  return {"prompt": tokenizer.decode(ids)}


def register(app, template, tokenizer, engine, read_body) -> None:
  """Adds the two endpoints to the server's app (read_body: its JSON body + model check)."""

  @app.post("/tokenize")
  async def _tokenize(http: Request):
    body = await read_body(http)
    return await asyncio.to_thread(tokenize, template, tokenizer, body, engine.max_len)

  @app.post("/detokenize")
  async def _detokenize(http: Request):
    return detokenize(tokenizer, await read_body(http), engine.cfg.vocab_size)


__all__ = ["register", "tokenize", "detokenize", "chat_ids", "completion_ids"]
