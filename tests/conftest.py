"""Shared test fixtures: an 8-device CPU platform and meshes carved out of it.

XLA_FLAGS must be set before jax is imported anywhere, so it happens here at
collection time. Smaller meshes are built from the first N of the 8 devices.

The tests' programs are tiny, so compiling them is most of the suite's time: they compile
with XLA:CPU's cheaper code generation (LLVM at -O0, the elemental emitters instead of the
fusion emitters), which halves a typical compile (the five-step optimizer test's step: 6.8
-> 2.0 s); the HLO passes, and so the programs' HLO, are XLA's own. A probe process checks
that this jaxlib knows the flags (else the suite runs with XLA's defaults). Benchmarks and
scripts keep XLA's defaults; GEM_JAX_TEST_XLA_DEFAULTS=1 runs the tests with them too.
"""
import os
import subprocess
import sys

_CHEAP_CODEGEN = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _cheap_codegen_flags() -> str:
  """The cheap code generation flags when this jaxlib accepts them (one probe per run: the
  answer travels to the xdist workers in the environment), else ''."""
  if os.environ.get("GEM_JAX_TEST_XLA_DEFAULTS") == "1":
    return ""
  if "GEM_JAX_TEST_CODEGEN" not in os.environ:
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                           env={**os.environ, "XLA_FLAGS": _CHEAP_CODEGEN, "JAX_PLATFORMS": "cpu"},
                           capture_output=True, timeout=300, check=False)
    os.environ["GEM_JAX_TEST_CODEGEN"] = _CHEAP_CODEGEN if probe.returncode == 0 else ""
  return os.environ["GEM_JAX_TEST_CODEGEN"]


_CODEGEN = _cheap_codegen_flags()
CHEAP_CODEGEN = bool(_CODEGEN)
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
     _CODEGEN]).strip()
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


# XLA's default code generation, for one compile (`compile_with_xla_defaults`), whatever the
# flags above: a test that compares two different programs bit for bit relies on how XLA
# orders their float operations by default (the cheap code generation can order one
# reduction of one program differently: 1 ulp).
XLA_DEFAULT_CODEGEN = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def compile_with_xla_defaults(jitted, *args):
  """`jitted` (a jax.jit function) compiled for `args` with XLA's default code generation."""
  return jitted.lower(*args).compile(compiler_options=XLA_DEFAULT_CODEGEN if CHEAP_CODEGEN
                                     else None)


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
