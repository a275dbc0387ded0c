"""Chat SFT end to end, through the command line: a tiny model with a K3-format tokenizer is
taught a fixed answer to a fixed question (`train --dataset=chats.jsonl`, random init),
exported (`convert`, with its tokenizer), served (`serve --hf_dir`), and the chat endpoint
answers it (greedy, the openai client). Then SFT again with MXFP4 / MXFP8 QAT, from that
export (`--init_from`), on a prepared chat directory that adds a second question: the export
with packed MXFP4 experts answers both."""

import json
import os
import subprocess
import sys

import openai
import pytest

from tests.data.test_chat_sft import small_k3_tokenizer_dir
from tests.serve.serverproc import start_server, stop_server

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QA = [("What is the capital of Wakanda?", "Birnin Zana."),
      ("Who wrote the Lay of Leithian?", "Tolkien wrote it.")]
MODEL = ["--config=k3_tiny", "--override=vocab_size=320", "--override=num_layers=4",
         "--override=mla_layers=(2,4)", "--override=dense_layers=(1,)",
         "--override=moe.latent_dim=32", "--override=moe.expert_intermediate=32"]
TRAIN = ["--seq_len=128", "--batch_size=2", "--eval_every=1000", "--log_every=20",
         "--learning_rate=3e-3"]
LAUNCH = """
import runpy, sys
sys.argv = ["main.py", "serve", "--hf_dir={hf}", "--served_model_name=sft", "--port={port}",
            "--max_batch=1", "--prefix_cache_bytes=0", "--nowarmup"]
runpy.run_path("main.py", run_name="__main__")
"""


def _main(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
  r = subprocess.run([sys.executable, "main.py", *args], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=900)
  if r.returncode:
    pytest.fail(f"main.py {args[0]} exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
  return r.stdout + r.stderr


def _chats(path, pairs, copies=1):
  with open(path, "w") as f:
    for _ in range(copies):
      for q, a in pairs:
        f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                         {"role": "assistant", "content": a}]}) + "\n")
  return str(path)


def _answers(hf, tmp_path):
  tmp_path.mkdir()
  proc, base, log = start_server(LAUNCH, tmp_path, hf=hf)
  try:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=300, max_retries=0)
    out = {}
    for q, _ in QA:
      r = client.chat.completions.create(model="sft", messages=[{"role": "user", "content": q}],
                                         max_tokens=48, temperature=0)
      out[q] = r.choices[0].message.content
    return out, log.read_text()
  finally:
    stop_server(proc)


def test_chat_sft_answer_is_served_after_export_with_and_without_qat(tmp_path):
  tok = small_k3_tokenizer_dir(tmp_path / "tok", [
      " ".join(q + " " + a for q, a in QA) + ' message role="user" role="assistant" think '
      'response'] * 4)
  # 1. SFT from a random init on one conversation; a dense export (the checkpoint exactly)
  run1, hf1 = str(tmp_path / "run1"), str(tmp_path / "hf1")
  out = _main("train", *MODEL, *TRAIN, f"--dataset={_chats(tmp_path / 'one.jsonl', QA[:1])}",
              f"--tokenizer={tok}", "--steps=100", "--checkpoint_every=100",
              f"--workdir={run1}")
  assert "too few conversations to hold one out" in out
  _main("convert", f"--from={run1}", f"--to={hf1}", "--expert_format=dense")
  assert os.path.isfile(os.path.join(hf1, "tokenizer_config.json"))
  got, _ = _answers(hf1, tmp_path / "serve1")
  assert got[QA[0][0]] == QA[0][1]

  # 2. SFT with MXFP4 / MXFP8 QAT from that export, on a prepared directory of both
  # questions; the export packs the routed experts in MXFP4
  data = str(tmp_path / "prepared")
  _main("prepare", f"--input={_chats(tmp_path / 'two.jsonl', QA, copies=2)}",
        f"--output={data}", "--num_shards=1")
  run2, hf2 = str(tmp_path / "run2"), str(tmp_path / "hf2")
  _main("train", f"--init_from={hf1}", "--override=quant.qat=mxfp4_mxfp8", *TRAIN,
        f"--dataset={data}", "--steps=100", "--checkpoint_every=100", f"--workdir={run2}")
  _main("convert", f"--from={run2}", f"--to={hf2}", "--expert_format=mxfp4")
  with open(os.path.join(hf2, "model.safetensors.index.json")) as f:
    names = json.load(f)["weight_map"]
  assert any(n.endswith("weight_packed") for n in names)
  got, _ = _answers(hf2, tmp_path / "serve2")
  assert got == dict(QA)
