"""Batched greedy rows on the fast path (`eagle3.fast.rows.FastRows`), on CPU (same code as on CUDA, eager).

- rows that join (several in one padded prefill) and leave at different cycles, in buckets that change as they
  do, with plain and speculative cycles mixed at random, each produce HF `generate`'s greedy output (Llama,
  Qwen3 and Qwen3-MoE layouts);
- run side by side, each row accepts exactly what the batch-1 `FastEngine` accepts for its prompt, cycle by
  cycle (a vocabulary of 8 makes accepted paths of 2 common, so per-row KV compaction is exercised);
- the cycles run on the meta device (no host sync, nothing created off-device: what CUDA graph capture needs);
- bad use is refused.
Run: pytest tests/test_rows.py
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import build_tiny_target
from eagle3.config import ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.sampling import FILTERED, GREEDY, TEMPERATURE, race_sample
from eagle3.fast import FastEngine, FastTarget
from eagle3.fast.rows import FastRows
from eagle3.fast.rows_prefill import prefill_buckets, prefill_step
from eagle3.runtime import init_drafter

TREE = DraftShape(4, 3, 12)


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def make_rows(model, drafter, capacity: int, shapes: dict, seq_len: int = 256) -> FastRows:
    rows = FastRows(FastTarget(model, drafter.config.aux_layer_ids), drafter, capacity=capacity, seq_len=seq_len,
                    shapes=shapes.get)
    rows.prepare()
    return rows


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_rows_joining_and_leaving_match_hf_generate(arch):
    model = build_tiny_target(arch, vocab_size=64)
    d = init_drafter(model, draft_vocab_size=64, seed=1)
    shapes = {1: TREE, 2: DraftShape(4, 2, 8), 4: DraftShape(3, 1, 3), 8: None}  # shrinking, then plain only
    rows = make_rows(model, d, 8, shapes)
    prompts = prompts_of([5, 35, 12, 7, 20, 9, 3, 16, 11], 64)
    budget = [24, 10, 30, 16, 24, 5, 12, 20, 8]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, budget, strict=True)]
    owner: list[int] = []  # request index in each active row
    outs: dict[int, list[int]] = {}
    waiting = list(range(len(prompts)))
    rng = random.Random(0)
    cycles = spec_cycles = 0
    while waiting or owner:
        if waiting and (cycles % 2 == 0 or not owner):  # one, two or three join at once (one batched prefill)
            joining = waiting[: min(1 + cycles % 3, rows.capacity - rows.n)]
            del waiting[: len(joining)]
            for i, first in zip(joining, rows.add_many([prompts[i] for i in joining]), strict=True):
                outs[i] = [first]
                owner.append(i)
        spec = rows.shape_of(rows.n) is not None and rng.random() < 0.7
        spec_cycles += spec
        for j, new in enumerate(rows.cycle(spec)):
            outs[owner[j]] += new
        for j in reversed(range(len(owner))):
            if len(outs[owner[j]]) >= budget[owner[j]]:
                rows.remove(j)  # the last row moves into j: mirror it
                owner[j] = owner[-1]
                owner.pop()
        cycles += 1
    assert spec_cycles > 5 and cycles > spec_cycles
    for i, ref in enumerate(refs):
        assert outs[i][: budget[i]] == ref, f"request {i}"
    assert rows.n == 0


def race_reference(model, prompt: list[int], n: int, s: SamplingConfig) -> list[int]:
    """Plain decoding where the token at position p is the position-keyed draw `race_sample(..., p, seed)`."""
    ids, dev = list(prompt), next(model.parameters()).device
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=dev)).logits[0, -1:].float()  # [1, V]
        pos = torch.tensor([len(ids)], device=dev)
        ids.append(int(race_sample(logits, pos, s.seed, s.temperature, s.top_p, s.top_k)[0]))
    return ids[len(prompt):]


def test_sampled_rows_draw_the_position_keyed_tokens():
    """Rows with their own temperature / top-p / top-k / seed, mixed with greedy rows, joining and leaving, in
    plain and speculative cycles: each sampled row emits exactly the position-keyed draws of plain decoding (the
    server's HF rows draw the same), each greedy row HF's greedy output, and drafts are still accepted."""
    model = build_tiny_target("llama", vocab_size=16)
    d = init_drafter(model, draft_vocab_size=16, seed=1)
    rows = make_rows(model, d, 4, {1: TREE, 2: DraftShape(4, 2, 8), 4: DraftShape(3, 1, 3)})
    settings = [SamplingConfig(0.7, seed=11), None, SamplingConfig(1.0, top_k=5, seed=12),
                SamplingConfig(0.5, top_p=0.8, seed=13), SamplingConfig(1.3, top_p=0.9, top_k=8, seed=2**40 + 5), None]
    prompts = prompts_of([6, 11, 4, 9, 14, 5], 16, seed=7)
    budget = [30, 20, 26, 30, 18, 24]
    refs = [hf_greedy(model, p, n) if s is None else race_reference(model, p, n, s)
            for p, n, s in zip(prompts, budget, settings, strict=True)]
    owner: list[int] = []
    outs: dict[int, list[int]] = {}
    waiting = list(range(len(prompts)))
    rng = random.Random(1)
    sampled_accepts = cycles = 0
    while waiting or owner:
        if waiting and rows.n < rows.capacity and (cycles % 3 == 0 or not owner):
            joining = waiting[: min(2, rows.capacity - rows.n)]
            del waiting[: len(joining)]
            firsts = rows.add_many([prompts[i] for i in joining], sampling=[settings[i] for i in joining])
            for i, first in zip(joining, firsts, strict=True):
                outs[i] = [first]
                owner.append(i)
        spec = rows.shape_of(rows.n) is not None and rng.random() < 0.75
        for j, new in enumerate(rows.cycle(spec)):
            outs[owner[j]] += new
            sampled_accepts += (settings[owner[j]] is not None) * (len(new) - 1)
        for j in reversed(range(len(owner))):
            if len(outs[owner[j]]) >= budget[owner[j]]:
                rows.remove(j)
                owner[j] = owner[-1]
                owner.pop()
        cycles += 1
    for i, ref in enumerate(refs):
        assert outs[i][: budget[i]] == ref, f"request {i} ({settings[i]})"
    assert sampled_accepts > 0  # sampled rows accepted drafts, not only their bonus tokens
    assert rows.n == 0 and not rows._modes


def test_sampled_rows_need_a_seed_and_sampling_cycles():
    model = build_tiny_target("llama", vocab_size=16)
    d = init_drafter(model, draft_vocab_size=16, seed=1)
    rows = make_rows(model, d, 2, {1: TREE, 2: TREE})
    with pytest.raises(ConfigError, match="seed"):
        rows.add([1, 2, 3], sampling=SamplingConfig(0.8))
    plain = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=2, seq_len=64, sampling=False)
    with pytest.raises(ConfigError, match="sampling=True"):
        plain.add([1, 2, 3], sampling=SamplingConfig(0.8, seed=1))
    assert plain.add([1, 2, 3], sampling=SamplingConfig(0.0, seed=1)) == hf_greedy(model, [1, 2, 3], 1)[0]


@pytest.mark.parametrize("shape", [TREE, DraftShape.chain(4)], ids=["tree", "chain"])
def test_rows_accept_what_the_batch1_engine_accepts(shape):
    model = build_tiny_target("llama", vocab_size=8)
    d = init_drafter(model, draft_vocab_size=8, seed=1)
    engine = FastEngine(model, draft="eagle3", spec=shape, drafter=d)
    prompts = prompts_of([9, 4, 17], 8, seed=3)
    ref = [engine.generate(torch.tensor(p), max_new_tokens=40, eos_token_ids=[]) for p in prompts]
    rows = make_rows(model, d, 4, {1: shape, 2: shape, 4: shape})
    outs = [[rows.add(p)] for p in prompts]
    accepted: list[list[int]] = [[], [], []]
    for _ in range(min(r.stats.cycles for r in ref)):
        for j, new in enumerate(rows.cycle(spec=True)):
            outs[j] += new
            accepted[j].append(len(new) - 1)
    for j, r in enumerate(ref):
        assert accepted[j] == r.stats.accepted_per_cycle[: len(accepted[j])]
        m = min(len(outs[j]), len(r.token_ids))
        assert outs[j][:m] == r.token_ids[:m]
    assert max(max(a) for a in accepted) >= 2  # multi-slot compaction happened


@pytest.mark.parametrize("stop", [0.05, 0.2])
def test_stopped_chains_keep_plain_decoding(stop):
    """With a chain stop (eager cycles: CPUs), rows draft until every row's joint draft probability falls below
    the stop: the chain stops early in some cycles, and one row, then three rows together, decode plain
    decoding's greedy tokens."""
    model = build_tiny_target("llama", vocab_size=8)
    d = init_drafter(model, draft_vocab_size=8, seed=1)
    chain = DraftShape.chain(6)
    prompts = prompts_of([9, 4, 17], 8, seed=3)
    plain = FastEngine(model, draft="none")
    ref = [plain.generate(torch.tensor(p), max_new_tokens=40, eos_token_ids=[]).token_ids for p in prompts]
    rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=4, seq_len=256,
                    shapes={1: chain, 2: chain, 4: chain}.get, chain_stop=stop)
    out, drafted = [rows.add(prompts[0])], []
    while len(out) < 40:
        out += rows.cycle(spec=True)[0]
        drafted.append(rows.drafted[0])
    assert out[:40] == ref[0]
    assert 1 <= min(drafted) < 6  # the chain stopped early in some cycles
    rows.clear()
    outs = [[first] for first in rows.add_many(prompts[1:])]
    for _ in range(15):
        for o, new in zip(outs, rows.cycle(spec=True), strict=True):
            o += new
    for o, r in zip(outs, ref[1:], strict=True):
        assert o[: len(r)] == r[: len(o)]


