"""Issue 18 in the library: logprobs, prompt logprobs, penalties and logit_bias, the same under
speculation as in plain decoding (greedy: token for token; logprobs: within 1e-5 in float32),
and equal to transformers' own scores. The distribution tests are in test_lossless.py."""

from __future__ import annotations

import pickle

import pytest
import torch

from quickdraft import LLM, QuickdraftError, SamplingParams
from quickdraft.sampling import PenaltyState, chain_ancestors, draft_context
from quickdraft.tree import tree_structure

from conftest import ref_penalize

PROMPTS = [
    [0, 5, 7, 9, 11, 5, 7, 9, 11, 5, 7],
    [0, 3],
    [0, 10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13],
    [0, 20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21],
]
CASES = [
    ("draft", {}),
    ("draft", {"tree_width": 3}),
    ("ngram", {}),
    ("ngram", {"num_candidates": 3, "min_ngram": 1}),
    ("suffix", {}),
    ("lookahead", {}),
]
IDS = ["draft-chain", "draft-tree", "ngram-chain", "ngram-tree", "suffix-tree", "lookahead"]
PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=0.7, presence_penalty=0.4),
    dict(repetition_penalty=0.8, presence_penalty=-1.0, logit_bias={5: 3.0, 7: -100, 200: 2.5}),
]


@pytest.fixture(scope="module")
def plain(target_dir):
    return LLM(target_dir, method="none")


# ---- parameters -----------------------------------------------------------------------------

@pytest.mark.parametrize("kw,message", [
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=21), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={"a": 1}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias={1: float("inf")}), "logit_bias"),
])
def test_bad_fields_are_clear_errors(kw, message):
    with pytest.raises(QuickdraftError, match=message):
        SamplingParams(**kw)


def test_logit_bias_is_clamped_frozen_hashable_and_picklable():
    p = SamplingParams(logit_bias={3: 250, 4: -1e9, 5: 0.5})
    assert dict(p.logit_bias) == {3: 100.0, 4: -100.0, 5: 0.5}
    with pytest.raises(TypeError):
        p.logit_bias[3] = 1.0
    assert hash(p) == hash(SamplingParams(logit_bias={5: 0.5, 4: -100, 3: 100}))
    assert pickle.loads(pickle.dumps(p)) == p
    assert p.penalized and not SamplingParams().penalized


def test_logit_bias_outside_the_vocabulary_is_a_clear_error(plain):
    with pytest.raises(QuickdraftError, match="logit_bias token ids"):
        plain.generate([[0, 3]], SamplingParams(logit_bias={10**6: 1.0}))


# ---- the batched penalty computation against the reference -----------------------------------

def test_penalty_state_matches_the_reference_per_position():
    V, g = 50, torch.Generator().manual_seed(0)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={3: 2.0}),
              SamplingParams(),
              SamplingParams(repetition_penalty=0.7, logit_bias={0: -5.0})]
    prompts = [[1, 2, 3, 2], [4, 5], [6, 7, 7]]
    outputs = [[2, 9, 9], [1], []]
    drafts = torch.tensor([[9, 11, 3], [5, -1, -1], [7, 7, 8]])
    logits = torch.randn(3, 4, V, generator=g) * 3
    got = PenaltyState.build(params, prompts, V, torch.device("cpu")).apply(
        logits, outputs, draft_context(drafts, chain_ancestors(drafts)))
    for b in range(3):
        for i in range(4):
            context = outputs[b] + [t for t in drafts[b, :i].tolist() if t >= 0]
            want = ref_penalize(logits[b, i], prompts[b], context, params[b])
            torch.testing.assert_close(got[b, i].double(), want, rtol=0, atol=1e-5)


