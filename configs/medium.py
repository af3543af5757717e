"""medium: one 8-GPU node (e.g. 8 x H100/H200), bf16 compute, FSDP over the node.

  python scripts/train.py --config configs/medium.py --workdir runs/medium

Mesh 1 x 8 (all 8 GPUs in one 'shard' group: dense params and tables split 8
ways). Data: synthetic 'small' (swap in criteo/avazu with
--config.data.kind=... and paths, see configs/criteo.py). Model: GEM 'medium'
preset (FMB MLP 3 x 4096, 4 InterFormer blocks), bf16 compute with fp32 master
weights; --config.model.fp8=True for the large matmuls on H100-class GPUs.
Sizes (synthetic 'small' features, embedding dim 128): 167M dense parameters,
0.8M embedding parameters (real data brings its own vocabularies: tables are
split row-wise over the 8 GPUs); 0.40 GFLOPs forward, 1.2 GFLOPs training
FLOPs per example (analytic, gem_jax.flops).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh = (1, -1)

  c.data = ml_collections.ConfigDict()
  c.data.kind = "synthetic"
  c.data.preset = "small"
  c.data.train = ""
  c.data.eval = ""
  c.data.batch_size = 8192
  c.data.eval_batch_size = 8192
  c.data.eval_examples = 200_000
  c.data.shuffle_buffer = 0
  c.data.bad_row_limit = 0.01

  c.model = ml_collections.ConfigDict()
  c.model.name = "gem"
  c.model.preset = "medium"
  c.model.overrides = ml_collections.ConfigDict()
  c.model.dtype = "bfloat16"
  c.model.fp8 = False
  c.model.remat = "none"

  c.embedding = ml_collections.ConfigDict()
  c.embedding.dim = 128
  c.embedding.optimizer = "rowwise_adagrad"
  c.embedding.lr = 0.05
  c.embedding.warmup_steps = 0
  c.embedding.sharding = "auto"
  c.embedding.id_policy = "hash"
  c.embedding.memory_budget_gb = 60.0
  c.embedding.replica_sync = "auto"   # rows | dense | auto (fewer bytes)
  c.embedding.share_tables = True

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"
  c.optim.lr = 1e-3
  c.optim.warmup_steps = 1000
  c.optim.decay = "cosine"
  c.optim.weight_decay = 1e-4
  c.optim.clip_norm = 1.0

  c.train = ml_collections.ConfigDict()
  c.train.steps = 50_000
  c.train.log_every = 100
  c.train.eval_every = 5000
  c.train.eval_batches = 0
  c.train.checkpoint_every = 5000
  c.train.keep = 3
  c.train.best_metric = "eval_auc"
  c.train.grad_accum = 1
  c.train.profile_steps = ""
  c.train.compile_cache = ""
  return c
