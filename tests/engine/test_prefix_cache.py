"""Prefix caching and chunked prefill: a cache hit, and a prompt cut into chunks, give the bits a
whole prefill gives (tokens, logprobs, seeded samples, acceptance), for plain decoding and every
proposer; eviction keeps the byte limit, and the KV budget's (the blocks give way to requests);
running streams keep flowing while a long prompt is prefilled."""

from __future__ import annotations

import random

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.cache import KVCache, row_bytes
from quickdraft.errors import QuickdraftError
from quickdraft.model.quant import row_invariant
from quickdraft.prefix_cache import PrefixCache

GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


def prompt(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(n)]


def conversation(llm: LLM, params: SamplingParams, system: list[int], turns: list[list[int]] | None = None) -> list:
    """Two chat turns and a second conversation with the same system prompt: each turn sends the
    whole history (the second turn and the other conversation hit the cache when it is on)."""
    eng = llm.engine
    turns = turns or [prompt(9, 1), prompt(7, 2), prompt(11, 3)]
    first = system + turns[0]
    out1 = eng.generate([(first, params)])[0]
    second = first + out1.token_ids + turns[1]
    out2 = eng.generate([(second, params)])[0]
    other = eng.generate([(system + turns[2], params)])[0]
    return [out1, out2, other]


def assert_same(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.logprobs == y.logprobs  # TokenLogprob floats compared exactly: the same bits
        assert (x.stats.num_draft_tokens, x.stats.num_accepted_tokens) == (y.stats.num_draft_tokens,
                                                                           y.stats.num_accepted_tokens)


def exact_or_skip(llm: LLM) -> None:
    if not row_invariant(llm.target):
        pytest.skip("the target's matmuls are not row-invariant here (quickdraft's kernels did not build): "
                    "a prefill's bits depend on its row count")


CASES = {
    "none": dict(method="none"),
    "draft": dict(method="draft", num_speculative_tokens=3),
    "draft-tree": dict(method="draft", num_speculative_tokens=3, spec_options={"tree_width": 2}),
    "suffix": dict(method="suffix", num_speculative_tokens=3),
    "ngram": dict(method="ngram", num_speculative_tokens=3),
    "lookahead": dict(method="lookahead", num_speculative_tokens=3),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_hit_gives_the_bits_of_a_miss(target_dir, noisy_draft, case, params):
    kw = dict(CASES[case], compile=False, max_num_seqs=4, policy="fixed")
    if kw["method"] == "draft":
        kw["draft"] = noisy_draft
    system = prompt(40, 0)
    plain = LLM(target_dir, **kw)
    exact_or_skip(plain)
    cached = LLM(target_dir, enable_prefix_caching=True, **kw)
    without, with_ = conversation(plain, params, system), conversation(cached, params, system)
    assert_same(without, with_)
    assert [o.num_cached_tokens for o in without] == [0, 0, 0]
    hits = [o.num_cached_tokens for o in with_]
    assert hits[0] == 0 and hits[1] >= 48 and hits[2] == 32  # whole 16-token blocks; the system prompt
    s = cached.engine.prefix_cache.stats
    assert s.hits == sum(hits) and s.queries == sum(len(o.prompt_token_ids) for o in with_)


@pytest.mark.parametrize("tree_width", [1, 2])
def test_eagle3_head_state_is_cached_with_the_target(tree_width):
    """The bundled target and its EAGLE-3 head: the head's KV comes with the target's blocks, so
    acceptance on a hit is acceptance without (vLLM #47930: it collapsed when it was not)."""
    kw = dict(draft="target-eagle3", num_speculative_tokens=3, compile=False,
              spec_options={"tree_width": tree_width}, policy="fixed")
    plain = LLM(**kw)
    exact_or_skip(plain)
    cached = LLM(enable_prefix_caching=True, **kw)
    enc = plain.tokenizer.encode
    system = enc("You are a helpful assistant. Answer the question briefly. " * 3)
    turns = [enc(" Question: what is two plus two?"), enc(" And three plus three?"), enc(" What is the capital of France?")]
    for params in (GREEDY, SEEDED):
        without, with_ = conversation(plain, params, system, turns), conversation(cached, params, system, turns)
        assert_same(without, with_)
        assert with_[1].num_cached_tokens > 0 and with_[1].stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["none", "draft"])
def test_chunked_prefill_gives_the_bits_of_a_whole_prefill(target_dir, noisy_draft, method):
    kw = dict(method=method, compile=False, num_speculative_tokens=3, draft=noisy_draft if method == "draft" else None,
              policy="fixed")
    whole = LLM(target_dir, max_num_batched_tokens=None, **kw)
    exact_or_skip(whole)
    chunked = LLM(target_dir, max_num_batched_tokens=7, **kw)
    params = [SamplingParams(max_tokens=8, temperature=0, logprobs=1, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]
    batch = [(prompt(n, n), p) for n, p in zip((30, 5, 19), params)]
    a, b = whole.engine.generate(batch), chunked.engine.generate(batch)
    assert_same(a, b)
    assert a[0].prompt_logprobs == b[0].prompt_logprobs and len(b[0].prompt_logprobs) == 30


def test_streams_keep_flowing_while_a_long_prompt_prefills(target_dir):
    """A long prompt arriving is prefilled in chunks that ride in the running request's decode steps
    (max_num_batched_tokens counts its token too: 15 prompt tokens a step); then it joins the batch
    (and its output is what it is alone). Where steps cannot mix, chunks and decode steps alternate
    (tests/engine/test_mixed_prefill.py)."""
    llm = LLM(target_dir, method="none", compile=False, max_num_batched_tokens=16, max_model_len=256, policy="fixed")
    eng = llm.engine
    exact_or_skip(llm)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eng.add_request(prompt(10, 1), params, request_id="running")
    eng.step()  # its prefill
    long = prompt(100, 2)
    eng.add_request(long, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), request_id="long")
    steps, outs, recording = [], {}, True
    while eng.has_unfinished():
        touched = eng.step()
        outs.update((o.request_id, o) for o in touched)
        if recording:  # until the long prompt's first token
            steps.append({o.request_id: len(o.new_token_ids) for o in touched})
            recording = "long" not in steps[-1]
    assert len(steps) == 7 and all(s.get("running") == 1 for s in steps)  # ceil(100 / 15) chunks, one token each
    assert steps[-1] == {"running": 1, "long": 1}  # the last chunk gives its first token
    alone = LLM(target_dir, method="none", compile=False, max_num_batched_tokens=None, policy="fixed")
    assert outs["long"].token_ids == alone.engine.generate([(long, SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True))])[0].token_ids


