"""Self-speculation (draft="self"): the target's own weights, quantised, as its draft model. It is
a draft model like any other: greedy output equals plain decoding and sampled output follows the
target's distribution; the draft shares the target's embeddings and reads nothing from disk."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.model.formats import FastLinear

from test_lossless import N, chi2_pvalue, exact_joint, pair, sampled_joint  # noqa: F401

PROMPTS = [[0, 5, 7, 9, 11], [0, 3], [0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def formats(model) -> set[str]:
    return {m.fmt for m in model.modules() if isinstance(m, FastLinear)}


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("float32", "int8"), ("bfloat16", None)])
def test_self_draft_greedy_output_equals_plain(target_dir, dtype, quant):
    plain = LLM(target_dir, method="none", dtype=dtype, policy="fixed")
    spec = LLM(target_dir, draft="self", num_speculative_tokens=4, dtype=dtype, draft_quantization=quant, policy="fixed")
    assert spec.engine.config.spec.method == "draft"
    assert formats(spec.draft) == {quant or "int4"}
    assert formats(spec.target) == formats(plain.target)  # the target itself is untouched
    # shared, not copied: the embedding table and the norms are the target's own tensors
    assert spec.draft.model.embed_tokens.weight is spec.target.model.embed_tokens.weight
    assert spec.draft.model.norm.weight is spec.target.model.norm.weight
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert spec.stats.num_accepted_tokens > 0


def test_self_draft_drafts_longer_by_default(target_dir):
    """A quantised copy agrees with its target most of the time: with draft="self" and no k given,
    k is DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS (a k given still wins; other drafts keep the
    common default), and its longer drafts still give plain decoding's tokens."""
    from quickdraft.config import DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS

    assert DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS > DEFAULT_NUM_SPECULATIVE_TOKENS
    spec = LLM(target_dir, draft="self", policy="fixed")
    assert spec.engine.k == DEFAULT_SELF_DRAFT_NUM_SPECULATIVE_TOKENS
    assert LLM(target_dir, draft="self", num_speculative_tokens=3, policy="fixed").engine.k == 3
    assert LLM(target_dir, method="ngram", policy="fixed").engine.k == DEFAULT_NUM_SPECULATIVE_TOKENS
    plain = LLM(target_dir, method="none", policy="fixed")
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert spec.stats.num_draft_tokens > 0


def test_self_draft_does_not_read_the_checkpoint_again(target_dir, monkeypatch):
    import quickdraft.llm as llm_module

    calls = []
    real = llm_module.load_model
    monkeypatch.setattr(llm_module, "load_model", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    LLM(target_dir, draft="self", num_speculative_tokens=2, policy="fixed")
    assert len(calls) == 1


def test_self_draft_sampling_matches_target_distribution(pair):
    target, other = pair
    kw = dict(temperature=1.0)
    llm = LLM(target, draft="self", num_speculative_tokens=2, max_num_seqs=N, policy="fixed")
    counts = sampled_joint(llm, lambda i: SamplingParams(max_tokens=4, seed=i, ignore_eos=True, **kw))
    probs = exact_joint(target, SamplingParams(**kw))
    # an int4 copy agrees most of the time, not always: both the accept and the reject paths ran
    assert 0.5 < llm.stats.acceptance_rate < 1.0
    assert chi2_pvalue(counts, probs) > 1e-3
    # a control the same test must reject: the target's distribution mixed with another model's
    wrong = exact_joint(other, SamplingParams(**kw))
    assert chi2_pvalue(counts, 0.7 * probs + 0.3 * wrong) < 1e-6


@pytest.mark.parametrize("kwargs,message", [
    (dict(quantization="int4"), "cannot pay"),
    (dict(quantization="int8", draft_quantization="int8"), "cannot pay"),
    (dict(draft_quantization="none"), "must be 'int4' or 'int8'"),
    (dict(method="ngram"), "method 'draft'"),
    (dict(draft_dtype="bfloat16"), "draft_dtype"),
])
def test_self_draft_refuses_what_cannot_pay(target_dir, kwargs, message):
    with pytest.raises(QuickdraftError, match=message):
        LLM(target_dir, draft="self", **kwargs)


def test_self_draft_of_a_4_bit_gguf_is_refused(tmp_path):
    pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from test_gguf import hf_model, vocab_size, write_gguf

    from quickdraft.model.gguf import four_bit_type

    model = hf_model("llama", vocab_size("gpt2"))
    q4 = write_gguf(tmp_path / "q4.gguf", model, "llama", qtype="Q4_1")
    f32 = write_gguf(tmp_path / "f32.gguf", model, "llama", qtype="F32")
    assert four_bit_type(q4) == "Q4_1" and four_bit_type(f32) is None
    with pytest.raises(QuickdraftError, match=r"stored in 4 bits \(Q4_1"):
        LLM(str(q4), draft="self", policy="fixed")
    assert LLM(str(f32), draft="self", num_speculative_tokens=2, policy="fixed").generate([[3, 4, 5]], GREEDY)[0].token_ids
    # run in 4 bits, the same file is its own fast path: the error says so
    assert LLM(str(q4), quantization="int4", method="none", policy="fixed").generate([[3, 4, 5]], GREEDY)[0].token_ids