def test_a_tree_nodes_penalties_count_its_path():
    """Tree verification: node n's position is penalised with node n and its ancestors only."""
    V, g = 8, torch.Generator().manual_seed(1)
    tokens = torch.tensor([[4, 5, 4, 6, -1, 5]])
    parents = torch.tensor([[-1, -1, 0, 2, 1, 1]])
    anc, _ = tree_structure(parents, tokens >= 0)
    params = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.3, logit_bias={6: 1.0})
    logits = torch.randn(1, 7, V, generator=g) * 2
    raw = logits.clone()
    got = PenaltyState.build([params], [[1, 2]], V, torch.device("cpu")).apply(logits, [[3, 4]],
                                                                             draft_context(tokens, anc))
    paths = {0: [4], 1: [5], 2: [4, 4], 3: [4, 4, 6], 4: [], 5: [5, 5]}
    torch.testing.assert_close(got[0, 0].double(), ref_penalize(logits[0, 0], [1, 2], [3, 4], params), rtol=0, atol=1e-5)
    for n, path in paths.items():
        if n == 4:
            continue  # an absent node: its position is never read
        want = ref_penalize(logits[0, 1 + n], [1, 2], [3, 4] + path, params)
        torch.testing.assert_close(got[0, 1 + n].double(), want, rtol=0, atol=1e-5)
    assert torch.equal(logits, raw)  # the raw logits are left as they were (logprobs read them)


# ---- greedy: speculative == plain == a reference loop ----------------------------------------

def reference_greedy(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """Plain greedy decoding by hand: the whole sequence through the model each token, the
    reference penalties, argmax."""
    model, out = llm.target, []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            raw = model(torch.tensor([prompt + out]))[0, -1]
            out.append(int(ref_penalize(raw, prompt, out, params).argmax()))
    return out


@pytest.mark.parametrize("penalties", PENALTIES, ids=["repetition", "frequency-presence", "bias-rep-presence"])
def test_plain_greedy_with_penalties_equals_the_reference_loop(plain, penalties):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties)
    outs = plain.generate(PROMPTS, params)
    for prompt, o in zip(PROMPTS, outs):
        assert o.token_ids == reference_greedy(plain, prompt, params)
    unpenalized = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] != [o.token_ids for o in unpenalized]


@pytest.mark.parametrize("method,options", CASES, ids=IDS)
def test_speculative_greedy_with_penalties_equals_plain(target_dir, noisy_draft, plain, method, options):
    llm = LLM(target_dir, draft=noisy_draft if method == "draft" else None, method=method, num_speculative_tokens=4,
              spec_options=options, policy="fixed")
    mixed = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **PENALTIES[i % 3]) for i in range(4)]
    expected = [o.token_ids for o in plain.generate(PROMPTS, mixed)]
    assert [o.token_ids for o in llm.generate(PROMPTS, mixed)] == expected  # one batch, different penalties per row
    for prompt, p, want in zip(PROMPTS, mixed, expected):
        assert llm.generate([prompt], p)[0].token_ids == want
    assert llm.stats.num_accepted_tokens > 0


# ---- logprobs --------------------------------------------------------------------------------

def _check_logprobs(out, n):
    assert len(out.logprobs) == len(out.token_ids)
    for lp, t in zip(out.logprobs, out.token_ids):
        assert lp.token_id == t and lp.logprob <= 0 and len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        if n:
            assert lp.rank >= 1 and (lp.rank == 1) == (lp.top[0][0] == t)


@pytest.mark.parametrize("method,options", [CASES[0], CASES[1], CASES[3]], ids=["draft-chain", "draft-tree", "ngram-tree"])
def test_logprobs_equal_between_plain_and_speculative(target_dir, noisy_draft, plain, method, options):
    llm = LLM(target_dir, draft=noisy_draft if method == "draft" else None, method=method, num_speculative_tokens=4,
              spec_options=options, policy="fixed")
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),  # a row without: none computed for it
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=5)]
    spec, ref = llm.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert llm.stats.num_accepted_tokens > 0
    for s, r, p in zip(spec, ref, params):
        assert s.token_ids == r.token_ids
        if p.logprobs is None:
            assert s.logprobs is None
            continue
        _check_logprobs(s, p.logprobs)
        for a, b in zip(s.logprobs, r.logprobs):
            assert a.token_id == b.token_id and a.rank == b.rank and abs(a.logprob - b.logprob) < 1e-5
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            assert all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(a.top, b.top))
    assert spec[0].prompt_logprobs[0] is None and len(spec[0].prompt_logprobs) == len(PROMPTS[0])
    assert spec[1].prompt_logprobs is None


