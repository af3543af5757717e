#!/usr/bin/env bash
# Builds (or repairs) the CPU-only TorchRec venv that benchmarks/torchrec/bench.py runs in.
#
#   bash benchmarks/torchrec/setup.sh [VENV]     # default ~/.cache/gem_jax/torchrec-venv
#   GEM_JAX_TORCHREC_PYTHON=VENV/bin/python      # tells gem_jax where a non-default venv is
#
# Idempotent: on a healthy venv it installs nothing and only reruns the smoke test.
# Pins (FBGEMM <-> torch pairs: 1.8 <-> 2.13, 1.9 <-> 2.14):
#   torch 2.13.0 (CPU build), fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0.
# torchrec declares `Requires-Dist: fbgemm-gpu` (the CUDA build), which unpacks into the
# same fbgemm_gpu/ folder as fbgemm-gpu-cpu and replaces its .so files with ones that need
# libtorch_cuda.so; so torchrec goes in with --no-deps and its other requirements are pinned.
set -euo pipefail

VENV="${1:-${HOME}/.cache/gem_jax/torchrec-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
FBGEMM_VERSION="1.8.0"
TORCHREC_VERSION="1.8.0"
REQS=(  # torchrec 1.8.0's requirements other than fbgemm-gpu
  "numpy==2.4.6" "tensordict==0.15.3" "torchmetrics==1.0.3" "tqdm==4.70.1"
  "pyre-extensions==0.0.32"
)

say() { echo "[benchmarks/torchrec/setup] $*" >&2; }

[ -x "$VENV/bin/python" ] || { say "new venv $VENV ($("$PYTHON" --version 2>&1))";
                              mkdir -p "$(dirname "$VENV")"; "$PYTHON" -m venv "$VENV"; }
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

version_of() {  # version_of DIST -> its installed version, or nothing
  "$PY" -c 'import sys, importlib.metadata as m
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}

# 1. torch, the CPU build (pip's find-links or TORCH_INDEX_URL; a CUDA build is refused).
if [[ "$(version_of torch)" != "${TORCH_VERSION}"* ]]; then
  extra=()
  [ -n "${TORCH_INDEX_URL:-}" ] && extra=(--extra-index-url "$TORCH_INDEX_URL")
  say "installing torch==${TORCH_VERSION}"
  "${PIP[@]}" install "${extra[@]}" "torch==${TORCH_VERSION}"
fi
if [ "$("$PY" -c 'import torch; print(torch.version.cuda is None)')" != "True" ]; then
  say "error: torch $(version_of torch) in $VENV is a CUDA build; remove the venv and rerun" \
      "with TORCH_INDEX_URL pointing at a PyTorch CPU index"
  exit 1
fi

# 2. fbgemm-gpu-cpu; the CUDA fbgemm-gpu, if anything installed it, goes first.
if [ -n "$(version_of fbgemm-gpu)" ]; then
  say "removing fbgemm-gpu (CUDA build; it overwrites fbgemm-gpu-cpu's kernels)"
  "${PIP[@]}" uninstall -y fbgemm-gpu fbgemm-gpu-cpu
fi
if [ "$(version_of fbgemm-gpu-cpu)" != "$FBGEMM_VERSION" ] \
    || ! "$PY" -c 'import fbgemm_gpu' >/dev/null 2>&1; then
  say "installing fbgemm-gpu-cpu==${FBGEMM_VERSION}"
  "${PIP[@]}" install --force-reinstall --no-deps "fbgemm-gpu-cpu==${FBGEMM_VERSION}"
fi

# 3. torchrec without its fbgemm-gpu requirement, then the rest of its requirements.
if [ "$(version_of torchrec)" != "$TORCHREC_VERSION" ]; then
  say "installing torchrec==${TORCHREC_VERSION} (--no-deps)"
  "${PIP[@]}" install --no-deps "torchrec==${TORCHREC_VERSION}"
fi
missing=()
for r in "${REQS[@]}"; do
  [ "$(version_of "${r%%==*}")" == "${r##*==}" ] || missing+=("$r")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  "${PIP[@]}" install "${missing[@]}"
fi
[ -z "$(version_of fbgemm-gpu)" ] || { say "error: fbgemm-gpu (CUDA) came back"; exit 1; }

# 4. Smoke test: plain and fused (FBGEMM TBE, CPU) embedding bags, forward + backward,
#    then two steps of bench.py itself.
"$PY" - <<'PYEOF'
import warnings
warnings.filterwarnings("ignore")
import torch, torchrec
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=10,
                             feature_names=[f"f{i}"]) for i in range(2)]
kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([0, 3, 9, 1, 2]),
                        lengths=torch.tensor([1, 1, 2, 1]))
plain = EmbeddingBagCollection(tables=tables)
plain(kjt).values().sum().backward()
assert plain.embedding_bags["t1"].weight.grad is not None
fused = FusedEmbeddingBagCollection(tables=tables, optimizer_type=torch.optim.SGD,
                                    optimizer_kwargs={"lr": 1.0}, device=torch.device("cpu"))
w = fused.embedding_bags["t0"].weight.detach().clone()
out = fused(kjt).values()
assert out.shape == (2, 8), out.shape
out.sum().backward()
assert not torch.equal(w, fused.embedding_bags["t0"].weight.detach()), "fused SGD did nothing"
print(f"torch {torch.__version__}, torchrec {torchrec.__version__}: EBC and fused EBC work")
PYEOF
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$HERE/bench.py" ]; then
  "$PY" "$HERE/bench.py" --steps 2 --warmup 1 --batch-size 64 --rows 1000 --num-tables 2 \
    --bottom-mlp 16 --top-mlp 16 --batch-pool 2 >/dev/null
  say "bench.py runs"
fi
say "OK: $PY (set GEM_JAX_TORCHREC_PYTHON to it if $VENV is not the default)"
