"""Draft vocabulary: top-Vd selection, padding, d2t/t2d consistency, coverage, files.

Run: pytest tests/test_vocab.py -q
"""

from __future__ import annotations

import pytest
import torch

from eagle3.config import ConfigError, DrafterConfig
from eagle3.drafter import Eagle3Drafter
from eagle3.training.vocab import (
    build_vocab_mapping,
    check_vocab_mapping,
    coverage,
    coverage_by_size,
    draft_ids_to_target,
    load_token_freq,
    load_vocab_mapping,
    save_token_freq,
    save_vocab_mapping,
)


def _reference_ids(freq: list[int], vd: int) -> list[int]:
    """The speculators rule written out by hand: sort seen ids by (-count, id), pad with ids 0.. not yet taken."""
    seen = [i for i, f in enumerate(freq) if f > 0]
    chosen = sorted(seen, key=lambda i: (-freq[i], i))[:vd]
    taken = set(chosen)
    for i in range(len(freq)):
        if len(chosen) >= vd:
            break
        if i not in taken:
            chosen.append(i)
    return sorted(chosen)


def test_docstring_example() -> None:
    d2t, t2d = build_vocab_mapping(torch.tensor([0, 5, 0, 9, 5, 1]), 3)
    assert d2t.tolist() == [1, 2, 2]
    assert t2d.tolist() == [False, True, False, True, True, False]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool


def test_ties_go_to_the_lower_id() -> None:
    # ids 2, 4, 6 all have count 3; only two fit after id 0 (count 10)
    d2t, t2d = build_vocab_mapping(torch.tensor([10, 0, 3, 0, 3, 0, 3]), 3)
    assert draft_ids_to_target(d2t).tolist() == [0, 2, 4]
    assert not t2d[6]


def test_fewer_distinct_tokens_than_draft_vocab_pads_with_lowest_unused_ids() -> None:
    freq = torch.zeros(10, dtype=torch.int64)
    freq[5], freq[7] = 4, 9
    d2t, t2d = build_vocab_mapping(freq, 4)
    assert draft_ids_to_target(d2t).tolist() == [0, 1, 5, 7]
    assert int(t2d.sum()) == 4
    assert coverage(freq, t2d) == 1.0


def test_matches_the_reference_rule_on_random_counts_with_ties() -> None:
    g = torch.Generator().manual_seed(0)
    for vocab, vd in [(50, 10), (50, 45), (200, 64), (30, 30)]:
        freq = torch.randint(0, 4, (vocab,), generator=g) * torch.randint(0, 2, (vocab,), generator=g)
        d2t, t2d = build_vocab_mapping(freq, vd)
        assert draft_ids_to_target(d2t).tolist() == _reference_ids(freq.tolist(), vd)
        check_vocab_mapping(d2t, t2d)
        assert torch.equal(torch.nonzero(t2d).flatten(), draft_ids_to_target(d2t))


def test_full_vocabulary_is_the_identity() -> None:
    d2t, t2d = build_vocab_mapping(torch.tensor([3, 0, 1, 7]), 4)
    assert d2t.tolist() == [0, 0, 0, 0]
    assert bool(t2d.all())


def test_invalid_sizes_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="larger than the target vocabulary"):
        build_vocab_mapping(torch.ones(8, dtype=torch.int64), 9)
    with pytest.raises(ConfigError, match="must be positive"):
        build_vocab_mapping(torch.ones(8, dtype=torch.int64), 0)
    with pytest.raises(ConfigError, match="1-D"):
        build_vocab_mapping(torch.ones(2, 4, dtype=torch.int64), 2)


def test_check_vocab_mapping_rejects_inconsistent_buffers() -> None:
    d2t, t2d = build_vocab_mapping(torch.tensor([0, 5, 0, 9, 5, 1]), 3)
    bad_t2d = t2d.clone()
    bad_t2d[0] = True
    with pytest.raises(ConfigError, match="t2d marks"):
        check_vocab_mapping(d2t, bad_t2d)
    absolute = draft_ids_to_target(d2t)  # absolute ids stored where offsets belong
    with pytest.raises(ConfigError):
        check_vocab_mapping(absolute, t2d)
    with pytest.raises(ConfigError, match="int64"):
        check_vocab_mapping(d2t.to(torch.int32), t2d)


def test_coverage_and_coverage_by_size() -> None:
    freq = torch.tensor([6, 0, 3, 1])
    _, t2d = build_vocab_mapping(freq, 2)  # ids 0, 2
    assert coverage(freq, t2d) == pytest.approx(0.9)
    assert coverage_by_size(freq, [1, 2, 3, 10]) == pytest.approx({1: 0.6, 2: 0.9, 3: 1.0, 4: 1.0})
    assert coverage(torch.zeros(4, dtype=torch.int64), t2d) == 0.0


def test_files_round_trip(tmp_path) -> None:
    freq = torch.tensor([0, 5, 0, 9, 5, 1])
    d2t, t2d = build_vocab_mapping(freq, 3)
    save_vocab_mapping(d2t, t2d, tmp_path / "vocab.safetensors")
    save_token_freq(freq, tmp_path / "token_freq.safetensors")
    d2t2, t2d2 = load_vocab_mapping(tmp_path / "vocab.safetensors")
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    assert torch.equal(load_token_freq(tmp_path / "token_freq.safetensors"), freq.to(torch.int64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token_freq.safetensors", "vocab.safetensors"]
    with pytest.raises(ConfigError, match="token_freq"):
        load_token_freq(tmp_path / "vocab.safetensors")


def test_mapping_agrees_with_the_drafter_buffers() -> None:
    cfg = DrafterConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=40,
        draft_vocab_size=8,
        aux_layer_ids=[1, 2, 3],
        target_num_layers=4,
    )
    freq = torch.randint(0, 5, (40,), generator=torch.Generator().manual_seed(1))
    d2t, t2d = build_vocab_mapping(freq, cfg.draft_vocab_size)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab_mapping(draft_ids_to_target(d2t))
    assert torch.equal(drafter.d2t, d2t) and torch.equal(drafter.t2d, t2d)
    draft_ids = torch.arange(cfg.draft_vocab_size)
    assert torch.equal(drafter.draft_ids_to_target(draft_ids), torch.nonzero(t2d).flatten())
