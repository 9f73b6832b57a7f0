"""Plain decoding of a random Qwen3-MoE target on the fast path against HF `generate`, in one `eagle3 bench` run.

The target is built at the given shape with random weights and the bundled stories260K tokenizer, saved to a
temporary folder, and benchmarked with `eagle3 bench --drafter random --methods hf,plain` (the record, bench.json,
goes to --out). Random weights say nothing about acceptance; this measures what a step costs.

    python scripts/bench_moe.py --out runs/moe-cpu
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from eagle3.cli import main as eagle3

TOKENIZER = Path(__file__).resolve().parents[1] / "src/eagle3/assets/stories260k"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for bench.json")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-size", type=int, default=384, help="moe_intermediate_size")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=args.hidden // 8, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_size, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.05)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / name, tmp)
        return eagle3(["bench", "--target", tmp, "--drafter", "random", "--methods", "hf,plain",
                       "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
                       "--device", args.device, "--out", args.out])


if __name__ == "__main__":
    raise SystemExit(main())
