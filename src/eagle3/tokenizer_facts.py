"""What a model's own files say its tokenizer does, and whether a loaded tokenizer does it.

A GGUF states its tokenizer's rules as metadata (`tokenizer.ggml.add_bos_token`, the BOS/EOS ids, the chat
template); transformers rebuilds a tokenizer from them, and its versions have differed on whether that tokenizer
then adds BOS. A model fed text without the BOS it was trained with still runs, and speculative decoding still
agrees with plain decoding, but it predicts much worse. So eagle3 compares behaviour (encoding a short text)
with what the file says: `match_gguf_tokenizer` corrects a tokenizer built from a GGUF (or refuses), and
`tokenizer_findings` gives `eagle3 check` its report for any target.

The GGUF also names the hub repository it was converted from, when the converter knew it (`public_name`):
exported drafters record that as their verifier, not eagle3's private converted copy.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError

PROBE_TEXT = "Hello world"  # encoded with and without special tokens to see what the tokenizer adds

# `general.source.*`: the model this file was converted from. `general.base_model.*` is the model *that* one was
# fine-tuned from (an instruct model names its base), so it is not used as a name, only mentioned.
_SOURCE_KEYS = ("general.source.huggingface.repository", "general.source.repo_url", "general.source.url")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_HUB_URL = re.compile(r"^https?://(?:www\.)?huggingface\.co/([\w.-]+/[\w.-]+?)(?:/tree/[^/]+)?/?$")


def read_gguf_facts(path: str | Path) -> dict[str, Any]:
    """The GGUF metadata eagle3 relies on (None where the file does not say): `add_bos_token`, `add_eos_token`,
    `bos_token_id`, `eos_token_id`, `chat_template` (the text), `repository` (hub id it was converted from) and
    `base_model` (the hub id it names as its base). Reads the header with gguf's GGUFReader, no tensor data."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(path)).fields
    except Exception as e:  # a truncated or foreign file: say which
        raise ConfigError(
            f"cannot read the GGUF metadata of {path} ({type(e).__name__}: {e}); pass a complete .gguf file"
        ) from e

    def value(key: str) -> Any:
        field = fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except AttributeError:  # gguf < 0.11 has no contents(): scalars and strings by hand
            from gguf import GGUFValueType

            part = field.parts[field.data[0]]
            if field.types == [GGUFValueType.STRING]:
                return bytes(part).decode("utf-8", "replace")
            return part.tolist()[0] if len(field.types) == 1 else None

    def flag(key: str) -> bool | None:
        v = value(key)
        return None if v is None else bool(v)

    def integer(key: str) -> int | None:
        v = value(key)
        return None if v is None else int(v)

    template = value("tokenizer.chat_template")
    return {
        "add_bos_token": flag("tokenizer.ggml.add_bos_token"),
        "add_eos_token": flag("tokenizer.ggml.add_eos_token"),
        "bos_token_id": integer("tokenizer.ggml.bos_token_id"),
        "eos_token_id": integer("tokenizer.ggml.eos_token_id"),
        "chat_template": template if isinstance(template, str) and template else None,
        "repository": next((hub for key in _SOURCE_KEYS if (hub := hub_id(value(key)))), None),
        "base_model": hub_id(value("general.base_model.0.repo_url")),
    }


def hub_id(text: Any) -> str | None:
    """`org/name` from a hub id or a huggingface.co URL; None for anything else."""
    if not isinstance(text, str):
        return None
    text = text.strip()
    if _HUB_ID.match(text):
        return text
    m = _HUB_URL.match(text)
    return m.group(1) if m else None


def encodes_with(tokenizer: Any) -> tuple[bool, bool]:
    """(adds BOS, adds EOS): what encoding `PROBE_TEXT` with special tokens adds to it without them."""
    ids = list(tokenizer(PROBE_TEXT, add_special_tokens=True)["input_ids"])
    plain = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    adds_bos = bos is not None and ids[:1] == [bos] and plain[:1] != [bos]
    adds_eos = eos is not None and ids[-1:] == [eos] and plain[-1:] != [eos]
    return adds_bos, adds_eos


def match_gguf_tokenizer(tokenizer: Any, facts: dict[str, Any], where: str | Path) -> list[str]:
    """Make `tokenizer` do what the GGUF's metadata `facts` say (BOS/EOS ids, adding BOS/EOS, chat template).

    Returns what was changed (empty when it already matched); raises ConfigError when a rule cannot be applied,
    since a model fed differently tokenized text degrades without any error.
    """
    import transformers

    changes = []
    for name in ("bos", "eos"):
        want, have = facts.get(f"{name}_token_id"), getattr(tokenizer, f"{name}_token_id", None)
        if want is None or want == have:
            continue
        if not 0 <= want < len(tokenizer):
            raise ConfigError(
                f"{where}: tokenizer.ggml.{name}_token_id={want} is outside its vocabulary of {len(tokenizer)} "
                "tokens; the file is damaged, convert the model again"
            )
        setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(want))
        changes.append(f"{name}_token_id {have} -> {want}")
    have = encodes_with(tokenizer)
    want = tuple(have[i] if facts.get(key) is None else facts[key]
                 for i, key in enumerate(("add_bos_token", "add_eos_token")))
    if changes or want != have:
        changes += [f"{key} {h} -> {w}" for key, h, w in zip(("add_bos_token", "add_eos_token"), have, want,
                                                             strict=True) if h != w]
        # both flags: their setters rebuild the post-processor; whether that worked is judged by behaviour below
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            tokenizer.add_bos_token, tokenizer.add_eos_token = want
        if encodes_with(tokenizer) != want:
            raise ConfigError(
                f"the tokenizer transformers {transformers.__version__} builds from {where} "
                f"{_adds_words(encodes_with(tokenizer))} although the GGUF says "
                f"{_adds_words(want)} (tokenizer.ggml.add_bos_token / add_eos_token), and eagle3 could not correct "
                "it; the model would see text unlike its training. Install another transformers 5.x version, or "
                "load the original Hugging Face model instead of the GGUF"
            )
    if facts.get("chat_template") and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = facts["chat_template"]
        changes.append("chat template restored from tokenizer.chat_template")
    return changes