def test_eager_rows_attend_over_the_slots_they_reach():
    """Eager cycles (a CPU) attend over the slots the active rows can reach, rounded up to 64, not the whole cache;
    the tokens are those of a full-span run, and the span follows the
    longest row as it grows and as rows leave."""
    model = build_tiny_target("llama", vocab_size=8)
    d = init_drafter(model, draft_vocab_size=8, seed=1)
    rows = make_rows(model, d, 4, {1: TREE, 2: TREE, 4: TREE}, seq_len=512)
    rows.add_many(prompts_of([9, 70], 8, seed=3))
    spans = []
    for _ in range(6):
        longest = max(rows._lens)
        rows.cycle(spec=True)
        spans.append(rows.span)
        assert longest + rows.margin <= rows.span < rows.seq_len and rows.span % 64 == 0
        assert rows._lens == rows.length[: rows.n].tolist()  # the host mirror of each row's length
    rows.remove(1)  # the long row leaves: the span shrinks with the next cycle
    rows.cycle(spec=False)
    assert rows.span < spans[-1] and rows._lens == rows.length[:1].tolist()


def test_rows_chain_stop_needs_eager_cycles():
    model = build_tiny_target("llama", vocab_size=8)
    d = init_drafter(model, draft_vocab_size=8, seed=1)
    with pytest.raises(ConfigError, match="eagerly"):
        FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=2, seq_len=64,
                 shapes={1: DraftShape.chain(4), 2: DraftShape.chain(4)}.get, compile_drafting=True, chain_stop=0.2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rows_verification_has_the_bits_of_one_token_steps_in_bf16(arch):
    """What keeps a row's bf16 chain identical to its plain decoding on a CPU (`exact_rows`, forced here on any
    CPU, as `tests/test_fast.py` does for the batch-1 engine): two rows' forward of 6 causal tokens each gives
    every token the logits, bit for bit, that six one-token forwards of one row give (MLP of 2,048, where a CPU
    without AMX rounds one-row and many-row products differently with the vendor's kernels)."""
    model = build_tiny_target(arch, hidden_size=256, intermediate_size=2048).to(torch.bfloat16)
    t = FastTarget(model)
    t.exact_rows = True
    ids = torch.stack([prompt for prompt in map(torch.tensor, prompts_of([24, 24], model.config.vocab_size, 3))])
    ar = torch.arange(32)
    shape = (t.num_layers, 2, t.nkv, 32, t.hd)
    rope = t.rope_table(32)
    logits = {}
    for mode in ("rows", "steps"):
        k, v = torch.zeros(shape, dtype=t.dtype), torch.zeros(shape, dtype=t.dtype)
        pre = ar[:18][None].expand(2, -1)
        t.forward_rows(ids[:, :18], pre, pre, (ar[None, :] <= ar[:18, None])[None].expand(2, -1, -1), k, v,
                       rope)
        if mode == "rows":
            pos = ar[18:24][None].expand(2, -1)
            logits[mode] = t.forward_rows(ids[:, 18:24], pos, pos, (ar[None, :] <= ar[18:24, None])[None].expand(2, -1, -1),
                                          k, v, rope)[0]
        else:  # row 0 alone, one token at a time
            steps = []
            for p in range(18, 24):
                pos = ar[p : p + 1][None]
                steps.append(t.forward_rows(ids[:1, p : p + 1], pos, pos, (ar <= p)[None, None], k[:, :1], v[:, :1],
                                            rope)[0])
            logits[mode] = torch.cat(steps, dim=1)
    assert torch.equal(logits["rows"][:1], logits["steps"])


