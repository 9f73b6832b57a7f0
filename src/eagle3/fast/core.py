"""The fixed-shape speculative cycle on device: draft a tree, verify it, accept greedily, compact the KV cache.

Every step reads and writes preallocated buffers only, takes no Python value that changes between calls, and
never copies to the host, so each step (or a whole cycle) can be replayed as one CUDA graph. Lengths are device
tensors. With N draft nodes and a maximum accepted depth D:

    state      length [1]     committed tokens in the target cache == committed drafter rows
               root [1]       last emitted token: verified this cycle, not yet in the cache
               last_out [1,H] drafter output of the newest committed row (EAGLE-3 only)
    tree       tree_tokens [N], tree_parents1 [N+1] (N+1 indexing, root's parent is itself), tree_valid [N]
    verify     top [N+1] (the target's choice after each node: argmax, or the request's position-keyed draw,
               `eagle3.decoding.sampling`); aux [N+1, 3·Ht]; anc [N+1, N+1]
    accept     keep [D+1] (N+1 indices of root + accepted path, padded with 0), n_acc [1],
               emitted [D+1] (accepted tokens, then the bonus token at index n_acc, padded)
               packet [D+3] = [n_acc, deepest drafted depth, emitted...]: the one thing the host reads per cycle

Worked example (chain, N = D = 3, length L = 10, drafts [a, b, c], target argmax after root/a/b/c = [a, b, x, y]):
match = [T, T, F] -> accepted nodes 1, 2 -> n_acc = 2, keep = [0, 1, 2, 0], emitted = [a, b, x, ·];
commit copies cache slots L + keep = [10, 11, 12, 10] to slots [10, 11, 12, 13] (slot 13 is garbage, beyond
the new length), feeds the drafter rows (aux of root, a, b) with tokens (a, b, x) at slots 10..12, and sets
root = x, length = 13.

Drafter cache layout: slot s < length is the committed drafter row at RoPE position s. Tree-expansion rows of
step j (1..depth-1) go to scratch slots length + (j-1)·k + [0, k); commit overwrites them.

Compiled drafting (`FastCore.compile_drafting`): every piece of the cycle that does not run the target's weights
(drafting, the verification's positions and mask, acceptance, feeding the drafter) can be compiled by inductor
into a few fused kernels, while the target's forward stays eager. The emitted tokens are then bit-identical to
an eager cycle's: the target's arithmetic is unchanged, acceptance is integer logic, and the drafter only decides
what is proposed (its roundings change which tokens are drafted, never which are emitted).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from eagle3.config import DraftShape
from eagle3.decoding.expand import coupled_top_k, expand_tree
from eagle3.decoding.sampling import GREEDY, SamplingRows
from eagle3.decoding.tree import ancestry, path_slots
from eagle3.decoding.verify import accept_rows
from eagle3.fast.drafter import FastDrafter, draft_top_k_op_for, ranked_top_k
from eagle3.fast.graphs import CompiledPieces
from eagle3.fast.target import FastTarget

MODES = ("none", "eagle3", "host")
# The pieces of a cycle that never run the target's weights (`FastCore.compile_drafting`).
DRAFTING_PIECES = ("draft", "tree_inputs", "accept", "feed")


def prefix_and_window(ar: torch.Tensor, length: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Bool mask [R, S]: slots below `length` (the committed prefix), and slots length + j for j < W where
    window[r, j] (ar = arange(S); length [1]; window bool [R, W]). A scatter of `window` into the prefix mask,
    written as a gather so that compiled pieces fuse it (see `eagle3.decoding.expand._place`)."""
    rel = ar - length  # [S] slot relative to the first uncommitted one
    w = window.shape[-1]
    inside = window.gather(1, rel.clamp(0, w - 1)[None].expand(window.shape[0], -1))  # [R, S]
    return torch.where((rel >= 0) & (rel < w), inside, rel < 0)


