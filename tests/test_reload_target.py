"""`Runtime.reload_target`: an RL loop's new policy weights reach the running decoders (engines built before the
update, sharing one `FastTarget`), which then decode exactly as a fresh load of those weights does."""

from __future__ import annotations

import copy

import pytest
import torch

from eagle3.config import ConfigError, DraftShape
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.fast import FastEngine
from eagle3.runtime import Runtime, init_drafter
from eagle3.target import Target


def runtime(model, tok, drafter) -> Runtime:
    target = Target(model, drafter.config.aux_layer_ids if drafter is not None else [])
    return Runtime(model=model, tokenizer=tok, target=target, engine=SpeculativeEngine(target, NoDraftProposer()),
                   drafter=drafter, spec=DraftShape.chain(3), draft="eagle3" if drafter is not None else "none")


def policy_step(model, seed: int) -> dict[str, torch.Tensor]:
    """The weights after a (simulated) policy update: every tensor moved by noise of its own scale."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=g).to(v.dtype)
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fold", [False, True])  # the norms folded into the fused matrices, as on a GPU
def test_reloaded_weights_decode_as_a_fresh_load(stories260k, fold):
    model, tok = stories260k
    model = copy.deepcopy(model)
    drafter = init_drafter(model, seed=1).eval()
    rt = runtime(model, tok, drafter)
    target = rt.fast_target()
    if fold:
        target.norm_kernel = "fold"
        target.select_norm()
    plain = FastEngine(model, draft="none", tokenizer=tok, target=target)
    eagle = FastEngine(model, draft="eagle3", spec=DraftShape(3, 2, 5), drafter=drafter, tokenizer=tok,
                       target=target)
    ids = tok("Once upon a time", add_special_tokens=True)["input_ids"]
    before = plain.generate(ids, max_new_tokens=32).token_ids

    new = policy_step(model, seed=5)
    rt.reload_target(new)
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(new)
    want = FastEngine(fresh, draft="none", tokenizer=tok).generate(ids, max_new_tokens=32).token_ids
    assert want != before  # the update changed the policy's answer: a stale decoder would fail below
    assert plain.generate(ids, max_new_tokens=32).token_ids == want
    assert eagle.generate(ids, max_new_tokens=32).token_ids == want
    assert rt.engine.generate(ids, max_new_tokens=32).token_ids == want  # the generic engine reads the model


def test_weights_of_another_model_are_refused(stories260k):
    model, tok = stories260k
    rt = runtime(copy.deepcopy(model), tok, None)
    with pytest.raises(ConfigError, match="do not fit the target"):
        rt.reload_target({"lm_head.weight": torch.zeros(3, 3)})


def test_a_reloaded_drafter_drafts_in_the_engines_built_before(stories260k, tmp_path):
    """`Runtime.reload_drafter`: a drafter of the same shapes (an `adapt` output after a policy step) reaches the
    engines built before: the fast engine's own tensors hold its weights (the same tensors, so captured graphs
    replay them) and the generic engines' drafter has them; answers stay the target's. A drafter of other shapes
    is refused and changes nothing."""
    from eagle3.defaults import Decoding
    from eagle3.fast.drafter import WEIGHTS, FastDrafter
    from eagle3.formats import save_drafter
    from eagle3.runtime import decoder, drafter_for

    model, tok = stories260k
    model = copy.deepcopy(model)
    save_drafter(init_drafter(model, seed=2), tmp_path / "new", format="speculators")
    save_drafter(init_drafter(model, draft_vocab_size=64, seed=3), tmp_path / "small", format="speculators")
    rt = runtime(model, tok, drafter_for(model, None))
    shape = DraftShape(3, 2, 5)
    fast, generic = (decoder(rt, Decoding(kind, shape, guard=True)) for kind in ("fast", "generic"))
    ids = tok("Once upon a time", add_special_tokens=True)["input_ids"]
    plain = FastEngine(model, draft="none", tokenizer=tok).generate(ids, max_new_tokens=24).token_ids
    fd = fast.drafter
    ptr = fd.wqkv.data_ptr()

    def holds(want) -> bool:
        ref = FastDrafter(want)
        return (all(torch.equal(getattr(fd, n), getattr(ref, n)) for n in WEIGHTS if getattr(ref, n) is not None)
                and all(torch.equal(a, b) for a, b in zip(rt.drafter.state_dict().values(),
                                                          want.state_dict().values(), strict=True)))

    new = drafter_for(model, tmp_path / "new")
    assert not holds(new)
    for engine in (fast, generic):  # each guard learns about the old drafter
        assert engine.generate(ids, max_new_tokens=24).token_ids == plain and len(engine.guards) == 1
    rt.reload_drafter(tmp_path / "new")
    assert holds(new) and fd.wqkv.data_ptr() == ptr
    assert len(fast.guards) == len(generic.guards) == 0  # the new drafter is judged afresh
    assert fast.generate(ids, max_new_tokens=24).token_ids == plain
    assert generic.generate(ids, max_new_tokens=24).token_ids == plain
    with pytest.raises(ConfigError, match="shapes differ"):
        rt.reload_drafter(tmp_path / "small")
    assert holds(new)
