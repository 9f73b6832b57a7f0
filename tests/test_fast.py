"""The fast path (`eagle3.fast`) on CPU: same code as on CUDA, run eagerly.

- greedy output equals HF `generate(do_sample=False)` on tiny Llama/Mistral/Qwen2/Qwen3 and on stories260K, for
  plain decoding, EAGLE-3 chains and trees (random drafter), n-gram, and the test doubles (scripted partial
  acceptance, always-right self-drafting) plugged in as host proposers;
- the device tree expansion equals `Eagle3Proposer.propose`; device acceptance equals `accept`;
  KV compaction moves exactly the accepted slots;
- the step functions run on the meta device (no host sync, no tensor created off-device: what CUDA graph
  capture needs);
- sampling reproduces the generic engine with the same seed; unsupported targets fall back with a notice.
Run: pytest tests/test_fast.py
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import build_tiny_target
from doubles import ScriptedProposer, SelfTreeProposer
from eagle3.config import ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.expand import top_k_last, top_n_in_order
from eagle3.decoding.proposers import ModelProposer, NoDraftProposer
from eagle3.decoding.tree import DraftTree, ancestry
from eagle3.decoding.verify import accept
from eagle3.fast import FastDrafter, FastEngine, FastOptions, FastRows, FastTarget, build_engine, fast_support
from eagle3.fast.cpu import argmax_ids
from eagle3.fast.pointwise import (
    ELEMENTWISE_PIECES,
    apply_rope,
    apply_rope_heads,
    fuse_level,
    rope_tables,
)
from eagle3.runtime import init_drafter
from eagle3.target import Target

FAST_ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NEW = 24
TREE = DraftShape(4, 3, 12)
CHAIN = DraftShape.chain(4)


@pytest.fixture(scope="module")
def models():
    return {a: build_tiny_target(a) for a in FAST_ARCHS}


@pytest.fixture(scope="module")
def drafters(models):
    return {a: init_drafter(m, draft_vocab_size=200, seed=1) for a, m in models.items()}


def prompt_of(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g)


def forward_outputs(tgt: FastTarget, ids: torch.Tensor, s: int = 32) -> tuple[torch.Tensor, ...]:
    """A causal forward of ids [T] into fresh caches of s slots: logits [T, V] and aux [T, 3·H] of one row, and the
    same for two equal rows ([2, T, V], [2, T, 3·H])."""
    t = ids.shape[0]
    pos = torch.arange(t)
    mask = torch.zeros(t, s, dtype=torch.bool)
    mask[:, :t] = torch.tril(torch.ones(t, t, dtype=torch.bool))
    rope = tgt.rope_table(s)

    def rows(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.zeros(tgt.num_layers, b, tgt.nkv, s, tgt.hd, dtype=tgt.dtype)
        return tgt.forward_rows(ids.expand(b, t), pos.expand(b, t), pos.expand(b, t), mask.expand(b, t, s), k,
                                torch.zeros_like(k), rope, want_aux=True)

    (logits, aux), (two, two_aux) = rows(1), rows(2)
    return logits[0], aux[0], two, two_aux


def hf_greedy(model, prompt: torch.Tensor, max_new: int, eos: int | None = None) -> list[int]:
    """HF greedy decoding; eos None: no EOS at all (the tiny models' EOS id would end some runs at once)."""
    out = model.generate(prompt[None], max_new_tokens=max_new, do_sample=False, pad_token_id=0, eos_token_id=eos)
    return out[0, prompt.numel():].tolist()


@pytest.mark.parametrize("arch", FAST_ARCHS)
@pytest.mark.parametrize("plen", [5, 35])
@pytest.mark.parametrize("kind", ["none", "chain", "tree", "ngram"])
def test_greedy_matches_hf_generate(models, drafters, arch, plen, kind):
    model = models[arch]
    prompt = prompt_of(plen, seed=len(arch) + plen)
    ref = hf_greedy(model, prompt, NEW)
    draft, spec = {"none": ("none", None), "chain": ("eagle3", CHAIN), "tree": ("eagle3", TREE),
                   "ngram": ("ngram", CHAIN)}[kind]
    engine = FastEngine(model, draft=draft, spec=spec, drafter=drafters[arch])
    res = engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[])
    assert res.token_ids == ref
    assert len(ref) == NEW and res.stats.cycles == len(res.stats.accepted_per_cycle) >= 1


