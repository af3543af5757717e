"""alimama: GEM on the Alimama display-ads DMR format (50-event behaviour histories).

The shared sample is one 500-row file, so by default train and eval read the
same file: a smoke test of the sequence path on real data, not a benchmark.
The default run is one pass (train.epochs=1: 500 rows = 8 steps of 64),
evaluated every 4 steps; the best checkpoint by eval log loss is kept and the
run stops early after 2 evaluations without a new best (`--config.train.steps=N`,
N > 0, sets the length instead: configs/base.py).
Domains are the two ad slots (pid). Point `data.train`/`data.eval` at the full
DMR `alimama_sampled.txt` splits for a real run:

  python scripts/train.py --config configs/alimama.py --workdir runs/alimama
  python scripts/train.py --config configs/alimama.py --workdir runs/alimama_full \
    --config.data.train=/data/dmr/alimama_train.txt --config.data.eval=/data/dmr/alimama_test.txt
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)



def get_config():
  c = base.get_config()
  c.mesh = (2, -1)
  c.data.update(kind="alimama", train=os.path.join(base.DATA, "alimama_display_dmr_500.csv"),
                eval=os.path.join(base.DATA, "alimama_display_dmr_500.csv"), batch_size=64,
                eval_batch_size=64, shuffle_buffer=500, vocab_size=1 << 15)
  c.optim.warmup_steps = 2
  c.train.update(steps=0, epochs=1.0, eval_every=4, checkpoint_every=4,
                 best_metric="eval_logloss", early_stop_patience=2)
  return c
