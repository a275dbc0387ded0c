"""Frozen configuration dataclasses for K3 models and jobs, plus validation.

Every field is plain data. `validate()` runs before any work starts and raises
`ConfigError` naming the field, its value and the rule it breaks. Overrides
from the command line (`kda.num_heads=4`) go through `apply_overrides`, which
rejects unknown fields by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class UserError(ValueError):
  """Bad input from the user (a flag, a file, a prompt): the command line prints the message
  without a traceback. Real bugs raise anything else and keep their traceback."""


class ConfigError(UserError):
  """A configuration value breaks a rule; the message names field, value and rule."""


# How routed-expert weights are served (generate, compile): as stored (the param dtype) or
# packed MXFP4 MXArrays (4.25 bits per weight).
EXPERT_FORMATS = ("dense", "mxfp4")


@dataclass(frozen=True)
class KDAConfig:
  num_heads: int = 4
  head_dim: int = 32            # K = V
  conv_size: int = 4            # depthwise causal short convolution width
  decay: str = "lower_bound"    # "lower_bound": g = g_min*sigmoid(e^A z) (K3); "softplus": Kimi Linear
  g_min: float = -5.0
  gate_rank: int = 0            # output gate: 0 = full rank (K3); r > 0 = low rank d -> r -> H*V
  decay_rank: int = 0           # rank of the decay logit projection; 0 = head_dim


@dataclass(frozen=True)
class MLAConfig:
  num_heads: int = 4
  q_lora_rank: int = 32         # 0 = no query low-rank (Kimi Linear)
  kv_lora_rank: int = 32
  qk_nope_head_dim: int = 32
  qk_rope_head_dim: int = 16    # kept in weights and scale, never rotated (NoPE)
  v_head_dim: int = 32
  output_gate: bool = True      # sigmoid(W_g x) gate before W_o (K3); False for Kimi Linear
  latent_norm_eps: float = 0.0  # eps of the q / kv latent RMSNorms; 0 = norm_eps. transformers'
                                # Kimi Linear uses 1e-6 there (docs/architecture.md section 11), vLLM norm_eps


@dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 8
  top_k: int = 2
  num_shared_experts: int = 1
  expert_intermediate: int = 64     # per routed (and per shared) expert
  latent_dim: int = 0               # 0 = routed experts run at full width (no latent projection)
  routed_scaling_factor: float = 1.0
  n_group: int = 1                  # group-limited routing (DeepSeek-V3); 1 = off
  topk_group: int = 1
  balance: str = "qb"               # router bias update in training: "qb" (Quantile
                                    # Balancing), "sign" (DeepSeek-V3 fixed step), "none"
  balance_rate: float = 1e-3        # step of the "sign" update
  qb_bins: int = 0                  # 0: exact quantiles; > 0: pooled histogram of this many bins


@dataclass(frozen=True)
class AttnResConfig:
  enabled: bool = False
  block_size: int = 12          # layers per AttnRes block


@dataclass(frozen=True)
class QuantConfig:
  qat: str = "none"             # "none" | "mxfp4_mxfp8": routed-expert weights fake-quantized
                                # to MXFP4 and their input activations to MXFP8 E4M3 (spec s7)


QAT_MODES = ("none", "mxfp4_mxfp8")
KDA_BACKENDS = ("auto", "reference", "pallas")
GMM_KINDS = ("auto", "ragged_dot", "tiled")

# Former model fields that choose how the model executes (kernels, buffer bounds), not what
# it computes: they are execution settings now (k3_jax/execution.py ExecConfig, by the
# names here). An old model_config.json that holds them still loads (`from_dict` drops
# them; execution.moved_from reads them) and matches a checkpoint of the same model.
MOVED_FIELDS = {"kda.backend": "kda_backend", "kda.chunk_size": "kda_chunk_size",
                "moe.gmm": "gmm", "moe.ep_capacity": "ep_capacity"}


@dataclass(frozen=True)
class VisionConfig:
  """The vision tower (MoonViT, docs/architecture.md section 8) and its projector into the LM width.

  The defaults are the released K3 tower (MoonViT-V2). The earlier MoonViT of Kimi K2.5 is
  the same mechanism with norm="layernorm", bias=True, projector_norm="pre"."""
  num_layers: int = 27
  width: int = 1024                 # model width of the tower
  num_heads: int = 12
  head_dim: int = 128               # attention width num_heads * head_dim may differ from width
  mlp_dim: int = 4096               # tanh-GELU MLP
  patch_size: int = 14
  pos_grid: int = 64                # learned position table [pos_grid, pos_grid, width]
  rope_theta: float = 10000.0
  merge: int = 2                    # k x k neighbouring patches -> one LM token
  norm: str = "rmsnorm"             # "rmsnorm" (V2) | "layernorm" (K2.5, with biases)
  bias: bool = False                # biases on the patch embedding, qkv, wo and MLP (K2.5)
  norm_eps: float = 1e-5
  projector_norm: str = "post"      # "post": Linear, GELU, Linear, RMSNorm (V2) |
                                    # "pre": LayerNorm, Linear, GELU, Linear (K2.5)
  projector_eps: float = 1e-5
  max_patches: int = 65_536         # patch budget per image
  max_side: int = 512               # patches per image side
  # text-side ids: <|media_begin|>image {w}x{h}<|media_content|> [image] * h*w/4 <|media_end|>
  media_begin_id: int = 163_602
  media_content_id: int = 163_603
  media_end_id: int = 163_604
  image_token_id: int = 163_605

  @property
  def merged_dim(self) -> int:
    return self.width * self.merge * self.merge

  @property
  def attn_dim(self) -> int:
    return self.num_heads * self.head_dim


@dataclass(frozen=True)
class ModelConfig:
  name: str = "custom"
  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 9
  mla_layers: tuple[int, ...] = (4, 8, 9)      # 1-based; the rest are KDA
  dense_layers: tuple[int, ...] = (1,)         # 1-based; the rest are MoE
  dense_intermediate: int = 256
  activation: str = "situ"                     # "situ" (SiTU-GLU) | "swiglu"
  situ_beta1: float = 4.0
  situ_beta2: float = 25.0
  norm_eps: float = 1e-5
  max_seq_len: int = 4096
  dtype: str = "float32"                       # compute dtype of matmuls
  param_dtype: str = "float32"
  scan_period: int = 4                         # layers per scanned unit ([KDA, KDA, KDA, MLA])
  bos_id: int = -1                             # -1 = none
  eos_id: int = -1
  pad_id: int = -1
  init_std: float = 0.02
  kda: KDAConfig = field(default_factory=KDAConfig)
  mla: MLAConfig = field(default_factory=MLAConfig)
  moe: MoEConfig = field(default_factory=MoEConfig)
  attn_res: AttnResConfig = field(default_factory=AttnResConfig)
  quant: QuantConfig = field(default_factory=QuantConfig)
  vision: VisionConfig | None = None           # None: text only (no tower is built)

  # ----- derived structure -------------------------------------------------
  def layer_kinds(self) -> tuple[tuple[str, str], ...]:
    """(mixer, ffn) per layer, 0-based list: mixer in {kda, mla}, ffn in {dense, moe}."""
    return tuple(
        ("mla" if i + 1 in self.mla_layers else "kda",
         "dense" if i + 1 in self.dense_layers else "moe")
        for i in range(self.num_layers))

  def stack_plan(self) -> tuple[int, int, int]:
    """(prefix, repeats, period): layers[:prefix] run unscanned, then `repeats`
    identical units of `period` layers run under one scan, then the rest
    unscanned. Chosen to scan as many layers as possible, so compile time
    stays flat as depth grows."""
    kinds, p = self.layer_kinds(), self.scan_period
    best = (len(kinds), 0)  # (unscanned count, -start) -> minimise
    plan = (len(kinds), 0, p)
    for start in range(len(kinds)):
      unit = kinds[start:start + p]
      if len(unit) < p:
        break
      reps = 1
      while kinds[start + reps * p:start + (reps + 1) * p] == unit:
        reps += 1
      unscanned = len(kinds) - reps * p
      if (unscanned, start) < best:
        best, plan = (unscanned, start), (start, reps, p)
    return plan


INIT_MODES = ("auto", "host", "sharded")     # TrainConfig.init


def option(default, help: str, *, step: bool = True, choices: tuple[str, ...] | None = None):
  """A field of TrainConfig / ServeConfig / execution.ExecConfig with its declaration: the
  command line defines a flag --<field name> from it (type from the default, an enum when
  `choices`, `help` as its help), and `step` says whether the value shapes the compiled train / eval steps (part of
  their cache key, k3_jax/train.py build_steps: a False field never recompiles them)."""
  return field(default=default, metadata={"help": help, "step": step, "choices": choices})


def flag_fields(cls) -> tuple[dataclasses.Field, ...]:
  """The fields of TrainConfig / ServeConfig / ExecConfig, each with its `option`
  declaration."""
  return dataclasses.fields(cls)


@dataclass(frozen=True)
class TrainConfig:
  """A training job. Every field is a flag of `train` (None there: the preset's value)."""
  steps: int = option(300, "training steps (default: the preset's)")
  batch_size: int = option(8, "global batch size in sequences")
  seq_len: int = option(256, "sequence length in tokens")
  optimizer: str = option("adamw", "muon (Per-Head Muon on matrices + AdamW on the rest) | "
                          "adamw (default: the preset's)", choices=("muon", "adamw"))
  learning_rate: float = option(3e-3, "peak AdamW learning rate (the whole model with "
                                "--optimizer=adamw; the non-matrix parameters with "
                                "--optimizer=muon)")
  muon_lr: float = option(3e-3, "peak Muon learning rate (matrix parameters, "
                          "--optimizer=muon)")
  muon_placement: str = option("owned", "where Newton-Schulz runs on a mesh: owned (each "
                               "block whole on one chip, computed once) | sharded (left to "
                               "the partitioner)", choices=("owned", "sharded"))
  qk_clip_tau: float = option(100.0, "QK-Clip threshold on the MLA max logits; 0 disables")
  warmup_frac: float = option(0.01, "fraction of the steps of linear learning-rate warmup")
  min_lr_ratio: float = option(0.1, "final learning rate of the cosine decay, as a fraction "
                               "of the peak")
  weight_decay: float = option(0.1, "decoupled weight decay (matrices only)")
  b1: float = option(0.9, "Adam / Muon first-moment decay")
  b2: float = option(0.95, "Adam second-moment decay")
  grad_clip: float = option(1.0, "clip gradients to this global norm")
  # the step's host init (k3_jax/train.py Steps.init) draws with the seed
  seed: int = option(0, "random seed (train: init and data order; generate: sampling, "
                     "default 0)")
  init: str = option("auto", "how a fresh run creates its parameters (the same values "
                     "either way): host (drawn on the host, then placed) | sharded (one jitted "
                     "program creating every shard on its device) | auto (default: sharded off "
                     "CPU or when the train state exceeds a quarter of host memory)",
                     step=False, choices=INIT_MODES)
  eval_every: int = option(100, "evaluate every N steps", step=False)
  eval_batches: int = option(4, "held-out batches per evaluation", step=False)
  checkpoint_every: int = option(100, "checkpoint every N steps", step=False)
  keep_checkpoints: int = option(2, "checkpoints kept in the workdir", step=False)
  log_every: int = option(10, "write metrics every N steps", step=False)
  dataset: str = option("stdlib", "stdlib (default) | mqar | shapes (synthetic images + "
                        "captions; attaches the preset's vision tower) | path to "
                        ".txt/.jsonl/folder", step=False)
  tokenizer: str = option("byte", "byte | path to a tiktoken BPE file | a model directory "
                          "(tiktoken.model or tokenizer.json; train default: byte, or "
                          "--init_from's; generate default: the run's)", step=False)


SERVE_PAGE = 512        # tokens per KV page (its one definition; serve/kv_pages.PAGE)


@dataclass(frozen=True)
class ServeConfig:
  """The serving engine's settings (k3_jax/serve/engine.py Engine), the flags of `serve`
  and the defaults of serve/loader.py ServeOptions: their one home."""
  max_batch: int = option(8, "sequence slots decoded together")
  max_len: int | None = option(None, "tokens per sequence, prompt + generated (default: the "
                               "model's max_seq_len)")
  prefill_chunk: int = option(4 * SERVE_PAGE, f"prompt tokens a step prefills (a multiple of "
                              f"{SERVE_PAGE}) before its decode step: one long prompt's "
                              f"chunk, or the same-size pieces of several prompts in one call")
  kv_cache_bytes: int = option(0, "bytes of the MLA page pool that every sequence's KV "
                               "pages come from, handed out as sequences grow (requests wait, "
                               "or the newest is preempted and later recomputed, when it runs "
                               "out); 0: 80% of the device memory free after the weights, or "
                               "1 GiB on a device that reports none (CPU)")
  prefix_cache_bytes: int = option(1 << 30, "prefix cache budget (cached MLA pages + KDA "
                                   "checkpoints); 0 disables it")
  host_cache_bytes: int = option(0, "prefix cache host-memory tier: bytes of host memory "
                                 "that entries evicted from the device cache are demoted into "
                                 "(and promoted back from on a hit); 0: no host tier")
  disk_cache_dir: str = option("", "prefix cache disk tier: a directory that demoted entries "
                               "are also written to (one file per block), reloaded by a "
                               "server restarted on the same model and tokenizer; empty: none")
  disk_cache_bytes: int = option(16 << 30, "the disk tier's budget in bytes (least recently "
                                 "used files are removed past it)")
  cache_decoded: bool = option(True, "a finished request's prompt + generated tokens join the "
                               "prefix cache (with a KDA checkpoint at the last grid boundary "
                               "the decode passed), so the next turn hits through its answer")
  prefix_match_tokens: int = option(SERVE_PAGE, "prefix-cache hit granularity in tokens (a "
                                    f"power of two dividing {SERVE_PAGE}): hash entries and "
                                    "KDA checkpoints lie on this grid, a hit ends on a "
                                    "multiple (--prefix_match_unit: its former name)")
  batch_invariant: bool = option(False, "every prefill call takes one prompt (one shape per "
                                 "piece size) and every decode step runs all max_batch slots, "
                                 "so a request's logits are bitwise the same whatever else "
                                 "runs (reproducible serving; a batch-1 step then costs a "
                                 "full batch's); false (default): the same-size pieces of up "
                                 "to max_batch prompts share a call and a decode step runs "
                                 "only the decoding slots (padded to a power of two), so a "
                                 "step's cost follows the load; on XLA:CPU the logits then "
                                 "move in the last bits with the batch (greedy tokens rarely)")
  overlap: bool = option(True, "dispatch each decode step before reading back the previous "
                         "one's tokens (one step ahead: the host's emit, detokenise and stop "
                         "checks run while the device computes); false: read each step first")
  warmup: bool = option(True, "before listening, compile the step shapes of 1 to max_batch "
                        "requests arriving together (dummy one-page prompts, two tokens each; "
                        "nothing cached), so that no request waits for a compile of those "
                        "shapes; false: each compiles on first use")
  admit_gap_ms: float = option(0.0, "serve: an idle engine starts its first prefill once no "
                               "request has arrived for this long (a burst of requests then "
                               "shares its prefill calls), and at most admit_window_ms after "
                               "the first arrival; 0: at once. On 2 CPU cores, 30 "
                               "gave a burst of 8 requests +9% tokens/s (median) and a lone "
                               "request -12% (docs/serving.md)")
  admit_window_ms: float = option(50.0, "serve: the longest an idle engine waits for a "
                                  "burst's requests to arrive (see admit_gap_ms)")
  max_queue: int = option(64, "waiting requests before new ones get HTTP 429")
  host: str = option("127.0.0.1", "address to listen on (loopback by default: the API has no "
                     "authentication)")
  port: int = option(8000, "TCP port")
  request_timeout: float = option(0.0, "seconds a request may run before it fails with a "
                                  "timeout error (HTTP 504); 0: no limit")
  drain_timeout: float = option(30.0, "on SIGTERM: seconds in-flight requests may take to "
                                "finish (new ones get 503) before the server exits")
  max_body_bytes: int = option(4 << 20, "largest request body accepted (larger: HTTP 413)")
  peer_timeout: float = option(30.0, "multi-host serving: seconds without a heartbeat after "
                               "which a process counts as lost; the others then exit with "
                               "status 3 (a supervisor restarts the group)")
  speculative: str = option("off", "speculative decoding: 'ngram' drafts up to "
                            "num_speculative_tokens tokens a step from the request's own "
                            "tokens (prompt lookup) and one verify step keeps the ones the "
                            "model agrees with (the output's distribution is the model's); "
                            "'draft': a smaller model (--draft_dir) drafts them; "
                            "'off': one token a step", choices=("off", "ngram", "draft"))
  num_speculative_tokens: int = option(4, "drafts per sequence and step with --speculative")
  draft_dir: str = option("", "--speculative=draft: the draft model's training workdir (a "
                          "smaller model with the served model's tokenizer)")

  def __post_init__(self):
    _require(self.request_timeout >= 0, "request_timeout", self.request_timeout,
             "must be >= 0 (0: no limit)")
    _require(self.drain_timeout >= 0, "drain_timeout", self.drain_timeout, "must be >= 0")
    _require(self.max_body_bytes >= 1, "max_body_bytes", self.max_body_bytes, "must be >= 1")
    _require(self.peer_timeout > 0, "peer_timeout", self.peer_timeout, "must be > 0")
    _require(self.max_batch >= 1, "max_batch", self.max_batch, "must be >= 1")
    _require(self.max_len is None or self.max_len >= 1, "max_len", self.max_len,
             "must be positive (or None: the model's max_seq_len)")
    _require(self.prefill_chunk >= SERVE_PAGE and self.prefill_chunk % SERVE_PAGE == 0,
             "prefill_chunk", self.prefill_chunk,
             f"must be a positive multiple of {SERVE_PAGE}")
    _require(isinstance(self.kv_cache_bytes, int) and self.kv_cache_bytes >= 0,
             "kv_cache_bytes", self.kv_cache_bytes,
             "must be a byte count >= 0 (0: sized from the device's free memory)")
    _require(self.prefix_cache_bytes >= 0, "prefix_cache_bytes", self.prefix_cache_bytes,
             "must be >= 0 (0 disables the prefix cache)")
    _require(self.host_cache_bytes >= 0, "host_cache_bytes", self.host_cache_bytes,
             "must be a byte count >= 0 (0: no host tier)")
    _require(self.disk_cache_bytes >= 0, "disk_cache_bytes", self.disk_cache_bytes,
             "must be a byte count >= 0")
    u = self.prefix_match_tokens
    _require(isinstance(u, int) and 1 <= u <= SERVE_PAGE and SERVE_PAGE % u == 0 and
             u & (u - 1) == 0, "prefix_match_tokens", u,
             f"must be a power of two dividing {SERVE_PAGE} (1, 2, ..., {SERVE_PAGE})")
    _require(self.max_queue >= 0, "max_queue", self.max_queue, "must be >= 0")
    _require(self.speculative in ("off", "ngram", "draft"), "speculative", self.speculative,
             "must be 'off', 'ngram' or 'draft'")
    _require((self.speculative == "draft") == bool(self.draft_dir), "draft_dir",
             self.draft_dir, "is needed by --speculative=draft, and only by it")
    _require(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens",
             self.num_speculative_tokens, "must be in 1..16")
    _require(0 <= self.port < 65536, "port", self.port, "must lie in [0, 65535]")


@dataclass(frozen=True)
class MeshConfig:
  data: int = 1
  fsdp: int = -1                    # -1: all remaining devices
  expert: int = 1
  sequence: int = 1
  tensor: int = 1


# ----- validation ---------------------------------------------------------

def _require(ok: bool, field_name: str, value: Any, rule: str) -> None:
  if not ok:
    raise ConfigError(f"{field_name}={value!r}: {rule}")


def validate(cfg: ModelConfig) -> ModelConfig:
  """Checks every rule the model relies on; returns cfg unchanged."""
  for f in ("vocab_size", "d_model", "num_layers", "dense_intermediate", "max_seq_len",
            "scan_period"):
    _require(getattr(cfg, f) > 0, f, getattr(cfg, f), "must be positive")
  for f in ("mla_layers", "dense_layers"):
    for i in getattr(cfg, f):
      _require(1 <= i <= cfg.num_layers, f, getattr(cfg, f),
               f"layer numbers are 1-based and must lie in [1, num_layers={cfg.num_layers}]")
  _require(cfg.activation in ("situ", "swiglu"), "activation", cfg.activation,
           "must be one of 'situ', 'swiglu'")
  for f in ("dtype", "param_dtype"):
    _require(getattr(cfg, f) in ("float32", "bfloat16"), f, getattr(cfg, f),
             "must be 'float32' or 'bfloat16'")
  k = cfg.kda
  for f in ("num_heads", "head_dim", "conv_size"):
    _require(getattr(k, f) > 0, f"kda.{f}", getattr(k, f), "must be positive")
  _require(k.decay in ("lower_bound", "softplus"), "kda.decay", k.decay,
           "must be 'lower_bound' (K3) or 'softplus' (Kimi Linear)")
  _require(k.g_min < 0, "kda.g_min", k.g_min, "must be negative (log of the smallest decay)")
  _require(k.gate_rank >= 0 and k.decay_rank >= 0, "kda.gate_rank/decay_rank",
           (k.gate_rank, k.decay_rank), "must be >= 0")
  m = cfg.mla
  for f in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
    _require(getattr(m, f) > 0, f"mla.{f}", getattr(m, f), "must be positive")
  _require(m.q_lora_rank >= 0 and m.qk_rope_head_dim >= 0, "mla.q_lora_rank/qk_rope_head_dim",
           (m.q_lora_rank, m.qk_rope_head_dim), "must be >= 0")
  e = cfg.moe
  _require(e.num_experts > 0, "moe.num_experts", e.num_experts, "must be positive")
  _require(0 < e.top_k <= e.num_experts, "moe.top_k", e.top_k,
           f"must lie in [1, moe.num_experts={e.num_experts}]")
  _require(e.expert_intermediate > 0, "moe.expert_intermediate", e.expert_intermediate,
           "must be positive")
  _require(e.latent_dim >= 0, "moe.latent_dim", e.latent_dim, "must be >= 0 (0 = no latent)")
  _require(e.num_shared_experts >= 0, "moe.num_shared_experts", e.num_shared_experts,
           "must be >= 0")
  _require(e.num_experts % e.n_group == 0, "moe.n_group", e.n_group,
           f"must divide moe.num_experts={e.num_experts}")
  _require(1 <= e.topk_group <= e.n_group, "moe.topk_group", e.topk_group,
           f"must lie in [1, moe.n_group={e.n_group}]")
  _require(e.balance in ("qb", "sign", "none"), "moe.balance", e.balance,
           "must be 'qb', 'sign' or 'none'")
  _require(e.balance != "qb" or e.top_k < e.num_experts, "moe.top_k", e.top_k,
           "Quantile Balancing needs top_k < num_experts (its cutoff is the (k+1)-th expert)")
  _require(e.qb_bins >= 0, "moe.qb_bins", e.qb_bins, "must be >= 0 (0 = exact)")
  _require(cfg.quant.qat in QAT_MODES, "quant.qat", cfg.quant.qat,
           f"must be one of {', '.join(map(repr, QAT_MODES))}")
  if cfg.quant.qat != "none":
    width = e.latent_dim or cfg.d_model
    for name, n in (("moe.latent_dim" if e.latent_dim else "d_model", width),
                    ("moe.expert_intermediate", e.expert_intermediate)):
      _require(n % 32 == 0, name, n, "must be a multiple of 32 with quant.qat on (MX blocks of "
               "32 along each routed-expert contraction axis)")
  _require(cfg.attn_res.block_size > 0, "attn_res.block_size", cfg.attn_res.block_size,
           "must be positive")
  if cfg.vision is not None:
    validate_vision(cfg.vision, cfg.vocab_size)
  return cfg


def validate_vision(v: VisionConfig, vocab_size: int) -> VisionConfig:
  for f in ("num_layers", "width", "num_heads", "head_dim", "mlp_dim", "patch_size", "pos_grid",
            "merge", "max_patches", "max_side"):
    _require(getattr(v, f) > 0, f"vision.{f}", getattr(v, f), "must be positive")
  _require(v.head_dim % 4 == 0, "vision.head_dim", v.head_dim,
           "must be divisible by 4 (2-D RoPE: complex pairs alternate x and y)")
  _require(v.norm in ("rmsnorm", "layernorm"), "vision.norm", v.norm,
           "must be 'rmsnorm' (MoonViT-V2) or 'layernorm' (K2.5)")
  _require(v.projector_norm in ("post", "pre"), "vision.projector_norm", v.projector_norm,
           "must be 'post' (MoonViT-V2) or 'pre' (K2.5)")
  ids = {f: getattr(v, f) for f in ("media_begin_id", "media_content_id", "media_end_id",
                                     "image_token_id")}
  for f, i in ids.items():
    _require(0 <= i < vocab_size, f"vision.{f}", i, f"must lie in [0, vocab_size={vocab_size})")
  _require(len(set(ids.values())) == 4, "vision media token ids", ids, "must be distinct")
  return v


def validate_train(tc: TrainConfig, cfg: ModelConfig) -> TrainConfig:
  for f in ("steps", "batch_size", "seq_len", "eval_every", "checkpoint_every", "log_every"):
    _require(getattr(tc, f) > 0, f, getattr(tc, f), "must be positive")
  _require(tc.seq_len <= cfg.max_seq_len, "seq_len", tc.seq_len,
           f"must not exceed the model's max_seq_len={cfg.max_seq_len}")
  _require(tc.optimizer in ("muon", "adamw"), "optimizer", tc.optimizer,
           "must be 'muon' (Per-Head Muon) or 'adamw'")
  _require(tc.muon_lr > 0, "muon_lr", tc.muon_lr, "must be positive")
  _require(tc.muon_placement in ("owned", "sharded"), "muon_placement", tc.muon_placement,
           "must be 'owned' (each Newton-Schulz block on one chip) or 'sharded'")
  _require(tc.qk_clip_tau >= 0, "qk_clip_tau", tc.qk_clip_tau, "must be >= 0 (0 disables)")
  _require(tc.init in INIT_MODES, "init", tc.init, f"must be one of {', '.join(INIT_MODES)}")
  _require(tc.learning_rate > 0, "learning_rate", tc.learning_rate, "must be positive")
  _require(0 <= tc.warmup_frac < 1, "warmup_frac", tc.warmup_frac, "must lie in [0, 1)")
  return tc


# generate (k3_jax/serve/loader.py Restored): one stream, nothing cached between requests
SINGLE_STREAM = ServeConfig(max_batch=1, prefix_cache_bytes=0)


# ----- overrides ----------------------------------------------------------

def _parse_value(raw: str, current: Any, name: str) -> Any:
  if isinstance(current, bool):
    if raw.lower() in ("1", "true", "yes", "on"):
      return True
    if raw.lower() in ("0", "false", "no", "off"):
      return False
    raise ConfigError(f"{name}={raw!r}: expected a boolean (true/false)")
  try:
    if isinstance(current, int):
      return int(raw)
    if isinstance(current, float):
      return float(raw)
    if isinstance(current, tuple):
      raw = raw.strip("()[] ")
      return tuple(int(x) for x in raw.split(",") if x.strip())
  except ValueError:
    raise ConfigError(f"{name}={raw!r}: expected a value of type {type(current).__name__}") from None
  return raw


def apply_overrides(obj: Any, overrides: list[str] | tuple[str, ...]) -> Any:
  """Applies `a.b=value` strings to a (nested) frozen dataclass; unknown fields are errors."""
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r}: expected the form field=value (e.g. kda.num_heads=4)")
    path, raw = item.split("=", 1)
    obj = _replace_path(obj, path.strip().split("."), raw.strip(), path.strip())
  return obj


