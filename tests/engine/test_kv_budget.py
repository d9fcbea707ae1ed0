"""The KV memory budget (quickdraft.cache.KVBudget): caches that grow as requests arrive and
shrink when idle, bounded by kv_cache_memory, without changing a single token or logprob."""

from __future__ import annotations

import pytest

from quickdraft import LLM, QuickdraftError, SamplingParams
from quickdraft.cache import KVCache, row_bytes
from quickdraft.config import EngineConfig, check_kv_cache_memory
from quickdraft.errors import ContextLengthError

# (after, prompt, params): `after` = (j, n): it arrives once request j has n output tokens (or
# finished). Different lengths, so rows and positions both grow; the last four arrive when
# request 3 holds ~280 positions, so the growth they cause copies a long row.
ARRIVALS = [
    (None, [0, 5, 7, 9, 11], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)),
    ((0, 3), [0, 3], SamplingParams(temperature=0, max_tokens=90, ignore_eos=True, logprobs=2)),
    ((0, 6), [0] + list(range(20, 60)), SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True,
                                                       logprobs=1)),
    ((1, 10), [0, 10, 11, 12], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, logprobs=2)),
] + [((3, 280), [0, 4 + i, 4, 4], SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True, logprobs=1))
     for i in range(4)]


def _run(engine, arrivals=ARRIVALS):
    """Feed the requests as their conditions come true; returns the final outputs in order
    and the caches' (rows, positions) after every step where some request was running before it."""
    ids, outs, shapes = [], {}, []
    pending = list(arrivals)

    def due(after) -> bool:
        if after is None:
            return True
        out = outs.get(ids[after[0]])
        return out is not None and (out.finished or len(out.token_ids) >= after[1])

    while pending or engine.has_unfinished():
        while pending and due(pending[0][0]):
            _, prompt, params = pending.pop(0)
            ids.append(engine.add_request(prompt, params))
        running = engine.num_running
        for out in engine.step():
            outs[out.request_id] = out
        if running:
            shapes.append((engine.cache.max_slots, engine.cache.capacity))
    return [outs[i] for i in ids], shapes


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.logprobs == y.logprobs  # bit for bit: growth copies the cache exactly


@pytest.fixture(scope="module")
def eagle3_head(target_dir, tmp_path_factory):
    from quickdraft.model.eagle3 import new_head, save_eagle3
    from quickdraft.model.loader import load_model

    return save_eagle3(new_head(load_model(target_dir, dtype="float32")), tmp_path_factory.mktemp("head") / "h")


@pytest.mark.parametrize("method", ["none", "draft", "draft-tree", "eagle3"])
def test_growth_mid_run_changes_no_token_or_logprob(target_dir, draft_dir, eagle3_head, method, monkeypatch):
    """Requests arriving while others run make the caches (the target's and the proposer's)
    grow under the running rows; every token and logprob equals a run whose caches were sized
    for everything from the start (same arrivals, same batches). Every cache on zero pages (the
    test model's are smaller than a real model's, which take them by size)."""
    monkeypatch.setattr("quickdraft.cache.ZERO_PAGES_MIN_BYTES", 0)
    kw = dict(none=dict(method="none"), draft=dict(draft=draft_dir, num_speculative_tokens=3),
              eagle3=dict(draft=eagle3_head, method="eagle3", num_speculative_tokens=3),
              **{"draft-tree": dict(draft=draft_dir, num_speculative_tokens=3, spec_options={"tree_width": 2})})[method]
    grown = LLM(target_dir, max_num_seqs=8, policy="fixed", **kw).engine
    outs, shapes = _run(grown)
    assert len(set(shapes)) >= 3, shapes  # grew more than once while requests ran
    assert shapes[0][0] == 1 and shapes[-1][0] == 8

    fixed = LLM(target_dir, max_num_seqs=8, policy="fixed", **kw).engine
    fixed._size_cache(8, fixed._full_capacity())  # the largest caches, before any request
    ref, ref_shapes = _run(fixed)
    assert set(ref_shapes) == {(8, fixed._full_capacity())}
    _same(outs, ref)


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_the_proposers_cache_grows_its_rows_within_the_reservation(target_dir, draft_dir, eagle3_head, method,
                                                                  monkeypatch):
    """The engine's first allocation reserves the address space of as many rows as the budget
    affords for the proposer's cache too (a draft model's, an EAGLE-3 head's), so that admitting
    requests later grows its rows as a view of the same memory, not a copy under running rows."""
    monkeypatch.setattr("quickdraft.cache.ZERO_PAGES_MIN_BYTES", 0)
    kw = dict(draft=dict(draft=draft_dir), eagle3=dict(draft=eagle3_head, method="eagle3"))[method]
    engine = LLM(target_dir, max_num_seqs=8, policy="fixed", num_speculative_tokens=3, **kw).engine
    engine._size_cache(1, 64)
    own = engine.proposer.cache
    assert engine.cache.reserve_rows == own.reserve_rows == 8 and own.max_slots == 1
    where = [t.data_ptr() for t in own.k + own.v]
    engine._size_cache(3, 64)  # more rows at the same capacity
    assert engine.proposer.cache is own and own.max_slots == engine.cache.max_slots == 4
    assert [t.data_ptr() for t in own.k + own.v] == where
    # a new capacity copies, and reserves as many rows as the budget affords there (not the old bytes'
    # worth), so that the next rows admitted are views again, the target's and the proposer's
    engine._size_cache(4, 512)
    assert engine.cache.reserve_rows == own.reserve_rows == 8 and engine.cache.capacity == own.capacity == 512
    where = [t.data_ptr() for t in engine.cache.k + engine.cache.v + own.k + own.v]
    engine._size_cache(5, 512)
    assert own.max_slots == engine.cache.max_slots == 8
    assert [t.data_ptr() for t in engine.cache.k + engine.cache.v + own.k + own.v] == where


