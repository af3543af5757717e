"""long_seq: long user histories on CPU (data.kind 'long_history', a signal planted deep).

  python scripts/train.py --config configs/long_seq.py --workdir /tmp/long_seq

Data (gem_jax/data/long_history_source.py): per user a log-normal number of events
(median 300, sigma 1, clipped to max_len 1024: mean ~395, ~10 % of the users at 1024),
uniform items of 20k, a candidate item, and a click logit that is high when the
candidate occurs in the history; 35 % of the candidates come from an event older than
the newest 64. The run ends (final JSON line) with eval AUC next to `oracle_auc` (the
true logit, ~0.83), `short_oracle_auc` (the best a model of the newest 64 events can do,
~0.63) and `auc_gap_closed`. An eval AUC above short_oracle_auc means the model used
events older than the newest 64. This budget (200 steps of 32 users) is a smoke run
of the long-history path (generated data, 1k-event streams, chunked attention above
attn_dense_max, packing fields): GEM from its random init stays near AUC 0.5 here, far
from learning the match; the target-aware ranker of gem_jax/bench/long_history.py,
whose attention starts as the identity, shows the full-vs-short gap in 150 steps.

Model: GEM 'tiny' preset with d_model 32 and one InterFormer block; 8 simulated CPU
devices (scripts/train.py), global batch 32 = 4 histories per device. The padded path
runs every history at 1024 events; packed histories (model.overrides seq_pack_tokens /
seq_pack_rows, below) let a batch shard's ~1.6k events fill 3 rows of 1028 tokens
instead of 4 (a batch that does not fit steps padded, counted in pack_fallback_steps;
gem_jax/train/packing.py). Also as a converted dataset:

  python scripts/preprocess.py --config configs/long_seq.py --out /tmp/long_seq_data \
      --config.data.train_examples=16384 --row_group_rows=4096
  python scripts/train.py --config configs/long_seq.py --workdir /tmp/long_seq_pq \
      --config.data.train=/tmp/long_seq_data/train --config.data.eval=/tmp/long_seq_data/eval
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)
from gem_jax.data.long_history_source import pack_rows  # noqa: E402

MAX_LEN, MEDIAN, SIGMA = 1024, 300.0, 1.0
NUM_CLS = 4          # GEMConfig.num_cls (the 'tiny' preset keeps the default)
DEVICES = 8          # CPU devices scripts/train.py simulates
BATCH = 32


def get_config():
  c = base.get_config()
  c.data.update(kind="long_history", max_len=MAX_LEN, median=MEDIAN, sigma=SIGMA,
                vocab=20_000, batch_size=BATCH, eval_batch_size=64, eval_examples=2048)
  c.model.preset = "tiny"
  c.model.overrides.update(d_model=32, num_blocks=1)
  # Packing: rows of max_len + num_cls tokens; per batch shard (BATCH / DEVICES histories)
  # seq_pack_rows = max(2, ceil(1.6 * rows * (E[min(n, max_len)] + num_cls) / seq_pack_tokens))
  # with E[min(n, L)] of the log-normal lengths (long_history_source.expected_tokens).
  c.model.overrides.seq_pack_tokens = MAX_LEN + NUM_CLS
  c.model.overrides.seq_pack_rows = pack_rows(BATCH // DEVICES, MAX_LEN, MEDIAN, SIGMA, NUM_CLS)
  c.embedding.update(dim=16, id_policy="error", lr=1.0, memory_budget_gb=1.0)
  c.optim.update(lr=4e-3, warmup_steps=10)
  c.train.update(steps=200, log_every=25, eval_every=100, checkpoint_every=100)
  return c
