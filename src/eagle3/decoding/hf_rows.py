"""Rows of any HF causal LM decoding together: the server's batch for targets and requests the fast rows don't take.

`HFRows` has the interface of `eagle3.fast.rows.FastRows`, so the scheduler runs both through one path:

    firsts = rows.add_many(prompts, roots, sampling)  # prefill new rows n, n+1, ...; their first tokens
    new = rows.cycle(spec)                            # one cycle of every row: each row's new tokens
    rows.remove(i)                                    # free row i; the last row moves into its place

State: one padded KV cache (`eagle3.decoding.hf_batch.BatchKV`, row b's tokens at [0, lengths[b])), a `BatchDrafter`
with one drafter state per row, and per row its sampling settings and whether the drafter follows it. A cycle
verifies [B, N+1] tokens (root and padded draft tree) in one forward under a 4-D mask and keeps each row's
accepted path (`eagle3.decoding.verify.accept_rows`). Plain cycles hold each followed row's root features and new
token back and feed the drafter in one batched extension before the next speculative cycle, or once `feed_window`
tokens are held, as `FastRows` does. Rows decoding when the server swaps drafters are not followed by the new one:
they finish plain (`swap_drafter`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from eagle3.attention import varying_shape_attention
from eagle3.config import FEED_WINDOW, ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.drafters import BatchDrafter, Eagle3BatchDrafter
from eagle3.decoding.grammar import Choose, Grammar, allowed_tokens, frontier_allowed, next_allowed, walk_tree
from eagle3.decoding.hf_batch import BatchKV, accept_batch, batched_forward, prefill
from eagle3.decoding.sampling import FILTERED, GREEDY, SamplingRows, sampling_mode
from eagle3.decoding.tree import ancestry, parents_with_root
from eagle3.target import Target

__all__ = ["HFRows"]


class HFRows:
    """Up to `capacity` rows on the HF backend; see the module docstring. `shapes(n)` is the draft shape of a
    speculative cycle of n rows (None: whatever the drafter proposes). A hybrid target (linear-attention layers
    with a recurrent state) decodes one row, and chains only. `timed`: add each cycle's drafting and verification
    seconds to `draft_s` and `verify_s` (with a device sync between them)."""

    sampling = True  # sampled rows decode here too

    def __init__(self, target: Target, drafter: BatchDrafter | None, capacity: int,
                 shapes: Callable[[int], DraftShape | None] | None = None, feed_window: int = FEED_WINDOW,
                 timed: bool = False):
        if target.recurrent_layers and capacity > 1:
            # the padded cache holds keys/values per row; rows of a hybrid target would share, and never roll
            # back, its linear layers' recurrent state
            raise ConfigError(f"{target.family} has linear-attention layers with a recurrent state per sequence, "
                              "which rows of a batch cannot keep apart: the server cannot batch it; decode one "
                              "request at a time with `eagle3 generate --target ... --chain K`")
        self.t, self.drafter, self.capacity = target, drafter, capacity
        self.shapes = shapes if drafter is not None else None
        self.feed_window = max(1, feed_window)
        self.kv = BatchKV()
        self.n = 0
        self._slot: list[int] = []  # per row: its row in the cache and the drafter (removals are applied lazily)
        self._sampling: list[SamplingConfig] = []  # per row (temperature 0: greedy)
        self._draws = SamplingRows(capacity, target.vocab_size, target.device)  # the same, on the device
        self._modes: list[int] = []  # per row: GREEDY, TEMPERATURE or FILTERED
        self._roots: list[int] = []  # per row: the last emitted token, not yet in the cache
        self._grammars: list[Grammar | None] = []  # per row: what its tokens must follow (None: anything)
        self._followed: list[bool] = []  # per row: the drafter's state follows it
        self._held_aux: list[list[torch.Tensor]] = []  # per row: root features of plain cycles, [1, 3·Ht] each
        self._held_tok: list[list[int]] = []  # per row: the token after each held root
        # per row, of the last cycle: depth and draft tokens drafted (0: did not draft)
        self.depths: list[int] = []
        self.drafted: list[int] = []
        self.timed, self.draft_s, self.verify_s = timed, 0.0, 0.0

    # -- host side -------------------------------------------------------------------------------
    def fits(self, context: int, max_new_tokens: int) -> bool:
        """Any length fits: the cache grows with the rows."""
        return True

    def shape_of(self, n: int) -> DraftShape | None:
        return self.shapes(max(1, n)) if self.shapes is not None else None

    @property
    def drafting(self) -> int:
        """Rows that draft in a speculative cycle."""
        return sum(self._followed)

    @property
    def sampled(self) -> bool:
        """Whether a row samples (the speed gate measures such cycles apart)."""
        return max(self._modes, default=GREEDY) != GREEDY

    def add_many(self, prompts: list[list[int]], roots: list[int | None] | None = None,
                 sampling: list[SamplingConfig | None] | None = None,
                 grammars: list[Grammar | None] | None = None) -> list[int]:
        """Prefill prompts into new rows n, n+1, ... in one padded forward; returns their first new tokens (a
        row's `roots` entry when given: a request moving in from elsewhere, whose next token is known).
        `grammars` (`eagle3.decoding.grammar`, fresh): each row's tokens are the target's choices among the tokens
        its grammar allows, and EAGLE-3 drafts only such tokens."""
        with torch.inference_mode(), varying_shape_attention(self.t.device):  # target and drafter alike
            return self._add_many(prompts, roots, sampling, grammars or [None] * len(prompts))

    def _add_many(self, prompts, roots, sampling, grammars) -> list[int]:
        r = len(prompts)
        roots = roots or [None] * r
        sampling = [s or SamplingConfig() for s in sampling or [None] * r]
        if self.n + r > self.capacity:
            raise RuntimeError(f"{r} more rows do not fit: {self.n} of {self.capacity} are in use")
        self._settle()
        kv, last, aux = prefill(self.t, prompts)  # last [r, V]
        if any(g is not None for g in grammars):
            allowed = next_allowed(grammars, r, last.shape[-1], last.device)[:, 0]  # [r, V]
            last = last.masked_fill(~allowed, float("-inf"))
        modes = [sampling_mode(s.temperature, s.top_p, s.top_k) for s in sampling]
        self._draws.set(self.n, sampling)
        if max(modes) == GREEDY:
            first = last.argmax(dim=-1)  # [r]
        else:
            pos = torch.tensor([len(p) for p in prompts], device=last.device)  # [r] the first tokens' positions
            first = self._draws.draw(last[:, None], pos[:, None], max(modes), fused=last.is_cuda, lo=self.n)[:, 0]
        firsts = [x if x is not None else f for x, f in zip(roots, first.tolist(), strict=True)]
        self.kv.merge(kv)
        if self.drafter is not None:
            self.drafter.add(prompts, aux, firsts, sampling)
        self._slot += range(self.n, self.n + r)
        self._sampling += sampling
        self._modes += modes
        self._roots += firsts
        for g, x in zip(grammars, firsts, strict=True):
            if g is not None:
                g.consume([x])
        self._grammars += grammars
        self._followed += [self.drafter is not None] * r
        self._held_aux += [[] for _ in range(r)]
        self._held_tok += [[] for _ in range(r)]
        self.n += r
        return firsts

    def remove(self, i: int) -> None:
        """Free row i; the last row moves into it (callers mirror that move in their own row lists)."""
        last = self.n - 1
        if not 0 <= i <= last:
            raise IndexError(f"row {i} is not active (rows 0..{last})")
        self._draws.move(i, last)
        for per_row in (self._slot, self._sampling, self._modes, self._roots, self._grammars, self._followed,
                        self._held_aux, self._held_tok):
            per_row[i] = per_row[last]
            per_row.pop()
        self.n -= 1

    def clear(self) -> None:
        """Free every row."""
        self.kv = BatchKV()
        if self.drafter is not None:
            self.drafter.select([])
        self._slot, self._sampling, self._modes, self._roots, self._grammars = [], [], [], [], []
        self._followed, self._held_aux, self._held_tok = [], [], []
        self.n = 0

    def _settle(self) -> None:
        """Apply the removals since the last call to the cache and the drafter's state, in one gather each (a
        gather copies the whole cache, so not once per removal)."""
        if self._slot != list(range(self.kv.rows)):
            self.kv.select(self._slot)
            if self.drafter is not None:
                self.drafter.select(self._slot)
        self._slot = list(range(self.n))

    def swap_drafter(self, drafter: Eagle3BatchDrafter) -> None:
        """Draft with `drafter` for rows added from now on; the rows decoding now finish plain."""
        self._settle()
        drafter.add_idle(self.n)
        self.drafter = drafter
        self._followed = [False] * self.n
        self._held_aux = [[] for _ in range(self.n)]
        self._held_tok = [[] for _ in range(self.n)]

    # -- one cycle -------------------------------------------------------------------------------
    def cycle(self, spec: bool) -> list[list[int]]:
        """One cycle of every row: each row's new tokens (accepted drafts, then the target's next token).
        `spec`: draft for the followed rows (needs a shape for this many rows). Every forward of the target and
        the drafter runs under `varying_shape_attention`: their shapes change every cycle, and cuDNN's attention
        would build a plan for each new shape, which costs more than the cycle itself."""
        with torch.inference_mode(), varying_shape_attention(self.t.device):
            return self._cycle(spec)

    def _cycle(self, spec: bool) -> list[list[int]]:
        if self.n == 0:
            return []
        self._settle()
        b, dev = self.n, self.t.device
        drafting = [i for i in range(b) if self._followed[i]] if spec else []
        t0 = self._clock()
        if drafting:
            self._feed_held()
            tokens, parents = self._draft(drafting)  # [B, N], -1 = padding (rows not drafting, shorter trees)
        else:
            tokens = parents = torch.full((b, 0), -1, dtype=torch.long, device=dev)
        t1 = self._clock()
        n = tokens.shape[1]
        roots = torch.tensor(self._roots, dtype=torch.long, device=dev)  # [B]
        ids = torch.cat([roots[:, None], tokens.clamp(min=0)], dim=1)  # [B, N+1]
        parents1 = parents_with_root(parents)  # [B, N+1]
        anc = ancestry(parents1, n)  # [B, N+1, N+1]
        offsets = anc.sum(dim=-1) - 1  # [B, N+1] depth of each node
        lengths = list(self.kv.lengths)
        appended_at = self.kv.width
        logits, aux = batched_forward(self.t, ids, self.kv, anc, offsets)  # [B, N+1, V], [B, N+1, 3·Ht]
        tok_host = tokens.tolist()
        top = self._choose(logits, offsets, lengths)  # [B, N+1]
        constrained = any(g is not None for g in self._grammars)
        if constrained:  # the constrained rows' choices along the path they accept; their grammars follow
            known = top.tolist() if max(self._modes) != FILTERED else None  # kept where the grammar allows them
            walk_tree(self._grammars, tok_host, parents.tolist(), self._masked_choice(logits, offsets, lengths, top),
                      top=known)
        paths, nxt = accept_batch(tokens, parents1, anc, top)
        keep = [[0, *p] for p in paths]  # root + accepted nodes, offsets into the appended block
        self.kv.compact(appended_at, keep)
        self.depths = (offsets[:, 1:] * (tokens >= 0)).amax(dim=1).tolist() if n else [0] * b
        self.drafted = [sum(x >= 0 for x in row) for row in tok_host]  # on the host: no second device read
        new = [[tok_host[i][j - 1] for j in paths[i]] + [nxt[i]] for i in range(b)]
        self._roots = [t[-1] for t in new]
        if drafting:
            self._extend(aux, keep, new, drafting)
        elif self.drafter is not None:
            self._hold(aux, new)
        if self.timed:
            self.draft_s += t1 - t0
            self.verify_s += self._clock() - t1
        return new

    def _clock(self) -> float:
        if self.timed and self.t.device.type == "cuda":
            torch.cuda.synchronize(self.t.device)
        return time.perf_counter() if self.timed else 0.0

    def _draft(self, drafting: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded draft trees of every row, [B, N] tokens and parents; rows not drafting are all padding."""
        b, dev = self.n, self.t.device
        grammars = [self._grammars[i] for i in drafting]
        constrain = None
        if any(g is not None for g in grammars):  # drafts among the tokens each row's grammar allows
            constrain = lambda _s, f, t, p: frontier_allowed(grammars, f, t, p, self.t.vocab_size, dev)  # noqa: E731
        t, p = self.drafter.propose(drafting, self.shape_of(b), [self._sampling[i] for i in drafting],
                                    constrain)  # [R, N]
        if self.t.recurrent_layers and t.shape[1] and not torch.equal(p[0], torch.arange(-1, t.shape[1] - 1,
                                                                                          device=p.device)):
            raise ConfigError(self.t.tree_refusal)  # a recurrent state follows one chain
        tokens = torch.full((b, t.shape[1]), -1, dtype=torch.long, device=dev)  # [B, N]
        parents = tokens.clone()
        idx = torch.tensor(drafting, dtype=torch.long, device=dev)
        tokens[idx], parents[idx] = t.to(dev), p.to(dev)
        return tokens, parents

    def _choose(self, logits: torch.Tensor, offsets: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The target's token after each node [B, N+1]: argmax, or each sampled row's position-keyed draw, all rows
        in one draw (`SamplingRows.draw`, as the fast rows take theirs)."""
        mode = max(self._modes)
        if mode == GREEDY:
            return logits.argmax(dim=-1)  # [B, N+1]
        lengths_t = torch.tensor(lengths, device=logits.device)
        pos = lengths_t[:, None] + offsets + 1  # [B, N+1] position of the token each node predicts
        return self._draws.draw(logits, pos, mode, fused=logits.is_cuda)

    def _masked_choice(self, logits: torch.Tensor, offsets: torch.Tensor, lengths: list[int],
                       top: torch.Tensor) -> Choose:
        """`eagle3.decoding.grammar.walk_tree`'s choice for this cycle's logits [B, N+1, V]: the target's token after
        each row's node under its mask, written into `top` [B, N+1] for the walking rows."""
        rows = torch.arange(self.n, device=logits.device)

        def choose(nodes: list[int], masks: torch.Tensor, walking: list[bool]) -> list[int]:
            node = torch.tensor(nodes, device=logits.device)  # [B]
            allowed = allowed_tokens(masks.to(logits.device), logits.shape[-1])  # [B, V]
            at = logits[rows, node].masked_fill(~allowed, float("-inf"))[:, None]  # [B, 1, V]
            choice = self._choose(at, offsets[rows, node][:, None], lengths)[:, 0]  # [B]
            keep = torch.tensor(walking, device=logits.device)
            top[rows, node] = torch.where(keep, choice, top[rows, node])
            return choice.tolist()

        return choose

    # -- the drafter follows the rows ------------------------------------------------------------
    def _extend(self, aux: torch.Tensor | None, keep: list[list[int]], new: list[list[int]],
                drafting: list[int]) -> None:
        """Feed the drafter the kept features (root + accepted nodes) of the rows that drafted."""
        on = set(drafting)
        counts = [len(k) if i in on else 0 for i, k in enumerate(keep)]
        aux_rows = None
        if aux is not None:
            width = max(counts)
            gidx = torch.zeros(self.n, width, dtype=torch.long)  # [B, M] kept node offsets
            for i in drafting:
                gidx[i, : counts[i]] = torch.tensor(keep[i])
            gidx = gidx.to(aux.device)[:, :, None].expand(-1, -1, aux.shape[-1])  # [B, M, 3·Ht]
            aux_rows = aux.gather(1, gidx)  # [B, M, 3·Ht]
        self.drafter.extend(aux_rows, new, counts)

    def _hold(self, aux: torch.Tensor | None, new: list[list[int]]) -> None:
        """A plain cycle: hold each followed row's root features and new token back for the drafter."""
        # the roots only, copied: a view into `aux` [B, 1, 3·Ht] would keep the cycle's features alive
        roots = aux[:, 0].clone() if aux is not None else None  # [B, 3·Ht]
        for i in range(self.n):
            if self._followed[i]:
                if roots is not None:
                    self._held_aux[i].append(roots[i : i + 1])
                self._held_tok[i].extend(new[i])
        if max(len(t) for t in self._held_tok) >= self.feed_window:
            self._feed_held()

    def _feed_held(self) -> None:
        """Feed the drafter what plain cycles held back, in one batched extension."""
        counts = [len(t) for t in self._held_tok]
        if not any(counts):
            return
        ref = next((a[0] for a in self._held_aux if a), None)  # None: the drafter reads no features
        aux_rows = None if ref is None else ref.new_zeros(self.n, max(counts), ref.shape[-1])  # [B, M, 3·Ht]
        for i, c in enumerate(counts):
            if c and aux_rows is not None:
                aux_rows[i, :c] = torch.cat(self._held_aux[i])
        self.drafter.extend(aux_rows, self._held_tok, counts)
        self._held_aux = [[] for _ in range(self.n)]
        self._held_tok = [[] for _ in range(self.n)]
