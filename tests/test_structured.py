"""Constrained decoding (`eagle3.decoding.grammar`): JSON-schema answers, with speculation, on both backends.

- Verification's walk along the accepted path emits what constrained plain decoding emits, one mask per token;
  fast rows verifying trees that hold their next tokens emit eager plain cycles' tokens (captured on a GPU).
- Greedy and sampled constrained speculation (chain and tree, fast rows and HF rows) emit exactly the tokens of
  constrained plain decoding, which differ from unconstrained decoding (negative control).
- Sampled constrained answers follow the target's distribution restricted by the grammar: the frequencies of an
  enum's values over many seeds against the exact probabilities (summed over every tokenization the grammar
  allows), with negative controls (verification without the mask; another temperature).
- `eagle3 generate --json-schema` and its errors; SmolLM2 with the bundled drafter answers valid JSON (slow).

Run: pytest tests/test_structured.py -q
"""

from __future__ import annotations

import copy
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from eagle3.cli import main
from eagle3.config import DraftShape, SamplingConfig
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.grammar import (
    ALL,
    GrammarCompiler,
    GrammarError,
    allowed_tokens,
    engine_tokenizer_json,
    forced_path_masks,
    single_token,
    walk_tree,
)
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.fast import row_grammar
from eagle3.fast.engine import FastEngine
from eagle3.fast.graphs import StepRunner
from eagle3.fast.rows import FastRows
from eagle3.fast.target import FastTarget
from eagle3.runtime import encode_prompt, eos_token_ids, init_drafter
from eagle3.target import Target

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                           "pet": {"enum": ["cat", "dog", "bird"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
PETS = {"enum": ["cat", "dog", "bird"]}


@pytest.fixture(scope="module")
def setup(stories260k):
    model, tok = stories260k
    eos = eos_token_ids(model, tok)
    return model, tok, eos, GrammarCompiler.for_model(model, tok, eos), init_drafter(model, seed=0)


def scores(path: list[int], vocab: int = 512) -> torch.Tensor:
    """Made-up target logits [V] after a path (a fixed function of it)."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(hash(tuple(path)) % 2**31))


def masked_argmax(path: list[int], mask: torch.Tensor) -> int:
    allowed = allowed_tokens(mask, 512)
    return int(scores(path).masked_fill(~allowed, float("-inf")).argmax())


def test_the_walk_emits_what_constrained_plain_decoding_emits(setup):
    _, tok, _, gc, _ = setup
    start = tok.convert_tokens_to_ids(["<0x7B>", '"', "n", "am", "e", '"'])  # {"name"
    reference = gc.compile(PERSON)  # plain constrained decoding, one mask per token
    reference.consume(start)
    plain: list[int] = []
    for _ in range(8):
        reference.mask_into(mask := torch.empty(reference.words, dtype=torch.int32))
        plain.append(masked_argmax(plain, mask))
        reference.consume(plain[-1:])
    gen = torch.Generator().manual_seed(0)
    for depth in (0, 1, 3, 7):  # rows whose trees hold the first `depth` choices as a chain, among other nodes
        trees = []
        for _ in range(3):
            tokens, parents, right = [], [], -1  # `right`: the node holding the choices so far (-1: the root)

            def wrong(j: int) -> int:  # a token that is not the choice after j drafted tokens
                return next(t for t in torch.randint(3, 512, (8,), generator=gen).tolist() if t != plain[j])

            for j in range(depth):  # a wrong sibling with a child, then the right node
                tokens += [wrong(j), wrong(j), plain[j]]
                parents += [right, len(tokens) - 3, right]
                right = len(tokens) - 1
            tokens.append(wrong(depth))  # a wrong leaf under the last right node
            parents.append(right)
            trees.append((tokens, parents))
        grammars = [gc.compile(PERSON), None, gc.compile(PERSON)]
        for g in grammars[::2]:
            g.consume(start)
        calls: list[list[bool]] = []

        def choose(nodes, masks, walking, trees=trees, calls=calls):
            calls.append(list(walking))
            out = []
            for r, (node, mask) in enumerate(zip(nodes, masks, strict=True)):
                tokens, parents = trees[r]
                path, j = [], node - 1
                while j >= 0:
                    path.insert(0, tokens[j])
                    j = parents[j]
                out.append(masked_argmax(path, mask) if walking[r] else -1)
            return out

        steps = walk_tree(grammars, [t for t, _ in trees], [p for _, p in trees], choose)
        assert steps == depth + 1 == len(calls)  # one step per emitted token: the drafted ones and the last
        assert all(c == [True, False, True] for c in calls)  # the unconstrained row is not walked
        for g in grammars[::2]:  # each walking row's grammar consumed exactly the tokens plain decoding emits
            check = gc.compile(PERSON)
            check.consume([*start, *plain[: depth + 1]])
            assert torch.equal(g.masks([[]])[0], check.masks([[]])[0])


def test_the_walk_keeps_unmasked_choices_the_grammar_allows(setup):
    """Where the target's unmasked choice at a node is allowed, the walk takes it without asking `choose`; where it
    is refused, `choose` gives the masked choice. Either way the rows emit constrained plain decoding's tokens."""
    _, tok, _, gc, _ = setup
    start = tok.convert_tokens_to_ids(["<0x7B>", '"', "n", "am", "e", '"'])  # {"name"
    reference = gc.compile(PERSON)
    reference.consume(start)
    plain: list[int] = []
    refused: list[int] = []  # a token the grammar refuses before each of plain's tokens
    for _ in range(8):
        reference.mask_into(mask := torch.empty(reference.words, dtype=torch.int32))
        plain.append(masked_argmax(plain, mask))
        refused.append(int((~allowed_tokens(mask, 512)).nonzero()[0, 0]))
        reference.consume(plain[-1:])
    tokens, parents = plain[:6], list(range(-1, 5))  # a chain of the first six choices
    for unmasked_right in ([True] * 7, [False] * 7, [True, False, True, True, False, False, True]):
        top = [plain[j] if right else refused[j] for j, right in enumerate(unmasked_right)]
        grammars = [gc.compile(PERSON), None]
        grammars[0].consume(start)
        asked: list[int] = []

        def choose(nodes, masks, walking, asked=asked):
            asked.append(nodes[0])
            assert walking == [True, False]
            path = plain[: nodes[0]]
            return [masked_argmax(path, masks[0]), -1]

        calls = walk_tree(grammars, [tokens, [-1] * 6], [parents, [-1] * 6], choose, top=[top, [0] * 7])
        assert asked == [j for j, right in enumerate(unmasked_right) if not right] and calls == len(asked)
        check = gc.compile(PERSON)
        check.consume([*start, *plain[:7]])
        assert torch.equal(grammars[0].masks([[]])[0], check.masks([[]])[0])


def test_single_token_reads_the_one_allowed_token_from_the_words():
    for token in (0, 5, 31, 32, 63, 511, 49151):  # bit 31: a negative int32 word
        mask = torch.zeros(1536, dtype=torch.int32)
        mask.view(-1)[token // 32] = torch.tensor(1 << (token % 32)).to(torch.int32)
        assert single_token(mask) == token == int(allowed_tokens(mask, 49152).nonzero()[0, 0])
        other = mask.clone()
        other[(token // 32 + 1) % 1536] = 1  # a second token in another word
        assert single_token(other) is None
        same = mask.clone()
        same[token // 32] |= 1 << ((token + 1) % 32)  # a second token in the same word
        assert single_token(same) is None
    assert single_token(torch.zeros(16, dtype=torch.int32)) is None
    assert single_token(torch.full((16,), ALL, dtype=torch.int32)) is None


def test_forced_path_masks_follow_the_tokens_the_grammar_forces(setup):
    """At every state of a constrained answer, the masks captured drafting gets: level 0 the next-token mask; while
    a level allows one token, the next level is the mask after it (checked on a fresh matcher that consumed the same
    tokens); past the first level that allows several, everything. Some state must have a forced chain two deep."""
    _, _, _, gc, _ = setup
    g, emitted, deep = gc.compile(PERSON), [], 0
    while not g.done and len(emitted) < 60:
        levels = forced_path_masks([g], 1, 4, g.words)[0]  # [D, W]
        fresh = gc.compile(PERSON)
        fresh.consume(emitted)
        free = False
        for level in levels:
            if free:
                assert (level == ALL).all()
                continue
            mask = torch.empty(g.words, dtype=torch.int32)
            fresh.mask_into(mask)
            assert torch.equal(level, mask)
            allowed = allowed_tokens(level, g.words * 32)
            free = int(allowed.sum()) != 1 or fresh.done
            if not free:
                fresh.consume([int(allowed.nonzero()[0, 0])])
        deep += not (levels[2] == ALL).all()
        mask = levels[0]
        emitted.append(masked_argmax(emitted, mask))
        g.consume(emitted[-1:])
    assert deep > 0


def test_grammar_refuses_tokens_and_ends_only_when_complete(setup):
    _, tok, eos, gc, _ = setup
    g = gc.compile(PETS)
    quote = tok.convert_tokens_to_ids(['"'])
    word = tok.convert_tokens_to_ids(['"', "c", "at", '"'])
    masks, ok = g.masks([word, quote, [*quote, 0]])
    assert ok == [True, True, False]
    ends = allowed_tokens(masks[:2], 512)[:, eos[0]]
    assert ends.tolist() == [True, False]  # the end token after the whole answer only, not inside the string
    with pytest.raises(RuntimeError, match="refused"):
        g.consume(tok.convert_tokens_to_ids(["c", "ow"]))
    with pytest.raises(GrammarError, match="Invalid type"):
        gc.compile({"type": "strin"})


def test_matchers_of_one_schema_are_independent_copies(setup):
    _, tok, _, gc, _ = setup
    a, b = gc.compile(PETS), gc.compile(PETS)
    start = b.masks([[]])[0]
    a.consume(tok.convert_tokens_to_ids(['"', "c"]))
    assert torch.equal(b.masks([[]])[0], start) and not torch.equal(a.masks([[]])[0], start)
    assert torch.equal(gc.compile(PETS).masks([[]])[0], start)  # a new copy starts fresh


def constrained_engines(setup, backend: str, shape: DraftShape | None):
    model, tok, _, _, d = setup
    if backend == "fast":
        return FastEngine(model, draft="none" if shape is None else "eagle3", spec=shape,
                          drafter=None if shape is None else d, tokenizer=tok)
    proposer = NoDraftProposer() if shape is None else Eagle3Proposer(d, shape)
    return SpeculativeEngine(Target(model, [] if shape is None else d.config.aux_layer_ids), proposer, tok)


@pytest.mark.parametrize("backend", ["fast", "hf"])
@pytest.mark.parametrize("shape", [DraftShape.chain(4), DraftShape(3, 3, 8)], ids=["chain", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_speculation_emits_what_constrained_plain_decoding_emits(setup, backend, shape, temperature):
    _, tok, eos, gc, _ = setup
    ids = encode_prompt(tok, prompt="Once upon a time")
    sampling = SamplingConfig(temperature=temperature, seed=11)

    def run(s, schema=PERSON):
        return constrained_engines(setup, backend, s).generate(
            ids, max_new_tokens=60, sampling=sampling, eos_token_ids=eos,
            **({"grammar": gc.compile(schema)} if schema is not None else {}))

    plain, spec = run(None), run(shape)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.tau > 1.0  # drafts were accepted: forced tokens at least
    check = gc.compile(PERSON)
    check.consume(plain.token_ids)  # every token is one the grammar allows (raises otherwise)
    assert run(None, schema=None).token_ids != plain.token_ids  # the mask changed the answer


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_constrained_rows_verify_trees_along_the_walk(setup, device):
    """Two constrained rows (greedy, sampled) beside an unconstrained one verify trees that hold their next tokens
    (host trees): every row emits what eager plain cycles emit, several tokens a cycle. On a GPU the constrained
    pieces are captured when first used, while the unconstrained row is mid-answer (its state kept around the
    warm-up cycles), and replayed."""
    model, tok, _, gc, _ = setup
    if device == "cuda":
        model = copy.deepcopy(model).cuda()
    prompt = encode_prompt(tok, prompt="Once upon a time")
    settings = [None, None, SamplingConfig(1.0, seed=3)]
    ref_rows = FastRows(FastTarget(model), None, capacity=4, seq_len=256, graphs=False)
    ref = [[f] for f in ref_rows.add_many([prompt] * 3, sampling=settings,
                                          grammars=[None, gc.compile(PERSON), gc.compile(PERSON)])]
    for _ in range(40):
        for o, new in zip(ref, ref_rows.cycle(False), strict=True):
            o += new
    rows = FastRows(FastTarget(model), None, capacity=4, seq_len=256, host_nodes=8, graphs=device == "cuda")
    rows.prepare()
    out = [[rows.add(prompt)]]

    def cycle(spec: bool) -> None:
        for i, o in enumerate(out):  # a wrong child of the root, and the next three tokens as a chain
            nxt = ref[i][len(o) : len(o) + 3]
            rows.load_tree(i, [(nxt[0] + 1) % 512, *nxt], [-1, -1, 1, 2])
        for o, new in zip(out, rows.cycle(spec), strict=True):
            o += new

    cycle(True)
    cycle(False)
    out += [[f] for f in rows.add_many([prompt] * 2, sampling=settings[1:],
                                       grammars=[gc.compile(PERSON) for _ in range(2)])]
    cycles = 0
    while min(len(o) for o in out) < 30:
        cycle(cycles % 3 != 2)
        cycles += 1
    assert [o[:30] for o in out] == [r[:30] for r in ref]
    assert cycles < 12  # drafted tokens were accepted under the grammars
    pieces = [k for k in rows._runners if isinstance(k[0], str)]
    assert {k[0] for k in pieces} == set(row_grammar.GRAMMAR_PIECES)
    if device == "cuda":
        assert all(rows._runners[k].graph is not None for k in pieces)


@pytest.mark.parametrize("shape", [DraftShape.chain(4), DraftShape(3, 3, 8)], ids=["chain", "tree"])
def test_capture_warm_ups_leave_the_rows_as_they_were(setup, shape, monkeypatch):
    """Constrained pieces are captured mid-answer, and a capture first runs its piece twice for real (warm-up):
    what those cycles do (advance the rows, move the tree's K/V into place) must be undone. Simulated on the CPU
    (each runner's warm-up without the capture, drafting as where it is captured): the rows emit what eager
    cycles emit. (With `compile_drafting=True` as on a GPU it passes too, in minutes of compilation.)"""
    model, tok, _, gc, d = setup
    prompt = encode_prompt(tok, prompt="Once upon a time")
    settings = [None, None, SamplingConfig(1.0, seed=3)]
    outs = []
    for warm in (False, True):
        rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=4, seq_len=256,
                        shapes=lambda _b: shape, graphs=False)
        if warm:
            monkeypatch.setattr(StepRunner, "prepare", StepRunner._warm)
            rows.graphs = True  # bucketed rows, captured drafting, state kept around warm-ups
        rows.prepare()
        out = [[rows.add(prompt)]]
        for k in range(3):  # the unconstrained row alone, then two constrained rows join
            out[0] += rows.cycle(k != 1)[0]
        out += [[f] for f in rows.add_many([prompt] * 2, sampling=settings[1:],
                                           grammars=[gc.compile(PERSON) for _ in range(2)])]
        for k in range(14):
            for o, new in zip(out, rows.cycle(k % 4 != 3), strict=True):
                o += new
        outs.append([o[:17] for o in out])
        monkeypatch.undo()
    assert outs[1] == outs[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_constrained_cycles_with_a_drafter_decode_as_eager_ones(setup):
    """On a GPU, constrained rows with an EAGLE-3 drafter (greedy and sampled, chain and tree, beside an
    unconstrained row): captured pieces give the tokens eager cycles give on the same GPU."""
    model, tok, _, gc, d = setup
    model, d = copy.deepcopy(model).cuda(), copy.deepcopy(d).cuda()
    prompt = encode_prompt(tok, prompt="Once upon a time")
    settings = [None, None, SamplingConfig(1.0, seed=3)]
    for shape in (DraftShape.chain(4), DraftShape(3, 3, 8)):
        outs = []
        for graphs in (False, True):
            rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=4, seq_len=256,
                            shapes=lambda _b, s=shape: s, graphs=graphs)
            rows.prepare()
            out = [[f] for f in rows.add_many([prompt] * 3, sampling=settings,
                                              grammars=[None, gc.compile(PERSON), gc.compile(PERSON)])]
            for k in range(16):
                for o, new in zip(out, rows.cycle(k % 4 != 3), strict=True):
                    o += new
            outs.append([o[:17] for o in out])  # 16 cycles: at least 17 tokens each
        assert outs[1] == outs[0]
        for o in outs[1][1:]:
            gc.compile(PERSON).consume(o)  # the answers follow the grammar (raises otherwise)


def exact_enum_distribution(model, tok, eos, gc, prompt: list[int], temperature: float) -> dict[str, float]:
    """P(answer) of constrained sampling at `temperature`, summed over every token path the grammar allows to
    the end token (a depth-first walk with the target's masked distribution at each step)."""
    out: dict[str, float] = {}
    g = gc.compile(PETS)

    def walk(path: list[int], p: float) -> None:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + path])).logits[0, -1].float()  # [V]
        allowed = allowed_tokens(g.masks([path])[0][0], logits.shape[-1])  # [V]
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")) / temperature, dim=-1)
        for t in torch.nonzero(probs > 0).flatten().tolist():
            q = p * float(probs[t])
            if t in eos:
                text = tok.decode(path)
                out[text] = out.get(text, 0.0) + q
            elif q > 1e-7:
                walk([*path, t], q)

    walk([], 1.0)
    return out


def sample_enum(setup, prompt: list[int], n: int, temperature: float) -> dict[str, int]:
    """Answers of n sampled rows (seeds 0..n-1) decoded together with a random drafter's trees."""
    model, tok, eos, gc, d = setup
    rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=64, seq_len=128,
                    shapes=lambda _b: DraftShape(3, 3, 8), graphs=False)
    counts: dict[str, int] = {}
    for lo in range(0, n, 64):
        seeds = range(lo, min(lo + 64, n))
        out = [[x] for x in rows.add_many([prompt] * len(seeds),
                                          sampling=[SamplingConfig(temperature=temperature, seed=s) for s in seeds],
                                          grammars=[gc.compile(PETS) for _ in seeds])]
        while not all(o[-1] in eos for o in out):
            for o, new in zip(out, rows.cycle(True), strict=True):
                if o[-1] not in eos:
                    o += new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))]
        for o in out:
            text = tok.decode(o[:-1])
            counts[text] = counts.get(text, 0) + 1
        rows.clear()
    return counts


