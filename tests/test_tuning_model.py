"""The tuning cost model picks the shape with the best predicted tokens/s, and the tuning cache finds an entry
only under an identical key. CPU only, no models: `pytest tests/test_tuning_model.py`."""

from __future__ import annotations

import json
import logging
import os

import pytest

import eagle3
from eagle3.config import ConfigError, DraftShape
from eagle3.tuning import (
    AcceptanceProfile,
    Costs,
    Prediction,
    TuningStore,
    candidate_shapes,
    choose,
    cycle_seconds,
    drafter_store,
    find_tuning,
    predict,
    predict_all,
    tuning_key,
    user_store,
)

ACCEPT = (0.8, 0.6, 0.45, 0.3, 0.2)  # per-position acceptance of a chain
PLAIN_S = 0.020


def gpu_like(verify_flat_to: int, verify_then: tuple[int, float]) -> Costs:
    """Verification costs one plain step up to `verify_flat_to` rows, then rises linearly."""
    return Costs(plain_s=PLAIN_S, verify_s={1: PLAIN_S, verify_flat_to: PLAIN_S, verify_then[0]: verify_then[1]},
                 draft_step_s={1: 0.002, 4: 0.003}, overhead_s=0.001)


# -- choosing ---------------------------------------------------------------------------------------------
def test_chain_optimum_when_verification_rises_after_four_rows():
    costs = gpu_like(4, (8, 0.030))  # verify(n) = 0.020 for n <= 4, then +0.0025 per row
    profile = AcceptanceProfile(0.0, ACCEPT)
    # by hand: k drafts cost k * 0.002, verify(k + 1), overhead 0.001; tau = 1 + sum(ACCEPT[:k])
    #   k=1: 1.80 / 0.023  = 78.26    k=2: 2.40 / 0.025 = 96.00    k=3: 2.85 / 0.027 = 105.56
    #   k=4: 3.15 / 0.0315 = 100.00   k=5: 3.35 / 0.036 = 93.06    k>5: no acceptance measured
    best = choose(costs, profile, candidate_shapes())
    assert best.shape == DraftShape.chain(3)
    assert best.tau == pytest.approx(2.85)
    assert best.cycle_s == pytest.approx(0.027)
    assert best.tokens_per_s == pytest.approx(2.85 / 0.027)
    assert best.speedup == pytest.approx(2.85 / 0.027 * PLAIN_S)
    assert cycle_seconds(DraftShape.chain(4), costs) == pytest.approx(0.0315)
    assert cycle_seconds(DraftShape.chain(5), costs) == pytest.approx(0.036)
    # trees have no measured tau in this profile, chains beyond 5 no acceptance: only plain + chains 1..5
    predictions = predict_all(candidate_shapes(), costs, profile)
    assert [p.shape for p in predictions] == [None, *(DraftShape.chain(k) for k in range(1, 6))]
    assert predictions[0] == Prediction(None, 1.0, PLAIN_S, 1 / PLAIN_S, 1.0)


def test_plain_when_verification_costs_a_plain_step_per_row():
    # CPU fp32-like: verify(n) = n * plain_s (extrapolated from two points)
    costs = Costs(plain_s=PLAIN_S, verify_s={1: PLAIN_S, 2: 2 * PLAIN_S}, draft_step_s={1: 0.002}, overhead_s=0.001)
    assert costs.verify(6) == pytest.approx(6 * PLAIN_S)
    profile = AcceptanceProfile(0.0, ACCEPT)
    best_chain = predict(DraftShape.chain(1), costs, profile)
    assert best_chain.tokens_per_s == pytest.approx(1.8 / 0.043)  # the best chain, still below 50 tok/s
    assert best_chain.speedup < 1.0
    best = choose(costs, profile, candidate_shapes())
    assert best.shape is None
    assert best.speedup == 1.0 and best.tokens_per_s == pytest.approx(50.0)


def test_plain_when_the_gain_is_below_min_speedup():
    costs = Costs(plain_s=PLAIN_S, verify_s={1: PLAIN_S}, draft_step_s={1: 0.002}, overhead_s=0.007625)
    profile = AcceptanceProfile(0.0, (0.5,))
    only = [DraftShape.chain(1)]
    assert predict(only[0], costs, profile).speedup == pytest.approx(1.5 * PLAIN_S / 0.029625)  # 1.0127
    assert choose(costs, profile, only).shape is None
    assert choose(costs, profile, only, min_speedup=1.0).shape == DraftShape.chain(1)


