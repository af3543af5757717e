"""Models on the shared input contract: GEM, the DLRM / DCNv2 / LR / FM / FwFM baselines and the student."""
from gem_jax.models.config import GEMConfig, PRESETS, get_config, reference_spec
from gem_jax.models.dlrm import DCNv2, DLRM, load_torchrec_state
from gem_jax.models.fm import FM, FwFM
from gem_jax.models.gem import GEM
from gem_jax.models.inputs import random_inputs
from gem_jax.models.linear import LinearModel
from gem_jax.models.student import Student

MODELS = {"gem": GEM, "dlrm": DLRM, "dcnv2": DCNv2, "student": Student,
          "lr": LinearModel, "fm": FM, "fwfm": FwFM}

__all__ = ["GEMConfig", "PRESETS", "get_config", "reference_spec", "GEM", "DLRM", "DCNv2",
           "Student", "LinearModel", "FM", "FwFM", "load_torchrec_state", "random_inputs", "MODELS"]
