"""criteo: GEM on Criteo display-ads TSV (Kaggle DAC / 1TB format).

Defaults read the shared 8k sample (`$GEM_JAX_DATA` or ../shared/data beside the
checkout): train on its train split, evaluate on its dev split.

  python scripts/train.py --config configs/criteo.py --workdir runs/criteo
  python scripts/train.py --config configs/criteo.py --workdir runs/criteo_full \
    --config.data.train='/data/criteo/day_[0-9].gz,/data/criteo/day_1[0-9].gz' \
    --config.data.eval=/data/criteo/day_23.gz \
    --config.data.vocab_size=10000000 --config.train.steps=100000

`data.train`/`data.eval` take files, comma-separated lists or globs (gzip or plain).
Baselines: --config.model.name=dlrm | dcnv2. See docs/data.md for the format.
"""
import os

import ml_collections

DATA = os.environ.get("GEM_JAX_DATA", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "..", "..", "shared", "data"))


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh = (2, -1)

  c.data = ml_collections.ConfigDict()
  c.data.kind = "criteo"
  c.data.train = os.path.join(DATA, "criteo_kaggle_8k_train.tsv")
  c.data.eval = os.path.join(DATA, "criteo_kaggle_8k_dev.tsv")
  c.data.batch_size = 256
  c.data.eval_batch_size = 256
  c.data.eval_examples = 0            # 0: the whole eval file
  c.data.shuffle_buffer = 4096
  c.data.bad_row_limit = 0.01
  c.data.vocab_size = 1 << 15         # hash buckets per categorical (table rows)
  c.data.int_buckets = False          # also embed the bucketised integer features

  c.model = ml_collections.ConfigDict()
  c.model.name = "gem"
  c.model.preset = "small"
  c.model.overrides = ml_collections.ConfigDict()
  c.model.dtype = "float32"
  c.model.fp8 = False
  c.model.remat = "none"

  c.embedding = ml_collections.ConfigDict()
  c.embedding.dim = 16
  c.embedding.optimizer = "rowwise_adagrad"
  c.embedding.lr = 0.05
  c.embedding.warmup_steps = 0
  c.embedding.sharding = "auto"
  c.embedding.id_policy = "hash"
  c.embedding.memory_budget_gb = 4.0
  c.embedding.share_tables = True

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"
  c.optim.lr = 1e-3
  c.optim.warmup_steps = 20
  c.optim.decay = "cosine"
  c.optim.weight_decay = 0.0
  c.optim.clip_norm = 1.0

  c.train = ml_collections.ConfigDict()
  c.train.steps = 300
  c.train.log_every = 25
  c.train.eval_every = 100
  c.train.eval_batches = 0            # 0: a full pass over data.eval
  c.train.checkpoint_every = 100
  c.train.keep = 2
  c.train.best_metric = "eval_auc"
  c.train.grad_accum = 1
  c.train.profile_steps = ""
  c.train.compile_cache = ""
  return c
