"""Ahead-of-time compiled steps (quickdraft.aot): built once, loaded from the cache folder, equal
to the eager forward, lossless in the engine. Each build compiles a package (20-40 s here)."""

from __future__ import annotations

import logging

import pytest
import torch

from quickdraft import aot
from quickdraft.cache import KVCache
from quickdraft.llm import LLM
from quickdraft.model.loader import load_model
from quickdraft.model import formats, quant as quant_mod
from quickdraft.model.quant import prepare
from quickdraft.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target_step(target_dir):
    model = prepare(load_model(target_dir, dtype="float32"))
    assert aot.load(model) is None  # nothing built yet
    aot.build(model)
    step = aot.load(model)
    assert isinstance(step, aot.AOTStep)
    return model, step


def _decode(fn, model, prompt, rows, start, n=6):
    """Prefill eagerly, then n one-token steps and one 3-token verify step through fn, on rows
    [start, start + B) of a cache with more rows than the batch."""
    cache = KVCache.for_model(model, start + rows + 1, 64)
    view = cache.rows(start, start + rows)
    B, L = prompt.shape
    outs = [model(prompt, torch.arange(L).expand(B, L), view, kv_len=L)]
    tok = outs[-1][:, -1:].argmax(-1)
    for i in range(n):
        outs.append(fn(tok, torch.full((B, 1), L + i), view, kv_len=L + i + 1))
        tok = outs[-1][:, -1:].argmax(-1)
    pos = torch.arange(L + n, L + n + 3).expand(B, 3)
    outs.append(fn(torch.cat([tok, tok, tok], 1), pos, view, kv_len=L + n + 3))
    return outs, view


