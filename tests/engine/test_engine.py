"""Lossless suite, engine level: speculative output vs plain decoding, stopping, stats, errors."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, QuickdraftError, SamplingParams
from quickdraft.errors import ContextLengthError

PROMPTS = [[0, 5, 7, 9, 11], [0, 3], [0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(target_dir):
    return LLM(target_dir, method="none")


@pytest.fixture(scope="module")
def plain_out(plain):
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def test_plain_decoding_matches_transformers_generate(target_dir, plain_out):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for prompt, ours in zip(PROMPTS, plain_out):
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
        assert out[0, len(prompt):].tolist() == ours


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_plain_batched(target_dir, draft_dir, plain_out, k):
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=k, policy="fixed")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_out
    assert llm.stats.num_draft_tokens > 0


def test_greedy_speculative_equals_plain_batch1(target_dir, draft_dir, plain_out):
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=4, policy="fixed")
    for prompt, expected in zip(PROMPTS, plain_out):
        assert llm.generate([prompt], GREEDY)[0].token_ids == expected


def test_greedy_equal_with_a_partly_agreeing_draft(target_dir, ckpt_factory, plain_out):
    """A draft that agrees often (the target with noise on its weights) exercises ragged
    acceptance: rows accept different counts in the same step."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = ckpt_factory("noisy", seed=0, layers=2)
    shutil.copy(target_dir / "model.safetensors", folder / "model.safetensors")
    w = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    w = {n: t + 0.003 * torch.randn(t.shape, generator=g) for n, t in w.items()}
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(target_dir, draft=folder, num_speculative_tokens=5, policy="fixed")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_out
    rate = llm.stats.acceptance_rate
    assert 0.05 < rate < 0.999, rate  # partial acceptance, so ragged rows were exercised


def test_draft_equal_to_target_accepts_everything(target_dir):
    k = 4
    llm = LLM(target_dir, draft=target_dir, num_speculative_tokens=k, policy="fixed")
    # prefill emits 1 token, then each step k + 1: 1 + 6 * 5 tokens is a whole number of steps
    params = SamplingParams(temperature=0, max_tokens=1 + 6 * (k + 1), ignore_eos=True)
    llm.generate(PROMPTS, params)
    assert llm.stats.acceptance_rate == 1.0
    assert llm.stats.mean_acceptance_length == k + 1
    assert llm.stats.accepted_per_pos == [18] * k


def test_sampled_speculative_is_seeded_and_valid(target_dir, draft_dir):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, max_tokens=30, seed=7, ignore_eos=True)
    a = LLM(target_dir, draft=draft_dir, policy="fixed").generate(PROMPTS, params)
    b = LLM(target_dir, draft=draft_dir, policy="fixed").generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    other = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, max_tokens=30, seed=8, ignore_eos=True)
    c = LLM(target_dir, draft=draft_dir, policy="fixed").generate(PROMPTS, other)
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    assert all(len(o.token_ids) == 30 for o in a)


def test_per_prompt_params_and_mixed_batch(target_dir, draft_dir, plain_out):
    """A greedy row next to sampled rows still equals plain greedy decoding."""
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=3, policy="fixed")
    params = [GREEDY, SamplingParams(temperature=1.0, max_tokens=10, seed=1, ignore_eos=True),
              SamplingParams(temperature=0.5, max_tokens=25, ignore_eos=True)]
    outs = llm.generate(PROMPTS, params)
    assert outs[0].token_ids == plain_out[0]
    assert [len(o.token_ids) for o in outs] == [40, 10, 25]


def test_max_tokens_inside_an_accepted_run(target_dir, plain_out):
    llm = LLM(target_dir, draft=target_dir, num_speculative_tokens=8, policy="fixed")
    for n in (1, 2, 5, 11):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert [o.token_ids for o in outs] == [p[:n] for p in plain_out]
        assert all(o.finish_reason == "length" and o.stats.num_output_tokens == n for o in outs)