def test_tree_wins_when_its_measured_tau_is_higher():
    costs = gpu_like(32, (64, 0.030))  # verification flat up to 32 rows
    chains_only = AcceptanceProfile(0.0, ACCEPT)
    # chains by hand: k=3: 2.85 / 0.027 = 105.56, k=4: 3.15 / 0.029 = 108.62, k=5: 3.35 / 0.031 = 108.06
    assert choose(costs, chains_only, candidate_shapes()).shape == DraftShape.chain(4)
    profile = AcceptanceProfile(0.0, ACCEPT, {"4,4,16": 4.2, "6,10,60": 4.5})
    # tree 4,4,16: 0.002 + 3 * draft_step(4) 0.003 + verify(17) 0.020 + 0.001 = 0.032 -> 4.2 / 0.032 = 131.25
    # tree 6,10,60: draft_step(10) = 0.005 (extrapolated), verify(61) = 0.020 + 29 * 0.01 / 32
    assert cycle_seconds(DraftShape.parse("6,10,60"), costs) == pytest.approx(0.002 + 5 * 0.005 + 0.0290625 + 0.001)
    best = choose(costs, profile, candidate_shapes())
    assert best.shape == DraftShape(4, 4, 16)
    assert best.tokens_per_s == pytest.approx(4.2 / 0.032)
    assert best.speedup == pytest.approx(4.2 / 0.032 * PLAIN_S)


def test_acceptance_tau():
    profile = AcceptanceProfile(0.7, ACCEPT, {"6,10,60": 3.9})
    assert profile.tau(DraftShape.chain(2)) == pytest.approx(2.4)
    assert profile.tau(DraftShape.chain(5)) == pytest.approx(3.35)
    assert profile.tau(DraftShape.chain(6)) is None
    assert profile.tau(DraftShape()) == 3.9
    assert profile.tau(DraftShape(5, 8, 32)) is None
    assert predict(DraftShape(5, 8, 32), gpu_like(4, (8, 0.03)), profile) is None


def test_candidate_shapes():
    shapes = candidate_shapes(max_chain=3, trees=("6,10,60",))
    assert shapes == [DraftShape.chain(1), DraftShape.chain(2), DraftShape.chain(3), DraftShape(6, 10, 60)]
    assert len(candidate_shapes()) == 13
    # every other length (a GPU's), the longest always: its run measures every position's acceptance
    assert [s.depth for s in candidate_shapes(max_chain=7, trees=(), chain_step=2)] == [2, 4, 6, 7]
    assert len(candidate_shapes(chain_step=2)) == 9


def test_tune_spreads_its_prompts_over_the_set():
    """Bundled sets are ordered by category: tune's few prompts come from across the set, not its start."""
    from eagle3.tuning.command import spread

    assert spread(list(range(80)), 4) == [0, 20, 40, 60]
    assert spread(list(range(10)), 3) == [0, 3, 6]
    assert spread([1, 2], 4) == [1, 2]


# -- interpolation ----------------------------------------------------------------------------------------
def test_draft_steps_from_timed_runs():
    """A run's cycle less the verification of its rows, per drafting step: the one-row step from the longest chain,
    a tree's wider steps after its root step; from a tree alone, every step costs the same."""
    from eagle3.tuning.sweep import Run, with_draft_steps

    rows = Costs(plain_s=0.010, verify_s={1: 0.010, 5: 0.012, 61: 0.016}, draft_step_s={1: 0.0})

    def run(cycle_s: float, depth: float) -> Run:
        return Run("x", seconds=cycle_s * 10, cycles=10, tokens=30, tau=3.0, acceptance=[], drafted_depth=depth)

    chain, tree = DraftShape.chain(4), DraftShape(6, 10, 60)
    both = with_draft_steps(rows, [(chain, run(0.016, 4)), (tree, run(0.026, 6))])
    assert both.draft_step(1) == pytest.approx(0.001) and both.draft_step(10) == pytest.approx(0.0018)
    alone = with_draft_steps(rows, [(tree, run(0.022, 6))])
    assert alone.draft_step(1) == pytest.approx(0.001) == alone.draft_step(10)
    assert alone.plain_s == rows.plain_s and alone.verify_s == rows.verify_s


def test_costs_interpolate_and_extrapolate():
    costs = Costs(plain_s=1.0, verify_s={8: 3.0, 1: 1.0, 4: 1.0}, draft_step_s={2: 0.5})
    assert costs.verify(0) == 1.0  # below the smallest point: its value
    assert costs.verify(1) == 1.0
    assert costs.verify(3) == 1.0
    assert costs.verify(6) == pytest.approx(2.0)
    assert costs.verify(8) == 3.0
    assert costs.verify(12) == pytest.approx(5.0)  # above: the slope of the last two points
    assert costs.draft_step(1) == 0.5 and costs.draft_step(16) == 0.5  # one point: flat
    with pytest.raises(ConfigError):
        Costs(plain_s=1.0, verify_s={}, draft_step_s={1: 0.1}).verify(2)
    with pytest.raises(ConfigError):
        Costs(plain_s=1.0, verify_s={1: 1.0}, draft_step_s={}).draft_step(1)


# -- JSON forms -------------------------------------------------------------------------------------------
def test_round_trips_through_json():
    costs = Costs(plain_s=0.02, verify_s={1: 0.02, 16: 0.025}, draft_step_s={1: 0.002, 10: 0.004}, overhead_s=0.001)
    d = json.loads(json.dumps(costs.to_dict()))
    assert d["verify_s"] == {"1": 0.02, "16": 0.025}
    assert Costs.from_dict(d) == costs
    profile = AcceptanceProfile(0.7, ACCEPT, {"6,10,60": 3.9})
    assert AcceptanceProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    best = choose(gpu_like(4, (8, 0.030)), AcceptanceProfile(0.0, ACCEPT))
    assert best.to_dict() == {"shape": "3,1,3", "tau": best.tau, "cycle_s": best.cycle_s,
                              "tokens_per_s": best.tokens_per_s, "speedup": best.speedup}
    assert predict_all([], costs, profile)[0].to_dict()["shape"] == "plain"


