"""The generic engine: one request at a time on any HF causal LM, through the server's HF rows
(`eagle3.decoding.hf_rows.HFRows`) with one row, so `generate` and the server run the same cycle: prefill ->
draft -> verify -> accept -> update (reference §C). Also the request checks and text streaming both engines
share (`Request`, `_Stream`) and the statistics they report. Metrics:
tau = tokens emitted per target verification forward, counting the bonus token; acceptance_per_position[i]
= fraction of cycles that drafted at depth >= i+1 in which at least i+1 drafts were accepted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from eagle3.config import DEFAULT_MAX_NEW_TOKENS, SamplingConfig
from eagle3.decoding.drafters import rows_drafter
from eagle3.decoding.grammar import Grammar
from eagle3.decoding.guard import EngineGuards, SpeculationGuard
from eagle3.decoding.hf_rows import HFRows
from eagle3.decoding.proposers import Proposer
from eagle3.decoding.sampling import new_seed
from eagle3.target import Target


@dataclass
class GenerationStats:
    cycles: int = 0
    accepted_per_cycle: list[int] = field(default_factory=list)
    drafted_depth_per_cycle: list[int] = field(default_factory=list)
    drafted_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0
    plain_steps: int = 0  # cycles the guard ran without drafting (`eagle3.decoding.guard`)

    @property
    def tau(self) -> float:
        """Tokens emitted per drafting cycle (the guard's plain steps emit one token and do not count)."""
        drafting = self.cycles - self.plain_steps
        return (sum(self.accepted_per_cycle) + drafting) / drafting if drafting else float(self.cycles > 0)

    @property
    def acceptance_per_position(self) -> list[float]:
        depth = max(self.drafted_depth_per_cycle, default=0)
        out = []
        for i in range(1, depth + 1):
            tried = sum(1 for d in self.drafted_depth_per_cycle if d >= i)
            ok = sum(1 for a, d in zip(self.accepted_per_cycle, self.drafted_depth_per_cycle, strict=True)
                     if d >= i and a >= i)
            out.append(ok / tried if tried else 0.0)
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("accepted_per_cycle")
        d.pop("drafted_depth_per_cycle")
        d.update(tau=self.tau, acceptance_per_position=self.acceptance_per_position,
                 tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats


class _Stream:
    """Turns a growing token list into text deltas, holding back incomplete characters and stop prefixes."""

    def __init__(self, tokenizer, callback, stop_strings: Sequence[str]):
        self.tokenizer, self.callback, self.stop = tokenizer, callback, list(stop_strings)
        self.sent = 0

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def find_stop(self, text: str) -> int:
        hits = [text.find(s) for s in self.stop if s and s in text]
        return min(hits) if hits else -1

    def push(self, text: str, final: bool) -> None:
        if self.callback is None:
            return
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            for s in self.stop:  # hold back a suffix that could start a stop string
                for j in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:j]):
                        end = min(end, len(text[:end]) - j)
                        break
        if end > self.sent:
            self.callback(text[self.sent:end])
            self.sent = end

    def result(self, out: list[int], finish: str | None, stats: GenerationStats, t0: float) -> GenerationResult:
        """The finished generation: its text cut at the first stop string, the rest of it streamed."""
        text = ""
        if self.tokenizer is not None:
            text = self.text(out)
            cut = self.find_stop(text)
            if cut >= 0:
                text = text[:cut]
            self.push(text, final=True)
        stats.total_s = time.perf_counter() - t0
        stats.new_tokens = len(out)
        return GenerationResult(token_ids=out, text=text, finish_reason=finish, stats=stats)


@dataclass
class Request:
    """A checked generation request: what both engines (generic and fast) start from."""

    prompt: torch.Tensor  # [T] long
    sampling: SamplingConfig
    eos: set[int]
    stream: _Stream
    seed: int  # the position-keyed draws' seed (`eagle3.decoding.sampling`); unused when greedy

    @classmethod
    def check(cls, prompt_ids, max_new_tokens: int, sampling: SamplingConfig | None, eos_token_ids,
              stop_strings, on_text, tokenizer) -> Request:
        sampling = sampling or SamplingConfig()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1)
        if prompt.numel() == 0:
            raise ValueError("empty prompt: give at least one token (e.g. BOS)")
        if (stop_strings or on_text is not None) and tokenizer is None:
            raise ValueError("stop strings and streaming need a tokenizer")
        seed = sampling.seed if sampling.seed is not None else new_seed()
        return cls(prompt=prompt, sampling=sampling, eos={int(e) for e in eos_token_ids},
                   stream=_Stream(tokenizer, on_text, stop_strings), seed=seed)


class SpeculativeEngine:
    """Runs one request at a time: `generate(prompt_ids, ...)` with any `Proposer`, as one row of `HFRows` (its
    drafter `rows_drafter(proposer)`: EAGLE-3 drafts as a row of the server's batch drafter). With `guard`, each
    request's cycles are timed and drafting pauses while it is slower than plain decoding (`SpeculationGuard`; one
    for greedy and one for sampled requests, kept from request to request)."""

    def __init__(self, target: Target, proposer: Proposer, tokenizer=None, guard: bool = False):
        self.target = target
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.guard = guard and proposer.name != "none"
        self.guards = EngineGuards(SpeculationGuard)

    def _sync(self) -> None:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sampling: SamplingConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationResult:
        """`grammar` (`eagle3.decoding.grammar`, fresh): every token is the target's choice among those it
        allows."""
        req = Request.check(prompt_ids, max_new_tokens, sampling, eos_token_ids, stop_strings, on_text,
                            self.tokenizer)
        eos, stream = req.eos, req.stream
        drafter, shape = rows_drafter(self.proposer, self.target.device)
        rows = HFRows(self.target, drafter, capacity=1, shapes=None if shape is None else lambda _n: shape,
                      timed=True)  # the server's cycle, one row
        stats = GenerationStats()
        t0 = time.perf_counter()
        row_sampling = None if req.sampling.greedy else replace(req.sampling, seed=req.seed)
        out = rows.add_many([req.prompt.tolist()], sampling=[row_sampling], grammars=[grammar])  # position T
        finish = self._finished(out, eos, max_new_tokens, stream, stop_strings)
        self._sync()
        stats.prefill_s = time.perf_counter() - t0

        guard = self.guards.for_request(not req.sampling.greedy) if self.guard else None
        while finish is None:
            t1 = time.perf_counter()
            drafting = guard is None or guard.drafting()
            new = rows.cycle(drafting)[0]
            t2 = time.perf_counter()
            stats.cycles += 1
            stats.accepted_per_cycle.append(len(new) - 1)
            stats.drafted_depth_per_cycle.append(rows.depths[0])
            stats.drafted_tokens += rows.drafted[0]
            for tok in new:
                out.append(tok)
                finish = self._finished(out, eos, max_new_tokens, stream, stop_strings)
                if finish is not None:
                    break
            if guard is not None:
                guard.record(drafting, t2 - t1, len(new))
                stats.plain_steps += not drafting
        stats.draft_s, stats.verify_s = rows.draft_s, rows.verify_s
        return stream.result(out, finish, stats, t0)

    @staticmethod
    def _finished(out, eos, max_new_tokens, stream: _Stream, stop_strings) -> str | None:
        if out[-1] in eos:
            return "stop"
        if stop_strings or stream.callback is not None:
            text = stream.text(out)
            if stop_strings and stream.find_stop(text) >= 0:
                return "stop"
            stream.push(text, final=False)
        if len(out) >= max_new_tokens:
            return "length"
        return None