def test_rows_draft_through_the_top_k_kernel_as_through_pytorch(monkeypatch):
    """Where the batch-1 engine's draft top-k kernel runs (CUDA), the rows' greedy drafting calls it on every
    row's outputs at once ([rows·T, Vd] logits) and reshapes its answer back: a CPU stand-in with the kernel's
    contract gives the same drafts, accepted drafts and tokens as the PyTorch path."""
    import eagle3.fast.rows as rows_mod
    from eagle3.decoding.expand import top_k_last

    model = build_tiny_target("llama", vocab_size=16)
    d = init_drafter(model, draft_vocab_size=16, seed=1)
    prompts = prompts_of([7, 12, 5], 16, seed=9)
    calls = []

    def op(logits, k):  # the kernel's contract: log-softmax, then the top k, over 2-d [N, Vd] logits
        calls.append(tuple(logits.shape))
        return top_k_last(torch.log_softmax(logits.float(), dim=-1), k)

    runs = []
    for stand_in in (False, True):
        if stand_in:
            monkeypatch.setattr(rows_mod, "draft_top_k_op_for", lambda drafter, k: op)
        rows = make_rows(model, d, 4, {1: TREE, 2: TREE, 4: TREE})
        outs = [[first] for first in rows.add_many(prompts)]
        for _ in range(6):
            for out, new in zip(outs, rows.cycle(spec=True), strict=True):
                out.append(new)
        runs.append(outs)
    assert runs[0] == runs[1]
    assert calls and all(len(c) == 2 for c in calls) and calls[0][0] == 3  # the 3 rows' roots at once (eager: no bucket)
    assert sum(len(new) - 1 for out in runs[1] for new in out[1:]) > 0  # drafts were accepted


