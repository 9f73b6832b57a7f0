"""Speculative sampling is lossless: emitted tokens follow the target's distribution exactly.

A synthetic target LM over a tiny vocabulary (V = 5..6) gives the next-token distribution as a fixed random
table keyed by the last two tokens, so the exact joint distribution of the first L emitted tokens is a
product of table rows. A deterministic drafter (the top-ranked tokens of another table, or of the target
itself) proposes chains and trees; each sample, with its own seed, runs verification rounds from a fixed
context until L tokens are out: the target's choice after every node is its position-keyed draw
(`eagle3.decoding.sampling.choose`) and `eagle3.decoding.verify.accept` follows the drafts that equal it. The
empirical joint over all V**L cells must match the exact one within a bound derived from the sample count, and
deliberately wrong rules (negative controls) must fail the same check. Modelled on vLLM
`tests/v1/sample/test_rejection_sampler.py`; the code here is our own.

Run: pytest tests/test_sampling_stats.py -q
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from eagle3.config import SamplingConfig
from eagle3.decoding import sampling as S
from eagle3.decoding.sampling import choose, filter_scores, filter_scores_rows, process_logits
from eagle3.decoding.tree import DraftTree
from eagle3.decoding.verify import Acceptance, accept

DELTA = 1e-6  # allowed probability that a correct implementation fails one check (union over its cells)
START = (0, 1)  # the context tail every sample starts from


# ---------------------------------------------------------------------------------------------
# The bound
# ---------------------------------------------------------------------------------------------
def bernstein_halfwidth(p: float, n: int, cells: int, delta: float = DELTA) -> float:
    """Half-width t with P(|p_hat - p| >= t) <= delta / cells for a mean of n Bernoulli(p) draws.

    Bernstein's inequality for i.i.d. X in [0, 1] with variance s2 = p(1-p):
        P(|mean - p| >= t) <= 2 exp(-n t^2 / (2 s2 + 2t/3)).
    Setting the right side to delta / cells and solving the quadratic in t gives
        t = l/(3n) + sqrt((l/(3n))^2 + 2 s2 l / n),  l = ln(2 cells / delta).
    A union bound over the cells makes the whole check fail with probability <= delta = 1e-6 when the
    implementation is correct. (Cells with p = 0 get t = 2l/(3n) > 0, but must in fact stay at 0.)
    """
    ln_term = math.log(2 * cells / delta)
    a = ln_term / (3 * n)
    return a + math.sqrt(a * a + 2 * p * (1 - p) * ln_term / n)


@dataclass
class Verdict:
    passed: bool
    worst: float  # max over cells of |p_hat - p| / half-width (> 1 fails)
    tv: float  # total-variation distance, for the message

    def __str__(self) -> str:
        return f"worst cell at {self.worst:.2f}x its bound, TV {self.tv:.4f}"


def check(counts: torch.Tensor, exact: torch.Tensor) -> Verdict:
    n = int(counts.sum())
    emp = counts.double() / n  # [V**L]
    worst = 0.0
    for p_hat, p in zip(emp.tolist(), exact.double().tolist(), strict=True):
        if p == 0.0 and p_hat > 0:
            worst = math.inf  # a token sequence the target cannot produce
        worst = max(worst, abs(p_hat - p) / bernstein_halfwidth(p, n, exact.numel()))
    tv = 0.5 * float((emp - exact.double()).abs().sum())
    return Verdict(passed=worst <= 1.0, worst=worst, tv=tv)


# ---------------------------------------------------------------------------------------------
# The synthetic target and drafter
# ---------------------------------------------------------------------------------------------
@dataclass
class Round:
    """Everything a verification round from one context needs, precomputed."""

    tree: DraftTree
    tokens: list[int]  # tree.tokens on the host
    logits: torch.Tensor  # [N+1, V] raw target logits after the root and each node
    offsets: torch.Tensor  # [N+1] depth of the root and each node (the root at 0)


@dataclass
class Scenario:
    name: str
    vocab: int
    emitted: int  # L: how many leading tokens are compared
    target: torch.Tensor  # [V, V, V] logits of the next token given the last two
    draft: torch.Tensor  # [V, V, V] drafter logits; drafts are its top-ranked tokens, deterministically
    shape: list[tuple[int, int]]  # per node: (parent, rank among the drafter's tokens at the parent)
    sampling: SamplingConfig

    def round_for(self, ctx: tuple[int, int]) -> Round:
        tokens, parents, ctxs = [], [], [ctx]
        for parent, rank in self.shape:
            node_ctx = ctxs[parent + 1]
            tok = int(torch.argsort(self.draft[node_ctx], descending=True, stable=True)[rank])
            tokens.append(tok)
            parents.append(parent)
            ctxs.append((node_ctx[1], tok))
        tree = DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents))
        tree.validate()
        logits = torch.stack([self.target[c] for c in ctxs])  # [N+1, V]
        return Round(tree, tokens, logits, tree.position_offsets())

    def exact_joint(self) -> torch.Tensor:
        """[V**L] exact probability of each sequence of the first L tokens under the filtered target."""
        s = self.sampling
        p = process_logits(self.target, s.temperature, s.top_p, s.top_k).double()  # [V, V, V]
        joint = torch.ones(1, dtype=torch.float64)  # over sequences so far, in row-major order
        seqs: list[tuple[int, ...]] = [START]
        for _ in range(self.emitted):
            nxt = torch.stack([p[seq[-2], seq[-1]] for seq in seqs])  # [S, V]
            joint = (joint[:, None] * nxt).reshape(-1)  # [S * V]
            seqs = [(*seq, t) for seq in seqs for t in range(self.vocab)]
        return joint


# (scenario, round, the request's seed, position of the round's root) -> the round's outcome
AcceptFn = Callable[[Scenario, Round, int, int], Acceptance]


def real_accept(scen: Scenario, rnd: Round, seed: int, root_pos: int) -> Acceptance:
    """The implementation under test: the target's choice after each node, at the position its token takes
    (root + depth + 1, as the engines compute it), then acceptance against those choices."""
    s = scen.sampling
    top = choose(rnd.logits, root_pos + rnd.offsets + 1, s.temperature, s.top_p, s.top_k, seed=seed)  # [N+1]
    return accept(rnd.tree, top)


def simulate(scen: Scenario, accept_fn: AcceptFn, n_samples: int, seed: int) -> torch.Tensor:
    """Counts [V**L] of the first L emitted tokens over n_samples speculative runs, run i with seed seed + i."""
    rounds: dict[tuple[int, int], Round] = {}
    counts = [0] * scen.vocab**scen.emitted
    for i in range(n_samples):
        ctx, out = START, []
        while len(out) < scen.emitted:
            rnd = rounds.get(ctx) or rounds.setdefault(ctx, scen.round_for(ctx))
            root_pos = len(START) + len(out) - 1  # the last token so far is the root
            acc = accept_fn(scen, rnd, seed + i, root_pos)
            emitted = [rnd.tokens[j - 1] for j in acc.path] + [acc.next_token]
            out += emitted
            ctx = (*ctx, *emitted)[-2:]
        cell = 0
        for t in out[: scen.emitted]:
            cell = cell * scen.vocab + t
        counts[cell] += 1
    return torch.tensor(counts)


def make_tables(vocab: int, seed: int, scale: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = scale * torch.randn(vocab, vocab, vocab, generator=g)  # [V, V, V]
    draft = target + 1.5 * torch.randn(vocab, vocab, vocab, generator=g)  # correlated, not equal
    return target, draft


CHAIN3 = [(-1, 0), (0, 0), (1, 0)]
# root: three children; first child: two children; second child: one; a grandchild of the first: one
TREE7 = [(-1, 0), (-1, 1), (-1, 2), (0, 0), (0, 1), (1, 0), (3, 0)]
# duplicated siblings at the root and below the first child (EAGLE trees never do this; a drafter could)
DUPS = [(-1, 0), (-1, 0), (-1, 1), (0, 0), (0, 0), (0, 1)]


def scenario(name: str) -> Scenario:
    v = 6
    target, draft = make_tables(v, seed=sum(map(ord, name)))
    sampling = SamplingConfig(temperature=1.0)
    shape, emitted = CHAIN3, 2
    if name == "chain":
        pass
    elif name == "chain_draft_is_target_argmax":
        draft = target.clone()
    elif name == "tree_siblings":
        shape = TREE7
    elif name == "tree_duplicate_siblings":
        shape = DUPS
    elif name == "tree_depth3_first3":
        v, emitted, shape = 5, 3, TREE7
        target, draft = make_tables(v, seed=7)
    elif name == "disjoint_support":
        # the target never emits tokens 0 and 1; the drafter proposes them first (and others after)
        target[..., :2] = float("-inf")
        draft[..., :2] += 100.0
        shape = TREE7
    elif name == "one_hot_target":
        # in every context whose tail sums to an even number the target is certain of one token
        for a in range(v):
            for b in range(v):
                if (a + b) % 2 == 0:
                    certain = (a * 3 + b) % v
                    target[a, b] = float("-inf")
                    target[a, b, certain] = 0.0
        shape = TREE7
    elif name == "temperature_top_p":
        target, draft = make_tables(v, seed=3, scale=0.5)  # soft enough that top-p keeps several tokens
        sampling = SamplingConfig(temperature=0.7, top_p=0.8)
        shape = TREE7
    elif name == "temperature_top_k":
        sampling = SamplingConfig(temperature=1.6, top_k=3)
    elif name == "top_k_top_p_draft_is_target":
        sampling = SamplingConfig(temperature=1.3, top_k=4, top_p=0.9)
        draft = target.clone()
        shape = TREE7
    else:
        raise KeyError(name)
    return Scenario(name, v, emitted, target, draft, shape, sampling)


# ---------------------------------------------------------------------------------------------
# The implementation passes
# ---------------------------------------------------------------------------------------------
# scenario -> samples. ~8k samples each keeps this file near 15 s of CPU. With n = 8k and 36 cells of p ~ 1/36
# the bound is ~0.012 absolute (~40% relative); the negative controls below exceed it with 4k samples.
CASES = {
    "chain": 8_000,
    "chain_draft_is_target_argmax": 8_000,
    "tree_siblings": 8_000,
    "tree_duplicate_siblings": 8_000,
    "tree_depth3_first3": 10_000,
    "disjoint_support": 8_000,
    "one_hot_target": 8_000,
    "temperature_top_p": 8_000,
    "temperature_top_k": 8_000,
    "top_k_top_p_draft_is_target": 8_000,
}


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_matches_the_target(name):
    scen = scenario(name)
    verdict = check(simulate(scen, real_accept, CASES[name], seed=11), scen.exact_joint())
    assert verdict.passed, f"{name}: emitted tokens do not follow the target ({verdict})"


@pytest.mark.parametrize("name", list(CASES))
def test_scenarios_are_not_vacuous(name):
    """Each scenario spreads mass over many sequences and both accepts and rejects drafts."""
    scen = scenario(name)
    exact = scen.exact_joint()
    assert int((exact > 0.005).sum()) >= 8 and float(exact.max()) < 0.5, (name, exact)
    lengths = set()
    for a in range(scen.vocab):
        for b in range(scen.vocab):
            rnd = scen.round_for((a, b))
            lengths |= {len(real_accept(scen, rnd, seed, 5).path) for seed in range(10)}
    deepest = 1 if name == "disjoint_support" else 2  # there only one depth-1 draft can ever be accepted
    assert 0 in lengths and max(lengths) >= deepest, (name, lengths)


# ---------------------------------------------------------------------------------------------
# Negative controls: wrong rules must fail the same check
# ---------------------------------------------------------------------------------------------
def _choices_at(scen: Scenario, rnd: Round, seed: int, positions: torch.Tensor) -> torch.Tensor:
    s = scen.sampling
    return choose(rnd.logits, positions, s.temperature, s.top_p, s.top_k, seed=seed)


def wrong_noise_by_node(scen: Scenario, rnd: Round, seed: int, root_pos: int) -> Acceptance:
    """Noise keyed by node index instead of position: every round reuses the draws of the round before."""
    return accept(rnd.tree, _choices_at(scen, rnd, seed, torch.arange(rnd.tree.n + 1)))


def wrong_one_position_per_round(scen: Scenario, rnd: Round, seed: int, root_pos: int) -> Acceptance:
    """Every node drawn with the root's next position: a child reuses its parent's draw."""
    return accept(rnd.tree, _choices_at(scen, rnd, seed, torch.full((rnd.tree.n + 1,), root_pos + 1)))


def wrong_argmax_drafts_always(scen: Scenario, rnd: Round, seed: int, root_pos: int) -> Acceptance:
    """A draft that is the target's argmax is accepted outright (greedy thinking at T > 0)."""
    top = _choices_at(scen, rnd, seed, root_pos + rnd.offsets + 1)
    argmax = rnd.logits.argmax(dim=-1)  # [N+1]
    drafted = torch.cat([torch.tensor([-1]), rnd.tree.tokens])  # [N+1] each node's own token
    parent1 = torch.cat([torch.tensor([0]), rnd.tree.parents + 1])
    for j in range(1, rnd.tree.n + 1):  # a node that is its parent's argmax becomes the parent's choice
        if int(drafted[j]) == int(argmax[parent1[j]]):
            top[parent1[j]] = drafted[j]
    return accept(rnd.tree, top)


