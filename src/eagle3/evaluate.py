"""`eagle3 eval`: acceptance (tau and per-position) of a drafter on benchmark prompts, with the chat template.

The bundled sets are the EAGLE-3 paper's evaluation prompts (SafeAILab/EAGLE `eagle/data/*/question.jsonl`,
Apache-2.0): mt_bench, humaneval, gsm8k, alpaca, sum (CNN/DM), qa (Natural Questions). Any JSONL whose rows
have `turns` (first turn used), `prompt`, `question`, `text` or OpenAI `messages` works too, and a `.txt` file
(one prompt per blank-line-separated block). A target without a chat template (a base model) gets each prompt
as raw text; `eagle3 eval --chat-template plain` does that for any target.

Tool calls: `bfcl` (opt-in, not among the defaults; needs the bfcl-eval wheel, see `eagle3.bfcl`) is 80 BFCL
prompts with the functions they offer, and a JSONL row with `messages` may carry `tools` too. Such a prompt
(`Prompt.tools`) is rendered as the server renders a chat request with tools (`eagle3.serving.tools.render`):
by the template with `tools=` where it takes them, else in the Hermes layout; a target without a chat template
gets the Hermes turns' texts as a raw prompt.

tau is aggregated over all cycles of a run (tokens emitted / target verification forwards, bonus included);
per-position acceptance is aggregated the same way (see eagle3.decoding.engine). Each run also keeps one row per
prompt (tokens, cycles, tau) and, where the rows name a `category` (MT-bench's writing, roleplay, reasoning, math,
coding, extraction, stem, humanities), tau per category: where a drafter is weak, and what data it lacks.
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from tqdm import tqdm

from eagle3.config import ConfigError, DraftShape, SamplingConfig

BENCH_SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
TOOL_SETS = ("bfcl", "bfcl_json")  # opt-in: read from an optional wheel (eagle3.bfcl)


class Prompt(list):
    """A prompt's messages (a list of dicts), the tools offered with them (`tools`, OpenAI function tools), and
    the JSON schema its answer is constrained to (`schema`; None: free text)."""

    def __init__(self, messages: list[dict], tools: list[dict] | None = None, schema: dict | None = None):
        super().__init__(messages)
        self.tools = list(tools or [])
        self.schema = schema


def bench_path(name: str) -> Path:
    """The bundled set `name` (one of BENCH_SETS), stored gzipped as `<name>.jsonl.gz`."""
    return Path(str(resources.files("eagle3") / "assets" / "bench" / f"{name}.jsonl.gz"))


def load_prompts(name_or_path: str, limit: int | None = None) -> tuple[str, list[list[dict]]]:
    """(dataset name, list of chat message lists) from a bundled set name (BENCH_SETS, or the opt-in TOOL_SETS)
    or a JSONL path (`.jsonl` or gzipped `.jsonl.gz`); a prompt offered tools is a `Prompt` carrying them."""
    name, prompts, _ = load_prompt_rows(name_or_path, limit)
    return name, prompts


def load_prompt_rows(name_or_path: str, limit: int | None = None) -> tuple[str, list[list[dict]], list[str | None]]:
    """`load_prompts` and each row's `category` (None where it has none)."""
    if name_or_path == "bfcl_json":
        from eagle3.bfcl import bfcl_json_prompts

        rows = bfcl_json_prompts(limit)
        return name_or_path, [Prompt(m, schema=schema) for m, schema in rows], [None] * len(rows)
    if name_or_path in TOOL_SETS:
        from eagle3.bfcl import bfcl_prompts

        rows = bfcl_prompts(limit)
        return name_or_path, [Prompt(m, tools) for m, tools, _ in rows], [category for _, _, category in rows]
    path = bench_path(name_or_path) if name_or_path in BENCH_SETS else Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"no benchmark set or file {name_or_path!r}; bundled sets: {', '.join(BENCH_SETS)}; "
                          f"opt-in: {', '.join(TOOL_SETS)}")
    out: list[list[dict]] = []
    categories: list[str | None] = []
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1) if path.suffix.lower() != ".txt" else _text_blocks(path):
            if isinstance(line, str) and not line.strip():
                continue
            try:
                row = json.loads(line) if isinstance(line, str) else line
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if "messages" in row:
                asked = [m for m in row["messages"] if m.get("role") not in ("assistant", "tool")][:2]
                msgs = Prompt(asked, _tools(row, path, lineno))
            elif "conversations" in row:  # ShareGPT rows (e.g. `eagle3 synthesize` output): the first human turn
                text = next((t.get("value") for t in row["conversations"] if isinstance(t, dict)
                             and t.get("from") in ("human", "user")), None)
                if not isinstance(text, str) or not text.strip():
                    raise ConfigError(f"{path}:{lineno}: 'conversations' holds no human turn with text")
                msgs = [{"role": "user", "content": text}]
            else:
                text = (row.get("turns") or [None])[0] or row.get("prompt") or row.get("question") or row.get("text")
                if not isinstance(text, str) or not text.strip():
                    raise ConfigError(f"{path}:{lineno}: needs 'turns', 'prompt', 'question', 'text', 'messages' or "
                                      f"'conversations'; found fields {', '.join(row)}")
                msgs = [{"role": "user", "content": text}]
            out.append(msgs)
            category = row.get("category")
            categories.append(str(category) if category is not None else None)
            if limit and len(out) >= limit:
                break
    if not out:
        raise ConfigError(f"{path}: no prompts in it")
    name = name_or_path if name_or_path in BENCH_SETS else Path(path.name.removesuffix(".gz")).stem
    return name, out, categories


