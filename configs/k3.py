"""Kimi K3, full size (docs/architecture.md section 1): 2.78T total, 104.2B activated
parameters (the vision tower adds 447.4M).

Never instantiated on a CPU; `main.py info` and ahead-of-time compilation use it abstractly:

    python main.py info --config=k3                      # layer plan, parameter counts
    python main.py info --config=k3 --serving_bytes      # bytes served with MXFP4 experts
    python main.py compile --config=k3 --topology=v5p-4096              # train step, 2048 chips
    python main.py compile --config=k3 --topology=v5p-128 --step=prefill  # one 1M-token prompt
    python main.py compile --config=k3 --topology=v5p-128 --step=decode   # 8 x 1M-token caches
    python main.py convert --config=k3 --dry_run         # the release's tensors and shards

The compile commands take the pod layouts below for every flag not given (docs/pod-scale.md).
"""

import dataclasses

from k3_jax.config import (AttnResConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig,
                           TrainConfig)
from k3_jax.execution import ExecConfig, PodLayout


def get_config() -> ModelConfig:
  return ModelConfig(
      name="k3",
      vocab_size=163_840,
      d_model=7168,
      num_layers=93,
      mla_layers=tuple(range(4, 93, 4)) + (93,),
      dense_layers=(1,),
      dense_intermediate=33_792,
      activation="situ",
      max_seq_len=1_048_576,
      dtype="bfloat16",
      param_dtype="bfloat16",
      bos_id=163_584, eos_id=163_586, pad_id=163_839,
      kda=KDAConfig(num_heads=96, head_dim=128, conv_size=4, decay="lower_bound", g_min=-5.0,
                    gate_rank=0, decay_rank=0),
      mla=MLAConfig(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, output_gate=True),
      moe=MoEConfig(num_experts=896, top_k=16, num_shared_experts=2, expert_intermediate=3072,
                    latent_dim=3584, routed_scaling_factor=1.0,
                    # docs/architecture.md section 5: at scale the quantiles come from a pooled
                    # histogram (~1000 bins); the exact ones would gather every token's
                    # [896] router margins (f32) onto each chip.
                    qb_bins=1000),
      attn_res=AttnResConfig(enabled=True, block_size=12),
  )


def get_exec_config() -> ExecConfig:
  """KDA in chunks of 64 (the TPU kernels' tile) on every backend."""
  return ExecConfig(kda_chunk_size=64)


def get_train_config() -> TrainConfig:
  """K3 trains with Per-Head Muon + QK-Clip (docs/architecture.md section 6)."""
  return TrainConfig(optimizer="muon")


def get_vision_config():
  """The vision tower attached by configs.get_multimodal (jobs that use images)."""
  from configs import vision
  return vision.k3()


def get_pod_layouts():
  """The recommended layouts of k3's steps on v5p pods, applied by `main.py compile` where a
  flag is not given (docs/pod-scale.md has the measured per-chip memory)."""
  run = lambda **kw: dataclasses.replace(get_exec_config(), **kw)
  return (
      # 2048 chips, 512 x 8192 tokens, 2048 per chip: the batch over fsdp x expert (one
      # sequence per group), each sequence split 4 ways (KDA / MLA context parallelism); the
      # routed experts over expert x fsdp x sequence, the rest ZeRO-3 over fsdp x expert.
      # 68.9 GiB per chip with owned Newton-Schulz (79.8 before; docs/pod-scale.md). The
      # same tokens per chip with sequence:2,tensor:2 needed 97.0 GiB: tensor:2 splits heads
      # and FFN units, but every
      # chip of a tensor pair holds the pair's whole residual stream (4096 tokens).
      PodLayout(topology="v5p-4096", step="train",
                run=run(mesh="fsdp:16,expert:32,sequence:4", remat="block", grad_accum=1,
                        ep_capacity=1.25),
                global_batch=512, seq_len=8192),
      # 2 slices (4096 chips, the data axis over DCN): the same 512 x 8192 a step, 1024
      # tokens per chip, each sequence split 8 ways. The one-slice mesh per slice at
      # 1024 x 8192 (2048 per chip) needs 100.5 GiB: over slices the compiler peels a
      # scanned unit out of its loops, 1.5x the layers' buffers (docs/pod-scale.md).
      PodLayout(topology="2*v5p-4096", step="train",
                run=run(mesh="data:2,fsdp:8,expert:32,sequence:8", remat="block",
                        grad_accum=1, ep_capacity=1.25),
                global_batch=512, seq_len=8192),
      # 4 slices (8192 chips): the 2-slice layout with the data axis twice as long, 1024 x
      # 8192 a step, the same 1024 tokens per chip: 62.84 GiB per chip (docs/pod-scale.md).
      PodLayout(topology="4*v5p-4096", step="train",
                run=run(mesh="data:4,fsdp:8,expert:32,sequence:8", remat="block",
                        grad_accum=1, ep_capacity=1.25),
                global_batch=1024, seq_len=8192),
      # 64 chips, 8 sequences decoding against 1M-token caches: experts (MXFP4) and dense
      # weights over the 64 chips; the batch of 8 cannot fill the expert axis, so the MLA
      # latent caches are split over their length instead (rules "cache_seq").
      PodLayout(topology="v5p-128", step="decode", run=run(mesh="expert:64"), global_batch=8,
                cache_len=1_048_576, expert_format="mxfp4"),
      # 64 chips, one 1M-token prompt: its tokens split over the 64 chips (rules "seq" takes
      # the expert axis the batch of one leaves): KDA context-parallel, MLA blockwise over
      # the gathered latent cache, experts (MXFP4) exchanging tokens over the same axis,
      # buffers bounded at 2x the balanced load.
      PodLayout(topology="v5p-128", step="prefill", run=run(mesh="expert:64", ep_capacity=2.0),
                global_batch=1, seq_len=1_048_576, cache_len=1_048_576, expert_format="mxfp4"),
  )