def wrong_one_seed_for_all(scen: Scenario, rnd: Round, seed: int, root_pos: int) -> Acceptance:
    """Every run draws with the same seed: the runs are not independent."""
    return real_accept(scen, rnd, 0, root_pos)


@pytest.mark.parametrize(
    ("wrong", "name"),
    [
        (wrong_noise_by_node, "chain"),
        (wrong_one_position_per_round, "tree_siblings"),
        (wrong_argmax_drafts_always, "chain_draft_is_target_argmax"),
        (wrong_one_seed_for_all, "chain"),
    ],
)
def test_negative_controls_fail_the_check(wrong, name):
    scen = scenario(name)
    verdict = check(simulate(scen, wrong, 4_000, seed=13), scen.exact_joint())
    assert not verdict.passed, f"{wrong.__name__} passed on {name} ({verdict}): the check cannot detect bias"


# ---------------------------------------------------------------------------------------------
# process_logits and the position-keyed draws
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.5, 4, 0.9), (2.0, 100, 0.01), (1.0, 1, 1.0)],
)
def test_process_logits_matches_hf_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 12, generator=g)  # [R, V]
    logits[:4] = torch.randint(-2, 3, (4, 12), generator=g).float()  # ties at the top-k / top-p edges
    logits[4, :6] = float("-inf")  # already masked entries
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)
    got = process_logits(logits, temperature, top_p=top_p, top_k=top_k)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(16), rtol=0, atol=1e-5)
    # leading batch dims are fine
    torch.testing.assert_close(
        process_logits(logits.view(4, 4, 12), temperature, top_p, top_k), got.view(4, 4, 12)
    )


