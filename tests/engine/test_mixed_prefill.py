"""Mixed steps: a prefill chunk rides in the running batch's verify forward (Transformer.forward_packed),
within the step's token budget (max_num_batched_tokens, the verify positions counted). Each row keeps
its own bits: the running requests' outputs, and the long prompt's, are what each gives alone, for plain
decoding and every proposer, greedy and seeded."""

from __future__ import annotations

import random

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.cache import KVCache
from quickdraft.model.quant import row_invariant
from quickdraft.model.transformer import Block

GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)


def prompt(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(n)]


def exact_or_skip(llm: LLM) -> None:
    if not row_invariant(llm.target):
        pytest.skip("the target's matmuls are not row-invariant here (quickdraft's kernels did not build)")


def spy_packed(eng) -> list[list[tuple[int, int]]]:
    """Record each forward_packed call's blocks as (rows, tokens per row)."""
    calls: list = []
    real = eng.target.forward_packed

    def spy(blocks, cache, hidden_at=None):
        calls.append([tuple(b.input_ids.shape) for b in blocks])
        return real(blocks, cache, hidden_at)

    eng.target.forward_packed = spy
    return calls


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    """A random EAGLE-3 head for the test target (agrees with it now and then)."""
    from quickdraft.model.eagle3 import new_head, save_eagle3
    from quickdraft.model.loader import load_model

    torch.manual_seed(0)
    return save_eagle3(new_head(load_model(target_dir, dtype="float32")), tmp_path_factory.mktemp("head") / "h")


def test_packed_forward_gives_each_block_its_own_bits(target_dir):
    """A verify block (2 rows x 3 tokens), a token tree, a 20-token chunk and a 1-token row in one
    forward give the logits, hidden states and cache entries each gives in a forward of its own."""
    llm = LLM(target_dir, method="none", compile=False, policy="fixed")
    exact_or_skip(llm)
    model = llm.target
    torch.manual_seed(0)
    V = model.config.vocab_size

    context = torch.randint(0, V, (5, 12))

    def filled() -> KVCache:  # every row holds 12 positions of context
        c = KVCache.for_model(model, 5, 64)
        model(context, None, c.rows(0, 5), kv_len=12)
        return c

    verify = Block(torch.randint(0, V, (2, 3)), 12 + torch.arange(3).expand(2, 3), 0, 15)
    slots = torch.tensor([[12, 13, 14]])  # a tree: the root and two siblings at one position
    mask = torch.arange(15)[None, None] <= torch.tensor([[12, 12, 12]])[..., None]
    mask = mask | (torch.arange(15) == slots[..., None])
    tree = Block(torch.randint(0, V, (1, 3)), torch.tensor([[12, 13, 13]]), 2, 15, slots, mask)
    chunk = Block(torch.randint(0, V, (1, 20)), 12 + torch.arange(20)[None], 3, 32, logits_at=torch.tensor([[19]]))
    one = Block(torch.randint(0, V, (1, 1)), torch.tensor([[12]]), 4, 13)
    blocks = [verify, tree, chunk, one]
    layers = (0, model.config.num_hidden_layers)
    packed_cache = filled()
    packed = model.forward_packed(blocks, packed_cache.rows(0, 5), hidden_at=layers)
    alone_cache = filled()
    for blk, (logits, hidden) in zip(blocks, packed):
        b = blk.input_ids.shape[0]
        want, want_hidden = model.forward_hidden(blk.input_ids, blk.positions, alone_cache.rows(blk.row, blk.row + b),
                                                 logits_at=blk.logits_at, kv_len=blk.kv_len, slots=blk.slots,
                                                 attn_mask=blk.attn_mask, hidden_at=layers)
        assert torch.equal(logits, want) and torch.equal(hidden, want_hidden)
    for a, b in zip(packed_cache.k + packed_cache.v, alone_cache.k + alone_cache.v):
        assert torch.equal(a[:, :, :32], b[:, :, :32])


