"""avazu: GEM on Avazu mobile-ads CSV, two domains (site and app traffic).

Defaults read the shared 9k sample (`$GEM_JAX_DATA` or ../shared/data beside the
checkout): train on its train split, evaluate on its dev split. Eval metrics
are reported per domain (0 = site, 1 = app: site_id 85f751fd).

  python scripts/train.py --config configs/avazu.py --workdir runs/avazu
  python scripts/train.py --config configs/avazu.py --workdir runs/avazu_full \
    --config.data.train=/data/avazu/train_days_21-29.csv.gz \
    --config.data.eval=/data/avazu/train_day_30.csv.gz --config.data.vocab_size=2000000

See docs/data.md for the format and how to split the Kaggle file by day.
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
  c.data.kind = "avazu"
  c.data.train = os.path.join(DATA, "avazu_9k_train.csv")
  c.data.eval = os.path.join(DATA, "avazu_9k_dev.csv")
  c.data.batch_size = 256
  c.data.eval_batch_size = 256
  c.data.eval_examples = 0            # 0: the whole eval file
  c.data.shuffle_buffer = 4096
  c.data.bad_row_limit = 0.01
  c.data.vocab_size = 1 << 15         # hash buckets per categorical (table rows)

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