@pytest.mark.parametrize("rows,start", [(1, 0), (3, 2)])
def test_package_equals_eager(target_step, rows, start):
    model, step = target_step
    prompt = torch.randint(3, 100, (rows, 7), generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        eager, eager_cache = _decode(model, model, prompt, rows, start)
        compiled, compiled_cache = _decode(step, model, prompt, rows, start)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for a, b in zip(eager_cache.k + eager_cache.v, compiled_cache.k + compiled_cache.v):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # the package wrote the same rows and slots


def test_other_signatures_run_eagerly(target_step):
    model, step = target_step
    cache = KVCache.for_model(model, 1, 32)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        got = step(ids, torch.arange(3)[None], cache.rows(0, 1), logits_at=torch.tensor([[2]]), kv_len=3)
    assert got.shape == (1, 1, model.config.vocab_size)


def test_stale_package_is_refused(target_step, caplog):
    model, _ = target_step
    bad = aot.package_path(model).with_name("broken.pt2")
    bad.write_bytes(b"not a package")
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        assert aot.load(model, bad) is None
    assert "did not load" in caplog.text


def test_package_key_follows_format_and_dtype(target_dir, target_step):
    model, _ = target_step
    int8 = prepare(load_model(target_dir, dtype="float32"), "int8")
    bf16 = prepare(load_model(target_dir, dtype="bfloat16"), fmt="dense")
    keys = {aot.shape_key(m) for m in (model, int8, bf16)}
    assert len(keys) == 3
    assert aot.load(int8) is None  # never the float32 package for another format


def test_engine_with_packages_is_lossless(target_dir, draft_dir, target_step):
    """compile="aot": target and draft run their packages (the draft's is built here); greedy
    speculative output equals plain eager decoding token for token, and sampled output with a
    seed equals the same engine's plain decoding."""
    prompts = [[3, 17, 42, 9], [5, 6, 7, 8, 9, 10, 11]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(target_dir, method="none", compile=False, dtype="float32")
    spec = LLM(target_dir, draft_dir, method="draft", num_speculative_tokens=3, compile="aot", dtype="float32", policy="fixed")
    assert isinstance(spec.engine._forward, aot.AOTStep)
    assert isinstance(spec.engine.proposer._step, aot.AOTStep)
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == want
    # by default a CPU engine picks up the cached packages
    auto = LLM(target_dir, method="ngram", compile=None, dtype="float32", policy="fixed")
    assert isinstance(auto.engine._forward, aot.AOTStep)
    assert [o.token_ids for o in auto.generate(prompts, greedy)] == want


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantised_package(target_dir, quant):
    """int8 / int4 weights: the package runs the weight-only kernel (PyTorch's: up to DENSE_ROWS rows);
    greedy speculative output equals the quantised target's own plain output. On quickdraft's
    blocked int4 kernel the package takes the model's weights at load time, like float32."""
    prompts = [[3, 17, 42, 9, 3, 17, 42]]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    spec = LLM(target_dir, method="ngram", num_speculative_tokens=3, compile="aot", quantization=quant,
               dtype="float32", policy="fixed")
    assert isinstance(spec.engine._forward, aot.AOTStep)
    # quickdraft's kernels run every row count; PyTorch's switch to a dense GEMM past DENSE_ROWS
    assert spec.engine._forward.max_rows == (aot._MAX_ROWS if quant_mod.blocked_supported() else formats.DENSE_ROWS)
    if quant == "int4" and quant_mod.blocked_supported():
        assert not aot._embeds_weights(spec.engine.target)
    plain = LLM(target_dir, method="none", compile="aot", quantization=quant, dtype="float32")
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == [o.token_ids for o in plain.generate(prompts, greedy)]


def test_package_with_hidden_states_and_eagle3(tmp_path, target_dir, target_step):
    """The variant returning layers' states (what an EAGLE-3 head reads): logits and states
    equal eager; an eagle3 engine with compile="aot" runs it and stays greedy-equal to plain."""
    from quickdraft.model.eagle3 import new_head, save_eagle3

    model, _ = target_step
    # the layers the eagle3 engine below asks for: its package is this one, built once
    layers = (1, 1, 0)
    aot.build(model, hidden_at=layers)
    step = aot.load(model, hidden_at=layers)
    assert step is not None and step.hidden_at == layers and step.path != aot.package_path(model)
    prompt = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache_a, cache_b = KVCache.for_model(model, 2, 32), KVCache.for_model(model, 2, 32)
        for cache in (cache_a, cache_b):
            model(prompt, torch.arange(5).expand(2, 5), cache.rows(0, 2), kv_len=5)
        pos = torch.arange(5, 8).expand(2, 3)
        want = model.forward_hidden(prompt[:, :3], pos, cache_a.rows(0, 2), kv_len=8, hidden_at=layers)
        got = step.forward_hidden(prompt[:, :3], pos, cache_b.rows(0, 2), kv_len=8, hidden_at=layers)
    assert isinstance(got, tuple) and len(got) == 2
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.manual_seed(0)
    save_eagle3(new_head(model), tmp_path / "h")
    # the bundled-style default head reads (2, L // 2, L - 3) clamped to this 2-layer target: (1, 1, 0)
    spec = LLM(target_dir, method="eagle3", draft=tmp_path / "h", num_speculative_tokens=3, compile="aot",
               dtype="float32", policy="fixed")
    assert isinstance(spec.engine._forward, aot.AOTStep) and spec.engine._forward.hidden_at == layers
    assert spec.engine._forward.path == step.path  # the package built above
    head_step = spec.engine.proposer._head  # the head's two packages: from target states, drafting
    assert isinstance(head_step, aot.HeadAOTStep) and len({p.name for p in head_step.paths}) == 2
    plain = LLM(target_dir, method="none", compile=False, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[3, 17, 42, 9], [5, 6, 7]]
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == [o.token_ids for o in plain.generate(prompts, greedy)]
    tree = LLM(target_dir, method="eagle3", draft=tmp_path / "h", num_speculative_tokens=3, compile="aot",
               dtype="float32", spec_options={"tree_width": 2, "tree_nodes": 5}, policy="fixed")
    # trees: the target's tree verify and the head's tree depths run their own packages
    forward, head_step = tree.engine._forward, tree.engine.proposer._head
    assert forward.tree_runner is not None and forward.tree_path.name.endswith("-t.pt2")
    assert head_step.tree_runner is not None and head_step.paths[-1].name.endswith("-t.pt2")
    calls = {"target": 0, "head": 0}

    def counted(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)
        return run

    forward.tree_runner = counted("target", forward.tree_runner)
    head_step.tree_runner = counted("head", head_step.tree_runner)
    assert [o.token_ids for o in tree.generate(prompts, greedy)] == [o.token_ids for o in plain.generate(prompts, greedy)]
    assert calls["target"] > 0 and calls["head"] > 0


def test_tree_package_equals_eager(target_step):
    """The token-tree variant (slots and a mask): logits and the cache slots it writes equal
    the eager forward's, for a two-row batch of different trees."""
    model, _ = target_step
    step = aot.load_or_build(model, trees=True)
    assert step.tree_runner is not None and aot.load(model, trees=True).tree_runner is not None
    assert aot.load(model).tree_runner is None  # only asked for
    prompt = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(2))
    nodes = torch.randint(3, 100, (2, 4), generator=torch.Generator().manual_seed(3))
    # row 0: a chain of 4; row 1: two branches of 2 (nodes 0 -> 1, 2 -> 3); node i at slot 6 + i
    anc = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],
                        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]], dtype=torch.bool)
    mask = torch.cat([torch.ones(2, 4, 6, dtype=torch.bool), anc], 2)  # (B, T, kv_len = 10)
    slots = torch.arange(6, 10).expand(2, 4)
    positions = torch.tensor([[6, 7, 8, 9], [6, 7, 6, 7]])
    with torch.inference_mode():
        caches = [KVCache.for_model(model, 2, 16) for _ in range(2)]
        for cache in caches:
            model(prompt, torch.arange(6).expand(2, 6), cache.rows(0, 2), kv_len=6)
        want = model(nodes, positions, caches[0].rows(0, 2), kv_len=10, slots=slots, attn_mask=mask)
        calls = []
        runner = step.tree_runner
        step.tree_runner = lambda *a: calls.append(1) or runner(*a)
        got = step(nodes, positions, caches[1].rows(0, 2), kv_len=10, slots=slots, attn_mask=mask)
    assert calls
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_large_tree_package_attends_on_the_kernel(target_step):
    """A tree of 17 nodes (more than the 12 query rows `attend` once took at a time: an exported
    step, one call of all its rows, then ran PyTorch's attention, whose bits for a row depend on
    the row count): the package gives its first 12 nodes the bits a package call of those 12
    alone gives them (the kernel's rows are independent), and the eager forward's values."""
    model, _ = target_step
    step = aot.load_or_build(model, trees=True)  # (built by the test above: loaded)
    n, ctx = 17, 6
    g = torch.Generator().manual_seed(4)
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    anc = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        anc[i, i] = True
        if parent[i] >= 0:
            anc[i] |= anc[parent[i]]
            depth[i] = depth[parent[i]] + 1
    mask = torch.cat([torch.ones(n, ctx, dtype=torch.bool), anc], 1)[None]  # (1, T, kv_len)
    slots = torch.arange(ctx, ctx + n)[None]
    positions = torch.tensor(depth)[None] + ctx
    prompt = torch.randint(3, 100, (1, ctx), generator=g)
    nodes = torch.randint(3, 100, (1, n), generator=g)
    with torch.inference_mode():
        caches = [KVCache.for_model(model, 1, 32) for _ in range(3)]
        for cache in caches:
            model(prompt, torch.arange(ctx)[None], cache.rows(0, 1), kv_len=ctx)
        want = model(nodes, positions, caches[0].rows(0, 1), kv_len=ctx + n, slots=slots, attn_mask=mask)
        got = step(nodes, positions, caches[1].rows(0, 1), kv_len=ctx + n, slots=slots, attn_mask=mask)
        # the first 12 nodes alone (a tree: every parent comes first), their slots the same
        first = step(nodes[:, :12], positions[:, :12], caches[2].rows(0, 1), kv_len=ctx + 12, slots=slots[:, :12],
                     attn_mask=mask[:, :12, :ctx + 12])
    assert torch.equal(got[:, :12], first)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_head_packages_equal_the_eager_head(tmp_path, target_step):
    """An EAGLE-3 head's packages (reading target states; drafting from its own output) give
    the eager head's logits and states, on a ragged batch over its cache."""
    from quickdraft.model.eagle3 import new_head

    model, _ = target_step
    torch.manual_seed(0)
    head = new_head(model).eval()
    step = aot.load_or_build(head)
    assert isinstance(step, aot.HeadAOTStep) and aot.load(head) is not None
    g = torch.Generator().manual_seed(1)
    width = len(head.aux_layers) * model.config.hidden_size
    with torch.inference_mode():
        caches = [KVCache(1, 2, head.config.num_key_value_heads, 32, head.config.head_dim, torch.float32, "cpu")
                  for _ in range(2)]
        ids = torch.randint(3, 100, (2, 4), generator=g)
        feats = torch.randn(2, 4, width, generator=g)
        pos = torch.tensor([[0, 1, 2, 3], [0, 1, 2, -1]])  # the second row one pair short (padding)
        want = head(ids, feats, pos, caches[0].rows(0, 2), kv_len=4)
        got = step(ids, feats, pos, caches[1].rows(0, 2), kv_len=4)
        for a, b in zip(want, got):
            torch.testing.assert_close(b[:, :3], a[:, :3], rtol=1e-4, atol=1e-4)
        own = want[1][:, 2:3]
        pos = torch.tensor([[4], [3]])
        want = head(ids[:, :1], own, pos, caches[0].rows(0, 2), kv_len=5, project=False)
        got = step(ids[:, :1], own, pos, caches[1].rows(0, 2), kv_len=5, project=False)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[1].k[0], caches[0].k[0], rtol=1e-4, atol=1e-4)
        # a tree depth: two nodes per row fed their own states, each reading the context and itself
        tree_step = aot.load_or_build(head, trees=True)
        assert tree_step.tree_runner is not None
        ids2, own2 = ids[:, :2], torch.cat([own, own * 0.5], 1)
        pos = torch.tensor([[5, 5], [4, 4]])
        slots = torch.tensor([[6, 7], [5, 6]])
        keys = torch.arange(8)
        mask = (keys < torch.tensor([[5], [4]]))[:, None, :] | (keys == slots[..., None])
        want = head(ids2, own2, pos, caches[0].rows(0, 2), kv_len=8, slots=slots, attn_mask=mask, project=False)
        got = tree_step(ids2, own2, pos, caches[1].rows(0, 2), kv_len=8, slots=slots, attn_mask=mask, project=False)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[1].k[0], caches[0].k[0], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_bfloat16_package_on_the_kernels_equals_eager(target_dir):
    """A bfloat16 target on quickdraft's kernels (`blocked_bf16`, its AOTInductor C entry point):
    the package's greedy tokens are the eager model's."""
    from quickdraft.model.quant import blocked_supported

    if not blocked_supported():
        pytest.skip("no vector path for quickdraft's kernels here")
    prompts = [[3, 17, 42, 9], [5, 6, 7, 8, 9, 10, 11]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    eager = LLM(target_dir, method="none", compile=False, dtype="bfloat16")
    packaged = LLM(target_dir, method="none", compile="aot", dtype="bfloat16")
    assert isinstance(packaged.engine._forward, aot.AOTStep)
    assert [o.token_ids for o in packaged.generate(prompts, greedy)] == \
        [o.token_ids for o in eager.generate(prompts, greedy)]
