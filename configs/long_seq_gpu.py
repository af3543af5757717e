"""long_seq_gpu: long user histories on one GPU (one H200): GEM-like widths, 8192 events.

  python scripts/train.py --config configs/long_seq_gpu.py --workdir runs/long_seq_gpu

For one GPU (mesh 1 x 1; it does not fit the CPU). Data: data.kind 'long_history'
(gem_jax/data/long_history_source.py) with the generator's defaults (median 300,
sigma 1, 100k items) and histories of up to 8192 events (mean ~490: padded, 94 % of
each history's tokens are padding; packed, seq_pack_rows rows of 8196 tokens per
batch). Model: GEM 'medium' preset at d_model 256, full attention (the mask packing
supports), bf16 compute, attn_impl 'auto' (cuDNN / chunked above attn_dense_max keys),
remat of the dots. Global batch 512. Generating 512 x 8192-event rows costs the host
a fraction of a second per batch; convert them once instead
(scripts/preprocess.py --config configs/long_seq_gpu.py --out DIR
--config.data.train_examples=N --row_group_rows=2048) and train on DIR/train, DIR/eval.
The run ends with eval AUC, `oracle_auc`, `short_oracle_auc` (newest 64 events only)
and `auc_gap_closed`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)
from gem_jax.data.long_history_source import pack_rows  # noqa: E402

MAX_LEN, MEDIAN, SIGMA = 8192, 300.0, 1.0
NUM_CLS = 4          # GEMConfig.num_cls (the 'medium' preset keeps the default)
DEVICES = 1
BATCH = 512


def get_config():
  c = base.get_config()
  c.data.update(kind="long_history", max_len=MAX_LEN, median=MEDIAN, sigma=SIGMA,
                batch_size=BATCH, eval_batch_size=BATCH, eval_examples=50_000)
  c.model.update(preset="medium", dtype="bfloat16", remat="dots")
  c.model.overrides.update(d_model=256, attn_mask="full", attn_impl="auto")
  # Packing: rows of max_len + num_cls tokens; per batch shard (BATCH / DEVICES histories)
  # seq_pack_rows = max(2, ceil(1.6 * rows * (E[min(n, max_len)] + num_cls) / seq_pack_tokens))
  # with E[min(n, L)] of the log-normal lengths (long_history_source.expected_tokens).
  c.model.overrides.seq_pack_tokens = MAX_LEN + NUM_CLS
  c.model.overrides.seq_pack_rows = pack_rows(BATCH // DEVICES, MAX_LEN, MEDIAN, SIGMA, NUM_CLS)
  c.embedding.update(dim=64, id_policy="error", memory_budget_gb=40.0)
  c.optim.update(warmup_steps=500, weight_decay=1e-4)
  c.train.update(steps=20_000, log_every=100, eval_every=2000, checkpoint_every=2000, keep=3)
  return c