CASES = {
    "none": dict(method="none"),
    "draft": dict(method="draft", num_speculative_tokens=3),
    "draft-tree": dict(method="draft", num_speculative_tokens=3, spec_options={"tree_width": 2}),
    "eagle3": dict(method="eagle3", num_speculative_tokens=3),
    "eagle3-tree": dict(method="eagle3", num_speculative_tokens=3, spec_options={"tree_width": 2, "tree_nodes": 4}),
    # (its global store of finished outputs follows the order requests finish in, which any other
    # request arriving changes: off, so that a request's own drafts are compared)
    "suffix": dict(method="suffix", num_speculative_tokens=3, spec_options={"global_max_tokens": 0}),
    "ngram": dict(method="ngram", num_speculative_tokens=3),
    "lookahead": dict(method="lookahead", num_speculative_tokens=3),
}


def _llm(target_dir, noisy_draft, head_dir, case: str, **kw) -> LLM:
    spec = dict(CASES[case])
    draft = {"draft": noisy_draft, "eagle3": head_dir}.get(spec["method"])
    return LLM(target_dir, draft=draft, compile=False, policy="fixed", **{"max_num_seqs": 4, **spec, **kw})


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_long_prompt_arriving_changes_no_running_output(target_dir, noisy_draft, head_dir, case, params):
    """Two requests decode; a long prompt arrives and is prefilled in chunks that ride in their steps.
    Every output (tokens, logprobs, drafted and accepted counts) is what the request gives alone."""
    llm = _llm(target_dir, noisy_draft, head_dir, case, max_num_batched_tokens=32)
    exact_or_skip(llm)
    eng = llm.engine
    calls = spy_packed(eng)
    short = [prompt(10, 1), prompt(13, 2)]
    ids = [eng.add_request(p, params) for p in short]
    eng.step()  # their prefill
    eng.step()
    long_ = prompt(100, 3)
    ids.append(eng.add_request(long_, SamplingParams(**{**vars(params), "max_tokens": 6})))
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert len(calls) >= 3  # the long prompt's chunks rode in decode steps
    alone = _llm(target_dir, noisy_draft, head_dir, case, max_num_batched_tokens=None).engine
    for rid, p, max_tokens in zip(ids, short + [long_], (16, 16, 6)):
        ref = alone.generate([(p, SamplingParams(**{**vars(params), "max_tokens": max_tokens}))])[0]
        got = outs[rid]
        assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs
        assert (got.stats.num_draft_tokens, got.stats.num_accepted_tokens) == (ref.stats.num_draft_tokens,
                                                                               ref.stats.num_accepted_tokens)


def test_the_budget_counts_the_verify_positions_and_the_chunk(target_dir, noisy_draft, head_dir):
    """Every mixed forward holds at most max_num_batched_tokens positions: the running rows' k + 1
    each, the rest for the chunk; a step whose verify leaves less than half the budget verifies
    alone and the next one prefills a whole budget (the alternation)."""
    llm = _llm(target_dir, noisy_draft, head_dir, "draft", max_num_batched_tokens=24, max_num_seqs=5)
    exact_or_skip(llm)
    eng = llm.engine
    calls = spy_packed(eng)
    prefills = []
    real = eng._prefill
    eng._prefill = lambda: prefills.append(len(eng.running)) or real()
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)

    def arrive(*prompts):
        for p in prompts:
            eng.add_request(p, params)
        while eng.prefilling or eng.waiting:
            eng.step()

    arrive(prompt(10, 1))
    assert prefills == [0] and not calls  # nothing running: a prefill step
    arrive(prompt(50, 2))
    assert calls[0] == [(1, 4), (1, 20)]  # k + 1 = 4 verify positions, 20 prompt tokens
    assert prefills == [0] and len(calls) == 3  # 50 tokens: 20 + 20 + 10, each in a decode step
    arrive(prompt(20, 3))  # two rows verify 8 positions: 16 left for the chunk
    assert calls[3:] == [[(2, 4), (1, 16)], [(2, 4), (1, 4)]]
    arrive(prompt(30, 4))  # three rows: 12 left, half the budget: still mixed
    assert calls[5:] == [[(3, 4), (1, 12)]] * 2 + [[(3, 4), (1, 6)]]
    assert all(sum(b * t for b, t in c) <= 24 for c in calls)
    arrive(prompt(40, 5))  # four rows verify 16: 8 left, under half: a decode step, then a chunk of 24
    assert len(calls) == 8 and prefills == [0, 4, 4]
    assert len(eng.running) == 5 and all(not r.finished for r in eng.running)


