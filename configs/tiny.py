"""tiny: the test config (seconds to compile and run on CPU).

Synthetic data (tiny preset), GEM tiny preset, 8 simulated CPU devices as a
2 x 4 (replica x shard) mesh.

  python scripts/train.py --config configs/tiny.py --workdir /tmp/tiny

Sizes (on its synthetic 'tiny' data, embedding dim 8): 228k dense parameters,
4.4k embedding parameters (3 tables); 2.8 MFLOPs forward, 8.3 MFLOPs training
FLOPs per example (analytic, gem_jax.flops; sequences at padded length).
Tiny exists to exercise every code path quickly, not to learn much.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh = (2, -1)

  c.data = ml_collections.ConfigDict()
  c.data.kind = "synthetic"
  c.data.preset = "tiny"
  c.data.train = ""
  c.data.eval = ""
  c.data.batch_size = 64
  c.data.eval_batch_size = 64
  c.data.eval_examples = 512
  c.data.shuffle_buffer = 0
  c.data.bad_row_limit = 0.01

  c.model = ml_collections.ConfigDict()
  c.model.name = "gem"
  c.model.preset = "tiny"
  c.model.overrides = ml_collections.ConfigDict()
  c.model.dtype = "float32"
  c.model.fp8 = False
  c.model.remat = "none"

  c.embedding = ml_collections.ConfigDict()
  c.embedding.dim = 8
  c.embedding.optimizer = "rowwise_adagrad"
  c.embedding.lr = 0.05
  c.embedding.warmup_steps = 0
  c.embedding.sharding = "auto"
  c.embedding.id_policy = "hash"
  c.embedding.memory_budget_gb = 1.0
  c.embedding.replica_sync = "auto"   # rows | dense | auto (fewer bytes)
  c.embedding.share_tables = True

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 2
  c.optim.decay = "cosine"
  c.optim.weight_decay = 0.0
  c.optim.clip_norm = 1.0

  c.train = ml_collections.ConfigDict()
  c.train.steps = 6
  c.train.log_every = 1
  c.train.eval_every = 3
  c.train.eval_batches = 2
  c.train.checkpoint_every = 3
  c.train.keep = 2
  c.train.best_metric = "eval_auc"
  c.train.grad_accum = 1
  c.train.profile_steps = ""
  c.train.compile_cache = ""
  c.train.stop_at = 0        # stop (and checkpoint) at this step: simulates a preemption
  return c
