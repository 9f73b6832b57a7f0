"""Draft vocabulary: which target tokens the drafter's `lm_head` can emit, chosen by training-token frequency.

`token_freq` counts target token ids where `loss_mask == 1` (assistant tokens), int64 [V].
`build_vocab_mapping` keeps the `Vd` most frequent ids, sorted ascending, and returns the two buffers every
EAGLE-3 checkpoint carries:

    d2t  int64 [Vd]  offsets: target_id = draft_id + d2t[draft_id]
    t2d  bool  [V]   True where the target id is in the draft vocabulary

Example, V = 6, Vd = 3, freq = [0, 5, 0, 9, 5, 1]: ids by (-freq, id) are 3, 1, 4, 5, ...; keep {1, 3, 4};
d2t = [1, 3, 4] - [0, 1, 2] = [1, 2, 2]; t2d = [F, T, F, T, T, F].
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.config import ConfigError

TOKEN_FREQ_KEY = "token_freq"


def build_vocab_mapping(freq: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) from token counts `freq` [V].

    Top-Vd ids by count, ties broken by the lower id (vllm-project/speculators `src/speculators/train/
    vocab_mapping.py` sorts by `(-freq, tid)`). With fewer than Vd distinct counted tokens the rest is filled with
    the lowest unused ids, as speculators (ids `0..`) and SpecForge (`process_token_dict_to_mappings`, missing
    ids at count 0) do: a stable sort of all V ids by count gives exactly that order.
    """
    if freq.dim() != 1:
        raise ConfigError(f"token frequencies must be a 1-D [V] tensor, got shape {tuple(freq.shape)}")
    vocab_size = freq.numel()
    if draft_vocab_size <= 0:
        raise ConfigError(f"draft_vocab_size={draft_vocab_size} must be positive")
    if draft_vocab_size > vocab_size:
        raise ConfigError(
            f"draft_vocab_size={draft_vocab_size} is larger than the target vocabulary ({vocab_size} tokens); "
            f"choose draft_vocab_size <= {vocab_size} (equal means no reduction)"
        )
    order = torch.sort(-freq.to(torch.int64), stable=True).indices  # [V] ids by count desc, then id asc
    chosen = order[:draft_vocab_size].sort().values  # [Vd] ascending target ids
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)  # [Vd] offsets
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[chosen] = True
    return d2t, t2d


def draft_ids_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """The ascending target ids of the draft vocabulary, [Vd]."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ConfigError unless d2t (offsets) and t2d (mask) describe the same strictly ascending id set."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ConfigError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    ids = draft_ids_to_target(d2t)
    if ids.numel() != int(t2d.sum()):
        raise ConfigError(f"d2t has {ids.numel()} entries but t2d marks {int(t2d.sum())} target ids")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.numel()):
        raise ConfigError(f"d2t maps outside the target vocabulary [0, {t2d.numel()})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ConfigError(
            "d2t target ids are not strictly ascending (d2t must hold offsets, target = i + d2t[i])"
        )
    if not bool(t2d[ids].all()):
        raise ConfigError("d2t and t2d disagree: some draft ids map to target ids that t2d does not mark")


def coverage(freq: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of counted (trainable) tokens whose id is in the draft vocabulary; 0.0 when nothing was counted."""
    total = int(freq.sum())
    return float(int(freq[t2d].sum()) / total) if total else 0.0


def coverage_by_size(freq: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """Coverage a top-k draft vocabulary would have, for each k in `sizes` (helps choose draft_vocab_size)."""
    total = int(freq.sum())
    ranked = torch.sort(freq.to(torch.int64), descending=True).values.cumsum(0)  # [V]
    out: dict[int, float] = {}
    for k in sizes:
        k = min(k, freq.numel())
        out[k] = float(int(ranked[k - 1]) / total) if total and k > 0 else 0.0
    return out


# ---------------------------------------------------------------------------------------------
# Files (safetensors, written atomically)
# ---------------------------------------------------------------------------------------------
def _save_atomic(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str]
) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o644)  # safetensors creates files 0600; keep them readable like the other outputs
    os.replace(tmp, path)


def save_token_freq(freq: torch.Tensor, path: str | os.PathLike[str]) -> None:
    _save_atomic({TOKEN_FREQ_KEY: freq.to(torch.int64)}, path, {"format": "eagle3-token-freq"})


