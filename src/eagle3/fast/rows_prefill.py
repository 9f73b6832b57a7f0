"""Admission of `eagle3.fast.rows.FastRows`: the static inputs, outputs and staging caches of one prefill shape (R
prompts right-padded to T tokens), captured once per shape and sharing flat staging buffers, and the prefill step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from eagle3.decoding.grammar import ALL, allowed_tokens, bitmask_words
from eagle3.decoding.sampling import FILTERED, GREEDY, SamplingRows

if TYPE_CHECKING:
    from eagle3.fast.graphs import StepRunner
    from eagle3.fast.rows import FastRows

MIN_PREFILL_WIDTH = 16  # the narrowest prefill bucket (tokens per prompt)


def prefill_staging_tokens(max_prefill_tokens: int) -> int:
    """Padded tokens to capture prefill buckets for, so that every admission of at most M = `max_prefill_tokens`
    padded tokens (R rows x longest prompt T) replays a graph. With bucket(R) = 2^a (2^(a-1) < R) and
    pow2(T) = 2^b (2^(b-1) < T): 2^(a+b-2) < R T <= M <= 2^m (M rounded up), so a + b <= m + 1 and the bucket
    holds at most 2^(m+1) tokens. (The width floor MIN_PREFILL_WIDTH adds nothing for M >= 512 and <= 64 rows.)"""
    return 2 * (1 << (max(1, max_prefill_tokens) - 1).bit_length())


def staging(rows: FastRows, name: str, lead: int | None, shape: tuple[int, int, int, int], dtype: torch.dtype,
            shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V staging caches of `shape` = (R, n_kv, T, hd), behind a leading layer dim `lead` unless None.
    `shared`: views into flat buffers of `rows.prefill_tokens` tokens that every prefill bucket uses (they never
    run at the same time); otherwise new tensors (a prefill larger than every bucket)."""
    full = shape if lead is None else (lead, *shape)
    if not shared:
        return (torch.empty(full, dtype=dtype, device=rows.device),
                torch.empty(full, dtype=dtype, device=rows.device))
    r, nkv, t, hd = shape
    out = []
    for kv in ("k", "v"):
        flat = rows.flat_staging.get(name + kv)
        if flat is None:
            flat = torch.empty(lead or 1, rows.prefill_tokens * nkv * hd, dtype=dtype, device=rows.device)
            rows.flat_staging[name + kv] = flat
        n = r * nkv * t * hd
        out.append(flat[:, :n].view(full) if lead is not None else flat[0, :n].view(full))
    return out[0], out[1]


class Prefill:
    """Static inputs, outputs and staging caches of one prefill shape: `r` prompts right-padded to `t` tokens."""

    def __init__(self, rows: FastRows, r: int, t: int, shared: bool = True):
        dev, tg = rows.device, rows.t
        self.r, self.t = r, t
        self.sampling = SamplingRows(r, tg.vocab_size, dev)  # each prompt's settings
        self.ids = torch.zeros(r, t, dtype=torch.long, device=dev)  # [R, T] right-padded prompts
        self.lens = torch.ones(r, dtype=torch.long, device=dev)  # [R] (padding rows: 1)
        self.root = torch.zeros(r, dtype=torch.long, device=dev)  # [R] a first token known in advance
        self.has_root = torch.zeros(r, dtype=torch.bool, device=dev)  # [R]
        self.first = torch.zeros(r, dtype=torch.long, device=dev)  # [R] out: each row's first new token
        # [R, W] bitmasks of the tokens each first token may be (a grammar's, `eagle3.decoding.grammar`; else all)
        self.mask_words = torch.full((r, bitmask_words(tg.vocab_size)), ALL, dtype=torch.int32, device=dev)
        self.masked = False  # whether a mask other than "all" is set
        self.k, self.v = staging(rows, "target", tg.num_layers, (r, tg.nkv, t, tg.hd), tg.dtype,
                                 shared)  # [L, R, n_kv, T, hd]
        if rows.d is not None:
            fd = rows.d
            self.dk, self.dv = staging(rows, "drafter", None, (r, fd.nkv, t, fd.hd), fd.dtype,
                                       shared)  # [R, n_kv, T, hd]
            self.last_out = torch.zeros(r, fd.hidden_size, dtype=fd.dtype, device=dev)  # [R, H] out
        self.runner: StepRunner | None = None


def prefill_buckets(rows: FastRows) -> list[tuple[int, int]]:
    """(rows, width) shapes captured for admission: batch buckets x powers of two up to the cache length, at most
    `prefill_tokens` padded tokens each."""
    widths, w = [], MIN_PREFILL_WIDTH
    while w < rows.seq_len:
        widths.append(w)
        w *= 2
    widths.append(rows.seq_len)
    return [(r, t) for r in rows.buckets for t in widths if r * t <= rows.prefill_tokens]


def prefill_key(rows: FastRows, r: int, width: int) -> tuple[int, int] | None:
    """The captured bucket that admits r prompts of up to `width` tokens, or None where none is that large."""
    t = max(MIN_PREFILL_WIDTH, 1 << (width - 1).bit_length())
    key = (rows.bucket(r), min(t, rows.seq_len))
    return key if key[0] * key[1] <= rows.prefill_tokens else None


def prefill_step(rows: FastRows, p: Prefill, mode: int | None = None) -> None:
    """Prefill p.ids into p's staging caches (causal, positions from 0); each prompt's first new token (the
    position-keyed choice at its length, or the root it came with) and, with a drafter, the drafter's output at
    each prompt's last token (row t pairs the target's features g_t with token x_{t+1}). `mode`: how the prompts
    choose (None: as any row may, what a captured prefill needs)."""
    r, t, d = p.r, p.t, rows.d
    pos = rows.ar_s[:t][None].expand(r, -1)  # [R, T]
    mask = rows.ar_s[None, None, :t] <= pos[:, :, None]  # [R, T, T] causal
    logits, aux = rows.t.forward_rows(p.ids, pos, pos, mask, p.k, p.v, rows.rope, logits_at=p.lens - 1,
                                      want_aux=d is not None)  # [R, 1, V], [R, T, 3·Ht]
    if mode is None:
        mode = FILTERED if rows.sampling else GREEDY
    rows.allowed = allowed_tokens(p.mask_words, rows.t.vocab_size)[:, None]  # [R, 1, V]
    try:
        tok = rows._choose(p.sampling, logits, p.lens[:, None], mode)[:, 0]  # [R]
    finally:
        rows.allowed = None
    p.first.copy_(torch.where(p.has_root, p.root, tok))
    if d is not None:
        nxt = torch.cat([p.ids[:, 1:], p.ids[:, :1]], dim=1).scatter(1, (p.lens - 1)[:, None], p.first[:, None])
        out = d.forward_rows(d.combine(aux), nxt, pos, pos, mask, p.dk, p.dv, rows.d_rope)  # [R, T, H]
        p.last_out.copy_(out[torch.arange(r, device=rows.device), p.lens - 1])