@pytest.mark.parametrize("kind", ["none", "chain", "tree"])
def test_stories260k_matches_hf_generate(stories260k, kind):
    model, tok = stories260k
    prompt = torch.tensor(tok("Once upon a time, Lily found a", add_special_tokens=True)["input_ids"])
    ref = hf_greedy(model, prompt, 48, eos=2)
    d = init_drafter(model, seed=0)
    spec = {"none": None, "chain": DraftShape.chain(5), "tree": DraftShape(5, 4, 16)}[kind]
    engine = FastEngine(model, draft="none" if kind == "none" else "eagle3", spec=spec, drafter=d, tokenizer=tok)
    res = engine.generate(prompt, max_new_tokens=48, eos_token_ids=[2])
    assert res.token_ids == ref
    assert res.text == tok.decode(ref, skip_special_tokens=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_scripted_partial_acceptance(models, arch, tree, k):
    """Exactly k drafts accepted per cycle: the compaction keeps exactly the accepted path."""
    model = models[arch]
    prompt = prompt_of(9, seed=3)
    ref = hf_greedy(model, prompt, NEW)
    prop = ScriptedProposer(ref, k=k, length=4, vocab_size=300, tree=tree)
    res = FastEngine(model, draft=prop, max_nodes=8).generate(prompt, max_new_tokens=NEW, eos_token_ids=[])
    assert res.token_ids == ref
    assert all(a == k for a in res.stats.accepted_per_cycle[:-1])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("stop", [1e-12, 1e-3, 0.9])
def test_stopping_chains_match_hf_generate(models, drafters, arch, stop):
    """`FastOptions.chain_stop`: chains of at most 5 that stop where the joint draft probability falls below
    `stop` (the random drafter's top-1 is near 1/200: 1e-12 never stops, 1e-3 after one or two tokens, 0.9 at
    once) emit HF `generate`'s tokens, draft 1..5 tokens a cycle and count what they drafted."""
    model = models[arch]
    prompt = prompt_of(11, seed=3)
    ref = hf_greedy(model, prompt, NEW)
    engine = FastEngine(model, draft="eagle3", spec=DraftShape.chain(5),
                        drafter=drafters[arch], options=FastOptions(chain_stop=stop))
    res = engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[])
    assert res.token_ids == ref
    depths = res.stats.drafted_depth_per_cycle
    assert res.stats.drafted_tokens == sum(depths)
    assert set(depths) == {5} if stop == 1e-12 else {1} if stop == 0.9 else 1 <= min(depths) <= max(depths) <= 5


def test_a_stopping_chain_drafts_a_prefix_of_the_full_chain(models, drafters):
    """From one state, a chain with a stop proposes the first n tokens of the full chain, n < its depth here."""
    model, d = models["llama"], drafters["llama"]
    rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=1, seq_len=128,
                    shapes=lambda _b: DraftShape.chain(5), chain_stop=1e-3)
    rows.add(prompt_of(11, seed=3).tolist())
    stopped, _ = rows._draft(1)
    rows.chain_stop = None
    full, _ = rows._draft(1)
    n = stopped.shape[1]
    assert 1 <= n < 5 and torch.equal(stopped, full[:, :n])


def test_chain_stop_is_checked(models, drafters):
    model, d = models["llama"], drafters["llama"]
    with pytest.raises(ConfigError, match="for EAGLE-3 chains"):
        FastEngine(model, draft="eagle3", spec=TREE, drafter=d, options=FastOptions(chain_stop=0.2))
    with pytest.raises(ConfigError, match="between 0 and 1"):
        FastEngine(model, draft="eagle3", spec=CHAIN, drafter=d, options=FastOptions(chain_stop=1.5))


@pytest.mark.parametrize("self_kind", ["chain", "tree"])
def test_always_right_drafter(models, self_kind):
    model = models["qwen2"]
    prompt = prompt_of(6, seed=4)
    ref = hf_greedy(model, prompt, NEW)
    prop = ModelProposer(model, 4) if self_kind == "chain" else SelfTreeProposer(model, 4)
    res = FastEngine(model, draft=prop, max_nodes=8).generate(prompt, max_new_tokens=NEW, eos_token_ids=[])
    assert res.token_ids == ref
    assert res.stats.tau > 4.0


def test_stops_at_eos_and_max_new_tokens_inside_a_cycle(models):
    model = models["llama"]
    prompt = prompt_of(6, seed=5)
    ref = hf_greedy(model, prompt, NEW)
    eos = ref[9]
    expected = ref[: ref.index(eos) + 1]
    res = FastEngine(model, draft=ModelProposer(model, 4), max_nodes=4).generate(
        prompt, max_new_tokens=NEW, eos_token_ids=[eos])
    assert res.token_ids == expected and res.finish_reason == "stop"
    res = FastEngine(model, draft=ModelProposer(model, 4), max_nodes=4).generate(
        prompt, max_new_tokens=7, eos_token_ids=[])
    assert res.token_ids == ref[:7] and res.finish_reason == "length"


