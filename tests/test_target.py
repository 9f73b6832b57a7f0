"""The target adapter: aux hidden states equal HF `output_hidden_states` at the tapped layers, in prefill and in
tree verification; tree logits equal sequential decoding; KV compaction keeps exactly the accepted path.
Run: pytest tests/test_target.py"""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, TINY_SLIDING_WINDOW
from eagle3.config import ConfigError, default_aux_layer_ids
from eagle3.decoding.hf_batch import batched_forward, prefill
from eagle3.decoding.tree import DraftTree
from eagle3.target import Target

PROMPT_LEN = TINY_SLIDING_WINDOW + 7  # past Gemma-3's sliding window


def hf_hidden(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    out = model(ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[k] for k in layer_ids], dim=-1)  # [1, T, 3H]


@pytest.mark.parametrize("arch", ARCHS)
def test_aux_equals_output_hidden_states_in_prefill_and_tree(tiny_target, arch):
    model = tiny_target(arch)
    L = model.config.num_hidden_layers
    aux_ids = [2, L // 2, L - 3] if len({2, L // 2, L - 3}) == 3 else default_aux_layer_ids(L)
    t = Target(model, aux_ids)
    g = torch.Generator().manual_seed(0)
    full = torch.randint(3, 300, (1, PROMPT_LEN + 3), generator=g)
    kv, _, aux = prefill(t, [full[0, :PROMPT_LEN].tolist()])
    torch.testing.assert_close(aux, hf_hidden(model, full[:, :PROMPT_LEN], aux_ids), atol=1e-5, rtol=1e-5)

    # a tree: root = x_P; children "right" x_{P+1} and "wrong"; the right child has child x_{P+2}
    wrong = (int(full[0, PROMPT_LEN + 1]) + 1) % 300
    tree = DraftTree(tokens=torch.tensor([int(full[0, PROMPT_LEN + 1]), wrong, int(full[0, PROMPT_LEN + 2])]),
                     parents=torch.tensor([-1, -1, 0]))
    ids = torch.cat([full[:, PROMPT_LEN:PROMPT_LEN + 1], tree.tokens[None]], dim=1)  # [1, 4]
    appended_at = kv.width
    logits, taux = batched_forward(t, ids, kv, tree.attention_mask()[None], tree.position_offsets()[None])
    path = [0, 1, 3]  # root, right child, grandchild (N+1 indexing)
    ref_hidden = hf_hidden(model, full, aux_ids)[:, PROMPT_LEN:]
    torch.testing.assert_close(taux[:, path], ref_hidden, atol=1e-4, rtol=1e-4)  # fp32, other summation order
    ref_logits = model(full).logits[:, PROMPT_LEN:]
    torch.testing.assert_close(logits[:, path], ref_logits.float(), atol=1e-4, rtol=1e-4)

    # keep root + accepted path, then decode one more token: equal to HF on the full sequence
    kv.compact(appended_at, [path])
    assert kv.lengths == [PROMPT_LEN + 3] and kv.width == PROMPT_LEN + 3
    nxt = torch.tensor([[7]])
    logits, _ = batched_forward(t, nxt, kv, torch.ones(1, 1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long))
    ref = model(torch.cat([full, nxt], dim=1)).logits[:, -1]
    torch.testing.assert_close(logits[:, -1], ref.float(), atol=1e-4, rtol=1e-4)
    t.close()


def test_last_layer_tap_is_pre_norm(tiny_target):
    model = tiny_target("llama")
    L = model.config.num_hidden_layers
    t = Target(model, [1, 3, L])
    ids = torch.randint(3, 300, (1, 9))
    _, aux = t.forward(ids, t.new_cache())
    out = model(ids, output_hidden_states=True)
    # HF's hidden_states[L] is post-norm for Llama; our id L is the final norm's input
    h = aux[..., -model.config.hidden_size:]
    torch.testing.assert_close(model.model.norm(h), out.hidden_states[L], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(h, out.hidden_states[L])
    t.close()


def test_out_of_range_layer_id_is_refused(tiny_target):
    model = tiny_target("qwen3")
    with pytest.raises(ConfigError, match="out of range"):
        Target(model, [2, 3, 99])


def test_varying_shape_attention_leaves_cudnn_out_on_cuda_only():
    from eagle3.attention import varying_shape_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with varying_shape_attention("cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before  # nothing changes off CUDA
    with varying_shape_attention(torch.device("cuda", 0)):  # only sets backend flags: runs without a GPU
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
