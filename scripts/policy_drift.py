"""Policy drift on a CPU: a drafter follows an RL policy that moves (stories260K, minutes).

1. Policy v1 is stories260K. Its sampled answers to 80 GSM8K question openings (T=0.8, prompt i at seed i) train a
   drafter from a random start (`eagle3.adapt.adapt`, the same call an RL loop makes with its rollouts).
2. Policy v2 is v1 fine-tuned on the GSM8K questions' text (next-token loss, AdamW): the policy moved.
3. On v2's answers to the same prompts, with the same step budget: the old drafter adapted, against a drafter
   trained from a random start. Tau (greedy, on the most recent tenth of each set of answers) of the old drafter
   on v1 (before the drift) and on v2, of the adapted one and of the one from scratch.

    python scripts/policy_drift.py --out runs/policy-drift.json
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

from eagle3.adapt import adapt
from eagle3.cli import main as eagle3
from eagle3.config import SamplingConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.evaluate import load_prompts
from eagle3.models import load_target
from eagle3.record import run_record, write_json
from eagle3.target import Target


def fine_tune(model, tok, texts: list[str], steps: int, lr: float, seed: int = 0):
    """`model` after `steps` of next-token loss on `texts` (batches of 8, at most 128 tokens)."""
    model = copy.deepcopy(model).float().train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    rows = [tok(t, add_special_tokens=True)["input_ids"][:128] for t in texts]
    for _ in range(steps):
        batch = [rows[i] for i in torch.randint(len(rows), (8,), generator=g).tolist()]
        width = max(len(r) for r in batch)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in batch])
        labels = torch.tensor([r + [-100] * (width - len(r)) for r in batch])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def rollouts(model, tok, prompts: list[list[int]], tokens: int) -> list[dict]:
    engine = SpeculativeEngine(Target(model, []), NoDraftProposer(), tok)
    out = []
    for i, ids in enumerate(prompts):
        answer = engine.generate(ids, max_new_tokens=tokens, sampling=SamplingConfig(temperature=0.8, seed=i))
        out.append({"prompt_ids": ids, "completion_ids": answer.token_ids, "time_unix": float(i)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--first-steps", type=int, default=200, help="steps that train the drafter on v1")
    p.add_argument("--budget", type=int, default=60, help="steps after the drift, for each of the two drafters")
    p.add_argument("--policy-steps", type=int, default=300, help="fine-tuning steps from v1 to v2")
    p.add_argument("--lr", type=float, default=3e-3, help="the drafters' learning rate")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", required=True, help="run record (JSON)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    v1, tok = load_target("stories260k", dtype="float32")
    _, questions = load_prompts("gsm8k")
    texts = [q[0]["content"] for q in questions]
    prompts = [tok(" ".join(t.split()[:6]), add_special_tokens=True)["input_ids"] for t in texts]
    with tempfile.TemporaryDirectory(prefix="eagle3-drift-") as tmp:
        work = Path(tmp)
        v2 = fine_tune(v1, tok, texts, args.policy_steps, lr=1e-3)
        for name, m in (("v1", v1), ("v2", v2)):
            m.save_pretrained(work / name)
            tok.save_pretrained(work / name)
        data = {name: rollouts(m, tok, prompts, args.max_new_tokens) for name, m in (("v1", v1), ("v2", v2))}
        assert eagle3(["init-drafter", "--target", str(work / "v1"), "--out", str(work / "random"),
                       "--draft-vocab-size", "full", "--device", "cpu"]) == 0
        common = {"time_budget": None, "lr": args.lr, "device": "cpu", "dtype": "float32", "progress": False,
                  "eval_tokens": args.max_new_tokens}
        first = adapt(str(work / "v1"), str(work / "random"), data["v1"], str(work / "old"),
                      max_steps=args.first_steps, **common)
        if not first.written:
            raise SystemExit(f"the first drafter was not written: {first.reason}")
        adapted = adapt(str(work / "v2"), str(work / "old"), data["v2"], str(work / "adapted"),
                        max_steps=args.budget, **common)
        scratch = adapt(str(work / "v2"), str(work / "random"), data["v2"], str(work / "scratch"),
                        max_steps=args.budget, **common)
    result = {"tau_old_on_v1": first.tau["new"], "tau_old_on_v2": adapted.tau["old"],
              "tau_adapted_on_v2": adapted.tau["new"], "tau_scratch_on_v2": scratch.tau["new"],
              "recovered": round(adapted.tau["new"] / first.tau["new"], 3),
              "steps": {"first": first.steps, "adapted": adapted.steps, "scratch": scratch.steps},
              "seconds": round(time.perf_counter() - t0, 1)}
    print("tau (greedy, held-out answers): old drafter on v1 {tau_old_on_v1:.3f}, on v2 {tau_old_on_v2:.3f}; "
          "adapted {tau_adapted_on_v2:.3f}; from scratch {tau_scratch_on_v2:.3f}; recovered {recovered:.0%} of "
          "the pre-drift tau ({seconds}s)".format(**result))
    write_json(run_record("policy-drift", **vars(args), **result), args.out)
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
