"""Constrained decoding: a JSON schema (or "any JSON object") as a token mask on the target and on the drafts.

The grammar engine is llguidance (PyPI `llguidance`, Rust, no Python dependencies, wheels for every CPU): a
request's schema compiles to an `LLMatcher` that follows the tokens the request emits and gives the set of tokens
allowed next as a bitmask (one bit per token, int32 words). docs/structured-output.md says why this engine and
what a mask costs.

A constrained row's tokens are the target's choices under the mask at every position: greedy is the argmax over
the allowed tokens, sampling draws from the target's distribution restricted to them (`eagle3.decoding.sampling`
with -inf elsewhere). Speculation keeps this exactly: verification walks the drafted tree along the path it
accepts (`walk_tree`): at each step the row's matcher gives the mask after the tokens emitted so far, the target's
choice is taken under it and consumed, and the walk moves to the child drafted with that token or ends there (the
choice is then the cycle's last token). That is plain constrained decoding, one mask per emitted token, with the
target's logits for the whole tree computed in one forward. Where the caller knows the target's unmasked choice at
a node and the grammar allows it, that is the choice (greedy and temperature-only draws: the winner over all
tokens is the winner over any subset holding it), and the step needs no device step. Where cycles run eagerly
the drafter proposes under the masks of its frontier (`Grammar.masks`), so its drafts are tokens the grammar
allows, and a token the grammar forces (its mask allows no other) is drafted as certain, in or out of the draft
vocabulary (`expand.force_single`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llguidance
import torch

from eagle3.config import ConfigError

__all__ = ["ALL", "Choose", "Grammar", "GrammarCompiler", "GrammarError", "allowed_tokens", "bitmask_words",
           "forced_path_masks", "frontier_allowed", "load_schema", "next_allowed", "next_masks", "restrict",
           "schema_file", "single_token", "walk_tree"]

ALL = -1  # a bitmask word with every token allowed
# Whitespace between JSON tokens: compact or pretty-printed (a newline and up to 32 spaces of indentation), but
# bounded. The engine's default (`[ \n\r\t]+`) lets a model that is unsure emit newlines until max_tokens.
COMPILED_SCHEMAS = 256  # compiled matchers kept (`GrammarCompiler.compile_text`)
WHITESPACE = r"[\x20\x09]{0,4}(\x0A[\x20\x09]{0,32})?"


class GrammarError(ConfigError):
    """A schema or response format the grammar engine refuses; the message names the problem."""


class GrammarCompiler:
    """Grammars for one tokenizer: `compile(schema)` gives a request's `Grammar`. `eos_ids` end a constrained
    answer (the first is the grammar engine's end token); `vocab_size` is the target's (it may exceed the
    tokenizer's, the extra ids never allowed). The engine's view of the vocabulary is built once, here."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        if not eos_ids:
            raise ConfigError("constrained decoding needs an end-of-sequence token to end the answer with")
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.words = bitmask_words(vocab_size)
        self._compiled: dict[str, object] = {}  # grammar text -> its compiled matcher, least recently used first
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ConfigError("constrained decoding needs a fast (Rust) tokenizer; this one is "
                              f"{type(tokenizer).__name__}")
        self._tokenizer = llguidance.LLTokenizer(engine_tokenizer_json(backend.to_str()), n_vocab=vocab_size,
                                                 eos_token=self.eos_ids)

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer, eos_ids: Sequence[int]) -> GrammarCompiler:
        """Grammars over the model's output vocabulary (its logits' width)."""
        return cls(tokenizer, model.get_output_embeddings().weight.shape[0], eos_ids)

    @staticmethod
    def grammar_text(schema: dict | None) -> str:
        """The engine's grammar for a JSON schema (None: any JSON object); raises GrammarError."""
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(
                schema if schema is not None else {"type": "object"}, overrides={"whitespace_pattern": WHITESPACE})
        except (ValueError, TypeError) as e:
            raise GrammarError(f"not a JSON schema: {e}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
        if failed:
            raise GrammarError(f"the JSON schema cannot be used: {messages[0]}")
        return text

    @staticmethod
    def lark_text(lark: str) -> str:
        """The engine's grammar for a Lark grammar (JSON schemas inside as `%json {...}`); raises GrammarError."""
        text = llguidance.LLMatcher.grammar_from_lark(lark)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
        if failed:
            raise GrammarError(f"the grammar cannot be used: {messages[0]}")
        return text

    def compile(self, schema: dict | None) -> Grammar:
        """A fresh matcher for `schema` (see `grammar_text`)."""
        return self.compile_text(self.grammar_text(schema))

    def compile_text(self, text: str) -> Grammar:
        """A fresh matcher for an engine grammar (`grammar_text`, `lark_text`). Matchers of one grammar are copies
        of one compiled matcher, which share what the engine learns about the vocabulary as they run, so a
        grammar's later answers compute their masks faster than its first."""
        template = self._compiled.pop(text, None)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
            if template.is_error():
                raise GrammarError(f"the grammar cannot be used: {template.get_error()}")
        self._compiled[text] = template  # most recently used last
        while len(self._compiled) > COMPILED_SCHEMAS:
            self._compiled.pop(next(iter(self._compiled)))
        return Grammar(template.deep_copy(), self.words, self.eos_ids)


def engine_tokenizer_json(text: str) -> str:
    """A tokenizer's JSON as the grammar engine must read it. The engine takes a BPE vocabulary with
    `byte_fallback` for SentencePiece-style (tokens are literal text, "▁" a space); a byte-level one (GPT-2 style:
    a ByteLevel pre-tokenizer, "Ġ" a space) flagged so, as transformers 5.17 converts SmolLM2's GGUF, would then
    spell every spaced token wrongly and allow none of them. Such a vocabulary is given to it as byte-level."""
    config = json.loads(text)
    pre = config.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    model = config.get("model") or {}
    if model.get("byte_fallback") and any(p.get("type") == "ByteLevel" for p in parts):
        model["byte_fallback"] = False
        config["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                             "use_regex": True}
        return json.dumps(config)
    return text


def load_schema(text: str, where: str) -> dict:
    """A JSON schema from JSON text (a file's content, a request field); GrammarError names `where`."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{where} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON object (a JSON schema), got {type(schema).__name__}")
    return schema


def schema_file(path: str) -> dict:
    """The JSON schema in a file (`--json-schema FILE`), checked by the grammar engine before a model loads."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--json-schema {path}: cannot read it ({e.strerror})") from None
    schema = load_schema(text, f"--json-schema {path}")
    GrammarCompiler.grammar_text(schema)
    return schema


class Grammar:
    """One request's matcher, in the state after every token the request has emitted (`consume`)."""

    def __init__(self, matcher: Any, words: int, eos_ids: Sequence[int]):
        self.m, self.words, self.eos = matcher, words, set(eos_ids)
        self.done = False  # an end token was emitted: the answer is complete
        self.masks_computed = 0  # bitmasks computed so far, and the seconds they took (`eagle3 bench`)
        self.mask_s = 0.0

    def consume(self, tokens: Sequence[int]) -> None:
        """Follow emitted tokens. Tokens after an end token are ignored (a row that finished may decode on)."""
        for t in tokens:
            if self.done:
                return
            if t in self.eos:
                self.done = True
                return
            if not self.m.consume_token(t):
                raise RuntimeError(f"the grammar refused emitted token {t}: {self.m.get_error()}")

    def _fill(self, out: torch.Tensor) -> None:
        """The mask of the matcher's current state into out [W] (int32). A finished answer with no end token left
        to allow (the matcher stopped) allows everything: the row's text ends there anyway."""
        t0 = time.perf_counter()
        self.m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        self.mask_s += time.perf_counter() - t0
        self.masks_computed += 1
        if not out.any():
            if not self.m.is_stopped():
                raise RuntimeError(f"the grammar allows no token of this vocabulary here: {self.m.get_error()}")
            out.fill_(ALL)

    def mask_into(self, out: torch.Tensor) -> None:
        """The bitmask of the tokens allowed next into out [W] (int32); everything once the answer has ended."""
        if self.done:
            out.fill_(ALL)
        else:
            self._fill(out)

    def masks(self, paths: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[bool]]:
        """The bitmask after each path of tokens from the current state, [P, W] int32, and whether the grammar
        allows each path (a refused path's mask allows everything: nothing below it is ever accepted)."""
        out = torch.full((len(paths), self.words), ALL, dtype=torch.int32)
        ok = []
        for i, path in enumerate(paths):
            if self.done:
                ok.append(True)
                continue
            n = self.m.try_consume_tokens(list(path))
            ok.append(n == len(path))
            if n == len(path):
                self._fill(out[i])
            if n:
                self.m.rollback(n)
        return out, ok


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask of a vocabulary."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [..., V] from bitmasks [..., W] int32 (bit b of word w is token 32·w + b)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[..., None] >> shifts) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()


def next_masks(grammars: Sequence[Grammar | None], rows: int, words: int) -> torch.Tensor:
    """The bitmasks of the tokens each of `rows` rows may emit next, [rows, W] int32 on the host (rows past
    `grammars`, or whose grammar is None, allow everything)."""
    masks = torch.full((rows, words), ALL, dtype=torch.int32)
    for r, g in enumerate(grammars[:rows]):
        if g is not None:
            g.mask_into(masks[r])
    return masks


def forced_path_masks(grammars: Sequence[Grammar | None], rows: int, depth: int, words: int) -> torch.Tensor:
    """Drafting masks the host can give before drafting starts, [rows, depth, W] int32: level 0 the tokens each row
    may emit next (`next_masks`); while a level allows a single token, the grammar forces it, and the next level is
    the mask after it; every level past the first that allows several tokens allows everything (what follows
    depends on the drafts). Rows past `grammars`, or whose grammar is None, allow everything."""
    masks = torch.full((rows, depth, words), ALL, dtype=torch.int32)
    for r, g in enumerate(grammars[:rows]):
        if g is None:
            continue
        path: list[int] = []
        for level in range(depth):
            m, ok = g.masks([path])
            masks[r, level] = m[0]
            forced = single_token(m[0])
            if not ok[0] or g.done or forced is None:
                break
            path.append(forced)
    return masks


def single_token(mask: torch.Tensor) -> int | None:
    """The one token a bitmask [W] (int32) allows, or None where it allows several or none; read from its words
    without unpacking the vocabulary's bits."""
    words = mask.nonzero()
    if words.shape[0] != 1:
        return None
    i = int(words[0, 0])
    w = int(mask[i]) & 0xFFFFFFFF
    return i * 32 + w.bit_length() - 1 if w & (w - 1) == 0 else None


def next_allowed(grammars: Sequence[Grammar | None], rows: int, vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """`next_masks` as bool [rows, 1, V] on `device`."""
    return allowed_tokens(next_masks(grammars, rows, bitmask_words(vocab_size)).to(device), vocab_size)[:, None]


# choose(nodes, masks, walking) -> the target's choice after node nodes[r] (N+1 indexing) of each row r among the
# tokens of masks[r] ([B, W] int32 bitmasks), for the rows where walking[r]; [B] token ids
Choose = Callable[[list[int], torch.Tensor, list[bool]], list[int]]


def walk_tree(grammars: Sequence[Grammar | None], tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]],
              choose: Choose, first: torch.Tensor | None = None,
              top: Sequence[Sequence[int]] | None = None) -> int:
    """Verification of B rows' draft trees under their grammars (tokens [B][N], -1: padding or a node that does not
    count; parents [B][N], -1: the root; rows whose grammar is None are not walked). From each root: the mask after
    the tokens emitted so far, the target's choice under it (`choose`, which keeps it as that node's choice), the
    choice consumed, then on to the child drafted with that token (the first of equal siblings, as
    `eagle3.decoding.verify.accept_rows` takes it) or the walk of that row ends. The choices are the row's emitted
    tokens, already consumed by its grammar. `first` [B, W]: the rows' next-token masks where the caller has them
    (`next_masks`), for the first step. `top` [B][N+1]: the target's choice at each node without a mask, for
    greedy and temperature-only draws; a row whose grammar allows it there takes it (the mask cannot change it)
    and is not walked by `choose` at that step. Returns the `choose` calls made."""
    b = len(tokens)
    children: list[dict[tuple[int, int], int]] = [{} for _ in range(b)]  # (node, token) -> child, N+1 indexing
    for r in range(b):
        for j, (t, p) in enumerate(zip(tokens[r], parents[r], strict=True)):
            if t >= 0:
                children[r].setdefault((p + 1, t), j + 1)
    walking = [r < len(grammars) and grammars[r] is not None for r in range(b)]
    words = next(g.words for g in grammars if g is not None) if any(walking) else 1
    node = [0] * b
    masks = first.clone() if first is not None else torch.full((b, words), ALL, dtype=torch.int32)
    calls = steps = 0
    while any(walking):
        choices = [-1] * b
        masked = [False] * b  # rows whose choice this step is the target's under the mask
        for r in range(b):
            if not walking[r]:
                continue
            if steps or first is None:
                grammars[r].mask_into(masks[r])
            t = top[r][node[r]] if top is not None else -1
            if t >= 0 and int(masks[r, t >> 5]) >> (t & 31) & 1:
                choices[r] = t
            else:
                masked[r] = True
        if any(masked):
            chosen = choose(node, masks, masked)
            calls += 1
            choices = [c if m else k for c, m, k in zip(chosen, masked, choices, strict=True)]
        steps += 1
        for r in range(b):
            if walking[r]:
                g = grammars[r]
                g.consume([choices[r]])
                nxt = children[r].get((node[r], choices[r]))
                walking[r] = nxt is not None and not g.done
                node[r] = nxt or 0
    return calls


def frontier_allowed(grammars: Sequence[Grammar | None], frontier: torch.Tensor | None, tokens: torch.Tensor | None,
                     parents: torch.Tensor | None, vocab_size: int, device: torch.device) -> torch.Tensor:
    """`eagle3.decoding.expand.Constrain` in target ids for the rows of `grammars`: the tokens allowed after each
    frontier node (record indices [R, T] into tokens / parents [R, records]; None: the roots, T = 1), bool
    [R, T, V]. Reads the tensors on the host."""
    r = len(grammars)
    if frontier is None:
        paths, width = [[[]] for _ in range(r)], 1
    else:
        f, toks, pars = frontier.tolist(), tokens.tolist(), parents.tolist()
        width = frontier.shape[1]

        def path(i: int, rec: int) -> list[int]:  # the tokens from row i's root to record `rec`
            out = []
            while rec >= 0:
                out.append(toks[i][rec])
                rec = pars[i][rec]
            return out[::-1]

        paths = [[path(i, rec) for rec in f[i]] if g is not None else [] for i, g in enumerate(grammars)]
    masks = torch.full((r, width, bitmask_words(vocab_size)), ALL, dtype=torch.int32)
    for i, g in enumerate(grammars):
        if g is not None:
            masks[i] = g.masks(paths[i])[0]
    return allowed_tokens(masks.to(device), vocab_size)


def restrict(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A drafter's logits [..., Vd] as fp32 with -inf where `allowed` [..., Vd] is False; a row that allows none
    of the drafter's tokens keeps them all (its drafts are then never accepted)."""
    logits = logits.float()
    return torch.where(allowed.any(dim=-1, keepdim=True), logits.masked_fill(~allowed, float("-inf")), logits)