def test_eos_inside_an_accepted_run(target_dir, plain_out):
    llm = LLM(target_dir, draft=target_dir, num_speculative_tokens=8, policy="fixed")
    expected = plain_out[0]
    eos = expected[6]
    cut = expected.index(eos) + 1
    llm.engine.eos_token_ids = frozenset({eos})
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.token_ids == expected[:cut] and out.finish_reason == "stop"
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert out.token_ids == expected


def test_stop_string_inside_an_accepted_run(target_dir):
    llm = LLM(target_dir, draft=target_dir, num_speculative_tokens=8, policy="fixed")
    full = llm.generate(["def add(a, b):"], GREEDY)[0]
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True))[0]
    idx = text.index(stop)
    assert out.text == text[:idx]
    assert out.finish_reason == "stop"
    assert full.token_ids[:len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(full.token_ids)


def test_streaming_deltas_add_up(target_dir, draft_dir):
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=3, policy="fixed")
    pieces, ids, last = [], [], None
    for o in llm.stream("def add(a, b):", GREEDY):
        pieces.append(o.new_text)
        ids.extend(o.new_token_ids)
        last = o
    assert last.finished and "".join(pieces) == last.text and ids == last.token_ids


def test_streamed_figures_count_the_engine_time_only(target_dir, draft_dir, monkeypatch):
    """A streamed run's elapsed time is the engine's, not the caller's between outputs (the CLI
    prints them while plain decoding's run, timed with generate, prints nothing): a clock that only
    the consumer advances leaves it at zero."""
    import quickdraft.llm as llm_module

    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=3, policy="fixed")
    now = [1000.0]
    monkeypatch.setattr(llm_module.time, "perf_counter", lambda: now[0])
    outs = 0
    for o in llm.stream("def add(a, b):", GREEDY):
        now[0] += 5.0  # the caller's time with each output
        outs += 1
    assert outs > 1 and o.finished
    assert llm.stats.elapsed_s == 0.0
    assert llm.stats.num_output_tokens == len(o.token_ids)


def test_stats_fields(target_dir, draft_dir):
    llm = LLM(target_dir, draft=draft_dir, num_speculative_tokens=3, policy="fixed")
    outs = llm.generate(PROMPTS, GREEDY)
    s = llm.stats
    assert s.num_output_tokens == sum(len(o.token_ids) for o in outs) == 120
    assert s.num_draft_tokens == sum(o.stats.num_draft_tokens for o in outs)
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert s.tokens_per_step == pytest.approx(1 + s.num_accepted_tokens / s.num_steps)
    assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
    assert s.tokens_per_second > 0


