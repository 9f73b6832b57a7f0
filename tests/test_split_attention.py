"""The split-KV attention kernel (`eagle3.fast.split_attention`) and the fast path's choice of target attention.

On a CPU the Triton kernels run in Triton's interpreter (`TRITON_INTERPRET=1`; fp32 and fp16, since the
interpreter's products do not take bf16), which checks their indexing and arithmetic: outputs against a direct
softmax attention for plain, chain and tree masks, one split and several; rows of a chain against one-token
calls, bit for bit; greedy decoding through the fast path with it against HF `generate`. On a GPU (marked
`gpu`): the compiled kernels in bf16, the chain rows' bits, and bf16 chains against plain decoding.
Skipped where Triton is not installed (it comes with PyTorch's CUDA wheels; the `test` extra installs it on
Linux x86-64).
Run: pytest tests/test_split_attention.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_target
from eagle3.config import ConfigError, DraftShape
from eagle3.fast import FastEngine, FastOptions
from eagle3.fast import split_attention as split
from eagle3.fast.attention import target_attention_for
from eagle3.runtime import init_drafter

pytest.importorskip("triton")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference(q, k, v, mask, scale):
    """Softmax attention in fp64 over the visible slots; q [nkv, g·T, hd] stacked -> [T, nh·hd]."""
    nkv, rows, hd = q.shape
    t = mask.shape[0]
    g = rows // t
    bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask.cpu(), float("-inf")).repeat(g, 1)
    w = torch.softmax(q.cpu().double() @ k.cpu().double().transpose(1, 2) * scale + bias, -1)
    o = w @ v.cpu().double()  # [nkv, g·T, hd]
    return o.reshape(nkv * g, t, hd).transpose(0, 1).reshape(t, -1)


def chain_mask(t: int, s: int, cached: int) -> torch.Tensor:
    """[T, S]: the cached prefix, then token i sees the chain's tokens 0..i."""
    ar = torch.arange(s)
    return (ar[None, :] < cached) | ((ar[None, :] >= cached) & (ar[None, :] <= cached + torch.arange(t)[:, None]))


def tree_mask(t: int, s: int, cached: int, g: torch.Generator) -> torch.Tensor:
    """[T, S]: the cached prefix, then each node sees a random set of earlier nodes and itself (a tree's ancestor
    sets are one such)."""
    mask = chain_mask(t, s, cached)
    mask[:, cached : cached + t] &= torch.rand(t, t, generator=g) < 0.5
    mask[torch.arange(t), cached + torch.arange(t)] = True
    return mask


def inputs(s, t, nkv, g, hd, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen).to(dtype).to(device)
               for shape in ((nkv, g * t, hd), (nkv, s, hd), (nkv, s, hd)))
    return q, k, v, gen


F32, F16 = torch.float32, torch.float16


