"""Ahead-of-time compiled steps (quickdraft.aot): built once, loaded from the cache folder, equal
to the eager forward, lossless in the engine. Each build compiles a package (20-40 s here)."""

from __future__ import annotations

import logging
import time

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


def _steps_other_threads_ran_during(runner, model, seconds: float = 0.5) -> int:
    """How often a thread that counts (and yields the GIL) ran while a step was running, decode
    steps run through `runner` back to back for `seconds`, with Python's switch interval set past
    the test's length: then the counting thread gets the GIL only where this one releases it, and
    between steps (a tensor freed may release it) it does not count. (The test model's steps take
    well under a millisecond: the counting thread, once the OS runs it, takes the GIL only if a
    step is running then, which is most of the time when steps release it.)"""
    import sys
    import threading

    cache = KVCache.for_model(model, 2, 64)
    view = cache.rows(0, 2)
    args = (torch.tensor([[5], [6]]), torch.tensor([[3], [4]]), torch.arange(8), view.k, view.v)
    count, inside, started, stop = [0], [False], threading.Event(), [False]

    def counter():
        while not stop[0]:
            count[0] += inside[0]
            started.set()
            time.sleep(0)  # hands the GIL back, then waits for it

    before = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    thread = threading.Thread(target=counter, daemon=True)
    try:
        with torch.inference_mode():
            runner(*args)  # (a first call allocates)
            thread.start()
            started.wait()  # (waiting releases the GIL): the counter now waits for it
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                inside[0] = True
                out = runner(*args)
                inside[0] = False
                out = None  # noqa: F841 - (the outputs freed outside the step)
    finally:
        stop[0] = True
        sys.setswitchinterval(before)
        thread.join()
    return count[0]


def test_steps_release_the_gil(target_step, monkeypatch):
    """A server's event loop streams tokens while the engine's thread runs steps: quickdraft's
    runner (kernels/aot_runner.cpp) releases the GIL while a package runs; PyTorch's own loader,
    the control, holds it for the whole step."""
    from quickdraft import kernels

    model, step = target_step
    assert kernels.aot_package_class() is not None and isinstance(step.runner, aot._PackageRunner)
    assert _steps_other_threads_ran_during(step.runner, model) > 0
    monkeypatch.setattr(kernels, "aot_package_class", lambda: None)
    held = aot._load_package(step.path)
    assert not isinstance(held, aot._PackageRunner)
    constants = aot._constants(aot._Step(model))
    held.load_constants({n: constants[n] for n in held.get_constant_fqns()}, check_full_update=True,
                        user_managed=True)
    assert _steps_other_threads_ran_during(held, model) == 0


def test_logits_at_is_served_by_the_package(target_step, monkeypatch):
    """A call for some positions' logits (a draft catching up: 2 tokens a row, a padded one among
    them) runs the package, not the eager model, and gives those positions' rows of its full output."""
    model, step = target_step
    calls = []
    runner = step.runner
    monkeypatch.setattr(step, "runner", lambda *a: calls.append(1) or runner(*a))
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("the eager forward ran"))
    g = torch.Generator().manual_seed(3)
    caches = [KVCache.for_model(model, 2, 32) for _ in range(3)]
    for t in zip(*(c.k + c.v for c in caches)):
        r = torch.randn(t[0].shape, generator=g)
        for c in t:
            c.copy_(r)
    ids, pos, last = torch.tensor([[5, 6], [7, 8]]), torch.tensor([[9, 10], [4, -1]]), torch.tensor([[1], [0]])
    with torch.inference_mode():
        got = step(ids, pos, caches[0].rows(0, 2), logits_at=last, kv_len=11)
        full = step(ids, pos, caches[1].rows(0, 2), kv_len=11)
        monkeypatch.undo()
        eager = model(ids, pos, caches[2].rows(0, 2), logits_at=last, kv_len=11)
    assert len(calls) == 2 and got.shape == (2, 1, model.config.vocab_size)
    assert torch.equal(got, full.gather(1, last[..., None].expand(-1, -1, full.shape[-1])))
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    for a, b in zip(caches[0].k + caches[0].v, caches[2].k + caches[2].v):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # the same slots written (none for the padding)


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