def test_bad_inputs(target_dir, draft_dir, ckpt_factory, tmp_path):
    llm = LLM(target_dir, method="none")
    # each error about a request carries its field (the server names it in its 400)
    with pytest.raises(QuickdraftError, match="empty") as info:
        llm.generate([[]], GREEDY)
    assert info.value.field == "prompt"
    with pytest.raises(QuickdraftError, match=r"\[0, 384\)") as info:
        llm.generate([[0, 999]], GREEDY)
    assert info.value.field == "prompt"
    with pytest.raises(ContextLengthError, match="512") as info:
        llm.generate([[0, 1]], SamplingParams(max_tokens=600))
    assert info.value.field == "max_tokens"
    with pytest.raises(ContextLengthError, match="512") as info:  # no max_tokens could fit: the prompt's fault
        llm.generate([[0] * 512], SamplingParams(max_tokens=1))
    assert info.value.field == "prompt"
    with pytest.raises(QuickdraftError, match="logit_bias") as info:
        llm.generate([[0, 1]], SamplingParams(logit_bias={384: 1.0}))
    assert info.value.field == "logit_bias"
    with pytest.raises(QuickdraftError, match="num_speculative_tokens") as info:
        llm.engine.check_request([0, 1], GREEDY, num_speculative_tokens=1)  # method none: k is 0
    assert info.value.field == "num_speculative_tokens"
    llm.engine.target.split_head = True  # as a tensor-parallel target with lm_head='vocab'
    try:
        with pytest.raises(QuickdraftError, match="lm_head") as info:
            llm.engine.check_request([0, 1], SamplingParams(prompt_logprobs=1))
        assert info.value.field == "prompt_logprobs"
    finally:
        del llm.engine.target.split_head
    with pytest.raises(QuickdraftError, match="one per prompt"):
        llm.generate(PROMPTS, [GREEDY])
    other = ckpt_factory("vocab400", vocab=400)
    with pytest.raises(QuickdraftError, match="vocabulary mismatch"):
        LLM(target_dir, draft=other, policy="fixed")
    with pytest.raises(QuickdraftError, match="needs a draft"):
        LLM(target_dir, method="draft", policy="fixed")
    with pytest.raises(QuickdraftError, match="method"):
        LLM(target_dir, method="medusa-x", policy="fixed")
    with pytest.raises(QuickdraftError, match="num_speculative_tokens"):
        LLM(target_dir, draft=draft_dir, num_speculative_tokens=0, policy="fixed")
    # the engine keeps working after rejected requests
    assert len(llm.generate([[0, 1]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_folder_without_tokenizer_takes_token_ids(ckpt_factory):
    folder = ckpt_factory("notok", tokenizer=False)
    llm = LLM(folder, method="none")
    assert len(llm.generate([[0, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    with pytest.raises(QuickdraftError, match="token ids"):
        llm.generate(["text"], GREEDY)
    with pytest.raises(QuickdraftError, match="tokenizer") as info:
        llm.generate([[0, 1]], SamplingParams(stop=["x"]))
    assert info.value.field == "stop"


def test_requests_joining_and_leaving_a_running_batch(target_dir, draft_dir, plain_out):
    """Continuous use of the engine: requests arrive while others run, finish at different
    times (rows are compacted), and each output equals plain decoding of that prompt alone."""
    from quickdraft import Engine, EngineConfig, SpecConfig
    from quickdraft.proposers.draft_model import DraftModelProposer

    llm = LLM(target_dir, draft=draft_dir, policy="fixed")
    engine = Engine(llm.target, DraftModelProposer(llm.draft), EngineConfig(SpecConfig("draft", 3, policy="fixed"), max_num_seqs=2,
                                                                             max_model_len=128))
    lengths = [40, 7, 23]
    done = {}
    ids = [engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=lengths[0], ignore_eos=True))]
    for _ in range(3):
        engine.step()
    ids.append(engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=lengths[1], ignore_eos=True)))
    ids.append(engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=lengths[2], ignore_eos=True)))
    aborted = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=30))
    engine.abort_request(aborted)
    while engine.has_unfinished():
        assert engine.num_running <= 2
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert aborted not in done
    assert [done[i] for i in ids] == [p[:n] for p, n in zip(plain_out, lengths)]


def test_abort_a_running_request_keeps_the_others(target_dir, draft_dir, plain_out):
    from quickdraft import Engine, EngineConfig, SpecConfig
    from quickdraft.proposers.draft_model import DraftModelProposer

    llm = LLM(target_dir, draft=draft_dir, policy="fixed")
    engine = Engine(llm.target, DraftModelProposer(llm.draft), EngineConfig(SpecConfig("draft", 4, policy="fixed"), max_num_seqs=4,
                                                                             max_model_len=128))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    engine.step()
    engine.step()
    engine.abort_request(ids[0])  # row 0 leaves; the last row moves into it
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert ids[0] not in done
    assert [done[i] for i in ids[1:]] == plain_out[1:]


