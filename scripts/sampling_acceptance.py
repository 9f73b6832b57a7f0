"""First-draft acceptance at temperature T under several drafting rules, teacher-forced on the target's own answers.

Sampled decoding accepts a draft where it equals the target's position-keyed draw (`eagle3.decoding.sampling`,
`eagle3.decoding.verify`), so a set of top-k point-mass drafts is accepted with probability sum of p over them,
which falls as the target's distribution p flattens with T. This script measures where that acceptance goes: the
target answers prompts sampling at each T (greedy at 0) with the one sampler, then, teacher-forced over each
answer, compares p (temperature T, optional top-p / top-k) with the drafter's first-step distribution q (draft
vocabulary mapped to target ids, q = 0 elsewhere; the same temperature) and reports per T:

    H(p), H(q), TV(p, q)                       entropies in nats and total variation
    (a)/(b) top-k point masses, k = 1, 4, 10   sum of p over q's top-k: today's chain (k = 1) and tree siblings
    (c) coupled drafts, k = 1, 4, 10           the drafter draws with the target's own position-keyed noise G:
                                               accepted iff argmax(log p + G) is among the top-k of log q + G
                                               (Gumbel-top-k); Monte Carlo over --samples noise seeds
    (d) speculative sampling                   independent x ~ q accepted w.p. min(1, p/q): 1 - TV(p, q)
    (e) recursive rejection sampling, k = 4, 10  k drafts drawn from q without replacement (Gumbel-top-k), each
                                               accepted w.p. min(1, p'/q') against the residual p' and the
                                               remaining draft mass q' (Jeon et al. 2024, "Recursive
                                               Speculative Decoding"); drafts Monte Carlo, coins exact
    oracle top-k of p                          the most any k point masses can get (a drafter with q = p)

At T = 0, p and q are one-hot: (a)/(b) are the greedy rates and (c) equals (b).

    python scripts/sampling_acceptance.py --target smollm2 --limit 10 --max-new-tokens 128 --out runs/sacc.json
"""

from __future__ import annotations

import argparse
import itertools

import torch
from tqdm import tqdm

from eagle3.config import SamplingConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.decoding.sampling import exponential_noise, filter_scores
from eagle3.demo import bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.models import load_target
from eagle3.record import run_record, write_json
from eagle3.runtime import drafter_for, encode_messages, eos_token_ids
from eagle3.target import Target
from eagle3.training.ttt import unroll

KS = (1, 4, 10)
QUANTILES = (0.1, 0.5, 0.9)
# positions are also split by the target's entropy H(p) (nats) into these regimes
ENTROPY_EDGES = (0.0, 0.5, 2.0, float("inf"))
MC_SEED_OFFSET = 1_000_003  # the Monte Carlo noise seeds start here, apart from the answers' seeds


