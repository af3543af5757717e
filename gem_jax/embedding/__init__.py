"""Sharded embedding engine: tables over the ('replica', 'shard') mesh, exchanges, sparse optimizers.

See docs/embedding.md for an example and the exchange algorithms.
"""
from gem_jax.embedding import managed, ragged
from gem_jax.embedding.config import (FeatureConfig, SparseOptimizerConfig, TableConfig,
                                      expected_collision_rate, normal_init, uniform_init)
from gem_jax.embedding.exchange import gather_rows, lookup, pool_rows, valid_mask
from gem_jax.embedding.ids import (apply_id_policy, hash_ids, id_collisions, prepare_ids,
                                   table_collisions)
from gem_jax.embedding.plan import EmbeddingPlan, check_mesh, plan_embeddings
from gem_jax.embedding.state import export_state, import_state, init_embedding_state
from gem_jax.embedding.stats import IdStats, id_stats
from gem_jax.embedding.update import apply_sparse_updates

__all__ = [
    "TableConfig", "FeatureConfig", "SparseOptimizerConfig", "uniform_init", "normal_init",
    "plan_embeddings", "EmbeddingPlan", "init_embedding_state", "prepare_ids", "hash_ids",
    "apply_id_policy", "gather_rows", "pool_rows", "lookup", "valid_mask",
    "apply_sparse_updates", "export_state", "import_state", "id_collisions",
    "table_collisions", "expected_collision_rate", "check_mesh", "id_stats", "IdStats",
    "managed", "ragged",
]