def test_cpu_caches_take_zero_pages_and_growth_copies_the_cached_positions_only():
    """A CPU cache of a real model's size is the operating system's zero pages (nothing filled,
    memory taken where written); growing it keeps the kept rows' cached positions bit for bit,
    and the rest reads zero."""
    import torch

    from quickdraft.cache import ZERO_PAGES_MIN_BYTES, zeros

    big = zeros((2, 3, 1025, 64), torch.float32, "cpu")  # 1.5 MiB
    assert big.nbytes >= ZERO_PAGES_MIN_BYTES and not big.any() and big.is_contiguous()
    other = zeros((2, 3, 1025, 64), torch.float32, "cpu")
    big[1, 2, 1000] = 3.0
    assert big.sum() == 64 * 3.0 and not other.any()  # memory of its own
    assert torch.equal(zeros((2, 3), torch.bfloat16, "cpu"), torch.zeros(2, 3, dtype=torch.bfloat16))
    cache = KVCache(2, 2, 3, 1024, 64, torch.float32, "cpu")
    for t in cache.k + cache.v:
        t.normal_()
    before = [t.clone() for t in cache.k + cache.v]
    cache.resize(4, 2048, keep=2, length=700)
    for old, new in zip(before, cache.k + cache.v):
        assert new.shape == (4, 3, 2049, 64)
        assert torch.equal(new[:2, :, :700], old[:2, :, :700])
        assert not new[:2, :, 700:].any() and not new[2:].any()


def test_rows_grow_within_the_reservation_without_a_copy():
    """A cache with reserved rows grows its rows at the same capacity as a view of the same memory
    (no copy: the kept rows' entries stay where they are), the new rows read zero; past the
    reservation, or at a new capacity, it copies the kept positions as before."""
    import torch

    cache = KVCache(2, 2, 3, 1024, 64, torch.float32, "cpu", reserve_rows=8)
    for t in cache.k + cache.v:
        t.normal_()
    before = [t.clone() for t in cache.k + cache.v]
    where = [t.data_ptr() for t in cache.k + cache.v]
    cache.resize(4, 1024, keep=2, length=700)
    assert [t.data_ptr() for t in cache.k + cache.v] == where
    for old, new in zip(before, cache.k + cache.v):
        assert new.shape == (4, 3, 1025, 64) and new.is_contiguous()
        assert torch.equal(new[:2], old) and not new[2:].any()
    cache.k[0][3, 1, 5] = 2.0  # the new rows are the cache's own memory
    assert cache.k[0][3, 1, 5, 0] == 2.0
    cache.resize(16, 1024, keep=4, length=700)  # past the reservation: a copy
    assert cache.k[0].data_ptr() != where[0] and cache.k[0].shape == (16, 3, 1025, 64)
    assert torch.equal(cache.k[1][:2, :, :700], before[1][:, :, :700]) and cache.k[0][3, 1, 5, 0] == 2.0
    assert not cache.k[1][:2, :, 700:].any() and not cache.k[1][4:].any()
    cache.resize(16, 2048, keep=16, length=700)  # a new capacity: a copy
    assert cache.k[0].shape == (16, 3, 2049, 64) and cache.k[0][3, 1, 5, 0] == 2.0