def _engine(target_dir, draft_dir, k=3, max_num_seqs=4):
    from quickdraft import Engine, EngineConfig, SpecConfig
    from quickdraft.proposers.draft_model import DraftModelProposer

    llm = LLM(target_dir, draft=draft_dir, policy="fixed")
    return Engine(llm.target, DraftModelProposer(llm.draft), EngineConfig(SpecConfig("draft", k, policy="fixed"),
                                                                          max_num_seqs=max_num_seqs,
                                                                          max_model_len=128))


def _run(engine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_per_request_speculation_cap(target_dir, draft_dir, plain_out):
    """num_speculative_tokens caps one request's drafts (0 = plain decoding for it) inside a
    batch whose other rows speculate; every output still equals plain decoding."""
    engine = _engine(target_dir, draft_dir, k=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(p, params, num_speculative_tokens=cap) for p, cap in zip(PROMPTS, (0, 1, None))]
    done = _run(engine)
    assert [done[i].token_ids for i in ids] == plain_out
    assert done[ids[0]].stats.num_draft_tokens == 0 and done[ids[0]].stats.num_steps > 0
    assert done[ids[1]].stats.accepted_per_pos[1:] == [] and done[ids[1]].stats.num_draft_tokens > 0
    assert len(done[ids[2]].stats.accepted_per_pos) == 4
    total = engine.stats  # the engine-wide counters are the sum over requests
    assert total.num_draft_tokens == sum(done[i].stats.num_draft_tokens for i in ids)
    assert total.num_output_tokens == 120
    for bad in (-1, 5, 1.5, True):
        with pytest.raises(QuickdraftError, match="num_speculative_tokens"):
            engine.check_request(PROMPTS[0], params, bad)


def test_a_failed_prefill_is_retried_one_request_at_a_time(target_dir, draft_dir, plain_out):
    """What the server does when a step raises: the requests being prefilled come back out,
    are retried singly, and only the one that fails alone is lost."""
    engine = _engine(target_dir, draft_dir)
    plan = engine._plan_prefill
    poison = [0, 333]

    def faulty(budget):  # the prefill (alone, or in a mixed step) of chunks of the prefilling requests
        requests, chunks, starts = plan(budget)
        if any(r.prompt == poison for r in requests):
            raise RuntimeError("injected")
        return requests, chunks, starts

    engine._plan_prefill = faulty
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in (PROMPTS[0], poison, PROMPTS[1], PROMPTS[2])]
    failures = []
    done = {}
    while engine.has_unfinished():
        try:
            outs = engine.step()
        except RuntimeError:
            requests, prefill_failed = engine.recover_failed_step()
            assert prefill_failed and not any(r.id in {q.id for q in requests} for r in engine.running)
            if len(requests) > 1:
                engine.retry_singly(requests)
            else:
                failures.append(requests[0].id)
            continue
        done.update({o.request_id: o.token_ids for o in outs if o.finished})
    assert failures == [ids[1]]
    assert [done[i] for i in (ids[0], ids[2], ids[3])] == plain_out


def test_requests_join_a_running_batch(target_dir, draft_dir, plain_out):
    """A request arriving while another runs joins the batch at the next step, up to
    max_num_seqs, instead of waiting for the batch to empty: the caches grow under the running
    rows (quickdraft.cache.KVBudget; tests/engine/test_kv_budget.py checks growth is exact)."""
    from quickdraft import Engine, EngineConfig, SpecConfig
    from quickdraft.proposers.draft_model import DraftModelProposer

    llm = LLM(target_dir, draft=draft_dir, policy="fixed")
    engine = Engine(llm.target, DraftModelProposer(llm.draft),
                    EngineConfig(SpecConfig("draft", 3, policy="fixed"), max_num_seqs=3))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(PROMPTS[0], params)]
    engine.step()
    assert engine.cache.max_slots == 1  # the engine holds what its requests need
    for p in PROMPTS[1:]:
        ids.append(engine.add_request(p, params))
        engine.step()
    assert engine.num_running == 3  # both joined while the first was running
    assert engine.cache.max_slots == 3
    done = _run(engine)
    assert [done[i].token_ids for i in ids] == plain_out
