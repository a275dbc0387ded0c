"""Every limit and default of a serving request, defined here once.

The request models (api_schema.py: they validate every HTTP body and are the schema
/openapi.json serves), the handlers' defaults (api_params.sampling_from), the engine's own
check (requests.SamplingParams.validate), the serving step (steps.TOP_K alternatives per
token) and `generate`'s flags (main.py) all read them from here; tests/serve/test_limits.py
checks each reader against them.

Ranges are (low, high), both included unless named otherwise. The OpenAI ranges bound HTTP
requests; the engine alone (Engine.submit with openai_ranges=False, `generate`) takes any
finite penalty or bias.
"""

from __future__ import annotations

TEMPERATURE = (0.0, 2.0)        # OpenAI's; the engine alone: any value >= 0 (0 = greedy)
TOP_P = (0.0, 1.0)              # low excluded
PENALTY = (-2.0, 2.0)           # presence_penalty, frequency_penalty (OpenAI's)
LOGIT_BIAS = (-100.0, 100.0)    # a logit_bias value (OpenAI's)
MAX_BIAS_ENTRIES = 1024         # logit_bias entries per request
MAX_STOP = 4                    # stop strings per request (OpenAI's)
MAX_N = 32                      # choices per request (n, best_of)
MAX_PROMPTS = 64                # prompts per /v1/completions request
TOP_LOGPROBS = 5                # alternatives per token: the step computes this many, and
                                # completions' `logprobs` / chat's `top_logprobs` go up to it
OPENAI_CHAT_TOP_LOGPROBS = 20   # chat's top_logprobs in OpenAI's API (above TOP_LOGPROBS:
                                # refused, saying this server's bound)
SEED_RANGE = 1 << 31            # seeds are taken modulo this

DEFAULT_MAX_TOKENS = 16         # OpenAI's default for max_tokens
DEFAULT_TEMPERATURE = 1.0       # OpenAI's default; SamplingParams' own default is 0 (greedy)

__all__ = ["TEMPERATURE", "TOP_P", "PENALTY", "LOGIT_BIAS", "MAX_BIAS_ENTRIES", "MAX_STOP",
           "MAX_N", "MAX_PROMPTS", "TOP_LOGPROBS", "OPENAI_CHAT_TOP_LOGPROBS", "SEED_RANGE",
           "DEFAULT_MAX_TOKENS", "DEFAULT_TEMPERATURE"]