@pytest.mark.parametrize("ranked", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_device_tree_equals_generic_proposer(models, drafters, arch, ranked):
    model, d = models[arch], drafters[arch]
    spec = DraftShape(5, 4, 20)
    prompt = prompt_of(11, seed=6)
    target = Target(model, d.config.aux_layer_ids)
    try:
        logits, aux = target.forward(prompt[None], target.new_cache(), logits_to_keep=1)
    finally:
        target.close()
    generic = Eagle3Proposer(d, spec)
    generic.begin(prompt, aux, int(logits[0, -1].argmax()))
    tree = generic.propose()

    rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=1, seq_len=128,
                    shapes=lambda _b: spec, sampling=False)
    rows.ranked = ranked  # the top-k of compiled drafting on CUDA (`ranked_top_k`)
    assert rows.add(prompt.tolist()) == int(logits[0, -1].argmax())
    tokens, parents1 = rows._draft(1)
    assert tokens[0].tolist() == tree.tokens.tolist()
    assert (parents1[0, 1:] - 1).tolist() == tree.parents.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_roll_is_bit_exact(dtype):
    from transformers.models.llama.modeling_llama import rotate_half

    g = torch.Generator().manual_seed(0)
    x, cos, sin = (torch.randn(*shape, generator=g).to(dtype) for shape in [(5, 3, 16), (5, 16), (5, 16)])
    assert torch.equal(apply_rope(x, *rope_tables(cos, sin)), x * cos[:, None] + rotate_half(x) * sin[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_the_heads_in_front_is_bit_exact(dtype):
    """RoPE on heads-first operands (what the RoPE kernel computes) gives `apply_rope`'s bits."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, 16, generator=g).to(dtype)  # [T, heads, hd]
    cos, ssin = rope_tables(*(torch.randn(6, 16, generator=g).to(dtype) for _ in range(2)))
    assert torch.equal(apply_rope_heads(x.transpose(0, 1), cos, ssin), apply_rope(x, cos, ssin).transpose(0, 1))


def test_fuse_levels_and_bad_levels():
    """`FastOptions.fuse_pointwise`: None or "auto" is elementwise on CUDA and off on a CPU; False or "off" is off;
    True and "elementwise" compile RoPE and SwiGLU, never the norms; anything else stops with the option's choices.
    A default engine on a CPU leaves the target eager."""
    values = (None, "auto", False, "off", True, "elementwise")
    assert [fuse_level(v, "cuda:1") for v in values] == [
        "elementwise", "elementwise", None, None, "elementwise", "elementwise"]
    assert [fuse_level(v, torch.device("cpu")) for v in values] == [
        None, None, None, None, "elementwise", "elementwise"]
    assert not {"norm", "add_norm"} & set(ELEMENTWISE_PIECES)
    with pytest.raises(ConfigError, match=r"expected one of \('auto', 'off', 'elementwise'\)"):
        fuse_level("all", "cpu")
    with pytest.raises(ConfigError, match="fuse_pointwise"):
        FastEngine(build_tiny_target("llama"), draft="none", options=FastOptions(fuse_pointwise="fast"))
    assert not FastEngine(build_tiny_target("llama"), draft="none").target.pointwise.compiled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_ids_equals_argmax_first_maximum_included(dtype):
    """The CPU upcast (`argmax_ids`) picks what torch's argmax picks in the logits' own dtype, ties included."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 5000, generator=g) * 4).to(dtype)  # coarse bf16 steps: many equal values
    logits[1, 7] = logits[1, 4000] = logits[1].max() + 1  # an exact tie: the first index wins
    ids = argmax_ids(logits)
    assert torch.equal(ids, logits.argmax(dim=-1)) and int(ids[1]) == 7
    assert torch.equal(argmax_ids(logits[2]), logits[2].argmax())  # one row [V] -> a scalar id


@pytest.mark.parametrize("arch,wide,fuse,gemm", [
    ("llama", False, None, False), ("qwen3", False, None, False), ("llama", True, None, False),
    ("llama", False, "elementwise", False), ("qwen3", False, "elementwise", False),
    ("llama", False, None, True), ("qwen2", False, "elementwise", True), ("llama", True, None, True)])
def test_chain_rows_have_the_bits_of_one_token_steps_in_bf16(arch, wide, fuse, gemm):
    """The property that keeps bf16 chains identical to plain decoding on the fast path: a forward of T causal
    tokens gives each row the logits (bit for bit) that T one-token steps give, whatever layout the many-token
    path uses internally. Qwen3 covers the q/k-norm path.
    `wide`: an MLP of 2,048 (SmolLM2's is 1,536), where a CPU without AMX (AMD EPYC, AVX512-BF16) rounds a
    one-row product differently from a many-row one with the vendor's kernels; the fast path's own
    (`exact_rows`, forced here on any CPU) keep the rows equal. `fuse`: with RoPE and
    SwiGLU compiled by inductor (`FastOptions.fuse_pointwise="elementwise"`), whose one-token and many-token kernels must
    round alike. `gemm`: the residual adds in the products' epilogues (`residual_in_gemm`, the CUDA default;
    qwen2 has q/k/v biases but none on o_proj and down_proj, so both its adds still fuse)."""
    over = {"hidden_size": 256, "intermediate_size": 2048} if wide else {}
    model = build_tiny_target(arch, **over).to(torch.bfloat16)

    def fresh() -> FastTarget:
        t = FastTarget(model)
        t.exact_rows = t.exact_rows or wide
        t.residual_in_gemm = gemm
        if fuse:
            t.fuse_pointwise(level=fuse)
        return t

    rows, steps = verification_and_steps(fresh)
    assert torch.equal(rows, steps)


def verification_and_steps(fresh) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [6, V] of tokens 18..23 of a 24-token prompt after the same 18-token prefill, on two fresh targets
    (`fresh()`), one row each: as one 6-token causal forward, and as six one-token steps."""
    ids = prompt_of(24, seed=3)
    ar = torch.arange(32)
    logits = {}
    for mode in ("rows", "steps"):
        t = fresh()
        k, rope = torch.zeros(t.num_layers, 1, t.nkv, 32, t.hd, dtype=t.dtype), t.rope_table(32)
        v = torch.zeros_like(k)

        def run(a: int, b: int, t=t, k=k, v=v, rope=rope) -> torch.Tensor:  # tokens a..b-1: logits [b-a, V]
            pos = ar[a:b]  # their positions and slots
            mask = (ar[None, :] <= pos[:, None])[None]  # [1, b-a, 32] causal
            return t.forward_rows(ids[None, a:b], pos[None], pos[None], mask, k, v, rope)[0][0]

        run(0, 18)  # the same prefill for both
        logits[mode] = run(18, 24) if mode == "rows" else torch.cat([run(p, p + 1) for p in range(18, 24)])
    return logits["rows"], logits["steps"]


def _random_tree(n: int, vocab: int, g: torch.Generator) -> DraftTree:
    parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
    tokens = torch.randint(0, vocab, (n,), generator=g)
    if n > 2:
        tokens[2] = tokens[1] if parents[2] == parents[1] else tokens[2]  # duplicate siblings happen
    return DraftTree(tokens=tokens, parents=torch.tensor(parents))


@pytest.mark.parametrize("seed", range(12))
def test_device_acceptance_equals_accept(models, seed):
    """Acceptance on device of a host tree (`load_tree`, padded with invalid nodes) against the reference `accept`."""
    g = torch.Generator().manual_seed(seed)
    n_max, vocab = 10, 6  # a small vocabulary makes long accepted paths likely
    rows = FastRows(FastTarget(models["llama"]), None, capacity=1, seq_len=64, host_nodes=n_max, sampling=False)
    n = int(torch.randint(1, n_max + 1, (1,), generator=g))
    tree = _random_tree(n, vocab, g)
    logits = torch.randn(n + 1, vocab, generator=g)
    for i in torch.randperm(n, generator=g)[: n // 2].tolist():  # plant matches: node i is the target's argmax
        logits[tree.parents[i] + 1, tree.tokens[i]] = 10.0 + i
    rows.root.fill_(4)
    rows.load_tree(0, tree.tokens.tolist(), tree.parents.tolist())
    top = torch.cat([logits.argmax(-1), torch.zeros(n_max - n, dtype=torch.long)])  # padding rows: any value
    tokens, parents1, valid = rows.tree_tokens[:1], rows.tree_parents1[:1], rows.tree_valid[:1]
    keep, n_acc, emitted = rows._accept(1, tokens, parents1, ancestry(parents1, n_max), top[None], valid)
    ref = accept(tree, logits.argmax(-1))
    a = int(n_acc)
    assert a == ref.n_accepted
    assert keep[0, 1 : a + 1].tolist() == ref.path
    assert emitted[0, : a + 1].tolist() == ref.emitted(tree)
    assert rows.packet[0, 0] == a and rows.packet[0, 2 : a + 3].tolist() == ref.emitted(tree)
    assert int(rows.packet[0, 1]) == (int(tree.depths().max()) if n else 0)


def test_kv_compaction_moves_the_accepted_slots(models):
    rows = FastRows(FastTarget(models["qwen3"]), None, capacity=1, seq_len=64, host_nodes=6, sampling=False)
    slots = torch.arange(64, dtype=rows.k.dtype)
    rows.k.copy_(slots[None, None, None, :, None].expand_as(rows.k))
    rows.v.copy_(-slots[None, None, None, :, None].expand_as(rows.v))
    length = 20
    rows.length.fill_(length)
    rows.span = 64
    keep = torch.tensor([[0, 2, 5, 6, 0, 0, 0]])  # root, then N+1 indices of the accepted path
    emitted = torch.tensor([[7, 8, 9, 10, 0, 0, 0]])  # its tokens, then the bonus token
    rows._commit(1, keep, torch.tensor([3]), emitted, None)
    expect = [*range(length), length + 0, length + 2, length + 5, length + 6]
    for layer in range(rows.t.num_layers):
        assert rows.k[layer, 0, 0, : length + 4, 0].tolist() == expect
        assert (-rows.v[layer, 0, 1, : length + 4, 0]).tolist() == expect
    assert int(rows.length[0]) == length + 4 and int(rows.root[0]) == 10


@pytest.mark.parametrize("ranked", [False, True])
def test_top_k_last_equals_topk(ranked):
    """Two-stage, ranked (chunk maxima, then ranks within the chosen chunks, then across them) and k = 1 (a max)
    give torch.topk's values and indices, also where the k largest crowd into one chunk."""
    g = torch.Generator().manual_seed(4)
    for shape, k in (((8192,), 10), ((10, 8192), 10), ((3, 4, 1024), 7), ((5, 300), 4), ((2, 512), 300),
                     ((10, 8192), 1), ((100,), 10), ((7, 640), 10)):
        x = torch.randn(shape, generator=g)
        vals, idx = top_k_last(x, k, ranked=ranked)
        ref_vals, ref_idx = x.topk(k, dim=-1)
        assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_idx), (shape, k)
    clustered = torch.randn(3, 4096, generator=g)
    clustered[0, 640:650] += 10  # the 10 largest in one chunk
    clustered[1, 640:645] += 10  # five there, the rest spread
    vals, idx = top_k_last(clustered, 10, ranked=ranked)
    assert torch.equal(vals, clustered.topk(10).values) and torch.equal(idx, clustered.topk(10).indices)
    ties = torch.tensor([[0.0, 1.0, 1.0, -2.0, 1.0, 0.5] * 64])  # [1, 384]: many equal values
    vals, idx = top_k_last(ties, 5, ranked=ranked)
    assert torch.equal(vals, ties.topk(5).values) and torch.equal(ties.gather(-1, idx), vals)


@pytest.mark.parametrize("ranked", [False, True])
def test_top_n_in_order_equals_the_two_sorts(ranked):
    """The rerank, sorted or ranked, keeps exactly what a stable descending sort's first n, sorted by index, keep:
    with ties (equal scores, -inf) and batch dimensions."""
    g = torch.Generator().manual_seed(5)
    cases = [torch.randn(510, generator=g), torch.randn(4, 37, generator=g),
             torch.randint(-3, 1, (3, 50), generator=g).float(),  # many ties
             torch.tensor([0.0, -float("inf"), -1.0, -float("inf"), 0.0, -2.0])]
    for scores in cases:
        for n in (1, 5, scores.shape[-1] // 2, scores.shape[-1]):
            ref = torch.sort(torch.sort(-scores, dim=-1, stable=True).indices[..., :n], dim=-1).values
            assert torch.equal(top_n_in_order(scores, n, ranked), ref), (scores.shape, n)


def test_compiled_drafting_keeps_greedy_output(models, drafters):
    """`FastOptions(compile_drafting=True)` (the default on CUDA): the engine's rows compile their drafting pieces
    and emit HF generate's tokens (the rows' own test compares the trees cycle by cycle)."""
    model, d = models["qwen3"], drafters["qwen3"]
    prompt = prompt_of(20, seed=40)
    engine = FastEngine(model, draft="eagle3", spec=CHAIN, drafter=d, options=FastOptions(compile_drafting=True))
    assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == hf_greedy(model, prompt, NEW)
    assert engine.drafting_compiled and engine.rows.pieces.tried


def test_compiled_drafting_falls_back_to_eager_with_a_warning(models, drafters, caplog):
    def broken(gm, example_inputs):
        raise RuntimeError("no code generator here")

    model, d = models["llama"], drafters["llama"]
    prompt = prompt_of(9, seed=41)
    engine = FastEngine(model, draft="eagle3", spec=TREE, drafter=d,
                        options=FastOptions(compile_drafting=True, compile_backend=broken))
    with caplog.at_level(logging.WARNING, logger="eagle3.fast"):
        out = engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids
    assert out == hf_greedy(model, prompt, NEW)
    assert "torch.compile of the cycle piece _draft failed" in caplog.text
    assert not engine.drafting_compiled  # every piece now runs eagerly


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_pointwise_keeps_greedy_output(models, drafters, arch):
    """`fuse_pointwise`: RoPE and SwiGLU compiled by inductor with dynamic shapes, so one
    set of kernels serves prefill (5 and 35 tokens), plain steps and 13-row tree verification; greedy output
    still equals HF generate (qwen3: with its q/k norms), and a forward's logits and aux features equal eager's
    up to fp32 rounding, also through `forward_rows`."""
    model, d = models[arch], drafters[arch]
    for plen in (5, 35):
        prompt = prompt_of(plen, seed=20 + plen)
        ref = hf_greedy(model, prompt, NEW)
        for draft, spec in (("none", None), ("eagle3", TREE)):
            engine = FastEngine(model, draft=draft, spec=spec, drafter=d, options=FastOptions(fuse_pointwise=True))
            assert engine.target.pointwise.compiled
            assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == ref

    eager, fused = FastTarget(model, d.config.aux_layer_ids), FastTarget(model, d.config.aux_layer_ids)
    fused.fuse_pointwise()
    outs = [forward_outputs(tgt, prompt_of(12, seed=30)) for tgt in (eager, fused)]
    for e, f in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=2e-4)  # other summation orders in fp32
    assert outs[0][0].argmax(-1).tolist() == outs[1][0].argmax(-1).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_residual_in_gemm_keeps_greedy_output(models, drafters, arch, monkeypatch):
    """The residual adds in the products' epilogues (`residual_in_gemm`, on by default only on CUDA): greedy
    output still equals HF generate for plain decoding, chains and trees (the aux features too, which are
    copied before the residual changes in place); the products are `Tensor.addmm_` with
    the residual written in place (two per layer), and a bias (qwen2's q/k/v only here) never goes that way."""
    import eagle3.fast.target as target_mod

    assert target_mod.residual_in_gemm("cuda:0") and not target_mod.residual_in_gemm("cpu")
    monkeypatch.setattr(target_mod, "residual_in_gemm", lambda device: True)
    calls = []
    real = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda h, *a, **k: calls.append(h.shape) or real(h, *a, **k))
    model, d = models[arch], drafters[arch]
    prompt = prompt_of(11, seed=41)
    ref = hf_greedy(model, prompt, NEW)
    for draft, spec in (("none", None), ("eagle3", CHAIN), ("eagle3", TREE)):
        engine = FastEngine(model, draft=draft, spec=spec, drafter=d)
        assert engine.target.residual_in_gemm
        calls.clear()
        assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == ref
        assert len(calls) % (2 * model.config.num_hidden_layers) == 0 and calls


