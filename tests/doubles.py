"""Test drafters: scripted to be right exactly k times per cycle, as a chain or inside a tree; `proposer` builds
the kinds the lossless tests run (always right, random EAGLE-3, scripted)."""

from __future__ import annotations

import torch

from eagle3.config import DraftShape
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.decoding.proposers import ModelProposer, Proposer
from eagle3.decoding.tree import DraftTree


class ScriptedProposer(Proposer):
    """Knows the reference continuation; each cycle drafts `k` right tokens, then wrong ones.

    chain: [r1 .. rk, w, w, ...] (length `length`)
    tree:  at each of the first k levels a wrong sibling comes first and the right token second; below the
           right node the chain goes on with wrong tokens, so exactly k drafts can be accepted.
    """

    name = "scripted"

    def __init__(self, reference: list[int], k: int, length: int, vocab_size: int, tree: bool = False):
        self.reference, self.k, self.length, self.vocab, self.tree = reference, k, length, vocab_size, tree
        self.emitted = 0

    def begin(self, prompt_ids, aux, first_token):
        self.emitted = 1

    def accept(self, aux_rows, next_tokens):
        self.emitted += next_tokens.numel()

    def _right(self, i: int) -> int:
        j = self.emitted + i
        return self.reference[j] if j < len(self.reference) else 0

    def _wrong(self, i: int) -> int:
        return (self._right(i) + 1 + i) % self.vocab

    def propose(self) -> DraftTree:
        if not self.tree:
            toks = [self._right(i) if i < self.k else self._wrong(i) for i in range(self.length)]
            return DraftTree.chain(torch.tensor(toks))
        tokens, parents = [], []
        parent = -1
        for i in range(self.length):
            if i < self.k:
                tokens.append(self._wrong(i))  # a rejected sibling first
                parents.append(parent)
                tokens.append(self._right(i))
                parents.append(parent)
                parent = len(tokens) - 1
            else:
                tokens.append(self._wrong(i))
                parents.append(parent)
                parent = len(tokens) - 1
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))


class SelfTreeProposer(Proposer):
    """The target drafting for itself as a tree: its greedy path plus the runner-up at every level.

    Always right (the greedy path is in the tree), and it exercises sibling handling and tree masks.
    """

    name = "self-tree"

    def __init__(self, model, depth: int):
        from eagle3.decoding.proposers import ModelProposer

        self.inner = ModelProposer(model, depth)
        self.model = model

    def begin(self, prompt_ids, aux, first_token):
        self.inner.begin(prompt_ids, aux, first_token)
        self.context = [*prompt_ids.tolist(), int(first_token)]

    def accept(self, aux_rows, next_tokens):
        self.inner.accept(aux_rows, next_tokens)
        self.context.extend(next_tokens.tolist())

    @torch.inference_mode()
    def propose(self) -> DraftTree:
        chain = self.inner.propose().tokens.tolist()
        tokens, parents = [], []
        parent = -1
        ctx = list(self.context)
        for tok in chain:
            logits = self.model(torch.tensor([ctx])).logits[0, -1]
            runner_up = int(logits.topk(2).indices[1])
            tokens += [runner_up, tok]
            parents += [parent, parent]
            parent = len(tokens) - 1
            ctx.append(tok)
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))


def proposer(model, kind: str, mode: str, reference: list[int], vocab: int = 300) -> Proposer:
    """A drafter of `kind` for `model`, drafting a `mode` ("chain" of 4, or a 4,3,12 "tree"): "self" (the target
    drafting for itself: always right), "random" (an untrained EAGLE-3 drafter: almost never right), or
    "scripted-k" (right exactly k times a cycle against `reference`)."""
    if kind == "self":
        return ModelProposer(model, 4) if mode == "chain" else SelfTreeProposer(model, 4)
    if kind == "random":
        from eagle3.runtime import init_drafter

        shape = DraftShape.chain(4) if mode == "chain" else DraftShape(4, 3, 12)
        return Eagle3Proposer(init_drafter(model, draft_vocab_size=200, seed=1), shape)
    k = int(kind.split("-")[1])
    return ScriptedProposer(reference, k=k, length=4, vocab_size=vocab, tree=mode == "tree")