def test_compiled_drafting_keeps_the_rows_drafts_and_tokens():
    """`FastRows.compile_drafting` (on CUDA by default): drafting, the verification's inputs, acceptance and
    feeding the drafter compiled by inductor, the target eager. A greedy and a sampled row decode as with eager
    pieces cycle after cycle (fp32): the same tokens and the same accepted drafts, and every piece ran compiled."""
    from eagle3.fast.rows import DRAFTING_PIECES

    model = build_tiny_target("llama", vocab_size=16)
    d = init_drafter(model, draft_vocab_size=16, seed=1)
    prompts = prompts_of([7, 12], 16, seed=9)
    settings = [None, SamplingConfig(0.8, seed=5)]
    runs = []
    for compiled in (False, True):
        rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=2, seq_len=128,
                        shapes={1: TREE, 2: TREE}.get, compile_drafting=compiled)
        outs = [[first] for first in rows.add_many(prompts, sampling=settings)]
        for _ in range(8):
            for out, new in zip(outs, rows.cycle(spec=True), strict=True):
                out.append(new)
        runs.append(outs)
        assert rows.drafting_compiled == compiled
        assert rows.pieces.tried == (set(DRAFTING_PIECES) if compiled else set())
    assert runs[0] == runs[1]
    assert sum(len(new) - 1 for out in runs[1] for new in out[1:]) > 0  # drafts were accepted


