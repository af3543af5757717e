"""movielens: GEM on MovieLens ratings turned into user sequences (like = rating >= 4).

Each rating is an example whose `history` stream holds the user's earlier
ratings (strictly earlier timestamps, most recent first). Train/eval is a time
split of the same ratings file at the `split_quantile` hour (or at
`split_timestamp`, unix seconds, when > 0). Defaults read the shared
ml-latest-small copy (`$GEM_JAX_DATA` or ../shared/data beside the checkout).
The default run is one pass over the train period (train.epochs=1: its 80,018
examples = 313 steps of 256; counting them reads the ratings once), evaluated
every 100 steps; the best checkpoint by eval log loss is kept and the run stops
early after 2 evaluations without a new best. `--config.train.steps=N` (> 0)
sets the length instead (configs/base.py).

  python scripts/train.py --config configs/movielens.py --workdir runs/movielens
  python scripts/train.py --config configs/movielens.py --workdir runs/ml25m \
    --config.data.train=/data/ml-25m/ratings.csv --config.data.eval=/data/ml-25m/ratings.csv \
    --config.data.movies=/data/ml-25m/movies.csv --config.data.split_timestamp=1514764800

The ratings must be grouped by user (as GroupLens ships them); see docs/data.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)



def get_config():
  c = base.get_config()
  c.mesh = (2, -1)
  ratings = os.path.join(base.DATA, "movielens_latest_small_2016_ratings.csv")
  c.data.update(kind="movielens", train=ratings, eval=ratings,  # a time split of one file
                movies=os.path.join(base.DATA, "movielens_latest_small_2016_movies.csv"),
                shuffle_buffer=8192, vocab_size=1 << 16)  # table rows for user / item ids
  c.train.update(steps=0, epochs=1.0, eval_every=100, checkpoint_every=100,
                 best_metric="eval_logloss", early_stop_patience=2)
  return c