def numpy_rows_alone() -> bool:
    """Whether this machine's numpy gives a row of an fp32 product the same bits wherever the row sits in its
    tile: the interpreter's `tl.dot` is `np.matmul`, and on some CPUs (this project's 2-core AMD EPYC, OpenBLAS)
    a [16, 64] x [64, 64] product rounds a row by its position, which a GPU's tensor cores do not."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 64), dtype=np.float32), rng.standard_normal((64, 64), dtype=np.float32)
    perm = rng.permutation(16)
    return bool(np.array_equal(np.matmul(a, b)[perm], np.matmul(a[perm], b)))


@pytest.mark.parametrize("s,t,nkv,g,hd,kind,dtype", [
    (100, 1, 3, 3, 64, "chain", F32),  # one split (<= 128 slots): the normalised output straight from the kernel
    (100, 1, 3, 3, 64, "chain", F16),
    (700, 1, 2, 4, 128, "chain", F32),  # a plain step over six splits
    (700, 6, 3, 3, 64, "chain", F16),
    (450, 20, 1, 2, 16, "tree", F32),
    (300, 61, 3, 3, 32, "tree", F16),  # 183 stacked rows: 12 row blocks
])
def test_split_attention_matches_softmax_attention(interpreted, s, t, nkv, g, hd, kind, dtype):
    q, k, v, gen = inputs(s, t, nkv, g, hd, dtype)
    cached = s - t - 9  # some slots at the end stay unseen by every row
    mask = chain_mask(t, s, cached) if kind == "chain" else tree_mask(t, s, cached, gen)
    out = split.split_attention(q, k, v, mask, hd**-0.5)
    assert out.shape == (t, nkv * g * hd) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, hd**-0.5), atol=tol, rtol=tol)
    # bounded by the forward's own slots (as FastTarget calls it): blocks past them are not walked, same bits
    slots = torch.arange(cached, cached + t).flip(0)  # any order: the bound is their maximum
    assert torch.equal(split.split_attention(q, k, v, mask, hd**-0.5, last=slots), out)


def test_bound_skips_the_blocks_past_it(interpreted):
    """A mask that breaks the bound's promise shows what is walked: the key blocks up to the one that holds slot
    max(last), in every split, and none after."""
    s, t, hd = 300, 2, 16
    q, k, v, _ = inputs(s, t, 1, 2, hd, F32, seed=3)
    mask = torch.ones(t, s, dtype=torch.bool)
    out = split.split_attention(q, k, v, mask, hd**-0.5, last=torch.tensor([70, 100]))
    cut = -(-101 // split.BLOCK_N) * split.BLOCK_N  # 128: slots 101..127 share a block with slot 100
    seen = torch.zeros(t, s, dtype=torch.bool)
    seen[:, :cut] = True
    torch.testing.assert_close(out.double(), reference(q, k, v, seen, hd**-0.5), atol=1e-5, rtol=1e-5)


def test_bound_is_checked(interpreted):
    q, k, v, _ = inputs(100, 2, 1, 2, 16, F32)
    mask = chain_mask(2, 100, 50)
    for bad in (torch.tensor([[51, 52]]), torch.tensor([51.0]), torch.arange(split.MAX_ROWS + 1)):
        with pytest.raises(ValueError, match="last must be an integer tensor"):
            split.split_attention(q, k, v, mask, 0.25, last=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chain_rows_keep_the_bits_of_one_token_calls(interpreted, dtype):
    """Row i of a chain's verification against a one-token call at the same place: the same bits (the slots are
    split the same way and the blocks only row i's neighbours see add exactly nothing to it)."""
    s, t, nkv, g, hd = 600, 5, 2, 3, 64
    q, k, v, _ = inputs(s, t, nkv, g, hd, dtype, seed=1)
    cached = 250
    rows = split.split_attention(q, k, v, chain_mask(t, s, cached), hd**-0.5,
                                 last=torch.arange(cached, cached + t))  # [T, nh·hd]
    for i in range(t):
        qi = q.view(nkv, g, t, hd)[:, :, i].contiguous()  # [nkv, g, hd]: token i's query heads
        one = split.split_attention(qi, k, v, chain_mask(t, s, cached)[i : i + 1], hd**-0.5,
                                    last=torch.tensor([cached + i]))  # walks fewer blocks than the chain
        if not numpy_rows_alone():  # numpy's rounding (fp16 products too), not the kernel's: the gpu test has bits
            tol = 1e-6 if dtype == F32 else 1e-3
            torch.testing.assert_close(rows[i : i + 1], one, atol=tol, rtol=tol)
        else:
            assert torch.equal(rows[i : i + 1], one), i


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """Parents of n nodes in N+1 indexing (node 0 the root, node i's parent before it): [N+1], root's is 0."""
    parents = [0] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n + 1)]
    return torch.tensor(parents)