def _tools(row: dict, path: Path, lineno: int) -> list[dict]:
    from eagle3.training.data import BadRow, conversation_tools

    try:
        return conversation_tools(row)
    except BadRow as e:
        raise ConfigError(f"{path}:{lineno}: {e.detail}") from None


def encode_prompt_messages(tokenizer, messages: list[dict]) -> list[int]:
    """A prompt's token ids (`runtime.encode_messages`), with its tools (`Prompt.tools`) rendered as the server
    renders them; for a target without a chat template, the Hermes turns' texts back to back as a raw prompt."""
    from eagle3.runtime import encode_messages, encode_prompt
    from eagle3.serving.tools import hermes_messages, render

    tools = getattr(messages, "tools", None)
    if not tools:
        return encode_messages(tokenizer, messages)
    if getattr(tokenizer, "chat_template", None):
        text, _ = render(tokenizer, list(messages), tools)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own BOS
    return encode_prompt(tokenizer, prompt="\n\n".join(m["content"] for m in hermes_messages(list(messages), tools)))


def _text_blocks(path: Path):
    """(block number, {"text": block}) for each blank-line-separated block of a `.txt` file."""
    from eagle3.training.data import _iter_text_blocks

    return enumerate(_iter_text_blocks(path), 1)


@dataclass
class RunResult:
    dataset: str
    method: str  # e.g. "eagle3-tree-6,10,60" or "ngram-chain-5"
    temperature: float
    prompts: int = 0
    new_tokens: int = 0
    cycles: int = 0
    accepted: list[int] = field(default_factory=list)  # per position: cycles with >= i+1 accepted
    tried: list[int] = field(default_factory=list)  # per position: cycles that drafted depth >= i+1
    seconds: float = 0.0
    new_tokens_in_cycles: int = 0  # tokens emitted by verification cycles (the prefill token excluded)
    per_prompt: list[dict] = field(default_factory=list)  # {"new_tokens", "cycles", "cycle_tokens", "tau"[,
    # "category"][, "valid"]} per prompt; cycle_tokens: emitted by its cycles (tau = cycle_tokens / cycles)
    constrained: int = 0  # prompts answered under a JSON schema
    valid: int = 0  # of those, answers that ended and are JSON valid under the schema (`valid_answer`)

    @property
    def tau(self) -> float:
        return self.new_tokens_in_cycles / self.cycles if self.cycles else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted, self.tried, strict=True)]

    def add(self, st, category: str | None = None, valid: bool | None = None) -> None:
        """Count one generation's `GenerationStats`: its tokens, cycles and per-position acceptance; `valid`:
        whether a constrained answer is valid (None: not constrained)."""
        self.prompts += 1
        if valid is not None:
            self.constrained += 1
            self.valid += valid
        self.new_tokens += st.new_tokens
        self.cycles += st.cycles
        in_cycles = sum(st.accepted_per_cycle) + st.cycles
        self.new_tokens_in_cycles += in_cycles
        row = {"new_tokens": st.new_tokens, "cycles": st.cycles, "cycle_tokens": in_cycles,
               "tau": round(in_cycles / st.cycles, 4) if st.cycles else 0.0}
        row = row if category is None else {**row, "category": category}
        self.per_prompt.append(row if valid is None else {**row, "valid": valid})
        depth = max(st.drafted_depth_per_cycle, default=0)
        if len(self.accepted) < depth:
            self.accepted += [0] * (depth - len(self.accepted))
            self.tried += [0] * (depth - len(self.tried))
        for a, d in zip(st.accepted_per_cycle, st.drafted_depth_per_cycle, strict=True):
            for j in range(d):
                self.tried[j] += 1
                self.accepted[j] += a > j

    def to_dict(self) -> dict:
        by_category = self.tau_by_category
        return {"dataset": self.dataset, "method": self.method, "temperature": self.temperature,
                "prompts": self.prompts, "new_tokens": self.new_tokens, "cycles": self.cycles,
                "tau": round(self.tau, 4), "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
                "tokens_per_s": round(self.new_tokens / self.seconds, 2) if self.seconds else 0.0,
                "seconds": round(self.seconds, 2), **({"tau_by_category": by_category} if by_category else {}),
                **({"valid_json": self.valid, "constrained": self.constrained} if self.constrained else {}),
                "per_prompt": self.per_prompt}

    @property
    def tau_by_category(self) -> dict[str, float]:
        """tau over each category's cycles (as the run's tau over all of them), in first-seen order."""
        sums: dict[str, list[int]] = {}
        for row in self.per_prompt:
            if "category" in row:
                s = sums.setdefault(row["category"], [0, 0])
                s[0] += row["cycle_tokens"]
                s[1] += row["cycles"]
        return {c: round(t / n, 4) if n else 0.0 for c, (t, n) in sums.items()}


