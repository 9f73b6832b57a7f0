"""Drafters behind one interface: a proposer sees what the target accepted and proposes a `DraftTree`.

    proposer.begin(prompt_ids, aux, first_token)   # after prefill
    tree = proposer.propose()                     # draft nodes after the last emitted token (the root)
    proposer.accept(aux_rows, next_tokens)        # after verification: features of the root and accepted
                                                  # nodes, paired with the token that followed each of them

Implementations: `Eagle3Proposer` (chain or EAGLE-2 dynamic tree), `NgramProposer` (prompt lookup),
`NoDraftProposer` (plain decoding through the same engine), `ModelProposer` (a small draft LM with the
target's tokenizer; with the target itself it is the always-right drafter the tests use).
"""

from __future__ import annotations

import abc
from dataclasses import replace

import torch

from eagle3.config import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DraftShape, SamplingConfig
from eagle3.decoding.expand import coupled_top_k, expand_tree
from eagle3.decoding.sampling import GREEDY, SamplingRows, sampling_mode, token_hash
from eagle3.decoding.tree import DraftTree
from eagle3.drafter import DrafterKV, Eagle3Drafter


class Proposer(abc.ABC):
    """Base class; `name` is what stats and run records call it."""

    name = "none"
    needs_aux = False  # whether `accept` needs the target's aux features

    def begin(self, prompt_ids: torch.Tensor, aux: torch.Tensor | None, first_token: int) -> None:  # noqa: B027
        """After prefill: the prompt, its aux features (if `needs_aux`) and the first sampled token."""

    def sample_with(self, sampling: SamplingConfig, seed: int) -> None:  # noqa: B027
        """Before `begin`: the request's sampling settings and the seed of its draws."""

    @abc.abstractmethod
    def propose(self) -> DraftTree:
        """The draft nodes below the root (the last emitted token)."""

    def accept(self, aux_rows: torch.Tensor | None, next_tokens: torch.Tensor) -> None:  # noqa: B027
        """After verification: aux rows of the root and accepted nodes, and the token following each."""


class NoDraftProposer(Proposer):
    """Plain autoregressive decoding: every cycle verifies the root alone."""

    name = "none"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def propose(self) -> DraftTree:
        return DraftTree.empty(self.device)


class NgramProposer(Proposer):
    """Prompt lookup decoding: match the longest recent n-gram earlier in the context, propose what followed.

    As HF `PromptLookupCandidateGenerator` (transformers `generation/candidate_generator.py`), but the most
    recent earlier match wins, which tracks the text being written more closely.
    """

    name = "ngram"

    def __init__(self, length: int, ngram_max: int = DEFAULT_NGRAM_MAX, ngram_min: int = DEFAULT_NGRAM_MIN,
                 device: torch.device | str = "cpu"):
        self.length, self.ngram_max, self.ngram_min = length, ngram_max, ngram_min
        self.device = torch.device(device)
        self.tokens: list[int] = []

    def begin(self, prompt_ids, aux, first_token):
        self.tokens = [int(t) for t in prompt_ids.view(-1).tolist()] + [int(first_token)]

    def accept(self, aux_rows, next_tokens):
        self.tokens.extend(int(t) for t in next_tokens.view(-1).tolist())

    def propose(self) -> DraftTree:
        toks = self.tokens
        for n in range(min(self.ngram_max, len(toks) - 1), self.ngram_min - 1, -1):
            tail = toks[-n:]
            # scan backwards for the most recent earlier occurrence whose continuation is non-empty
            for start in range(len(toks) - n - 1, -1, -1):
                if toks[start : start + n] == tail:
                    cont = toks[start + n : start + n + self.length]
                    if cont:
                        return DraftTree.chain(torch.tensor(cont, dtype=torch.long, device=self.device))
        return DraftTree.empty(self.device)


class ModelProposer(Proposer):
    """A draft language model sharing the target's vocabulary, drafting a greedy chain of `length` tokens."""

    name = "model"

    def __init__(self, model, length: int):
        from eagle3.target import Target  # local: Target wraps any HF causal LM

        self.model = model.eval()
        self.length = length
        self._target = Target(model, aux_layer_ids=[])
        self.cache = None
        self.pending: list[int] = []

    @property
    def device(self):
        return self._target.device

    def begin(self, prompt_ids, aux, first_token):
        self.cache = self._target.new_cache()
        self._target.forward(prompt_ids.view(1, -1).to(self.device), self.cache, logits_to_keep=1)
        self.pending = [int(first_token)]

    def accept(self, aux_rows, next_tokens):
        self.pending.extend(int(t) for t in next_tokens.view(-1).tolist())

    def propose(self) -> DraftTree:
        stable = self.cache.get_seq_length()
        inp = torch.tensor([self.pending], device=self.device)
        drafts = []
        for _ in range(self.length):
            logits, _ = self._target.forward(inp, self.cache, logits_to_keep=1)
            nxt = int(logits[0, -1].argmax())
            drafts.append(nxt)
            inp = torch.tensor([[nxt]], device=self.device)
        # keep only the context positions; the last pending token is fed again next cycle
        self._target.crop(self.cache, stable + len(self.pending) - 1)
        self.pending = self.pending[-1:]
        return DraftTree.chain(torch.tensor(drafts, dtype=torch.long, device=self.device))


