"""eagle3's speculators-format checkpoints checked by the `speculators` package itself (vLLM's drafter library).

Both directions, with fp32 logits compared to 1e-5 of the logit scale over three TTT steps:
(a) eagle3 saves a random drafter; speculators' `Eagle3DraftModel.from_pretrained` loads it and runs its forward;
(b) speculators builds and saves a random Eagle3 speculator; eagle3's `load_drafter` loads it and runs it.

speculators lives in its own venv (`bash scripts/setup_oracle_venv.sh` makes `.venv-oracle`); these tests skip
when it is missing. All jobs run in one subprocess (tests/oracle/speculators_check.py), started once per session.
Run: `pytest -m oracle tests/test_oracle.py -q`.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle3.config import DrafterConfig
from eagle3.drafter import DrafterKV, Eagle3Drafter
from eagle3.formats import load_drafter, save_drafter

pytestmark = pytest.mark.oracle

REPO = Path(__file__).resolve().parents[1]
ORACLE_PYTHON = Path(os.environ.get("EAGLE3_ORACLE_PYTHON", REPO / ".venv-oracle" / "bin" / "python"))
ORACLE_SCRIPT = REPO / "tests" / "oracle" / "speculators_check.py"
V, H, L, TTT_STEPS = 128, 64, 8, 3
# fp32 logits of these random drafters reach |6|; two correct fp32 implementations then differ by up to ~2e-5
# (each is ~2e-5 from an fp64 run), so the bound is 1e-5 of the logit scale. A wrong flag or name gives O(1).
TOL = 1e-5
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 256}  # fmt: skip

if not ORACLE_PYTHON.exists():
    pytest.skip(
        f"speculators oracle venv not found at {ORACLE_PYTHON}; create it with `bash scripts/setup_oracle_venv.sh` "
        "(about 2 minutes, CPU torch) or point EAGLE3_ORACLE_PYTHON at a python that has speculators==0.9.0",
        allow_module_level=True,
    )


@dataclass
class Case:
    name: str
    draft_vocab: int = 96
    flags: dict = field(default_factory=dict)
    seq_len: int = 9
    attn: str = "eager"
    verifier: str = "local"  # oracle loads with a local random verifier, or "none" (see speculators_check.py)


# (a) eagle3 writes, speculators reads
LOAD_CASES = [
    Case("full-vocab", draft_vocab=V),
    Case("draft-vocab"),
    Case("norm_before_residual", flags={"norm_before_residual": True}),
    Case("norm_before_fc", flags={"norm_before_fc": True}),
    Case("fc_norm", flags={"fc_norm": True}),
    Case("norm_output", flags={"norm_output": True}),
    Case("llama3-rope", flags={"rope_theta": 500000.0, "rope_scaling": SCALING}),
    Case("flex-attention", seq_len=128, attn="flex"),  # speculators' default attention; blocks of 128
    Case("no-verifier", verifier="none"),  # verifier path cleared
]
# (b) speculators writes, eagle3 reads
BUILD_CASES = [
    Case("full-vocab", draft_vocab=V),
    Case("draft-vocab"),
    Case("norm_before_residual", flags={"norm_before_residual": True}),
    Case("norm_before_fc", flags={"norm_before_fc": True}),
    Case("fc_norm", flags={"fc_norm": True}),
    Case("norm_output", flags={"norm_output": True}),
]
# DrafterConfig fields the oracle's "build" job reads to make the same drafter with speculators' classes
BUILD_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "max_position_embeddings", "draft_vocab_size", "aux_layer_ids", "norm_before_residual",
    "norm_before_fc", "fc_norm", "norm_output",
)  # fmt: skip


def make_cfg(case: Case) -> DrafterConfig:
    kw = dict(
        hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=V, draft_vocab_size=case.draft_vocab, aux_layer_ids=[2, 4, 5], target_num_layers=L,
        rms_norm_eps=1e-5, max_position_embeddings=256, verifier_name_or_path=None, speculative_tokens=TTT_STEPS,
    )  # fmt: skip
    kw.update(case.flags)
    return DrafterConfig(**kw)


def target_config(**kw) -> LlamaConfig:
    base = dict(
        vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4
    )
    return LlamaConfig(**{**base, **kw})


def random_drafter(cfg: DrafterConfig, seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    if cfg.uses_draft_vocab:
        drafter.set_vocab_mapping(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values)
    return drafter.eval()


@torch.no_grad()
def ttt_logits(drafter: Eagle3Drafter, inputs: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
    """eagle3's drafter run the way speculators' forward runs TTT: [steps, T, Vd].

    Step k reads the previous step's output (`feedback`), tokens shifted left by k (zero-padded, teacher forcing),
    positions + k, and attends causally to step-0 keys plus its own row's key of every later step.
    """
    ids, pos = inputs["input_ids"], inputs["position_ids"]  # [1, T]
    t = ids.shape[1]
    hidden = drafter.combine(inputs["hidden_states"])  # [1, T, H]
    cache, out_logits = DrafterKV(), []
    for k in range(steps):
        mask = torch.cat(
            [torch.ones(t, t, dtype=torch.bool).tril()] + [torch.eye(t, dtype=torch.bool)] * k, dim=1
        )
        step_ids = torch.cat([ids[:, k:], ids.new_zeros(1, k)], dim=1)  # [1, T]
        out = drafter(hidden, step_ids, pos + k, mask=mask[None, None], cache=cache)  # [1, T, H]
        out_logits.append(drafter.logits(out)[0])
        hidden = drafter.feedback(out)
    return torch.stack(out_logits).float()  # [steps, T, Vd]


def random_inputs(seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, seq_len, 3 * H, generator=g),  # [1, T, 3H]
        "input_ids": torch.randint(0, V, (1, seq_len), generator=g),
        "position_ids": torch.arange(seq_len)[None],
    }


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """Write every case's files, run the oracle once, and return (workdir, results by (direction, name))."""
    work = tmp_path_factory.mktemp("oracle")
    jobs, keys = [], []
    for i, case in enumerate(LOAD_CASES):
        stem = work / f"a-{case.name}"
        save_drafter(random_drafter(make_cfg(case), seed=i), stem, "speculators")
        save_file(random_inputs(case.seq_len, seed=100 + i), f"{stem}.inputs.safetensors")
        jobs.append(
            dict(kind="load", ckpt=str(stem), inputs=f"{stem}.inputs.safetensors", out=f"{stem}.out.safetensors",
                 ttt_steps=TTT_STEPS, attn=case.attn, verifier=case.verifier)
        )  # fmt: skip
        keys.append(("a", case.name))
    for i, case in enumerate(BUILD_CASES):
        cfg = make_cfg(case)
        spec = {k: getattr(cfg, k) for k in BUILD_FIELDS} | {"rope_theta": 5000.0}
        stem = work / f"b-{case.name}"
        jobs.append(
            dict(kind="build", out_dir=str(stem), out=f"{stem}.out.safetensors", config=spec, seed=200 + i,
                 seq_len=case.seq_len, ttt_steps=TTT_STEPS)
        )  # fmt: skip
        keys.append(("b", case.name))
    (work / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [str(ORACLE_PYTHON), str(ORACLE_SCRIPT), str(work / "jobs.json"), str(work / "results.json")],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, f"oracle failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads((work / "results.json").read_text())
    return work, dict(zip(keys, results, strict=True))


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=0, atol=TOL * scale)