def test_abort_while_prefilling_leaves_the_rest_exact(target_dir):
    llm = LLM(target_dir, method="none", compile=False, max_num_batched_tokens=8, max_model_len=256,
              enable_prefix_caching=True, policy="fixed")
    eng = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = [eng.add_request(prompt(n, n), params) for n in (40, 33, 21)]
    # admission takes only the prompts the next prefill starts on: here all three (as a larger budget
    # at admission leaves them), then 8 tokens a step, so that a row in the middle is aborted
    budgets, per_step = iter([100]), eng._token_budget
    eng._token_budget = lambda idle=False: next(budgets, None) or per_step(idle)
    eng.step()
    eng.step()
    assert len(eng.prefilling) == 3
    eng.abort_request(ids[1])
    assert [r.id for r in eng.prefilling] == [ids[0], ids[2]]
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    fresh = LLM(target_dir, method="none", compile=False, policy="fixed").engine
    for rid, n in ((ids[0], 40), (ids[2], 21)):
        assert outs[rid].token_ids == fresh.generate([(prompt(n, n), params)])[0].token_ids


def test_only_prompts_the_next_prefill_reaches_are_admitted(target_dir):
    """A request whose first chunk would not run this step waits without a row: with 8 tokens a
    step, one 40-token prompt prefills at a time; with 50, the 40- and 33-token ones, the 21 waits."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for budget, admitted in ((8, 1), (50, 2)):
        eng = LLM(target_dir, method="none", compile=False, max_num_batched_tokens=budget, policy="fixed").engine
        for n in (40, 33, 21):
            eng.add_request(prompt(n, n), params)
        eng.step()
        assert len(eng.prefilling) + len(eng.running) == admitted and len(eng.waiting) == 3 - admitted
        assert eng.cache.max_slots < 3 or admitted == 3
        while eng.has_unfinished():
            eng.step()


def test_prompt_logprobs_requests_compute_every_position(target_dir):
    llm = LLM(target_dir, method="none", compile=False, enable_prefix_caching=True, policy="fixed")
    p = prompt(40, 5)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    llm.engine.generate([(p, SamplingParams(max_tokens=2, temperature=0))])
    out = llm.engine.generate([(p, params)])[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 40
    assert llm.engine.generate([(p, SamplingParams(max_tokens=2, temperature=0))])[0].num_cached_tokens == 32


def _cache_with(rows: int, length: int) -> KVCache:
    c = KVCache(2, rows, 2, length + 1, 16, torch.float32, "cpu")
    for t in c.k + c.v:
        t.copy_(torch.randn(t.shape))
    return c


def test_prefix_cache_blocks_lru_and_byte_limit():
    kv = _cache_with(3, 64)
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # layers x (k, v) x heads x tokens x dim x float32
    pc = PrefixCache(max_bytes=5 * block_bytes, block_size=16)
    a, b = prompt(64, 1), prompt(64, 2)
    pc.store(a, 50, kv, 0)  # 3 whole blocks of 50 positions
    assert pc.nbytes == 3 * block_bytes and pc.num_cached_tokens == 48
    hit = pc.match(a[:40] + [1, 2], need_extra=False)
    assert len(hit) == 2  # 42 tokens: two blocks, and at least one token left to compute
    row = _cache_with(1, 64)
    assert pc.load(hit, row, 0) == (32, 0)
    for a_, b_ in zip(row.k + row.v, kv.k + kv.v):
        assert torch.equal(a_[0, :, :32], b_[0, :, :32]) and not a_[0, :, 32:].eq(b_[0, :, 32:]).any()
    pc.match(a, need_extra=False)  # a's chain is the most recently used
    pc.store(b, 64, kv, 1)  # 4 more blocks: 7 > 5, the least recently used go first
    assert pc.nbytes <= pc.max_bytes and pc.stats.evictions >= 2
    # evicting a's root evicted its descendants too: nothing of a is reachable, nothing orphaned remains
    assert pc.match(a, need_extra=False) == [] and pc.num_cached_tokens * block_bytes // 16 == pc.nbytes
    assert len(pc.match(b, need_extra=False)) == 3  # b's 4 blocks are kept; a match leaves a token to compute
    # a chain longer than the limit keeps its first blocks
    small = PrefixCache(max_bytes=2 * block_bytes, block_size=16)
    small.store(a, 64, kv, 0)
    assert small.num_cached_tokens == 32 and len(small.match(a, need_extra=False)) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_read_and_written_whole_are_the_rows_bits(dtype):
    """read_blocks / write_blocks copy a layer's keys and values in one strided copy each: every
    block is its own memory (freed with it), with exactly its positions of every layer."""
    from quickdraft.prefix_cache import read_blocks, write_blocks
    src = KVCache(3, 4, 2, 100, 8, dtype, torch.device("cpu"))
    for t in src.k + src.v:
        t.copy_(torch.randn(t.shape))
    blocks = read_blocks(src, 2, 16, 5, 16)  # positions 16 .. 95 of row 2
    assert len(blocks) == 5 and len({b.untyped_storage().data_ptr() for b in blocks}) == 5
    for j, b in enumerate(blocks):
        assert b.shape == (3, 2, 2, 16, 8) and b.is_contiguous()
        for layer in range(3):
            assert torch.equal(b[layer, 0], src.k[layer][2, :, 16 + 16 * j:32 + 16 * j])
            assert torch.equal(b[layer, 1], src.v[layer][2, :, 16 + 16 * j:32 + 16 * j])
    dst = KVCache(3, 2, 2, 100, 8, dtype, torch.device("cpu"))
    assert write_blocks(dst, 1, blocks) == 80 and write_blocks(dst, 0, []) == 0
    for d, s_ in zip(dst.k + dst.v, src.k + src.v):
        assert torch.equal(d[1, :, :80], s_[2, :, 16:96])
        assert not d[1, :, 80:].any() and not d[0].any()  # nothing else written


def test_bad_settings_are_clear_errors(target_dir):
    with pytest.raises(QuickdraftError, match="max_num_batched_tokens"):
        LLM(target_dir, method="none", max_num_batched_tokens=0, policy="fixed")
    from quickdraft.config import EngineConfig
    with pytest.raises(QuickdraftError, match="prefix_cache_bytes"):
        EngineConfig(prefix_cache_bytes=-1)
    with pytest.raises(QuickdraftError, match="prefix_cache_bytes"):
        LLM(target_dir, method="none", enable_prefix_caching=True, prefix_cache_bytes="1GiB", policy="fixed")


def test_prefix_cache_gives_way_to_requests_within_the_kv_budget(target_dir):
    """One budget: the prefix cache's blocks take what the rows leave free, and a request that
    needs more than is free evicts them (all of them if it must) instead of waiting forever;
    the budget is never exceeded and every output is plain decoding's."""
    probe = LLM(target_dir, method="none", compile=False, policy="fixed").engine
    tb = probe.budget.token_bytes
    total = row_bytes(tb, 64) + 48 * tb  # one row of 64 positions, and three 16-token blocks beside it
    llm = LLM(target_dir, method="none", compile=False, enable_prefix_caching=True, kv_cache_memory=total, policy="fixed")
    exact_or_skip(llm)
    eng, pc = llm.engine, llm.engine.prefix_cache
    assert pc.max_bytes is None and eng.budget.total == total  # the default: the budget alone bounds it
    a, b = prompt(40, 11), prompt(40, 12)
    short, long_ = (SamplingParams(max_tokens=n, temperature=0, logprobs=1, ignore_eos=True) for n in (12, 40))
    outs = []
    for p, params in ((a, short), (a, short), (b, long_)):
        rid = eng.add_request(p, params)
        for _ in range(200):  # a request the cache's blocks kept waiting would never finish
            done = [o for o in eng.step() if o.finished and o.request_id == rid]
            assert eng.budget.used <= total
            assert eng.budget.claims["prefix"] == pc.nbytes
            if done:
                outs += done
                break
        assert not eng.has_unfinished()
        if len(outs) == 1:  # a's 51 computed positions: three blocks, exactly what the rows (1 x 64) leave
            assert pc.nbytes == 48 * tb and pc.stats.evictions == 0
    assert [o.num_cached_tokens for o in outs] == [0, 32, 0]  # the second a hit; b is another prompt
    assert pc.stats.evictions == 3  # b's row (81 positions) needed the blocks' memory: all of a's chain went
    plain = LLM(target_dir, method="none", compile=False, policy="fixed").engine
    assert_same(outs, [plain.generate([(p, params)])[0] for p, params in ((a, short), (a, short), (b, long_))])


