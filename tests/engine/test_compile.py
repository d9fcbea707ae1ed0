"""Compiled steps (torch.compile) and memory accounting (issue 7).

Compiled and eager decoding give the same greedy tokens in float32 and the compiled
engine keeps the target's distribution. Weight formats and quantisation: test_quantized.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from quickdraft import LLM, SamplingParams
from quickdraft.compile import StepFunction

from test_lossless import N, PROMPT, chi2_pvalue, exact_joint, pair, sampled_joint  # noqa: F401

PROMPTS = [[0, 5, 7, 9, 11], [0, 3], [0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_out(target_dir):
    return [o.token_ids for o in LLM(target_dir, method="none").generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("method,options", [("draft", {}), ("draft", {"tree_width": 2}), ("ngram", {})],
                         ids=["draft-chain", "draft-tree", "ngram"])
def test_compiled_greedy_equals_eager(target_dir, draft_dir, plain_out, method, options):
    llm = LLM(target_dir, draft_dir if method == "draft" else None, method=method, num_speculative_tokens=3,
              spec_options=options, compile=True, policy="fixed")
    assert isinstance(llm.engine._forward, StepFunction) and llm.engine._forward.failed is None
    chain = method == "draft" and not options  # drafted as one compiled graph
    if chain:
        proposer = llm.engine.proposer
        assert {(B, k) for B, k, *_ in proposer._chain_ready} == {(False, 3), (True, 3)}  # batch 1 and > 1
        fused = _count_calls(proposer._chain)
    graphs = counters["stats"]["unique_graphs"]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out
    assert [o.token_ids for o in llm.generate(PROMPTS[1:2], GREEDY)] == plain_out[1:2]  # another batch size
    llm.generate(PROMPTS * 2, SamplingParams(temperature=0.8, max_tokens=12, seed=1))  # batch 6, sampled
    assert counters["stats"]["unique_graphs"] == graphs  # start-up compiled all of it: no request recompiles
    if method == "draft":
        assert isinstance(llm.engine.proposer._step, StepFunction) and llm.engine.proposer._step.failed is None
    if chain:
        assert fused[0] > 0 and proposer._chain.failed is None


@pytest.mark.slow
def test_static_shapes_pad_the_batch_and_read_the_whole_cache(target_dir, draft_dir, plain_out):
    """The CUDA-graph layout, run on CPU: batch padded to a bucket (3 -> 4 rows), keys over
    the whole static cache, padding rows writing to the trash column."""
    llm = LLM(target_dir, draft_dir, num_speculative_tokens=3, max_model_len=128, max_num_seqs=8, policy="fixed")
    engine = llm.engine
    calls = []
    step = StepFunction(llm.target, name="target", static=True)
    compiled = step._compiled

    def spy(ids, positions, cache, **kw):
        # the cache's own tensors (static addresses for CUDA graphs), not per-step views
        calls.append((ids.shape[0], kw["kv_len"], cache.k[0] is engine.cache.k[0]))
        return compiled(ids, positions, cache, **kw)

    step._compiled = spy
    engine._forward = step
    engine.proposer.compile(lambda model, name, **kw: StepFunction(model, name=name, static=True, **kw))
    engine.proposer.warm_up(3)  # static: registers the chain variants (captured on first use)
    chain_calls = []
    chain = engine.proposer._chain
    compiled_chain = chain._compiled

    def chain_spy(ids, positions, cache, **kw):
        chain_calls.append((ids.shape[0], kw["kv_len"], kw["grow"], cache.k[0] is engine.proposer.cache.k[0]))
        return compiled_chain(ids, positions, cache, **kw)

    chain._compiled = chain_spy
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out
    assert calls and all(b == 4 and kv == engine.cache.capacity and own for b, kv, own in calls[:5])
    # the draft's whole chain as one static graph: padded rows, whole cache, no growing key range
    cap = engine.proposer.cache.capacity
    assert chain_calls and all(c == (4, cap, False, True) for c in chain_calls[:5])
    assert step.failed is None and engine.proposer._step.failed is None and chain.failed is None


def test_compile_failure_falls_back_to_eager_with_one_log_line(target_dir, plain_out, caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    llm = LLM(target_dir, method="none")
    step = StepFunction(llm.target, name="target", backend=broken_backend)
    llm.engine._forward = step
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        out = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert out == plain_out
    assert step.failed and "no compiler here" in step.failed
    warnings = [r for r in caplog.records if "running it eagerly" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.slow
def test_compiled_engine_keeps_the_target_distribution(pair):  # noqa: F811
    """Plain temperature runs the draft's whole chain as one compiled graph (warmed up);
    top-k, a mix the warm-up did not compile, runs it one compiled forward at a time."""
    target, draft = pair
    llm = LLM(target, draft=draft, num_speculative_tokens=2, max_num_seqs=N, compile=True, policy="fixed")
    proposer = llm.engine.proposer
    fused = _count_calls(proposer._chain)
    for kw, expect_fused in ((dict(temperature=1.0), True), (dict(temperature=1.0, top_k=8), False)):
        before = fused[0]
        counts = sampled_joint(llm, lambda i: SamplingParams(max_tokens=4, seed=i, ignore_eos=True, **kw))
        assert (fused[0] > before) == expect_fused
        assert 0.05 < llm.stats.acceptance_rate < 0.95
        assert chi2_pvalue(counts, exact_joint(target, SamplingParams(**kw))) > 1e-3
        assert chi2_pvalue(counts, exact_joint(draft, SamplingParams(**kw))) < 1e-6
    assert llm.engine._forward.failed is None and proposer._chain.failed is None


def _count_calls(step: StepFunction) -> list[int]:
    """Count the calls of a StepFunction's compiled function (a one-element list)."""
    calls, compiled = [0], step._compiled

    def counted(*args, **kwargs):
        calls[0] += 1
        return compiled(*args, **kwargs)

    step._compiled = counted
    return calls


def test_memory_footprint(target_dir, draft_dir):
    from quickdraft.bench.memory import footprint

    llm = LLM(target_dir, draft_dir, num_speculative_tokens=3, policy="fixed")
    f = footprint(llm, batch=2, context=100)
    cfg = llm.target.config
    per_pos = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # k and v, float32
    assert f["plain_total"] == f["target_weights"] + 2 * 101 * per_pos
    assert f["target_cache"] == 2 * (101 + llm.engine._draft_room) * per_pos
    assert f["speculative_total"] == f["target_weights"] + f["target_cache"] + f["draft_weights"] + f["draft_cache"]
    assert np.isclose(f["added_fraction"], (f["speculative_total"] - f["plain_total"]) / f["plain_total"])
    resident = list(llm.target.parameters()) + list(llm.target.buffers())  # rope's inv_freq is a buffer
    assert f["target_weights"] == sum(t.numel() * 4 for t in resident)