def test_suffix_trees_past_their_node_budget_run_on_the_tree_package(target_dir, target_step):
    """At k = 16 suffix decoding's node budget (16) no longer exceeds k, yet it drafts trees: the
    engine must load the compiled tree step for them. Verified by the eager forward between the
    compiled chain steps, they rounded differently, and SmolLM2's greedy answer left plain
    decoding's (tests/proposers holds every proposer to saying it may draft trees)."""
    prompts = [[3, 17, 42, 9, 3, 17, 42, 9, 3, 17], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = LLM(target_dir, method="suffix", num_speculative_tokens=16, compile="aot", dtype="float32", policy="fixed")
    assert spec.engine._forward.tree_runner is not None
    plain = LLM(target_dir, method="none", compile="aot", dtype="float32")
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == [o.token_ids for o in plain.generate(prompts, greedy)]
    assert spec.stats.num_accepted_tokens > 0


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


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target_step):
    """A random EAGLE-3 head for the target (seed 0), saved: the engine's and the head tests' packages are one."""
    from quickdraft.model.eagle3 import new_head, save_eagle3

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("head") / "h"
    save_eagle3(new_head(target_step[0]), folder)
    return folder


def test_package_with_hidden_states_and_eagle3(target_dir, target_step, head_dir):
    """The variant returning layers' states (what an EAGLE-3 head reads): logits and states
    equal eager; an eagle3 engine with compile="aot" runs it and stays greedy-equal to plain."""
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
    # the bundled-style default head reads (2, L // 2, L - 3) clamped to this 2-layer target: (1, 1, 0)
    spec = LLM(target_dir, method="eagle3", draft=head_dir, num_speculative_tokens=3, compile="aot",
               dtype="float32", policy="fixed")
    assert isinstance(spec.engine._forward, aot.AOTStep) and spec.engine._forward.hidden_at == layers
    assert spec.engine._forward.path == step.path  # the package built above
    head_step = spec.engine.proposer._head  # the head's two packages: from target states, drafting
    assert isinstance(head_step, aot.HeadAOTStep) and len({p.name for p in head_step.paths}) == 2
    plain = LLM(target_dir, method="none", compile=False, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[3, 17, 42, 9], [5, 6, 7]]
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == [o.token_ids for o in plain.generate(prompts, greedy)]
    tree = LLM(target_dir, method="eagle3", draft=head_dir, num_speculative_tokens=3, compile="aot",
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


def test_head_packages_equal_the_eager_head(target_dir, target_step, head_dir):
    """An EAGLE-3 head's packages (reading target states; drafting from its own output) give
    the eager head's logits and states, on a ragged batch over its cache. (The head as the engine
    loads it: the eagle3 engine test above built these packages, if it ran.)"""
    model, _ = target_step
    head = LLM(target_dir, method="eagle3", draft=head_dir, compile=False, dtype="float32").engine.proposer._head
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


@pytest.fixture(scope="module")
def packed_step(target_step):
    """The float32 target's packages with the packed (mixed-step) one (one more build of this shape)."""
    model, _ = target_step
    step = aot.load_or_build(model, packed=True)
    assert step.packed_runner is not None and step.packed_path.name.endswith("-m.pt2")
    return model, step


def test_packed_package_gives_each_block_its_own_bits(packed_step):
    """The mixed-step package: the running rows get the decode package's bits (one token and a
    4-token verify), whatever chunk is beside them; a prompt's chunks get the same bits in
    three 16-token pieces beside running rows as in one piece alone, and padded beside a
    shorter prompt; and the step's own probe says they agree."""
    model, step = packed_step
    assert step.packed_agrees()
    g = torch.Generator().manual_seed(5)
    B, L = 3, 9
    context = torch.randint(3, 300, (B, L), generator=g)
    long_ = torch.randint(3, 300, (1, 60), generator=g)

    def filled():
        c = KVCache.for_model(model, B + 2, 80)
        model(context, torch.arange(L).expand(B, L), c.rows(0, B), kv_len=L)
        return c

    with torch.inference_mode():
        alone, mixed, dummy = filled(), filled(), filled()
        for i, T in enumerate([1, 4, 1]):
            p0 = L + 5 * i
            ids, pos = context[:, i:i + T].contiguous(), (p0 + torch.arange(T)).expand(B, T).contiguous()
            want = step(ids, pos, alone.rows(0, B), kv_len=p0 + T)
            chunk = (long_[:, 16 * i:16 * i + 16], (16 * i + torch.arange(16))[None], torch.tensor([[15]]),
                     mixed.rows(B, B + 1), 16 * i + 16)
            (got, _), (last_logits, _) = step.packed((ids, pos, mixed.rows(0, B), p0 + T), chunk)
            (got_alone, _), none = step.packed((ids, pos, dummy.rows(0, B), p0 + T), None)
            assert torch.equal(got, want) and torch.equal(got_alone, want) and none is None
        one = KVCache.for_model(model, 2, 80)
        none, (whole, _) = step.packed(None, (long_[:, :48], torch.arange(48)[None], torch.tensor([[47]]),
                                              one.rows(1, 2), 48))
        assert none is None and torch.equal(whole, last_logits)
        padded = KVCache.for_model(model, 2, 80)
        ids = torch.zeros(2, 48, dtype=torch.long)
        ids[0], ids[1, :30] = long_[0, :48], long_[0, 20:50]
        pos = torch.full((2, 48), -1)
        pos[0], pos[1, :30] = torch.arange(48), torch.arange(30)
        _, (two, _) = step.packed(None, (ids, pos, torch.tensor([[47], [29]]), padded.rows(0, 2), 48))
        assert torch.equal(two[:1], whole)
    for a, b, c, d in zip(mixed.k + mixed.v, one.k + one.v, padded.k + padded.v, alone.k + alone.v):
        assert torch.equal(a[B, :, :48], b[1, :, :48]) and torch.equal(c[0, :, :48], b[1, :, :48])
        assert torch.equal(a[:B], d[:B])  # the running rows' keys and values too


@pytest.mark.parametrize("method", ["none", "draft", "eagle3"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_aot_steps_mix_a_long_prompt_and_change_no_output(target_dir, draft_dir, head_dir, packed_step, monkeypatch,
                                                          method, seeded):
    """With the AOT steps (compile="aot") a prompt arriving while two requests decode is prefilled in
    chunks that ride in their steps on the packed package (for an EAGLE-3 head, its variant that
    returns the layers' states the head reads); every output (tokens, logprobs) is what the request
    gives alone on the same engine, and a lone prompt's chunks run that package too."""
    monkeypatch.setenv("QUICKDRAFT_AOT_MIXED", "1")
    kw = dict(num_speculative_tokens=3) if method != "none" else {}
    draft = {"none": None, "draft": draft_dir, "eagle3": head_dir}[method]
    llm = LLM(target_dir, draft, method=method, compile="aot",
              dtype="float32", policy="fixed", max_num_batched_tokens=24, max_num_seqs=4, **kw)
    eng = llm.engine
    assert eng._forward.packed_runner is not None and eng.mixes_prefill()
    assert (eng._forward.hidden_at is not None) == (method == "eagle3")  # the head reads the states it returns
    calls = []
    real = eng._forward.packed

    def spy(a, b):
        calls.append((a is not None, b is not None))
        return real(a, b)

    eng._forward.packed = spy
    params = SamplingParams(max_tokens=14, temperature=0.8 if seeded else 0.0, seed=3 if seeded else None,
                            logprobs=1, ignore_eos=True)
    prompts = [[3, 17, 42, 9, 11], [5, 6, 7, 8, 9, 10, 11], list(range(20, 90))]
    ids = [eng.add_request(p, params) for p in prompts[:2]]
    eng.step()
    eng.step()
    ids.append(eng.add_request(prompts[2], params))
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert calls[0] == (False, True) and calls.count((True, True)) >= 3  # chunks rode in decode steps
    for rid, p in zip(ids, prompts):
        calls.clear()
        ref = eng.generate([(p, params)])[0]
        assert calls and all(c == (False, True) for c in calls)  # alone: the chunks on the packed package
        assert outs[rid].token_ids == ref.token_ids and outs[rid].logprobs == ref.logprobs