def method_name(draft: str, spec: DraftShape) -> str:
    if draft == "none":
        return "none"
    return f"{draft}-chain-{spec.depth}" if spec.is_chain else f"{draft}-tree-{spec.text}"


def run_dataset(rt, dataset: str, prompts: list[list[dict]], sampling: SamplingConfig, max_new_tokens: int,
                progress: bool = True, categories: list[str | None] | None = None) -> RunResult:
    res = RunResult(dataset=dataset, method=method_name(rt.draft, rt.spec), temperature=sampling.temperature)
    grammars = None
    if any(getattr(p, "schema", None) is not None for p in prompts):
        from eagle3.decoding.grammar import GrammarCompiler

        grammars = GrammarCompiler.for_model(rt.model, rt.tokenizer, rt.eos_token_ids)
    t0 = time.perf_counter()
    for i, msgs in enumerate(tqdm(prompts, desc=f"{dataset} {res.method} T={sampling.temperature}",
                                  disable=not progress, leave=False)):
        ids = encode_prompt_messages(rt.tokenizer, msgs)
        s = SamplingConfig(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           seed=None if sampling.seed is None else sampling.seed + i)
        schema = getattr(msgs, "schema", None)
        grammar = {"grammar": grammars.compile(schema)} if schema is not None else {}
        out = rt.engine.generate(ids, max_new_tokens=max_new_tokens, sampling=s, eos_token_ids=rt.eos_token_ids,
                                 **grammar)
        res.add(out.stats, categories[i] if categories else None,
                valid_answer(out, schema) if schema is not None else None)
    res.seconds = time.perf_counter() - t0
    return res


def valid_answer(out, schema: dict) -> bool:
    """Whether a constrained answer ended (not cut by max_new_tokens) and is JSON valid under `schema` (checked
    with `jsonschema` where it is installed, else only parsed)."""
    if out.finish_reason != "stop":
        return False
    try:
        value = json.loads(out.text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def plot_report(report: dict, png: str | Path) -> Path | None:
    """Per-position acceptance per dataset, one panel per method and temperature. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = report["runs"]
    keys = sorted({(r["method"], r["temperature"]) for r in runs})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (method, temp) in zip(axes[0], keys, strict=True):
        for r in runs:
            if (r["method"], r["temperature"]) == (method, temp) and r["acceptance_per_position"]:
                xs = range(1, len(r["acceptance_per_position"]) + 1)
                ax.plot(xs, r["acceptance_per_position"], marker="o", label=f"{r['dataset']} (tau {r['tau']:.2f})")
        ax.set_title(f"{method}, T={temp}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
