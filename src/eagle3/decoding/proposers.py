"""Drafters behind one interface: a proposer sees what the target accepted and proposes a `DraftTree`.

    proposer.begin(prompt_ids, aux, first_token)   # after prefill
    tree = proposer.propose()                     # draft nodes after the last emitted token (the root)
    proposer.accept(aux_rows, next_tokens)        # after verification: features of the root and accepted
                                                  # nodes, paired with the token that followed each of them

Implementations: `NgramProposer` (prompt lookup), `NoDraftProposer` (plain decoding through the same engine),
`ModelProposer` (a small draft LM with the target's tokenizer; with the target itself it is the always-right
drafter the tests use), and `eagle3.decoding.drafters.Eagle3Proposer` (EAGLE-3: one row of the batch drafter).
"""

from __future__ import annotations

import abc

import torch

from eagle3.config import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, SamplingConfig
from eagle3.decoding.tree import DraftTree


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
