"""Drafters for a batch of rows: the EAGLE-3 drafter batched across rows, or any per-row `Proposer`.

Both keep one drafter state per batch row, in the scheduler's row order, and share one interface:

    drafter.add(prompts, aux, first_tokens, sampling)  # rows joining after their prefill (appended at the end)
    drafter.select(rows)                         # rows that stay, in their new order
    tokens, parents = drafter.propose(rows, shape, sampling)  # padded trees [R, N] for these rows (padding: -1);
                                                  # sampling: each row's settings and seed (sampled rows draft
                                                  # coupled to their draws: `eagle3.decoding.sampling`)
    drafter.extend(aux_rows, new_tokens, counts)  # after verification: row b's first counts[b] kept features
                                                  # with the token following each (counts[b] = 0: no update)

`Eagle3BatchDrafter.add_idle(n)` appends rows it never drafts for: rows that were decoding when the server swapped
drafters (`Scheduler.swap_drafter`), which finish plain. `identity_probe` is the check a candidate drafter passes
before a swap.

`Eagle3BatchDrafter` runs the EAGLE-2 tree expansion (`eagle3.decoding.expand`) for all drafting rows at
once: its `DrafterKV` is a padded [B, n_kv, S, hd] tensor with per-row lengths, and every
drafter forward takes a bool mask [B, 1, T, S+T] that hides other rows' padding. `ProposerBatchDrafter`
loops over per-row proposers (n-gram, test doubles): correct for any proposer, slower.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from eagle3.config import DraftShape, SamplingConfig
from eagle3.decoding.expand import coupled_top_k, expand_tree
from eagle3.decoding.proposers import Eagle3Proposer, Proposer
from eagle3.decoding.sampling import GREEDY, SamplingRows, sampling_mode, token_hash
from eagle3.drafter import DrafterKV, Eagle3Drafter
from eagle3.target import Target

__all__ = ["BatchDrafter", "Eagle3BatchDrafter", "ProposerBatchDrafter", "identity_probe", "pad_trees"]


class BatchDrafter(abc.ABC):
    """Interface; see the module docstring. Aux arguments are None when the target has no aux layers."""

    name = "none"

    @abc.abstractmethod
    def add(self, prompts: list[list[int]], aux: torch.Tensor | None, first_tokens: list[int],
            sampling: list[SamplingConfig | None] | None = None) -> None:
        ...

    @abc.abstractmethod
    def select(self, rows: list[int]) -> None:
        ...

    @abc.abstractmethod
    def propose(self, rows: list[int], shape: DraftShape,
                sampling: list[SamplingConfig] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    @abc.abstractmethod
    def extend(self, aux_rows: torch.Tensor | None, new_tokens: list[list[int]], counts: list[int]) -> None:
        ...


def pad_trees(trees: list[tuple[torch.Tensor, torch.Tensor]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack (tokens [n_i], parents [n_i]) pairs into [R, N_max] tensors, padding with -1."""
    n = max((t.numel() for t, _ in trees), default=0)
    tokens = torch.full((len(trees), n), -1, dtype=torch.long, device=device)  # [R, N]
    parents = torch.full((len(trees), n), -1, dtype=torch.long, device=device)
    for i, (t, p) in enumerate(trees):
        tokens[i, : t.numel()] = t.to(device)
        parents[i, : p.numel()] = p.to(device)
    return tokens, parents