def test_auto_budget_prefills_a_lone_prompt_in_large_chunks_and_a_late_one_in_small(target_dir, monkeypatch):
    """max_num_batched_tokens="auto" (the default): with nothing decoding a prompt is prefilled in
    chunks of AUTO_BATCHED_TOKENS[1] (no stream to keep flowing; small chunks only cost time to the
    first token), and one arriving while a request decodes rides in its steps within
    AUTO_BATCHED_TOKENS[0] tokens; outputs are the same as with whole prompts."""
    from quickdraft.config import AUTO_BATCHED_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS

    assert DEFAULT_MAX_NUM_BATCHED_TOKENS == "auto" and AUTO_BATCHED_TOKENS[0] < AUTO_BATCHED_TOKENS[1]
    busy, idle = 12, 100  # the test model's context is short: the same rule at a smaller scale
    monkeypatch.setattr("quickdraft.engine.AUTO_BATCHED_TOKENS", (busy, idle))
    llm = LLM(target_dir, method="none", compile=False, policy="fixed")
    exact_or_skip(llm)
    eng = llm.engine
    calls = spy_packed(eng)
    chunks = []
    real = eng._prefill
    eng._prefill = lambda: chunks.append(eng._token_budget()) or real()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = prompt(idle + 30, 1)
    a = eng.add_request(first, params)
    eng.step()
    assert chunks == [idle] and not calls  # a prefill step of `idle` tokens, nothing running
    while eng.prefilling:
        eng.step()
    assert chunks == [idle, idle]  # the rest (30 tokens) in a second prefill step
    late = prompt(3 * busy, 2)
    b = eng.add_request(late, params)
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert calls and all(sum(r * t for r, t in c) <= busy for c in calls)  # mixed steps within `busy` tokens
    whole = LLM(target_dir, method="none", compile=False, policy="fixed", max_num_batched_tokens=None).engine
    assert [outs[a].token_ids, outs[b].token_ids] == [o.token_ids for o in whole.generate([(first, params),
                                                                                           (late, params)])]


def test_max_num_batched_tokens_values():
    from quickdraft.config import EngineConfig, check_max_num_batched_tokens
    from quickdraft.errors import QuickdraftError

    assert [check_max_num_batched_tokens(v) for v in ("auto", None, 64, "64")] == ["auto", None, 64, 64]
    assert EngineConfig(max_num_batched_tokens="32").max_num_batched_tokens == 32
    for bad in (0, -3, "many", 2.5, "0"):
        with pytest.raises(QuickdraftError, match="max_num_batched_tokens"):
            check_max_num_batched_tokens(bad)


def test_whole_prompts_ride_in_a_step_without_a_budget(target_dir):
    llm = LLM(target_dir, method="none", compile=False, policy="fixed", max_num_batched_tokens=None)
    exact_or_skip(llm)
    eng = llm.engine
    calls = spy_packed(eng)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eng.add_request(prompt(10, 1), params)
    eng.step()
    long_ = prompt(70, 2)
    rid = eng.add_request(long_, params)
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert calls[0] == [(1, 1), (1, 70)]
    assert outs[rid].token_ids == LLM(target_dir, method="none", compile=False, policy="fixed").engine.generate(
        [(long_, params)])[0].token_ids


def test_abort_during_mixed_steps_frees_the_row(target_dir):
    """A long prompt aborted between two mixed steps leaves its row; the running request goes on
    with the output it has alone."""
    llm = LLM(target_dir, method="none", compile=False, policy="fixed", max_num_batched_tokens=16,
              enable_prefix_caching=True)
    exact_or_skip(llm)
    eng = llm.engine
    calls = spy_packed(eng)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    running = eng.add_request(prompt(10, 1), params)
    eng.step()
    long_ = eng.add_request(prompt(100, 2), params)
    eng.step()
    eng.step()
    assert len(calls) == 2 and len(eng.prefilling) == 1 and eng.prefilling[0].num_computed == 30
    eng.abort_request(long_)
    assert not eng.prefilling and [r.id for r in eng.running] == [running]
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert outs[running].token_ids == LLM(target_dir, method="none", compile=False, policy="fixed").engine.generate(
        [(prompt(10, 1), params)])[0].token_ids