def test_logprobs_equal_transformers_scores(target_dir, plain):
    """The raw model's log-probabilities: log_softmax of transformers' logits on the same
    checkpoint, for prompt tokens and generated ones, whatever the penalties and temperature."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    prompt = PROMPTS[2]
    for params in [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=4, prompt_logprobs=4),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True, logprobs=4, prompt_logprobs=0,
                                  frequency_penalty=1.0, logit_bias={9: 4.0})]:
        out = plain.generate([prompt], params)[0]
        seq = prompt + out.token_ids
        with torch.no_grad():
            lp = hf(torch.tensor([seq])).logits[0].float().log_softmax(-1)
        for j, t in enumerate(seq[1:]):
            got = out.prompt_logprobs[j + 1] if j + 1 < len(prompt) else out.logprobs[j + 1 - len(prompt)]
            assert got.token_id == t and abs(got.logprob - lp[j, t].item()) < 1e-5, j
            assert got.rank == int((lp[j] > lp[j, t]).sum()) + 1
            top = lp[j].topk(len(got.top))
            assert [i for i, _ in got.top] == top.indices.tolist()


def test_logprobs_follow_stops_and_streaming(target_dir, noisy_draft):
    """Logprobs are cut with the tokens (eos, stop strings, max_tokens), and a stream's deltas
    add up to the final list."""
    llm = LLM(target_dir, draft=noisy_draft, num_speculative_tokens=4, policy="fixed")
    full = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1))[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip()
    cut = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1,
                                                    stop=stop))[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(full.token_ids)
    _check_logprobs(cut, 1)
    assert cut.logprobs == full.logprobs[:len(cut.token_ids)]
    short = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1))[0]
    assert len(short.logprobs) == 5 and short.logprobs == full.logprobs[:5]
    deltas = []
    for o in llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)):
        deltas += o.new_logprobs
    assert [d.token_id for d in deltas] == full.token_ids


def test_eagle3_head_with_prompt_logprobs_and_penalties():
    """A head reads the prefill's hidden states too: asking for prompt logprobs adds the final
    layer to the same forward without changing what the head gets (the bundled target and head)."""
    from quickdraft.llm import default_model_dirs

    target = default_model_dirs()[0]
    llm = LLM(target, draft="target-eagle3", num_speculative_tokens=3, compile=False, policy="fixed")
    plain = LLM(target, method="none", compile=False)
    prompts = [llm.tokenizer.encode("def read_config(path):\n    with open(path) as f:\n"),
               llm.tokenizer.encode("class Stack:\n    def __init__(self):\n")]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    spec, ref = llm.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ref]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(spec[0].logprobs, ref[0].logprobs))
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(spec[0].prompt_logprobs[1:], ref[0].prompt_logprobs[1:]))
    # the head saw the same states as without prompt logprobs: the same drafts, the same acceptance
    again = LLM(target, draft="target-eagle3", num_speculative_tokens=3, compile=False, policy="fixed")
    again.generate(prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2,
                                            frequency_penalty=0.5), params[1]])
    assert again.stats.num_accepted_tokens == llm.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_drafts_from_penalised_distributions(target_dir, plain, temperature):
    """The target as its own draft: with q penalised by the same rule as p (the default), every
    draft token is accepted, penalties and all; drafting from raw logits (penalize=False)
    loses acceptance but not the output."""
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=40, ignore_eos=True, repetition_penalty=1.5,
                            frequency_penalty=0.5, logit_bias={5: 2.0})
    want = plain.generate(PROMPTS, params)
    rates = {}
    for penalize in (True, False):
        llm = LLM(target_dir, draft=target_dir, num_speculative_tokens=4, spec_options={"penalize": penalize}, policy="fixed")
        got = llm.generate(PROMPTS, params)
        if temperature == 0:
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
        rates[penalize] = llm.stats.acceptance_rate
    assert rates[True] > 0.99 and rates[False] < 0.99  # raw drafts are rejected where the penalties bite


def test_prompt_logprobs_with_a_vocabulary_split_head_is_a_clear_error(target_dir):
    """A tensor-parallel target whose lm_head is split by vocabulary (split_head) gives logits only
    from a forward on every rank: prompt logprobs say so instead of hanging in a collective."""
    llm = LLM(target_dir, method="none")
    llm.engine.target.split_head = True  # what parallel.runtime.TensorParallelTarget reports in "vocab" mode
    with pytest.raises(QuickdraftError, match="lm_head='rank0'"):
        llm.generate([[0, 3]], SamplingParams(prompt_logprobs=1))
    assert llm.generate([[0, 3]], SamplingParams(logprobs=1, max_tokens=2))[0].logprobs  # generated ones are fine
