"""Assemble a ready-to-run decoder from names: target, drafter, draft kind, spec. Shared by CLI, eval,
benchmarks and the server, so they all take the same defaults."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eagle3.config import DEFAULT_CHAIN_LENGTH, ConfigError, DrafterConfig, DraftShape
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import ModelProposer, NgramProposer, NoDraftProposer, Proposer
from eagle3.defaults import Decoding, load_for_decoding
from eagle3.drafter import Eagle3Drafter
from eagle3.target import Target

log = logging.getLogger("eagle3")

DRAFT_KINDS = ("eagle3", "ngram", "model", "mtp", "none")


@dataclass
class Runtime:
    model: torch.nn.Module
    tokenizer: object
    target: Target
    engine: SpeculativeEngine
    drafter: Eagle3Drafter | None
    spec: DraftShape
    draft: str
    decoding: Decoding | None = None  # set by `decoder`

    def __post_init__(self) -> None:
        import weakref

        self.engine_spec = self.spec  # the shape `engine`'s proposer drafts
        self._fast_target = None
        self._fast_drafters = weakref.WeakSet()  # of the fast engines `decoder` built: `reload_drafter` updates them
        self._guards = weakref.WeakSet()  # of the engines `decoder` built: a reloaded drafter is judged afresh

    def fast_target(self):
        """The one `FastTarget` (fused weights, static caches) every fast engine of this runtime shares."""
        if self._fast_target is None:
            from eagle3.fast.target import FastTarget

            self._fast_target = FastTarget(self.model, self.drafter.config.aux_layer_ids if self.drafter else [])
        return self._fast_target

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.model, self.tokenizer)

    def reload_target(self, state_dict: dict) -> None:
        """Load new target weights (an RL policy's, after an update) into the running decoders: the model takes
        them in place (`load_state_dict`, strict), and the shared `FastTarget` rewrites its fused copies, so
        engines built before, and their captured graphs, decode with the new policy."""
        try:
            self.model.load_state_dict(state_dict, strict=True)
        except RuntimeError as e:
            raise ConfigError(f"these weights do not fit the target: {str(e).splitlines()[0]}") from None
        if self._fast_target is not None:
            self._fast_target.reload_weights()


    @torch.no_grad()
    def reload_drafter(self, path: str | Path) -> None:
        """Load the drafter saved at `path` (e.g. `eagle3.adapt.adapt`'s output after a policy step) into the
        running decoders in place: the fast engines `decoder` built write its weights into their own tensors
        (`FastDrafter.load_weights`: their captured graphs stay valid), and `drafter`, which the generic engines
        read, takes them too. It must have the current drafter's aux layers and shapes (as `adapt` keeps them)."""
        if self.drafter is None:
            raise ConfigError("this runtime has no EAGLE-3 drafter to reload; build it with a drafter")
        new = drafter_for(self.model, path)
        mine, theirs = self.drafter.state_dict(), new.state_dict()
        if sorted(new.config.aux_layer_ids) != sorted(self.drafter.config.aux_layer_ids) or mine.keys() != theirs.keys() \
                or any(mine[k].shape != theirs[k].shape for k in mine):
            raise ConfigError(f"{path}: its aux layers or shapes differ from the running drafter's; load it with "
                              "load_runtime instead")
        if not torch.equal(new.embed_tokens.weight, self.drafter.embed_tokens.weight):  # the target's: never written
            raise ConfigError(f"{path}: it embeds tokens with other weights than the running drafter")
        from eagle3.fast.drafter import load_in_place

        why = load_in_place(list(self._fast_drafters), new)
        if why is not None:
            raise ConfigError(f"{path}: {why}; load it with load_runtime instead")
        self.drafter.load_state_dict(theirs)
        for guards in self._guards:
            guards.reset()


def eos_token_ids(model, tokenizer) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        e = getattr(src, "eos_token_id", None)
        if e is None:
            continue
        ids.update([e] if isinstance(e, int) else list(e))
    return sorted(ids)


def encode_prompt(tokenizer, prompt: str | None = None, chat: str | list[dict] | None = None) -> list[int]:
    """Token ids for a raw prompt (with the tokenizer's BOS) or a chat turn rendered by the chat template."""
    if (prompt is None) == (chat is None):
        raise ValueError("give exactly one of prompt or chat")
    if chat is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("this target's tokenizer has no chat template; use --prompt instead of --chat")
        messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else chat
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # the template writes its own BOS, if any
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id]
    return ids


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """A benchmark row's token ids: rendered by the chat template where the tokenizer has one, else (a base model)
    its last user message as a raw prompt."""
    if getattr(tokenizer, "chat_template", None):
        return encode_prompt(tokenizer, chat=messages)
    return encode_prompt(tokenizer, prompt=messages[-1]["content"])


def make_proposer(draft: str, spec: DraftShape, drafter: Eagle3Drafter | None, device,
                  draft_model=None, target_model=None, target_source=None) -> Proposer:
    if draft == "none":
        return NoDraftProposer(device)
    if draft == "mtp":  # the target's own MTP layer; its Target must tap aux id L (eagle3.decoding.mtp)
        if target_model is None:
            raise ConfigError("--draft mtp needs the target model (its MTP weights are part of the target)")
        from eagle3.decoding.mtp import mtp_proposer

        return mtp_proposer(target_model, spec, target_source)
    if draft == "model":
        if draft_model is None:
            raise ConfigError("--draft model needs --draft-model PATH (a causal LM with the target's tokenizer)")
        return ModelProposer(draft_model, spec.depth)
    if draft == "ngram":
        return NgramProposer(length=spec.depth, device=device)
    if draft == "eagle3":
        if drafter is None:
            raise ConfigError("--draft eagle3 needs --drafter DIR (a drafter checkpoint)")
        return Eagle3Proposer(drafter, spec)
    raise ConfigError(f"unknown draft kind {draft!r}; expected one of {DRAFT_KINDS}")


def load_runtime(
    target: str,
    drafter: str | Path | None = None,
    draft: str | None = None,
    spec: DraftShape | None = None,
    device: str | None = None,
    dtype: str = "auto",
    draft_model: str | None = None,
    engine: str = "auto",
) -> Runtime:
    """`engine`: the engine the caller will ask `decoder` for ("auto", "fast", "generic"), which the "auto" dtype
    depends on (`decoding_dtype`)."""
    from eagle3.models import load_target

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    draft = draft or ("eagle3" if drafter else "model" if draft_model else "none")
    from eagle3.fast.engine import FAST_DRAFT_KINDS

    # the device's decoding dtype, which depends on the family and the engine (`decoding_dtype`)
    model, tokenizer = load_for_decoding(target, device, dtype, engine if draft in FAST_DRAFT_KINDS else "generic")
    tcfg = getattr(model.config, "text_config", None) or model.config
    d = None
    if draft == "eagle3":
        if drafter is None:
            raise ConfigError("--draft eagle3 needs --drafter DIR")
        d = drafter_for(model, drafter)
        aux_ids = d.config.aux_layer_ids
    elif draft == "mtp":  # the MTP layer reads the final hidden state: the input of the final norm
        from eagle3.decoding.mtp import mtp_aux_id

        aux_ids = [mtp_aux_id(model)]
    else:
        aux_ids = []
    tgt = Target(model, aux_ids)
    if spec is None:  # the default draft shape; a hybrid target verifies chains only
        spec = DraftShape.chain(DEFAULT_CHAIN_LENGTH) if tgt.recurrent_layers else DraftShape()
    if d is None and draft == "eagle3":
        raise ConfigError("no drafter loaded")
    if tgt.recurrent_layers and draft in ("eagle3", "mtp") and not spec.is_chain:  # other drafts propose chains
        raise ConfigError(tgt.tree_refusal)
    dm = None
    if draft == "model":
        if not draft_model:
            raise ConfigError("--draft model needs --draft-model PATH")
        # the target itself is the always-right drafter (a correctness check); any same-tokenizer LM works
        dm = model if draft_model == target else load_target(draft_model, dtype=dtype, device=device)[0]
        if dm.config.vocab_size != tcfg.vocab_size:
            raise ConfigError(f"draft model vocab_size={dm.config.vocab_size} differs from the target's "
                              f"vocab_size={tcfg.vocab_size}; a draft model must share the target's tokenizer")
    proposer = make_proposer(draft, spec, d, device, draft_model=dm, target_model=model,
                             target_source=target if Path(str(target)).expanduser().is_dir() else None)
    log.debug("target %s (%d layers), draft=%s, spec=%s", target, tcfg.num_hidden_layers, draft, spec)
    return Runtime(model=model, tokenizer=tokenizer, target=tgt,
                   engine=SpeculativeEngine(tgt, proposer, tokenizer), drafter=d, spec=spec, draft=draft)


def decoder(rt: Runtime, decoding: Decoding, options=None):
    """The engine that decodes as `decoding` says: a `FastEngine` (with `options`, an `eagle3.fast.FastOptions`)
    or the generic engine; `rt.spec` and `rt.decoding` become what it runs."""
    from eagle3.fast.engine import FastEngine, FastOptions

    draft = rt.draft if decoding.speculate else "none"
    rt.spec, rt.decoding = decoding.shape, decoding
    if decoding.engine == "fast":
        on = decoding.speculate
        options = replace(options or FastOptions(), chain_stop=decoding.chain_stop if on else None,
                          guard=decoding.guard and on)
        engine = FastEngine(rt.model, draft=draft, spec=decoding.shape, drafter=rt.drafter, tokenizer=rt.tokenizer,
                            options=options, target=rt.fast_target())
        if engine.drafter is not None:
            rt._fast_drafters.add(engine.drafter)
    else:
        proposer = rt.engine.proposer
        if draft == "none" or decoding.shape != rt.engine_spec:
            device = next(rt.model.parameters()).device
            proposer = make_proposer(draft, decoding.shape, rt.drafter, device,
                                     draft_model=getattr(proposer, "model", None), target_model=rt.model)
        engine = SpeculativeEngine(rt.target, proposer, rt.tokenizer, guard=decoding.guard)
    rt._guards.add(engine.guards)
    return engine


def drafter_for(model, path: str | Path | None) -> Eagle3Drafter:
    """The drafter saved at `path`, checked against `model` and placed like it (the target's embedding, device and
    dtype); `path` None gives a random one (smoke tests and benchmarks of the machinery)."""
    param = next(model.parameters())
    if path is None:
        return init_drafter(model, seed=0).to(device=param.device, dtype=param.dtype).eval()
    from eagle3.formats import load_drafter

    return load_drafter(path, target_config=model.config, target_embedding=model.get_input_embeddings().weight,
                        device=param.device, dtype=param.dtype)


def init_drafter(model, draft_vocab_size: int | None = None, seed: int = 0, draft_ids: torch.Tensor | None = None,
                 **overrides) -> Eagle3Drafter:
    """A randomly initialised drafter shaped for `model`, with the target's embedding and the draft vocabulary
    `draft_ids` (ascending target ids), else an identity prefix (the first `draft_vocab_size` ids; None: all)."""
    torch.manual_seed(seed)
    if draft_ids is not None:
        draft_vocab_size = draft_ids.numel()
    cfg = DrafterConfig.for_target(model.config, draft_vocab_size=draft_vocab_size, **overrides)
    d = Eagle3Drafter(cfg)
    d.load_target_embedding(model.get_input_embeddings().weight.detach().float().cpu())
    if cfg.uses_draft_vocab:
        d.set_vocab_mapping(draft_ids if draft_ids is not None else torch.arange(cfg.draft_vocab_size))
    return d