ROW_SETTINGS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.5, 4, 0.9), (2.0, 100, 0.01), (1.0, 1, 1.0),
                (0.9, 12, 1.0), (1.1, 2, 0.5)]


def test_filter_scores_rows_equals_filter_scores_row_by_row():
    """Each row with its own temperature / top-k / top-p (ties and masked entries included) gets exactly what
    `filter_scores` gives it alone: the batched server path samples the same tokens as the per-request one."""
    g = torch.Generator().manual_seed(1)
    r, m, v = len(ROW_SETTINGS), 5, 12
    logits = torch.randn(r, m, v, generator=g)
    logits[:3, :2] = torch.randint(-2, 3, (3, 2, v), generator=g).float()  # ties at the filter edges
    logits[4, 1, :6] = float("-inf")
    temp = torch.tensor([t for t, _, _ in ROW_SETTINGS])
    top_k = torch.tensor([k for _, k, _ in ROW_SETTINGS])
    top_p = torch.tensor([p for _, _, p in ROW_SETTINGS])
    got = filter_scores_rows(logits, temp, top_p, top_k)  # [R, M, V]
    for i, (t, k, p) in enumerate(ROW_SETTINGS):
        assert torch.equal(got[i], filter_scores(logits[i], t, top_p=p, top_k=k)), ROW_SETTINGS[i]


