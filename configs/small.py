"""small: the CPU demo. Learns the planted signal of the synthetic 'small' dataset.

  python scripts/train.py --config configs/small.py --workdir runs/small
  python scripts/evaluate.py --config configs/small.py --workdir runs/small

Runs on 2 CPU cores with 8 simulated devices as a 2 x 4 (replica x shard) mesh
in a few minutes, and ends with eval AUC, the oracle AUC of the data and the
share of the gap closed, (AUC - 0.5) / (oracle - 0.5).

Data: synthetic 'small' (8 pooled features incl. a 4-id bag, 2 event streams of
32 and 64 events, 3 domains, click + conversion). Model: GEM 'small' preset.
Sizes: 237k dense parameters, 100k embedding parameters (8 tables, dim 16);
4.6 MFLOPs forward, 13.8 MFLOPs training FLOPs per example (analytic,
gem_jax.flops; sequences at padded length).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh = (2, -1)

  c.data = ml_collections.ConfigDict()
  c.data.kind = "synthetic"
  c.data.preset = "small"
  c.data.train = ""
  c.data.eval = ""
  c.data.batch_size = 256
  c.data.eval_batch_size = 1024
  c.data.eval_examples = 20_000
  c.data.shuffle_buffer = 0
  c.data.bad_row_limit = 0.01

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
  c.embedding.lr = 0.2
  c.embedding.warmup_steps = 0
  c.embedding.sharding = "auto"
  c.embedding.id_policy = "hash"
  c.embedding.memory_budget_gb = 1.0
  c.embedding.share_tables = True

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"
  c.optim.lr = 2e-3
  c.optim.warmup_steps = 20
  c.optim.decay = "cosine"
  c.optim.weight_decay = 0.0
  c.optim.clip_norm = 1.0

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000
  c.train.log_every = 50
  c.train.eval_every = 250
  c.train.eval_batches = 0
  c.train.checkpoint_every = 250
  c.train.keep = 2
  c.train.best_metric = "eval_auc"
  c.train.grad_accum = 1
  c.train.profile_steps = ""
  c.train.compile_cache = ""
  return c
