"""Batched target state for serving: one padded KV cache for all rows, batched prefill and tree verification.

Layout. The batch cache is an HF `DynamicCache` whose layers hold keys/values [B, n_kv, S, hd]; row b's
valid positions are [0, lengths[b]) and [lengths[b], S) is padding. A forward over N1 new tokens per row
appends them at S..S+N1-1 (DynamicCache concatenates along the sequence dim), under a 4-D mask
[B, 1, N1, S+N1] that shows row b its own prefix and its own tree only; positions are lengths[b] + depth.
`compact` then gathers, per row, the prefix plus the kept new tokens into a fresh, narrower padded tensor,
so rows with ragged acceptance never see each other's keys or padding.

Worked example (B=2, S=4, N1=3; `.` = padding, `r` root, `a`/`b` tree nodes)::

    row 0: cache [p p p .] + new [r a b]  lengths[0]=3, path keeps (r, a)   -> [p p p r a]
    row 1: cache [q q q q] + new [r . .]  lengths[1]=4, row 1 drafted none  -> [q q q q r]
    gather index: row 0 [0 1 2 4 5], row 1 [0 1 2 3 4]; new lengths [5, 5]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from eagle3.decoding.verify import accept_rows
from eagle3.target import RecurrentCache, Target, cache_layers

__all__ = [
    "BatchKV",
    "accept_batch",
    "batched_forward",
    "build_mask",
    "prefill",
]


class BatchKV:
    """A padded batch KV cache plus per-row lengths (host list, the scheduler's source of truth)."""

    def __init__(self, cache: DynamicCache | None = None, lengths: list[int] | None = None):
        self.cache = cache
        self.lengths: list[int] = list(lengths or [])

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """S: the padded sequence width of the cache (0 when empty)."""
        layers = self._layers() if self.cache is not None else []
        return layers[0].keys.shape[-2] if layers else 0

    def _layers(self) -> list:
        return [la for la in cache_layers(self.cache) if getattr(la, "keys", None) is not None and la.keys.numel()]

    def merge(self, other: BatchKV) -> None:
        """Append `other`'s rows after this batch's rows (both padded to the wider width)."""
        if other.rows == 0:
            return
        if self.rows == 0:
            self.cache, self.lengths = other.cache, list(other.lengths)
            return
        width = max(self.width, other.width)
        mine, theirs = self._layers(), other._layers()
        if len(mine) != len(theirs):
            raise RuntimeError(f"cannot merge batch caches with {len(mine)} and {len(theirs)} layers")
        for a, b in zip(mine, theirs, strict=True):
            a.keys = torch.cat([_pad_seq(a.keys, width), _pad_seq(b.keys, width)], dim=0)  # [B+b, n_kv, S, hd]
            a.values = torch.cat([_pad_seq(a.values, width), _pad_seq(b.values, width)], dim=0)
        self.lengths += other.lengths

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order; the width shrinks to the longest kept row."""
        if not rows:
            self.cache, self.lengths = None, []
            return
        lengths = [self.lengths[r] for r in rows]
        width = max(lengths)
        layers = self._layers()
        idx = torch.tensor(rows, dtype=torch.long, device=layers[0].keys.device)
        for layer in layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, :width]  # [B', n_kv, S', hd]
            layer.values = layer.values.index_select(0, idx)[:, :, :width]
        self.lengths = lengths

    def compact(self, appended_at: int, keep_new: list[list[int]]) -> None:
        """After a forward appended N1 tokens at width `appended_at`: keep each row's prefix plus
        `keep_new[b]` (offsets into the appended block, in order); lengths grow by len(keep_new[b]). A hybrid
        target's cache (one row) keeps its linear layers' state after the kept chain prefix."""
        old = appended_at
        if isinstance(self.cache, RecurrentCache):  # before the keys shrink: it reads their length
            self.cache.keep_chain(old, torch.tensor(keep_new[0], dtype=torch.long))
        n1 = self.width - old
        new_lengths = [n + len(k) for n, k in zip(self.lengths, keep_new, strict=True)]
        new_width = max(new_lengths)
        idx = torch.zeros(self.rows, new_width, dtype=torch.long)  # [B, S'] padding points at position 0
        for b, (n, keep) in enumerate(zip(self.lengths, keep_new, strict=True)):
            if any(not 0 <= k < n1 for k in keep):
                raise ValueError(f"row {b}: keep offsets {keep} outside the {n1} appended tokens")
            idx[b, :n] = torch.arange(n)
            idx[b, n : n + len(keep)] = torch.tensor(keep, dtype=torch.long) + old
        layers = self._layers()
        idx = idx.to(layers[0].keys.device)[:, None, :, None]  # [B, 1, S', 1]
        for layer in layers:  # keys and values may differ in head size (MLA)
            layer.keys = layer.keys.gather(2, idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, idx.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        self.lengths = new_lengths


def _pad_seq(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad dim -2 (the sequence) of [B, n_kv, S, hd] with zeros to `width`."""
    return F.pad(x, (0, 0, 0, width - x.shape[-2])) if x.shape[-2] < width else x


# -- masks ------------------------------------------------------------------------------------
def build_mask(target: Target, lengths: torch.Tensor, width: int, local: torch.Tensor, positions: torch.Tensor):
    """The 4-D attention mask for N1 new tokens per row after a padded cache of `width` positions.

    lengths: [B] valid cache positions per row; local: bool [B, N1, N1] (new token i may see new token j);
    positions: [B, N1] absolute positions of the new tokens. Row b sees its cache positions < lengths[b]
    and its own new tokens per `local`; `Target.attention_mask` applies sliding windows and per-layer types.
    """
    b, n1 = positions.shape
    cols = torch.arange(width, device=positions.device)  # [S]
    prefix = (cols[None, None, :] < lengths[:, None, None]).expand(b, n1, width)  # [B, N1, S]
    visible = torch.cat([prefix, local], dim=2)  # [B, N1, S+N1]
    kv_pos = torch.cat([cols[None].expand(b, width), positions], dim=1)  # [B, S+N1]
    return target.attention_mask(visible, positions, kv_pos)


# -- forwards ---------------------------------------------------------------------------------
@torch.inference_mode()
def batched_forward(
    target: Target,
    input_ids: torch.Tensor,  # [B, N1]
    kv: BatchKV,
    local: torch.Tensor,  # bool [B, N1, N1]
    offsets: torch.Tensor,  # [B, N1] position of each new token relative to its row's length
    logits_to_keep: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over every row; returns logits [B, N1', V] (fp32) and aux [B, N1, 3·Ht].

    The new tokens are appended to `kv.cache` at the old width `kv.width` (read it before the call and
    pass it to `kv.compact` afterwards).
    """
    dev = input_ids.device
    if kv.cache is None:
        kv.cache = target.new_cache()
    width = kv.width
    n1 = input_ids.shape[1]
    lengths = torch.tensor(kv.lengths, dtype=torch.long, device=dev)  # [B]
    positions = lengths[:, None] + offsets  # [B, N1]
    mask = build_mask(target, lengths, width, local, positions)
    if isinstance(kv.cache, RecurrentCache) and width:
        kv.cache.record(n1)  # after the prefill every forward may be rolled back
    target._captured.clear()
    target._set_query_ratio(positions, width)  # Llama-4 NoPE temperature: rows' positions, not padded slots
    try:
        out = target.model(
            input_ids=input_ids,
            position_ids=positions,
            cache_position=torch.arange(width, width + n1, device=dev),
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=0 if target._all_rows else logits_to_keep,
            **{target._cache_kw: kv.cache},
        )
    finally:
        target._query_ratio = None
    logits = out.logits
    if target._all_rows and torch.is_tensor(logits_to_keep):  # a model that computes every row's logits
        logits = logits[:, logits_to_keep]
    elif target._all_rows and logits_to_keep:
        logits = logits[:, -logits_to_keep:]
    return logits.float(), target._aux()


@torch.inference_mode()
def prefill(
    target: Target, prompts: list[list[int]]
) -> tuple[BatchKV, torch.Tensor, torch.Tensor | None]:
    """Batched prefill of right-padded prompts into a fresh `BatchKV`.

    Returns the cache (lengths = prompt lengths), the logits after each prompt's last token [b, V] and the
    aux features [b, T, 3·Ht] (rows past a prompt's length are padding).
    """
    dev = target.device
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError("every prompt needs at least one token")
    b, t = len(prompts), max(lens)
    ids = torch.zeros(b, t, dtype=torch.long)  # [b, T]
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    ids = ids.to(dev)
    length_t = torch.tensor(lens, device=dev)  # [b]
    col = torch.arange(t, device=dev)
    causal = col[None, :] <= col[:, None]  # [T, T]
    # padding queries (i >= len) also see themselves, so no softmax row is empty
    local = (causal[None] & (col[None, None, :] < length_t[:, None, None])) | torch.eye(
        t, dtype=torch.bool, device=dev)[None]  # [b, T, T]
    kv = BatchKV(lengths=[0] * b)
    uniq = sorted(set(n - 1 for n in lens))
    keep = torch.tensor(uniq, dtype=torch.long, device=dev)  # [K] positions whose logits we need
    logits, aux = batched_forward(target, ids, kv, local, col[None].expand(b, t), logits_to_keep=keep)
    pick = torch.tensor([uniq.index(n - 1) for n in lens], device=dev)  # [b]
    last = logits[torch.arange(b, device=dev), pick]  # [b, V]
    kv.lengths = lens
    return kv, last, aux


def accept_batch(
    tokens: torch.Tensor,  # [B, N] draft tokens (padding: -1)
    parents1: torch.Tensor,  # [B, N+1] parents, N+1 indexing (padding nodes hang off the root)
    anc: torch.Tensor,  # bool [B, N+1, N+1] (`eagle3.decoding.tree.ancestry`)
    top: torch.Tensor,  # [B, N+1] the target's choice after each node (argmax, or a seeded sample)
) -> tuple[list[list[int]], list[int]]:
    """Per row: the accepted path (N+1 indexing, root to deepest) and the next token
    (`eagle3.decoding.verify.accept_rows`); one host sync."""
    acc = accept_rows(tokens, parents1, anc, top, tokens.shape[1])
    packed = torch.cat([acc.n_acc[:, None], acc.bonus[:, None], acc.keep[:, 1:]], dim=1).tolist()  # one host sync
    return [row[2 : 2 + row[0]] for row in packed], [row[1] for row in packed]