class FastCore(nn.Module):
    """Static buffers and step functions of one decoding setup (mode, draft shape); see the module docstring.

    mode "none": plain decoding (N = 0). "eagle3": the drafter drafts `shape` (a tree, or a chain at top_k 1)
    every cycle. "host": the host writes a tree of at most `max_nodes` nodes into the tree buffers before each
    cycle (n-gram, test doubles).
    """

    def __init__(
        self,
        target: FastTarget,
        mode: str,
        drafter: FastDrafter | None = None,
        shape: DraftShape | None = None,
        max_nodes: int = 0,
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: expected one of {MODES}")
        if (mode == "eagle3") != (drafter is not None and shape is not None):
            raise ValueError("a drafter and a draft shape are needed for mode 'eagle3' and only there")
        self.target, self.drafter, self.mode = target, drafter, mode
        if mode == "eagle3":
            self.shape = shape
            self.top_k, self.depth, self.n_nodes = shape.top_k, shape.depth, shape.total
            self.max_depth = shape.depth
            self.scratch = shape.scratch  # drafter rows of tree expansion
        elif mode == "host":
            self.n_nodes = self.max_depth = max_nodes
            self.top_k = self.depth = self.scratch = 0
        else:
            self.n_nodes = self.max_depth = self.top_k = self.depth = self.scratch = 0
        if mode != "none" and self.n_nodes < 1:
            raise ValueError(f"mode {mode!r} needs at least one draft node")
        n, d = self.n_nodes, self.max_depth
        dev = target.device
        self.register_buffer("length", torch.zeros(1, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("root", torch.zeros(1, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("ar", torch.arange(max(n, d, self.top_k) + 2, device=dev), persistent=False)
        self.register_buffer("tree_tokens", torch.zeros(n, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("tree_parents1", torch.zeros(n + 1, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("tree_valid", torch.ones(n, dtype=torch.bool, device=dev), persistent=False)
        self.register_buffer("top", torch.zeros(n + 1, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("anc", torch.zeros(n + 1, n + 1, dtype=torch.bool, device=dev), persistent=False)
        self.register_buffer("keep", torch.zeros(d + 1, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("n_acc", torch.zeros(1, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("emitted", torch.zeros(d + 1, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("packet", torch.zeros(d + 3, dtype=torch.long, device=dev), persistent=False)
        if drafter is not None:
            ht3 = 3 * target.hidden_size
            self.register_buffer("aux", torch.zeros(n + 1, ht3, dtype=target.dtype, device=dev), persistent=False)
            self.register_buffer("last_out", torch.zeros(1, drafter.hidden_size, dtype=drafter.dtype, device=dev),
                                 persistent=False)
        self.register_buffer("ar_s", None, persistent=False)
        self.register_buffer("ar_sd", None, persistent=False)
        for name in ("pre_ids", "pre_len", "pre_first", "pre_logits", "pre_aux"):  # `allocate_prefill`
            self.register_buffer(name, None, persistent=False)
        # the request's sampling settings (one row), read by cycles captured for a sampled mode
        self.sampling = SamplingRows(1, target.vocab_size, dev)
        self.fused_sampling = dev.type == "cuda"  # the draw as one compiled kernel inside the captured cycle
        self.pieces = CompiledPieces(self)  # `compile_drafting`
        self.ranked = False  # how drafting picks its top-k: ranked where it is compiled on CUDA (`ranked_top_k`)
        # the draft steps' log-softmax and top-k as two Triton kernels (`eagle3.fast.draft_top_k`) where they can
        # run; None: as PyTorch work (`top_k_last` of `FastDrafter.log_probs`)
        self.top_k_op = draft_top_k_op_for(drafter, self.top_k)
        # Sampled requests draft with the noise of the target's own draws (`choose_drafts`); False: the drafter's
        # top-k, as for greedy ones (`FastOptions.coupled_drafts`)
        self.coupled = True
        # A chain's drafting stops once the drafted tokens' joint draft probability falls below this, and only the
        # drafted tokens are verified (`draft_chain_until`); None: every cycle drafts `depth` tokens. The host
        # reads each step's score, so only cycles that run eagerly take it (`FastOptions.chain_stop`: CPUs).
        self.chain_stop: float | None = None
        # `feed` gives the drafter only the n_acc + 1 accepted rows, read on the host, instead of all D + 1: where
        # cycles run eagerly on a CPU (the host read costs nothing there); fixed shapes everywhere else
        self.feed_accepted_only = self.device.type == "cpu"
        self._valid_all = True  # tree_valid is all True (what `draft`'s trees assume)
        if drafter is not None:  # the rows of plain steps the drafter has not seen yet (`plain_step`)
            self.register_buffer("backlog_aux", torch.zeros(self.BACKLOG, 3 * target.hidden_size,
                                                            dtype=target.dtype, device=dev), persistent=False)
            self.register_buffer("backlog_tok", torch.zeros(self.BACKLOG, dtype=torch.long, device=dev),
                                 persistent=False)
            self.register_buffer("backlog_at", torch.zeros(1, dtype=torch.long, device=dev), persistent=False)
        self.backlog_n = 0  # the same count, on the host

    @property
    def device(self) -> torch.device:
        return self.length.device

    # -- allocation ----------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.target.seq_len

    def slots_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Target cache slots for one request: prompt, output, one verification beyond the end (the pipelined
        cycle the host launches before it reads that generation stopped), and compaction padding."""
        return prompt_len + max_new_tokens + 2 * (self.n_nodes + 1) + self.max_depth + 2

    @torch.no_grad()
    def allocate(self, seq_len: int) -> None:
        """Size the caches for `seq_len` target slots (the drafter gets room for its scratch rows too)."""
        self.target.allocate(seq_len)
        dev = self.device
        self.ar_s = torch.arange(seq_len, device=dev)
        if self.drafter is not None:
            sd = -(-(seq_len + max(self.scratch, self.max_depth + 1)) // 128) * 128  # aligned, as the target
            self.drafter.allocate(sd)
            self.ar_sd = torch.arange(sd, device=dev)

    def alloc_ids(self) -> tuple[int, int]:
        """Changes whenever a cache this core uses was reallocated (graphs captured before are stale)."""
        return self.target.alloc_id, (self.drafter.alloc_id if self.drafter is not None else 0)

    @torch.no_grad()
    def reset(self) -> None:
        """Zero the state scalars (after graph warm-up, which runs real cycles on whatever is in the buffers)."""
        self.length.zero_()
        self.root.zero_()
        self.backlog_n = 0
        if self.drafter is not None:
            self.last_out.zero_()
            self.backlog_at.zero_()

    def compile_drafting(self, backend: str | Callable = "inductor", mode: str | None = None) -> None:
        """Compile the cycle's pieces that do not run the target (`DRAFTING_PIECES`) with inductor from now on;
        they compile on first use (call before capturing graphs). A piece that fails to compile logs a warning
        and runs eagerly (`CompiledPieces`). Emitted tokens are unchanged (module docstring). `mode`: see
        `CompiledPieces.compile` (an experiment of `scripts/profile_step.py --drafting-mode`)."""
        names = [n for n in DRAFTING_PIECES if self.drafter is not None or n in ("tree_inputs", "accept")]
        self.pieces.compile(names, backend, mode=mode)
        self.ranked = ranked_top_k(self.device)

    @staticmethod
    def drafting_compiled_by_default(device: torch.device) -> bool:
        """`compile_drafting`'s default: on CUDA."""
        return torch.device(device).type == "cuda"

    @property
    def drafting_compiled(self) -> bool:
        return bool(self.pieces)

    def piece(self, name: str, *args):
        """Piece `name` of the cycle, compiled if `compile_drafting` asked for it."""
        return self.pieces.run(name, *args)

    # -- prefill (eager, variable length) -------------------------------------------------------
    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompt [T] into slots 0..T-1; returns next-token logits [V] and aux [T, 3·Ht] (EAGLE-3)."""
        t = prompt.shape[0]
        pos = torch.arange(t, device=self.device)  # [T]
        mask = self.ar_s[None, :] <= pos[:, None]  # [T, S] causal
        logits, aux = self.target(prompt, pos, pos, mask, last_only=True, want_aux=self.drafter is not None)
        return logits[0], aux

    # -- prefill in fixed widths (what the engine captures with `FastOptions.graph_prefill`) ----------
    def allocate_prefill(self) -> None:
        """Input and output buffers of `prefill_fixed`/`begin_fixed` for prompts of up to `seq_len` tokens."""
        s, dev = self.seq_len, self.device
        self.pre_ids = torch.zeros(s, dtype=torch.long, device=dev)  # [S] the prompt, then leftovers (padding)
        self.pre_len = torch.ones(1, dtype=torch.long, device=dev)  # [1] the prompt's length T
        self.pre_first = torch.zeros(1, dtype=torch.long, device=dev)  # [1] in for begin_fixed: the first new token
        self.pre_logits = torch.zeros(self.target.vocab_size, dtype=self.target.dtype, device=dev)  # [V] out
        self.pre_aux = (torch.zeros(s, 3 * self.target.hidden_size, dtype=self.target.dtype, device=dev)
                        if self.drafter is not None else None)  # [S, 3·Ht] out

    def prefill_fixed(self, width: int) -> None:
        """`prefill` of the T = pre_len tokens in pre_ids, run over `width` >= T tokens so that its shapes stay
        fixed: next-token logits at T-1 into pre_logits, aux into pre_aux. The padding writes K/V into slots
        T..width-1, which every later step masks out until it has written them itself (as `FastRows` padding)."""
        ids, pos = self.pre_ids[:width], self.ar_s[:width]  # [W], [W]
        mask = self.ar_s[None, :] <= pos[:, None]  # [W, S] causal
        logits, aux = self.target(ids, pos, pos, mask, want_aux=self.drafter is not None,
                                  logits_at=self.pre_len - 1)  # [1, V], [W, 3·Ht]
        self.pre_logits.copy_(logits[0])
        if aux is not None:
            self.pre_aux[:width].copy_(aux)

    def begin_fixed(self, width: int) -> None:
        """`begin` after `prefill_fixed(width)`, with the first new token in pre_first."""
        n = self.pre_len  # [1]
        if self.drafter is not None:
            ids, pos = self.pre_ids[:width], self.ar_s[:width]  # [W], [W]
            mask = self.ar_sd[None, :] <= pos[:, None]  # [W, Sd]
            nxt = torch.cat([ids[1:], ids[:1]]).scatter(0, n - 1, self.pre_first)  # [W]: x_{t+1}, first at T-1
            out = self.drafter(self.drafter.combine(self.pre_aux[:width]), nxt, pos, pos, mask)  # [W, H]
            self.last_out.copy_(out.index_select(0, n - 1))
            self.backlog_at.zero_()  # a request starts with no plain steps waiting (the host's count: `_generate`)
        self.root.copy_(self.pre_first)
        self.length.copy_(n)

    def begin(self, prompt: torch.Tensor, aux: torch.Tensor | None, first: torch.Tensor) -> None:
        """After prefill: drafter rows for the prompt (row t pairs features g_t with token x_{t+1}), state."""
        t = prompt.shape[0]
        if self.drafter is not None:
            pos = torch.arange(t, device=self.device)
            mask = self.ar_sd[None, :] <= pos[:, None]  # [T, Sd]
            hidden = self.drafter.combine(aux)  # [T, H]
            out = self.drafter(hidden, torch.cat([prompt[1:], first]), pos, pos, mask)  # [T, H]
            self.last_out.copy_(out[-1:])
            self.backlog_at.zero_()
        self.root.copy_(first)
        self.length.fill_(t)
        self.backlog_n = 0

    # -- step functions (fixed shapes, no host sync) ------------------------------------------
    def draft(self, mode: int = GREEDY, until: Callable[[torch.Tensor], bool] | None = None) -> int:
        """The EAGLE-2 tree (`eagle3.decoding.expand`) into the tree buffers; each node's children as
        `choose_drafts` picks them for `mode`. Expansion step j writes the drafter's scratch slots
        length + (j-1)·k + [0, k). `until`: see `expand_tree` (nodes past the ones drafted stay invalid).
        Returns the number of nodes drafted."""
        d, k, length = self.drafter, self.top_k, self.length  # length [1]

        def children(out: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:  # out [1, T, H]
            lp, ids = self.choose_drafts(out[0], length + 1 + step, mode)  # [T, k]
            return lp[None], ids[None]

        def run(step: int, hidden: torch.Tensor, tokens: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
            slots = length + (step - 1) * k + self.ar[:k]  # [k] this step's scratch slots
            mask = prefix_and_window(self.ar_sd, length, anc[0])  # [k, Sd]: committed rows + ancestry in scratch
            pos = (length - 1 + step).expand(k)  # [k] all frontier rows share one position
            return d(hidden[0], tokens[0], pos, slots, mask)[None]  # [1, k, H]

        tokens, parents = expand_tree(self.last_out, self.shape, children, run, d.feedback, d.to_target_ids,
                                      self.ranked, until)  # [1, n] each
        n = tokens.shape[1]
        if n < self.n_nodes:  # invalid nodes: token 0, hanging off the root
            self.tree_tokens.zero_()
            self.tree_parents1.zero_()
            self.tree_valid.copy_(self.ar[: self.n_nodes] < n)
            self._valid_all = False
        self.tree_tokens[:n].copy_(tokens[0])
        self.tree_parents1[1 : n + 1].copy_(parents[0] + 1)
        self.tree_parents1[:1].zero_()
        return n

    def draft_chain_until(self, mode: int = GREEDY) -> int:
        """Draft a chain of at most `depth` tokens, stopping after the first token whose chain's joint draft
        probability (the product of the drafter's top-1 probabilities so far) is below `chain_stop`; the rest of
        the tree buffers become invalid nodes. Returns the number of tokens drafted (at least one): the same
        proposals as `draft` up to where it stops, one host read per drafted token."""
        stop = self.chain_stop
        return self.draft(mode, until=lambda scores: float(scores.exp().max()) < stop)

    def choose_drafts(self, out: torch.Tensor, pos: torch.Tensor,
                      mode: int = GREEDY) -> tuple[torch.Tensor, torch.Tensor]:
        """The `top_k` drafts after each of the drafter's outputs out [T, H], all candidates for the token at
        absolute position `pos` [1]: their draft log-probabilities [T, k] (what a tree ranks its paths by: a child
        never scores above its parent) and draft-vocabulary ids [T, k]. Greedy: the drafter's top k. Sampled
        (`coupled`): `coupled_top_k`, the first coupled to the target's own draw. A draft is accepted where it
        equals the target's draw either way: the output is the target's."""
        if mode == GREEDY or not self.coupled:
            return self.draft_top_k(out)
        d = self.drafter
        lq, ids = coupled_top_k(d.logits(out)[None], pos, self.sampling, mode, d.draft_h, self.top_k, self.ranked)
        return lq[0], ids[0]  # [T, k] each

    def draft_top_k(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `top_k` best draft tokens after each of the drafter's pre-norm outputs out [T, H]: their
        log-probabilities [T, k] (fp32, descending) and draft-vocabulary ids [T, k]."""
        return self.drafter.top_k(out, self.top_k, self.top_k_op, self.ranked)

    def tree_inputs(self, by_paths: bool) -> tuple[torch.Tensor | None, ...]:
        """What the verification forward reads: ids [N+1] (root, nodes), RoPE positions length + depth [N+1],
        cache slots length + [0, N] [N+1], the ancestry [N+1, N+1], and how the target sees the cache: with
        `by_paths` (it attends by `eagle3.fast.split_attention.Paths`), each node's path by depth, tail [N+1, D+1]
        (the slot of its ancestor at depth j, j <= its depth), else the mask [N+1, S] (committed prefix, each
        node's ancestors and itself); the other is None."""
        n1 = self.n_nodes + 1
        length = self.length
        ids = torch.cat([self.root, self.tree_tokens])  # [N+1]
        anc = ancestry(self.tree_parents1, self.max_depth)  # [N+1, N+1]
        pos = length + anc.sum(dim=-1) - 1  # [N+1]
        slots = length + self.ar[:n1]  # [N+1]
        mask = tail = None
        if not by_paths:
            mask = prefix_and_window(self.ar_s, length, anc)  # [N+1, S] the prefix, each node's ancestors, itself
        elif n1 == 1:  # plain steps: the root alone
            tail = length[None]  # [1, 1]
        else:
            tail = path_slots(anc, length, self.max_depth)  # [N+1, D+1]
        return ids, pos, slots, mask, anc, tail

    def choose(self, logits: torch.Tensor, pos: torch.Tensor, mode: int) -> torch.Tensor:
        """The target's token after each of logits [M, V] at RoPE positions `pos` [M] (each predicts the token at
        pos + 1): the argmax (GREEDY) or the request's position-keyed draw (`self.sampling`). [M]."""
        if mode == GREEDY:
            return self.target.argmax(logits)
        return self.sampling.draw(logits[None], (pos + 1)[None], mode, self.fused_sampling)[0]

    def verify(self, mode: int = GREEDY, rows: int | None = None) -> None:
        """Target forward over [root, nodes] at positions length + depth, cache slots length + [0, N], and the
        target's choice after each node; with `rows` (a chain drafted by `draft_chain_until`), over the first
        `rows` of them only, the others' choice left at -1 (no token)."""
        by_paths = self.target.by_splits(self.n_nodes + 1)  # decided here: compiled pieces cannot tell
        ids, pos, slots, mask, anc, tail = self.piece("tree_inputs", by_paths)
        m = ids.shape[0] if rows is None else rows
        logits, aux = self.target(ids[:m], pos[:m], slots[:m], None if by_paths else mask[:m],
                                  want_aux=self.drafter is not None,
                                  path=(self.length, tail[:m]) if by_paths else None)  # [m, V]
        self.top[:m].copy_(self.choose(logits, pos[:m], mode))
        if rows is not None:
            self.top[m:].fill_(-1)
        if aux is not None:
            self.aux[:m].copy_(aux)
        self.anc.copy_(anc)

    def accept(self) -> None:
        """Acceptance against the target's choices, on device (`eagle3.decoding.verify.accept_rows`)."""
        top = self.top  # [N+1]
        if self.n_nodes == 0:  # plain decoding's cycle: a few writes, not `accept_rows`'s kernels
            self.keep.zero_()
            self.n_acc.zero_()
            self.emitted.copy_(top[:1])
            self.packet.copy_(torch.cat([self.n_acc, self.n_acc, top[:1]]))
            return
        acc = accept_rows(self.tree_tokens[None], self.tree_parents1[None], self.anc[None], top[None],
                          self.max_depth, self.tree_valid[None], self.root)
        self.keep.copy_(acc.keep[0])
        self.n_acc.copy_(acc.n_acc)
        self.emitted.copy_(acc.emitted[0])
        self.packet.copy_(torch.cat([acc.n_acc, acc.drafted, acc.emitted[0]]))

    def commit(self) -> None:
        """Move the accepted path's K/V next to the prefix, then `feed`."""
        if self.max_depth > 0:
            length, t = self.length, self.target
            dst = length + self.ar[: self.max_depth + 1]  # [D+1]
            src = length + self.keep  # [D+1], src >= dst elementwise: gather first, then write
            t.kv_cache.index_copy_(2, dst, t.kv_cache.index_select(2, src))  # [L, 2·nkv, D+1, hd] K and V
        self.piece("feed")

    def feed(self) -> None:
        """Feed the drafter the accepted rows (EAGLE-3), advance root and length. Fixed shapes feed all D+1 rows
        (those after n_acc are padding, overwritten before any row reads them); with `feed_accepted_only` (eager
        cycles on a CPU) only the n_acc + 1 that count."""
        length, keep, n_acc = self.length, self.keep, self.n_acc
        if self.drafter is not None:
            m = self.max_depth + 1
            if self.feed_accepted_only and not torch.compiler.is_compiling():
                m = int(n_acc) + 1
            dst = length + self.ar[:m]  # [m]
            hidden = self.drafter.combine(self.aux.index_select(0, keep[:m]))  # [m, H]
            mask = self.ar_sd[None, :] <= dst[:, None]  # [m, Sd] committed rows + causal
            out = self.drafter(hidden, self.emitted[:m], dst, dst, mask)  # [m, H]
            self.last_out.copy_(out.index_select(0, n_acc))  # n_acc < m either way
        self.root.copy_(self.emitted.gather(0, n_acc))
        self.length.add_(n_acc + 1)

    # -- plain steps between cycles (`eagle3.decoding.guard`) --------------------------------------
    BACKLOG = 64  # plain steps whose rows wait for the drafter at most; then they are fed together

    def plain_verify(self, mode: int = GREEDY) -> None:
        """A plain step's fixed-shape work (what the engine captures): the root alone through the target (the
        tree's buffers untouched: the step costs what plain decoding's does), advance by the target's token, and
        put the root's aux row and that token in the backlog's next slot."""
        length = self.length  # [1]: the root's slot and RoPE position
        if self.target.by_splits(1):  # by position: the prefix, then the root at its own slot
            mask, path = None, (length, length[None])
        else:
            mask, path = self.ar_s[None, :] <= length, None  # [1, S] the prefix and the root itself
        logits, aux = self.target(self.root, length, length, mask, want_aux=self.drafter is not None,
                                  path=path)  # [1, V]
        tok = self.choose(logits, length, mode)  # [1]
        self.n_acc.zero_()
        self.keep.zero_()
        self.emitted[:1].copy_(tok)
        self.packet[:3].copy_(torch.cat([self.n_acc, self.n_acc, tok]))  # [n_acc 0, drafted 0, token]
        if self.drafter is not None:
            self.backlog_aux.index_copy_(0, self.backlog_at, aux)
            self.backlog_tok.index_copy_(0, self.backlog_at, tok)
            self.backlog_at.add_(1)
        self.root.copy_(tok)
        length.add_(1)

    def plain_step(self, mode: int = GREEDY, run: Callable[[], None] | None = None) -> None:
        """One step without drafting: `plain_verify`, eagerly or by `run` (its captured graph). The drafter sees
        the step's row later, when `feed_backlog` runs before it next drafts (or here, once the backlog is full)."""
        if self.drafter is not None and self.backlog_n == self.BACKLOG:
            self.feed_backlog()
        if run is None:
            self.plain_verify(mode)
        else:
            run()
        self.backlog_n += self.drafter is not None

    def feed_backlog(self) -> None:
        """Feed the drafter the rows of the plain steps since it last drafted, in one forward (see `feed`)."""
        m = self.backlog_n
        if m == 0:
            return
        dst = self.length - m + self.ar_s[:m]  # [m] their slots: the m positions before `length`
        hidden = self.drafter.combine(self.backlog_aux[:m])  # [m, H]
        mask = self.ar_sd[None, :] <= dst[:, None]  # [m, Sd]
        out = self.drafter(hidden, self.backlog_tok[:m], dst, dst, mask)  # [m, H]
        self.last_out.copy_(out[m - 1 :])
        self.backlog_n = 0
        self.backlog_at.zero_()

    # -- whole cycles (what the engine captures) ----------------------------------------------
    def cycle(self, mode: int = GREEDY) -> None:
        """Draft, verify, accept, commit: one whole cycle, choosing tokens by `mode` (what the engine captures)."""
        rows = None
        if self.mode == "eagle3" and self.chain_stop is not None and self.top_k == 1:
            rows = self.draft_chain_until(mode) + 1  # root and the drafted tokens
        elif self.mode == "eagle3":
            if not self._valid_all:  # after `draft_chain_until`: every node valid again
                self.tree_valid.fill_(True)
                self._valid_all = True
            self.piece("draft", mode)
        self.verify(mode, rows=rows)
        self.piece("accept")
        self.commit()

    # -- host-side helpers (outside graphs) -------------------------------------------------
    def load_tree(self, tokens: list[int], parents: list[int]) -> None:
        """Write a host tree (parents: -1 = root, earlier node otherwise) padded to N invalid root children."""
        n = self.n_nodes
        m = len(tokens)
        if m > n:
            raise ValueError(f"the proposer drafted {m} nodes; this engine was built for at most {n}")
        pad = n - m
        host = torch.tensor([*tokens, *([0] * pad), 0, *[p + 1 for p in parents], *([0] * pad),
                             *([1] * m), *([0] * pad)], dtype=torch.long)
        host = host.to(self.device, non_blocking=False)
        self.tree_tokens.copy_(host[:n])
        self.tree_parents1.copy_(host[n : 2 * n + 1])
        self.tree_valid.copy_(host[2 * n + 1 :].bool())