def _ok(result: dict) -> dict:
    assert result["ok"], f"oracle job failed:\n{result['error']}"
    return result


@pytest.mark.parametrize("case", LOAD_CASES, ids=lambda c: c.name)
def test_speculators_loads_eagle3_checkpoint(oracle, case):
    work, results = oracle
    result = _ok(results[("a", case.name)])
    assert result["unused_checkpoint_tensors"] == [], "speculators ignored tensors eagle3 wrote"
    assert result["missing_checkpoint_tensors"] == [], "speculators expected tensors eagle3 did not write"
    assert result["tensors_not_as_saved"] == [], (
        "speculators replaced checkpoint tensors on load (reference pitfall 22: embed_tokens/lm_head from the verifier)"
    )
    ckpt = work / f"a-{case.name}"
    drafter = load_drafter(ckpt)
    cfg = drafter.config
    assert result["flags"] == {k: getattr(cfg, k) for k in result["flags"]}
    assert result["aux_layer_ids"] == cfg.aux_layer_ids
    expected = ttt_logits(drafter, load_file(str(work / f"a-{case.name}.inputs.safetensors")), TTT_STEPS)
    got = load_file(str(work / f"a-{case.name}.out.safetensors"))
    assert_logits_close(got["logits"], expected)
    if cfg.uses_draft_vocab:
        assert torch.equal(got["d2t"], drafter.d2t) and torch.equal(got["t2d"], drafter.t2d)
    else:
        assert "d2t" not in got


@pytest.mark.parametrize("case", BUILD_CASES, ids=lambda c: c.name)
def test_eagle3_loads_speculators_checkpoint(oracle, case):
    work, results = oracle
    _ok(results[("b", case.name)])
    drafter = load_drafter(work / f"b-{case.name}", target_config=target_config(rope_theta=5000.0))
    cfg = drafter.config
    want = make_cfg(case)
    for key in ("draft_vocab_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                "aux_layer_ids", "target_num_layers", "rms_norm_eps", "head_dim"):  # fmt: skip
        assert getattr(cfg, key) == getattr(want, key), key
    assert cfg.rope_theta == 5000.0
    data = load_file(str(work / f"b-{case.name}.out.safetensors"))
    assert_logits_close(ttt_logits(drafter, data, TTT_STEPS), data["logits"])