def test_race_sample_rows_equals_race_sample_and_argmax():
    """Batched position-keyed sampling: sampled rows draw what `race_sample` draws for their seed and positions,
    rows at temperature 0 take the argmax."""
    from eagle3.decoding.sampling import race_sample, race_sample_rows, seed_hash, vocab_hash

    g = torch.Generator().manual_seed(2)
    settings = [*ROW_SETTINGS, (0.0, 0, 1.0), (0.0, 5, 0.3)]
    r, m, v = len(settings), 7, 50
    logits = torch.randn(r, m, v, generator=g) * 3
    pos = torch.randint(0, 10_000, (r, m), generator=g)
    seeds = [int(x) for x in torch.randint(0, 2**40, (r,), generator=g)]
    got = race_sample_rows(logits, pos, torch.tensor([seed_hash(s) for s in seeds]),
                           torch.tensor([t for t, _, _ in settings]), torch.tensor([p for _, _, p in settings]),
                           torch.tensor([k for _, k, _ in settings]), vocab_hash(v))  # [R, M]
    for i, (t, k, p) in enumerate(settings):
        want = race_sample(logits[i], pos[i], seeds[i], t, p, k) if t > 0 else logits[i].argmax(-1)
        assert torch.equal(got[i], want), settings[i]
    assert not torch.equal(got[0], logits[0].argmax(-1))  # the sampled rows do sample
    plain = [i for i, (_, k, p) in enumerate(settings) if k == 0 and p == 1.0]  # no filters: the sort-free path
    idx = torch.tensor(plain)
    fast = race_sample_rows(logits[idx], pos[idx], torch.tensor([seed_hash(seeds[i]) for i in plain]),
                            torch.tensor([settings[i][0] for i in plain]), torch.ones(len(plain)),
                            torch.zeros(len(plain), dtype=torch.long), vocab_hash(v), filters=False)
    assert torch.equal(fast, got[idx])