def chi_square_p(counts: dict[str, int], probs: dict[str, float]) -> float:
    """The p-value of Pearson's test of `counts` against `probs` (an answer `probs` does not have: 0)."""
    if set(counts) - set(probs):
        return 0.0
    n = sum(counts.values())
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())
    k = len(probs) - 1  # the chi-square survival function for k degrees of freedom (k = 2 here: closed form)
    assert k == 2
    return math.exp(-stat / 2)


N_DRAWS = 1536


def test_sampled_constrained_answers_follow_the_masked_target(setup, monkeypatch):
    model, tok, eos, gc, _ = setup
    prompt = encode_prompt(tok, prompt="Tom had a pet. It was a")
    exact = exact_enum_distribution(model, tok, eos, gc, prompt, 1.0)
    assert len(exact) == 3 and min(exact.values()) > 0.02 and abs(sum(exact.values()) - 1) < 1e-3
    counts = sample_enum(setup, prompt, N_DRAWS, 1.0)
    assert chi_square_p(counts, exact) > 1e-3, (counts, exact)
    # negative controls: another temperature; verification that ignores the grammar
    assert chi_square_p(sample_enum(setup, prompt, N_DRAWS, 0.6), exact) < 1e-3
    real = row_grammar.allowed_tokens
    monkeypatch.setattr(row_grammar, "allowed_tokens", lambda words, v: torch.ones_like(real(words, v)))
    with pytest.raises(RuntimeError, match="refused"):  # an answer the grammar refuses
        sample_enum(setup, prompt, 256, 1.0)


