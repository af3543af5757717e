"""gem_xl: a GEM-class model for accelerators: ~23 training GFLOPs per example, long histories.

  python scripts/train.py --config configs/gem_xl.py --workdir runs/gem_xl
  python scripts/train.py --config configs/gem_xl.py --workdir runs/gem_xl --config.model.fp8=True

Sized where GEM-class models sit (Wukong's published configs train at 2.1, 22 and 108
GFLOPs per example; ../docs/model.md): GEM 'medium' widened to d_model 256, 4 blocks of
Wukong n_F = n_L = k = 96 with the FMB MLP 3 x 10240, and an InterFormer over one stream
of up to 2048 events (log-normal lengths, median 300, mean ~454), packed per batch shard
into rows of 2052 tokens (full attention; the pyramid halves the events per block).
bf16 compute with fp32 master weights, remat of the dots; --config.model.fp8=True runs
the large matmuls in fp8 (H100-class GPUs). Mesh 1 x -1: one GPU (batch 512), or a node
with the dense parameters and tables split over its GPUs (--config.data.batch_size=4096
for 8 GPUs). Data: data.kind 'long_history' (gem_jax/data/long_history_source.py); point
data.kind/train/eval at real logs for real work. On many nodes,
--config.train.grad_reduce_dtype=bfloat16 halves the gradient bytes between them, the term
that limits the projected step (docs/PERFORMANCE.md, "Scale projection").
Sizes (analytic, gem_jax.flops; the histories at their real lengths): 2.69B dense
parameters, 22.9 GFLOPs training FLOPs per example of useful work (43.6 at the padded
length 2048 that packing avoids; 7.6 forward useful, of which 5.5 in the Wukong stack).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)
from gem_jax.data.long_history_source import pack_rows  # noqa: E402

MAX_LEN, MEDIAN, SIGMA = 2048, 300.0, 1.0
NUM_CLS = 4          # GEMConfig.num_cls (the 'medium' preset keeps the default)
DEVICES = 1
BATCH = 512


def get_config():
  c = base.get_config()
  c.data.update(kind="long_history", max_len=MAX_LEN, median=MEDIAN, sigma=SIGMA,
                batch_size=BATCH, eval_batch_size=BATCH, eval_examples=50_000)
  c.model.update(preset="medium", dtype="bfloat16", remat="dots")
  c.model.overrides.update(d_model=256, num_blocks=4, pyramid=(1.0, 0.5, 0.25, 0.125),
                           wukong_nf=96, wukong_nl=96, wukong_k=96,
                           wukong_mlp=(10240, 10240, 10240), attn_mask="full", attn_impl="auto")
  # Packing as configs/long_seq_gpu.py: rows of max_len + num_cls tokens per batch shard.
  c.model.overrides.seq_pack_tokens = MAX_LEN + NUM_CLS
  c.model.overrides.seq_pack_rows = pack_rows(BATCH // DEVICES, MAX_LEN, MEDIAN, SIGMA, NUM_CLS)
  c.embedding.update(dim=64, id_policy="error", memory_budget_gb=40.0)
  c.optim.update(lr=5e-4, warmup_steps=1000, weight_decay=1e-4)
  c.train.update(steps=50_000, log_every=100, eval_every=5000, checkpoint_every=2000, keep=3)
  return c
