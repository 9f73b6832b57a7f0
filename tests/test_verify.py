"""DraftTree bookkeeping and greedy / sampling acceptance on hand-made trees and logits.

Run: pytest tests/test_verify.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

from eagle3.config import SamplingConfig
from eagle3.decoding.tree import DraftTree
from eagle3.decoding.verify import Acceptance, accept, accept_from_probs, accept_greedy, accept_sampling

# The DraftTree docstring example:  root -> the(1) -> cat(3) -> sat(5);  the(1) -> dog(4);  root -> a(2)
THE, A, CAT, DOG, SAT = 10, 11, 12, 13, 14
V = 20


def example_tree() -> DraftTree:
    return DraftTree(tokens=torch.tensor([THE, A, CAT, DOG, SAT]), parents=torch.tensor([-1, -1, 0, 0, 2]))


def logits_with_argmax(argmax_per_row: list[int], vocab: int = V) -> torch.Tensor:
    """[len, vocab] random logits whose row r has its maximum at argmax_per_row[r]."""
    g = torch.Generator().manual_seed(len(argmax_per_row))
    logits = torch.randn(len(argmax_per_row), vocab, generator=g)  # [R, V]
    logits[torch.arange(len(argmax_per_row)), argmax_per_row] = 10.0
    return logits


def reference_ancestors(parents: list[int]) -> torch.Tensor:
    n1 = len(parents) + 1
    mask = torch.zeros(n1, n1, dtype=torch.bool)
    for i in range(n1):
        j = i
        while True:
            mask[i, j] = True
            if j == 0:
                break
            j = parents[j - 1] + 1
    return mask


def reference_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """The plain sequential walk down the tree, for comparison with the vectorised implementation."""
    kids = tree.children()
    tokens = tree.tokens.tolist()
    node, path = 0, []
    while True:
        t = int(logits[node].argmax())
        nxt = next((c for c in kids[node] if tokens[c - 1] == t), None)
        if nxt is None:
            return Acceptance(path=path, next_token=t)
        node = nxt
        path.append(node)


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [rng.randint(-1, i - 1) for i in range(n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long)
    )


# ---------------------------------------------------------------------------------------------
# DraftTree
# ---------------------------------------------------------------------------------------------
def test_example_tree_bookkeeping():
    tree = example_tree()
    tree.validate()
    assert tree.n == 5
    assert tree.depths().tolist() == [1, 1, 2, 2, 3]
    assert tree.position_offsets().tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.children() == [[1, 2], [3, 4], [], [5], [], []]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # the
            [1, 0, 1, 0, 0, 0],  # a
            [1, 1, 0, 1, 0, 0],  # cat
            [1, 1, 0, 0, 1, 0],  # dog
            [1, 1, 0, 1, 0, 1],  # sat
        ],
        dtype=torch.bool,
    )
    mask = tree.attention_mask()
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_chain_and_empty():
    chain = DraftTree.chain(torch.tensor([5, 6, 7]))
    chain.validate()
    assert chain.parents.tolist() == [-1, 0, 1]
    assert chain.depths().tolist() == [1, 2, 3]
    assert torch.equal(chain.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.children() == [[1], [2], [3], []]

    empty = DraftTree.empty("cpu")
    empty.validate()
    assert empty.n == 0
    assert empty.depths().tolist() == []
    assert empty.position_offsets().tolist() == [0]
    assert torch.equal(empty.attention_mask(), torch.ones(1, 1, dtype=torch.bool))
    assert empty.children() == [[]]


@pytest.mark.parametrize("n", [1, 2, 7, 33, 64])
def test_masks_match_a_parent_walk_on_random_trees(n):
    rng = random.Random(n)
    for _ in range(5):
        tree = random_tree(rng, n, vocab=50)
        ref = reference_ancestors(tree.parents.tolist())
        assert torch.equal(tree.attention_mask(), ref)
        assert tree.position_offsets().tolist() == (ref.sum(-1) - 1).tolist()
    deep = DraftTree.chain(torch.arange(n))  # the longest path: exercises every squaring step
    assert torch.equal(deep.attention_mask(), reference_ancestors(deep.parents.tolist()))


@pytest.mark.parametrize(
    ("tokens", "parents", "match"),
    [
        ([1], [0], "parent 0"),  # a node cannot be its own parent
        ([1, 2], [1, -1], "parent 1"),  # parent after child
        ([1], [-2], "parent -2"),  # out of range
        ([1, 2], [-1, 5], "parent 5"),
        ([-3], [-1], "ids >= 0"),
    ],
)
def test_invalid_trees_raise(tokens, parents, match):
    tree = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))
    with pytest.raises(ValueError, match=match):
        tree.validate()


def test_malformed_tensors_raise():
    with pytest.raises(ValueError, match="one parent per token"):
        DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1]))
    with pytest.raises(ValueError, match="1-D"):
        DraftTree(tokens=torch.tensor([[1]]), parents=torch.tensor([[-1]]))
    with pytest.raises(ValueError, match=r"torch\.long"):
        DraftTree(tokens=torch.tensor([1.0]), parents=torch.tensor([-1])).validate()


# ---------------------------------------------------------------------------------------------
# Greedy acceptance
# ---------------------------------------------------------------------------------------------
def test_greedy_full_acceptance_to_a_leaf():
    # rows: root, the, a, cat, dog, sat -> root->the, the->cat, cat->sat, bonus 3 after sat
    logits = logits_with_argmax([THE, CAT, 0, SAT, 0, 3])
    acc = accept_greedy(example_tree(), logits)
    assert acc == Acceptance(path=[1, 3, 5], next_token=3)
    assert acc.emitted(example_tree()) == [THE, CAT, SAT, 3]
    assert acc.n_accepted == 3


def test_greedy_partial_acceptance():
    # root->the accepted, then the target wants DOG after "the": dog (node 4) accepted, bonus after dog
    logits = logits_with_argmax([THE, DOG, 0, 0, 7, 0])
    assert accept_greedy(example_tree(), logits) == Acceptance(path=[1, 4], next_token=7)
    # the target wants 2 after "the": no child matches, correction token 2
    logits = logits_with_argmax([THE, 2, 0, 0, 0, 0])
    assert accept_greedy(example_tree(), logits) == Acceptance(path=[1], next_token=2)


def test_greedy_no_acceptance():
    logits = logits_with_argmax([5, CAT, 0, SAT, 0, 3])  # deeper rows would match, but the first does not
    acc = accept_greedy(example_tree(), logits)
    assert acc == Acceptance(path=[], next_token=5)
    assert acc.emitted(example_tree()) == [5]


def test_greedy_second_sibling_matches():
    logits = logits_with_argmax([A, 0, 9, 0, 0, 0])  # "a" is node 2, the second child of the root
    assert accept_greedy(example_tree(), logits) == Acceptance(path=[2], next_token=9)


def test_greedy_duplicate_siblings_follow_the_first():
    tree = DraftTree(tokens=torch.tensor([4, 4, 6]), parents=torch.tensor([-1, -1, 1]))
    logits = logits_with_argmax([4, 8, 6, 1])  # after the first 4 the target says 8; the second 4 has child 6
    assert accept_greedy(tree, logits) == Acceptance(path=[1], next_token=8)


def test_greedy_empty_tree():
    assert accept_greedy(DraftTree.empty(), logits_with_argmax([3])) == Acceptance(path=[], next_token=3)


@pytest.mark.parametrize("n", [1, 5, 20, 60])
def test_greedy_matches_the_sequential_walk_on_random_trees(n):
    rng = random.Random(1000 + n)
    vocab = 4  # small, so matches and duplicated siblings are common
    for trial in range(15):
        tree = random_tree(rng, n, vocab)
        g = torch.Generator().manual_seed(trial)
        logits = torch.randn(n + 1, vocab, generator=g)  # [N+1, V]
        assert accept_greedy(tree, logits) == reference_greedy(tree, logits)


def test_logits_shape_is_checked():
    with pytest.raises(ValueError, match=r"\[N\+1, V\]"):
        accept_greedy(example_tree(), torch.zeros(5, V))
    with pytest.raises(ValueError, match=r"\[N\+1, V\]"):
        accept_sampling(example_tree(), torch.zeros(6), SamplingConfig(temperature=1.0), None)


def test_accept_dispatches_on_temperature():
    logits = logits_with_argmax([THE, CAT, 0, SAT, 0, 3])
    assert accept(example_tree(), logits, SamplingConfig()) == accept_greedy(example_tree(), logits)
    with pytest.raises(ValueError, match="temperature > 0"):
        accept_sampling(example_tree(), logits, SamplingConfig(), torch.Generator())


# ---------------------------------------------------------------------------------------------
# Sampling acceptance: properties that hold with probability 1 (distributions: test_sampling_stats.py)
# ---------------------------------------------------------------------------------------------
def test_sampling_one_hot_target_accepts_its_token_and_nothing_else():
    # the target is certain of THE, then CAT, then SAT, then 3: the drafts on that path are always accepted
    logits = torch.full((6, V), -1e9)
    for row, tok in enumerate([THE, CAT, 0, SAT, 0, 3]):
        logits[row, tok] = 0.0
    gen = torch.Generator().manual_seed(0)
    for temperature in (0.5, 1.0, 2.0):
        for _ in range(50):
            acc = accept(example_tree(), logits, SamplingConfig(temperature=temperature), gen)
            assert acc == Acceptance(path=[1, 3, 5], next_token=3)


def test_sampling_never_accepts_zero_probability_drafts_nor_resamples_rejected_ones():
    probs = torch.zeros(6, V)
    probs[0, [THE, A, 2]] = torch.tensor([0.3, 0.0, 0.7])  # "a" has probability 0
    probs[1:] = 1.0 / V
    gen = torch.Generator().manual_seed(1)
    seen_paths = set()
    for _ in range(400):
        acc = accept_from_probs(example_tree(), probs, gen)
        assert 2 not in acc.path  # node 2 ("a") has target probability 0
        if not acc.path:
            assert acc.next_token == 2  # THE was rejected and A has mass 0: only token 2 is left
        seen_paths.add(tuple(acc.path[:1]))
    assert seen_paths == {(), (1,)}


def test_sampling_duplicate_sibling_is_never_accepted():
    tree = DraftTree(tokens=torch.tensor([4, 4, 5]), parents=torch.tensor([-1, -1, -1]))
    probs = torch.zeros(4, 8)
    probs[0, [4, 5, 6]] = torch.tensor([0.5, 0.25, 0.25])
    probs[1:] = 1.0 / 8
    gen = torch.Generator().manual_seed(2)
    outcomes = set()
    for _ in range(300):
        acc = accept_from_probs(tree, probs, gen)
        assert acc.path != [2]  # the second 4 has residual probability 0 once the first 4 is rejected
        if not acc.path:
            assert acc.next_token == 6  # 4 and 5 both rejected
        outcomes.add(tuple(acc.path))
    assert outcomes == {(), (1,), (3,)}


def test_sampling_last_remaining_token_is_always_accepted():
    # once THE (0.3) is rejected, A holds all remaining mass and must be accepted despite float rounding
    probs = torch.zeros(6, V)
    probs[0, THE], probs[0, A] = 0.3, 0.7
    probs[1:] = 1.0 / V
    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        assert accept_from_probs(example_tree(), probs, gen).path[:1] in ([1], [2])


def test_sampling_is_reproducible_with_a_seeded_generator():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(4))
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, top_k=8)
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(123)
        runs.append([accept(example_tree(), logits, cfg, gen) for _ in range(20)])
    assert runs[0] == runs[1]
