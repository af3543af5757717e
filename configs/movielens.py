"""movielens: GEM on MovieLens ratings turned into user sequences (like = rating >= 4).

Each rating is an example whose `history` stream holds the user's earlier
ratings (strictly earlier timestamps, most recent first). Train/eval is a time
split of the same ratings file at the `split_quantile` hour (or at
`split_timestamp`, unix seconds, when > 0). Defaults read the shared
ml-latest-small copy (`$GEM_JAX_DATA` or ../shared/data beside the checkout).

  python scripts/train.py --config configs/movielens.py --workdir runs/movielens
  python scripts/train.py --config configs/movielens.py --workdir runs/ml25m \
    --config.data.train=/data/ml-25m/ratings.csv --config.data.eval=/data/ml-25m/ratings.csv \
    --config.data.movies=/data/ml-25m/movies.csv --config.data.split_timestamp=1514764800

The ratings must be grouped by user (as GroupLens ships them); see docs/data.md.
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
  c.data.kind = "movielens"
  c.data.train = os.path.join(DATA, "movielens_latest_small_2016_ratings.csv")
  c.data.eval = os.path.join(DATA, "movielens_latest_small_2016_ratings.csv")
  c.data.movies = os.path.join(DATA, "movielens_latest_small_2016_movies.csv")
  c.data.split_quantile = 0.8         # the last 20% of the ratings (by time) are eval
  c.data.split_timestamp = 0          # > 0: split at this unix time instead
  c.data.max_len = 50                 # history events kept (most recent)
  c.data.max_genres = 10
  c.data.like_threshold = 4.0
  c.data.batch_size = 256
  c.data.eval_batch_size = 256
  c.data.eval_examples = 0            # 0: the whole eval split
  c.data.shuffle_buffer = 8192
  c.data.bad_row_limit = 0.01
  c.data.vocab_size = 1 << 16         # table rows for user / item ids

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
  c.train.steps = 1000
  c.train.log_every = 25
  c.train.eval_every = 250
  c.train.eval_batches = 0            # 0: a full pass over data.eval
  c.train.checkpoint_every = 250
  c.train.keep = 2
  c.train.best_metric = "eval_auc"
  c.train.grad_accum = 1
  c.train.profile_steps = ""
  c.train.compile_cache = ""
  return c
