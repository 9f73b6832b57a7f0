"""The speculators oracle: run eagle3's checkpoints through vLLM's own drafter library, and make checkpoints with it.

Runs inside `.venv-oracle` (speculators 0.9.0, see tests/oracle/README.md), never in eagle3's venv, and imports
nothing from eagle3. tests/test_oracle.py drives it:

    .venv-oracle/bin/python tests/oracle/speculators_check.py JOBS.json RESULTS.json

JOBS.json is a list of jobs; each writes one `.safetensors` file and one entry of RESULTS.json
({"ok": true, ...} or {"ok": false, "error": traceback}), so a failing job does not hide the others.

* `{"kind": "load", "ckpt": DIR, "inputs": FILE, "out": FILE, "ttt_steps": N, "attn": "eager"|"flex",
   "verifier": "local"|"none"}`
  loads DIR with `Eagle3DraftModel.from_pretrained` and runs speculators' forward on the inputs
  (`hidden_states [1, T, 3H]`, `input_ids [1, T]`, `position_ids [1, T]`), saving the draft-vocab logits of every
  TTT step (captured at `lm_head`) as `logits [steps, T, Vd]`, plus `d2t`/`t2d` as loaded. The result lists
  checkpoint tensors speculators did not use, model tensors the checkpoint lacks, and tensors that differ from
  the file after loading.
  verifier="local" (default) points `speculators_config.verifier.name_or_path` at a random local Llama verifier
  made here, so speculators' loader runs unpatched, `load_verifier_weights` included; the verifier's embedding
  and lm_head differ from the checkpoint's, so a loader that replaced them (reference pitfall 22) shows up.
  verifier="none" clears the path; speculators 0.9.0 then fails in `Eagle3DraftModel.load_verifier_weights`
  (`AutoConfig.from_pretrained(None)`), so that step alone is skipped.
* `{"kind": "build", "out_dir": DIR, "out": FILE, "config": {...}, "seed": S, "seq_len": T, "ttt_steps": N}`
  builds an Eagle3 speculator with speculators' classes (random weights, small Llama layer), saves it with
  `save_pretrained(DIR)`, and writes random inputs plus its logits to FILE for eagle3 to load and compare.

Positions: speculators' forward defaults to `position_ids = 1 + arange(T)` (`models/eagle3/core.py`); jobs always
pass explicit position ids so both sides rotate the same positions.
"""

from __future__ import annotations

import json
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig, LlamaForCausalLM

VERIFIER_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")  # speculators' frozen training targets


@torch.no_grad()
def draft_logits(model: Eagle3DraftModel, inputs: dict[str, torch.Tensor], ttt_steps: int) -> torch.Tensor:
    """speculators' own forward, with the lm_head output of every TTT step captured: [steps, T, Vd]."""
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().float()))
    try:
        hidden = inputs["hidden_states"]  # [1, T, 3H]
        model(
            hidden_states=hidden,
            input_ids=inputs["input_ids"],  # [1, T]
            document_ids=torch.zeros_like(inputs["input_ids"]),  # one document
            position_ids=inputs["position_ids"],  # [1, T]
            ttt_steps=ttt_steps,
        )
    finally:
        hook.remove()
    return torch.cat(captured, dim=0)  # [steps, T, Vd]


def make_verifier(tl_config: LlamaConfig, num_layers: int, path: Path) -> None:
    """A random Llama verifier with the drafter's vocabulary and width, saved for speculators to read."""
    config = LlamaConfig(
        vocab_size=tl_config.vocab_size,
        hidden_size=tl_config.hidden_size,
        intermediate_size=tl_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tl_config.num_attention_heads,
        num_key_value_heads=tl_config.num_key_value_heads,
        head_dim=tl_config.head_dim,
    )
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(path)


@contextmanager
def verifier_weights_skipped():
    """Skip `Eagle3DraftModel.load_verifier_weights`, which 0.9.0 cannot run without a verifier path."""
    original = Eagle3DraftModel.load_verifier_weights
    Eagle3DraftModel.load_verifier_weights = lambda self: None
    try:
        yield
    finally:
        Eagle3DraftModel.load_verifier_weights = original


