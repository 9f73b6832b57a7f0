"""Recorded traffic for trying `eagle3 adapt` on a CPU: stories260K's sampled answers (T=0.8) to short story
starts, written as `eagle3 serve --record` writes them (`eagle3.traffic`).

    python scripts/record_stories_traffic.py --requests 120 --out traffic/
    eagle3 init-drafter --target stories260k --out d --draft-vocab-size full
    eagle3 adapt --target stories260k --drafter d --data traffic/ --out new --max-steps 150 --lr 3e-3 --dtype float32
"""

from __future__ import annotations

import argparse
import random

from eagle3.config import SamplingConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.models import load_target
from eagle3.target import Target
from eagle3.traffic import TrafficRecorder

STARTS = ["Once upon a time", "Lily had a dog", "The sun was", "Tom went to", "A little bird", "The cat sat",
          "One day", "Ben and Mia", "The big tree", "In the park", "Sam liked", "The girl saw"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="traffic")
    args = ap.parse_args(argv)
    model, tok = load_target("stories260k")
    engine = SpeculativeEngine(Target(model, []), NoDraftProposer(), tok)
    rec = TrafficRecorder(args.out, shard_rows=50)
    rng = random.Random(0)
    for i in range(args.requests):
        ids = tok(f"{rng.choice(STARTS)} {rng.choice(['and', 'with', 'the', 'a'])}", add_special_tokens=True)["input_ids"]
        out = engine.generate(ids, max_new_tokens=args.max_new_tokens,
                              sampling=SamplingConfig(temperature=0.8, seed=i)).token_ids
        rec.add({"request_id": str(i), "prompt_ids": ids, "completion_ids": out, "time_unix": float(i),
                 "temperature": 0.8, "top_p": 1.0, "top_k": 0})
    rec.close()
    print(f"{rec.written} requests recorded in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