def test_a_reservation_the_os_refuses_falls_back_to_the_rows_alone(monkeypatch):
    """Strict overcommit accounting may refuse the reserved address space (mmap's ENOMEM): the
    cache then holds its rows alone and grows them by copying, exactly."""
    import torch

    from quickdraft import cache as cache_module

    real = cache_module.anonymous
    row = 3 * 1025 * 64 * 4

    def refusing(size):
        if size > 4 * row:
            raise OSError(12, "Cannot allocate memory")
        return real(size)

    monkeypatch.setattr(cache_module, "anonymous", refusing)
    cache = KVCache(2, 2, 3, 1024, 64, torch.float32, "cpu", reserve_rows=8)
    assert cache.reserve_rows == 0 and all(t.shape[0] == 2 for t in cache.k + cache.v)
    for t in cache.k + cache.v:
        t.normal_()
    before = [t.clone() for t in cache.k + cache.v]
    cache.resize(4, 1024, keep=2, length=1024)
    assert all(new.shape[0] == 4 and torch.equal(new[:2, :, :1024], old[:, :, :1024]) and not new[2:].any()
               for old, new in zip(before, cache.k + cache.v))  # (the trash column is never kept)
    with pytest.raises(OSError):
        cache.resize(8, 1024, keep=4)  # the rows themselves refused: the error stands
    monkeypatch.setattr(cache_module, "anonymous", real)
    cache = KVCache(2, 2, 3, 1024, 64, torch.float32, "cpu", reserve_rows=4)
    for t in cache.k + cache.v:
        t.normal_()
    before = [t.clone() for t in cache.k + cache.v]
    limit = 3 * 3 * 513 * 64 * 4  # three rows of 512 positions: the reservation of 7 is refused at a new capacity
    monkeypatch.setattr(cache_module, "anonymous", lambda size: real(size) if size <= limit else refusing(1 << 40))
    cache.resize(2, 512, keep=2, length=512)
    assert cache.reserve_rows == 0 and all(t.shape == (2, 3, 513, 64) for t in cache.k + cache.v)
    assert all(torch.equal(new[:, :, :512], old[:, :, :512]) for old, new in zip(before, cache.k + cache.v))


def test_caches_stay_within_the_budget_and_requests_wait(target_dir, draft_dir):
    """A budget holding about two of these requests: the others wait in the queue (none is
    refused), memory never exceeds the budget, and the output is what an unbounded run gives."""
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    prompts = [[0, 3 + i, 5, 7 + i] for i in range(5)]
    probe = LLM(target_dir, draft=draft_dir, num_speculative_tokens=3, policy="fixed").engine
    need = probe._capacity_needed(type("R", (), {"prompt": prompts[0], "params": params})())
    budget = 2 * row_bytes(probe.budget.token_bytes, need) + probe.budget.token_bytes * 50
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=3, kv_cache_memory=budget, policy="fixed")
    engine = llm.engine
    assert engine.budget.total == budget
    ids = [engine.add_request(p, params) for p in prompts]
    most, done = 0, {}
    while engine.has_unfinished():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        most = max(most, engine.num_running)
        held = engine.cache.nbytes() + engine.proposer.cache.nbytes()
        assert held == engine.kv_cache_bytes() <= budget
    assert most == 2
    ref = LLM(target_dir, draft=draft_dir, num_speculative_tokens=3, policy="fixed").generate(prompts, params)
    assert [done[i] for i in ids] == [o.token_ids for o in ref]


