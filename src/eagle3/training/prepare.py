"""`eagle3 prepare`: conversations -> tokenised, loss-masked training rows, token counts and a draft vocabulary.
Completion rows (`text`, `prompt` + `completion`, `.txt` files; for base models) are read as raw text (data.py).

Output folder (every file written to a temporary name and renamed into place; `report.json` comes last, so
its presence means the folder is complete):

    tokens.bin              int32 little-endian, all rows' token ids back to back
    loss_mask.bin           uint8, same length: 1 where the drafter is trained (assistant content + end token)
    offsets.npy             int64 [N+1]: row i is tokens[offsets[i]:offsets[i+1]]
    token_freq.safetensors  {"token_freq": int64 [V]}: counts of ids where loss_mask == 1
    vocab.safetensors       {"d2t": int64 [Vd] offsets (target = i + d2t[i]), "t2d": bool [V]}
    report.json             counts (kept, dropped by reason, truncated, tokens), tokenizer and template hashes

`PreparedDataset(out_dir)` reads it back memory-mapped and checks that a tokenizer matches.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.config import DEFAULT_DRAFT_VOCAB_SIZE, ConfigError
from eagle3.training.data import BadRow, iter_rows, text_sha256, tokenizer_fingerprint
from eagle3.training.render import TURN_CUT_END_MASKED, ChatRenderer, EncodedRow
from eagle3.training.vocab import (
    build_vocab_mapping,
    check_vocab_mapping,
    coverage,
    coverage_by_size,
    load_token_freq,
    load_vocab_mapping,
    save_token_freq,
    save_vocab_mapping,
)

FORMAT_NAME = "eagle3-prepared"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
MASK_FILE = "loss_mask.bin"
OFFSETS_FILE = "offsets.npy"
FREQ_FILE = "token_freq.safetensors"
VOCAB_FILE = "vocab.safetensors"
REPORT_FILE = "report.json"
LENGTH_POLICIES = ("drop", "truncate")
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32000, 65536)
_CHUNK_ROWS = 64


@dataclass
class PrepareReport:
    """What `prepare` did. `rows_read == rows_kept + sum(dropped.values())`."""

    rows_read: int = 0
    rows_kept: int = 0
    rows_truncated: int = 0  # kept, cut to max_length (length_policy="truncate")
    dropped: dict[str, int] = field(
        default_factory=dict
    )  # reason -> rows: data.BAD_REASONS, too_long, no_trainable_tokens
    read_errors: dict[str, int] = field(default_factory=dict)  # unreadable JSONL lines, a broken JSON tail
    repairs: dict[str, int] = field(
        default_factory=dict
    )  # leading_assistant_dropped, trailing_user_dropped, ...
    turns: dict[str, int] = field(default_factory=dict)  # assistant-turn outcomes over all rendered rows
    total_tokens: int = 0
    trainable_tokens: int = 0
    distinct_trainable_tokens: int = 0
    longest_row_tokens: int = 0
    max_length: int = 0
    length_policy: str = "drop"
    vocab_size: int = 0
    draft_vocab_size: int = 0
    draft_vocab_coverage: float = 0.0  # fraction of trainable tokens inside the draft vocabulary
    coverage_by_draft_vocab_size: dict[str, float] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)  # data.tokenizer_fingerprint
    chat_template_sha256: str = ""
    chat_template_source: str = "tokenizer"  # "tokenizer", "given" (chat_template=), or "none" (raw text only)
    system_prompt: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    data_files: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    seconds: float = 0.0

    @property
    def rows_dropped(self) -> int:
        return sum(self.dropped.values())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrepareReport:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def summary(self) -> str:
        """A few human-readable lines for the CLI."""
        drops = (
            ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items(), key=lambda kv: -kv[1])) or "none"
        )
        lines = [
            f"rows: read {self.rows_read}, kept {self.rows_kept}, truncated {self.rows_truncated}, "
            f"dropped {self.rows_dropped} ({drops})",
            f"tokens: {self.total_tokens} total, {self.trainable_tokens} trainable "
            f"({self.distinct_trainable_tokens} distinct ids)",
            f"draft vocab: {self.draft_vocab_size} of {self.vocab_size} ids cover "
            f"{100 * self.draft_vocab_coverage:.2f}% of trainable tokens",
        ]
        if len(self.coverage_by_draft_vocab_size) > 1:  # the trade-off behind --draft-vocab-size (docs/training.md)
            lines.append("coverage by draft vocab size: " + ", ".join(
                f"{k} {100 * v:.1f}%" for k, v in sorted(self.coverage_by_draft_vocab_size.items(),
                                                        key=lambda kv: int(kv[0]))))
        if self.read_errors:
            lines.append(f"read errors: {self.read_errors}")
        skipped = {k: v for k, v in self.turns.items() if k.startswith("skipped_")}
        if skipped:
            lines.append(
                f"assistant turns not supervised: {skipped} (supervised {self.turns.get('supervised', 0)})"
            )
        cut = self.turns.get(TURN_CUT_END_MASKED, 0)
        if cut:
            lines.append(f"answers cut at the generation limit: {cut} (their end-of-turn token is not a label)")
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def prepare(
    tokenizer: Any,
    data_paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    max_length: int = 2048,
    length_policy: str = "drop",
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
    system_prompt: str | None = None,
    num_workers: int = 1,
    progress: bool = True,
    *,
    vocab_size: int | None = None,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    max_rows: int | None = None,
    vocab_mapping: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PrepareReport:
    """Tokenise and mask every conversation in `data_paths`; write the folder described in the module docstring.

    `vocab_size` is the target model's vocabulary V (its config's `vocab_size`, which may exceed
    `len(tokenizer)` for padded embeddings); it sizes `token_freq` and `t2d`. Defaults to `len(tokenizer)`.
    `length_policy`: "drop" rows longer than `max_length` tokens (official EAGLE-3, `traineagle3/main.py`) or
    "truncate" them to their first `max_length` tokens. `max_rows` stops after that many rows (a quick slice).
    `vocab_mapping` (d2t, t2d): use this draft vocabulary instead of choosing one by frequency (to continue
    training a drafter on new data, `eagle3 prepare --vocab-from DRAFTER`); `draft_vocab_size` is then its size.
    `num_workers > 1` renders and tokenises in that many 'spawn' processes (a script calling this needs an
    `if __name__ == "__main__":` guard); batched tokenisation already runs on all cores, so 1 is usually enough.
    """
    started = time.perf_counter()
    paths = (
        [Path(data_paths)] if isinstance(data_paths, (str, os.PathLike)) else [Path(p) for p in data_paths]
    )
    if not paths:
        raise ConfigError("no --data files given; pass one or more conversation files")
    if length_policy not in LENGTH_POLICIES:
        raise ConfigError(f"length_policy={length_policy!r}: expected one of {LENGTH_POLICIES}")
    if max_length < 2:
        raise ConfigError(f"max_length={max_length} must be at least 2 tokens")
    if num_workers < 1:
        raise ConfigError(f"num_workers={num_workers} must be >= 1")
    vocab = int(vocab_size) if vocab_size is not None else len(tokenizer)
    if vocab_mapping is not None:
        check_vocab_mapping(*vocab_mapping)
        if vocab_mapping[1].numel() != vocab:
            raise ConfigError(
                f"the given draft vocabulary maps a target vocabulary of {vocab_mapping[1].numel()} ids, this "
                f"target has {vocab}: the drafter was trained for another model"
            )
        draft_vocab_size = vocab_mapping[0].numel()
    if vocab < len(tokenizer):
        raise ConfigError(
            f"vocab_size={vocab} is smaller than the tokenizer ({len(tokenizer)} tokens); pass the target config's "
            "vocab_size"
        )
    if not 0 < draft_vocab_size <= vocab:
        raise ConfigError(
            f"draft_vocab_size={draft_vocab_size} must be in [1, {vocab}] (the target vocabulary); "
            f"{vocab} means no reduction"
        )
    from eagle3.training.inputs import check_data, check_out_dir, needs_template_error

    for p in paths:
        if not p.exists():
            raise ConfigError(f"--data {p}: no such file or folder")
    out = Path(out_dir)
    check_out_dir(out, "--out")
    renderer = ChatRenderer(tokenizer, chat_template=chat_template, template_kwargs=template_kwargs,
                            require_template=False)
    if renderer.chat_template is None and check_data(paths, "prepare").get("chat"):
        raise needs_template_error(tokenizer, "prepare")  # raw text only, without a template
    out.mkdir(parents=True, exist_ok=True)

    report = PrepareReport(
        max_length=max_length,
        length_policy=length_policy,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab_size,
        tokenizer=tokenizer_fingerprint(tokenizer),
        chat_template_sha256=text_sha256(renderer.chat_template) if renderer.chat_template else "",
        chat_template_source="none" if renderer.chat_template is None else (
            "given" if chat_template is not None else "tokenizer"),
        system_prompt=system_prompt,
        template_kwargs=dict(template_kwargs or {}),
        data_files=[str(p) for p in paths],
    )
    read_errors: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    repairs: Counter[str] = Counter()
    turns: Counter[str] = Counter()
    freq = np.zeros(vocab, dtype=np.int64)  # [V]
    offsets = [0]

    rows = _iter_all(paths, read_errors)
    if max_rows is not None:
        rows = islice(rows, max_rows)
    tmp_tokens, tmp_mask = _tmp(out / TOKENS_FILE), _tmp(out / MASK_FILE)
    bar = _progress(progress)
    try:
        with open(tmp_tokens, "wb") as f_tok, open(tmp_mask, "wb") as f_mask:
            for results in _encode_chunks(renderer, _chunks(rows, _CHUNK_ROWS), system_prompt, num_workers):
                kept_ids: list[np.ndarray] = []
                for r in results:
                    report.rows_read += 1
                    turns.update(r.turns)
                    if isinstance(r, BadRow):
                        dropped[r.reason] += 1
                        continue
                    kept = _apply_length_policy(r, max_length, length_policy, dropped)
                    if kept is None:
                        continue
                    ids, mask, was_truncated = kept
                    repairs.update(r.repairs)
                    report.rows_truncated += was_truncated
                    f_tok.write(ids.astype("<i4", copy=False).tobytes())
                    f_mask.write(mask.tobytes())
                    offsets.append(offsets[-1] + len(ids))
                    report.longest_row_tokens = max(report.longest_row_tokens, len(ids))
                    kept_ids.append(ids[mask.astype(bool)])
                if kept_ids:
                    _count(freq, np.concatenate(kept_ids), vocab)
                if bar is not None:
                    bar.update(len(results))
    except BaseException:
        for tmp in (tmp_tokens, tmp_mask):
            tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()

    offsets_arr = np.asarray(offsets, dtype=np.int64)  # [N+1]
    tmp_offsets = _tmp(out / OFFSETS_FILE)
    with open(tmp_offsets, "wb") as f:
        np.save(f, offsets_arr)
    for tmp, final in ((tmp_tokens, TOKENS_FILE), (tmp_mask, MASK_FILE), (tmp_offsets, OFFSETS_FILE)):
        os.replace(tmp, out / final)

    freq_t = torch.from_numpy(freq)
    d2t, t2d = vocab_mapping if vocab_mapping is not None else build_vocab_mapping(freq_t, draft_vocab_size)
    save_token_freq(freq_t, out / FREQ_FILE)
    save_vocab_mapping(d2t, t2d, out / VOCAB_FILE)

    report.rows_kept = len(offsets) - 1
    report.dropped = dict(dropped)
    report.read_errors = dict(read_errors)
    report.repairs = dict(repairs)
    report.turns = dict(turns)
    report.total_tokens = int(offsets_arr[-1])
    report.trainable_tokens = int(freq.sum())
    report.distinct_trainable_tokens = int((freq > 0).sum())
    report.draft_vocab_coverage = coverage(freq_t, t2d)
    sizes = sorted({s for s in COVERAGE_SIZES if s < vocab} | {draft_vocab_size})
    report.coverage_by_draft_vocab_size = {str(k): v for k, v in coverage_by_size(freq_t, sizes).items()}
    report.files = {
        "tokens": TOKENS_FILE,
        "loss_mask": MASK_FILE,
        "offsets": OFFSETS_FILE,
        "token_freq": FREQ_FILE,
        "vocab": VOCAB_FILE,
    }
    report.warnings = _warnings(report, renderer)
    report.seconds = round(time.perf_counter() - started, 3)
    write_json_atomic(report.to_dict(), out / REPORT_FILE)
    if report.rows_kept == 0:
        raise ConfigError(
            f"prepare kept 0 of {report.rows_read} rows (dropped: {report.dropped}, read errors: "
            f"{report.read_errors}); see {out / REPORT_FILE}"
        )
    return report


def write_token_rows(rows: Iterable[tuple[np.ndarray, np.ndarray]], out_dir: str | os.PathLike[str], tokenizer: Any,
                     vocab_size: int, vocab_mapping: tuple[torch.Tensor, torch.Tensor], source: str) -> PrepareReport:
    """A prepared folder (module docstring) from rows that are token ids already: (ids [T] int, loss mask [T] 0/1),
    e.g. recorded traffic (`eagle3.traffic`), with the draft vocabulary `vocab_mapping` (the drafter's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_vocab_mapping(*vocab_mapping)
    report = PrepareReport(vocab_size=vocab_size, draft_vocab_size=vocab_mapping[0].numel(),
                           tokenizer=tokenizer_fingerprint(tokenizer), chat_template_source="traffic",
                           data_files=[source])
    freq = np.zeros(vocab_size, dtype=np.int64)  # [V]
    offsets = [0]
    tmp_tokens, tmp_mask, tmp_offsets = _tmp(out / TOKENS_FILE), _tmp(out / MASK_FILE), _tmp(out / OFFSETS_FILE)
    with open(tmp_tokens, "wb") as f_tok, open(tmp_mask, "wb") as f_mask:
        for ids, mask in rows:
            report.rows_read += 1
            f_tok.write(np.asarray(ids).astype("<i4").tobytes())
            f_mask.write(np.asarray(mask).astype(np.uint8).tobytes())
            offsets.append(offsets[-1] + len(ids))
            report.longest_row_tokens = max(report.longest_row_tokens, len(ids))
            _count(freq, np.asarray(ids)[np.asarray(mask, dtype=bool)], vocab_size)
    with open(tmp_offsets, "wb") as f:
        np.save(f, np.asarray(offsets, dtype=np.int64))
    for tmp, final in ((tmp_tokens, TOKENS_FILE), (tmp_mask, MASK_FILE), (tmp_offsets, OFFSETS_FILE)):
        os.replace(tmp, out / final)
    freq_t = torch.from_numpy(freq)
    save_token_freq(freq_t, out / FREQ_FILE)
    save_vocab_mapping(*vocab_mapping, out / VOCAB_FILE)
    report.rows_kept = len(offsets) - 1
    report.max_length = report.longest_row_tokens
    report.total_tokens, report.trainable_tokens = offsets[-1], int(freq.sum())
    report.distinct_trainable_tokens = int((freq > 0).sum())
    report.draft_vocab_coverage = coverage(freq_t, vocab_mapping[1])
    report.files = {"tokens": TOKENS_FILE, "loss_mask": MASK_FILE, "offsets": OFFSETS_FILE, "token_freq": FREQ_FILE,
                    "vocab": VOCAB_FILE}
    write_json_atomic(report.to_dict(), out / REPORT_FILE)
    return report


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def _warnings(report: PrepareReport, renderer: ChatRenderer) -> list[str]:
    out = []
    tok = renderer.tokenizer
    bos = tok.bos_token
    adds_bos = bool(bos) and tok("x", verbose=False)["input_ids"][:1] == [tok.bos_token_id]
    try:
        writes_bos = renderer.plain or renderer.render([{"role": "user", "content": "x"}]).startswith(bos or "")
    except BadRow:  # a template that refuses a lone user message, or none (raw text only): no verdict
        writes_bos = True
    if adds_bos and not writes_bos:
        out.append(
            f"the tokenizer adds {bos!r} by default but the chat template does not write it; rows have no BOS, "
            "as in vLLM/HF chat serving (apply_chat_template tokenises with add_special_tokens=False)"
        )
    supervised = report.turns.get("supervised", 0)
    skipped = sum(v for k, v in report.turns.items() if k.startswith("skipped_"))
    if skipped and skipped >= 0.1 * (skipped + supervised):
        reasons = {k: v for k, v in report.turns.items() if k.startswith("skipped_")}
        out.append(
            f"{skipped} of {skipped + supervised} assistant turns were not supervised ({reasons}): the template "
            "renders them differently once later turns follow (e.g. it drops earlier reasoning), or changes their "
            "text; only turns that appear unchanged in the full conversation are trained on"
        )
    too_long = report.dropped.get("too_long", 0)
    if too_long and too_long >= 0.1 * report.rows_read:
        out.append(
            f"{too_long} of {report.rows_read} rows exceed max_length={report.max_length} and were dropped; "
            "use length_policy='truncate' or a larger max_length to keep them"
        )
    return out


def _iter_all(paths: list[Path], read_errors: Counter[str]) -> Iterator[Any]:
    for p in paths:
        yield from iter_rows(p, read_errors)


def _chunks(rows: Iterator[Any], size: int) -> Iterator[list[Any]]:
    while chunk := list(islice(rows, size)):
        yield chunk


def _apply_length_policy(
    r: EncodedRow, max_length: int, policy: str, dropped: Counter[str]
) -> tuple[np.ndarray, np.ndarray, bool] | None:
    ids, mask = r.input_ids, r.loss_mask  # [T], [T]
    truncated = False
    if len(ids) > max_length:
        if policy == "drop":
            dropped["too_long"] += 1
            return None
        ids, mask, truncated = ids[:max_length], mask[:max_length], True
    if not mask.any():
        dropped["no_trainable_tokens"] += 1
        return None
    return ids, mask, truncated


def _count(freq: np.ndarray, ids: np.ndarray, vocab: int) -> None:
    if ids.size and int(ids.max()) >= vocab:
        raise ConfigError(
            f"token id {int(ids.max())} is outside vocab_size={vocab}; pass the target config's vocab_size"
        )
    freq += np.bincount(ids, minlength=vocab)


_WORKER: tuple[ChatRenderer, str | None] | None = None


def _init_worker(renderer: ChatRenderer, system_prompt: str | None) -> None:
    global _WORKER
    _WORKER = (renderer, system_prompt)


def _encode_in_worker(chunk: list[Any]) -> list[EncodedRow | BadRow]:
    assert _WORKER is not None, "worker not initialised"
    renderer, system_prompt = _WORKER
    return renderer.encode_many(chunk, system_prompt)


def _encode_chunks(
    renderer: ChatRenderer, chunks: Iterator[list[Any]], system_prompt: str | None, num_workers: int
) -> Iterator[list[EncodedRow | BadRow]]:
    """Encoded chunks in input order; with workers, at most 2 chunks per worker are in flight (bounded memory)."""
    if num_workers == 1:
        for chunk in chunks:
            yield renderer.encode_many(chunk, system_prompt)
        return
    ctx = multiprocessing.get_context("spawn")  # no fork: the parent may hold tokenizer threads
    with ProcessPoolExecutor(
        num_workers, mp_context=ctx, initializer=_init_worker, initargs=(renderer, system_prompt)
    ) as pool:
        pending: deque[Any] = deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(_encode_in_worker, chunk))
                if len(pending) >= 2 * num_workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool as e:
            raise RuntimeError(
                f"prepare's {num_workers} worker processes died. Workers are started with 'spawn', which re-imports "
                "the calling script: call prepare(num_workers>1) under `if __name__ == '__main__':`, or use "
                "num_workers=1 (tokenisation already uses all cores)"
            ) from e


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(unit=" rows", desc="prepare", smoothing=0.05)


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def write_json_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    path = Path(path)
    tmp = _tmp(path)
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Reading a prepared folder
# ---------------------------------------------------------------------------------------------
class PreparedDataset(torch.utils.data.Dataset):
    """A prepared folder, memory-mapped: `ds[i]` is `{"input_ids": long [T], "loss_mask": long [T]}`."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(out_dir)
        report_path = self.dir / REPORT_FILE
        if not report_path.exists():
            raise ConfigError(
                f"{self.dir}: no {REPORT_FILE}; run `eagle3 prepare --out {self.dir}` (or it did not finish)"
            )
        meta = json.loads(report_path.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
            raise ConfigError(
                f"{self.dir}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
                f"{FORMAT_NAME!r} v{FORMAT_VERSION}; re-run `eagle3 prepare`"
            )
        self.report = PrepareReport.from_dict(meta)
        self.offsets = np.load(self.dir / OFFSETS_FILE)  # [N+1]
        n_tokens = int(self.offsets[-1])
        self._tokens = _memmap(self.dir / TOKENS_FILE, np.dtype("<i4"), n_tokens)  # [total]
        self._mask = _memmap(self.dir / MASK_FILE, np.dtype(np.uint8), n_tokens)  # [total]
        if len(self.offsets) - 1 != self.report.rows_kept:
            raise ConfigError(
                f"{self.dir}: {OFFSETS_FILE} has {len(self.offsets) - 1} rows, report.json says {self.report.rows_kept}"
            )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)  # [N]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        i %= len(self)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {
            "input_ids": torch.from_numpy(self._tokens[a:b].astype(np.int64)),  # [T]
            "loss_mask": torch.from_numpy(self._mask[a:b].astype(np.int64)),  # [T]
        }

    def token_freq(self) -> torch.Tensor:
        return load_token_freq(self.dir / FREQ_FILE)

    def vocab_mapping(self) -> tuple[torch.Tensor, torch.Tensor]:
        return load_vocab_mapping(self.dir / VOCAB_FILE)

    def check_tokenizer(self, tokenizer: Any, chat_template: str | None = None) -> None:
        """Raise ConfigError if `tokenizer` (and its chat template) is not the one the data was prepared with."""
        mine = self.report.tokenizer.get("vocab_sha256")
        theirs = tokenizer_fingerprint(tokenizer)["vocab_sha256"]
        if mine != theirs:
            raise ConfigError(
                f"{self.dir} was prepared with tokenizer {self.report.tokenizer.get('name_or_path')!r} "
                f"(vocab hash {str(mine)[:12]}), but this target's tokenizer "
                f"{getattr(tokenizer, 'name_or_path', '?')!r} differs (hash {theirs[:12]}); re-run `eagle3 prepare` "
                "with this target"
            )
        if self.report.chat_template_source != "tokenizer" and chat_template is None:
            return  # raw text, or a template chosen at prepare time (--chat-template)
        template = chat_template if chat_template is not None else tokenizer.chat_template
        if isinstance(template, str) and text_sha256(template) != self.report.chat_template_sha256:
            raise ConfigError(
                f"{self.dir} was prepared with a different chat template than this target's; re-run "
                "`eagle3 prepare` (the drafter must learn the target's own template)"
            )


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    size = path.stat().st_size if path.exists() else -1
    if size != count * dtype.itemsize:
        raise ConfigError(
            f"{path}: expected {count * dtype.itemsize} bytes, found {size}; re-run `eagle3 prepare`"
        )
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
