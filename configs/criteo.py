"""criteo: GEM on Criteo display-ads TSV (Kaggle DAC / 1TB format).

Defaults read the shared 8k sample (`$GEM_JAX_DATA` or ../shared/data beside the
checkout): train on its train split, evaluate on its dev split. The default run
is one pass (train.epochs=1: 7,200 rows = 57 steps of 128; more passes overfit
the hashed embeddings of this sample), evaluated every 19 steps; the best
checkpoint by eval log loss is kept and the run stops early after 2 evaluations
without a new best. The summary line reports the last and the `best` eval.
`--config.train.steps=N` (> 0) sets the length instead (the rule: configs/base.py).

  python scripts/train.py --config configs/criteo.py --workdir runs/criteo
  python scripts/train.py --config configs/criteo.py --workdir runs/criteo_full \
    --config.data.train='/data/criteo/day_[0-9].gz,/data/criteo/day_1[0-9].gz' \
    --config.data.eval=/data/criteo/day_23.gz \
    --config.data.vocab_size=10000000 --config.train.steps=100000

`data.train`/`data.eval` take files, comma-separated lists or globs (gzip or plain).
Baselines: --config.model.name=lr | fm | fwfm | dlrm | dcnv2. See docs/data.md for the format.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)



def get_config():
  c = base.get_config()
  c.mesh = (2, -1)
  c.data.update(kind="criteo", train=os.path.join(base.DATA, "criteo_kaggle_8k_train.tsv"),
                eval=os.path.join(base.DATA, "criteo_kaggle_8k_dev.tsv"), shuffle_buffer=4096,
                vocab_size=1 << 15)  # hash buckets per categorical (table rows)
  c.data.batch_size = 128
  c.optim.warmup_steps = 5
  c.train.update(steps=0, epochs=1.0, eval_every=19, checkpoint_every=19,
                 best_metric="eval_logloss", early_stop_patience=2)
  return c
