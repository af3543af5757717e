"""adult: GEM on UCI adult as a two-task example (income > 50K, never married).

Defaults read the shared copies of adult.data (train) and adult.test (eval)
(`$GEM_JAX_DATA` or ../shared/data beside the checkout). Metrics are reported
per task; see gem_jax/data/adult.py for why `relationship` makes task 2 easy.
The default run is one pass (train.epochs=1: 32,561 rows = 128 steps of 256),
evaluated every 32 steps; the best checkpoint by eval log loss (the mean over
the two tasks) is kept and the run stops early after 2 evaluations without a
new best. `--config.train.steps=N` (> 0) sets the length instead (configs/base.py).

  python scripts/train.py --config configs/adult.py --workdir runs/adult
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)



def get_config():
  c = base.get_config()
  c.mesh = (2, -1)
  c.data.update(kind="adult", train=os.path.join(base.DATA, "uci_adult_train.csv"),
                eval=os.path.join(base.DATA, "uci_adult_test.csv"), shuffle_buffer=8192,
                vocab_size=1024)  # table rows per categorical (<= 42 values each)
  c.train.update(steps=0, epochs=1.0, eval_every=32, checkpoint_every=32,
                 best_metric="eval_logloss", early_stop_patience=2)
  return c
