"""A simple front end of the engine: one prompt's sampled tokens as they come
(Engine.generate), stepping the engine itself (no server, no thread)."""

from __future__ import annotations

from typing import Iterator

from k3_jax.config import UserError
from k3_jax.serve.requests import RequestError, SamplingParams


def generate(engine, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, stop_ids=(), frequency_penalty: float = 0.0,
             presence_penalty: float = 0.0, images: dict | None = None) -> Iterator[int]:
  """Yields up to max_new_tokens sampled token ids for one prompt (a stop id is yielded,
  then generation ends). The penalties lower the logits of tokens already generated
  (sampling.penalize; the prompt is not counted); unlike the server, which keeps the
  OpenAI range [-2, 2], any finite value is accepted here. images: packed images for the
  prompt's placeholders (see Engine.submit)."""
  try:
    req = engine.submit(prompt_ids, SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
        stop_ids=tuple(stop_ids), frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty), openai_ranges=False, images=images)
  except RequestError as e:
    raise UserError(str(e)) from None
  sent = 0
  while True:
    while sent < len(req.output_ids):
      yield req.output_ids[sent]
      sent += 1
    if req.state == "done":
      if req.error:
        raise RuntimeError(f"the request failed: {req.error}")
      return
    engine.step()


__all__ = ["generate"]