def tree_paths(parents: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree verified at slots length + [0, N]: each node's position [N+1] and the slots of its path by position
    [N+1, D+1] (root first), as `Paths` takes them."""
    n1 = parents.shape[0]
    chains = []
    for i in range(n1):
        path = [i]
        while path[-1] != 0:
            path.append(int(parents[path[-1]]))
        chains.append(path[::-1])
    width = max(map(len, chains))
    tail = torch.tensor([[length + j for j in c] + [length] * (width - len(c)) for c in chains])
    pos = torch.tensor([length + len(c) - 1 for c in chains])
    return pos, tail


def paths_mask(pos, tail, length, s):
    """The slots each token sees under `Paths`, as a mask [T, S]."""
    mask = torch.zeros(pos.shape[0], s, dtype=torch.bool)
    mask[:, :length] = True
    for t in range(pos.shape[0]):
        mask[t, tail[t, : int(pos[t]) - length + 1]] = True
    return mask


@pytest.mark.parametrize("s,n,nkv,g,hd,dtype", [
    (100, 12, 3, 3, 64, F32),  # one split
    (700, 20, 2, 4, 32, F32),  # several splits
    (700, 30, 3, 3, 64, F16),
    (450, 8, 1, 20, 16, F32),  # 20 query heads per KV head: two tiles of a token's heads
    (145, 12, 2, 3, 32, F32),  # the prefix ends one slot before a split's end: paths run into the next split
])
def test_paths_match_softmax_attention_over_the_same_slots(interpreted, s, n, nkv, g, hd, dtype):
    gen = torch.Generator().manual_seed(n)
    length = s - n - 70
    pos, tail = tree_paths(random_tree(n, gen), length)
    q, k, v, _ = inputs(s, n + 1, nkv, g, hd, dtype, seed=n)
    out = split.split_attention(q, k, v, None, hd**-0.5, paths=split.Paths(torch.tensor([length]), tail, pos))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), reference(q, k, v, paths_mask(pos, tail, length, s), hd**-0.5),
                               atol=tol, rtol=tol)


def test_paths_window_and_padding(interpreted):
    """A sliding window counts positions, not slots; padding tokens (beyond `valid`) are not computed (zero)."""
    s, n, nkv, g, hd, window = 300, 10, 2, 3, 32, 40
    gen = torch.Generator().manual_seed(4)
    length = 150
    pos, tail = tree_paths(random_tree(n, gen), length)
    q, k, v, _ = inputs(s, n + 1, nkv, g, hd, F32, seed=4)
    paths = split.Paths(torch.tensor([length]), tail, pos, valid=n - 2)
    out = split.split_attention(q, k, v, None, hd**-0.5, paths=paths, window=window)
    mask = paths_mask(pos, tail, length, s)
    mask[:, :length] &= torch.arange(length)[None, :] > pos[:, None] - window  # the prefix: slot = position
    for t in range(n + 1):  # a path's slots are not its positions: window them by position
        for j, slot in enumerate(tail[t, : int(pos[t]) - length + 1].tolist()):
            mask[t, slot] = length + j > int(pos[t]) - window
    ref = reference(q, k, v, mask, hd**-0.5)
    torch.testing.assert_close(out[: n - 2].double(), ref[: n - 2], atol=1e-5, rtol=1e-5)
    assert not out[n - 2 :].any()


@pytest.mark.parametrize("dtype,length", [(torch.float32, 260), (torch.float16, 260),
                                          (torch.float32, 319)])  # 319: paths run from split 4 into split 5
def test_a_tree_node_keeps_the_bits_of_a_one_token_step_at_its_position(interpreted, dtype, length):
    """Walked by position, a node whose path sits at scattered slots attends exactly as a one-token step does
    with the same path laid out at the slots of its positions (what plain decoding's cache holds): the same
    blocks, splits and tiles, so the same bits, whatever else the forward holds."""
    s, n, nkv, g, hd = 600, 30, 2, 3, 64
    gen = torch.Generator().manual_seed(7)
    pos, tail = tree_paths(random_tree(n, gen), length)
    q, k, v, _ = inputs(s, n + 1, nkv, g, hd, dtype, seed=7)
    tree = split.split_attention(q, k, v, None, hd**-0.5, paths=split.Paths(torch.tensor([length]), tail, pos))
    for t in range(n + 1):
        depth = int(pos[t]) - length
        k1, v1 = k.clone(), v.clone()  # the cache plain decoding has: the path at its positions
        k1[:, length : length + depth + 1] = k[:, tail[t, : depth + 1]]
        v1[:, length : length + depth + 1] = v[:, tail[t, : depth + 1]]
        qt = q.view(nkv, g, n + 1, hd)[:, :, t].contiguous()  # [nkv, g, hd]
        p = torch.tensor([length + depth])
        one = split.split_attention(qt, k1, v1, None, hd**-0.5,
                                    paths=split.Paths(torch.tensor([length + depth]), p[:, None], p))
        assert torch.equal(tree[t : t + 1], one), t



@pytest.mark.parametrize("dtype", [F32, F16])
def test_rows_of_paths_keep_the_bits_of_each_row_alone(interpreted, dtype):
    """B rows, each over its own cache with its own prefix length and tree (`eagle3.fast.rows`), in one call: each
    row's output is the bits of that row attended alone, and matches softmax attention over its slots. The rows'
    prefixes end in different splits (one in the first, one on a split boundary, one near the end)."""
    s, n, nkv, g, hd = 600, 9, 2, 3, 32
    gen = torch.Generator().manual_seed(11)
    lengths = [40, 320, 520]
    qs, ks, vs, tails, poss = [], [], [], [], []
    for b, length in enumerate(lengths):
        pos, tail = tree_paths(random_tree(n, gen), length)
        q, k, v, _ = inputs(s, n + 1, nkv, g, hd, dtype, seed=20 + b)
        width = n + 1  # pad every row's tail to one width (past a node's depth its entries are never read)
        tail = torch.cat([tail, tail[:, :1].expand(-1, width - tail.shape[1])], dim=1)
        qs.append(q), ks.append(k), vs.append(v), tails.append(tail), poss.append(pos)
    paths = split.Paths(torch.tensor(lengths), torch.stack(tails), torch.stack(poss))
    out = split.split_attention(torch.stack(qs), torch.stack(ks), torch.stack(vs), None, hd**-0.5, paths=paths)
    assert out.shape == (3, n + 1, nkv * g * hd)
    tol = 1e-5 if dtype == F32 else 2e-3
    for b, length in enumerate(lengths):
        alone = split.split_attention(qs[b], ks[b], vs[b], None, hd**-0.5,
                                      paths=split.Paths(torch.tensor([length]), tails[b], poss[b]))
        assert torch.equal(out[b], alone), b
        ref = reference(qs[b], ks[b], vs[b], paths_mask(poss[b], tails[b], length, s), hd**-0.5)
        torch.testing.assert_close(out[b].double(), ref, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="needs paths"):
        split.split_attention(torch.stack(qs), torch.stack(ks), torch.stack(vs), torch.ones(n + 1, s, dtype=torch.bool),
                              hd**-0.5)
    with pytest.raises(ValueError, match="length \\[B\\]"):
        split.split_attention(torch.stack(qs), torch.stack(ks), torch.stack(vs), None, hd**-0.5,
                              paths=paths._replace(length=torch.tensor([40])))


def test_path_slots_are_each_nodes_path_by_depth():
    """`eagle3.decoding.tree.path_slots` (what the fast path's verifications hand the kernel) against the paths
    walked node by node, for one tree and for a batch of trees with their own first slots."""
    from eagle3.decoding.tree import ancestry, path_slots

    gen = torch.Generator().manual_seed(3)
    trees = [random_tree(12, gen) for _ in range(3)]
    depth = 12
    for parents, first in zip(trees, (5, 70, 300), strict=True):
        _, want = tree_paths(parents, first)
        got = path_slots(ancestry(parents, depth), torch.tensor([first]), depth)  # [N+1, D+1]
        assert torch.equal(got[:, : want.shape[1]], want)
        assert (got[:, want.shape[1] :] == first).all()
    parents1 = torch.stack(trees)
    got = path_slots(ancestry(parents1, depth), torch.tensor([5, 70, 300]), depth)  # [3, N+1, D+1]
    for b, (parents, first) in enumerate(zip(trees, (5, 70, 300), strict=True)):
        _, want = tree_paths(parents, first)
        assert torch.equal(got[b, :, : want.shape[1]], want)


@pytest.mark.parametrize("arch,window", [("llama", None), ("mistral", 24)])
def test_fast_rows_attending_by_position_match_hf_generate(interpreted, arch, window):
    """The server's rows (`eagle3.fast.rows.FastRows`) with every decoding forward attending by the kernel by
    position (`Paths` with a row axis), as on CUDA: rows of different lengths joining and leaving, plain and tree
    cycles mixed, each row HF `generate`'s greedy tokens. Head size 16, 160 slots per row: three splits. With a
    sliding window of 24 positions, the longer prompts reach past it."""
    from eagle3.fast import FastTarget
    from eagle3.fast.rows import FastRows

    extra = {} if window is None else {"sliding_window": window}
    model = build_tiny_target(arch, num_hidden_layers=3, **extra)
    d = init_drafter(model, draft_vocab_size=200, seed=1)
    target = FastTarget(model, d.config.aux_layer_ids)
    target.attention = "split"  # on a CPU only through the interpreter
    shape = DraftShape(3, 2, 6)
    rows = FastRows(target, d, capacity=4, seq_len=160, shapes=lambda b: shape, graphs=False, sampling=False)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (11, 62, 5, 100)]
    budget = [8, 5, 9, 5]
    refs = [model.generate(torch.tensor([p]), max_new_tokens=m, do_sample=False, min_new_tokens=m)[0, len(p):].tolist()
            for p, m in zip(prompts, budget, strict=True)]
    outs = {i: [f] for i, f in enumerate(rows.add_many(prompts[:3]))}
    owner = [0, 1, 2]
    cycle = 0
    while owner:
        for j, new in enumerate(rows.cycle(spec=cycle % 3 != 1)):
            outs[owner[j]] += new
        for j in reversed(range(len(owner))):
            if len(outs[owner[j]]) >= budget[owner[j]]:
                rows.remove(j)
                owner[j] = owner[-1]
                owner.pop()
        if cycle == 1:  # the fourth request joins while the others decode
            outs[3] = rows.add_many([prompts[3]])
            owner.append(3)
        cycle += 1
    assert rows.spec_cycles >= 2
    for i, ref in enumerate(refs):
        assert outs[i][: budget[i]] == ref, i

def test_rows_draft_by_position_as_by_mask(interpreted):
    """Where the rows' target attends by the split kernel, their drafter does too (`FastDrafter.forward_rows` with
    paths: the committed rows, then each frontier row's path through the scratch rows). It drafts the trees the
    mask attention drafts, for rows of different lengths, cycle after cycle (fp32)."""
    from eagle3.decoding.sampling import GREEDY
    from eagle3.fast import FastTarget
    from eagle3.fast.rows import FastRows

    model = build_tiny_target("llama", num_hidden_layers=3)
    d = init_drafter(model, draft_vocab_size=200, seed=1)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (9, 40, 23)]
    trees = []
    for by_paths in (True, False):
        target = FastTarget(model, d.config.aux_layer_ids)
        target.attention = "split"  # on a CPU only through the interpreter
        rows = FastRows(target, d, capacity=4, seq_len=128, shapes=lambda b: DraftShape(4, 3, 9), graphs=False,
                        sampling=False)
        assert (rows.d.paths_op is not None) is True
        if not by_paths:
            rows.d.paths_op = None  # the mask attention of other devices
        rows.add_many(prompts)
        drafted = []
        for _ in range(4):
            drafted.append([t.clone() for t in rows._draft(rows.bucket(rows.n), GREEDY)])
            rows.cycle(spec=True)
        trees.append(drafted)
    for (tok_a, par_a), (tok_b, par_b) in zip(*trees, strict=True):
        assert torch.equal(tok_a, tok_b) and torch.equal(par_a, par_b)


def test_split_size_depends_on_the_cache_only():
    blocks = split.MIN_SPLIT_BLOCKS
    assert split.split_size(1) == split.split_size(blocks * split.BLOCK_N) == blocks * split.BLOCK_N
    assert split.split_size(64 * 64 * max(blocks, 2)) == 64 * max(blocks, 2)
    assert split.split_size(64 * 64 * max(blocks, 2) + 1) == 64 * (max(blocks, 2) + 1)
    for s in (1, 500, 8192, 100_000):
        assert -(-s // split.split_size(s)) <= split.MAX_SPLITS
    assert split.supports(64, 1) and split.supports(128, split.MAX_ROWS)
    assert not split.supports(96, 1) and not split.supports(64, split.MAX_ROWS + 1)


def test_target_attention_choices():
    assert target_attention_for("auto", "cpu", 64) == "sdpa"
    assert target_attention_for(None, "cpu", 64) == "sdpa"
    with pytest.raises(ConfigError, match="expected one of"):
        target_attention_for("matmul", "cpu", 64)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        target_attention_for("split", "cpu", 64)
    with pytest.raises(ConfigError, match="expected one of"):
        target_attention_for("flash", "cpu", 64)


@pytest.mark.parametrize("arch,kind,norms,pad", [("llama", "none", "auto", 16), ("llama", "tree", "auto", 16),
                                                 ("qwen3", "chain", "auto", 0), ("llama", "tree", "on", 0)])
def test_fast_path_with_split_attention_matches_hf_generate(interpreted, arch, kind, norms, pad):
    """Greedy decoding through the fast path with every decoding forward attending by the kernel by position
    (`Paths`; the target's head size is 16, its cache 256 slots: two splits and the merge), rotating and writing
    the cache by `rope_cache`, the layers' norms folded into their products (`eagle3.fast.norm_fold`; "on":
    normalising by `row_norm` instead), decoding forwards padded to `pad` tokens (`step_rows`), as on CUDA: HF
    `generate`'s tokens. Qwen3 covers the q/k norms."""
    model = build_tiny_target(arch)
    gen = torch.Generator().manual_seed(2)
    for name, w in model.named_parameters():  # norm weights start at one, where folding changes nothing
        if "norm" in name:
            w.copy_(torch.rand(w.shape, generator=gen) + 0.5)
    d = init_drafter(model, draft_vocab_size=200, seed=1)
    spec = {"none": None, "chain": DraftShape.chain(4), "tree": DraftShape(4, 3, 12)}[kind]
    engine = FastEngine(model, draft="none" if kind == "none" else "eagle3", spec=spec, drafter=d,
                        options=FastOptions(max_seq_len=256))
    engine.target.attention = "split"  # on a CPU only through the interpreter: `target_attention_for` refuses
    engine.target.step_rows = pad
    engine.target.norm_kernel = norms
    engine.target.select_norm()  # and the norms that go with it
    assert engine.target.folded == (norms == "auto")
    prompt = torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(5))
    ref = model.generate(prompt[None], max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 11:].tolist()
    assert engine.generate(prompt, max_new_tokens=6, eos_token_ids=[]).token_ids == ref


def test_split_attention_hides_what_a_sliding_window_leaves_out(interpreted):
    """A windowed Mistral (window 12) past a 150-token prompt: the first of the cache's two splits holds no slot
    any row may see (the kernel's running max stays finite there and the merge gives it no weight), and greedy
    decoding by the kernel is HF `generate`'s."""
    model = build_tiny_target("mistral", sliding_window=12)
    d = init_drafter(model, draft_vocab_size=200, seed=1)
    engine = FastEngine(model, draft="eagle3", spec=DraftShape(4, 3, 12), drafter=d,
                        options=FastOptions(max_seq_len=256))
    engine.target.attention = "split"
    engine.target.select_norm()
    prompt = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(6))
    ref = model.generate(prompt[None], max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 150:].tolist()
    assert engine.generate(prompt, max_new_tokens=6, eos_token_ids=[]).token_ids == ref


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("s,t,nkv,g,hd", [(900, 1, 8, 4, 128), (900, 6, 3, 3, 64), (900, 61, 8, 4, 128)])
def test_compiled_kernels_in_bf16(s, t, nkv, g, hd):
    """On a GPU in bf16: close to fp64 attention (tree masks), the same bits bounded by the forward's slots, and
    chain rows with the bits of one-token calls."""
    q, k, v, gen = inputs(s, t, nkv, g, hd, torch.bfloat16, device="cuda")
    mask = tree_mask(t, s, 400, gen).cuda()
    out = split.split_attention(q, k, v, mask, hd**-0.5)
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, mask, hd**-0.5), atol=2e-2, rtol=2e-2)
    slots = torch.arange(400, 400 + t, device="cuda")
    assert torch.equal(split.split_attention(q, k, v, mask, hd**-0.5, last=slots), out)
    cm = chain_mask(t, s, 400).cuda()
    rows = split.split_attention(q, k, v, cm, hd**-0.5, last=slots)
    for i in range(t):
        qi = q.view(nkv, g, t, hd)[:, :, i].contiguous()
        one = split.split_attention(qi, k, v, cm[i : i + 1], hd**-0.5, last=slots[i : i + 1])
        assert torch.equal(rows[i : i + 1], one), i