def test_held_tokens_reach_the_drafter_as_if_fed_every_cycle():
    """Plain cycles hold each row's features back and a feed step gives them to the drafter in one forward (before
    a speculative cycle, or when a row's window is full). Side by side with rows that feed the drafter in every
    plain cycle (`feed_window=0`), through joins, leaves and a random mix of cycles, every row accepts the same
    drafts and emits the same tokens, and after a feed both drafter caches hold the same K/V."""
    model = build_tiny_target("llama", vocab_size=8)
    d = init_drafter(model, draft_vocab_size=8, seed=1)
    shapes = {1: TREE, 2: DraftShape(4, 2, 8), 4: DraftShape(3, 1, 3)}
    eager, lazy = (FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=4, seq_len=256,
                            shapes=shapes.get, feed_window=w) for w in (0, 3))
    prompts = prompts_of([9, 4, 17, 6, 12, 5], 8, seed=3)
    budget = [60, 25, 70, 40, 30, 50]
    owner: list[int] = []
    done: dict[int, int] = {}
    waiting = list(range(len(prompts)))
    rng = random.Random(2)
    cycles = accepted = 0
    while waiting or owner:
        if waiting and eager.n < eager.capacity and cycles % 5 == 0:
            i = waiting.pop(0)
            assert eager.add(prompts[i]) == lazy.add(prompts[i])
            owner.append(i)
            done[i] = 1
        spec = rng.random() < 0.3  # runs of plain cycles: windows fill up
        a, b = eager.cycle(spec), lazy.cycle(spec)
        assert a == b, f"cycle {cycles}"
        accepted += spec * sum(len(t) - 1 for t in a)
        if spec:  # the lazy rows were fed first: both drafter caches cover every committed token
            for j in range(eager.n):
                n = int(eager.length[j])
                torch.testing.assert_close(lazy.dk[j, :, :n], eager.dk[j, :, :n], rtol=1e-4, atol=1e-5)
        for j, new in enumerate(a):
            done[owner[j]] += len(new)
        for j in reversed(range(len(owner))):
            if done[owner[j]] >= budget[owner[j]]:
                eager.remove(j)
                lazy.remove(j)
                owner[j] = owner[-1]
                owner.pop()
        cycles += 1
    assert accepted >= 5  # drafts were accepted, the same ones on both sides
    assert lazy.feeds > eager.feeds == 0 and lazy.feeds > lazy.spec_cycles  # also windows that filled up
    with pytest.raises(ConfigError, match="feed_window"):
        FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=2, seq_len=64, feed_window=-1)


def test_cycles_are_capture_safe():
    """On the meta device any `.item()`, boolean indexing or tensor made on the CPU raises."""
    model = build_tiny_target("qwen3")
    d = init_drafter(model, draft_vocab_size=64, seed=1)
    model, d = model.to("meta"), d.to("meta")
    rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=4, seq_len=64,
                    shapes={1: TREE, 2: DraftShape(3, 1, 3)}.get)
    for mode in (GREEDY, TEMPERATURE, FILTERED):  # argmax cycles, and those of buckets holding sampled rows
        for nb in (1, 2, 4):
            rows._plain_cycle(nb, mode)
            if rows.shapes[nb] is not None:
                rows._spec_cycle(nb, mode)
    for nb in (1, 2, 4):
        rows._feed_held(nb)  # the drafter catching up on plain cycles' held tokens
    for r, t in [(1, 16), (4, 64)]:  # admission prefills, captured per bucket too
        prefill_step(rows, rows._prefill_slot(r, t))
    assert rows.packet.device.type == "meta"
    host = FastRows(FastTarget(model), None, capacity=2, seq_len=64, host_nodes=5)  # trees the host writes
    for nb in (1, 2):
        host._spec_cycle(nb, GREEDY)
        host._spec_cycle(nb, FILTERED)
    assert host.packet.device.type == "meta"


@pytest.mark.parametrize("prefill_tokens", [8192, 24], ids=["bucketed", "beyond-buckets"])
def test_prefill_buckets_and_known_first_tokens(prefill_tokens):
    """Prompts prefilled through a bucket (staging cache, padded rows and width) or, past every bucket, through
    an exact one decode as HF does; a first token given in advance (a request moving in from elsewhere) is the
    one the row continues from."""
    model = build_tiny_target("qwen3", vocab_size=64)
    d = init_drafter(model, draft_vocab_size=64, seed=1)
    rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=4, seq_len=128,
                    shapes={1: TREE, 2: TREE, 4: DraftShape(3, 1, 3)}.get, prefill_tokens=prefill_tokens,
                    prefill_graphs=True)
    rows.prepare()
    assert all(r * t <= prefill_tokens for r, t in prefill_buckets(rows))
    assert len(rows._prefills) == len(prefill_buckets(rows))
    prompts = prompts_of([21, 6, 13], 64, seed=5)
    forced = 7  # not the model's own choice after prompts[2]
    refs = [hf_greedy(model, p, 12) for p in prompts[:2]] + [[forced, *hf_greedy(model, [*prompts[2], forced], 11)]]
    assert refs[2][0] != hf_greedy(model, prompts[2], 1)[0]
    firsts = rows.add_many(prompts, roots=[None, None, forced])
    outs = [[f] for f in firsts]
    while min(len(o) for o in outs) < 12:
        for j, new in enumerate(rows.cycle(spec=True)):
            outs[j] += new
    assert [o[:12] for o in outs] == refs