class Eagle3BatchDrafter(BatchDrafter):
    """The EAGLE-3 drafter over a batch of rows, with a padded drafter cache."""

    name = "eagle3"

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter.eval()
        self.cache = DrafterKV()  # keys [B, n_kv, S, hd]
        self.lengths: list[int] = []  # rows computed from target features (= RoPE position of the next one)
        self.last_out: torch.Tensor | None = None  # [B, H] pre-norm output of each row's newest row
        self.draft_h: torch.Tensor | None = None  # [Vd] noise keys of the draft vocabulary, on first sampled use

    @property
    def device(self) -> torch.device:
        return self.drafter.fc.weight.device

    # -- rows ------------------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, prompts, aux, first_tokens, sampling=None):  # sampling: taken per cycle by `propose`
        b = len(prompts)
        lens = [len(p) for p in prompts]
        m = max(lens)
        toks = torch.zeros(b, m, dtype=torch.long)  # [b, T] x_{t+1} for feature row t
        for i, (p, first) in enumerate(zip(prompts, first_tokens, strict=True)):
            toks[i, : len(p)] = torch.tensor([*p[1:], first], dtype=torch.long)
        new = Eagle3BatchDrafter(self.drafter)
        new.lengths = [0] * b
        new.last_out = torch.zeros(b, self.drafter.config.hidden_size, device=self.device,
                                   dtype=self.drafter.fc.weight.dtype)
        new._extend(self.drafter.combine(aux[:, :m].to(self.device)), toks.to(self.device), lens)
        self._merge(new)

    def add_idle(self, n: int) -> None:
        """Append n rows with an empty cache, which are never proposed for nor extended (counts 0)."""
        if n == 0:
            return
        cfg, w = self.drafter.config, self.drafter.fc.weight
        kv = w.new_zeros(n, cfg.num_key_value_heads, 0, cfg.resolved_head_dim)  # [n, n_kv, 0, hd]
        idle = Eagle3BatchDrafter(self.drafter)
        idle.cache, idle.lengths = DrafterKV(kv, kv.clone()), [0] * n
        idle.last_out = w.new_zeros(n, cfg.hidden_size)  # [n, H]
        self._merge(idle)

    def _merge(self, other: Eagle3BatchDrafter) -> None:
        if not self.lengths:
            self.cache, self.lengths, self.last_out = other.cache, list(other.lengths), other.last_out
            return
        width = max(self.cache.length, other.cache.length)

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[2]))  # [B, n_kv, width, hd]

        self.cache = DrafterKV(torch.cat([pad(self.cache.keys), pad(other.cache.keys)]),
                               torch.cat([pad(self.cache.values), pad(other.cache.values)]))
        self.lengths += other.lengths
        self.last_out = torch.cat([self.last_out, other.last_out])  # [B, H]

    def select(self, rows):
        if not rows:
            self.cache, self.lengths, self.last_out = DrafterKV(), [], None
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.lengths = [self.lengths[r] for r in rows]
        width = max(self.lengths)
        self.cache = DrafterKV(self.cache.keys.index_select(0, idx)[:, :, :width],
                               self.cache.values.index_select(0, idx)[:, :, :width])
        self.last_out = self.last_out.index_select(0, idx)

    # -- updates ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _extend(self, hidden: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> None:
        """Append counts[b] rows per batch row: hidden [B, M, H], following tokens [B, M]."""
        d, dev = self.drafter, self.device
        b, m = tokens.shape
        width = self.cache.length
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=dev)  # [B]
        cnt = torch.tensor(counts, dtype=torch.long, device=dev)  # [B]
        j = torch.arange(m, device=dev)
        pos = lengths[:, None] + j[None]  # [B, M]
        local = ((j[None, :] <= j[:, None])[None] & (j[None, None, :] < cnt[:, None, None])) | torch.eye(
            m, dtype=torch.bool, device=dev)[None]  # [B, M, M]; padding rows see themselves
        prefix = (torch.arange(width, device=dev)[None, None, :] < lengths[:, None, None]).expand(b, m, width)
        mask = torch.cat([prefix, local], dim=2)[:, None]  # [B, 1, M, S+M]
        out = d(hidden, tokens, pos, mask=mask, cache=self.cache)  # [B, M, H]
        new_lengths = [n + c for n, c in zip(self.lengths, counts, strict=True)]
        idx = torch.zeros(b, max(new_lengths), dtype=torch.long)  # [B, S'] gather index
        for r, (n, c) in enumerate(zip(self.lengths, counts, strict=True)):
            idx[r, :n] = torch.arange(n)
            idx[r, n : n + c] = torch.arange(width, width + c)
        g = idx.to(dev)[:, None, :, None].expand(-1, self.cache.keys.shape[1], -1, self.cache.keys.shape[3])
        self.cache = DrafterKV(self.cache.keys.gather(2, g), self.cache.values.gather(2, g))
        last = (cnt - 1).clamp(min=0)  # [B]
        newest = out[torch.arange(b, device=dev), last]  # [B, H]
        self.last_out = torch.where((cnt > 0)[:, None], newest, self.last_out)
        self.lengths = new_lengths

    @torch.inference_mode()
    def extend(self, aux_rows, new_tokens, counts):
        if not any(counts):
            return
        m = max(counts)
        toks = torch.zeros(len(counts), m, dtype=torch.long)  # [B, M]
        for r, (t, c) in enumerate(zip(new_tokens, counts, strict=True)):
            toks[r, :c] = torch.tensor(t[:c], dtype=torch.long)
        self._extend(self.drafter.combine(aux_rows[:, :m].to(self.device)), toks.to(self.device), counts)

    # -- drafting --------------------------------------------------------------------------
    def _coupling(self, sampling: list[SamplingConfig] | None, positions: torch.Tensor, k: int):
        """`expand_tree`'s children: drafter outputs [R, T, H] to the top k drafts' (log-probabilities, ids)
        [R, T, k], sampled rows' coupled to their draws at `positions` [R] + the step (`coupled_top_k`)."""
        d = self.drafter
        modes = [sampling_mode(s.temperature, s.top_p, s.top_k) for s in sampling or []]
        if not any(m != GREEDY for m in modes):
            return lambda out, step: torch.log_softmax(d.logits(out).float(), dim=-1).topk(k, dim=-1)
        rows = SamplingRows(len(modes), None, self.device)
        rows.set(0, sampling)
        if self.draft_h is None:
            vd = d.lm_head.weight.shape[0]
            self.draft_h = token_hash(d.draft_ids_to_target(torch.arange(vd, device=self.device)))  # [Vd]
        return lambda out, step: coupled_top_k(d.logits(out), positions + step, rows, max(modes), self.draft_h, k)

    @torch.inference_mode()
    def propose(self, rows, shape, sampling=None):
        """The EAGLE-2 tree (`eagle3.decoding.expand`) of every row in `rows` at once."""
        d, k, dev = self.drafter, shape.top_k, self.device
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        r = len(rows)
        lengths = torch.tensor([self.lengths[i] for i in rows], dtype=torch.long, device=dev)  # [R]
        width = max(self.lengths[i] for i in rows)
        if len(rows) == len(self.lengths) and rows == sorted(rows):  # every row: no copy (append makes new tensors)
            cache = DrafterKV(self.cache.keys[:, :, :width], self.cache.values[:, :, :width])
            last = self.last_out  # [R, H]
        else:
            cache = DrafterKV(self.cache.keys.index_select(0, idx)[:, :, :width],
                              self.cache.values.index_select(0, idx)[:, :, :width])
            last = self.last_out.index_select(0, idx)  # [R, H]
        prefix = torch.arange(width, device=dev)[None, None, :] < lengths[:, None, None]  # [R, 1, S]

        def run(step: int, hidden: torch.Tensor, tokens: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
            mask = torch.cat([prefix.expand(r, k, width), anc], dim=2)[:, None]  # [R, 1, k, S + rows]
            pos = (lengths - 1 + step)[:, None].expand(r, k)  # [R, k]
            return d(hidden, tokens, pos, mask=mask, cache=cache)  # [R, k, H]

        # the first drafts are for the token at lengths + 1
        return expand_tree(last, shape, self._coupling(sampling, lengths + 1, k), run, d.feedback,
                           d.draft_ids_to_target)


class ProposerBatchDrafter(BatchDrafter):
    """One `Proposer` per row, made by `factory(prompt_ids)`, run one after another; trees are truncated
    to the policy's node count (a prefix of a tree keeps every parent; no shape: kept whole). Aux features are
    passed when the target computes them (an `Eagle3Proposer` per row needs them; others ignore them)."""

    name = "per-row"

    def __init__(self, factory: Callable[[list[int]], Proposer], device: torch.device | str = "cpu"):
        self.factory = factory
        self.device = torch.device(device)
        self.rows: list[Proposer] = []

    def add(self, prompts, aux, first_tokens, sampling=None):
        for i, (p, first) in enumerate(zip(prompts, first_tokens, strict=True)):
            pr = self.factory(list(p))
            s = sampling[i] if sampling else None
            if s is not None:
                pr.sample_with(s, s.seed)
            row_aux = aux[i : i + 1, : len(p)] if aux is not None else None
            pr.begin(torch.tensor(p, dtype=torch.long, device=self.device), row_aux, first)
            self.rows.append(pr)

    def select(self, rows):
        self.rows = [self.rows[r] for r in rows]

    def propose(self, rows, shape, sampling=None):
        trees = []
        for r in rows:
            t = self.rows[r].propose()
            n = shape.total if shape is not None else t.n
            trees.append((t.tokens[:n], t.parents[:n]))  # a prefix keeps every parent
        return pad_trees(trees, self.device)

    def extend(self, aux_rows, new_tokens, counts):
        for r, (toks, c) in enumerate(zip(new_tokens, counts, strict=True)):
            if c:
                a = aux_rows[r : r + 1, :c] if aux_rows is not None else None
                self.rows[r].accept(a, torch.tensor(toks[:c], dtype=torch.long, device=self.device))


def identity_probe(target: Target, drafter: Eagle3Drafter, shape: DraftShape, prompt: list[int],
                   plain: list[int]) -> str | None:
    """None when greedy decoding of `prompt` on `target` with `drafter` proposing gives `plain` (the target's own
    greedy tokens, as many), else what differs. A difference at a near tie of the target's two candidates (float
    rounding of tree-shaped vs one-token forwards, as in bf16) is not counted."""
    from eagle3.decoding.engine import SpeculativeEngine  # which decodes on this module's drafters

    got = SpeculativeEngine(target, Eagle3Proposer(drafter, shape)).generate(prompt, len(plain)).token_ids
    i = next((i for i, (a, b) in enumerate(zip(got, plain, strict=False)) if a != b), None)
    if i is None:
        return None if len(got) == len(plain) else f"{len(got)} tokens where plain decoding gives {len(plain)}"
    with torch.inference_mode():
        ids = torch.tensor([[*prompt, *plain[:i]]], device=target.device)  # [1, T]
        logits, _ = target.forward(ids, target.new_cache(), logits_to_keep=1)
    last = logits[0, -1].float()  # [V]
    tolerance = 8 * torch.finfo(logits.dtype).eps * max(1.0, float(last.abs().max()))
    if abs(float(last[got[i]] - last[plain[i]])) <= tolerance:
        return None
    return f"token {i} is {got[i]} with the candidate drafting and {plain[i]} without"