def _adds_words(adds: tuple[bool, bool]) -> str:
    bos, eos = adds
    return f"{'adds' if bos else 'does not add'} BOS and {'adds' if eos else 'does not add'} EOS"


def hf_expectations(where: str | Path) -> dict[str, Any]:
    """What a Hugging Face folder (or a hub id in the local hub cache) says about its tokenizer: `add_bos_token`
    and `add_eos_token` (tokenizer_config.json, None where unstated), `bos_token_id` (generation_config.json, else
    config.json) and `chat_template` (True/False; None when tokenizer_config.json is not at hand)."""
    tok_config = _hf_json(where, "tokenizer_config.json")
    gen = _hf_json(where, "generation_config.json") or {}
    cfg = _hf_json(where, "config.json") or {}
    cfg = cfg.get("text_config") or cfg
    template = None
    if tok_config is not None:
        template = bool(tok_config.get("chat_template")) or any(
            _hf_file(where, name) is not None for name in ("chat_template.jinja", "chat_template.json"))
    flags = tok_config or {}
    return {
        "source": f"{where} (tokenizer_config.json, generation_config.json)",
        "add_bos_token": flags.get("add_bos_token"),
        "add_eos_token": flags.get("add_eos_token"),
        "bos_token_id": gen.get("bos_token_id", cfg.get("bos_token_id")),
        "eos_token_id": None,  # models list several stop ids; the tokenizer's EOS is one of them, or not
        "chat_template": template,
    }


def _hf_file(where: str | Path, name: str) -> Path | None:
    folder = Path(where).expanduser()
    if folder.is_dir():
        return folder / name if (folder / name).is_file() else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(where), name)
    return Path(cached) if isinstance(cached, str) else None


def _hf_json(where: str | Path, name: str) -> dict[str, Any] | None:
    path = _hf_file(where, name)
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def tokenizer_findings(tokenizer: Any, expect: dict[str, Any]) -> list[tuple[str, str]]:
    """(status, message) pairs for `eagle3 check`: the tokenizer's behaviour against `expect` (GGUF facts with a
    `source`, or `hf_expectations`). Disagreements are warnings: the check's decodings share the tokenizer and
    stay identical, and a file's flag can be meant to be overridden (a template that writes BOS itself), but a
    missing BOS the model was trained with costs much of its quality, so the line says what to look at."""
    adds_bos, adds_eos = encodes_with(tokenizer)
    source = expect.get("source", "the model files")
    out: list[tuple[str, str]] = []
    for key, adds, token in (("add_bos_token", adds_bos, "BOS"), ("add_eos_token", adds_eos, "EOS")):
        want = expect.get(key)
        if want is not None and want != adds:
            out.append(("warn", f"encoding text {'adds' if adds else 'does not add'} {token} but {source} says "
                                f"{key}={want}: the model sees text unlike its training (a missing BOS can raise "
                                "perplexity several-fold while speculative and plain decoding still agree). Load "
                                "the target with another transformers version or from its original files"))
    # a GGUF's ids define its tokenizer's; a folder's config ids matter only for the BOS the tokenizer adds
    for key, token, added in (("bos_token_id", "BOS", adds_bos), ("eos_token_id", "EOS", True)):
        want, have = expect.get(key), getattr(tokenizer, key, None)
        if want is not None and want != have and (added or expect.get("ids_define_tokenizer")):
            out.append(("warn", f"the tokenizer's {token} id is {have} but {source} says {want}"))
    template = bool(getattr(tokenizer, "chat_template", None))
    if expect.get("chat_template") is not None and bool(expect["chat_template"]) != template:
        out.append(("warn", f"the tokenizer {'has' if template else 'has no'} chat template but {source} "
                            f"{'has none' if template else 'has one'}: chat prompts are rendered differently "
                            "from the model's own format"))
    if not out:
        stated = any(expect.get(k) is not None for k in ("add_bos_token", "add_eos_token", "chat_template"))
        out.append(("pass", f"encoding adds {'BOS' if adds_bos else 'no BOS'} and {'EOS' if adds_eos else 'no EOS'}, "
                            f"{'with' if template else 'without'} a chat template"
                            + (f", as {source} says" if stated else f" ({source} does not say)")))
    return out