@pytest.mark.gpu
@cuda
def test_bf16_chains_stay_identical_to_plain_decoding_with_split_attention():
    """The fast path's default attention on CUDA: bf16 EAGLE-3 chains emit what bf16 plain decoding emits, with the
    drafter attending by position (the split kernels) inside compiled drafting."""
    model = build_tiny_target("llama").cuda().to(torch.bfloat16)
    d = init_drafter(model, draft_vocab_size=200, seed=1).cuda().to(torch.bfloat16)
    plain = FastEngine(model, draft="none", options=FastOptions())
    chain = FastEngine(model, draft="eagle3", spec=DraftShape.chain(5), drafter=d,
                       options=FastOptions())
    assert plain.target_attention == chain.target_attention == "split"
    assert chain.settings()["drafter_attention"] == "split" and chain.drafting_compiled
    for seed in range(4):
        prompt = torch.randint(3, 300, (9 + seed,), generator=torch.Generator().manual_seed(seed))
        want = plain.generate(prompt, max_new_tokens=40, eos_token_ids=[]).token_ids
        assert chain.generate(prompt, max_new_tokens=40, eos_token_ids=[]).token_ids == want, seed
    assert {"_draft", "_feed_rows"} <= chain.rows.pieces.tried  # compiled with the custom op, not eager


