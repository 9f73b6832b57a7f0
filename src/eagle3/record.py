"""Run records: every benchmark and evaluation writes one JSON beside its numbers (git SHA, versions, device,
argv), so a number can always be traced to the code and machine that produced it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _git_sha() -> str | None:
    """HEAD of the checkout this package runs from ("-dirty" with local changes); where the code runs from a copy
    without `.git` (a remote GPU machine), the SHA the caller exported as EAGLE3_GIT_SHA."""
    if os.environ.get("EAGLE3_GIT_SHA"):
        return os.environ["EAGLE3_GIT_SHA"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def run_record(kind: str, argv: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    import torch
    import transformers

    import eagle3

    return {
        "kind": kind,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_sha": _git_sha(),
        "argv": list(sys.argv if argv is None else argv),
        "versions": {"eagle3": eagle3.__version__, "python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "device": device_info(),
        **extra,
    }


def write_json(obj: Any, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