# -- the tuning cache -------------------------------------------------------------------------------------
TARGET_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4}


@pytest.fixture
def drafter(tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    config = {"architectures": ["Eagle3Speculator"], "eagle3": {"version": "0.1.0", "aux_layer_ids": [1, 2, 3]}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    return folder


def key_for(drafter, target_config=TARGET_CONFIG):
    return tuning_key("cpu", "float32", "fast", "tiny-llama", target_config, drafter)


def test_key_fields(drafter):
    key = key_for(drafter)
    assert set(key) == {"device", "dtype", "engine", "target", "target_sha256", "drafter_sha256", "eagle3_version"}
    assert key["device"].startswith("cpu:") and key["device"].endswith(" threads")
    assert len(key["target_sha256"]) == 16 and len(key["drafter_sha256"]) == 16
    assert key["eagle3_version"] == eagle3.__version__
    assert tuning_key("cpu", "float32", "fast", "tiny-llama", TARGET_CONFIG, None)["drafter_sha256"] is None
    assert key_for(drafter) == key  # deterministic


def test_store_then_lookup(tmp_path, drafter):
    store = TuningStore(tmp_path / "deep" / "folder" / "tuning.json")
    key = key_for(drafter)
    assert store.lookup(key) is None
    store.store({"key": key, "shape": "3,1,3"})
    other = dict(key, dtype="bfloat16")
    store.store({"key": other, "shape": "6,10,60"})
    store.store({"key": key, "shape": "4,1,4"})  # replaces the first
    assert store.lookup(key)["shape"] == "4,1,4"
    assert "measured_utc" in store.lookup(key)
    assert store.lookup(other)["shape"] == "6,10,60"
    assert len(json.loads(store.path.read_text())["entries"]) == 2
    assert not store.path.with_name("tuning.json.tmp").exists()


def test_lookup_misses_when_drafter_weights_change(tmp_path, drafter):
    store = TuningStore(tmp_path / "tuning.json")
    store.store({"key": key_for(drafter), "shape": "3,1,3"})
    weights = drafter / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert store.lookup(key_for(drafter)) is None


def test_lookup_misses_when_target_config_or_version_changes(tmp_path, drafter, monkeypatch):
    store = TuningStore(tmp_path / "tuning.json")
    store.store({"key": key_for(drafter), "shape": "3,1,3"})
    assert store.lookup(key_for(drafter, dict(TARGET_CONFIG, num_hidden_layers=5))) is None
    assert store.lookup(dict(key_for(drafter), engine="generic")) is None
    monkeypatch.setattr(eagle3, "__version__", "99.0.0")
    assert store.lookup(key_for(drafter)) is None


def test_acceptance_profile_in_config_keeps_the_key(tmp_path, drafter):
    store = TuningStore(tmp_path / "tuning.json")
    store.store({"key": key_for(drafter), "shape": "3,1,3"})
    config = json.loads((drafter / "config.json").read_text())
    config["eagle3"]["acceptance_profile"] = {"tau": 3.1, "chain_length": 5}
    (drafter / "config.json").write_text(json.dumps(config, indent=2))
    assert store.lookup(key_for(drafter))["shape"] == "3,1,3"
    config["eagle3"]["aux_layer_ids"] = [1, 2, 4]  # any other config change does miss
    (drafter / "config.json").write_text(json.dumps(config))
    assert store.lookup(key_for(drafter)) is None


def test_corrupt_file_is_ignored_then_rewritten(tmp_path, drafter, caplog):
    store = TuningStore(tmp_path / "tuning.json")
    key = key_for(drafter)
    for bad in ("{not json", json.dumps({"format": 0, "entries": [{"key": key}]})):
        store.path.write_text(bad)
        with caplog.at_level(logging.WARNING, logger="eagle3"):
            assert store.lookup(key) is None
        assert "tuning cache" in caplog.text
        caplog.clear()
        store.store({"key": key, "shape": "2,1,2"})
        data = json.loads(store.path.read_text())
        assert data["format"] == 1 and [e["shape"] for e in data["entries"]] == ["2,1,2"]


def test_find_tuning_prefers_the_drafter_folder(tmp_path, drafter, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    assert user_store().path == tmp_path / "cache" / "tuning.json"
    assert drafter_store(drafter).path == drafter / "tuning.json"
    key = key_for(drafter)
    assert find_tuning(key, drafter) is None
    user_store().store({"key": key, "shape": "user"})
    assert find_tuning(key, drafter)["shape"] == "user"
    assert find_tuning(key, None)["shape"] == "user"
    drafter_store(drafter).store({"key": key, "shape": "drafter"})
    assert find_tuning(key_for(drafter), drafter)["shape"] == "drafter"  # tuning.json is not a weight file
