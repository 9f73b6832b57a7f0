"""Synthesize user prompts with the target itself, for targets without enough prompts of their own.

An instruction-tuned model continues its chat template's user-turn header with something a user would ask: give
it the rendered template up to where a user's message starts, sample until its end-of-turn token, and the text
is a new prompt (the Magpie recipe: Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting
Aligned LLMs with Nothing"). `eagle3 regenerate` then answers the prompts with the same target. A drafter misses
most at the start of answers (docs/training.md), and every prompt brings one more answer start.

Output: JSONL rows in ShareGPT form, `{"id", "conversations": [{"from": "human", "value": prompt}]}`, which
`regenerate` and `prepare` read. Kept prompts are unique (after folding case and whitespace), non-empty, at
least `min_chars` long, and finished (a prompt cut at `max_new_tokens` is dropped: its question may be missing).
Rerunning the same command resumes: rows already in the file stay and count towards `count`.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.config import ConfigError
from eagle3.training.backends import LocalBackend
from eagle3.training.prepare import write_json_atomic

SENTINEL = "Zqxjv"  # a string no template contains, marking where the user's message would start
# rounds in a row that keep nothing new before the run stops (the model keeps repeating prompts it already wrote)
MAX_BARREN_ROUNDS = 3


def user_turn_prefix(tokenizer: Any, system: str | None = None, chat_template: str | None = None) -> str:
    """The chat template rendered up to where a user's first message starts (with `system` as the system prompt,
    or the template's own default). Raises ConfigError for a tokenizer without a chat template."""
    import jinja2

    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the target's tokenizer has no chat template; synthesize continues a chat template's "
                          "user turn (pass one with chat_template=...)")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             chat_template=chat_template)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise ConfigError(f"the chat template failed on a system prompt and one user message: {exc}") from exc
    if SENTINEL not in text:
        raise ConfigError("the chat template does not show the user's message; cannot find where a user turn starts")
    return text.split(SENTINEL, 1)[0]


def _key(text: str) -> str:
    return " ".join(text.lower().split())


@dataclass
class SynthesizeReport:
    out: str
    backend: str
    requested: int
    temperature: float
    max_new_tokens: int
    system: str | None
    prefix: str
    resumed: int = 0  # prompts already in the file
    generated: int = 0  # samples drawn by this run
    kept: int = 0  # written by this run
    dropped: dict[str, int] = field(default_factory=dict)  # cut_at_limit, empty, too_short, duplicate, error
    rounds: int = 0
    stopped_early: str | None = None  # why the run ended before `requested` rows existed
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        return (f"synthesize: {self.resumed + self.kept} prompts in {self.out} ({self.kept} new from "
                f"{self.generated} samples in {self.seconds:.0f} s; dropped: {drops})"
                + (f"; stopped early: {self.stopped_early}" if self.stopped_early else ""))


def _existing(out: Path) -> tuple[int, set[str]]:
    """(rows, their prompt keys) already in `out`; a torn last line (an interrupted write) is cut off."""
    if not out.exists():
        return 0, set()
    keys: set[str] = set()
    rows = good = 0  # complete lines, and their bytes
    with open(out, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                row = json.loads(line)
                keys.add(_key(row["conversations"][0]["value"]))
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
                raise ConfigError(f"{out} holds a line that is not a synthesized prompt ({exc}); "
                                  "write to a new file") from exc
            rows, good = rows + 1, good + len(line)
    if good < out.stat().st_size:
        with open(out, "r+b") as f:
            f.truncate(good)
    return rows, keys


def synthesize(
    backend: LocalBackend,
    count: int,
    out_path: str | os.PathLike,
    *,
    system: str | None = None,
    temperature: float = 1.0,
    max_new_tokens: int = 128,
    batch_size: int = 64,
    min_chars: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> SynthesizeReport:
    """Write `count` unique prompts written by the backend's model to `out_path` (see the module docstring)."""
    if count < 1:
        raise ConfigError(f"count must be >= 1 (got {count})")
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0 (got {temperature}): greedy decoding writes one prompt only")
    if max_new_tokens < 1 or batch_size < 1:
        raise ConfigError(f"max_new_tokens and batch_size must be >= 1 (got {max_new_tokens}, {batch_size})")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = user_turn_prefix(backend.tokenizer, system, backend.chat_template)
    prefix_ids = backend.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    have, seen = _existing(out)
    report = SynthesizeReport(out=str(out), backend=backend.describe(), requested=count, temperature=temperature,
                              max_new_tokens=max_new_tokens, system=system, prefix=prefix, resumed=have)
    dropped: Counter[str] = Counter()
    from tqdm import tqdm

    bar = tqdm(total=count, initial=min(have, count), unit="prompt", desc="synthesize", disable=not progress,
               dynamic_ncols=True)
    start, barren = time.perf_counter(), 0
    try:
        with open(out, "a", encoding="utf-8") as f:
            while have < count:
                # a fresh stream per round, fixed by the seed and the progress so far: a resumed run goes on
                # differently from the rounds it already wrote
                torch.manual_seed(random.Random(f"{seed}:{have}:{report.rounds}").getrandbits(63))
                n = min(max(batch_size, 2 * (count - have)), 8 * batch_size)  # extra samples cover the drops
                gens = backend.complete([prefix_ids] * n, temperature, max_new_tokens, batch_size)
                report.rounds += 1
                report.generated += n
                new = 0
                for g in gens:
                    text = g.text.strip()
                    why = ("error" if g.finish_reason == "error" else "cut_at_limit" if g.finish_reason != "stop"
                           else "empty" if not text else "too_short" if len(text) < min_chars
                           else "duplicate" if _key(text) in seen else None)
                    if why is not None:
                        dropped[why] += 1
                        continue
                    if have >= count:
                        break
                    seen.add(_key(text))
                    row = {"id": f"synth-{seed}-{have}", "conversations": [{"from": "human", "value": text}]}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    have, new = have + 1, new + 1
                    bar.update(1)
                f.flush()
                report.kept += new
                barren = 0 if new else barren + 1
                if barren >= MAX_BARREN_ROUNDS:
                    report.stopped_early = (f"{MAX_BARREN_ROUNDS} rounds in a row kept no new prompt; raise "
                                            "--temperature or --max-new-tokens, or ask for fewer prompts")
                    break
    finally:
        bar.close()
        report.dropped = dict(dropped)
        report.seconds = time.perf_counter() - start
        write_json_atomic(report.to_dict(), str(out) + ".report.json")
        if progress:
            print(report.summary(), flush=True)
    return report
