"""Where bf16 tree decoding (3,4,12) leaves bf16 plain decoding on MT-bench prompt 0 (CPU, fast path), and the
top logits there from a fast-path forward over the shared prefix."""
import torch

from eagle3.config import SpecConfig
from eagle3.evaluate import load_prompts
from eagle3.fast import FastEngine
from eagle3.models import load_target
from eagle3.runtime import drafter_for, encode_messages

model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = drafter_for(model, "src/eagle3/assets/smollm2-drafter")
_, chats = load_prompts("mt_bench", limit=1)
ids = encode_messages(tok, chats[0])
plain = FastEngine(model, draft="none", tokenizer=tok)
tree = FastEngine(model, draft="eagle3", spec=SpecConfig.parse_tree("3,4,12"), drafter=d, tokenizer=tok)
a = plain.generate(torch.tensor(ids), max_new_tokens=128, eos_token_ids=[]).token_ids
b = tree.generate(torch.tensor(ids), max_new_tokens=128, eos_token_ids=[]).token_ids
i = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
print("first difference at new token", i, "plain", a[i] if i is not None else None, "tree", b[i] if i is not None else None)
if i is not None:
    prefix = torch.tensor(ids + a[:i])
    t = plain.core.target
    with torch.no_grad():
        n = len(prefix)
        logits, _ = t.forward(prefix, torch.arange(n), torch.arange(n),
                              torch.ones(n, t.seq_len, dtype=torch.bool).tril(), last_only=True)
    top = logits[0].float().topk(3)
    print("top-3 after the shared prefix:", top.indices.tolist(), [round(x, 4) for x in top.values.tolist()])