class Eagle3Proposer(Proposer):
    """EAGLE-3 drafting: a chain (top-1) or the EAGLE-2 dynamic tree (`eagle3.decoding.expand`).

    Drafter row t pairs target features g_t with token x_{t+1} at RoPE position t (reference §A.3). The
    drafter cache keeps only rows computed from target features; tree-expansion rows are dropped after
    each proposal.
    """

    name = "eagle3"
    needs_aux = True

    def __init__(self, drafter: Eagle3Drafter, shape: DraftShape, coupled: bool = True):
        """`coupled`: sampled requests draft coupled to the target's draws (`coupled_top_k`); False:
        the drafter's top-k, as greedy requests do."""
        self.drafter = drafter.eval()
        self.shape = shape
        self.coupled = coupled
        self.draws: tuple[SamplingRows, int] | None = None  # a sampled request's settings and mode
        self.draft_h: torch.Tensor | None = None  # [Vd] noise keys of the draft vocabulary, on first sampled use
        self.cache = DrafterKV()
        self.next_pos = 0  # RoPE position of the next target-feature row
        self.last_out: torch.Tensor | None = None  # [1, H] pre-norm output of the newest row
        # accepted rows not fed to the drafter yet: fed together by the next `propose`, so cycles that do not
        # draft (`eagle3.decoding.guard`) run no drafter forward
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def device(self):
        return self.drafter.fc.weight.device

    @torch.inference_mode()
    def _extend(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Append target-feature rows: aux [1, m, 3Ht] with the token following each row, [m]."""
        d = self.drafter
        m = aux.shape[1]
        hidden = d.combine(aux.to(self.device))  # [1, m, H]
        pos = torch.arange(self.next_pos, self.next_pos + m, device=self.device)[None]  # [1, m]
        out = d(hidden, next_tokens.view(1, m).to(self.device), pos, mask=None, cache=self.cache)  # [1, m, H]
        self.next_pos += m
        self.last_out = out[:, -1]  # [1, H]

    def sample_with(self, sampling, seed):
        mode = sampling_mode(sampling.temperature, sampling.top_p, sampling.top_k)
        if mode == GREEDY or not self.coupled:
            self.draws = None
            return
        rows = SamplingRows(1, None, self.device)
        rows.set(0, [replace(sampling, seed=seed)])
        self.draws = (rows, mode)

    def _children(self, out: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k drafts after each of the drafter's outputs out [1, T, H], candidates for the token at
        absolute `position`: their log-probabilities [1, T, k] (a tree ranks paths by them) and draft ids.
        Greedy: the drafter's top k; sampled: coupled to the target's draws (`coupled_top_k`)."""
        logits, k = self.drafter.logits(out), self.shape.top_k  # [1, T, Vd]
        if self.draws is None:
            return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        rows, mode = self.draws
        if self.draft_h is None:
            vd = logits.shape[-1]
            self.draft_h = token_hash(self.drafter.draft_ids_to_target(torch.arange(vd, device=self.device)))
        return coupled_top_k(logits, torch.tensor([position], device=self.device), rows, mode, self.draft_h, k)

    def begin(self, prompt_ids, aux, first_token):
        self.cache = DrafterKV()
        self.next_pos = 0
        self.pending = []
        ids = prompt_ids.view(-1).to(self.device)
        next_tokens = torch.cat([ids[1:], torch.tensor([first_token], device=self.device)])  # x_1..x_T
        self._extend(aux, next_tokens)

    def accept(self, aux_rows, next_tokens):
        self.pending.append((aux_rows.view(1, -1, aux_rows.shape[-1]), next_tokens.view(-1)))

    @torch.inference_mode()
    def propose(self) -> DraftTree:
        if self.pending:
            aux, tokens = zip(*self.pending, strict=True)
            self.pending = []
            self._extend(torch.cat(aux, dim=1), torch.cat(tokens))
        d, k, dev = self.drafter, self.shape.top_k, self.device
        stable = self.cache.length
        p_last = self.next_pos - 1  # RoPE position of the newest committed row

        def run(step: int, hidden: torch.Tensor, tokens: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
            # the cache holds the committed rows, then k expansion rows per step so far
            mask = torch.cat([torch.ones(1, k, stable, dtype=torch.bool, device=dev), anc], dim=2)[:, None]
            pos = torch.full((1, k), p_last + step, device=dev)
            return d(hidden, tokens, pos, mask=mask, cache=self.cache)  # [1, k, H]

        def children(out: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self._children(out, p_last + 2 + step)  # the first drafts are for the token at p_last + 2

        tokens, parents = expand_tree(self.last_out, self.shape, children, run, d.feedback, d.draft_ids_to_target)
        self.cache.crop(stable)
        return DraftTree(tokens=tokens[0], parents=parents[0])