def run_load(job: dict) -> dict:
    ckpt = Path(job["ckpt"])
    config = Eagle3SpeculatorConfig.from_pretrained(ckpt)
    if job.get("attn", "eager") == "eager":
        config.transformer_layer_config._attn_implementation = (
            "eager"  # any T; "flex" needs T % 128 == 0 here
        )
    if job.get("verifier", "local") == "local":
        verifier_dir = Path(job["out"]).with_suffix(".verifier")
        num_layers = json.loads((ckpt / "config.json").read_text())["eagle3"]["target_num_layers"]
        make_verifier(config.transformer_layer_config, num_layers, verifier_dir)
        config.speculators_config.verifier.name_or_path = str(verifier_dir)
        model = Eagle3DraftModel.from_pretrained(ckpt, config=config)
    else:
        config.speculators_config.verifier.name_or_path = None
        with verifier_weights_skipped():
            model = Eagle3DraftModel.from_pretrained(ckpt, config=config)
    model.eval()

    file_tensors = load_file(str(ckpt / "model.safetensors"))
    own = model.state_dict()
    unused = sorted(k for k in file_tensors if k not in own)
    missing = sorted(k for k in own if k not in file_tensors and k not in VERIFIER_ONLY)
    differ = sorted(k for k in file_tensors if k in own and not torch.equal(own[k], file_tensors[k]))

    logits = draft_logits(model, load_file(job["inputs"]), int(job["ttt_steps"]))
    out = {"logits": logits.contiguous()}
    if model.d2t is not None:
        out.update(d2t=model.d2t.clone(), t2d=model.t2d.clone())
    save_file(out, job["out"])
    return {
        "unused_checkpoint_tensors": unused,
        "missing_checkpoint_tensors": missing,
        "tensors_not_as_saved": differ,
        "flags": {
            k: getattr(model.config, k)
            for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
        },
        "aux_layer_ids": model.config.eagle_aux_hidden_state_layer_ids,
        "attn_implementation": model._attn_impl,
    }


def build_config(spec: dict) -> Eagle3SpeculatorConfig:
    """A small Eagle3 speculator config in speculators' own classes (Llama layer, no verifier path)."""
    layer = LlamaConfig(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"],
        rms_norm_eps=spec["rms_norm_eps"],
        rope_theta=spec["rope_theta"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=False,
    )
    layer._attn_implementation = "eager"
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=spec["draft_vocab_size"],
        norm_before_residual=spec["norm_before_residual"],
        norm_before_fc=spec["norm_before_fc"],
        fc_norm=spec["fc_norm"],
        norm_output=spec["norm_output"],
        eagle_aux_hidden_state_layer_ids=spec["aux_layer_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )


def run_build(job: dict) -> dict:
    spec = job["config"]
    torch.manual_seed(int(job["seed"]))
    model = Eagle3DraftModel(build_config(spec)).eval()
    with torch.no_grad():  # speculators leaves embed_tokens / lm_head as NaN until a verifier fills them
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    vocab, draft_vocab = spec["vocab_size"], spec["draft_vocab_size"]
    if draft_vocab != vocab:
        ids = torch.randperm(vocab)[:draft_vocab].sort().values  # [Vd] ascending target ids
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    model.save_pretrained(job["out_dir"])

    t, width = int(job["seq_len"]), 3 * spec["hidden_size"]
    inputs = {
        "hidden_states": torch.randn(1, t, width),  # [1, T, 3H]
        "input_ids": torch.randint(0, vocab, (1, t)),
        "position_ids": torch.arange(t)[None],
    }
    logits = draft_logits(model, inputs, int(job["ttt_steps"]))
    save_file({**inputs, "logits": logits.contiguous()}, job["out"])
    return {}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    jobs = json.loads(Path(argv[0]).read_text())
    results = []
    for job in jobs:
        runner = {"load": run_load, "build": run_build}[job["kind"]]
        try:
            results.append({"ok": True, **runner(job)})
        except Exception:  # one failing job is reported with its traceback; the others still run
            results.append({"ok": False, "error": traceback.format_exc()})
    Path(argv[1]).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