def test_residual_in_gemm_keeps_logits_and_aux_features(models, drafters):
    """With the residual changing in place (`residual_in_gemm`), a forward's logits and aux features (which the
    drafter reads, so a wrong one would only cost acceptance, never output) equal the separate adds' up to fp32
    rounding, in one row and in two, and the batched generator answers alike."""
    from eagle3.fast.batched import BatchedGenerator

    model, d = models["llama"], drafters["llama"]
    ids = prompt_of(12, seed=44)
    outs, answers = [], []
    for gemm in (False, True):
        tgt = FastTarget(model, d.config.aux_layer_ids)
        tgt.residual_in_gemm = gemm
        outs.append(forward_outputs(tgt, ids))
        gen = BatchedGenerator(model, rows=2, max_seq_len=64)
        gen.t.residual_in_gemm = gemm
        answers.append([a.tokens for a in gen.generate([ids[:7].tolist(), ids.tolist()], max_new_tokens=6,
                                                       eos_token_ids=[])])
    for e, f in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-5)
    assert answers[0] == answers[1]


def test_packed_weights_give_the_bits_of_f_linear(models, drafters):
    """`PackedWeights`, the products over weights packed once for oneDNN (in bf16 on CPUs with AVX512-BF16 and no
    AMX, `cpu_packs_weights`): F.linear's bits, with and without a bias, for 1 to 8 rows and 3-D inputs, each row
    the same whatever rows come with it; F.linear itself for a weight it does not hold. Targets and drafters
    pack exactly where `cpu_packs_weights` says (bf16 here), never in fp32."""
    from eagle3.fast.cpu import PackedWeights, cpu_packs_weights

    if not cpu_packs_weights("cpu", torch.bfloat16):
        pytest.skip("this CPU keeps torch's bf16 products (no AVX512-BF16, or AMX: see cpu_packs_weights)")
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 64, generator=g) / 8).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    other = torch.randn(32, 64, generator=g).bfloat16()
    packed = PackedWeights([w])
    x = torch.randn(8, 64, generator=g).bfloat16()
    for bias in (None, b):
        full = packed.linear(x, w, bias)  # [8, 96]
        assert torch.equal(full, F.linear(x, w, bias))
        for m in (1, 2, 3, 4):
            assert torch.equal(packed.linear(x[:m], w, bias), full[:m])
        assert torch.equal(packed.linear(x.view(2, 4, 64), w, bias), full.view(2, 4, 96))
    assert torch.equal(packed.linear(x, other), F.linear(x, other))
    model, d = models["llama"], drafters["llama"]
    assert FastTarget(model).packed is None and FastDrafter(d).packed is None  # fp32
    m16, d16 = build_tiny_target("llama").to(torch.bfloat16), init_drafter(model, draft_vocab_size=200, seed=1)
    t16, fd16 = FastTarget(m16), FastDrafter(d16.to(torch.bfloat16))
    assert t16.packed is not None and fd16.packed is not None
    x16 = torch.randn(3, t16.hidden_size, generator=g).bfloat16()
    assert torch.equal(t16.linear(x16, t16.lm_head), F.linear(x16, t16.lm_head))


