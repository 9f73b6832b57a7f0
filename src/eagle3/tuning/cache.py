"""Tuning results per device, kept in JSON files so a tuned shape is measured once.

An entry is found only under a key equal in every field: device, dtype, engine, target config, drafter
weights and eagle3 version. Any change means "measure again". A drafter folder's `tuning.json` travels with
the drafter; the user store (`$EAGLE3_CACHE/tuning.json`) holds the rest.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

logger = logging.getLogger("eagle3")

FORMAT = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
EDGE_BYTES = 1 << 20  # hash the first and last MiB of each weight file, not all of it
# config.json entries that tuning and checks write: they must not change the drafter's hash
UNHASHED_EXTRAS = ("acceptance_profile", "tuning")


def device_description(device: str) -> str:
    """'cuda:<GPU name>' or 'cpu:<CPU model>:<N> threads': what a tuning result was measured on."""
    import torch

    device = str(device)
    if device.startswith("cuda"):
        return "cuda:" + torch.cuda.get_device_name(torch.device(device).index)
    if device == "cpu":
        return f"cpu:{_cpu_model()}:{torch.get_num_threads()} threads"
    return device


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _short_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def drafter_sha256(drafter_dir: str | Path) -> str:
    """16 hex digits over the drafter's config.json (less the entries in UNHASHED_EXTRAS) and, per weight
    file sorted by name, its name, size and first and last MiB."""
    folder = Path(drafter_dir)
    digest = hashlib.sha256()
    config_path = folder / "config.json"
    if config_path.is_file():
        raw = config_path.read_bytes()
        try:
            config = json.loads(raw)
        except ValueError:
            digest.update(raw)
        else:
            extras = config.get("eagle3") if isinstance(config, dict) else None
            if isinstance(extras, dict):
                config["eagle3"] = {k: v for k, v in extras.items() if k not in UNHASHED_EXTRAS}
            digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    for path in weights:
        size = path.stat().st_size
        digest.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(EDGE_BYTES))
            f.seek(max(0, size - EDGE_BYTES))
            digest.update(f.read(EDGE_BYTES))
    return digest.hexdigest()[:16]


def tuning_key(device: str, dtype: str, engine: str, target: str, target_config: dict[str, Any],
               drafter_dir: str | Path | None) -> dict[str, Any]:
    """The key a tuning result is stored under; results measured under any other key do not apply."""
    import eagle3

    return {
        "device": device_description(device),
        "dtype": dtype,
        "engine": engine,
        "target": target,
        "target_sha256": _short_sha256(json.dumps(target_config, sort_keys=True, default=str).encode()),
        "drafter_sha256": None if drafter_dir is None else drafter_sha256(drafter_dir),
        "eagle3_version": eagle3.__version__,
    }


class TuningStore:
    """A JSON file `{"format": 1, "entries": [{"key": {...}, "measured_utc": ..., ...}]}`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _entries(self) -> list[dict[str, Any]] | None:
        """The stored entries; [] when there is no file; None (with a warning) when it is unreadable."""
        if not self.path.exists():
            return []
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            logger.warning("tuning cache %s is unreadable (%s); ignoring it", self.path, e)
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
            logger.warning("tuning cache %s is not format %d; ignoring it", self.path, FORMAT)
            return None
        return [e for e in data["entries"] if isinstance(e, dict)]

    def lookup(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The entry stored under exactly `key`, else None."""
        for entry in self._entries() or []:
            if entry.get("key") == key:
                return entry
        return None

    def store(self, entry: dict[str, Any]) -> None:
        """Add `entry` (it must hold a "key"), replacing any entry with an equal key; written atomically."""
        if not isinstance(entry.get("key"), dict):
            raise ValueError("a tuning entry needs a 'key' dict (see tuning_key)")
        entry = dict(entry)
        entry.setdefault("measured_utc", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
        kept = [e for e in self._entries() or [] if e.get("key") != entry["key"]]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "entries": [*kept, entry]}, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


def user_store() -> TuningStore:
    """`$EAGLE3_CACHE/tuning.json`, else `~/.cache/eagle3/tuning.json`."""
    from eagle3.models import cache_dir

    return TuningStore(cache_dir() / "tuning.json")


def drafter_store(drafter_dir: str | Path) -> TuningStore:
    """`<drafter_dir>/tuning.json`: results that travel with the drafter."""
    return TuningStore(Path(drafter_dir) / "tuning.json")


def find_tuning(key: dict[str, Any], drafter_dir: str | Path | None) -> dict[str, Any] | None:
    """The entry for `key` in the drafter folder's store, else in the user store; None when neither has it."""
    if drafter_dir is not None:
        entry = drafter_store(drafter_dir).lookup(key)
        if entry is not None:
            return entry
    return user_store().lookup(key)


def serving_choice(drafter_dir: str | Path) -> tuple[Any, dict[str, Any]] | None:
    """(DraftShape, entry) tuned for serving engines from the drafter folder's `tuning.json`: the newest GPU
    entry (vLLM and SGLang run on GPUs), else the newest of any device; its greedy choice. None without an
    entry, or when the entry found plain decoding faster."""
    from eagle3.config import DraftShape

    entries = drafter_store(drafter_dir)._entries() or []
    if not entries:
        return None
    gpu = [e for e in entries if str(e.get("key", {}).get("device", "")).startswith("cuda")]
    entry = max(gpu or entries, key=lambda e: e.get("measured_utc", ""))
    choices = entry.get("choices") or {}
    choice = choices.get("0.0") or entry.get("choice") or {}
    if not choice.get("shape"):
        return None
    return DraftShape.from_dict(choice["shape"]), entry


def engine_flags(shape) -> str:
    """vLLM's and SGLang's flags for draft shape `shape` (a chain's length; SGLang also takes trees; its draft
    token count includes the root, `python/sglang/srt/server_args.py` in sgl-project/sglang)."""
    return (f"vLLM: --speculative-config '{{\"method\": \"eagle3\", \"num_speculative_tokens\": {shape.depth}}}'; "
            f"SGLang: --speculative-num-steps {shape.depth} --speculative-eagle-topk {shape.top_k} "
            f"--speculative-num-draft-tokens {shape.total + 1}")