def first_step_logits(drafter, target: Target, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(target logits [M, V] predicting each label, drafter first-step logits [M, V] over target ids, -inf outside
    the draft vocabulary) for label indices `labels` [M] of a sequence ids [n]: the drafter's step-0 row t
    (target features at t, token t+1) drafts token t+2, as in `eagle3.training.ttt`."""
    n = ids.shape[0]
    aux, logits = target.features(ids[None])  # [1, n, 3Ht], [1, n, V]
    aux = aux.clone()  # an ordinary tensor (features run under inference mode)
    positions = torch.arange(n, device=ids.device)[None]
    docs = torch.zeros(1, n, dtype=torch.long, device=ids.device)
    out = next(unroll(drafter, drafter.combine(aux), ids[None], positions, docs, steps=1))  # [1, n, H]
    draft = drafter.logits(out[0, labels - 2]).float()  # [M, Vd]
    vd = draft.shape[-1]
    to_target = drafter.draft_ids_to_target(torch.arange(vd, device=ids.device))  # [Vd]
    full = draft.new_full((labels.shape[0], logits.shape[-1]), float("-inf"))  # [M, V]
    full[:, to_target] = draft
    return logits[0, labels - 1].float(), full


def recursive_rejection(p: torch.Tensor, q: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """[M] probability that recursive rejection sampling accepts one of k drafts drawn from q [M, V] without
    replacement (one Gumbel-top-k draw of the drafts per position; the accept coins integrated exactly). Drafts
    are tried in order: x accepted w.p. min(1, p'(x)/q'(x)); on rejection the target's residual becomes
    p' <- norm(max(p' - q', 0)) and x leaves q' (q' renormalised). Lossless for any q."""
    u = torch.rand(q.shape, generator=gen).clamp(min=1e-20)
    drafts = (q.log() - (-u.log()).log()).topk(k, dim=-1).indices  # [M, k] Gumbel-top-k of q
    pc, qc = p.clone(), q.clone()
    alive = torch.ones(p.shape[0])  # probability that every draft so far was rejected
    accepted = torch.zeros(p.shape[0])
    for i in range(k):
        x = drafts[:, i : i + 1]
        qn = qc / qc.sum(-1, keepdim=True).clamp(min=1e-30)
        px, qx = pc.gather(-1, x)[:, 0], qn.gather(-1, x)[:, 0]
        a = torch.where(qx > 0, (px / qx.clamp(min=1e-30)).clamp(max=1.0), torch.zeros_like(qx))
        accepted += alive * a
        alive = alive * (1 - a)
        pc = (pc - qn).clamp(min=0)
        pc = pc / pc.sum(-1, keepdim=True).clamp(min=1e-30)
        qc = qc.scatter(-1, x, 0.0)
    return accepted


def position_metrics(z: torch.Tensor, d: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor,
                     temperature: float, top_p: float, top_k: int, seeds: list[int], answer_seed: int,
                     ) -> dict[str, torch.Tensor]:
    """Per-position numbers [M] for target logits z [M, V] and drafter logits d [M, V] (target ids) predicting the
    tokens `tokens` [M] at absolute positions `labels` [M]."""
    m, vocab = z.shape
    kmax = min(max(KS), int(torch.isfinite(d[0]).sum()))
    top_q = d.topk(kmax, dim=-1).indices  # [M, kmax] q's top-k (temperature keeps the order)
    if temperature == 0:
        p = torch.zeros_like(z).scatter_(-1, z.argmax(-1, keepdim=True), 1.0)  # [M, V] one-hot
        q = torch.zeros_like(d).scatter_(-1, d.argmax(-1, keepdim=True), 1.0)
        sp = None
    else:
        sp = filter_scores(z, temperature, top_p, top_k)  # [M, V]
        sq = d / temperature  # [M, V] temperature only (filters apply to the target's distribution)
        p, q = sp.softmax(-1), sq.softmax(-1)
    out = {"H_p": torch.special.entr(p).sum(-1), "H_q": torch.special.entr(q).sum(-1),
           "TV": 0.5 * (p - q).abs().sum(-1)}
    out["spec_sampling"] = 1.0 - out["TV"]
    mass = p.gather(-1, top_q).cumsum(-1)  # [M, kmax]
    oracle = p.topk(kmax, dim=-1).values.cumsum(-1)  # [M, kmax]
    for k in KS:
        out[f"point_top{k}"] = mass[:, min(k, kmax) - 1]
        out[f"oracle_top{k}"] = oracle[:, min(k, kmax) - 1]
    if sp is None:  # greedy: the noise plays no part, coupled drafting is top-k drafting
        for k in KS:
            out[f"coupled_top{k}"] = out[f"point_top{k}"].clone()
            if k > 1:  # one-hot p: a draft is accepted iff it is the argmax
                out[f"rrs_top{k}"] = out[f"point_top{k}"].clone()
        out["replay"] = (z.argmax(-1) == tokens).float()
        return out
    hits = torch.zeros(m, len(KS))
    for seed in seeds:
        log_e = exponential_noise(seed, labels, vocab).log()  # [M, V] the position-keyed noise, as -G
        drawn = (sp - log_e).argmax(-1)  # [M] the target's draw
        ranked = (sq - log_e).topk(kmax, dim=-1).indices == drawn[:, None]  # [M, kmax] Gumbel-top-k of q
        hits += torch.stack([ranked[:, :k].any(-1) for k in KS], dim=-1).float()
    for j, k in enumerate(KS):
        out[f"coupled_top{k}"] = hits[:, j] / len(seeds)
    gen = torch.Generator().manual_seed(seeds[0])
    for k in KS[1:]:  # k = 1 is speculative sampling, (d)
        out[f"rrs_top{k}"] = sum(recursive_rejection(p, q, k, gen) for _ in seeds) / len(seeds)
    # the answer's own seed must reproduce the answer: checks positions, noise and alignment
    out["replay"] = ((sp - exponential_noise(answer_seed, labels, vocab).log()).argmax(-1) == tokens).float()
    return out


def summarise(rows: dict[str, torch.Tensor]) -> dict:
    """Means (and quantiles of the per-position numbers) over all positions, and means per entropy regime."""
    summary = {"positions": int(rows["H_p"].numel())}
    for key, v in rows.items():
        entry = {"mean": round(float(v.mean()), 4)}
        if key in ("H_p", "H_q", "TV", "point_top1", "spec_sampling", "oracle_top1"):
            entry["quantiles"] = {f"p{int(q * 100)}": round(float(x), 4)
                                  for q, x in zip(QUANTILES, torch.quantile(v, torch.tensor(QUANTILES)).tolist(),
                                                  strict=True)}
        summary[key] = entry
    regimes = {}
    for lo, hi in itertools.pairwise(ENTROPY_EDGES):
        sel = (rows["H_p"] >= lo) & (rows["H_p"] < hi)
        regimes[f"H_p {lo:g}-{hi:g}"] = {"share": round(float(sel.float().mean()), 4),
                                         **{key: round(float(v[sel].mean()), 4) if sel.any() else None
                                            for key, v in rows.items() if key != "replay"}}
    summary["by_target_entropy"] = regimes
    return summary


@torch.inference_mode()
def sampling_acceptance(model, tok, drafter, prompts: list[list[dict]], temperatures: list[float],
                        max_new_tokens: int, samples: int, seed: int = 0, top_p: float = 1.0,
                        top_k: int = 0, draft_scale: float = 1.0) -> dict[str, dict]:
    """{"T=<t>": summary} (see `summarise`) over the answer tokens after the first of every prompt's fresh answer
    at each T; the drafter's logits are multiplied by `draft_scale` first (q at temperature T / draft_scale)."""
    target = Target(model, drafter.config.aux_layer_ids)
    engine = SpeculativeEngine(target, NoDraftProposer(model.device), tok)  # plain decoding, the one sampler
    eos = eos_token_ids(model, tok)
    mc_seeds = [seed + MC_SEED_OFFSET + s for s in range(samples)]
    result = {}
    try:
        for temperature in temperatures:
            rows: dict[str, list[torch.Tensor]] = {}
            for j, messages in enumerate(tqdm(prompts, desc=f"T={temperature:g}", unit="prompt")):
                prompt = encode_messages(tok, messages)
                answer_seed = seed + j
                sampling = SamplingConfig(temperature=temperature, top_p=top_p if temperature else 1.0,
                                          top_k=top_k if temperature else 0, seed=answer_seed)
                answer = engine.generate(prompt, max_new_tokens, sampling, eos_token_ids=eos).token_ids
                ids = torch.tensor(prompt + answer, device=model.device)  # [n]
                # every answer token but the first (the prefill's) can be a cycle's first draft
                labels = torch.arange(max(len(prompt) + 1, 2), ids.shape[0], device=ids.device)  # [M]
                if labels.numel() == 0:
                    continue
                z, d = first_step_logits(drafter, target, ids, labels)
                d = d * draft_scale  # -inf outside the draft vocabulary stays -inf
                per_pos = position_metrics(z, d, labels, ids[labels], temperature, top_p, top_k, mc_seeds,
                                           answer_seed)
                for key, v in per_pos.items():
                    rows.setdefault(key, []).append(v.float().cpu())
            result[f"T={temperature:g}"] = summarise({k: torch.cat(v) for k, v in rows.items()})
    finally:
        target.close()
    return result


TABLE = [("positions", "positions", None), ("H(p) nats", "H_p", "q"), ("H(q) nats", "H_q", "q"),
         ("TV(p,q)", "TV", "q"), ("(a) top-1 point p(argmax q)", "point_top1", "q"),
         ("(b) top-4 point masses", "point_top4", None), ("(b) top-10 point masses", "point_top10", None),
         ("(c) coupled top-1", "coupled_top1", None), ("(c) coupled top-4", "coupled_top4", None),
         ("(c) coupled top-10", "coupled_top10", None), ("(d) spec sampling 1-TV", "spec_sampling", "q"),
         ("(e) recursive rejection top-4", "rrs_top4", None), ("(e) recursive rejection top-10", "rrs_top10", None),
         ("oracle top-1 max p", "oracle_top1", None), ("oracle top-4 p mass", "oracle_top4", None),
         ("oracle top-10 p mass", "oracle_top10", None), ("replay (answer seed)", "replay", None)]


def format_table(result: dict[str, dict]) -> str:
    """Rows of metrics, a column per temperature: mean, and [p10 p50 p90] where kept."""
    cols = list(result)
    width = 24
    lines = [f"{'':30s}" + "".join(f"{c:>{width}s}" for c in cols)]
    for label, key, quant in TABLE:
        cells = []
        for c in cols:
            entry = result[c][key]
            if key == "positions":
                cells.append(f"{entry:>{width}d}")
                continue
            text = f"{entry['mean']:.3f}"
            if quant:
                qs = entry["quantiles"]
                text += f" [{qs['p10']:.2f} {qs['p50']:.2f} {qs['p90']:.2f}]"
            cells.append(f"{text:>{width}s}")
        lines.append(f"{label:30s}" + "".join(cells))
    lines.append("")
    lines.append("by target entropy H(p): share of positions / (a) top-1 / (b) top-10 / (c) coupled top-1 / "
                 "(c) coupled top-10 / (d) 1-TV")
    for c in cols:
        for regime, r in result[c]["by_target_entropy"].items():
            if r["share"]:
                lines.append(f"  {c:6s} {regime:14s} {r['share']:.3f} / {r['point_top1']:.3f} / "
                             f"{r['point_top10']:.3f} / {r['coupled_top1']:.3f} / {r['coupled_top10']:.3f} / "
                             f"{r['spec_sampling']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default=str(bundled_drafter()), help="a drafter folder, or 'random'")
    ap.add_argument("--prompts", default="mt_bench", help="a bundled benchmark set or a JSONL of prompts")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    ap.add_argument("--top-p", type=float, default=1.0, help="applied to the target's distribution p")
    ap.add_argument("--top-k", type=int, default=0, help="applied to the target's distribution p (0: off)")
    ap.add_argument("--draft-scale", type=float, default=1.0,
                    help="multiply the drafter's logits by this before processing: q at temperature T / scale (a "
                         "drafter trained on labels at temperature t would match the target at T with scale t if "
                         "its labels had sharpened it)")
    ap.add_argument("--samples", type=int, default=32, help="noise draws per position for the coupled rules")
    ap.add_argument("--seed", type=int, default=0, help="answer j is sampled with seed + j")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="runs/sampling_acceptance.json")
    args = ap.parse_args(argv)
    if any(t < 0 for t in args.temperatures) or args.samples < 1 or args.draft_scale <= 0:
        raise SystemExit("--temperatures must be >= 0, --samples >= 1 and --draft-scale > 0")

    model, tok = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = drafter_for(model, None if args.drafter == "random" else args.drafter)
    name, prompts = load_prompts(args.prompts, args.limit)
    result = sampling_acceptance(model, tok, drafter, prompts, args.temperatures, args.max_new_tokens,
                                 args.samples, args.seed, args.top_p, args.top_k, args.draft_scale)
    print(format_table(result))
    record = run_record("sampling_acceptance", argv=None if argv is None else ["scripts/sampling_acceptance.py", *argv],
                        target=args.target, drafter=args.drafter, prompts=name, limit=args.limit,
                        max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, top_p=args.top_p,
                        top_k=args.top_k, draft_scale=args.draft_scale, samples=args.samples, seed=args.seed,
                        dtype=args.dtype,
                        draft_vocab_size=drafter.config.draft_vocab_size, results=result)
    write_json(record, args.out)
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