def test_generate_json_schema_flag_and_its_errors(tmp_path, capsys):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert main(["generate", "--target", "stories260k", "--prompt", "Once upon a time", "--json-schema",
                 str(schema), "--max-new-tokens", "24", "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert text.startswith("{")
    for content, message in [('{"type": "strin"}', "Invalid type"), ("[1", "is not JSON"),
                             ("[1]", "must be a JSON object")]:
        schema.write_text(content)
        assert main(["generate", "--target", "stories260k", "--prompt", "x", "--json-schema", str(schema)]) == 2
        assert "eagle3: error: " in (err := capsys.readouterr().err) and message in err
    assert main(["generate", "--target", "stories260k", "--prompt", "x", "--json-schema", str(tmp_path / "no")]) == 2
    assert "cannot read it" in capsys.readouterr().err


@pytest.mark.slow
def test_a_byte_level_vocabulary_flagged_byte_fallback_is_read_as_byte_level(smollm2, stories260k):
    import llguidance

    _, tok = smollm2
    ours = tok.backend_tokenizer.to_str()
    assert engine_tokenizer_json(ours) == ours  # read right as it is
    sp = stories260k[1].backend_tokenizer.to_str()
    assert engine_tokenizer_json(sp) == sp  # a SentencePiece vocabulary with byte fallback: as it is
    config = json.loads(ours)  # as transformers 5.17 converts SmolLM2's GGUF
    config["model"]["byte_fallback"] = True
    config["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    ids = tok.encode(' Info {"', add_special_tokens=False)

    def spelled(text: str) -> list[bytes]:
        return [llguidance.LLTokenizer(text, n_vocab=len(tok), eos_token=[2]).decode_bytes([i]) for i in ids]

    assert spelled(json.dumps(config))[0] == "\u0120Info".encode()  # the engine misreads it (negative control)
    assert spelled(engine_tokenizer_json(json.dumps(config))) == [b" Info", b' {"']


@pytest.mark.slow
def test_smollm2_answers_valid_json_with_the_bundled_drafter(smollm2, capsys, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    answers = {}
    for draft in (["--draft", "none"], ["--chain", "4"], ["--tree", "3,4,12"]):
        assert main(["generate", "--target", "smollm2", "--drafter", "src/eagle3/assets/smollm2-drafter", *draft,
                     "--chat", "Describe a person named Alice, aged 31, who lives in Paris, as JSON.",
                     "--json-schema", str(path), "--json", "--max-new-tokens", "64"]) == 0
        answers[draft[-1]] = json.loads(capsys.readouterr().out)
    for a in answers.values():
        jsonschema.validate(json.loads(a["text"]), schema)
        assert a["token_ids"] == answers["none"]["token_ids"]
    assert answers["4"]["tau"] > 2.0


# -- the server: response_format ----------------------------------------------------------------
def chat_answer(setup, messages: list[dict], schema: dict, max_tokens: int) -> str:
    """The single-request constrained greedy answer (generic engine, no drafts) to a chat under the test
    server's template."""
    from test_serving import TEMPLATE

    model, tok, eos, gc, _ = setup
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    engine = SpeculativeEngine(Target(model, []), NoDraftProposer(), tok)
    try:
        return engine.generate(ids, max_new_tokens=max_tokens, eos_token_ids=eos, grammar=gc.compile(schema)).text
    finally:
        engine.target.close()


@pytest.mark.parametrize("rows", [True, False], ids=["fast-rows", "hf-rows"])
def test_server_response_format_answers_equal_the_single_request(setup, stories260k, rows):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_serving import MODEL, PROMPTS, make_server

    jobs = [([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], i % 2 == 0) for i in range(16)]
    want = {p[0]["content"]: chat_answer(setup, p, PERSON, 40) for p, _ in jobs[:len(PROMPTS)]}
    srv = make_server(*stories260k, rows=rows, max_batch_size=16)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

        def one(job):
            messages, stream = job
            if stream:
                chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                        response_format=fmt, stream=True))
                return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                          response_format=fmt)
            return r.choices[0].message.content

        with ThreadPoolExecutor(16) as pool:  # 16 concurrent clients, streamed and not
            answers = list(pool.map(one, jobs, timeout=240))
        for (messages, _), text in zip(jobs, answers, strict=True):
            assert text == want[messages[0]["content"]]
        # json_object: any JSON object; a sampled request's tokens all follow the grammar too
        r = c.chat.completions.create(model=MODEL, messages=jobs[0][0], max_tokens=30, temperature=1.0, seed=3,
                                      response_format={"type": "json_object"})
        assert r.choices[0].message.content.lstrip().startswith("{")
        if rows:
            assert srv.app.state.scheduler.fast_rows.spec_cycles > 0
    finally:
        srv.stop()


def test_server_refuses_bad_response_formats(stories260k):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_serving import MODEL, make_server

    msgs = [{"role": "user", "content": "Hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        ({"type": "xml"}, {}, "response_format.type"),
        ({"type": "json_schema"}, {}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}, {},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}, {},
         "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": []}}, {}, "response_format.json_schema.schema"),
        ({"type": "json_object", "json_schema": {}}, {}, "response_format.json_schema"),
        ({"type": "json_object"}, {"tools": [tool], "tool_choice": "required"}, "response_format"),
    ]
    srv = make_server(*stories260k, spec=False)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for fmt, extra, param in cases:
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt, **extra)
            assert e.value.body["param"] == param, fmt
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, response_format={"type": "text"})
        assert r.choices[0].finish_reason == "length"
    finally:
        srv.stop()


