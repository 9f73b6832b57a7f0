"""Continuous-batching plain decoding on the fast path, for throughput work such as `eagle3 regenerate`.

`BatchedGenerator` keeps B rows, each with its own static KV cache `[L, B, n_kv, S, hd]` (row b's token at
position p lives in slot p of row b, so no left padding and no cross-row masking are needed). One decoding step
runs all B rows at once with fixed shapes (captured as one CUDA graph on GPU); every `sync_every` steps the host
reads the new tokens, retires rows that hit an end-of-turn token or their budget, and prefills waiting prompts
into the free rows in one padded forward. Rows that are finished but not yet refilled keep decoding into their
own cache, harmlessly.

Attention reads only the first `span` slots of every row, the smallest of `span_buckets(S)` (powers of two
from `min_span`, then S) that holds the furthest position any active row reaches in the next window: one
captured graph per span. With the whole cache read at every step, the K/V bytes of a step grow with S however
short the answers are: for SmolLM2 at 512 rows and S = 1,664 slots (`eagle3 regenerate --max-prompt-tokens
1280 --max-new-tokens 384`) that is 19.6 GB a step, milliseconds even at HBM bandwidth, however few slots the
rows in flight have filled (prompts are served longest first, so the rows in flight have similar lengths).

Greedy output equals plain greedy decoding of the same weights (tested against HF on CPU in fp32); sampling draws
from the full softmax at the given temperature (no top-k / top-p), i.e. from the target's own distribution.
Weights and RoPE tables are shared with `FastTarget` (same families, `FAST_MODEL_TYPES`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.attention import varying_shape_attention
from eagle3.config import ConfigError
from eagle3.fast.cpu import argmax_ids
from eagle3.fast.graphs import StepRunner, graph_pool
from eagle3.fast.pointwise import rms_norm
from eagle3.fast.target import FastTarget

MIN_SPAN = 128  # the narrowest attention span of a decoding window (`span_buckets`)


def span_buckets(seq_len: int, min_span: int = MIN_SPAN) -> tuple[int, ...]:
    """The attention spans a decoding window can run at: powers of two from `min_span` below `seq_len`, then
    `seq_len` itself (128, 256, 512, 1024, 1664 for 1,664 slots)."""
    spans, s = [], max(1, min_span)
    while s < seq_len:
        spans.append(s)
        s *= 2
    return (*spans, seq_len)


@dataclass
class BatchedOutput:
    """One prompt's answer: generated ids (the end-of-turn token excluded) and why it stopped."""

    tokens: list[int]
    finish_reason: str  # "stop" (an end-of-turn token) or "length" (max_new_tokens)


