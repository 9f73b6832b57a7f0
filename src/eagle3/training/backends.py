"""Answering prompts for `eagle3 regenerate`: an HF model in this process (`LocalBackend`) or any
OpenAI-compatible server (`EndpointBackend`, with retries and clear errors). `regenerate.py` drives them."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from eagle3.attention import varying_shape_attention
from eagle3.config import ConfigError
from eagle3.serving.tools import hermes_messages, parser_for, takes_tools, template_source
from eagle3.training.data import PLAIN

log = logging.getLogger("eagle3")

try:  # POSIX advisory lock: two runs must not append to the same output
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

Message = dict[str, str]

ENGINES = ("auto", "hf", "fast")


# ------------------------------------------------------------------------------------------------
# Backends
# ------------------------------------------------------------------------------------------------


@dataclass
class Generation:
    """One answer. finish_reason: "stop" (end of turn), "length" (hit max_new_tokens),
    "prompt_too_long" (not generated) or "error" (see `error`)."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str = "stop"
    error: str | None = None
    reasoning: str | None = None  # a server's separate `reasoning_content`, kept in the output turn
    # the calls of a backend that reads them itself (a server's `message.tool_calls`), as rows hold them:
    # {"id", "type": "function", "function": {"name", "arguments": dict}}; None: any calls are in `text`
    tool_calls: list[dict] | None = None


class Prompt(list):
    """Chat messages (tool calls and results in the OpenAI shape, arguments as objects) with the tools offered
    to the target. Given to a backend whose `takes_tools` is true; other backends get plain Hermes-layout lists."""

    def __init__(self, messages: Sequence[dict] = (), tools: Sequence[dict] = ()):
        super().__init__(messages)
        self.tools = list(tools)


class Backend(Protocol):
    """Answers a list of chat prompts; one Generation per prompt, in order. Never raises for one bad prompt."""

    def generate(
        self, prompts: list[list[Message]], temperature: float, max_new_tokens: int, batch_size: int
    ) -> list[Generation]: ...

    def describe(self) -> str: ...