@pytest.mark.parametrize("kind", ["none", "tree"])
def test_sampling_matches_generic_engine_with_same_seed(models, drafters, kind):
    model, d = models["llama"], drafters["llama"]
    prompt = prompt_of(8, seed=9)
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=123)
    target = Target(model, d.config.aux_layer_ids)
    try:
        prop = NoDraftProposer() if kind == "none" else Eagle3Proposer(d, TREE)
        ref = SpeculativeEngine(target, prop).generate(prompt, max_new_tokens=NEW, sampling=sampling).token_ids
    finally:
        target.close()
    engine = FastEngine(model, draft="none" if kind == "none" else "eagle3", spec=TREE, drafter=d)
    assert engine.generate(prompt, max_new_tokens=NEW, sampling=sampling).token_ids == ref


@pytest.mark.parametrize("kind", ["none", "chain", "tree", "ngram"])
def test_fixed_width_prefill_matches_hf_generate(models, drafters, kind):
    """`graph_prefill`: prompts padded to a power of two (the padding's K/V sits in slots no step sees before
    overwriting them) give HF's greedy tokens, across widths, leftovers of a longer prompt in the padding, and
    a cache regrown by a long prompt; sampling still matches the generic engine."""
    model, d = models["qwen2"], drafters["qwen2"]
    draft, spec = {"none": ("none", None), "chain": ("eagle3", CHAIN), "tree": ("eagle3", TREE),
                   "ngram": ("ngram", CHAIN)}[kind]
    engine = FastEngine(model, draft=draft, spec=spec, drafter=d, options=FastOptions(graph_prefill=True))
    for n, seed in [(35, 20), (5, 21), (16, 22), (17, 23), (150, 24), (9, 25)]:
        prompt = prompt_of(n, seed)
        assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == \
            hf_greedy(model, prompt, NEW), n
    assert {t for _, t in engine.rows._prefills} >= {16, 256}  # prefill widths captured
    if kind == "tree":
        prompt, sampling = prompt_of(8, seed=9), SamplingConfig(temperature=0.8, top_p=0.95, seed=123)
        target = Target(model, d.config.aux_layer_ids)
        try:
            ref = SpeculativeEngine(target, Eagle3Proposer(d, TREE)).generate(
                prompt, max_new_tokens=NEW, sampling=sampling).token_ids
        finally:
            target.close()
        assert engine.generate(prompt, max_new_tokens=NEW, sampling=sampling).token_ids == ref


