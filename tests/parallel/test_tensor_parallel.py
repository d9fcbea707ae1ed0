"""The bundled pair with its target split over 2 gloo ranks (real processes): greedy
speculative output (draft chains, draft trees, n-gram, suffix) equals plain decoding and the
single process's output token for token (EAGLE-3 too); a batch whose rows finish at different times (row
moves) and seeded sampling too."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.model.loader import load_model

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Point:\n    def __init__(self, x, y):",
           "for i in range(10):"]


@pytest.fixture(scope="module")
def tp_llms():
    """LLMs of one process share its tensor-parallel group (one target, caches of their own)."""
    made = {}

    def make(method: str, **kwargs) -> LLM:
        key = (method, tuple(sorted(kwargs.items())))
        if key not in made:
            opts = kwargs.pop("spec_options", None)
            made[key] = LLM(method=method, tensor_parallel_size=2, spec_options=opts and dict(opts), **kwargs, policy="fixed")
        return made[key]

    yield make
    for llm in made.values():
        llm.close()


@pytest.fixture(scope="module")
def reference():
    """Plain decoding in one process (eager float32, the reference of every test here)."""
    plain = LLM(method="none", compile=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 17, 33, 25)]
    return plain, params, [o.token_ids for o in plain.generate(PROMPTS, params)]


def test_logits_equal_the_single_process(tp_llms):
    tp = tp_llms("none").target
    ref = load_model(tp.checkpoint_path)
    ids = torch.randint(0, ref.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        # each rank runs its prepared shard (the CPU float32 format: blocked, or MKL), the reference
        # F.linear: the sums are taken in other orders, so equal to float rounding (~2e-6 relative)
        torch.testing.assert_close(tp(ids), ref(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("method", "kwargs"), [
    ("none", {}),
    ("draft", {}),
    ("draft", {"spec_options": (("tree_width", 2),)}),
    ("ngram", {}),
    ("suffix", {}),
    ("eagle3", {}),  # the bundled target's EAGLE-3 head, fed the hidden states every rank's forward produces
])
def test_greedy_output_equals_plain_single_process_decoding(tp_llms, reference, method, kwargs):
    _, params, expected = reference
    llm = tp_llms(method, **kwargs)
    outs = llm.generate(PROMPTS, params)  # rows finish at different steps: row moves on every rank
    assert [o.token_ids for o in outs] == expected
    if method != "none":
        assert llm.stats.num_accepted_tokens > 0


def test_seeded_sampling_matches_the_single_process(tp_llms):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7, ignore_eos=True)
    single = LLM(method="draft", compile=False, policy="fixed")
    assert [o.token_ids for o in tp_llms("draft").generate(PROMPTS[:2], params)] == \
        [o.token_ids for o in single.generate(PROMPTS[:2], params)]


def test_streaming_and_a_request_joining_a_running_batch(tp_llms, reference):
    _, params, expected = reference
    llm = tp_llms("draft", max_model_len=256)  # the second request joins the running batch: every rank's caches grow
    engine = llm.engine
    first = engine.add_request(llm.encode(PROMPTS[0]), params[0])
    engine.step()  # prefill the first alone
    second = engine.add_request(llm.encode(PROMPTS[2]), params[2])
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert done == {first: expected[0], second: expected[2]}


def test_logprobs_and_penalties_equal_the_single_process(tp_llms, reference):
    """Penalties, logit_bias, logprobs and prompt logprobs are rank 0's (the head is there by default)."""
    plain = reference[0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                            repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={11: 3.0})
    got, want = tp_llms("draft").generate(PROMPTS[:2], params), plain.generate(PROMPTS[:2], params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(g.logprobs, w.logprobs))
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]))
