"""large: multi-node (N nodes x 8 GPUs), HSDP: replicas across nodes, FSDP inside a node.

  # on every node (SLURM / Open MPI / TPU runtimes are detected by JAX):
  GEM_JAX_DISTRIBUTED=auto python scripts/train.py --config configs/large.py --workdir /shared/runs/large

Mesh (-1, 8): one 'replica' per node, dense params and embedding tables split
over the 8 GPUs of a node ('shard'), batch over all GPUs. Model: GEM 'large'
preset (~1B dense params, FMB MLP 16384-8192-8192, 6 blocks), bf16, remat
'dots'. Data: point data.kind/train/eval at real logs (see docs/data.md); the
synthetic default only smoke-tests the job.
Sizes (synthetic 'small' features, embedding dim 256): 1.22B dense parameters,
1.6M embedding parameters (real vocabularies add far more); 2.9 GFLOPs forward,
8.6 GFLOPs training FLOPs per example (analytic, gem_jax.flops).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh = (-1, 8)

  c.data = ml_collections.ConfigDict()
  c.data.kind = "synthetic"
  c.data.preset = "small"
  c.data.train = ""
  c.data.eval = ""
  c.data.batch_size = 65536
  c.data.eval_batch_size = 65536
  c.data.eval_examples = 1_000_000
  c.data.shuffle_buffer = 0
  c.data.bad_row_limit = 0.01

  c.model = ml_collections.ConfigDict()
  c.model.name = "gem"
  c.model.preset = "large"
  c.model.overrides = ml_collections.ConfigDict()
  c.model.dtype = "bfloat16"
  c.model.fp8 = False
  c.model.remat = "dots"

  c.embedding = ml_collections.ConfigDict()
  c.embedding.dim = 256
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
  c.optim.lr = 5e-4
  c.optim.warmup_steps = 2000
  c.optim.decay = "cosine"
  c.optim.weight_decay = 1e-4
  c.optim.clip_norm = 1.0

  c.train = ml_collections.ConfigDict()
  c.train.steps = 200_000
  c.train.log_every = 100
  c.train.eval_every = 10_000
  c.train.eval_batches = 0
  c.train.checkpoint_every = 2000
  c.train.keep = 3
  c.train.best_metric = "eval_auc"
  c.train.grad_accum = 1
  c.train.profile_steps = ""
  c.train.compile_cache = ""
  return c
