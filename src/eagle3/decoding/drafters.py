"""Drafters for rows: the EAGLE-3 drafter batched across rows, or any per-request `Proposer`, one per row.

Both keep one drafter state per row, in the caller's row order, and share one interface:

    drafter.add(prompts, aux, first_tokens, sampling)  # rows joining after their prefill (appended at the end)
    drafter.select(rows)                         # rows that stay, in their new order
    tokens, parents = drafter.propose(rows, shape, sampling)  # padded trees [R, N] for these rows (padding: -1);
                                                  # sampling: each row's settings and seed (sampled rows draft
                                                  # coupled to their draws: `eagle3.decoding.sampling`)
    drafter.extend(aux_rows, new_tokens, counts)  # after verification: row b's first counts[b] kept features
                                                  # with the token following each (counts[b] = 0: no update)

The server's HF rows (`eagle3.decoding.hf_rows`) draft many rows with them, the generic engine one (`rows_drafter`).
`Eagle3BatchDrafter` runs the EAGLE-2 tree expansion (`eagle3.decoding.expand`) for all drafting rows at
once: its `DrafterKV` is a padded [B, n_kv, S, hd] tensor with per-row lengths, and every drafter forward takes a
bool mask [B, 1, T, S+T] that hides other rows' padding. It drafts with an `Eagle3Drafter` or with a target's own
MTP layer (`eagle3.decoding.mtp.MtpDrafter`): anything with `combine`, a forward over (features, tokens,
positions, mask, `DrafterKV`), `logits`, `feedback`, `draft_ids_to_target` and `position_offset` (the RoPE
position of feature row 0). `Eagle3Proposer` is one request's row of it. `ProposerBatchDrafter` loops over
per-row proposers (n-gram, test doubles): correct for any proposer, slower. `add_idle(n)` appends rows an
`Eagle3BatchDrafter` never drafts for (rows decoding when the server swapped drafters), and `identity_probe` is
the check a candidate drafter passes before a swap.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import replace

import torch

from eagle3.config import DraftShape, SamplingConfig
from eagle3.decoding.expand import Constrain, coupled_top_k, expand_tree
from eagle3.decoding.grammar import restrict
from eagle3.decoding.proposers import Proposer
from eagle3.decoding.sampling import GREEDY, SamplingRows, sampling_mode, token_hash
from eagle3.decoding.tree import DraftTree
from eagle3.drafter import DrafterKV, Eagle3Drafter
from eagle3.target import Target

__all__ = ["BatchDrafter", "Eagle3BatchDrafter", "Eagle3Proposer", "ProposerBatchDrafter", "identity_probe",
           "pad_trees", "rows_drafter"]


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
    def propose(self, rows: list[int], shape: DraftShape, sampling: list[SamplingConfig] | None = None,
                constrain: Constrain | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft trees of `rows`: tokens and parents [R, N] (-1 padding). `constrain`
        (`eagle3.decoding.expand.Constrain`, in target ids [R, T, V]): what a grammar allows after each node, where
        the drafter can follow it."""

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
    """The EAGLE-3 drafter (or an MTP layer) over a batch of rows, with a padded drafter cache. `coupled`: sampled
    rows draft coupled to their draws (`coupled_top_k`); False: the drafter's top-k, as greedy rows do."""

    name = "eagle3"

    def __init__(self, drafter: Eagle3Drafter, coupled: bool = True):
        self.drafter = drafter.eval()
        self.coupled = coupled
        self.offset = getattr(drafter, "position_offset", 0)  # RoPE position of feature row 0
        self.cache = DrafterKV()  # keys [B, n_kv, S, hd]
        self.lengths: list[int] = []  # rows computed from target features
        self.last_out: torch.Tensor | None = None  # [B, H] pre-norm output of each row's newest row
        self.draft_h: torch.Tensor | None = None  # [Vd] noise keys of the draft vocabulary, on first sampled use

    @property
    def device(self) -> torch.device:
        return next(self.drafter.parameters()).device

    # -- rows ------------------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, prompts, aux, first_tokens, sampling=None):  # sampling: taken per cycle by `propose`
        b = len(prompts)
        lens = [len(p) for p in prompts]
        m = max(lens)
        toks = torch.zeros(b, m, dtype=torch.long)  # [b, T] x_{t+1} for feature row t
        for i, (p, first) in enumerate(zip(prompts, first_tokens, strict=True)):
            toks[i, : len(p)] = torch.tensor([*p[1:], first], dtype=torch.long)
        new = Eagle3BatchDrafter(self.drafter, self.coupled)
        hidden = self.drafter.combine(aux[:, :m].to(self.device))  # [b, T, H]
        new.lengths = [0] * b
        new.last_out = hidden.new_zeros(b, hidden.shape[-1])
        new._extend(hidden, toks.to(self.device), lens)
        self._merge(new)

    def add_idle(self, n: int) -> None:
        """Append n rows with an empty cache, which are never proposed for nor extended (counts 0)."""
        if n == 0:
            return
        cfg, w = self.drafter.config, self.drafter.fc.weight
        kv = w.new_zeros(n, cfg.num_key_value_heads, 0, cfg.resolved_head_dim)  # [n, n_kv, 0, hd]
        idle = Eagle3BatchDrafter(self.drafter, self.coupled)
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
        pos = lengths[:, None] + j[None] + self.offset  # [B, M]
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
        idx = idx.to(dev)[:, None, :, None]  # [B, 1, S', 1]

        def keep(x: torch.Tensor) -> torch.Tensor:  # keys and values may differ in head size (MLA)
            return x.gather(2, idx.expand(-1, x.shape[1], -1, x.shape[3]))

        self.cache = DrafterKV(keep(self.cache.keys), keep(self.cache.values))
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
        [R, T, k], sampled rows' coupled to their draws at `positions` [R] + the step (`coupled_top_k`), among
        the draft tokens `allowed` [R, T, Vd] where a grammar constrains."""
        d = self.drafter

        def logits_of(out: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:  # [R, T, Vd]
            logits = d.logits(out)
            if allowed is None:
                return logits.float()
            ids = d.draft_ids_to_target(torch.arange(logits.shape[-1], device=logits.device))  # [Vd]
            return restrict(logits, allowed[..., ids])  # allowed [R, T, V] in target ids

        modes = [sampling_mode(s.temperature, s.top_p, s.top_k) for s in sampling or []] if self.coupled else []
        if not any(m != GREEDY for m in modes):
            return lambda out, step, allowed=None: torch.log_softmax(logits_of(out, allowed), dim=-1).topk(k, dim=-1)
        rows = SamplingRows(len(modes), None, self.device)
        rows.set(0, sampling)

        def children(out: torch.Tensor, step: int, allowed: torch.Tensor | None = None):
            logits = logits_of(out, allowed)  # [R, T, Vd]
            if self.draft_h is None or self.draft_h.shape[0] != logits.shape[-1]:
                ids = torch.arange(logits.shape[-1], device=self.device)
                self.draft_h = token_hash(d.draft_ids_to_target(ids))  # [Vd]
            return coupled_top_k(logits, positions + step, rows, max(modes), self.draft_h, k)

        return children

    @torch.inference_mode()
    def propose(self, rows, shape, sampling=None, constrain=None):
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
            pos = (lengths - 1 + step + self.offset)[:, None].expand(r, k)  # [R, k]
            return d(hidden, tokens, pos, mask=mask, cache=cache)  # [R, k, H]

        # the first drafts are for the token at lengths + 1
        return expand_tree(last, shape, self._coupling(sampling, lengths + 1, k), run, d.feedback,
                           d.draft_ids_to_target, constrain=constrain)


class ProposerBatchDrafter(BatchDrafter):
    """One `Proposer` per row, made by `factory(prompt_ids)`, run one after another; trees are truncated
    to the policy's node count (a prefix of a tree keeps every parent; no shape: kept whole). Aux features are
    passed when the target computes them (proposers that do not need them ignore them)."""

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

    def propose(self, rows, shape, sampling=None, constrain=None):  # host proposers draft unconstrained
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


class Eagle3Proposer(Proposer):
    """EAGLE-3 drafting for one request, `shape` every cycle: one row of an `Eagle3BatchDrafter` (also with a
    target's MTP layer, `eagle3.decoding.mtp`). The generic engine drafts with that batch drafter itself
    (`rows_drafter`); `begin`, `propose` and `accept` serve callers that draft one request step by step."""

    name = "eagle3"
    needs_aux = True

    def __init__(self, drafter: Eagle3Drafter, shape: DraftShape, coupled: bool = True):
        self.drafter, self.shape, self.coupled = drafter.eval(), shape, coupled
        self.row = self.rows()
        self.sampling: SamplingConfig | None = None  # a sampled request's settings and seed
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # accepted rows, fed by the next `propose`

    def rows(self) -> Eagle3BatchDrafter:
        """A fresh batch drafter with this proposer's drafter."""
        return Eagle3BatchDrafter(self.drafter, self.coupled)

    @property
    def device(self) -> torch.device:
        return self.row.device

    @property
    def last_out(self) -> torch.Tensor:
        return self.row.last_out  # [1, H]

    def sample_with(self, sampling, seed):
        self.sampling = None if sampling.temperature == 0 else replace(sampling, seed=seed)

    def begin(self, prompt_ids, aux, first_token):
        self.row, self.pending = self.rows(), []
        self.row.add([prompt_ids.view(-1).tolist()], aux, [int(first_token)])

    def accept(self, aux_rows, next_tokens):
        self.pending.append((aux_rows.view(1, -1, aux_rows.shape[-1]), next_tokens.view(-1)))

    def propose(self) -> DraftTree:
        if self.pending:
            aux, tokens = zip(*self.pending, strict=True)
            self.pending = []
            ids = torch.cat(tokens).tolist()
            self.row.extend(torch.cat(aux, dim=1), [ids], [len(ids)])
        tokens, parents = self.row.propose([0], self.shape, None if self.sampling is None else [self.sampling])
        return DraftTree(tokens=tokens[0], parents=parents[0])


def rows_drafter(proposer: Proposer, device: torch.device | str) -> tuple[BatchDrafter | None, DraftShape | None]:
    """The drafter of the generic engine's one row and the shape it drafts (None: what the proposer proposes):
    an `Eagle3Proposer`'s batch drafter, any other proposer through `ProposerBatchDrafter`, none for "none"."""
    if proposer.name == "none":
        return None, None
    if isinstance(proposer, Eagle3Proposer):
        return proposer.rows(), proposer.shape
    return ProposerBatchDrafter(lambda _p: proposer, device), None


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