def test_fused_race_draws_the_same_tokens(caplog):
    """The compiled draw (one inductor kernel) picks the same tokens as the eager ops, with and without the
    filters, batched and for one request; if compiling fails, sampling goes on eagerly and says so."""
    g = torch.Generator().manual_seed(5)
    settings = [*ROW_SETTINGS, (0.0, 0, 1.0)]
    r, m, v = len(settings), 6, 300
    logits = (torch.randn(r, m, v, generator=g) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 10_000, (r, m), generator=g)
    args = (logits, pos, torch.tensor([S.seed_hash(7 + i) for i in range(r)]),
            torch.tensor([t for t, _, _ in settings]), torch.tensor([p for _, _, p in settings]),
            torch.tensor([k for _, k, _ in settings]), S.vocab_hash(v))
    for filters in (False, True):
        eager = S.race_sample_rows(*args, filters=filters)
        assert torch.equal(S.race_sample_rows(*args, filters=filters, fused=True), eager), filters
    one = S.race_sample(logits[0].float(), pos[0], 11, 0.7)
    assert torch.equal(S.race_sample(logits[0].float(), pos[0], 11, 0.7, fused=True), one)
    assert S.fused_draw_available()

    def broken(*a):
        raise RuntimeError("no compiler here")

    saved = S._fused_draw
    S._fused_draw = broken
    try:
        with caplog.at_level("WARNING", logger="eagle3.decoding"):
            assert torch.equal(S.race_sample_rows(*args, filters=False, fused=True),
                               S.race_sample_rows(*args, filters=False))
        assert "sampling eagerly" in caplog.text and not S.fused_draw_available()
    finally:
        S._fused_draw = saved


def test_process_logits_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        process_logits(torch.zeros(3), 0.0)
    with pytest.raises(ValueError, match="top_p"):
        process_logits(torch.zeros(3), 1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        process_logits(torch.zeros(3), 1.0, top_k=-1)
