"""The bad-input sweep of the command line (docs/errors.md): each mistake a user can make in a
command's flags, paths, presets, overrides, data, tokenizer, port or workdir gives one
`error: ...` line naming it, exit status 2, before any model is loaded or compiled, and
creates or changes nothing.

The cases run in-process through main's own flag parser and `main()` (a subprocess per case
would import jax each time); each runs with the working directory in tmp_path, so a default
relative workdir (runs/default) would show up there, and every file under tmp_path is
compared before and after. `serve` is additionally run with the model loader replaced by
one that fails the test, so a check that only fires after loading cannot pass."""

import contextlib
import io
import json
import os
import socket
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (command, case, argv with {t} = tmp_path, a piece of the expected error line). The suite
# runs with 8 host devices (conftest): train cases checked after the mesh give a batch of 8.
CASES = [
    # any command
    ("-", "no command", [], "expected a command"),
    ("-", "unknown command", ["trian"], "got trian"),
    ("-", "positional argument", ["train", "extra"], "unexpected arguments ['extra']"),
    ("-", "unknown flag", ["train", "--stpes=3"], "Unknown command line flag 'stpes'"),
    ("-", "flag of another command", ["info", "--prompt=x"], "--prompt: not a flag of `info`"),
    ("-", "flag value of the wrong type", ["train", "--steps=abc"], "flag --steps=abc"),
    ("-", "value outside an enum", ["compile", "--step=bogus"], "flag --step=bogus"),
    # train
    ("train", "unknown preset", ["train", "--config=k9", "--workdir={t}/w"], "unknown config 'k9'"),
    ("train", "override of an unknown field", ["train", "--config=k3_tiny",
     "--override=kda.heads=2", "--workdir={t}/w"], "KDAConfig has no field 'heads'"),
    ("train", "override value of the wrong type", ["train", "--config=k3_tiny",
     "--override=num_layers=abc", "--workdir={t}/w"], "num_layers='abc'"),
    ("train", "override without =", ["train", "--config=k3_tiny", "--override=num_layers",
     "--workdir={t}/w"], "expected the form field=value"),
    ("train", "override that breaks the model", ["train", "--config=k3_tiny",
     "--override=kda.num_heads=0", "--workdir={t}/w"], "kda.num_heads=0"),
    ("train", "non-positive steps", ["train", "--config=k3_tiny", "--steps=0",
     "--workdir={t}/w"], "steps=0: must be positive"),
    ("train", "seq_len over the model's", ["train", "--config=k3_tiny", "--seq_len=99999",
     "--workdir={t}/w"], "max_seq_len"),
    ("train", "batch not divisible by grad_accum", ["train", "--config=k3_tiny",
     "--batch_size=3", "--grad_accum=2", "--workdir={t}/w"], "divisible by grad_accum=2"),
    ("train", "non-positive learning rate", ["train", "--config=k3_tiny", "--learning_rate=0",
     "--workdir={t}/w"], "learning_rate=0.0"),
    ("train", "shapes with too short a seq_len", ["train", "--config=k3_tiny",
     "--dataset=shapes", "--seq_len=32", "--workdir={t}/w"], "too short for the shapes"),
    ("train", "dataset path missing", ["train", "--config=k3_tiny", "--dataset={t}/nodata", "--batch_size=8",
     "--workdir={t}/w"], "data path not found"),
    ("train", "dataset folder without documents", ["train", "--config=k3_tiny",
     "--dataset={t}/empty", "--batch_size=8", "--workdir={t}/w"], "holds no non-empty documents"),
    ("train", "tokenizer file missing", ["train", "--config=k3_tiny", "--tokenizer={t}/tok",
     "--batch_size=8", "--workdir={t}/w"], "no such file"),
    ("train", "unknown mesh axis", ["train", "--config=k3_tiny", "--mesh=foo:2",
     "--workdir={t}/w"], "mesh axis 'foo' is unknown"),
    ("train", "mesh larger than the devices", ["train", "--config=k3_tiny", "--mesh=fsdp:3",
     "--workdir={t}/w"], "needs 3 devices"),
    ("train", "negative ep_capacity", ["train", "--config=k3_tiny", "--ep_capacity=-1",
     "--workdir={t}/w"], "ep_capacity=-1.0"),
    ("train", "profile_steps malformed", ["train", "--config=k3_tiny", "--profile_steps=5",
     "--workdir={t}/w"], "expected FIRST:LAST"),
    ("train", "profile_steps reversed", ["train", "--config=k3_tiny", "--profile_steps=5:2",
     "--workdir={t}/w"], "FIRST <= LAST"),
    ("train", "max_bad_steps below 1", ["train", "--config=k3_tiny", "--max_bad_steps=0",
     "--workdir={t}/w"], "--max_bad_steps=0"),
    ("train", "negative caption_eval_images", ["train", "--config=k3_tiny",
     "--caption_eval_images=-1", "--workdir={t}/w"], "--caption_eval_images=-1"),
    ("train", "negative checkpoint_step", ["train", "--config=k3_tiny", "--checkpoint_step=-1",
     "--workdir={t}/w"], "--checkpoint_step=-1"),
    ("train", "some multi-host flags only", ["train", "--config=k3_tiny", "--num_processes=2",
     "--workdir={t}/w"], "give all of --coordinator_address"),
    ("train", "init_from path missing", ["train", "--init_from={t}/nohf", "--workdir={t}/w"],
     "has no config.json"),
    ("train", "workdir is a file", ["train", "--config=k3_tiny", "--workdir={t}/file.txt"],
     "is a file, not a directory"),
    ("train", "workdir of another model", ["train", "--config=k3_small", "--batch_size=8",
     "--workdir={t}/tinyrun"], "different model config"),
    # generate
    ("generate", "no prompt", ["generate", "--workdir={t}/empty"], "--prompt is empty"),
    ("generate", "non-positive max_new_tokens", ["generate", "--workdir={t}/empty",
     "--prompt=hi", "--max_new_tokens=0"], "--max_new_tokens=0"),
    ("generate", "negative temperature", ["generate", "--workdir={t}/empty", "--prompt=hi",
     "--temperature=-1"], "--temperature=-1.0"),
    ("generate", "top_p of 0", ["generate", "--workdir={t}/empty", "--prompt=hi", "--top_p=0"],
     "--top_p=0.0: must lie in (0, 1]"),
    ("generate", "prompt_ids not integers", ["generate", "--workdir={t}/empty",
     "--prompt_ids=1,x"], "--prompt_ids='1,x'"),
    ("generate", "image with prompt_ids", ["generate", "--workdir={t}/empty", "--prompt_ids=1",
     "--image={t}/file.txt"], "cannot be combined"),
    ("generate", "image file missing", ["generate", "--workdir={t}/empty", "--prompt=hi",
     "--image={t}/cat.png"], "--image=", ),
    ("generate", "tokenizer file missing", ["generate", "--workdir={t}/empty", "--prompt=hi",
     "--tokenizer={t}/tok"], "no such file"),
    ("generate", "negative checkpoint_step", ["generate", "--workdir={t}/empty", "--prompt=hi",
     "--checkpoint_step=-1"], "--checkpoint_step=-1"),
    ("generate", "workdir without checkpoints", ["generate", "--workdir={t}/empty",
     "--prompt=hi"], "no checkpoints in"),
    ("generate", "workdir missing", ["generate", "--workdir={t}/nothere", "--prompt=hi"],
     "no checkpoints in"),
    ("generate", "hf_dir without config.json", ["generate", "--hf_dir={t}/empty",
     "--prompt=hi"], "has no config.json"),
    # info
    ("info", "unknown preset", ["info", "--config=k9"], "unknown config 'k9'"),
    ("info", "override of an unknown field", ["info", "--config=k3_tiny", "--override=x=1"],
     "ModelConfig has no field 'x'"),
    ("info", "override that breaks the model", ["info", "--config=k3_tiny",
     "--override=moe.num_experts=-1"], "moe.num_experts=-1"),
    ("info", "unknown optimizer", ["info", "--param_groups", "--optimizer=sgd"],
     "flag --optimizer=sgd"),
    # compile
    ("compile", "no topology", ["compile", "--config=k3_tiny"], "compile needs --topology"),
    ("compile", "micro-batch smaller than the batch shards",
     ["compile", "--config=k3_tiny", "--topology=v5p-8", "--mesh=fsdp:4", "--step=train",
      "--global_batch=4", "--grad_accum=2"],
     "micro-batch=2 (global batch 4 / grad_accum 2) is not divisible by mesh fsdp:4 = 4"),
    ("compile", "unknown topology", ["compile", "--config=k3_tiny", "--topology=v9-8"],
     "topology 'v9-8'"),
    ("compile", "zero slices", ["compile", "--config=k3_tiny", "--topology=v5p-8",
     "--slices=0"], "slices must be >= 1"),
    ("compile", "mesh not matching the chips", ["compile", "--config=k3_tiny",
     "--topology=v5p-8", "--mesh=fsdp:3"], "needs 3 devices, but 4"),
    ("compile", "zero global_batch", ["compile", "--config=k3_tiny", "--topology=v5p-8",
     "--global_batch=0"], "--global_batch=0"),
    ("compile", "zero cache_len", ["compile", "--config=k3_tiny", "--topology=v5p-8",
     "--step=decode", "--cache_len=0"], "--cache_len=0"),
    ("compile", "non-positive seq_len", ["compile", "--config=k3_tiny", "--topology=v5p-8",
     "--seq_len=0"], "seq_len=0: must be positive"),
    ("compile", "global batch not divisible by grad_accum", ["compile", "--config=k3_tiny",
     "--topology=v5p-8", "--global_batch=12", "--grad_accum=8"],
     "global batch=12 is not divisible by grad_accum=8"),
    # convert
    ("convert", "no --to", ["convert", "--from={t}/empty"], "convert needs --from=SRC"),
    ("convert", "no --from", ["convert", "--to={t}/out"], "convert needs --from=SRC"),
    ("convert", "mistyped --from", ["convert", "--from={t}/runs/defualt", "--to={t}/out"],
     "no such file or directory"),
    ("convert", "--from is a file", ["convert", "--from={t}/file.txt", "--to={t}/out"],
     "is a file"),
    ("convert", "--from holds no checkpoint", ["convert", "--from={t}/empty",
     "--to={t}/out"], "holds neither a Hugging Face"),
    ("convert", "bad shard size", ["convert", "--from={t}/empty", "--to={t}/out",
     "--max_shard_size=5XB"], "--max_shard_size='5XB'"),
    ("convert", "negative checkpoint_step", ["convert", "--from={t}/tinyrun", "--to={t}/out",
     "--checkpoint_step=-1"], "--checkpoint_step=-1"),
    ("convert", "dry run of an unknown preset", ["convert", "--dry_run", "--config=k9"],
     "unknown config 'k9'"),
    # serve
    ("serve", "workdir without checkpoints", ["serve", "--workdir={t}/empty", "--port=0"],
     "no checkpoints in"),
    ("serve", "hf_dir without config.json", ["serve", "--hf_dir={t}/empty", "--port=0"],
     "has no config.json"),
    ("serve", "unknown preset", ["serve", "--random_weights", "--config=k9", "--port=0"],
     "unknown config 'k9'"),
    ("serve", "override of an unknown field", ["serve", "--random_weights",
     "--config=k3_tiny", "--override=x=1", "--port=0"], "ModelConfig has no field 'x'"),
    ("serve", "port out of range", ["serve", "--random_weights", "--config=k3_tiny",
     "--port=99999"], "port=99999"),
    ("serve", "zero max_batch", ["serve", "--random_weights", "--config=k3_tiny",
     "--max_batch=0"], "max_batch=0"),
    ("serve", "zero max_len", ["serve", "--random_weights", "--config=k3_tiny",
     "--max_len=0"], "max_len=0"),
    ("serve", "prefill_chunk not a page multiple", ["serve", "--random_weights",
     "--config=k3_tiny", "--prefill_chunk=7"], "prefill_chunk=7"),
    ("serve", "unknown mesh axis", ["serve", "--random_weights", "--config=k3_tiny",
     "--mesh=foo:1", "--port=0"], "mesh axis 'foo' is unknown"),
    ("serve", "tokenizer file missing", ["serve", "--random_weights", "--config=k3_tiny",
     "--tokenizer={t}/tok", "--port=0"], "no such file"),
    ("serve", "tokenizer directory without a tokenizer file", ["serve", "--random_weights",
     "--config=k3_tiny", "--tokenizer={t}/empty", "--port=0"], "a directory without"),
    ("serve", "host that does not resolve", ["serve", "--random_weights", "--config=k3_tiny",
     "--host=999.1.1.1", "--port=0"], "--host=999.1.1.1: cannot resolve"),
    ("serve", "port already in use", ["serve", "--random_weights", "--config=k3_tiny",
     "--port={busy_port}"], "already in use"),
    ("serve", "some multi-host flags only", ["serve", "--random_weights", "--config=k3_tiny",
     "--num_processes=2", "--port=0"], "multi-host: give all of"),
    ("serve", "zero peer_timeout", ["serve", "--random_weights", "--config=k3_tiny",
     "--peer_timeout=0", "--port=0"], "peer_timeout=0"),
    ("serve", "match grid not a power of two (by its former flag name)", ["serve",
     "--random_weights", "--config=k3_tiny", "--prefix_match_unit=48", "--port=0"],
     "prefix_match_tokens=48"),
    ("serve", "negative KDA chunk (an execution setting)", ["serve", "--random_weights",
     "--config=k3_tiny", "--kda_chunk_size=-16", "--port=0"], "kda_chunk_size=-16"),
]