def test_bad_use_is_refused():
    model = build_tiny_target("llama", vocab_size=64)
    d = init_drafter(model, draft_vocab_size=64, seed=1)
    with pytest.raises(ConfigError, match="taps layers"):
        FastRows(FastTarget(model, []), d, capacity=2, seq_len=64)
    rows = make_rows(model, d, 2, {1: TREE}, seq_len=64)
    with pytest.raises(ConfigError, match="does not fit"):
        rows.add(list(range(60)))
    rows.add([1, 2, 3])
    with pytest.raises(RuntimeError, match="before adding rows"):
        rows.prepare()
    with pytest.raises(ValueError, match="no draft shape"):
        rows.add([4, 5])
        rows.cycle(spec=True)  # bucket 2 has no shape
    with pytest.raises(IndexError):
        rows.remove(5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_rows_match_the_batch1_engine():
    """On a GPU (fp32): every bucket's cycles are captured, also for a second FastRows built after the first was
    dropped (a graph the garbage collector frees during a capture used to spoil every capture after it), and
    the rows' tokens equal the batch-1 engine's."""
    model = build_tiny_target("llama", vocab_size=8).cuda()
    d = init_drafter(model, draft_vocab_size=8, seed=1).cuda()
    engine = FastEngine(model, draft="eagle3", spec=DraftShape(4, 3, 12), drafter=d)
    prompts = prompts_of([9, 4, 17], 8, seed=3)
    ref = [engine.generate(torch.tensor(p), max_new_tokens=30, eos_token_ids=[]).token_ids for p in prompts]
    for _ in range(2):
        rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=4, seq_len=256,
                        shapes={1: TREE, 2: TREE, 4: TREE}.get)
        rows.prepare()
        assert all(r.graph is not None for r in rows._runners.values())
        outs = [[rows.add(p)] for p in prompts]
        while min(len(o) for o in outs) < 30:
            for j, new in enumerate(rows.cycle(spec=True)):
                outs[j] += new
        assert [o[:30] for o in outs] == ref
        del rows
    # sampled rows replay their own captured cycles and draw the position-keyed tokens, next to a greedy row
    rows = make_rows(model, d, 4, {1: TREE, 2: TREE, 4: TREE})
    settings = [SamplingConfig(0.8, seed=5), None, SamplingConfig(1.0, top_p=0.9, top_k=4, seed=6)]
    want = [race_reference(model, p, 30, s) if s else r for p, s, r in zip(prompts, settings, ref, strict=True)]
    outs = [[f] for f in rows.add_many(prompts, sampling=settings)]
    k = 0
    while min(len(o) for o in outs) < 30:  # plain cycles in between: their held tokens are fed by captured steps
        for j, new in enumerate(rows.cycle(spec=k % 3 == 0)):
            outs[j] += new
        k += 1
    assert all(r.graph is not None for r in rows._runners.values()) and {k[2] for k in rows._runners} == {0, 1, 2}
    assert rows.feeds > 0 and all(r.graph is not None for r in rows._feeds.values())
    assert [o[:30] for o in outs] == want


def test_serve_says_what_to_do_when_the_rows_do_not_fit(monkeypatch):
    """`eagle3 serve --fast-rows on`: caches that do not fit the device give a ConfigError naming the flags."""
    import eagle3.fast.rows as rows_mod
    from eagle3.serving.cli import fast_rows
    from eagle3.serving.config import ServeConfig
    from eagle3.serving.policy import SpecPolicy

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(rows_mod.FastRows, "__init__", oom)
    model = build_tiny_target("llama", vocab_size=64)
    with pytest.raises(ConfigError, match="--fast-rows-len, --max-batch-size or --max-prefill-tokens, or use --fast-rows off"):
        fast_rows("on", model, None, SpecPolicy(largest=None), ServeConfig(max_batch_size=8), "cpu")