def test_compiled_steps_alternate(target_dir):
    """A step that is not the eager model and has no packed package (torch.compile'd, tensor
    parallel; AOT steps with theirs mix: tests/engine/test_aot.py) cannot take a chunk of another
    shape: prefill and decode steps alternate there."""
    llm = LLM(target_dir, method="none", compile=False, policy="fixed", max_num_batched_tokens=16)
    exact_or_skip(llm)
    eng = llm.engine
    assert eng.mixes_prefill()
    eng._forward = lambda *a, **kw: eng.target(*a, **kw)  # what a compiled step looks like to the engine
    assert not eng.mixes_prefill()
    calls = spy_packed(eng)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    running = eng.add_request(prompt(10, 1), params)
    eng.step()
    eng.add_request(prompt(40, 2), params)
    fed = [running in {o.request_id for o in eng.step()} for _ in range(6)]
    assert not calls and fed == [True, False, True, False, True, False]  # a decode step, a chunk, ...


@pytest.mark.parametrize("case", ["none", "eagle3"])
def test_prompt_logprobs_of_a_prompt_prefilled_in_mixed_steps(target_dir, noisy_draft, head_dir, case):
    """Prompt logprobs read every chunk position's final states from the mixed forward (with the
    head's states beside them for EAGLE-3): the same as a whole prefill's."""
    llm = _llm(target_dir, noisy_draft, head_dir, case, max_num_batched_tokens=24)
    exact_or_skip(llm)
    eng = llm.engine
    calls = spy_packed(eng)
    eng.add_request(prompt(10, 1), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eng.step()
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=1, prompt_logprobs=2, ignore_eos=True)
    rid = eng.add_request(prompt(60, 2), params)
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert len(calls) >= 3
    ref = _llm(target_dir, noisy_draft, head_dir, case, max_num_batched_tokens=None).engine.generate(
        [(prompt(60, 2), params)])[0]
    got = outs[rid]
    assert got.prompt_logprobs == ref.prompt_logprobs and len(got.prompt_logprobs) == 60
    assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs


def test_auto_budget_weighs_a_chunk_by_its_position(target_dir):
    """"auto" while requests decode counts a prompt token at position p as 1 + p / P (P: where its
    attention costs what its linear layers do), so chunks shrink as the prompt grows; a number
    given is a plain count of tokens; the output is the whole prefill's."""
    from quickdraft.config import AUTO_ATTENTION_COST, AUTO_BATCHED_TOKENS
    from quickdraft.engine import _weighted_chunk, attention_position

    assert _weighted_chunk(0, 100, 10, 10.0) == (7, pytest.approx(9.1))  # 1.0 + 1.1 + ... + 1.6 (+ 1.7 > 10)
    assert _weighted_chunk(50, 100, 3, 10.0) == (1, 6.0)  # always one token, even past the budget
    assert _weighted_chunk(0, 3, 10, 10.0) == (3, pytest.approx(3.3))
    llm = LLM(target_dir, method="none", compile=False, policy="fixed")
    exact_or_skip(llm)
    eng = llm.engine
    P = attention_position(llm.target.config)
    assert P == pytest.approx(36864 / (AUTO_ATTENTION_COST * 128))  # the test model: 36,864 multiply-adds per token in its linears, 128 per key in attention
    calls = spy_packed(eng)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = eng.add_request(prompt(10, 1), params)
    eng.step()
    long_ = prompt(200, 2)
    rid = eng.add_request(long_, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    sizes = [c[1][1] for c in calls]
    start = 0
    for n in sizes:  # each chunk the longest within the budget left beside the running row's token
        assert n == _weighted_chunk(start, 200 - start, AUTO_BATCHED_TOKENS[0] - 1, P)[0]
        start += n
    assert start == 200 and sizes[0] > sizes[-2] >= 1
    whole = LLM(target_dir, method="none", compile=False, policy="fixed", max_num_batched_tokens=None).engine
    assert outs[rid].token_ids == whole.generate([(long_, SamplingParams(max_tokens=4, temperature=0,
                                                                          ignore_eos=True))])[0].token_ids
    assert outs[first].token_ids == whole.generate([(prompt(10, 1), params)])[0].token_ids
