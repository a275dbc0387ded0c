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
from k3_jax.serve import api_params, api_schema
from k3_jax.serve import completions as cmpl
from k3_jax.serve.api_params import ParamError


def chat_ids(template, body: dict) -> list[int]:
  """The prompt ids of a chat request body (what /v1/chat/completions prefills)."""
  try:
    return template.render(body.get("messages"),
                           **api_params.render_kwargs(body, tokenize=True)).ids
  except ChatError as e:
    raise ParamError(str(e), e.param) from None


def completion_ids(tokenizer, prompt, vocab_size: int | None = None) -> list[int]:
  """The prompt ids of a validated completion `prompt` (one prompt, as /v1/completions
  encodes and checks it)."""
  return cmpl.prompt_list(prompt, tokenizer, vocab_size)[0]


def tokenize(template, tokenizer, body: dict, max_len: int,
             vocab_size: int | None = None) -> dict:
  req = api_schema.parse(api_schema.TokenizeRequest, body)
  if req.messages is not None:
    ids = chat_ids(template, body)
  else:                     # (add_special_tokens: the completions endpoint adds none)
    ids = completion_ids(tokenizer, req.prompt, vocab_size)
  strs = [tokenizer.decode([i]) for i in ids] if req.return_token_strs else None
  return {"tokens": ids, "count": len(ids), "max_model_len": max_len, "token_strs": strs}


def detokenize(tokenizer, body: dict, vocab_size: int) -> dict:
  ids = api_schema.parse(api_schema.DetokenizeRequest, body).tokens
  if any(t >= vocab_size for t in ids):
    raise ParamError(f"tokens must be a list of token ids in [0, {vocab_size})", "tokens")
  return {"prompt": tokenizer.decode(ids)}


def register(app, template, tokenizer, engine, read_body) -> None:
  """Adds the two endpoints to the server's app (read_body: its JSON body + model check;
  then the body validated by its api_schema model, which /openapi.json serves)."""

  @app.post("/tokenize", openapi_extra=api_schema.request_body(api_schema.TokenizeRequest))
  async def _tokenize(http: Request):
    body = await read_body(http)
    return await asyncio.to_thread(tokenize, template, tokenizer, body, engine.max_len,
                                   engine.cfg.vocab_size)

  @app.post("/detokenize",
            openapi_extra=api_schema.request_body(api_schema.DetokenizeRequest))
  async def _detokenize(http: Request):
    return detokenize(tokenizer, await read_body(http), engine.cfg.vocab_size)


__all__ = ["register", "tokenize", "detokenize", "chat_ids", "completion_ids"]
