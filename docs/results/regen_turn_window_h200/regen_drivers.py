"""Time regenerate's two fast-engine drivers on one GPU: turn-synchronous windows vs turns chained in the batch.

Random-weight Llama of SmolLM2-135M's shape (30 layers, hidden 576) with the stories260K tokenizer + ChatML,
bf16; 3,000 two-turn conversations, batch 512, up to 256 new tokens a turn. Prints time to the first written
conversation, wall time and tokens/s for each driver (order: chained, windows, chained).
"""
import json, os, random, sys, threading, time
from pathlib import Path
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from eagle3.training.regenerate import LocalBackend, regenerate

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
tok = AutoTokenizer.from_pretrained("src/eagle3/assets/stories260k")
tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
tok.chat_template = CHATML
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=int(os.environ.get("LAYERS", "30")),
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096, rope_theta=1e5,
                  tie_word_embeddings=True)
DEV = os.environ.get("DEV", "cuda"); N = int(os.environ.get("N", "3000")); L = int(os.environ.get("LAYERS", "30"))
model = LlamaForCausalLM(cfg).to(DEV, torch.bfloat16 if DEV == "cuda" else torch.float32).eval()
words = "once upon a time there was a little girl named lily who loved to play in the park with her dog".split()
rng = random.Random(0)
W = Path("/tmp/rd"); W.mkdir(exist_ok=True)
src = W / "in.jsonl"
with open(src, "w") as f:
    for i in range(N):
        turns = [" ".join(rng.choices(words, k=rng.randint(5, 300))) for _ in range(2)]
        f.write(json.dumps({"id": f"r{i}", "turns": turns}) + "\n")
warm = W / "warm.jsonl"
with open(warm, "w") as f:
    for i in range(600):
        f.write(json.dumps({"id": f"w{i}", "turns": ["hello there", "and again"]}) + "\n")

def run(name, chained):
    backend = LocalBackend(model, tok, max_prompt_tokens=1280, engine="fast")
    if not chained:
        backend.answer_chains = None  # falls back to the turn-synchronous window driver
    regenerate(warm, W / f"warm_{name}.jsonl", backend, max_new_tokens=32, batch_size=512, max_turns=2, progress=False)
    out = W / f"{name}.jsonl"
    first = [None]; t0 = time.perf_counter(); stop = threading.Event()
    def watch():
        while not stop.is_set():
            if out.exists() and out.stat().st_size > 0 and first[0] is None:
                first[0] = time.perf_counter() - t0
            time.sleep(0.05)
    th = threading.Thread(target=watch, daemon=True); th.start()
    rep = regenerate(src, out, backend, max_new_tokens=int(os.environ.get("NEW", "256")), batch_size=int(os.environ.get("BS", "512")), max_turns=2, progress=False)
    stop.set(); th.join()
    if first[0] is None:  # everything was written in the last moments of the run
        first[0] = rep.seconds
    res = {"driver": name, "first_row_s": first[0], "seconds": rep.seconds, "rows_done": rep.rows_done,
           "turns": rep.turns_generated, "tokens": rep.tokens_generated, "tokens_per_s": rep.tokens_per_s}
    print(json.dumps(res), flush=True)
    return res

results = [run("chained1", True), run("windows", False), run("chained2", True)]
rows = lambda p: {json.loads(l)["row"]: json.loads(l)["conversations"] for l in open(p)}
a, b = rows(W / "chained1.jsonl"), rows(W / "windows.jsonl")
same = sum(a[k] == b.get(k) for k in a)
print(json.dumps({"identical_conversations_chained_vs_windows": same, "of": len(a)}))
json.dump({"results": results, "identical": same, "of": len(a), "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
           "torch": torch.__version__, "git_sha": os.environ.get("EAGLE3_GIT_SHA")},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "regen_drivers_h200.json"), "w"), indent=2)