class LocalBackend:
    """An HF causal LM and its tokenizer: batched generation with the chat template.

    engine "hf": HF `generate`, left-padded batches of `batch_size`. engine "fast": continuous batching over
    `batch_size` rows on the static-cache path (`eagle3.fast.batched`, CUDA graphs on GPU; Llama/Mistral/Qwen
    families), several times the throughput of "hf" on a GPU; temperature sampling draws from the full softmax.
    "auto" (default) picks "fast" on CUDA where the model supports it, else "hf".

    Sampling knobs other than temperature (top_p, top_k, repetition_penalty) come from the model's
    `generation_config`, as vLLM applies a model's generation_config.json by default.
    `chat_template="plain"` (`raw_text`): no template, for a base model; a prompt is its messages' texts back to
    back, tokenised as a raw prompt (with the tokenizer's BOS), and the answer is the text that continues it.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_prompt_tokens: int | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        engine: str = "auto",
    ):
        import torch

        if engine not in ENGINES:
            raise ConfigError(f"engine={engine!r}: expected one of {ENGINES}")
        self.model = model.eval()
        self.engine = self._pick_engine(engine)
        self._fast = None  # BatchedGenerator, built on first use and rebuilt when the batch shape grows
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.raw_text = chat_template == PLAIN
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        source = "" if self.raw_text else template_source(tokenizer, chat_template)
        # a template with its own tool format (Llama 3.1, Qwen, Mistral) renders `tools=` and teaches its calls
        self.tool_parser = parser_for(source) if takes_tools(source) else None
        self.takes_tools = self.tool_parser is not None
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ConfigError(
                f"tokenizer {type(tokenizer).__name__} has no chat_template; regeneration must prompt the "
                "target exactly as it is served. Load the instruct model's tokenizer or pass chat_template=..."
            )
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ConfigError(
                f"max_prompt_tokens must be >= 1 (got {max_prompt_tokens}); use None for no limit"
            )
        self.max_prompt_tokens = max_prompt_tokens
        self.eos_ids = self._stop_ids(stop_token_ids)
        if not self.eos_ids:
            raise ConfigError(
                "no end-of-turn token found (tokenizer eos_token, generation_config.eos_token_id and the chat "
                "template are all silent); pass stop_token_ids=[...]"
            )
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        if seed is not None:
            torch.manual_seed(seed)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype: str = "auto",
        device: str | None = None,
        gguf_file: str | None = None,
        **kwargs: Any,
    ) -> LocalBackend:
        """Load model + tokenizer from a local directory (or a GGUF file inside it); kwargs go to __init__."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from eagle3.models import select_device

        extra = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(path, **extra)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
        model.to(select_device(device))
        return cls(model, tokenizer, **kwargs)

    def describe(self) -> str:
        name = getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__
        return f"local {name} on {self.model.device}, engine {self.engine} (stop ids {self.eos_ids})"

    def _pick_engine(self, engine: str) -> str:
        from eagle3.fast.families import fast_support

        reason = fast_support(self.model)
        if engine == "fast" and reason is not None:
            raise ConfigError(f"engine 'fast' is not available for this model: {reason}; use engine 'hf'")
        if engine == "auto":
            return "fast" if reason is None and self.model.device.type == "cuda" else "hf"
        return engine

    def window(self, batch_size: int) -> int:
        """Conversations the regenerate driver should keep in flight: continuous batching wants a deep queue."""
        return batch_size * (16 if self.engine == "fast" else 4)

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        """The prompt text; a `Prompt`'s tools go to a template that takes them (`tools=`), else into the
        messages in the Hermes layout."""
        if self.raw_text:
            return "".join(m["content"] for m in messages)
        kwargs = dict(self.chat_template_kwargs)
        if isinstance(messages, Prompt):
            if self.takes_tools:
                if messages.tools:
                    kwargs["tools"] = messages.tools
                messages = list(messages)
            else:
                messages = hermes_messages([dict(m) for m in messages], messages.tools)
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
            **kwargs,
        )

    def _stop_ids(self, extra: Sequence[int]) -> list[int]:
        """Tokenizer EOS + generation_config EOS ids + the template's end-of-turn token (e.g. <|im_end|>)."""
        ids = {int(i) for i in extra}
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, list | tuple) else [gen_eos]))
        end_of_turn = self._template_end_of_turn()
        if end_of_turn is not None:
            ids.add(end_of_turn)
        return sorted(ids)

    def _template_end_of_turn(self) -> int | None:
        """The special token a rendered assistant turn ends with, or None if the template shows none."""
        import jinja2

        sentinel = "Zqxjv"
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": sentinel}]
        try:
            text = self._render(msgs, add_generation_prompt=False)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError):
            return None
        if sentinel not in text:
            return None
        tail = text.split(sentinel, 1)[1].lstrip()
        ids = self.tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
        special = set(self.tokenizer.all_special_ids)
        special.update(i for i, tok in self.tokenizer.added_tokens_decoder.items() if tok.special)
        return ids[0] if ids and ids[0] in special else None

    def encode(self, messages: list[Message]) -> list[int]:
        """Prompt token ids: the chat template with the generation prompt (its BOS text included once); raw text
        with the tokenizer's own specials (BOS) under the plain template."""
        text = self._render(messages, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=self.raw_text)["input_ids"]
        if not ids and self.raw_text and self.tokenizer.bos_token_id is not None:
            ids = [self.tokenizer.bos_token_id]
        return ids

    def _decode(self, answer: list[int], prompt: list[int]) -> str:
        """An answer's text; under the plain template the exact continuation of the prompt's text (a tokenizer
        drops the leading space of text decoded on its own)."""
        if self.raw_text and prompt:
            head = self.tokenizer.decode(prompt, skip_special_tokens=True)
            full = self.tokenizer.decode(list(prompt) + list(answer), skip_special_tokens=True)
            if full.startswith(head):
                return full[len(head):]
        return self.tokenizer.decode(answer, skip_special_tokens=True)

    def _encode_checked(
        self, messages: list[Message], limit: int | None
    ) -> tuple[list[int], None] | tuple[None, Generation]:
        """Token ids of a prompt, or the failed Generation (template error, longer than `limit`)."""
        import jinja2

        try:
            ids = self.encode(messages)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            return None, Generation(finish_reason="error", error=f"chat template failed: {exc}")
        if limit is not None and len(ids) > limit:
            return None, Generation(
                finish_reason="prompt_too_long", error=f"prompt has {len(ids)} tokens > the limit {limit}"
            )
        return ids, None

    def generate(
        self, prompts: list[list[Message]], temperature: float, max_new_tokens: int, batch_size: int = 32
    ) -> list[Generation]:
        results: list[Generation | None] = [None] * len(prompts)
        encoded: list[tuple[int, list[int]]] = []
        for i, messages in enumerate(prompts):
            ids, failure = self._encode_checked(messages, self.max_prompt_tokens)
            if failure is not None:
                results[i] = failure
                continue
            encoded.append((i, ids))
        self._run(encoded, results, temperature, max_new_tokens, batch_size)
        return [
            r if r is not None else Generation(finish_reason="error", error="not generated") for r in results
        ]

    def complete(
        self, prefixes: list[list[int]], temperature: float, max_new_tokens: int, batch_size: int = 32
    ) -> list[Generation]:
        """Continue raw token prefixes (no chat template applied) until an end-of-turn token or
        `max_new_tokens`; one Generation per prefix, in order (`eagle3 synthesize` continues a user-turn header)."""
        results: list[Generation | None] = [None] * len(prefixes)
        self._run(list(enumerate(prefixes)), results, temperature, max_new_tokens, batch_size)
        return [r if r is not None else Generation(finish_reason="error", error="not generated") for r in results]

    def _run(self, encoded: list[tuple[int, list[int]]], results: list[Generation | None], temperature: float,
             max_new_tokens: int, batch_size: int) -> None:
        """Generate for (index, token ids) pairs into `results[index]` with this backend's engine."""
        if not encoded:
            return
        if self.engine == "fast":
            self._generate_fast(encoded, results, temperature, max_new_tokens, batch_size)
            return
        # Longest first: similar lengths share a batch (little padding), and an OOM shows up at once.
        encoded = sorted(encoded, key=lambda item: -len(item[1]))
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start : start + batch_size]
            for (i, _), gen in zip(
                chunk, self._generate_batch([ids for _, ids in chunk], temperature, max_new_tokens), strict=True
            ):
                results[i] = gen

    def _fast_generator(self, longest_prompt: int, max_new_tokens: int, rows: int) -> Any:
        """The continuous-batching generator, kept between calls while it is big enough."""
        from eagle3.fast.batched import BatchedGenerator

        need = max(longest_prompt, self.max_prompt_tokens or 0) + max_new_tokens  # one size for the whole run
        need = -(-need // 256) * 256
        gen = self._fast
        if gen is None or gen.rows != rows or gen.seq_len < need:
            self._fast = gen = None  # free the old cache before allocating the new one
            gen = self._fast = BatchedGenerator(self.model, rows=rows, max_seq_len=need)
        return gen

    def _to_generation(self, out: Any, prompt: list[int] = ()) -> Generation:
        stopped = out.finish_reason == "stop"
        return Generation(
            text=self._decode(out.tokens, list(prompt)),
            num_tokens=len(out.tokens) + stopped,  # the end-of-turn token counts, as in the hf engine
            finish_reason=out.finish_reason,
        )

    def _generate_fast(self, encoded, results, temperature: float, max_new_tokens: int, rows: int) -> None:
        gen = self._fast_generator(max(len(ids) for _, ids in encoded), max_new_tokens, rows)
        outs = gen.generate([ids for _, ids in encoded], max_new_tokens, self.eos_ids, temperature=temperature)
        for (i, ids), out in zip(encoded, outs, strict=True):
            results[i] = self._to_generation(out, ids)

    def answer_chains(
        self,
        prompts: list[list[Message]],
        on_answer: Callable[[int, Generation], list[Message] | None],
        temperature: float,
        max_new_tokens: int,
        batch_size: int = 32,
    ) -> None:
        """Answer chains of prompts where each next prompt needs the last answer (the turns of a conversation).

        Fast engine only. `prompts[k]` starts chain k; `on_answer(k, generation)` gets each answer of chain k as
        it finishes and returns the chain's next prompt, or None when the chain is over. A next prompt joins
        the same continuous batch at once, so conversations finish (and can be written) all through the run
        rather than after every conversation's first turn. A prompt that fails to encode or is too long is
        answered with the failed Generation, as in `generate`; a later turn may also exceed what the
        generator holds (its longest first prompt, or max_prompt_tokens, plus max_new_tokens).
        """
        if self.engine != "fast":
            raise ConfigError("answer_chains needs engine 'fast'; use generate() turn by turn")
        limit = self.max_prompt_tokens  # becomes what the generator holds once it exists

        def admit(k: int, messages: list[Message] | None) -> list[int] | None:
            while messages is not None:
                ids, failure = self._encode_checked(messages, limit)
                if failure is None:
                    return ids
                messages = on_answer(k, failure)
            return None

        chain_of: list[int] = []  # generator prompt index -> chain
        first: list[list[int]] = []
        prompt_of: list[list[int]] = []  # generator prompt index -> its token ids
        for k, messages in enumerate(prompts):
            ids = admit(k, messages)
            if ids is not None:
                chain_of.append(k)
                first.append(ids)
                prompt_of.append(ids)
        if not first:
            return
        gen = self._fast_generator(max(len(ids) for ids in first), max_new_tokens, batch_size)
        if limit is None:
            limit = gen.seq_len - max_new_tokens

        def done(i: int, out: Any) -> list[int] | None:
            k = chain_of[i]
            ids = admit(k, on_answer(k, self._to_generation(out, prompt_of[i])))
            if ids is not None:
                chain_of.append(k)
                prompt_of.append(ids)
            return ids

        gen.generate(first, max_new_tokens, self.eos_ids, temperature=temperature, on_done=done)

    def _generate_batch(
        self, batch: list[list[int]], temperature: float, max_new_tokens: int
    ) -> list[Generation]:
        import torch
        from transformers import GenerationConfig

        width = max(len(ids) for ids in batch)
        device = self.model.device
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        for row, ids in enumerate(batch):  # left padding: every prompt ends at column T-1
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        sample = temperature > 0
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else 1.0,
            num_beams=1,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        with torch.inference_mode(), varying_shape_attention(device):  # padded batches, a growing cache
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=config,
            )  # [B, T + n]
        stops = set(self.eos_ids)
        gens = []
        for prompt, row in zip(batch, out[:, width:].tolist(), strict=True):
            end = next((k for k, tok in enumerate(row) if tok in stops), None)
            answer = row if end is None else row[:end]
            gens.append(
                Generation(
                    text=self._decode(answer, prompt),
                    num_tokens=len(row) if end is None else end + 1,
                    finish_reason="length" if end is None else "stop",
                )
            )
        return gens
