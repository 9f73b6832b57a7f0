"""Continuous-batching plain decoding on the fast rows, for throughput work such as `eagle3 regenerate`.

`BatchedGenerator` answers many prompts with the rows of `eagle3.fast.rows.FastRows` and no drafter: each cycle
decodes one token for every active row (a captured graph per batch-size bucket on CUDA, attending by position,
so a step reads the slots the rows have filled, not the whole cache). Prompts are admitted longest first, in
right-padded prefills of at most `prefill_tokens` padded tokens, whenever a sixteenth of the rows is free; an
answer leaves its row at an end-of-turn token or its budget. On CUDA the next cycle is launched before the last
one is read, and rows that finished keep decoding (their tokens unread) until the next admission frees them, so
the GPU does not wait for the host between admissions.

Tokens come from the one sampler (`eagle3.decoding.sampling`): the argmax, or position-keyed draws with a seed per
prompt (`seed` + its index; by default drawn from torch's generator, so `torch.manual_seed` makes a run repeatable).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from eagle3.config import ConfigError, SamplingConfig
from eagle3.decoding.sampling import sampling_mode
from eagle3.fast.rows import FastRows, cycle_margin
from eagle3.fast.target import FastTarget


@dataclass
class BatchedOutput:
    """One prompt's answer: generated ids (the end-of-turn token excluded) and why it stopped."""

    tokens: list[int]
    finish_reason: str  # "stop" (an end-of-turn token) or "length" (max_new_tokens)


class BatchedGenerator:
    """`rows` rows of continuous-batching plain decoding, each with `max_seq_len` cache slots (prompt and answer);
    see the module docstring."""

    def __init__(self, model: nn.Module, rows: int, max_seq_len: int, *, graphs: bool = True,
                 prefill_tokens: int = 16384):
        if rows < 1 or max_seq_len < 2:
            raise ConfigError(f"rows and max_seq_len must be >= 1 and >= 2 (got {rows}, {max_seq_len})")
        self.t = FastTarget(model)  # fused weights (refuses families without a fast path)
        self.t.fuse_pointwise(level="auto")  # compiled RoPE and SwiGLU on CUDA, as every fast engine runs them
        self.rows, self.seq_len = rows, max_seq_len
        self.prefill_tokens = prefill_tokens  # padded tokens per admission forward (bounds its activations)
        # eager admission at each chunk's own width: a regeneration's prompts come in every length
        self.r = FastRows(self.t, None, capacity=rows, seq_len=max_seq_len + cycle_margin([]), graphs=graphs,
                          prefill_graphs=False, prefill_tokens=prefill_tokens)

    @property
    def device(self) -> torch.device:
        return self.t.device

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 0.0,
        on_done: Callable[[int, BatchedOutput], Sequence[int] | None] | None = None,
        seed: int | None = None,
    ) -> list[BatchedOutput]:
        """Answer every prompt (token ids); each output stops at an EOS id or after max_new_tokens.

        A prompt longer than max_seq_len - max_new_tokens raises ConfigError before anything runs.
        `on_done(index, output)` is called as each answer finishes (in completion order). It may return a
        follow-up prompt (e.g. the next turn of the same conversation, which needs this answer): it gets the
        next index, goes to the front of the queue, and its output is appended to the returned list.
        """
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        if temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (got {temperature})")
        room = self.seq_len - max_new_tokens
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= room:
                raise ConfigError(
                    f"prompt {i} has {len(p)} tokens; this generator holds {self.seq_len} slots per row, so "
                    f"prompts must have 1..{room} tokens with max_new_tokens={max_new_tokens}"
                )
        if seed is None and temperature > 0:
            seed = int(torch.randint(0, 2**62, ()))
        mode = sampling_mode(temperature)
        rows = self.r
        rows.prepare((mode,), spec=False, max_prompt=room)  # captures once per mode, before any row is added
        stops = {int(e) for e in eos_token_ids}
        prompts = list(prompts)  # follow-ups are appended
        results: list[BatchedOutput | None] = [None] * len(prompts)
        # Longest first: prefill chunks of similar lengths waste little padding.
        waiting = deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))
        owner: list[int] = []  # prompt index of each active row
        made: list[list[int] | None] = []  # its answer so far; None once finished (the row leaves at admission)

        def finished(b: int, output: BatchedOutput) -> None:
            i = owner[b]
            made[b] = None
            results[i] = output
            follow_up = on_done(i, output) if on_done is not None else None
            if follow_up is not None:
                if not 1 <= len(follow_up) <= room:
                    raise ConfigError(
                        f"follow-up of prompt {i} has {len(follow_up)} tokens; this generator takes 1..{room}")
                prompts.append(follow_up)
                results.append(None)
                waiting.appendleft(len(prompts) - 1)  # finish started work first

        def take(new: list[list[int]]) -> None:
            for b, (tok,) in enumerate(new):
                out = made[b]
                if out is None:  # finished: decoding on until the next admission frees the row
                    continue
                if tok in stops:
                    finished(b, BatchedOutput(out, "stop"))
                    continue
                out.append(tok)
                if len(out) >= max_new_tokens:
                    finished(b, BatchedOutput(out, "length"))

        pipeline = self.device.type == "cuda"
        in_flight = 0
        refill_at = max(1, self.rows // 16)  # an admission costs a forward and a sync: batch them
        try:
            while True:
                idle = made.count(None)
                free = self.rows - len(owner) + idle
                admit = bool(waiting) and (free >= min(refill_at, len(waiting)) or idle == len(owner))
                if admit or idle == len(owner):  # settle: read what is in flight, free the finished rows
                    for _ in range(in_flight):
                        take(rows.collect())
                    in_flight = 0
                    for b in reversed(range(len(owner))):
                        if made[b] is None:
                            rows.remove(b)  # the last row moves into b
                            owner[b], made[b] = owner[-1], made[-1]
                            owner.pop()
                            made.pop()
                    if waiting:
                        self._admit(waiting, prompts, owner, made, stops, max_new_tokens, temperature, seed,
                                    finished)
                    if not owner:
                        if not waiting:
                            break
                        continue
                rows.launch(False)
                in_flight += 1
                if in_flight == 2 or not pipeline:
                    take(rows.collect())
                    in_flight -= 1
        finally:
            rows.clear()
        return results  # type: ignore[return-value]

    def _admit(self, waiting: deque, prompts, owner: list[int], made: list, stops: set[int], max_new_tokens: int,
               temperature: float, seed: int | None, finished: Callable) -> None:
        """Prefill waiting prompts into the free rows, in chunks of at most `prefill_tokens` padded tokens (a
        chunk is as wide as its longest prompt)."""
        while waiting and len(owner) < self.rows:
            chunk = [waiting.popleft()]  # a follow-up at the front may be shorter than the prompts after it
            width = len(prompts[chunk[0]])
            while (waiting and len(owner) + len(chunk) < self.rows
                   and (len(chunk) + 1) * max(width, len(prompts[waiting[0]])) <= self.prefill_tokens):
                chunk.append(waiting.popleft())
                width = max(width, len(prompts[chunk[-1]]))
            sampling = [SamplingConfig(temperature, seed=seed + i) if temperature > 0 else None for i in chunk]
            firsts = self.r.add_many([list(prompts[i]) for i in chunk], sampling=sampling)
            for i, tok in zip(chunk, firsts, strict=True):
                owner.append(i)
                made.append([tok])
                b = len(owner) - 1
                if tok in stops:  # the prefill's token may already end the answer
                    made[b] = []
                    finished(b, BatchedOutput([], "stop"))
                elif max_new_tokens == 1:
                    finished(b, BatchedOutput([tok], "length"))
