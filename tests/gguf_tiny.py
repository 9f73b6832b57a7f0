"""A tiny random Llama written as a GGUF with the `gguf` package, for tests of GGUF loading without a real model.

`write_tiny_gguf(path, ...)` writes a 3-layer (the fewest EAGLE-3 taps), hidden-16 Llama with a 38-token byte-level BPE vocabulary
("hello world" encodes to a few ids), tokenizer flags and ids as given, and optional `general.*` strings.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

BOS, EOS = 1, 2
_LETTERS = [*"abcdefghijklmnopqrstuvwxyz", "Ġ", ".", ","]
_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r"]
TOKENS = ["<unk>", "<s>", "</s>", *_LETTERS, *(m.replace(" ", "") for m in _MERGES)]


def write_tiny_gguf(path: str | Path, add_bos: bool | None = True, add_eos: bool | None = None,
                    chat_template: str | None = None, metadata: dict[str, str] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab, hidden, inter, layers, heads, kv_heads = len(TOKENS), 16, 32, 3, 2, 1
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(0)
    for key, value in (metadata or {}).items():
        w.add_string(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(_MERGES)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if chat_template:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    head_dim = hidden // heads
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", head_dim * kv_heads, hidden)
        tensor(f"blk.{i}.attn_v.weight", head_dim * kv_heads, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_gate.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_up.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    tensor("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