class BatchedGenerator:
    """B rows of continuous-batching plain decoding over a static per-row KV cache (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        rows: int,
        max_seq_len: int,
        *,
        graphs: bool = True,
        sync_every: int = 8,
        prefill_tokens: int = 16384,
        min_span: int = MIN_SPAN,
    ):
        if rows < 1 or max_seq_len < 2 or sync_every < 1:
            raise ConfigError(f"rows, max_seq_len, sync_every must be >= 1, 2, 1 (got {rows}, {max_seq_len}, "
                              f"{sync_every})")
        self.t = FastTarget(model)  # fused weights; its own (batch-1) cache stays unallocated
        t = self.t
        self.rows, self.seq_len, self.sync_every = rows, max_seq_len, sync_every
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward (bounds its activations)
        dev, dt = t.device, t.dtype
        self.cos, self.sin = t.rope_table(max_seq_len)  # [S, hd]
        shape = (t.num_layers, rows, t.nkv, max_seq_len, t.hd)
        self.k_cache = torch.zeros(shape, dtype=dt, device=dev)
        self.v_cache = torch.zeros(shape, dtype=dt, device=dev)
        self.ar_b = torch.arange(rows, device=dev)
        self.ar_s = torch.arange(max_seq_len, device=dev)
        # step state: the token each row feeds next and its position (= slot); outputs of the last sync window
        self.cur = torch.zeros(rows, dtype=torch.long, device=dev)  # [B]
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)  # [B]
        self.inv_temp = torch.ones(1, device=dev)  # [1] 1/temperature; unused when greedy
        self.window = torch.zeros(rows, sync_every, dtype=torch.long, device=dev)  # [B, W]
        self.spans = span_buckets(max_seq_len, min_span)  # attention spans, one captured window step each
        self.span_windows: Counter[int] = Counter()  # decoding windows run at each span
        self._graphs, self._pool = graphs, graph_pool(dev)
        self._steps: dict[tuple[bool, int], StepRunner] = {}  # (greedy, span) -> its window step

    @property
    def device(self) -> torch.device:
        return self.t.device

    def kv_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    # -- forwards ----------------------------------------------------------------------------
    def _decode(self, ids: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One token per row: ids, pos [B] -> logits [B, V]. Writes K/V at (row, pos); attends over the first
        `span` slots of each row (every pos < span for the rows that matter)."""
        t = self.t
        b, nh, nkv, hd = ids.shape[0], t.nh, t.nkv, t.hd
        g = nh // nkv
        h = F.embedding(ids, t.embed)  # [B, H]
        cos, sin = self.cos[pos], self.sin[pos]  # [B, hd]
        visible = (self.ar_s[None, :span] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, span]
        for i, lw in enumerate(t.layers):
            qkv = t.qkv(h, lw)  # [B, (nh + 2·nkv)·hd]
            q, k = t.rope_qk(qkv, lw, cos, sin)  # [B, nh, hd], [B, nkv, hd]
            v = qkv[:, (nh + nkv) * hd :].view(b, nkv, hd)
            self.k_cache[i, self.ar_b, :, pos] = k  # row b, slot pos[b]
            self.v_cache[i, self.ar_b, :, pos] = v
            keys = self.k_cache[i, :, :, :span]  # [B, nkv, span, hd], a view
            values = self.v_cache[i, :, :, :span]
            qg = q.view(b, nkv, g, hd)  # query heads kv·g + r share kv head `kv` (`eagle3.fast.attention`)
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible, scale=t.scale)  # [B, nkv, g, hd]
            h = t.mlp_block(t.add_linear(h, o.reshape(b, nh * hd), lw.wo, lw.bo), lw)
        return t.linear(rms_norm(h, t.norm, t.eps), t.lm_head)  # [B, V]

    def _prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Prompts into cache rows (slots 0..len-1), one right-padded forward; returns last logits [R, V]."""
        t = self.t
        dev = self.device
        r, width = len(rows), max(len(p) for p in prompts)
        nh, nkv, hd = t.nh, t.nkv, t.hd
        ids = torch.zeros(r, width, dtype=torch.long)
        for j, p in enumerate(prompts):
            ids[j, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(dev).view(-1)  # [R·T]
        lens = torch.tensor([len(p) for p in prompts], device=dev)  # [R]
        rows_t = torch.tensor(rows, device=dev)
        pos = torch.arange(width, device=dev).repeat(r)  # [R·T]
        row_of = rows_t.repeat_interleave(width)  # [R·T]
        h = F.embedding(ids, t.embed)  # [R·T, H]
        cos, sin = self.cos[pos], self.sin[pos]
        for i, lw in enumerate(t.layers):
            qkv = t.qkv(h, lw)
            q, k = t.rope_qk(qkv, lw, cos, sin)  # [R·T, nh, hd], [R·T, nkv, hd]
            v = qkv[:, (nh + nkv) * hd :].view(-1, nkv, hd)
            self.k_cache[i, row_of, :, pos] = k  # padding goes to slots >= len: overwritten before it is seen
            self.v_cache[i, row_of, :, pos] = v
            o = F.scaled_dot_product_attention(
                q.view(r, width, nh, hd).transpose(1, 2),  # [R, nh, T, hd]
                k.view(r, width, nkv, hd).transpose(1, 2),
                v.view(r, width, nkv, hd).transpose(1, 2),
                is_causal=True, scale=t.scale, enable_gqa=True,
            )  # [R, nh, T, hd]; right padding never reaches a real token under the causal mask
            h = t.mlp_block(t.add_linear(h, o.transpose(1, 2).reshape(r * width, nh * hd), lw.wo, lw.bo), lw)
        last = h.view(r, width, -1)[torch.arange(r, device=dev), lens - 1]  # [R, H]
        return t.linear(rms_norm(last, t.norm, t.eps), t.lm_head)  # [R, V]

    def _pick(self, logits: torch.Tensor, greedy: bool) -> torch.Tensor:
        """Next tokens [N] from logits [N, V]: argmax, or a softmax sample at 1/inv_temp (exponential race,
        which needs no host sync and is capturable)."""
        if greedy:
            return argmax_ids(logits)
        probs = torch.softmax(logits.float() * self.inv_temp, dim=-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)

    def _window_steps(self, greedy: bool, span: int) -> None:
        """`sync_every` decoding steps for all rows, attending over `span` slots; the tokens go to `window`
        [B, W]."""
        last = self.seq_len - 1
        for w in range(self.sync_every):
            nxt = self._pick(self._decode(self.cur, self.pos, span), greedy)  # [B]
            self.window[:, w].copy_(nxt)
            self.cur.copy_(nxt)
            self.pos.copy_((self.pos + 1).clamp(max=last))  # idle rows stay inside their cache

    def _step(self, greedy: bool, span: int) -> StepRunner:
        """The window step at `span` (captured on first use: call while no row is active, see `generate`)."""
        key = (greedy, span)
        if key not in self._steps:
            mode = "greedy" if greedy else "sample"
            self._steps[key] = StepRunner(lambda: self._window_steps(greedy, span), self.device,
                                          graphs=self._graphs, pool=self._pool,
                                          name=f"batched_{mode}_x{self.sync_every}_s{span}")
        return self._steps[key]

    def span_for(self, furthest: int) -> int:
        """The smallest span that holds slot `furthest` - 1 (the whole cache beyond the largest bucket)."""
        return next((s for s in self.spans if s >= furthest), self.seq_len)

    # -- driver ------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 0.0,
        on_done: Callable[[int, BatchedOutput], Sequence[int] | None] | None = None,
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
        greedy = temperature == 0
        if not greedy:
            self.inv_temp.fill_(1.0 / temperature)
        for span in self.spans:  # capture every span now: warm-up decodes garbage into the cache, harmless
            step = self._step(greedy, span)  # while no row is active (each is prefilled before it decodes)
            if step.graph is None and step.use_graphs:
                step.prepare()
        stops = set(int(e) for e in eos_token_ids)
        prompts = list(prompts)  # follow-ups are appended
        results: list[BatchedOutput | None] = [None] * len(prompts)
        # Longest first: prefill batches of similar lengths waste little padding.
        waiting = deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))

        def finished(i: int, output: BatchedOutput) -> None:
            results[i] = output
            follow_up = on_done(i, output) if on_done is not None else None
            if follow_up is not None:
                if not 1 <= len(follow_up) <= room:
                    raise ConfigError(
                        f"follow-up of prompt {i} has {len(follow_up)} tokens; this generator takes 1..{room}"
                    )
                prompts.append(follow_up)
                results.append(None)
                waiting.appendleft(len(prompts) - 1)  # finish started work first
        owner: list[int | None] = [None] * self.rows  # prompt index decoding in each row
        made: list[list[int]] = [[] for _ in range(self.rows)]
        refill_at = max(1, self.rows // 16)  # a prefill costs a forward: batch refills, ~3% of rows idle meanwhile
        while waiting or any(o is not None for o in owner):
            free = [b for b in range(self.rows) if owner[b] is None]
            if waiting and (len(free) >= min(refill_at, len(waiting)) or len(free) == self.rows):
                for b in self._fill(free, waiting, prompts, owner, made, greedy):
                    first = made[b][0]  # the prefill's token may already end the answer
                    if first in stops or max_new_tokens == 1:
                        finish = "stop" if first in stops else "length"
                        i = owner[b]
                        owner[b], made[b] = None, []
                        finished(i, BatchedOutput(tokens=[] if first in stops else [first], finish_reason=finish))
                if all(o is None for o in owner):
                    continue
            # the furthest slot an active row writes in this window: its next position is prompt + made - 1
            furthest = max(len(prompts[i]) + len(made[b]) - 1 for b, i in enumerate(owner) if i is not None)
            span = self.span_for(furthest + self.sync_every)
            self.span_windows[span] += 1
            self._step(greedy, span)()
            window = self.window.tolist()  # the one host sync per `sync_every` steps
            for b in range(self.rows):
                i = owner[b]
                if i is None:
                    continue
                out = made[b]
                finish = None
                for tok in window[b]:
                    if tok in stops:
                        finish = "stop"
                        break
                    out.append(tok)
                    if len(out) >= max_new_tokens:
                        finish = "length"
                        break
                if finish is not None:
                    owner[b], made[b] = None, []
                    finished(i, BatchedOutput(tokens=out[:max_new_tokens], finish_reason=finish))
        return results  # type: ignore[return-value]

    def _fill(self, free: list[int], waiting: deque, prompts, owner, made, greedy: bool) -> list[int]:
        """Prefill waiting prompts into free rows, in chunks of at most `prefill_tokens` padded tokens;
        returns the rows filled (each `made[b]` then holds the first answer token)."""
        taken: list[tuple[int, int]] = []  # (row, prompt index)
        for b in free:
            if not waiting:
                break
            taken.append((b, waiting.popleft()))
        start = 0
        while start < len(taken):
            width = len(prompts[taken[start][1]])  # the longest of this chunk (waiting is sorted longest first)
            n = max(1, min(len(taken) - start, self.prefill_tokens // width))
            chunk = taken[start : start + n]
            start += n
            rows = [b for b, _ in chunk]
            with varying_shape_attention(self.device):  # padded prompt width differs per chunk
                logits = self._prefill(rows, [list(prompts[i]) for _, i in chunk])  # [n, V]
            first = self._pick(logits, greedy)  # [n]: the first answer token, fed by the next step
            rows_t = torch.tensor(rows, device=self.device)
            self.cur[rows_t] = first
            self.pos[rows_t] = torch.tensor([len(prompts[i]) for _, i in chunk], device=self.device)
            first_host = first.tolist()
            for (b, i), tok in zip(chunk, first_host, strict=True):
                owner[b] = i
                made[b] = [tok]
        return [b for b, _ in taken]
