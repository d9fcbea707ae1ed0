"""The hybrid proposer (method="auto" or a list of methods): every method's candidates, the one
that pays chosen per row and step, one verify. Greedy output equals plain decoding whatever the
choices (batch 1 and ragged batches, k 1..8, chains and trees), the model member's own cache
stays exact for rows it did not draft, and bad lists are clear errors. The distribution tests
are in tests/engine/test_lossless.py's pattern, here at the end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from quickdraft import LLM, QuickdraftError, SamplingParams
from quickdraft.cache import KVCache
from quickdraft.model.transformer import forward_chunks
from quickdraft.proposers import HybridProposer, get, method_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_lossless import N, chi2_pvalue, exact_joint, pair, sampled_joint  # noqa: E402,F401

# Repetitive prompts give suffix / n-gram candidates; others (and the draft) where they have none.
PROMPTS = [
    [0, 5, 7, 9, 11, 5, 7, 9, 11, 5, 7],
    [0, 3],
    [0, 10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13],
    [0, 20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21],
    [0, 31, 8, 44, 2],
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# draft_cost 0: the model's drafting costs nothing, so it drafts every step and each row takes the
# candidate of more expected tokens: both kinds of rows in one batch, every step
MIXED = {"draft_cost": 0.0}


@pytest.fixture(scope="module")
def plain_out(target_dir):
    return [o.token_ids for o in LLM(target_dir, method="none").generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def head(target_dir, tmp_path_factory):
    from quickdraft.model.eagle3 import new_head, save_eagle3
    from quickdraft.model.loader import load_model

    torch.manual_seed(0)
    return save_eagle3(new_head(load_model(target_dir, dtype="float32")), tmp_path_factory.mktemp("head") / "h")


def make(target_dir, draft, method, options=None, k=4, policy="fixed", **kw):
    return LLM(target_dir, draft=draft, method=method, num_speculative_tokens=k, spec_options=options,
               policy=policy, **kw)


def check_greedy(llm, plain_out):
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out
    for prompt, expected in zip(PROMPTS, plain_out):
        assert llm.generate([prompt], GREEDY)[0].token_ids == expected


CASES = [
    ("suffix,draft", MIXED),
    ("suffix,draft", {**MIXED, "suffix.tree": False}),
    ("ngram,draft", MIXED),
    ("suffix,ngram,draft", {**MIXED, "draft.tree_width": 3}),
    ("suffix,ngram,draft", {}),  # measured costs
    ("suffix,ngram", {}),
    ("suffix,eagle3", MIXED),
    ("ngram,eagle3", {**MIXED, "eagle3.tree_width": 2}),
    ("suffix,ngram,draft", {**MIXED, "merge": True}),
    ("suffix,ngram", {"merge": True}),
    ("suffix,eagle3", {**MIXED, "merge": True}),
    ("ngram,draft", {**MIXED, "draft.tree_width": 2, "merge": True}),
]
IDS = ["suffix-draft", "suffix-chain-draft", "ngram-draft", "all-draft-tree", "all-measured", "free-only",
       "suffix-eagle3", "ngram-eagle3-tree", "merged", "free-merged", "eagle3-merged", "draft-tree-merged"]


@pytest.mark.parametrize("method,options", CASES, ids=IDS)
def test_greedy_equals_plain_batched_and_batch1(target_dir, noisy_draft, head, plain_out, method, options):
    draft = head if "eagle3" in method else noisy_draft if "draft" in method else None
    llm = make(target_dir, draft, method, options)
    proposer = llm.engine.proposer
    assert isinstance(proposer, HybridProposer) and proposer.MEMBERS == tuple(method.split(","))
    check_greedy(llm, plain_out)
    assert llm.stats.num_accepted_tokens > 0
    used = [n for n, c in proposer.drafted_by.items() if c > 0]
    if options.get("draft_cost") == 0.0:  # both a free and the model member drafted rows
        assert len(used) >= 2 and proposer.MODEL in used, proposer.drafted_by
    # with merge, rows with several candidates verify them in one tree (a model's tree joins no other
    # candidate: with a single free member beside it, rows may have nothing to merge)
    if not options.get("merge"):
        assert proposer.merged_rows == 0
    elif not any(o.endswith("tree_width") for o in options):
        assert proposer.merged_rows > 0


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_greedy_equal_for_every_k(target_dir, noisy_draft, plain_out, k):
    for options in (MIXED, {**MIXED, "draft.tree_width": 2}):
        llm = make(target_dir, noisy_draft, "suffix,ngram,draft", options, k=k)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out


def test_auto_policy_and_requests_joining_and_leaving(target_dir, noisy_draft, plain_out):
    """The default (auto) policy picks k per step; max_num_seqs 2 moves rows while the hybrid
    keeps per-row estimates."""
    llm = make(target_dir, noisy_draft, "auto", None, policy="auto")
    assert llm.engine.config.spec.method == "suffix,ngram,draft"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out
    llm = make(target_dir, noisy_draft, ["suffix", "draft"], MIXED, k=3, max_num_seqs=2)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 9, 30, 17, 25)]
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [p[:m] for p, m in zip(plain_out, (40, 9, 30, 17, 25))]


@pytest.mark.parametrize("merge", [False, True])
def test_model_cache_stays_exact_for_rows_it_did_not_draft(target_dir, draft_dir, merge):
    """After every step, each row's positions the draft model counts as cached hold exactly the
    keys a fresh prefill of its committed tokens gives: rows drafted by suffix decoding keep
    only the part of the model's own draft that the committed tokens follow (a draft that often
    disagrees with the target: its tokens and the committed ones part often)."""
    llm = make(target_dir, draft_dir, "suffix,draft", {**MIXED, "merge": merge})
    engine, member = llm.engine, llm.engine.proposer.model
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for b, r in enumerate(engine.running):
            n = member.cached[b]
            if n == 0:
                continue
            fresh = KVCache.for_model(member.model, 1, n + 1)
            with torch.inference_mode():
                forward_chunks(member.model, [r.tokens[:n]], [0], fresh.rows(0, 1))
            for got, want in zip(member.cache.k + member.cache.v, fresh.k + fresh.v):
                torch.testing.assert_close(got[b, :, :n], want[0, :, :n], atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked > 20
    assert llm.engine.proposer.drafted_by["suffix"] > 0 and llm.engine.proposer.drafted_by["draft"] > 0
    assert (llm.engine.proposer.merged_rows > 0) == merge  # merged: a row's accepted path may leave the model's chain


def test_merge_grafts_the_other_candidate_onto_the_chosen_one():
    from quickdraft.proposers.hybrid import _merge

    chain = ([5, 6, 7], [-1, 0, 1])
    # a chain parting after two tokens: its rest hangs under the shared node
    assert _merge(chain, ([5, 6, 9, 10], [-1, 0, 1, 2]), 16) == ([5, 6, 7, 9, 10], [-1, 0, 1, 1, 3])
    # a tree (siblings 8 and 5 under the root; 4 under 5) onto the chain; nothing shared but 5
    assert _merge(chain, ([8, 5, 4], [-1, -1, 1]), 16) == ([5, 6, 7, 8, 4], [-1, 0, 1, -1, 0])
    # the node limit: what does not fit is left out, and its subtree with it
    assert _merge(chain, ([9, 10, 11], [-1, 0, 1]), 4) == ([5, 6, 7, 9], [-1, 0, 1, -1])
    assert _merge(chain, ([9, 10], [-1, 0]), 3) == chain
    # unused nodes (-1) of the other are skipped, as are their children
    assert _merge(chain, ([-1, 3], [-1, 0]), 16) == chain


def test_self_draft_and_auto_expansion(target_dir, noisy_draft, head):
    llm = make(target_dir, "self", "auto", MIXED, k=2)
    assert llm.engine.config.spec.method == "suffix,ngram,draft"
    assert make(target_dir, None, "auto").engine.config.spec.method == "suffix,ngram"
    assert make(target_dir, head, "auto").engine.config.spec.method == "suffix,ngram,eagle3"
    assert make(target_dir, noisy_draft, " suffix , draft ").engine.config.spec.method == "suffix,draft"
    assert method_name(["ngram", "draft"]) == "ngram,draft"
    assert get("suffix") is not None and not issubclass(get("suffix"), HybridProposer)


@pytest.mark.parametrize("method,options,message", [
    ("suffix,suffix", None, "twice"),
    ("draft,eagle3", None, "at most one model proposer"),
    ("lookahead,draft", None, "cannot be combined"),
    ("none,draft", None, "cannot be part of a list"),
    ("suffix,auto", None, "cannot be part of a list"),
    ("suffix,medusa", None, "method must be one of"),
    ("suffix,", None, "empty name"),
    (5, None, "a name or a list of names"),
    ("suffix,draft", {"suffix.min_token_prob": 2.0}, "min_token_prob"),
    ("suffix,draft", {"suffix.": 3}, "unknown"),
    ("suffix,draft", {"ngram.min_ngram": 3}, "unknown"),
    ("suffix,draft", {"tree_width": 2}, "unknown"),
    ("suffix,draft", {"draft_cost": -1}, "draft_cost"),
    ("suffix,draft", {"probe_every": 0}, "probe_every"),
    ("suffix,draft", {"merge": "yes"}, "merge must be true or false"),
])
def test_bad_lists_and_options_are_clear_errors(target_dir, noisy_draft, method, options, message):
    with pytest.raises(QuickdraftError, match=message):
        make(target_dir, noisy_draft, method, options)


def test_a_list_with_draft_needs_a_draft(target_dir):
    with pytest.raises(QuickdraftError, match="draft"):
        make(target_dir, None, "suffix,draft")


# ---- distribution tests (tests/engine/test_lossless.py's pair and helpers) ----------------------

SAMPLED = [
    ("suffix,draft", MIXED, dict(temperature=1.0)),
    ("suffix,ngram", {"ngram.min_ngram": 1, "ngram.max_ngram": 2, "merge": True}, dict(temperature=1.0)),
    ("suffix,ngram,draft", {**MIXED, "ngram.min_ngram": 1, "ngram.max_ngram": 2}, dict(temperature=0.8, top_p=0.9)),
    ("suffix,draft", {**MIXED, "draft.tree_width": 2, "draft.tree_sampled": True}, dict(temperature=1.0)),
    ("suffix,draft", {**MIXED, "draft.tree_width": 2}, dict(temperature=1.0)),
]


@pytest.mark.slow
@pytest.mark.parametrize("method,options,kw", SAMPLED, ids=["chain", "free-merged", "chain-top-p", "sampled-tree",
                                                       "top-w-tree"])
def test_hybrid_sampling_matches_target_distribution(pair, method, options, kw):
    """Rows drafted by the model (with its q) and rows drafted by suffix decoding (one-hot q)
    share steps; the output follows the target's distribution and not a mixture with the draft's.
    Every request repeats the same prompt, so the suffix proposer's global trie finds candidates."""
    target, draft = pair
    llm = LLM(target, draft=draft, method=method, num_speculative_tokens=2, max_num_seqs=N // 4,
              spec_options=options, policy="fixed")
    counts = sampled_joint(llm, lambda i: SamplingParams(max_tokens=4, seed=i, ignore_eos=True, **kw))
    probs = exact_joint(target, SamplingParams(**kw))
    by = llm.engine.proposer.drafted_by
    if "draft" in by:
        assert by["suffix"] > 100 and by["draft"] > 100, by
    else:  # two free members: their candidates verified as one deterministic tree
        assert by["suffix"] > 100 and llm.engine.proposer.merged_rows > 100, (by, llm.engine.proposer.merged_rows)
    assert llm.stats.num_accepted_tokens > 100 and llm.stats.acceptance_rate < 0.95
    assert chi2_pvalue(counts, probs) > 1e-3
    # the control the same test must reject: the target's distribution mixed with the draft's
    wrong = exact_joint(draft, SamplingParams(**kw))
    assert chi2_pvalue(counts, 0.7 * probs + 0.3 * wrong) < 1e-6


