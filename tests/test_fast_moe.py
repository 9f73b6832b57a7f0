"""Routed experts on the fast path (`eagle3.fast.moe`): Qwen3-MoE and Mixtral targets.

- `RoutedExperts` equals the HF MoE block on one token (experts gathered) and on many (every expert run), and
  grouped by expert on the host (a CPU's way), with and without Qwen3's renormalised top-k weights;
- greedy output equals HF `generate(do_sample=False)` for plain decoding, chains and trees, with few experts
  (verifications run every expert) and many (they gather), a dense layer among the MoE ones, and a sliding window;
- in bf16 a chain's verification gives each row the bits of one-token steps (what keeps chains identical);
- the steps are capture-safe (no host sync, nothing made off the device);
- the server's rows forward equals the batch-1 forward; new weights reach the fast target in place.
CPU, fp32 unless said. Run: pytest tests/test_fast_moe.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from conftest import _COMMON
from eagle3.config import DraftShape
from eagle3.decoding.sampling import GREEDY, TEMPERATURE
from eagle3.fast import FastEngine, FastOptions, FastRows, FastTarget, fast_support
from eagle3.fast.moe import RoutedExperts
from eagle3.fast.rows_prefill import prefill_step
from eagle3.runtime import init_drafter
from test_fast import forward_outputs, hf_greedy, prompt_of, verification_and_steps

NEW = 24
SHAPES = {"none": None, "chain": DraftShape.chain(4), "tree": DraftShape(4, 3, 12)}
FAMILIES = {
    # layer 2 dense (`mlp_only_layers`), the others routed; k of E renormalised or not (`norm_topk_prob`)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2, mlp_only_layers=[2], norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_experts_per_tok=2)),  # always renormalised
}
EXPERTS_KEY = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}


def build(family: str, experts: int = 8, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    config_name, model_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **kwargs, EXPERTS_KEY[family]: experts, **overrides})
    torch.manual_seed(seed + 7)
    return getattr(transformers, model_name)(config).to(torch.float32).eval().requires_grad_(False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("renormalise", [False, True])
def test_routed_experts_equal_the_hf_block(family, renormalise):
    model = build(family, experts=8, norm_topk_prob=renormalise) if family == "qwen3_moe" else build(family)
    block = model.model.layers[0].mlp
    experts = RoutedExperts(block)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    for n in (1, 2, 9):  # 2 and 4 (token, expert) pairs: gathered; 18 >= 8 experts: every expert runs
        torch.testing.assert_close(experts(x[:n]), block(x[None, :n])[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(experts(x[:n], on_host=True, min_rows=2), block(x[None, :n])[0], rtol=1e-5,
                                   atol=1e-5)
    # negative control: the k weights renormalised (or not) when the model says otherwise
    experts.renormalise = not experts.renormalise
    if family == "qwen3_moe":
        assert not torch.allclose(experts(x), block(x[None])[0], atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("experts", [8, 64])
@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("on_host", [True, False])
def test_greedy_matches_hf_generate(family, experts, kind, on_host):
    """Grouped by expert on the host (the CPU's way), or as on a GPU: with 8 experts, 2 a token, one-token steps
    gather, a chain's and a tree's verification run every expert; with 64, verifications gather too, prefills of
    35 tokens run every expert."""
    model = build(family, experts)
    assert fast_support(model) is None
    d = init_drafter(model, draft_vocab_size=200, seed=1)
    engine = FastEngine(model, draft="none" if kind == "none" else "eagle3", spec=SHAPES[kind], drafter=d)
    assert engine.target.experts_on_host
    engine.target.experts_on_host = on_host
    assert sum(lw.moe is not None for lw in engine.target.layers) == (5 if family == "qwen3_moe" else 6)
    for plen, seed in ((5, 1), (35, 2)):
        prompt = prompt_of(plen, seed)
        assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == \
            hf_greedy(model, prompt, NEW), plen


@pytest.mark.parametrize("kind", ["none", "tree"])
def test_a_windowed_mixtral_matches_hf_generate(kind):
    model = build("mixtral", sliding_window=12)
    engine = FastEngine(model, draft="none" if kind == "none" else "eagle3", spec=SHAPES[kind],
                        drafter=init_drafter(model, draft_vocab_size=200, seed=1))
    assert engine.target.window == 12
    prompt = prompt_of(35, 3)
    assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == hf_greedy(model, prompt, NEW)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("on_host", [True, False])
def test_chain_rows_have_the_bits_of_one_token_steps_in_bf16(family, on_host):
    """A chain's verification (6 tokens, 12 (token, expert) pairs of 64 experts) gives each row the logits of six
    one-token steps bit for bit, with the fast path's own row-exact kernels (`exact_rows`, forced here on any
    CPU): grouped on the host, every expert's product has at least two rows; gathered (as on a GPU), each pair is
    a product of its own."""
    wide = {"hidden_size": 256, "moe_intermediate_size": 2048} if family == "qwen3_moe" else \
        {"hidden_size": 256, "intermediate_size": 2048}  # where one-row products round otherwise
    model = build(family, experts=64, **wide).to(torch.bfloat16)

    def fresh() -> FastTarget:
        t = FastTarget(model)
        t.exact_rows = True
        t.experts_on_host = on_host
        t.packed = None  # torch's own products, whose one-row kernel rounds otherwise
        return t

    rows, steps = verification_and_steps(fresh)
    assert torch.equal(rows, steps)


@pytest.mark.parametrize("experts", [8, 64])
def test_step_functions_are_capture_safe(experts):
    """As tests/test_rows.py's test of cycles, on the meta device (any host read raises there), with experts
    gathered and run whole."""
    model = build("qwen3_moe", experts)
    d = init_drafter(model, draft_vocab_size=200, seed=1)
    model, d = model.to("meta"), d.to("meta")
    aux = d.config.aux_layer_ids
    for shape in (DraftShape(4, 3, 10), DraftShape.chain(3)):
        rows = FastRows(FastTarget(model, aux), d, capacity=2, seq_len=256, shapes=lambda _b, s=shape: s)
        for nb in (1, 2):
            rows._spec_cycle(nb, GREEDY)
            rows._spec_cycle(nb, TEMPERATURE)
            rows._plain_cycle(nb, GREEDY)
        prefill_step(rows, rows._prefill_slot(1, 64))  # 64 tokens: every expert runs
        assert rows.packet.device.type == "meta"


def test_two_rows_forward_as_one():
    model = build("qwen3_moe")
    logits, aux, rows, rows_aux = forward_outputs(FastTarget(model, [1, 3, 5]), prompt_of(12, seed=4))
    for r in range(2):
        torch.testing.assert_close(rows[r], logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rows_aux[r], aux, rtol=1e-4, atol=1e-4)


def test_new_weights_reach_the_fast_target():
    """Experts are the model's own tensors: an in-place update (an RL step) reaches the fast target, and
    `reload_weights` refreshes the fused attention copies."""
    model = build("qwen3_moe")
    target = FastTarget(model, [1, 3, 5])
    prompt = prompt_of(9, seed=5)
    before = forward_outputs(target, prompt)[0]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(1.5)
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts.down_proj.mul_(-1.0)
    target.reload_weights()
    after = forward_outputs(target, prompt)[0]
    expected = model(prompt[None]).logits[0]
    assert not torch.allclose(before, expected, atol=1e-3)
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)


def test_weight_bytes_count_the_active_experts():
    model = build("mixtral", experts=8)
    target = FastTarget(model)
    per_expert = 3 * 64 * 128 * 4  # gate, up and down of an expert, fp32
    dense = FastTarget(build("mixtral", experts=8, num_experts_per_tok=1)).weight_bytes()
    assert target.weight_bytes() - dense == 6 * per_expert  # one more expert read per layer


def test_experts_with_biases_stay_off_the_fast_path():
    model = build("mixtral")
    experts = model.model.layers[3].mlp.experts
    experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(8, 256))
    assert "layer 3" in fast_support(model) and "biases" in fast_support(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pieces", ["eager", "compiled"])
@pytest.mark.parametrize("experts", [8, 64])
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_cuda_graphs_match_hf_generate(pieces, experts, kind):
    """On a GPU, fp32: routed experts inside captured cycles and graph prefills give HF's greedy tokens, with the
    elementwise pieces and drafting eager or compiled (the CUDA defaults)."""
    model = build("qwen3_moe", experts).cuda()
    d = init_drafter(model, draft_vocab_size=200, seed=1).cuda()
    prompt = prompt_of(9, seed=13)
    ref = hf_greedy(model, prompt.cuda(), NEW)
    base = FastOptions() if pieces == "compiled" else FastOptions(fuse_pointwise="off", compile_drafting=False)
    for opts in (base, replace(base, graph_prefill=True)):
        engine = FastEngine(model, draft="none" if kind == "none" else "eagle3", spec=SHAPES[kind], drafter=d,
                            options=opts)
        for _ in range(2):  # the second request replays the graphs captured for the first
            assert engine.generate(prompt, max_new_tokens=NEW, eos_token_ids=[]).token_ids == ref
        assert engine.graphed