def test_growth_while_a_prompt_prefills_keeps_its_computed_chunks(target_dir):
    """A request admitted while another's long prompt is half prefilled (chunked) makes the caches
    grow; the prefilling row's computed positions are kept (rows after the running ones), so both
    outputs are what each gives alone."""
    llm = LLM(target_dir, method="none", compile=False, max_num_batched_tokens=8, max_num_seqs=4, policy="fixed")
    exact_or_skip(llm)
    eng = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, ignore_eos=True)
    long_, late = prompt(60, 21), prompt(9, 22)
    first = eng.add_request(long_, params)
    eng.step()
    eng.step()  # 16 of its 60 positions computed, in a cache of one row
    assert len(eng.prefilling) == 1 and eng.prefilling[0].num_computed == 16 and eng.cache.max_slots == 1
    second = eng.add_request(late, SamplingParams(max_tokens=200, temperature=0, logprobs=1, ignore_eos=True))
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert eng.cache.max_slots >= 2  # it grew while the first prompt was prefilling
    alone = LLM(target_dir, method="none", compile=False, max_num_batched_tokens=None, policy="fixed").engine
    assert_same([outs[first], outs[second]],
                [alone.generate([(long_, params)])[0],
                 alone.generate([(late, SamplingParams(max_tokens=200, temperature=0, logprobs=1,
                                                       ignore_eos=True))])[0]])


