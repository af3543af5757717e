"""large: multi-node (N nodes x 8 GPUs), HSDP: replicas across nodes, FSDP inside a node.

  # on every node (SLURM / Open MPI / TPU runtimes are detected by JAX):
  GEM_JAX_DISTRIBUTED=auto python scripts/train.py --config configs/large.py --workdir /shared/runs/large

Mesh (-1, 8): one 'replica' per node, dense params and embedding tables split
over the 8 GPUs of a node ('shard'), batch over all GPUs. Model: GEM 'large'
preset (~1B dense params, FMB MLP 16384-8192-8192, 6 blocks), bf16, remat
'dots'. Data: point data.kind/train/eval at real logs (see docs/data.md); the
synthetic default only smoke-tests the job.
Sizes (synthetic 'small' features, embedding dim 256): 1.22B dense parameters,
1.6M embedding parameters (real vocabularies add far more); 2.9 GFLOPs forward,
8.6 GFLOPs training FLOPs per example (analytic, gem_jax.flops).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)



def get_config():
  c = base.get_config()
  c.mesh = (-1, 8)
  c.data.update(preset="small", batch_size=65536, eval_batch_size=65536, eval_examples=1_000_000)
  c.model.update(preset="large", dtype="bfloat16", remat="dots")
  c.embedding.update(dim=256, memory_budget_gb=60.0)
  c.optim.update(lr=5e-4, warmup_steps=2000, weight_decay=1e-4)
  c.train.update(steps=200_000, log_every=100, eval_every=10_000, checkpoint_every=2000, keep=3)
  return c