def test_serve_leaves_the_rows_off_where_host_memory_is_short(monkeypatch, caplog):
    """On a CPU the rows' caches are host memory: where they would take more than half of what the machine has
    available, `--fast-rows auto` serves on the HF rows and says why, and `--fast-rows on` is refused naming the
    flags; with room they are built."""
    import eagle3.fast.cpu as cpu_mod
    from eagle3.defaults import Decoding
    from eagle3.serving.cli import fast_rows
    from eagle3.serving.config import ServeConfig
    from eagle3.serving.policy import SpecPolicy

    model = build_tiny_target("llama", vocab_size=64)
    config = ServeConfig(max_batch_size=8, fast_rows_len=256)
    need = 2 * model.config.num_hidden_layers * 8 * model.config.num_key_value_heads * 256 * (
        model.config.hidden_size // model.config.num_attention_heads) * 4  # fp32 caches
    monkeypatch.setattr(cpu_mod, "available_memory", lambda: 2 * need - 1)
    fast = Decoding("fast", DraftShape.chain(4), None, False)  # what a CPU decoding in bf16 takes
    with caplog.at_level("WARNING"):
        assert fast_rows("auto", model, None, SpecPolicy(largest=None), config, "cpu", decoding=fast) is None
    assert "fast rows off" in caplog.text and "--max-batch-size or --fast-rows-len" in caplog.text
    with pytest.raises(ConfigError, match="lower --max-batch-size or --fast-rows-len, or use --fast-rows off"):
        fast_rows("on", model, None, SpecPolicy(largest=None), config, "cpu")
    monkeypatch.setattr(cpu_mod, "available_memory", lambda: 2 * need)
    assert fast_rows("on", model, None, SpecPolicy(largest=None), config, "cpu") is not None


def test_prefill_staging_covers_every_admission():
    """Every admission the scheduler allows (R rows x longest prompt T <= max_prefill_tokens, up to 64 rows and
    2,048 slots) falls in a captured bucket, also for sizes that are not powers of two."""
    from eagle3.fast.rows_prefill import MIN_PREFILL_WIDTH, prefill_staging_tokens

    def pow2(n: int) -> int:
        return 1 << (n - 1).bit_length()

    for m in (512, 3000, 4096, 6000):
        staging = prefill_staging_tokens(m)
        worst = max(pow2(r) * min(max(MIN_PREFILL_WIDTH, pow2(t)), 2048)
                    for r in range(1, 65) for t in range(1, min(m // r, 2048) + 1))
        assert worst <= staging <= 4 * m, (m, worst, staging)
    assert prefill_staging_tokens(4096) == 8192  # the default: twice max_prefill_tokens, as before


def test_rows_with_a_sliding_window_match_hf_generate():
    """The server's rows hide what lies outside an active sliding window (12 positions) as HF does."""
    model = build_tiny_target("mistral", vocab_size=64, sliding_window=12)
    d = init_drafter(model, draft_vocab_size=64, seed=1)
    rows = make_rows(model, d, 4, {1: TREE, 2: TREE, 4: DraftShape(3, 1, 3)})
    prompts = prompts_of([30, 9, 21], 64, seed=5)
    outs = [[t] for t in rows.add_many(prompts)]
    for spec in [True, False] * 12:
        for j, new in enumerate(rows.cycle(spec)):
            outs[j] += new
    for p, out in zip(prompts, outs, strict=True):
        assert out[:20] == hf_greedy(model, p, 20)


def test_a_cycle_launched_before_the_last_is_collected_changes_nothing():
    """`launch` twice before `collect` (what `FastEngine` does on CUDA, one cycle ahead of the host): the tokens two
    `cycle` calls give, in order; a third launch waits for a collect, and `clear` drops a cycle in flight."""
    model = build_tiny_target("llama", vocab_size=8)
    d = init_drafter(model, draft_vocab_size=8, seed=1)
    prompt = prompts_of([9], 8, seed=3)[0]
    ahead, step = (make_rows(model, d, 1, {1: TREE}) for _ in range(2))
    ahead.add(prompt)
    step.add(prompt)
    for _ in range(3):
        ahead.launch(spec=True)
        ahead.launch(spec=False)
        with pytest.raises(RuntimeError, match="collect one first"):
            ahead.launch(spec=True)
        assert [ahead.collect(), ahead.collect()] == [step.cycle(spec=True), step.cycle(spec=False)]
    ahead.launch(spec=True)
    ahead.clear()
    assert ahead.n == 0 and not ahead._launched
