"""avazu: GEM on Avazu mobile-ads CSV, two domains (site and app traffic).

Defaults read the shared 9k sample (`$GEM_JAX_DATA` or ../shared/data beside the
checkout): train on its train split, evaluate on its dev split. Eval metrics
are reported per domain (0 = site, 1 = app: site_id 85f751fd). The default run
is one pass (train.epochs=1: 8,087 rows = 64 steps of 128), evaluated every 16
steps; the best checkpoint by eval log loss is kept and the run stops early
after 2 evaluations without a new best. The summary line reports the last and
the `best` eval. `--config.train.steps=N` (> 0) sets the length instead (the
rule: configs/base.py).

  python scripts/train.py --config configs/avazu.py --workdir runs/avazu
  python scripts/train.py --config configs/avazu.py --workdir runs/avazu_full \
    --config.data.train=/data/avazu/train_days_21-29.csv.gz \
    --config.data.eval=/data/avazu/train_day_30.csv.gz --config.data.vocab_size=2000000

See docs/data.md for the format and how to split the Kaggle file by day.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)



def get_config():
  c = base.get_config()
  c.mesh = (2, -1)
  c.data.update(kind="avazu", train=os.path.join(base.DATA, "avazu_9k_train.csv"),
                eval=os.path.join(base.DATA, "avazu_9k_dev.csv"), shuffle_buffer=4096,
                vocab_size=1 << 15)  # hash buckets per categorical (table rows)
  c.data.batch_size = 128
  c.optim.warmup_steps = 5
  c.train.update(steps=0, epochs=1.0, eval_every=16, checkpoint_every=16,
                 best_metric="eval_logloss", early_stop_patience=2)
  return c
