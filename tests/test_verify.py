"""DraftTree bookkeeping, and acceptance against the target's choices on hand-made trees.

Run: pytest tests/test_verify.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

from eagle3.decoding.sampling import choose
from eagle3.decoding.tree import DraftTree
from eagle3.decoding.verify import Acceptance, accept

# The DraftTree docstring example:  root -> the(1) -> cat(3) -> sat(5);  the(1) -> dog(4);  root -> a(2)
THE, A, CAT, DOG, SAT = 10, 11, 12, 13, 14
V = 20


def example_tree() -> DraftTree:
    return DraftTree(tokens=torch.tensor([THE, A, CAT, DOG, SAT]), parents=torch.tensor([-1, -1, 0, 0, 2]))


def choices(per_row: list[int]) -> torch.Tensor:
    """The target's choice after the root and after each node, as `accept` takes it: long [N+1]."""
    return torch.tensor(per_row, dtype=torch.long)


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


def reference_walk(tree: DraftTree, top: torch.Tensor) -> Acceptance:
    """The plain sequential walk down the tree, for comparison with the vectorised implementation."""
    kids = tree.children()
    tokens = tree.tokens.tolist()
    node, path = 0, []
    while True:
        t = int(top[node])
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
# Acceptance
# ---------------------------------------------------------------------------------------------
def test_full_acceptance_to_a_leaf():
    # rows: root, the, a, cat, dog, sat -> root->the, the->cat, cat->sat, bonus 3 after sat
    acc = accept(example_tree(), choices([THE, CAT, 0, SAT, 0, 3]))
    assert acc == Acceptance(path=[1, 3, 5], next_token=3)
    assert acc.emitted(example_tree()) == [THE, CAT, SAT, 3]
    assert acc.n_accepted == 3


def test_partial_acceptance():
    # root->the accepted, then the target wants DOG after "the": dog (node 4) accepted, bonus after dog
    assert accept(example_tree(), choices([THE, DOG, 0, 0, 7, 0])) == Acceptance(path=[1, 4], next_token=7)
    # the target wants 2 after "the": no child matches, correction token 2
    assert accept(example_tree(), choices([THE, 2, 0, 0, 0, 0])) == Acceptance(path=[1], next_token=2)


def test_no_acceptance():
    acc = accept(example_tree(), choices([5, CAT, 0, SAT, 0, 3]))  # deeper rows would match, the first does not
    assert acc == Acceptance(path=[], next_token=5)
    assert acc.emitted(example_tree()) == [5]


def test_second_sibling_matches():
    # "a" is node 2, the second child of the root
    assert accept(example_tree(), choices([A, 0, 9, 0, 0, 0])) == Acceptance(path=[2], next_token=9)


def test_duplicate_siblings_follow_the_first():
    tree = DraftTree(tokens=torch.tensor([4, 4, 6]), parents=torch.tensor([-1, -1, 1]))
    # after the first 4 the target says 8; the second 4 has child 6
    assert accept(tree, choices([4, 8, 6, 1])) == Acceptance(path=[1], next_token=8)


def test_empty_tree():
    assert accept(DraftTree.empty(), choices([3])) == Acceptance(path=[], next_token=3)


@pytest.mark.parametrize("n", [1, 5, 20, 60])
def test_acceptance_matches_the_sequential_walk_on_random_trees(n):
    rng = random.Random(1000 + n)
    vocab = 4  # small, so matches and duplicated siblings are common
    for trial in range(15):
        tree = random_tree(rng, n, vocab)
        g = torch.Generator().manual_seed(trial)
        top = torch.randint(0, vocab, (n + 1,), generator=g)  # [N+1]
        assert accept(tree, top) == reference_walk(tree, top)


def test_choices_shape_is_checked():
    with pytest.raises(ValueError, match=r"\[N\+1\]"):
        accept(example_tree(), choices([1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match=r"\[N\+1\]"):
        accept(example_tree(), torch.zeros(6, V, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# The target's choices: properties that hold with probability 1 (distributions: test_sampling_stats.py)
# ---------------------------------------------------------------------------------------------
def test_greedy_choice_is_the_argmax():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    assert torch.equal(choose(logits, torch.arange(6), temperature=0.0, seed=5), logits.argmax(-1))


def test_one_hot_target_accepts_its_token_at_every_temperature():
    # the target is certain of THE, then CAT, then SAT, then 3: the drafts on that path are always accepted
    logits = torch.full((6, V), -1e9)
    for row, tok in enumerate([THE, CAT, 0, SAT, 0, 3]):
        logits[row, tok] = 0.0
    for temperature in (0.5, 1.0, 2.0):
        for seed in range(50):
            top = choose(logits, torch.arange(6) + 40, temperature, seed=seed)
            assert accept(example_tree(), top) == Acceptance(path=[1, 3, 5], next_token=3)


def test_filtered_tokens_are_never_chosen():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=g)
    logits[:, 2] = float("-inf")  # probability 0
    for seed in range(200):
        top = choose(logits, torch.arange(6), 1.5, top_k=3, seed=seed)
        top3 = logits.topk(3, dim=-1).indices  # [6, 3]
        assert (top3 == top[:, None]).any(dim=-1).all() and not (top == 2).any()


def test_choices_depend_only_on_seed_and_position():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([9, 10, 10, 11, 11, 12])  # siblings predict the same position
    a = choose(logits, pos, 0.8, top_p=0.9, top_k=8, seed=123)
    assert torch.equal(a, choose(logits, pos, 0.8, top_p=0.9, top_k=8, seed=123))
    # one row at a time, or with other rows beside it: the same tokens
    assert all(int(choose(logits[i : i + 1], pos[i : i + 1], 0.8, 0.9, 8, seed=123)) == int(a[i]) for i in range(6))
    draws = {tuple(choose(logits, pos, 0.8, top_p=0.9, top_k=8, seed=s).tolist()) for s in range(20)}
    assert len(draws) > 10  # other seeds, other draws
