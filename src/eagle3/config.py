"""Typed configuration and the one set of defaults shared by library, CLI and benchmarks.

`DrafterConfig` describes an EAGLE-3 drafter (what its checkpoint's config holds).
`DraftShape` describes what a cycle drafts (a chain or an EAGLE-2 tree, its sizes).
`SamplingConfig` describes how tokens are chosen (greedy or sampled).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------------------------------------
# Defaults (one place). EAGLE-2 tree defaults follow SafeAILab/EAGLE `eagle/model/ea_model.py`
# (`total_token=60, depth=7, top_k=10`) with depth counted as draft steps (paper depth 6 = 6 steps).
# ---------------------------------------------------------------------------------------------
DEFAULT_TREE_DEPTH = 6
DEFAULT_TREE_TOP_K = 10
DEFAULT_TREE_TOTAL_TOKENS = 60
DEFAULT_CHAIN_LENGTH = 5
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_DRAFT_VOCAB_SIZE = 32000
DEFAULT_NGRAM_MAX = 4
DEFAULT_NGRAM_MIN = 1
# plain-cycle tokens a served row holds back for the drafter before they are fed in one batched step
FEED_WINDOW = 32

# The fast path's variants are library options only (`eagle3.fast.engine.FastOptions`, `run_bench`'s keywords,
# `fast_rows`, the scripts' own flags); their auto defaults pick per device
# (docs/how-it-works.md, "The fast path's options"). The values each accepts, checked where they resolve:
# `FastOptions.fuse_pointwise` (`eagle3.fast.pointwise.fuse_level`).
FUSE_POINTWISE_CHOICES = ("auto", "off", "elementwise")
FUSE_POINTWISE_HELP = "elementwise (the flag alone): compile RoPE and SwiGLU; auto: elementwise on CUDA, off elsewhere"
# `FastOptions.target_attention`, resolved by `eagle3.fast.attention.target_attention_for`.
TARGET_ATTENTION = ("auto", "sdpa", "split")
TARGET_ATTENTION_HELP = ("how the target attends when decoding; auto: split (flash-decoding Triton kernels) on "
                         "CUDA with Triton, else sdpa")

# The one fast-engine flag of the decoding commands (generate, bench): a debugging switch.
NO_GRAPHS_HELP = "run the fast path eagerly (no CUDA graphs; slower, for debugging)"
BATCH_INVARIANT_HELP = ("CUDA: run every decoding forward at one row count, so that greedy trees are identical "
                        "to plain decoding by construction (slower; docs/tuning.md)")


def help_formatter(prog: str) -> argparse.HelpFormatter:
    """The `eagle3 <command> --help` layout: a flag of up to 26 characters keeps its help on its own line."""
    return argparse.HelpFormatter(prog, max_help_position=30)


# One help text for `--dtype` and `--guard` of the decoding commands (`eagle3.defaults`).
DTYPE_HELP = "auto: bf16 on CUDA and on CPUs with native bf16 (fast-engine families), else fp32"
GUARD_HELP = "pause drafting while slower than plain decoding (auto: on a CPU)"

AUTO_ON_OFF = {"auto": None, "on": True, "off": False}  # an auto/on/off flag as an optional bool (None: auto)


def on_for_device(choice: str, device) -> bool:
    """An auto/on/off option (`--fast-rows`, `FastOptions.graph_prefill`) for `device`: auto means on for CUDA
    only."""
    if choice not in AUTO_ON_OFF:
        raise ConfigError(f"an auto/on/off option must be auto, on or off, not {choice!r}")
    on = AUTO_ON_OFF[choice]
    return str(device).startswith("cuda") if on is None else on


class ConfigError(ValueError):
    """A configuration is invalid or does not fit its target; the message says which field and what to do."""


def require_extra(extra: str, modules: tuple[str, ...], what: str) -> None:
    """Raise a `ConfigError` that names the pip extra to install when one of `modules` (an optional
    dependency of `what`, e.g. "eagle3 serve") cannot be imported."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            raise ConfigError(f"{what} needs the {extra} extra: pip install 'eagle3[{extra}]'") from None


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Target layers whose *input* residual stream feeds the drafter, in HF `hidden_states` indexing.

    The EAGLE-3 rule is `[2, L//2, L-3]` (SafeAILab/EAGLE `eagle/model/modeling_llama_kv.py`; vLLM
    `get_eagle3_aux_hidden_state_layers`). Shallow targets would repeat ids (L=5 gives [2, 2, 2]), which
    speculators refuses (`src/speculators/models/utils.py`); we then spread three distinct ids over the depth.
    """
    if num_layers < 3:
        raise ConfigError(f"target has {num_layers} decoder layers; EAGLE-3 needs at least 3 to tap low/mid/high")
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and ids == sorted(ids):
        return ids
    # distinct and ascending: [1, L//2, L-1] for L >= 4; [0, 1, 2] (embedding output first) for L = 3
    return [1, num_layers // 2, num_layers - 1] if num_layers >= 4 else [0, 1, 2]


@dataclass
class DrafterConfig:
    """Shape and flags of an EAGLE-3 drafter (one Llama-style decoder layer reading fused target features).

    Field names follow the speculators `transformer_layer_config` / native EAGLE-3 `config.json` keys.
    `aux_layer_ids` use the vLLM convention: id k is HF `hidden_states[k]`, the residual stream *entering*
    decoder layer k (k = L means the last layer's output before the final norm).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # target vocabulary V
    draft_vocab_size: int  # Vd; == vocab_size means "no reduction"
    aux_layer_ids: list[int]
    target_num_layers: int
    head_dim: int | None = None
    target_hidden_size: int | None = None  # Ht when it differs from hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    num_hidden_layers: int = 1
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    use_aux_hidden_state: bool = True
    torch_dtype: str = "float32"
    # provenance, written into checkpoints
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] = field(default_factory=list)
    speculative_tokens: int = DEFAULT_CHAIN_LENGTH
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # acceptance measured by `eagle3 check --write-profile` (settings and tau), so a later check can tell a
    # misconfigured deployment from a weak drafter; kept through save, load and export
    acceptance_profile: dict[str, Any] | None = None
    # config.json keys eagle3 does not interpret, kept so export writes them back verbatim: {"top": {...},
    # "layer": {...}} (speculators top level / `transformer_layer_config`; see eagle3.formats.configs)
    kept_keys: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    # -- derived -----------------------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def resolved_target_hidden_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    # -- checks ------------------------------------------------------------------------------
    def validate(self) -> None:
        if self.num_hidden_layers != 1:
            raise ConfigError(
                f"num_hidden_layers={self.num_hidden_layers}: only 1-layer EAGLE-3 drafters are supported "
                "(multi-layer weight names differ between vLLM and SGLang; see docs/vllm-sglang.md)"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: the EAGLE-3 drafter MLP is SwiGLU ('silu')")
        if not self.use_aux_hidden_state:
            raise ConfigError(
                "use_aux_hidden_state=false (EAGLE-1-style drafter on the last layer only) is not supported; "
                "re-train or convert to an EAGLE-3 drafter with three aux layers"
            )
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError("fc_norm and norm_before_fc are mutually exclusive; set at most one")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size={self.draft_vocab_size} is larger than the target vocabulary "
                f"vocab_size={self.vocab_size}; choose draft_vocab_size <= {self.vocab_size}"
            )
        if self.draft_vocab_size <= 0:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} must be positive")
        if len(self.aux_layer_ids) != 3:
            raise ConfigError(
                f"aux_layer_ids={self.aux_layer_ids}: EAGLE-3 fuses exactly 3 target layers (low, mid, high)"
            )
        if sorted(set(self.aux_layer_ids)) != list(self.aux_layer_ids):
            raise ConfigError(f"aux_layer_ids={self.aux_layer_ids} must be distinct and ascending")
        for k in self.aux_layer_ids:
            if not 0 <= k <= self.target_num_layers:
                raise ConfigError(
                    f"aux layer id {k} is out of range for a target with {self.target_num_layers} layers "
                    f"(valid: 0..{self.target_num_layers}, HF hidden_states indexing)"
                )
        if (self.num_attention_heads * self.resolved_head_dim) <= 0:
            raise ConfigError("num_attention_heads * head_dim must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown DrafterConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        draft_vocab_size: int | None = None,
        aux_layer_ids: list[int] | None = None,
        **overrides: Any,
    ) -> DrafterConfig:
        """A drafter shaped like one decoder layer of `target_config` (an HF `PretrainedConfig`)."""
        tc = getattr(target_config, "text_config", None) or target_config
        num_layers = tc.num_hidden_layers
        vocab = tc.vocab_size
        # MoE targets: use the dense FFN size if any, else the expert size times the routed top-k
        inter = _global_attr(tc, "intermediate_size")
        if not inter:
            inter = _global_attr(tc, "moe_intermediate_size") or 4 * tc.hidden_size
        heads, kv_heads, head_dim = drafter_attention_shape(tc)
        kw: dict[str, Any] = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=inter,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            draft_vocab_size=min(draft_vocab_size or vocab, vocab),
            aux_layer_ids=list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(num_layers),
            target_num_layers=num_layers,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6) or 1e-6),
            rope_theta=_rope_theta(tc),
            max_position_embeddings=max(2048, int(getattr(tc, "max_position_embeddings", 2048) or 2048)),
            verifier_name_or_path=getattr(tc, "_name_or_path", None) or None,
            verifier_architectures=list(getattr(target_config, "architectures", None) or []),
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_id=getattr(tc, "eos_token_id", None),
            pad_token_id=getattr(tc, "pad_token_id", None),
        )
        kw.update(overrides)
        return cls(**kw)