def _tree(root):
  """Every path under root with its size and mtime: what a case may not change."""
  out = {}
  for d, dirs, files in os.walk(root):
    for n in dirs + files:
      p = os.path.join(d, n)
      st = os.stat(p)
      out[os.path.relpath(p, root)] = (os.path.isdir(p), st.st_size, st.st_mtime_ns)
  return out


@pytest.fixture(scope="module")
def cli():
  """main's parser and entry, with the flags reset before and after each call."""
  import main
  from absl import flags

  def run(argv):
    flags.FLAGS.unparse_flags()
    err, out, code = io.StringIO(), io.StringIO(), None
    try:
      with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        main.main(main._parse(["main.py", *argv]))
    except SystemExit as e:
      code = e.code
    finally:
      flags.FLAGS.unparse_flags()
    return code, err.getvalue(), out.getvalue()
  yield run
  flags.FLAGS.unparse_flags()


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
  """tmp_path as the working directory with an empty folder, a file, and a (fake) workdir of
  k3_tiny checkpoints; building a model or a serving engine fails the test."""
  import configs
  from k3_jax.config import to_dict
  from k3_jax import model
  from k3_jax.serve import engine
  # The modules that bind these names at import: imported now and patched too (monkeypatch
  # restores them), so a first import inside a case cannot keep the stand-in afterwards.
  import importlib
  binders = [importlib.import_module(m) for m in (
      "k3_jax.checkpoint.inference", "k3_jax.compile", "k3_jax.serve.loader",
      "k3_jax.serve.server", "k3_jax.train")]
  (tmp_path / "empty").mkdir()
  (tmp_path / "file.txt").write_text("not a directory\n")
  ck = tmp_path / "tinyrun" / "checkpoints"
  (ck / "4").mkdir(parents=True)
  (ck / "model_config.json").write_text(json.dumps(to_dict(configs.get("k3_tiny"))))
  monkeypatch.chdir(tmp_path)

  def no_load(*a, **k):
    raise AssertionError("the model was built before the input was refused")
  monkeypatch.setattr(model, "create_model", no_load)     # random weights
  monkeypatch.setattr(engine, "Engine", no_load)          # every source: the engine
  for mod in binders:
    for name in ("create_model", "Engine"):
      if hasattr(mod, name):
        monkeypatch.setattr(mod, name, no_load)
  return tmp_path


