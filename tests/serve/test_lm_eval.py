"""Acceptance with a real client: lm-evaluation-harness (pinned, lm-eval 0.4.13) scores a
multiple-choice (log-likelihood) task and a generate_until task (tests/serve/lm_eval_task)
twice on one directory: a small random transformers KimiLinearForCausalLM saved with a real
Hugging Face tokenizer (a byte-level BPE of the `tokenizers` library, trained here on local
text, saved by transformers so AutoTokenizer loads it).

- through our server: `serve --hf_dir DIR` (run_server in a subprocess), lm-eval's
  `local-completions` backend with tokenized_requests=True and the directory's tokenizer, so
  prompts travel as token-id lists (several per request), are scored with echo + logprobs
  and generated greedily with stop strings;
- through transformers: lm-eval's `hf` backend on the same directory (CPU, float32).

Per-choice log-likelihoods agree within 1e-3 (FP32 both sides: ours vs transformers' own
rounding, see tests/checkpoint/test_hf_parity.py) and the generations are equal.
docs/serving.md gives the same run as lm_eval commands.
"""

import json
import os
import time

import pytest

from tests.serve.serverproc import ROOT, start_server, stop_server

pytestmark = pytest.mark.slow

TASKS = ["k3_mc", "k3_gen"]
TASK_DIR = os.path.join(ROOT, "tests", "serve", "lm_eval_task")
MODEL = "kimi-linear-test"
ATOL = 1e-3
LAUNCH = """
from k3_jax.serve.loader import ServeOptions, run_server
from k3_jax.config import ServeConfig
run_server(ServeOptions(hf_dir={hf_dir!r}, model_name={model!r},
           serve=ServeConfig(max_batch=4, max_len=256, prefix_cache_bytes=0, warmup=False,
                             host="127.0.0.1", port={port})))
"""


def _train_text():
  """Local text for the BPE merges: the tasks' own documents plus a few sentences."""
  lines = ["The quick brown fox jumps over the lazy dog. Question: Answer: one two three four",
           "Bees make honey; cats have four legs; the sky is blue and the sun rises in the east."]
  for name in ("mc.jsonl", "gen.jsonl"):
    with open(os.path.join(TASK_DIR, name)) as f:
      lines += [" ".join(str(v) for v in json.loads(line).values()) for line in f]
  return lines * 4


def _save_tokenizer(out: str) -> int:
  """A byte-level BPE (256 bytes + learned merges + <|endoftext|>), saved by transformers.
  -> its vocabulary size."""
  import tokenizers
  import transformers
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_train_text(), trainer)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                              clean_up_tokenization_spaces=False)
  fast.save_pretrained(out)
  return tok.get_vocab_size()


def build_dir(out: str) -> str:
  """Saves the test model directory: the tokenizer, then a random transformers
  KimiLinearForCausalLM (d 64, 4 layers: KDA x 3 + MLA, 8 experts top-2) over its
  vocabulary, weights redrawn (tests/hf_reference.py), eos = <|endoftext|>. -> out.
  docs/serving.md: python -c "from tests.serve.test_lm_eval import build_dir; build_dir('DIR')"."""
  import torch
  import transformers
  from tests.hf_reference import kimi_linear_config, redraw
  vocab = _save_tokenizer(out)
  eos = transformers.AutoTokenizer.from_pretrained(out).eos_token_id
  cfg = kimi_linear_config(vocab=vocab, d=64, dense=96, expert=32, layers=4, heads=2,
                           kv_lora=16, rope=8, nope=16, v=16, experts=8, top_k=2,
                           kda_heads=2, kda_dim=16, full_attn_layers=[4])
  cfg.eos_token_id = eos
  torch.manual_seed(0)
  model = transformers.KimiLinearForCausalLM(cfg).eval()
  redraw(model, seed=1)
  model.save_pretrained(out)
  return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  return build_dir(str(tmp_path_factory.mktemp("lm_eval") / "kimi_linear"))


def _evaluate(model: str, model_args: dict, batch_size: int):
  import lm_eval
  from lm_eval.tasks import TaskManager
  t0 = time.monotonic()
  out = lm_eval.simple_evaluate(
      model=model, model_args=model_args, tasks=TASKS, batch_size=batch_size,
      task_manager=TaskManager(include_path=TASK_DIR), log_samples=True,
      bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
  return out, time.monotonic() - t0


def _by_doc(out, task):
  return {s["doc_id"]: s for s in out["samples"][task]}


def test_lm_eval_local_completions_matches_hf(hf_dir, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)                       # the task files name their data from the root
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
  ref, t_hf = _evaluate("hf", {"pretrained": hf_dir, "device": "cpu", "dtype": "float32"}, 1)
  proc, base, log = start_server(LAUNCH, tmp_path, hf_dir=hf_dir, model=MODEL)
  try:
    ours, t_api = _evaluate("local-completions", {
        "model": MODEL, "base_url": f"{base}/v1/completions", "tokenized_requests": True,
        "tokenizer": hf_dir, "tokenizer_backend": "huggingface", "max_length": 256,
        "num_concurrent": 1, "max_retries": 1, "timeout": 600}, 4)
  finally:
    stop_server(proc)

  # multiple choice: every choice of every document, the same log-likelihood
  a, b = _by_doc(ref, "k3_mc"), _by_doc(ours, "k3_mc")
  assert sorted(a) == sorted(b) == list(range(5))
  diffs, n = [], 0
  for i in a:
    ra = [r[0][0] for r in a[i]["resps"]]
    rb = [r[0][0] for r in b[i]["resps"]]
    assert len(ra) == len(rb) == len(a[i]["doc"]["choices"])
    for la, lb in zip(ra, rb):
      assert abs(la - lb) <= ATOL, (i, la, lb)
      assert la < -1e-3                        # a real score, not a constant
      diffs.append(abs(la - lb))
      n += 1
  # generate_until: the same text for every prompt, and something generated
  ga, gb = _by_doc(ref, "k3_gen"), _by_doc(ours, "k3_gen")
  assert sorted(ga) == sorted(gb) == list(range(4))
  gens = [(ga[i]["resps"][0][0], gb[i]["resps"][0][0]) for i in ga]
  assert all(x == y for x, y in gens), gens
  assert any(x for x, _ in gens), gens
  for task, metric in (("k3_mc", "acc,none"), ("k3_gen", "exact_match,none")):
    assert ref["results"][task][metric] == ours["results"][task][metric]
  print(f"\nlm-eval: {n} choices, max |loglik diff| {max(diffs):.2e}; "
        f"{len(gens)} generations equal {[x for x, _ in gens]}; "
        f"hf {t_hf:.1f} s, local-completions {t_api:.1f} s")