def test_graph_prefill_is_on_by_default_only_on_cuda(models):
    """`FastOptions.graph_prefill=None` (the default of the library, `generate` and `bench`) resolves per device:
    captured prefills on CUDA, the eager prefill on a CPU (where padding to a power of two costs compute); an
    explicit choice stays, and the caller's options object is not changed."""
    from eagle3.fast.engine import graph_prefill_by_default

    assert graph_prefill_by_default("cuda:0") and graph_prefill_by_default(torch.device("cuda"))
    assert not graph_prefill_by_default("cpu")
    model = models["llama"]
    shared = FastOptions()
    assert FastEngine(model, draft="none", options=shared).options.graph_prefill is False
    assert shared.graph_prefill is None
    assert FastEngine(model, draft="none", options=FastOptions(graph_prefill=True)).options.graph_prefill is True


def test_shared_target_and_cache_growth(models, drafters):
    """Engines sharing one FastTarget stay correct when another engine (or a longer request) regrows it."""
    model, d = models["qwen3"], drafters["qwen3"]
    shared = FastTarget(model, d.config.aux_layer_ids)
    plain = FastEngine(model, draft="none", target=shared)
    tree = FastEngine(model, draft="eagle3", spec=TREE, drafter=d, target=shared)
    short, long = prompt_of(5, seed=10), prompt_of(150, seed=11)
    for engine, prompt in [(plain, short), (tree, long), (plain, short), (plain, long), (tree, short)]:
        assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == \
            hf_greedy(model, prompt, NEW)