def test_a_schema_the_engine_refuses_at_admission_fails_that_request_only(stories260k, monkeypatch):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_serving import MODEL, make_server

    real = GrammarCompiler.compile_text

    def compile_text(self, text):
        if '"title":"refused"' in text.replace(" ", ""):
            raise GrammarError("refused for this tokenizer")
        return real(self, text)

    monkeypatch.setattr(GrammarCompiler, "compile_text", compile_text)
    srv = make_server(*stories260k, spec=False)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Hi"}]
        with pytest.raises(openai.BadRequestError, match="refused for this tokenizer"):
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, response_format={
                "type": "json_schema", "json_schema": {"name": "p", "schema": {**PETS, "title": "refused"}}})
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": PETS}})
        assert r.choices[0].message.content.lstrip().startswith('"')
    finally:
        srv.stop()


# -- forced tool calls ---------------------------------------------------------------------------
GO = [{"type": "function", "function": {"name": "go", "parameters": {
    "type": "object", "properties": {"u": {"enum": ["c", "f"]}}, "required": ["u"]}}}]


def forced_call(setup, tools: list[dict], choice: str, parallel: bool, template: str, max_new_tokens: int):
    """A call forced by `choice` ("required" or "function": go), rendered with `template` and answered by the tiny
    model greedily under its grammar: (ToolCalls, the answer). Each token follows the grammar, while the free
    answer to the same prompt is refused by it (a negative control)."""
    from eagle3.serving.tools import render

    model, tok, eos, gc, _ = setup
    messages = [{"role": "user", "content": "Once upon a time"}]
    text, calls = render(tok, messages, tools, choice, "go" if choice == "function" else None, parallel, template)
    assert calls.grammar is not None and text.endswith(calls.prefix)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    engine = SpeculativeEngine(Target(model, []), NoDraftProposer(), tok)
    try:
        want = engine.generate(ids, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                               grammar=gc.compile_text(calls.grammar))
        free = engine.generate(ids, max_new_tokens=40, eos_token_ids=eos)
    finally:
        engine.target.close()
    gc.compile_text(calls.grammar).consume(want.token_ids)  # raises on a token the grammar refuses
    with pytest.raises(RuntimeError, match="refused"):
        gc.compile_text(calls.grammar).consume(free.token_ids)
    return calls, want


