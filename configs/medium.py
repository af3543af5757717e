"""medium: one 8-GPU node (e.g. 8 x H100/H200), bf16 compute, FSDP over the node.

  python scripts/train.py --config configs/medium.py --workdir runs/medium

Mesh 1 x 8 (all 8 GPUs in one 'shard' group: dense params and tables split 8
ways). Data: synthetic 'small' (swap in criteo/avazu with
--config.data.kind=... and paths, see configs/criteo.py). Model: GEM 'medium'
preset (FMB MLP 3 x 4096, 4 InterFormer blocks), bf16 compute with fp32 master
weights; --config.model.fp8=True for the large matmuls on H100-class GPUs.
Sizes (synthetic 'small' features, embedding dim 128): 167M dense parameters,
0.8M embedding parameters (real data brings its own vocabularies: tables are
split row-wise over the 8 GPUs); 0.40 GFLOPs forward, 1.2 GFLOPs training
FLOPs per example (analytic, gem_jax.flops).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)



def get_config():
  c = base.get_config()
  c.data.update(preset="small", batch_size=8192, eval_batch_size=8192, eval_examples=200_000)
  c.model.update(preset="medium", dtype="bfloat16")
  c.embedding.update(dim=128, memory_budget_gb=60.0)
  c.optim.update(warmup_steps=1000, weight_decay=1e-4)
  c.train.update(steps=50_000, log_every=100, eval_every=5000, checkpoint_every=5000, keep=3)
  return c
