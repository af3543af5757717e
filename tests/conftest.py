"""Shared test fixtures: an 8-device CPU platform and meshes carved out of it.

XLA_FLAGS must be set before jax is imported anywhere, so it happens here at
collection time. Smaller meshes are built from the first N of the 8 devices.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from gem_jax.parallel.mesh import make_mesh as _make_mesh  # noqa: E402

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def make_mesh(replica: int, shard: int) -> jax.sharding.Mesh:
  """A ('replica', 'shard') mesh over the first replica*shard CPU devices."""
  return _make_mesh((replica, shard))


@pytest.fixture(scope="session")
def mesh8():
  """The full 1 x 8 mesh."""
  return make_mesh(1, 8)


@pytest.fixture(scope="session")
def shared_data_dir():
  """`../shared/data` beside the checkout (or $GEM_JAX_DATA); skips nothing: fails if absent."""
  path = os.environ.get("GEM_JAX_DATA", SHARED_DATA)
  assert os.path.isdir(path), f"shared data folder not found: {path} (set GEM_JAX_DATA)"
  return os.path.abspath(path)
