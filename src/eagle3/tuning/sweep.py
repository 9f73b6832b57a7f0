"""What `eagle3 tune` measures on a device: the costs of a cycle's parts and each candidate shape's acceptance and
speed, on the same prompts and answers, with the engine every command uses there."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from eagle3.config import DraftShape, SamplingConfig
from eagle3.decoding.proposers import Proposer
from eagle3.decoding.tree import DraftTree
from eagle3.defaults import Decoding
from eagle3.tuning.model import Costs


class FixedChain(Proposer):
    """Proposes the same `n` tokens every cycle (almost never accepted): a verification of n + 1 rows, timed."""

    name = "fixed"

    def __init__(self, n: int, device: torch.device, token: int = 0):
        self.n, self.device, self.token = n, device, token

    def propose(self) -> DraftTree:
        tokens = torch.full((self.n,), self.token, dtype=torch.long, device=self.device)
        return DraftTree(tokens=tokens, parents=torch.arange(-1, self.n - 1, device=self.device))


@dataclass
class Run:
    """One shape's generations over the prompts: seconds in cycles, cycles, tokens, per-position acceptance."""

    label: str
    seconds: float
    cycles: int
    tokens: int
    tau: float
    acceptance: list[float]
    drafted_depth: float  # mean tokens drafted per cycle (a stopped chain drafts fewer than its length)

    @property
    def cycle_s(self) -> float:
        return self.seconds / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def time_engine(engine, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                label: str) -> Run:
    """Generate `max_new_tokens` per prompt (no EOS: every shape decodes the same number of tokens) after one
    warm-up; the cycles' time, tau and acceptance over all prompts."""
    engine.generate(prompts[0], max_new_tokens=max_new_tokens, sampling=sampling)  # new shapes' first costs
    seconds, cycles, tokens, accepted, depths = 0.0, 0, 0, [], []
    from eagle3.evaluate import RunResult

    acc = RunResult(dataset="", method=label, temperature=sampling.temperature)
    for i, ids in enumerate(prompts):
        st = engine.generate(ids, max_new_tokens=max_new_tokens,
                             sampling=SamplingConfig(temperature=sampling.temperature, seed=i)).stats
        seconds += st.draft_s + st.verify_s
        cycles += st.cycles
        tokens += st.new_tokens - 1  # the first token comes from the prefill
        accepted += st.accepted_per_cycle
        depths += st.drafted_depth_per_cycle
        acc.add(st)
    mean_depth = sum(depths) / len(depths) if depths else 0.0
    return Run(label, seconds, cycles, tokens, acc.tau, acc.acceptance_per_position, mean_depth)


def measure_rows(rt, decoding: Decoding, prompts: list[list[int]], max_new_tokens: int, sizes: list[int],
                 options=None, compiled: bool = False, echo: Callable[[str], None] = print) -> Costs:
    """A plain step and verifications of n rows (fixed chains that are rejected); no drafting costs yet
    (`with_draft_steps`).

    The fixed chains run the cycle's bookkeeping (acceptance, commit) uncompiled, to save a compilation per n.
    `compiled`: the commands compile it, so that extra is taken off every verification of 2 or more rows, as
    what a 2-row verification costs beyond a plain step (a GPU verifies a few rows at the cost of one)."""
    from eagle3.runtime import decoder

    greedy = SamplingConfig()
    plain = time_engine(decoder(rt, replace(decoding, speculate=False, guard=False), options), prompts[:1],
                        max_new_tokens, greedy, "plain")
    verify: dict[int, float] = {1: plain.cycle_s}
    device = next(rt.model.parameters()).device
    for n in sorted(set(sizes) | {2, 3, 5, 9}):
        t0 = time.perf_counter()
        engine = _fixed_engine(rt, decoding, n - 1, device, options)
        verify[n] = time_engine(engine, prompts[:1], max(8, max_new_tokens // 2), greedy, f"verify {n}").cycle_s
        echo(f"  verification of {n:3d} rows: {1e3 * verify[n]:.2f} ms ({time.perf_counter() - t0:.1f}s)")
    if compiled:
        eager = max(0.0, verify[2] - verify[1])
        verify = {n: s if n == 1 else s - eager for n, s in verify.items()}
        echo(f"  uncompiled bookkeeping: {1e3 * eager:.2f} ms a cycle, taken off the verifications")
    return Costs(plain_s=plain.cycle_s, verify_s=verify, draft_step_s={1: 0.0})


def with_draft_steps(rows: Costs, runs: list[tuple[DraftShape, Run]]) -> Costs:
    """`rows` with the drafting steps that timed runs imply: a run's cycle less the verification of as many rows,
    per drafting step. The one-row step comes from the longest chain; without a chain, a tree's steps are taken to
    cost the same whatever their rows (a GPU's drafting steps are bound by launches, not by rows)."""
    chains = [(s, r) for s, r in runs if s.is_chain]
    step1 = None
    if chains:
        _, run = max(chains, key=lambda sr: sr[0].depth)
        k = round(run.drafted_depth) or 1
        step1 = max(0.0, (run.cycle_s - rows.verify(k + 1)) / k)
    steps = {} if step1 is None else {1: step1}
    for t, run in runs:
        if t.is_chain:
            continue
        if step1 is None:
            each = max(0.0, (run.cycle_s - rows.verify(t.total + 1)) / t.depth)
            steps.setdefault(1, each)
            steps.setdefault(t.top_k, each)
        elif t.depth > 1:
            steps[t.top_k] = max(0.0, (run.cycle_s - rows.verify(t.total + 1) - step1) / (t.depth - 1))
    return replace(rows, draft_step_s=steps or {1: 0.0})


def _fixed_engine(rt, decoding: Decoding, n: int, device, options=None):
    """An engine of `decoding`'s kind verifying a fixed chain of n rejected tokens each cycle."""
    from eagle3.decoding.engine import SpeculativeEngine

    if decoding.engine == "fast":
        from eagle3.fast.engine import FastEngine, FastOptions

        # the verification is what is timed here: drafting-side pieces stay eager (one compilation per n saved)
        options = replace(options or FastOptions(), chain_stop=None, guard=False, compile_drafting=False)
        return FastEngine(rt.model, draft=FixedChain(n, device), max_nodes=n, tokenizer=rt.tokenizer,
                          options=options, target=rt.fast_target())
    return SpeculativeEngine(rt.target, FixedChain(n, device), rt.tokenizer)