def test_unsupported_target_falls_back_with_notice(caplog):
    model = build_tiny_target("gemma3_text")
    with caplog.at_level(logging.WARNING, logger="eagle3.fast"):
        engine = build_engine(model, draft="none")
    assert isinstance(engine, SpeculativeEngine)
    assert "fast path unavailable" in caplog.text and "gemma3_text" in caplog.text
    prompt = prompt_of(6, seed=12)
    assert engine.generate(prompt, max_new_tokens=8, eos_token_ids=[]).token_ids == hf_greedy(model, prompt, 8)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_graphs_on_a_second_gpu_that_is_not_current():
    """A model on cuda:1 while cuda:0 is the current device (a library user who never called set_device): the
    captured cycles still run on cuda:1 and give HF's greedy tokens. torch.cuda.graph's default capture stream
    belongs to the device current when it was made, so a capture there would leave graphs that replay nothing."""
    torch.cuda.set_device(0)
    model = build_tiny_target("llama").to("cuda:1")
    d = init_drafter(model, draft_vocab_size=200, seed=1).to("cuda:1")
    prompt = prompt_of(9, seed=13)
    ref = hf_greedy(model, prompt.to("cuda:1"), NEW)
    for draft, spec in (("none", None), ("eagle3", CHAIN), ("eagle3", TREE)):
        engine = FastEngine(model, draft=draft, spec=spec, drafter=d, options=FastOptions())
        for _ in range(2):
            assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == ref
        assert engine.graphed
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["none", "chain", "tree", "ngram"])
def test_cuda_sampled_cycles_match_plain_sampling(kind):
    """On a GPU: sampled requests run captured cycles with the position-keyed draw compiled inside them, and emit
    exactly what eager plain sampling emits with the same seed (temperature alone, and with top-p / top-k)."""
    model = build_tiny_target("llama").cuda()
    d = init_drafter(model, draft_vocab_size=200, seed=1).cuda()
    prompt = prompt_of(9, seed=13)
    draft, spec = {"none": ("none", None), "chain": ("eagle3", CHAIN), "tree": ("eagle3", TREE),
                   "ngram": ("ngram", CHAIN)}[kind]
    for sampling in (SamplingConfig(temperature=0.9, seed=3), SamplingConfig(temperature=1.1, top_p=0.9, top_k=40,
                                                                              seed=4)):
        plain = FastEngine(model, draft="none", options=FastOptions(graphs=False)).generate(
            prompt, max_new_tokens=NEW, eos_token_ids=[], sampling=sampling).token_ids
        assert plain != hf_greedy(model, prompt.cuda(), NEW)
        for opts in (FastOptions(), FastOptions(pipeline=False), FastOptions(graph_prefill=True)):
            engine = FastEngine(model, draft=draft, spec=spec, drafter=d, options=opts)
            for _ in range(2):
                assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[], sampling=sampling).token_ids \
                    == plain
            assert engine.graphed


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["none", "chain", "tree", "ngram"])
def test_cuda_graphs_match_hf_generate(kind):
    """On a GPU: captured cycles (pipelined) give HF's greedy tokens in fp32, and really replay graphs; also with
    the elementwise work compiled (`fuse_pointwise`: elementwise by default on CUDA) inside the captured
    graphs or eager (off), with the drafter's and the target's SDPA attention (matmul and split by default on
    CUDA), and with captured prefills (`graph_prefill`)."""
    model = build_tiny_target("llama").cuda()
    d = init_drafter(model, draft_vocab_size=200, seed=1).cuda()
    prompt = prompt_of(9, seed=13)
    ref = hf_greedy(model, prompt.cuda(), NEW)
    draft, spec = {"none": ("none", None), "chain": ("eagle3", CHAIN), "tree": ("eagle3", TREE),
                   "ngram": ("ngram", CHAIN)}[kind]
    for opts in (FastOptions(), FastOptions(pipeline=False), FastOptions(graphs=False),
                 FastOptions(fuse_pointwise=True), FastOptions(fuse_pointwise="off"),
                 FastOptions(target_attention="sdpa"),
                 FastOptions(graph_prefill=True)):
        engine = FastEngine(model, draft=draft, spec=spec, drafter=d, options=opts)
        for _ in range(2):  # the second request replays the graphs captured for the first
            assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == ref
        assert engine.graphed == opts.graphs



WINDOWED = {"mistral": dict(sliding_window=12),  # every layer, as Mistral sets it
            "qwen2": dict(sliding_window=12, use_sliding_window=True, max_window_layers=0)}  # every layer windowed


