"""The request side of /v1/completions beyond sampling: the prompt forms, `n`, `logprobs` and
`echo` (server.py runs the choices; logprobs.py holds the arithmetic).

Prompt forms (OpenAI's): a string, a list of strings, a list of token ids, or a list of
token-id lists; each prompt gives `n` choices, numbered prompt-major (choice index =
prompt index * n + sample). The samples of one prompt run as separate requests with seeds
seed, seed + 1, ... (so a seeded request is reproducible and its samples differ); they share
the prompt's cached prefix through the prefix cache once the first has registered it, not
one prefill (forking a slot's state is left to the engine's step seam).
"""

from __future__ import annotations

import dataclasses

from k3_jax.serve.api_params import ParamError
from k3_jax.serve.logprobs import MAX_LOGPROBS

MAX_N = 32
MAX_PROMPTS = 64


def prompt_list(prompt, tokenizer) -> list[list[int]]:
  """The request's prompts as token-id lists (ParamError naming `prompt` for any other form)."""
  def ids_of(p) -> list[int]:
    if isinstance(p, str):
      if tokenizer is None:
        raise ParamError("text prompts need a tokenizer; send token ids", "prompt")
      return list(tokenizer.encode(p))
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
      return list(p)                  # (an empty one is refused below, naming its index)
    raise ParamError("prompt must be a string, a list of strings, a list of token ids or a "
                     "list of token-id lists", "prompt")

  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                 and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in prompt)):
    out = [ids_of(prompt)]
  elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    out = [ids_of(p) for p in prompt]
  else:
    raise ParamError("prompt must be a string, a list of strings, a list of token ids or a "
                     "list of token-id lists (a non-empty one)", "prompt")
  if len(out) > MAX_PROMPTS:
    raise ParamError(f"{len(out)} prompts in one request; at most {MAX_PROMPTS}", "prompt")
  for i, ids in enumerate(out):
    if not ids:
      raise ParamError(f"prompt {i} is empty", "prompt")
  return out


@dataclasses.dataclass(frozen=True)
class Options:
  n: int = 1
  logprobs: int | None = None       # None: no logprobs; 0-5: the chosen token (+ top-k)
  echo: bool = False
  score_only: bool = False          # max_tokens=0 with echo: the prompt's log-probabilities


def options(body: dict) -> Options:
  n = body.get("n", 1)
  if n is None:
    n = 1
  if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
    raise ParamError(f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
  lp = body.get("logprobs")
  if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int)
                         or not 0 <= lp <= MAX_LOGPROBS):
    raise ParamError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {lp!r}",
                     "logprobs")
  echo = body.get("echo", False)
  if not isinstance(echo, bool):
    raise ParamError(f"echo must be a boolean, got {echo!r}", "echo")
  max_tokens = body.get("max_tokens")
  score_only = max_tokens == 0 and not isinstance(max_tokens, bool)
  if score_only and not echo:
    raise ParamError("max_tokens=0 generates nothing; it is only meaningful with echo=true "
                     "(scoring the prompt)", "max_tokens")
  if score_only and body.get("stream"):
    raise ParamError("max_tokens=0 (scoring) cannot be streamed", "stream")
  return Options(n=n, logprobs=lp, echo=echo, score_only=score_only)


__all__ = ["MAX_N", "MAX_PROMPTS", "prompt_list", "Options", "options"]