# ---- the measured costs, cached on disk ------------------------------------------------------

def test_measured_costs_are_cached_and_seeded_output_stops_depending_on_the_clock(target_dir, noisy_draft,
                                                                               monkeypatch):
    """The first engine measures (c_verify, c_token) and writes them under the engine's cost key;
    a later one (another process: the in-process share cleared) reads them and measures nothing,
    so its seeded sampled output is a function of the tokens alone: a clock that returns nonsense
    changes nothing."""
    import itertools

    from quickdraft.policy.auto import costs_path
    from quickdraft.proposers import hybrid

    monkeypatch.setattr(hybrid, "_MEASURED", {})
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True)
    first = make(target_dir, noisy_draft, "suffix,draft")  # measured costs (no draft_cost)
    first.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    measured = dict(first.engine.proposer._costs)
    assert 1 in measured, "the batch-1 bucket was not measured"
    path = costs_path(first.engine.proposer._key)
    assert path.exists()

    def fresh_engine():
        monkeypatch.setattr(hybrid, "_MEASURED", {})  # as a new process: only the disk remembers
        llm = make(target_dir, noisy_draft, "suffix,draft")
        assert llm.engine.proposer._costs == measured  # from the disk, before any step
        return llm

    second = fresh_engine()
    want = [second.generate([p], params)[0].token_ids for p in PROMPTS]  # batch 1: the bucket measured
    assert second.engine.proposer._token_times == {} and second.engine.proposer._verify_times == {}  # nothing timed
    third = fresh_engine()
    ticks = itertools.count()
    monkeypatch.setattr(hybrid.time, "perf_counter", lambda: 1e3 * (next(ticks) % 7))  # a clock that lies
    assert [third.generate([p], params)[0].token_ids for p in PROMPTS] == want
    monkeypatch.undo()
    # another key (another method list) has costs of its own
    assert make(target_dir, noisy_draft, "ngram,draft").engine.proposer._costs == {}


def test_unreadable_cached_costs_are_measured_again(target_dir, noisy_draft, monkeypatch, caplog):
    from quickdraft.policy.auto import costs_path
    from quickdraft.proposers import hybrid

    monkeypatch.setattr(hybrid, "_MEASURED", {})
    llm = make(target_dir, noisy_draft, "suffix,ngram,draft", {"suffix.tree": False})
    path = costs_path(llm.engine.proposer._key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    monkeypatch.setattr(hybrid, "_MEASURED", {})
    llm = make(target_dir, noisy_draft, "suffix,ngram,draft", {"suffix.tree": False})
    assert llm.engine.proposer._costs == {} and "ignoring the hybrid's cached step costs" in caplog.text