@pytest.mark.parametrize("arch", sorted(WINDOWED))
@pytest.mark.parametrize("kind", ["none", "chain", "tree"])
def test_sliding_windows_match_hf_generate(arch, kind):
    """An active sliding window (12 positions; prompts of 35 and 24 new tokens) on the fast path: prefill,
    verification and plain steps hide what lies outside it, as HF's `sliding_window_overlay` does."""
    model = build_tiny_target(arch, **WINDOWED[arch])
    d = init_drafter(model, draft_vocab_size=200, seed=1)
    engine = FastEngine(model, draft="none" if kind == "none" else "eagle3",
                        spec={"none": None, "chain": CHAIN, "tree": TREE}[kind], drafter=d)
    assert engine.target.window == 12
    for plen, seed in ((35, 3), (9, 4)):
        prompt = prompt_of(plen, seed)
        assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == \
            hf_greedy(model, prompt, NEW), plen
    # negative control: the same model attending without its window answers otherwise
    full = FastEngine(model, draft="none")
    full.target.window = None
    prompt = prompt_of(35, 3)
    assert full.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids != hf_greedy(model, prompt, NEW)


def test_mixed_window_layers_stay_off_the_fast_path():
    model = build_tiny_target("qwen2", sliding_window=12, use_sliding_window=True, max_window_layers=1)
    assert "mixed" in fast_support(model)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["none", "chain", "tree"])
def test_cuda_graphs_with_a_sliding_window_match_hf_generate(kind):
    """On a GPU, fp32: a windowed Mistral (window 12) decodes by captured cycles, split-KV kernels and graph
    prefills as HF `generate` does past its window."""
    model = build_tiny_target("mistral", **WINDOWED["mistral"]).cuda()
    d = init_drafter(model, draft_vocab_size=200, seed=1).cuda()
    engine = FastEngine(model, draft="none" if kind == "none" else "eagle3",
                        spec={"none": None, "chain": CHAIN, "tree": TREE}[kind], drafter=d)
    for plen, seed in ((35, 3), (150, 4)):
        prompt = prompt_of(plen, seed)
        assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == \
            hf_greedy(model, prompt.cuda(), NEW), plen
    assert engine.graphed


def test_a_piece_that_fails_to_compile_for_one_mode_stays_compiled_for_the_others(caplog):
    """A cycle piece compiles once per sampling mode (a plain int argument); when one mode's compilation fails,
    that mode runs eagerly (one warning) and the modes that compiled keep their compiled code."""
    from eagle3.fast.graphs import CompiledPieces

    class Owner:
        def piece(self, x: torch.Tensor, mode: int) -> torch.Tensor:
            return x * 2 if mode == 0 else x + 1

    compiled_runs, compilations = [], []

    def backend(gm, example_inputs):  # the first compilation (mode 0) works, the second (mode 1) fails
        compilations.append(len(compilations))
        if len(compilations) > 1:
            raise RuntimeError("no code for this variant")

        def run(*a):
            compiled_runs.append(1)
            return gm.forward(*a)
        return run

    owner, x = Owner(), torch.arange(4.0)
    pieces = CompiledPieces(owner)
    pieces.compile(["piece"], backend=backend)
    with caplog.at_level("WARNING", logger="eagle3"):
        assert torch.equal(pieces.run("piece", x, 0), x * 2) and len(compiled_runs) == 1
        for _ in range(2):  # mode 1 fails once, then runs eagerly without another attempt
            assert torch.equal(pieces.run("piece", x, 1), x + 1)
        assert torch.equal(pieces.run("piece", x, 0), x * 2) and len(compiled_runs) == 2  # still compiled
    warnings = [r.getMessage() for r in caplog.records if "torch.compile of the cycle piece piece" in r.getMessage()]
    assert len(warnings) == 1 and "(1,)" in warnings[0] and "running it eagerly" in warnings[0]
    assert len(compilations) == 2 and pieces.failed == {("piece", 1)}


def test_a_drafter_loads_in_place_and_keeps_its_source_intact(models):
    """`FastDrafter.load_weights`: another drafter of the same shapes, written into this one's own tensors (the
    same storage, so captured graphs replay the new weights): it then computes what a FastDrafter built from the new
    drafter computes, and the drafter it was built from keeps its own weights. Other shapes are refused, unchanged."""
    model = models["llama"]
    old, new = (init_drafter(model, draft_vocab_size=200, seed=s) for s in (1, 2))
    before = {n: t.clone() for n, t in old.state_dict().items()}
    fd, ref = FastDrafter(old), FastDrafter(new)
    ptrs = {n: getattr(fd, n).data_ptr() for n in ("fc", "wqkv", "lm_head", "d2t")}
    assert fd.mismatch(new) is None
    fd.load_weights(new)
    assert {n: getattr(fd, n).data_ptr() for n in ptrs} == ptrs
    g = torch.Generator().manual_seed(3)
    hidden, tokens = torch.randn(1, 5, fd.hidden_size, generator=g), torch.randint(3, 200, (1, 5), generator=g)
    pos = torch.arange(5)[None]
    mask = torch.arange(64)[None, None, :] <= pos[:, :, None]  # [1, 5, 64]

    def out(f: FastDrafter) -> torch.Tensor:
        k = torch.zeros(1, f.nkv, 64, f.hd)
        return f.logits(f.forward_rows(hidden, tokens, pos, pos, mask, k, torch.zeros_like(k), f.rope_table(64)))

    torch.testing.assert_close(out(fd), out(ref), rtol=0, atol=0)
    assert all(torch.equal(t, before[n]) for n, t in old.state_dict().items())

    small = init_drafter(model, draft_vocab_size=100, seed=3)
    assert "lm_head" in fd.mismatch(small)
    with pytest.raises(ConfigError, match="cannot be loaded in place"):
        fd.load_weights(small)
    torch.testing.assert_close(fd.lm_head, ref.lm_head, rtol=0, atol=0)