def _replace_path(obj: Any, parts: list[str], raw: str, full: str) -> Any:
  names = {f.name for f in dataclasses.fields(obj)}
  if parts[0] not in names:
    raise ConfigError(
        f"override {full!r}: {type(obj).__name__} has no field {parts[0]!r}; "
        f"fields are: {', '.join(sorted(names))}")
  current = getattr(obj, parts[0])
  if len(parts) == 1:
    if dataclasses.is_dataclass(current):
      raise ConfigError(f"override {full!r}: {parts[0]!r} is a group; name one of its fields")
    return dataclasses.replace(obj, **{parts[0]: _parse_value(raw, current, full)})
  if current is None and parts[0] == "vision":
    raise ConfigError(f"override {full!r}: this model has no vision tower (vision is None); "
                      "vision fields apply to jobs with images, e.g. --dataset=shapes")
  if not dataclasses.is_dataclass(current):
    raise ConfigError(f"override {full!r}: {parts[0]!r} is not a group of fields")
  return dataclasses.replace(obj, **{parts[0]: _replace_path(current, parts[1:], raw, full)})


def to_dict(obj: Any) -> dict:
  return dataclasses.asdict(obj)


def without_execution_fields(d: dict) -> dict:
  """A config dict (`to_dict`, or an old model_config.json) without the MOVED_FIELDS an old
  one may hold: what identifies the model."""
  out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
  for path in MOVED_FIELDS:
    group, name = path.split(".")
    out.get(group, {}).pop(name, None)
  return out


