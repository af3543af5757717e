"""tiny: the test config (seconds to compile and run on CPU).

Synthetic data (tiny preset), GEM tiny preset, 8 simulated CPU devices as a
2 x 4 (replica x shard) mesh.

  python scripts/train.py --config configs/tiny.py --workdir /tmp/tiny

Sizes (on its synthetic 'tiny' data, embedding dim 8): 228k dense parameters,
4.4k embedding parameters (3 tables); 2.8 MFLOPs forward, 8.3 MFLOPs training
FLOPs per example (analytic, gem_jax.flops; sequences at padded length).
Tiny exists to exercise every code path quickly, not to learn much.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)



def get_config():
  c = base.get_config()
  c.mesh = (2, -1)
  c.data.update(preset="tiny", batch_size=64, eval_batch_size=64, eval_examples=512)
  c.model.preset = "tiny"
  c.embedding.update(dim=8, memory_budget_gb=1.0)
  c.optim.update(lr=3e-3, warmup_steps=2)
  c.train.update(steps=6, log_every=1, eval_every=3, eval_batches=2, checkpoint_every=3)
  return c