def load_token_freq(path: str | os.PathLike[str]) -> torch.Tensor:
    tensors = load_file(str(path))
    if TOKEN_FREQ_KEY not in tensors:
        raise ConfigError(f"{path}: no '{TOKEN_FREQ_KEY}' tensor; was it written by `eagle3 prepare`?")
    return tensors[TOKEN_FREQ_KEY]


def save_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, path: str | os.PathLike[str]) -> None:
    check_vocab_mapping(d2t, t2d)
    meta = {"format": "eagle3-vocab", "draft_vocab_size": str(d2t.numel()), "vocab_size": str(t2d.numel())}
    _save_atomic({"d2t": d2t, "t2d": t2d}, path, meta)


def load_vocab_mapping(path: str | os.PathLike[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a `vocab.safetensors`, checked for consistency."""
    tensors = load_file(str(path))
    missing = {"d2t", "t2d"} - set(tensors)
    if missing:
        raise ConfigError(
            f"{path}: missing {sorted(missing)}; expected the vocab.safetensors of `eagle3 prepare`"
        )
    check_vocab_mapping(tensors["d2t"], tensors["t2d"])
    return tensors["d2t"], tensors["t2d"]


# ---------------------------------------------------------------------------------------------
# A fresh drafter's vocabulary (`eagle3 init-drafter`)
# ---------------------------------------------------------------------------------------------
def initial_draft_ids(vocab_size: int, size: int | None, data: str | os.PathLike[str] | None = None,
                      default: int = 32000) -> tuple[torch.Tensor | None, str]:
    """The draft vocabulary of a fresh drafter: ascending target ids [Vd] (None: the full vocabulary) and a
    sentence saying how they were chosen.

    `size` None: with `data` (a folder written by `eagle3 prepare`) its vocab.safetensors, so `train --init`
    accepts the drafter with that data; without, the first min(`default`, V) ids. 0: the full vocabulary. N: the
    N most frequent tokens of the data's token_freq.safetensors, or without data the first N ids. Without data
    the low ids are the sensible guess: BPE vocabularies number tokens in merge order and SentencePiece ones by
    score, so the common tokens come first. A drafter trained from scratch on prepared data takes that data's.
    """
    if size is not None and size < 0:
        raise ConfigError(f"--draft-vocab-size {size}: give a positive number of tokens, or full (0)")
    if size is not None and size > vocab_size:
        raise ConfigError(f"--draft-vocab-size {size} is larger than the target's vocabulary ({vocab_size} ids); "
                          f"give at most {vocab_size}, or full")
    if size == 0 or (size is None and data is None and default >= vocab_size):
        return None, f"the full vocabulary ({vocab_size} ids)"
    if data is None:
        n = size if size is not None else default
        return torch.arange(n), (f"the first {n} of {vocab_size} target ids (tokenizers number common tokens "
                                 "first; --data DIR picks the most frequent tokens of prepared data)")
    folder = Path(data)
    if size is None:
        path = folder / "vocab.safetensors"
        if not path.exists():
            raise ConfigError(f"{path} does not exist: --data takes a folder written by `eagle3 prepare`")
        d2t, t2d = load_vocab_mapping(path)
        _check_data_vocab(t2d.numel(), vocab_size, data)
        return draft_ids_to_target(d2t), (f"the {d2t.numel()} ids of {path} (what `eagle3 prepare "
                                          "--draft-vocab-size` chose from its token frequencies)")
    path = folder / "token_freq.safetensors"
    if not path.exists():
        raise ConfigError(f"{path} does not exist: --data takes a folder written by `eagle3 prepare`")
    freq = load_token_freq(path)
    _check_data_vocab(freq.numel(), vocab_size, data)
    d2t, t2d = build_vocab_mapping(freq, size)
    return draft_ids_to_target(d2t), (f"the {size} most frequent target ids of {path} ({100 * coverage(freq, t2d):.1f}"
                                      " % of its trained tokens; train --init needs data prepared with this "
                                      "drafter's vocabulary: prepare --vocab-from)")


def _check_data_vocab(data_vocab: int, vocab_size: int, data) -> None:
    if data_vocab != vocab_size:
        raise ConfigError(f"{data} was prepared for a vocabulary of {data_vocab} ids, the target has {vocab_size}; "
                          "give the folder `eagle3 prepare --target` wrote for this target")