def _tree_over_a_path(path: list[int], n: int, gen: torch.Generator) -> tuple[list[int], list[int], list[int]]:
    """A tree of n nodes whose path of tokens `path` (below the root) sits at scattered nodes: at each depth a
    decoy sibling comes first. Returns tokens, parents (N+1 indexing, root 0) and the path's node indices."""
    tokens, parents, nodes = [], [0], []
    parent = 0
    for tok in path:
        tokens += [int(torch.randint(3, 300, (1,), generator=gen)), tok]
        parents += [parent, parent]
        parent = len(tokens)
        nodes.append(parent)
    while len(tokens) < n:  # the rest hang off random earlier nodes
        tokens.append(int(torch.randint(3, 300, (1,), generator=gen)))
        parents.append(int(torch.randint(0, len(tokens), (1,), generator=gen)))
    return tokens, parents, nodes


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_tree_nodes_get_the_bits_of_plain_steps(arch):
    """On CUDA in bf16, batch-invariant (`FastOptions.batch_invariant`): a 40-node tree verified in one forward
    whose accepted path sits at scattered slots gives that path's tokens the logits of one-token plain steps, bit
    for bit: attention walks by position (`Paths`) and every decoding forward is padded to `step_rows` tokens,
    so the products run the same kernels."""
    from eagle3.fast.target import STEP_ROWS, FastTarget

    model = build_tiny_target(arch).cuda().to(torch.bfloat16)
    target = FastTarget(model)
    assert target.attention == "split" and target.step_rows == 0
    target.step_rows = STEP_ROWS  # what `FastOptions.batch_invariant` sets
    k = torch.zeros(target.num_layers, 1, target.nkv, 512, target.hd, dtype=torch.bfloat16, device="cuda")
    v, rope = torch.zeros_like(k), target.rope_table(512)

    def ft(ids, pos, slots, mask, path=None):  # one row: ids, pos, slots [T], mask [T, S], path (length, tail [T, W])
        return target.forward_rows(ids[None], pos[None], slots[None], None if mask is None else mask[None], k, v,
                                   rope, path=None if path is None else (path[0], path[1][None]))[0][0]

    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 300, (200,), generator=gen).cuda()
    ar = torch.arange(512, device="cuda")
    n0 = prompt.shape[0]
    ft(prompt, ar[:n0], ar[:n0], ar[None, :] <= ar[:n0, None])
    path = torch.randint(3, 300, (6,), generator=gen).tolist()  # root, then 5 nodes
    plain = []
    for j, tok in enumerate(path):  # one-token steps at positions n0 + j, slots n0 + j
        p = ar[n0 + j : n0 + j + 1]
        plain.append(ft(torch.tensor([tok], device="cuda"), p, p, None, path=(p, p[:, None]))[0])
    tokens, parents, nodes = _tree_over_a_path(path[1:], 40, gen)
    pos, tail = tree_paths(torch.tensor(parents), n0)  # the tree verified at slots n0 + [0, 40]
    ids = torch.tensor([path[0], *tokens], device="cuda")
    logits = ft(ids, pos.cuda(), n0 + ar[:41], None, path=(ar[n0 : n0 + 1], tail.cuda()))
    for j, node in enumerate([0, *nodes]):
        assert torch.equal(logits[node], plain[j]), j