def from_dict(d: dict) -> ModelConfig:
  """The ModelConfig of a `to_dict` dict; the execution settings an old one holds
  (MOVED_FIELDS) are dropped (execution.moved_from reads them)."""
  d = without_execution_fields(d)
  sub = {"kda": KDAConfig, "mla": MLAConfig, "moe": MoEConfig, "attn_res": AttnResConfig,
         "quant": QuantConfig, "vision": VisionConfig}
  kw = {}
  for k, v in d.items():
    if k == "vision" and v is None:
      kw[k] = None
    elif k in sub:
      kw[k] = sub[k](**v)
    elif isinstance(v, list):
      kw[k] = tuple(v)
    else:
      kw[k] = v
  return ModelConfig(**kw)


def jnp_dtype(name: str):
  import jax.numpy as jnp
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


__all__ = ["ConfigError", "KDAConfig", "MLAConfig", "MoEConfig", "AttnResConfig", "QuantConfig",
           "QAT_MODES", "KDA_BACKENDS", "GMM_KINDS", "MOVED_FIELDS", "ModelConfig",
           "VisionConfig", "validate_vision",
           "TrainConfig", "ServeConfig", "SINGLE_STREAM", "SERVE_PAGE", "option", "flag_fields",
           "MeshConfig", "validate", "validate_train", "apply_overrides",
           "to_dict", "without_execution_fields", "from_dict", "jnp_dtype"]