@pytest.mark.parametrize("choice", ["required", "function"])
def test_a_forced_tool_call_is_constrained_to_the_functions_schema(setup, stories260k, choice):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_serving import MODEL, TEMPLATE, make_server

    calls, want = forced_call(setup, GO, choice, True, TEMPLATE, 40)
    srv = make_server(*stories260k, rows=True)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        tool_choice = {"type": "function", "function": {"name": "go"}} if choice == "function" else "required"
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}],
                                      tools=GO, tool_choice=tool_choice, max_tokens=40, temperature=0)
        assert r.choices[0].message.content == calls.prefix + want.text  # cut by max_tokens: returned as text
    finally:
        srv.stop()


LLAMA3 = ('{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}Respond in the format {"name": function '
          'name, "parameters": dictionary}. {{ tools | tojson }}\nassistant:')
MISTRAL = ("[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% for m in messages %}[INST]{{ m.content }}"
           "[/INST]{% endfor %} Calls follow [TOOL_CALLS].")


@pytest.mark.parametrize("template", [LLAMA3, MISTRAL], ids=["llama3", "mistral"])
@pytest.mark.parametrize("choice", ["required", "function"])
def test_forced_calls_in_the_llama3_and_mistral_formats_are_constrained(setup, template, choice):
    tools = [{"type": "function", "function": {"name": "go", "parameters": {
        **GO[0]["function"]["parameters"], "additionalProperties": False}}}]  # an answer that must end soon
    calls, want = forced_call(setup, tools, choice, False, template, 480)
    assert calls.parser.name == ("llama3" if template == LLAMA3 else "mistral")
    assert want.finish_reason == "stop"  # one call, then the grammar allows only the end
    content, found = calls.parse(want.text)
    assert content is None and len(found) == 1 and calls.errors == 0
    assert found[0]["function"]["name"] == "go" and json.loads(found[0]["function"]["arguments"])["u"] in "cf"


@pytest.mark.slow
def test_smollm2_forced_tool_calls_are_valid_calls(smollm2):
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("fastapi")
    from eagle3.serving.app import create_app
    from eagle3.serving.config import ServeConfig
    from eagle3.serving.server import ServerThread, build_scheduler

    model, tok = smollm2
    params = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "description": "Time in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    sched = build_scheduler(Target(model, []), tok, eos_token_ids(model, tok), None, None,
                            ServeConfig(model_name="smollm2"))
    with ServerThread(create_app(sched)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = c.chat.completions.create(model="smollm2", messages=messages, tools=tools, tool_choice=choice,
                                          max_tokens=64, temperature=0)
            assert r.choices[0].finish_reason == "tool_calls"
            call = r.choices[0].message.tool_calls[0].function
            schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), schema)
