"""For tests: every K3 component, three [KDA, KDA, KDA, MLA] blocks + a final MLA, tiny widths.

    python main.py train --config=k3_tiny --workdir=/tmp/tiny     # 4 steps by default
    python main.py generate --workdir=/tmp/tiny --prompt="def "
    python main.py serve --random_weights --config=k3_tiny --override=max_seq_len=2048
    python main.py compile --config=k3_tiny --topology=v5p-8 --step=decode   # its pod layout
"""

import dataclasses

from k3_jax.config import (AttnResConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig,
                           TrainConfig)
from k3_jax.execution import ExecConfig, PodLayout


def get_config() -> ModelConfig:
  return ModelConfig(
      name="k3_tiny",
      vocab_size=256,
      d_model=32,
      num_layers=13,
      mla_layers=(4, 8, 12, 13),
      dense_layers=(1,),
      dense_intermediate=64,
      activation="situ",
      max_seq_len=512,
      dtype="float32",
      param_dtype="float32",
      eos_id=0,
      kda=KDAConfig(num_heads=2, head_dim=8, conv_size=4, decay="lower_bound"),
      mla=MLAConfig(num_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8, output_gate=True),
      moe=MoEConfig(num_experts=8, top_k=2, num_shared_experts=1, expert_intermediate=16,
                    latent_dim=16, routed_scaling_factor=1.0),
      attn_res=AttnResConfig(enabled=True, block_size=4),
  )


def get_exec_config() -> ExecConfig:
  """KDA in chunks of 16 on every backend (the Pallas kernels too: the tests' short
  sequences span several chunks)."""
  return ExecConfig(kda_chunk_size=16)


def get_train_config() -> TrainConfig:
  return TrainConfig(steps=4, batch_size=4, seq_len=32, eval_every=2, eval_batches=1,
                     checkpoint_every=2, log_every=1)


def get_vision_config():
  """The vision tower attached by configs.get_multimodal (jobs that use images)."""
  from configs import vision
  return vision.tiny()


def get_pod_layouts() -> tuple[PodLayout, ...]:
  """The test of `compile`'s preset layouts: decode on v5p-8 (4 chips) as expert x fsdp."""
  run = dataclasses.replace(get_exec_config(), mesh="fsdp:2,expert:2")
  return (PodLayout(topology="v5p-8", step="decode", run=run, global_batch=8, seq_len=64),)
