"""Checkpoints of `eagle3 train`: atomic writes, finding the newest one, RNG state, and the log a resume rewrites.

A checkpoint is built in a hidden temporary directory, fsync'ed and renamed into place; older ones are removed
only after that, so a crash at any point leaves the previous complete checkpoint:

    checkpoints/step_XXXXXXXX/   drafter/ (speculators format), training_state.pt (exact fp32 drafter weights,
                                 optimizer, scheduler, data position, config), rng_rank{r}.pt
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from eagle3.drafter import Eagle3Drafter
from eagle3.training.distributed import Dist

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "training_state.pt"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def latest_checkpoint(out_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under out_dir/checkpoints (complete = renamed into place), or None."""
    root = Path(out_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return None
    found = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).exists())
    return found[-1] if found else None


def fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [path, *sorted(q for q in path.rglob("*") if q.is_dir())]:
        fsync_dir(d)


def fsync_dir(path: Path) -> None:
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ctx: Dist, out: Path, step: int, drafter: Eagle3Drafter, state: dict[str, Any],
                     keep: int) -> Path:
    from eagle3.formats import save_drafter

    root = out / CHECKPOINT_DIR
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if ctx.main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    ctx.barrier()
    torch.save(rng_state(), tmp / f"rng_rank{ctx.rank}.pt")
    ctx.barrier()
    if ctx.main:
        save_drafter(drafter, tmp / "drafter", format="speculators")
        torch.save(state, tmp / STATE_FILE)
        fsync_tree(tmp)
        if final.exists():  # the same step saved again (e.g. the end of a resumed run)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
        done = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    ctx.barrier()
    return final


def truncate_log(path: Path, step: int) -> None:
    """Keep only log records up to `step` (a resumed run rewrites what came after its checkpoint)."""
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        return
    keep = []
    for line in path.read_text().splitlines():
        if line.strip() and json.loads(line).get("step", 0) <= step:
            keep.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, path)
