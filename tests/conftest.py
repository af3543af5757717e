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

# The real public samples (Criteo/Avazu heads, MovieLens, UCI adult, Alimama) are not part
# of the repository (their licences do not all allow redistribution). Tests that need them
# take the `real_data_dir` fixture: skipped with one reason when the folder is absent,
# an error instead when GEM_JAX_REQUIRE_DATA=1 (what .ci/run sets, since CI has them).
REAL_DATA = os.path.abspath(os.environ.get(
    "GEM_JAX_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")))
REAL_DATA_SKIP = (f"real public samples not found at {REAL_DATA} "
                  "(set GEM_JAX_DATA; README 'Tests' says how to get them)")


def make_mesh(replica: int, shard: int) -> jax.sharding.Mesh:
  """A ('replica', 'shard') mesh over the first replica*shard CPU devices."""
  return _make_mesh((replica, shard))


@pytest.fixture(scope="session")
def mesh8():
  """The full 1 x 8 mesh."""
  return make_mesh(1, 8)


def have_real_data() -> bool:
  return os.path.isdir(REAL_DATA)


@pytest.fixture(scope="session")
def real_data_dir():
  """$GEM_JAX_DATA (default ../shared/data beside the checkout): the real public samples."""
  if not have_real_data():
    if os.environ.get("GEM_JAX_REQUIRE_DATA") == "1":
      pytest.fail(f"GEM_JAX_REQUIRE_DATA=1 but {REAL_DATA_SKIP}")
    pytest.skip(REAL_DATA_SKIP)
  return REAL_DATA