def test_prefix_cache_claims_from_the_budget_under_its_cap():
    from quickdraft.cache import KVBudget

    kv = _cache_with(2, 64)
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4
    budget = KVBudget(6 * block_bytes, token_bytes=block_bytes // 16)
    budget.claim("rows", 2 * block_bytes)
    pc = PrefixCache(budget=budget, block_size=16)  # no cap of its own: what the rows leave free
    pc.store(prompt(96, 1), 96, _cache_with(1, 96), 0)  # six blocks offered, four fit
    assert pc.nbytes == 4 * block_bytes == budget.claims["prefix"] and budget.used == budget.total
    assert budget.make_room("rows", 3 * block_bytes)  # the rows need one more block: the cache gives way
    assert budget.claims["prefix"] == pc.nbytes < 4 * block_bytes and pc.stats.evictions >= 1
    assert budget.make_room("rows", 6 * block_bytes) and pc.nbytes == 0  # it can give everything back
    capped = PrefixCache(max_bytes=block_bytes, budget=KVBudget(6 * block_bytes, block_bytes // 16), block_size=16)
    capped.store(prompt(64, 2), 64, kv, 1)
    assert capped.nbytes == block_bytes  # its own cap, below what the budget has free


def test_eviction_under_pressure_leaves_running_requests_exact(target_dir):
    """A tiny budget: a request that hit the cache is running when another request's admission
    needs the blocks' memory, so every block it was copied from is evicted under it; it reads only
    its own row (copies), so its output is still plain decoding's, and the budget holds every step."""
    probe = LLM(target_dir, method="none", compile=False, policy="fixed").engine
    tb = probe.budget.token_bytes
    # one row of 64 positions and three 16-token blocks, or two rows and one block
    total = row_bytes(tb, 64) * 2 + 16 * tb
    llm = LLM(target_dir, method="none", compile=False, enable_prefix_caching=True, kv_cache_memory=total,
              max_num_seqs=2, policy="fixed", prefix_cache_check="raise")
    exact_or_skip(llm)
    eng, pc = llm.engine, llm.engine.prefix_cache
    a = prompt(40, 31)
    short = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    first = eng.generate([(a, short)])[0]
    assert pc.num_cached_tokens == 48  # a's 51 computed positions: three blocks
    b = a[:36] + prompt(4, 32)  # shares a's first two blocks
    hit = eng.add_request(b, SamplingParams(max_tokens=20, temperature=0, logprobs=1, ignore_eos=True))
    outs = {o.request_id: o for o in eng.step()}  # its prefill: 32 positions copied from the cache
    assert eng.running[0].num_cached == 32 and pc.num_cached_tokens == 48
    other = eng.add_request(prompt(30, 33), short)  # needs a second row: the blocks must go
    evicted_while_running = False
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
        assert eng.budget.used <= total
        # a's three blocks all gone (the only ones held before `other` came; a mixed step may store
        # other's prompt in the same step)
        evicted_while_running |= pc.stats.evictions >= 3 and any(r.id == hit for r in eng.running)
    assert evicted_while_running and pc.stats.evictions >= 3
    plain = LLM(target_dir, method="none", compile=False, policy="fixed").engine
    assert_same([first, outs[hit], outs[other]],
                [plain.generate([(p, params)])[0] for p, params in
                 ((a, short), (b, SamplingParams(max_tokens=20, temperature=0, logprobs=1, ignore_eos=True)),
                  (prompt(30, 33), short))])
    assert outs[hit].num_cached_tokens == 32 and pc.stats.checks == 1 and pc.stats.check_mismatches == 0


@pytest.mark.parametrize("case", ["none", "draft"])
def test_check_mode_finds_nothing_on_a_sound_cache(target_dir, noisy_draft, case):
    kw = dict(CASES[case], compile=False, max_num_seqs=4, policy="fixed")
    if kw["method"] == "draft":
        kw["draft"] = noisy_draft
    checked = LLM(target_dir, enable_prefix_caching=True, prefix_cache_check="raise", max_num_batched_tokens=16, **kw)
    exact_or_skip(checked)
    outs = conversation(checked, GREEDY, prompt(40, 0))
    s = checked.engine.prefix_cache.stats
    assert s.checks == sum(o.num_cached_tokens > 0 for o in outs) == 2 and s.check_mismatches == 0


def _corrupt_first_cached_block(llm: LLM) -> int:
    block = next(iter(llm.engine.prefix_cache._lru.values()))  # the system prompt's first block
    with torch.inference_mode():
        block.kv[1, 0, 0, 5, 3] += 0.5  # one value of layer 1's keys at position 5: what a cache bug could do
    return block.id


def test_check_mode_catches_a_corrupted_block(target_dir, caplog):
    """A block corrupted behind the cache's back: "raise" raises on the hit; True logs it, counts
    it, evicts the bad blocks and gives the row the recomputed KV, so the output is still right."""
    from quickdraft.errors import PrefixCacheMismatch

    kw = dict(method="none", compile=False, policy="fixed", enable_prefix_caching=True)
    system, turns = prompt(40, 0), [prompt(9, 1), prompt(7, 2), prompt(11, 3)]
    strict = LLM(target_dir, prefix_cache_check="raise", **kw)
    exact_or_skip(strict)
    strict.engine.generate([(system + turns[0], GREEDY)])
    _corrupt_first_cached_block(strict)
    with pytest.raises(PrefixCacheMismatch, match="from position 5 on"):
        strict.engine.generate([(system + turns[2], GREEDY)])
    assert not strict.engine.has_unfinished()  # generate aborted it: the engine goes on

    lenient = LLM(target_dir, prefix_cache_check=True, **kw)
    lenient.engine.generate([(system + turns[0], GREEDY)])
    bad = _corrupt_first_cached_block(lenient)
    with caplog.at_level("WARNING", logger="quickdraft"):
        out = lenient.engine.generate([(system + turns[2], GREEDY)])[0]
    plain = LLM(target_dir, method="none", compile=False, policy="fixed").engine
    assert_same([out], [plain.generate([(system + turns[2], GREEDY)])[0]])
    s = lenient.engine.prefix_cache.stats
    assert out.num_cached_tokens == 32 and s.checks == 1 and s.check_mismatches == 1
    assert "differs from a fresh prefill from position 5" in caplog.text
    # the bad block and its descendants are gone; the repaired request stored sound ones in their place
    assert bad not in lenient.engine.prefix_cache._lru and len(lenient.engine.prefix_cache._chain(system, 32)) == 2
    # the next hit finds the blocks the repaired request stored: sound again
    again = lenient.engine.generate([(system + turns[1], GREEDY)])[0]
    assert again.num_cached_tokens == 32 and s.check_mismatches == 1 and s.checks == 2


def test_check_mode_settings(target_dir, monkeypatch):
    from quickdraft.config import EngineConfig, check_prefix_cache_check

    assert [check_prefix_cache_check(v) for v in (True, False, "1", "0", "", "raise", "On")] == \
        [True, False, True, False, False, "raise", True]
    with pytest.raises(QuickdraftError, match="prefix_cache_check must be"):
        check_prefix_cache_check("sometimes")
    with pytest.raises(QuickdraftError, match="turn prefix caching on"):
        EngineConfig(prefix_cache_check=True)
    monkeypatch.setenv("QUICKDRAFT_PREFIX_CACHE_CHECK", "raise")
    assert LLM(target_dir, method="none", compile=False, enable_prefix_caching=True,
               policy="fixed").engine.config.prefix_cache_check == "raise"
    assert LLM(target_dir, method="none", compile=False, policy="fixed").engine.config.prefix_cache_check is False