def test_idle_engine_holds_no_cache_until_asked(target_dir, draft_dir):
    llm = LLM(target_dir, draft=draft_dir, policy="fixed")
    engine = llm.engine
    assert engine.cache is None and engine.kv_cache_bytes() == 0  # nothing before the first request
    llm.generate([[0, 5, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert 0 < engine.kv_cache_bytes() == engine.cache.nbytes() + engine.proposer.cache.nbytes()
    engine.release_caches()  # what a server does whenever it goes idle
    assert engine.cache is None and engine.proposer.cache is None and engine.kv_cache_bytes() == 0
    again = llm.generate([[0, 5, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(again[0].token_ids) == 8


def test_bytes_per_token_counts_the_proposers_cache(target_dir, draft_dir, eagle3_head):
    plain = LLM(target_dir, method="none", policy="fixed").engine
    cfg = plain.target.config
    assert plain.budget.token_bytes == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    spec = LLM(target_dir, draft=draft_dir, policy="fixed").engine
    assert spec.budget.token_bytes == plain.budget.token_bytes + KVCache.token_bytes(spec.proposer.model)
    head = LLM(target_dir, draft=eagle3_head, method="eagle3", policy="fixed").engine
    hc = head.proposer.head.config
    assert head.budget.token_bytes == plain.budget.token_bytes + 2 * hc.num_key_value_heads * hc.head_dim * 4
    ngram = LLM(target_dir, method="ngram", policy="fixed").engine
    assert ngram.budget.token_bytes == plain.budget.token_bytes


def test_max_model_len_follows_the_budget_and_errors_name_both_numbers(target_dir):
    full = LLM(target_dir, method="none", policy="fixed").engine
    assert full.max_model_len == full.target.config.max_position_embeddings == 512  # the default budget holds it
    tb = full.budget.token_bytes
    small = LLM(target_dir, method="none", kv_cache_memory=tb * 201, policy="fixed").engine
    assert small.max_model_len == 199  # 201 positions: 1 trash column, 1 past the last token
    with pytest.raises(ContextLengthError) as e:
        small.add_request([0, 1, 2, 3, 4], SamplingParams(max_tokens=195))
    assert "200" in str(e.value) and "199" in str(e.value) and e.value.field == "max_tokens"
    with pytest.raises(QuickdraftError) as e:
        LLM(target_dir, method="none", kv_cache_memory=tb * 201, max_model_len=300, policy="fixed")
    assert e.value.field == "max_model_len" and "300" in str(e.value) and "199" in str(e.value)
    with pytest.raises(QuickdraftError) as e:
        LLM(target_dir, method="none", kv_cache_memory=1000, policy="fixed")
    assert e.value.field == "kv_cache_memory"
    half = LLM(target_dir, method="none", kv_cache_memory="0.5", policy="fixed").engine
    assert half.budget.total > 0


@pytest.mark.parametrize("text, value", [("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1e9", 10**9),
                                         ("0.5", 0.5), (0.25, 0.25), (123456, 123456), ("2 g", 2 * 2**30)])
def test_kv_cache_memory_values(text, value):
    assert check_kv_cache_memory(text) == value
    assert EngineConfig(kv_cache_memory=text).kv_cache_memory == value


@pytest.mark.parametrize("bad", ["", "lots", "0", "-1GB", "0.0", 0, 1.5, True, "3 parsecs", [1]])
def test_bad_kv_cache_memory_is_a_clear_error(bad):
    with pytest.raises(QuickdraftError, match="kv_cache_memory must be"):
        check_kv_cache_memory(bad)


def test_caches_allocated_once_hold_what_the_budget_affords(target_dir):
    """The GPU server's layout (preallocate, static shapes for CUDA graphs), run here on the CPU by
    setting the engine's flag: as many rows of max_model_len as the budget holds, allocated at the
    first request and never resized; more requests wait for a row."""
    probe = LLM(target_dir, method="none", policy="fixed").engine
    budget = 2 * row_bytes(probe.budget.token_bytes, 513) + 1000  # two rows of the whole 512-token context
    llm = LLM(target_dir, method="none", kv_cache_memory=budget, max_num_seqs=4, policy="fixed")
    engine = llm.engine
    engine.fixed_size = True
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[0, 3 + i, 5] for i in range(3)]
    ids = [engine.add_request(p, params) for p in prompts]
    done, shapes, most = {}, set(), 0
    while engine.has_unfinished():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        shapes.add((engine.cache.max_slots, engine.cache.capacity))
        most = max(most, engine.num_running)
    assert shapes == {(2, 513)} and most == 2
    engine.release_caches()
    assert engine.cache is not None  # kept: its shape and addresses are what the compiled steps captured
    ref = LLM(target_dir, method="none", policy="fixed").generate(prompts, params)
    assert [done[i] for i in ids] == [o.token_ids for o in ref]
