#!/usr/bin/env bash
# Create .venv-oracle: a separate virtual environment holding the `speculators` package (vLLM's drafter
# format library), used by tests/test_oracle.py as an independent check of eagle3's checkpoint format.
#
# It is kept apart from .venv because speculators pins its own torch/transformers ranges
# (torch<=2.14.1, transformers<=5.19) and pulls torchvision/torchaudio; none of that may leak into .venv.
#
# Usage:  bash scripts/setup_oracle_venv.sh            (idempotent: a working venv is left as it is)
#         ORACLE_VENV=/path/to/venv bash scripts/setup_oracle_venv.sh
#         ORACLE_TORCH="" bash scripts/setup_oracle_venv.sh   (let pip pick torch; a multi-GB CUDA build)
#
# By default torch is pinned to the CPU build (ORACLE_TORCH, default torch==2.13.0+cpu) when pip can find
# it (e.g. through a pip find-links index); the oracle runs on CPU only. If that build
# cannot be found, pip resolves torch as speculators asks (>=2.9,<=2.14.1), which is a CUDA build.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ORACLE_VENV:-$ROOT/.venv-oracle}"
SPECULATORS="${ORACLE_SPECULATORS:-speculators==0.9.0}"
TORCH="${ORACLE_TORCH-torch==2.13.0+cpu}"
PY="${PYTHON:-python3}"

# ready = it imports (a broken torchvision shows up here) and has the requested speculators version
probe='import speculators, torch, safetensors; from importlib.metadata import version; print(version("speculators"), torch.__version__)'
if [ -x "$VENV/bin/python" ] && found="$("$VENV/bin/python" -c "$probe" 2>/dev/null)"; then
    if [[ "$SPECULATORS" != speculators==* || "speculators==${found%% *}" == "$SPECULATORS" ]]; then
        echo "oracle venv ready: $VENV (speculators ${found%% *}, torch ${found#* })"
        exit 0
    fi
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet)

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
if [ -n "$TORCH" ] && "${PIP[@]}" "$TORCH"; then
    # keep that torch while resolving speculators (pip then picks the torchvision release built for it)
    "$VENV/bin/python" -c "from importlib.metadata import version; print(f'torch=={version(\"torch\")}')" > "$constraints"
    echo "oracle venv: using $(cat "$constraints")"
else
    echo "oracle venv: ${TORCH:-no torch pin given}; letting pip resolve torch for $SPECULATORS (large download)" >&2
fi
"${PIP[@]}" -c "$constraints" "$SPECULATORS"

# speculators lists torchvision/torchaudio but never imports them. PyPI's torchvision is a CUDA build: next
# to a CPU torch it fails to import ("operator torchvision::nms does not exist"), and transformers imports
# torchvision whenever it is installed, which breaks `import speculators`. Remove both in that case.
if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    echo "oracle venv: torchvision does not import with this torch; removing torchvision and torchaudio"
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio
fi

found="$("$VENV/bin/python" -c "$probe; from speculators.models.eagle3 import Eagle3DraftModel")"
echo "oracle venv ready: $VENV (speculators ${found%% *}, torch ${found#* })"
echo "oracle venv setup took $(( $(date +%s) - start )) s"