def _global_attr(tc: Any, name: str, default: Any = None) -> Any:
    """`tc.<name>`, also where transformers marks it per-layer (Gemma-4 `head_dim`, read through `per_layer_config`,
    raises on the global config): the top-level value, which is what the layers without an override use."""
    try:
        return getattr(tc, name, default)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError)
        d = tc.to_dict() if hasattr(tc, "to_dict") else {}
        return d.get(name, default)


# Published drafters for these targets use 128-wide heads, whatever the target's own head size.
DRAFTER_HEAD_DIM = 128


def drafter_attention_shape(tc: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of a new drafter for the text config `tc`.

    Most targets: their own heads, KV heads and head size. Two families differ, shaped like the drafters
    published for them:

    * MLA targets (DeepSeek-V3, Kimi-K2/K2.5: `kv_lora_rank` set). HF's `head_dim` there is the RoPE part
      (`qk_rope_head_dim`, 64), not a head size; the drafter keeps the target's query heads with head size
      `v_head_dim` (128) and as many KV heads (plain MHA: MLA has no grouped KV). Facts relied on:
      sgl-project/SpecForge `configs/kimi-k25-eagle3.json` (the lightseekorg/kimi-k2.5-eagle3 shape):
      hidden_size 7168, num_attention_heads 64, num_key_value_heads 64, head_dim 128, for Kimi-K2.5's 64 heads
      with v_head_dim 128.
    * Gemma-4 (`per_layer_config`: full-attention layers override `head_dim` with `global_head_dim`). The
      drafter reads the top-level (sliding-layer) head size, then splits the query width heads x head_dim into
      128-wide heads, keeping the target's KV heads. Fact relied on: SpecForge `configs/gemma4-26b-a4b-eagle3.json`:
      32 heads of 128 and 8 KV heads for gemma-4-26B-A4B's 16 heads of 256 and 8 KV heads.

    Rule, for both: query width = target heads x head size; where it divides by 128 the drafter uses width/128
    heads of 128 (tiny test targets keep their own split); KV heads fall back to the query heads when they do not
    divide them.
    """
    heads = int(tc.num_attention_heads)
    mla = _global_attr(tc, "kv_lora_rank") is not None and _global_attr(tc, "v_head_dim") is not None
    gemma4 = str(getattr(tc, "model_type", "")).startswith("gemma4")
    if mla:
        head_dim = int(_global_attr(tc, "v_head_dim"))
        kv = heads
    else:
        head_dim = int(_global_attr(tc, "head_dim") or tc.hidden_size // heads)
        kv = int(_global_attr(tc, "num_key_value_heads") or heads)
    if (mla or gemma4) and head_dim != DRAFTER_HEAD_DIM and (heads * head_dim) % DRAFTER_HEAD_DIM == 0:
        heads, head_dim = heads * head_dim // DRAFTER_HEAD_DIM, DRAFTER_HEAD_DIM
    if heads % kv:
        kv = heads
    return heads, kv, head_dim


def _rope_theta(tc: Any) -> float:
    params = getattr(tc, "rope_parameters", None)
    if isinstance(params, dict):
        if "rope_theta" in params:
            return float(params["rope_theta"])
        # per-layer-type dicts (Gemma-3): take the full-attention one
        full = params.get("full_attention")
        if isinstance(full, dict) and "rope_theta" in full:
            return float(full["rope_theta"])
        for v in params.values():
            if isinstance(v, dict) and "rope_theta" in v:
                return float(v["rope_theta"])
    return float(getattr(tc, "rope_theta", 10000.0) or 10000.0)


@dataclass(frozen=True)
class DraftShape:
    """How a cycle drafts: `depth` drafter steps, `top_k` children per expanded node, `total` draft nodes verified
    (root excluded). `DraftShape()` is the default EAGLE-2 tree; a chain of K tokens is `DraftShape.chain(K)`,
    i.e. (K, 1, K). `total` is capped at the nodes EAGLE-2's expansion records (top_k, then top_k² per step)."""

    depth: int = DEFAULT_TREE_DEPTH
    top_k: int = DEFAULT_TREE_TOP_K
    total: int = DEFAULT_TREE_TOTAL_TOKENS

    def __post_init__(self) -> None:
        if min(self.depth, self.top_k, self.total) < 1:
            raise ConfigError(f"draft shape depth={self.depth}, top_k={self.top_k}, total={self.total} must all "
                              "be >= 1")
        object.__setattr__(self, "total", min(self.total, self.top_k + (self.depth - 1) * self.top_k ** 2))

    @classmethod
    def chain(cls, length: int) -> DraftShape:
        """`length` tokens, each the drafter's top choice after the one before."""
        return cls(length, 1, length)

    @classmethod
    def parse(cls, text: str) -> DraftShape:
        """'DEPTH,TOPK,TOTAL' as `--tree` takes it (the inverse of `text`)."""
        try:
            depth, top_k, total = (int(x) for x in text.split(","))
        except ValueError:
            raise ConfigError(f"--tree {text!r}: expected three integers DEPTH,TOPK,TOTAL such as 6,10,60") from None
        return cls(depth, top_k, total)

    @classmethod
    def from_flags(cls, tree: str | None = None, chain: int | None = None) -> DraftShape | None:
        """The shape `--tree D,K,N` or `--chain K` asks for; None when neither is given (the caller's default)."""
        if tree is not None and chain is not None:
            raise ConfigError("give at most one of --chain and --tree")
        return cls.chain(chain) if chain is not None else None if tree is None else cls.parse(tree)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftShape:
        """The inverse of `to_dict`; keys it lacks take the defaults."""
        if d.get("mode") == "chain":
            return cls.chain(d.get("chain_length", DEFAULT_CHAIN_LENGTH))
        return cls(d.get("depth", DEFAULT_TREE_DEPTH), d.get("top_k", DEFAULT_TREE_TOP_K),
                   d.get("total_tokens", DEFAULT_TREE_TOTAL_TOKENS))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of records and acceptance profiles: {"mode": "chain", "chain_length": K} or
        {"mode": "tree", "depth": D, "top_k": K, "total_tokens": N}."""
        if self.is_chain:
            return {"mode": "chain", "chain_length": self.depth}
        return {"mode": "tree", "depth": self.depth, "top_k": self.top_k, "total_tokens": self.total}

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1 and self.total == self.depth

    @property
    def scratch(self) -> int:
        """Drafter rows the expansion computes beyond the committed ones: (depth - 1) steps of top_k rows."""
        return (self.depth - 1) * self.top_k

    @property
    def text(self) -> str:
        """'6,10,60', as `--tree` takes it and method names show it."""
        return f"{self.depth},{self.top_k},{self.total}"

    def __str__(self) -> str:
        return f"chain {self.depth}" if self.is_chain else f"tree {self.text}"


@dataclass
class SamplingConfig:
    """Temperature 0 means greedy. temperature, top_p and top_k process the target's distribution (and the
    drafter's, where sampled requests draft coupled to the target's draws: `eagle3.decoding.sampling`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise ConfigError(f"temperature={self.temperature} must be in [0, 100]")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