@pytest.fixture(scope="module")
def busy_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]


@pytest.mark.parametrize("command,case,argv,expected", CASES,
                         ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_bad_input(cli, sandbox, busy_port, command, case, argv, expected):
  argv = [a.format(t=sandbox, busy_port=busy_port) for a in argv]
  before = _tree(sandbox)
  t0 = time.perf_counter()
  code, err, out = cli(argv)
  seconds = time.perf_counter() - t0
  assert code == 2, (code, err[-2000:])
  lines = err.strip().splitlines()
  assert "Traceback" not in err and sum(l.startswith("error:") for l in lines) == 1, err
  assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
  # one line, except a usage mistake, which the command's help follows after a blank line
  assert len(lines) == 1 or lines[1] == "", lines
  assert _tree(sandbox) == before, "the case created or changed files"
  assert seconds < 10, f"{seconds:.1f}s: expensive work before the check"


def test_serve_port_in_use_exits_before_loading(env, busy_port, tmp_path):
  """The issue's case end to end: `serve` on a bound port, a real process with the real
  loader, exits 2 with the error line and without printing that it serves."""
  import subprocess
  t0 = time.perf_counter()
  r = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "serve",
                      "--random_weights", "--config=k3_tiny", f"--port={busy_port}"],
                     cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  seconds = time.perf_counter() - t0
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip().splitlines() == [
      f"error: --port={busy_port}: cannot listen on 127.0.0.1:{busy_port}: already in use "
      f"(choose another --port, or stop the process that holds it)"]
  assert "serving" not in r.stdout and not os.listdir(tmp_path)
  print(f"serve on a busy port refused in {seconds:.1f}s")


@pytest.mark.parametrize("fmt,noted", [("auto", True), ("dense", False), ("mxfp4", False)])
def test_convert_says_when_it_packs_experts_lossily(cli, fmt, noted):
  """An export left at --expert_format=auto packs k3_small's experts in MXFP4: it says so
  (lossy) and names the flag that keeps them exact; asked for explicitly, it says nothing."""
  code, err, out = cli(["convert", "--dry_run", "--config=k3_small", f"--expert_format={fmt}"])
  assert code is None and out, err
  note = ("note: the export packs the routed experts in MXFP4 (4.25 bits per weight, lossy: "
          "the exported model differs from the checkpoint); --expert_format=dense keeps them "
          "exact")
  assert (err.strip().splitlines() == [note]) if noted else note not in err
