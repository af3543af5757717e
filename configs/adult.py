"""adult: GEM on UCI adult as a two-task example (income > 50K, never married).

Defaults read the shared copies of adult.data (train) and adult.test (eval)
(`$GEM_JAX_DATA` or ../shared/data beside the checkout). Metrics are reported
per task; see gem_jax/data/adult.py for why `relationship` makes task 2 easy.

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
  c.train.update(steps=600, eval_every=200, checkpoint_every=200)
  return c
