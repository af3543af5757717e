"""dlrm_peer: exactly the TorchRec peer's model and data (benchmarks/torchrec/bench.py).

  python scripts/benchmark.py --config dlrm_peer --devices 1 --peer torchrec
  python scripts/benchmark.py --config dcn_peer --devices 1 --peer torchrec   # DCNv2 variant
  python scripts/train.py --config configs/dlrm_peer.py --workdir /tmp/dlrm_peer

Model: DLRM, 8 tables x 100k rows x dim 64 (one table per feature, 1 id per
table, sum pooling, U(-1/sqrt(rows), 1/sqrt(rows)) init), bottom MLP
13-512-256-64 (ReLU after every layer), dot interaction (strict upper triangle),
top MLP 100-512-256-1, mean BCE. Optimizer: plain SGD lr 0.1 on tables (sparse,
duplicates summed) and dense parameters, no clipping, no schedule.
Data: gem_jax.bench.peer_data, which the peer imports too (Zipf 1.05 ids, permuted
ranks, lognormal dense, Bernoulli(0.25) labels), seeds as the peer's `--seed 0`, 32
batches cycled. Batch 4096, one CPU device (mesh 1 x 1). Precision: gem_jax's mixed
policy, bf16 matmuls with fp32 accumulation, fp32 master weights, fp32 tables and
optimizer; `--peer torchrec` runs the peer the same way (`--autocast bf16`: its dense
part under torch.autocast, fp32 tables, optimizer and loss). `--set
model.dtype="'float32'"` makes both sides fp32. The peer's venv: `bash
benchmarks/torchrec/setup.sh`. docs/PERFORMANCE.md has the figures and losses.
`--config.model.name=dcnv2` (or configs/dcn_peer.py) selects the DCNv2
interaction (3 low-rank cross layers, rank 512), as the peer's `--interaction dcn`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)



def get_config():
  import gem_jax.bench.peer  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  c = base.get_config()
  # data.kind registered by gem_jax.bench.peer; its fields' defaults are the peer's
  # (8 tables x 100k rows, 1 id per table, Zipf 1.05, seed 0, 32 batches)
  c.data.update(kind="torchrec_synthetic", batch_size=4096, eval_batch_size=4096,
                eval_examples=4096)
  # name 'dcnv2' for the --interaction dcn peer; preset d_model 64, bottom (512, 256),
  # top (512, 256); bf16 compute, parameters stay fp32
  c.model.update(name="dlrm", preset="dlrm_torchrec", dtype="bfloat16")
  c.model.overrides.update(dcn_layers=3, dcn_rank=512)
  # the peer's ids are already row ids in range ('error'); one table per feature
  c.embedding.update(dim=64, optimizer="sgd", lr=0.1, id_policy="error", memory_budget_gb=8.0,
                     share_tables=False)
  c.optim.update(name="sgd", lr=0.1, warmup_steps=0, decay="constant", clip_norm=0.0)
  c.train.update(steps=100, log_every=20, eval_batches=1, checkpoint_every=0, keep=1)
  return c
