"""Every proposer, chain and tree, through the engine: greedy output is token-identical to
plain decoding at batch 1 and batch > 1, with drafts actually accepted."""

from __future__ import annotations


import pytest
import torch

from quickdraft import LLM, QuickdraftError, SamplingParams

# Repetitive prompts give prompt lookup, suffix decoding and lookahead something to find;
# ragged lengths make rows of one batch accept different counts.
PROMPTS = [
    [0, 5, 7, 9, 11, 5, 7, 9, 11, 5, 7],
    [0, 3],
    [0, 10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13],
    [0, 20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21],
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

CASES = [
    ("draft", {}),
    ("draft", {"tree_width": 3}),
    ("draft", {"tree_width": 3, "tree_nodes": 5}),
    ("ngram", {}),
    ("ngram", {"num_candidates": 3, "min_ngram": 1}),
    ("suffix", {"tree": False}),
    ("suffix", {}),
    ("lookahead", {}),
    ("lookahead", {"window": 3, "ngram": 3, "guesses": 2}),
]
IDS = ["draft-chain", "draft-tree", "draft-tree-pruned", "ngram-chain", "ngram-tree", "suffix-chain", "suffix-tree", "lookahead",
       "lookahead-small"]


@pytest.fixture(scope="module")
def plain_out(target_dir):
    return [o.token_ids for o in LLM(target_dir, method="none").generate(PROMPTS, GREEDY)]


def make(target_dir, noisy_draft, method, options, k=4):
    return LLM(target_dir, draft=noisy_draft if method == "draft" else None, method=method,
               num_speculative_tokens=k, spec_options=options, policy="fixed")


@pytest.mark.parametrize("method,options", CASES, ids=IDS)
def test_greedy_equals_plain_batched_and_batch1(target_dir, noisy_draft, plain_out, method, options):
    llm = make(target_dir, noisy_draft, method, options)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out
    for prompt, expected in zip(PROMPTS, plain_out):
        assert llm.generate([prompt], GREEDY)[0].token_ids == expected
    s = llm.stats
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens > 0
    assert s.mean_acceptance_length > 1.0


@pytest.mark.parametrize("k", [1, 2, 7])
@pytest.mark.parametrize("method,options", [CASES[1], CASES[4], CASES[6], CASES[7]],
                         ids=["draft-tree", "ngram-tree", "suffix-tree", "lookahead"])
def test_trees_greedy_equal_for_several_k(target_dir, noisy_draft, plain_out, method, options, k):
    llm = make(target_dir, noisy_draft, method, options, k=k)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out


@pytest.mark.parametrize("k", [1, 4, 16, 24])
@pytest.mark.parametrize("method,options", CASES, ids=IDS)
def test_a_proposer_that_returns_a_tree_says_it_may(target_dir, noisy_draft, method, options, k):
    """may_draft_trees(k) is what makes the engine load the compiled tree verify step: a tree
    verified eagerly between compiled chain steps rounds differently, and greedy output left
    plain decoding's (SmolLM2, suffix at k = 16: the budget of 16 nodes no longer exceeded k, the
    tree package was not loaded, and 17 tree steps ran eagerly). Every proposer, at k past its
    node budgets: if a draft comes back as a tree, the proposer said so beforehand."""
    llm = make(target_dir, noisy_draft, method, options, k=k)
    proposer, trees = llm.engine.proposer, []
    propose = proposer.propose

    def recording(batch):
        draft = propose(batch)
        trees.append(draft.parents is not None)
        return draft

    proposer.propose = recording
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert trees  # (it proposed)
    if any(trees):
        assert proposer.may_draft_trees(k)


def test_tree_beats_chain_in_acceptance_length(target_dir, noisy_draft):
    chain = make(target_dir, noisy_draft, "draft", {})
    tree = make(target_dir, noisy_draft, "draft", {"tree_width": 3})
    chain.generate(PROMPTS, GREEDY)
    tree.generate(PROMPTS, GREEDY)
    assert tree.stats.mean_acceptance_length > chain.stats.mean_acceptance_length


def test_requests_joining_and_leaving_with_trees(target_dir, noisy_draft, plain_out):
    """max_num_seqs 2 with 4 requests: rows are compacted while trees are in flight."""
    for method, options in (CASES[1], CASES[6], CASES[7]):
        llm = LLM(target_dir, draft=noisy_draft if method == "draft" else None, method=method,
                  num_speculative_tokens=3, spec_options=options, max_num_seqs=2, policy="fixed")
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (48, 9, 30, 17)]
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [p[: m.max_tokens] for p, m in zip(plain_out, params)]


def test_stop_and_eos_inside_an_accepted_tree_path(target_dir, noisy_draft, plain_out):
    llm = make(target_dir, noisy_draft, "suffix", {})
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=48))[0]
    assert out.token_ids == plain_out[3][: len(out.token_ids)]
    # max_tokens inside a long accepted run
    for m in (1, 2, 5, 11):
        assert llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))[0] \
            .token_ids == plain_out[3][:m]


@pytest.mark.parametrize("method,options,message", [
    ("ngram", {"bogus": 1}, "bogus"),
    ("ngram", {"min_ngram": 0}, "min_ngram"),
    ("suffix", {"min_token_prob": 2.0}, "min_token_prob"),
    ("lookahead", {"window": 0}, "window"),
    ("draft", {"tree_width": 0}, "tree_width"),
    ("draft", {"tree_width": 2, "tree_sampled": True, "tree_nodes": 3}, "tree_sampled"),
    ("draft", {"tree_sampled": "yes"}, "tree_sampled"),
])
def test_bad_options_are_clear_errors(target_dir, noisy_draft, method, options, message):
    with pytest.raises(QuickdraftError, match=message):
        make(target_dir, noisy_draft, method, options)


def test_method_needing_a_draft_and_unknown_method(target_dir):
    with pytest.raises(QuickdraftError, match="draft"):
        LLM(target_dir, method="draft", spec_options={"tree_width": 2}, policy="fixed")
    with pytest.raises(QuickdraftError, match="method must be one of"):
        LLM(target_dir, method="medusa-x", policy="fixed")


def test_pruned_draft_tree_keeps_the_best_nodes_as_a_tree(target_dir, noisy_draft):
    from quickdraft.proposers.base import ProposeBatch
    from quickdraft.sampling import BatchSampling, StepRandom

    llm = make(target_dir, noisy_draft, "draft", {"tree_width": 3, "tree_nodes": 5})
    proposer = llm.engine.proposer
    proposer.reserve(2, 64)
    for row, prompt in enumerate(PROMPTS[:2]):
        proposer.start(row, prompt)
    sampling = BatchSampling.build([SamplingParams(temperature=0)] * 2, "cpu")
    draft = proposer.propose(ProposeBatch([list(p) for p in PROMPTS[:2]], 4, sampling,
                                          StepRandom([0, 0], [len(p) for p in PROMPTS[:2]], "cpu")))
    assert draft.tokens.shape == (2, 5) and (draft.tokens >= 0).all()
    for b in range(2):
        pars = draft.parents[b].tolist()
        assert all(p < i for i, p in enumerate(pars))  # parents first, all kept
        assert pars[0] == -1  # the draft's likeliest first token is always kept
        kids = {}
        for i, p in enumerate(pars):
            kids.setdefault(p, []).append(draft.tokens[b, i].item())
        assert all(len(set(v)) == len(v) for v in kids.values())  # siblings distinct


def test_sampled_tree_mixed_batch_is_seeded_and_greedy_rows_exact(target_dir, noisy_draft, plain_out):
    """A batch mixing greedy and sampled rows drafts a sampled tree: greedy rows still
    equal plain decoding, and a seeded sampled row repeats exactly."""
    llm = make(target_dir, noisy_draft, "draft", {"tree_width": 3, "tree_sampled": True})
    params = [GREEDY, SamplingParams(temperature=0.9, seed=4, max_tokens=48, ignore_eos=True)] * 2
    first = llm.generate(PROMPTS, params)
    assert first[0].token_ids == plain_out[0] and first[2].token_ids == plain_out[2]
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert llm.stats.num_accepted_tokens > 0


# Sampled outputs of the tiny random model rarely repeat: n-gram matches of one token; the
# confidence stop low enough that rows draft (and stop at different depths). Suffix without its
# global trie: that one holds earlier requests' outputs by design, so its drafts (and then a
# seeded request's tokens) depend on what was generated before.
SEEDED_CASES = [
    ("draft", {}),
    ("draft", {"tree_width": 3, "tree_sampled": True}),
    ("draft", {"tree_width": 3}),
    ("draft", {"confidence_threshold": 0.004}),
    ("ngram", {"min_ngram": 1}),
    ("ngram", {"num_candidates": 3, "min_ngram": 1}),
    ("suffix", {"tree": False, "global_max_tokens": 0}),
    ("suffix", {"global_max_tokens": 0}),
    ("lookahead", {}),
    ("lookahead", {"window": 3, "ngram": 3, "guesses": 2}),
    ("eagle3", {}),
]
SEEDED_IDS = ["draft-chain", "draft-sampled-tree", "draft-top-w-tree", "draft-confidence", "ngram-chain", "ngram-tree",
              "suffix-chain", "suffix-tree", "lookahead", "lookahead-small", "eagle3-chain"]


@pytest.fixture(scope="module")
def eagle3_head(target_dir, tmp_path_factory):
    """A random EAGLE-3 head for the target (batch independence does not need acceptance)."""
    from quickdraft.model.eagle3 import new_head, save_eagle3
    from quickdraft.model.loader import load_model

    torch.manual_seed(0)
    return save_eagle3(new_head(load_model(target_dir, dtype="float32")), tmp_path_factory.mktemp("head") / "h")


@pytest.mark.parametrize("policy", ["fixed", "acceptance"])
@pytest.mark.parametrize("method,options", SEEDED_CASES, ids=SEEDED_IDS)
def test_seeded_output_is_the_same_alone_and_beside_other_requests(target_dir, noisy_draft, eagle3_head, method, options,
                                                                  policy):
    """Issue 16: with speculation a seeded request (T > 0) changed when another request shared
    its batch (from token 18 with a draft, token 2 with ngram): how many random numbers a row
    drew depended on the other rows (their k, their remaining tokens, the batch's width)."""
    draft = {"draft": noisy_draft, "eagle3": eagle3_head}.get(method)
    llm = LLM(target_dir, draft=draft, method=method, num_speculative_tokens=4, spec_options=options, policy=policy)
    mine = [SamplingParams(temperature=t, max_tokens=40, seed=s, ignore_eos=True) for t, s in ((0.5, 11), (1.0, 2**40 + 3))]
    others = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),  # greedy, longer
              SamplingParams(temperature=0.7, max_tokens=3, seed=5, ignore_eos=True),  # finishes early
              SamplingParams(temperature=1.3, top_k=20, max_tokens=25, ignore_eos=True)]  # unseeded
    alone = [llm.generate([PROMPTS[i]], p)[0].token_ids for i, p in enumerate(mine)]
    beside = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[0]],
                          [others[0], mine[0], others[1], mine[1], others[2]])
    assert [beside[1].token_ids, beside[3].token_ids] == alone
    assert beside[1].stats.num_draft_tokens + beside[3].stats.num_draft_tokens > 0  # they did speculate
    again = llm.generate([PROMPTS[1], PROMPTS[0]], [others[2], mine[0]])  # another neighbour, another row
    assert again[1].token_ids == alone[0]


def test_seeds_differing_above_32_bits_give_different_outputs(target_dir, noisy_draft):
    llm = make(target_dir, noisy_draft, "draft", {})
    outs = [llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=24, seed=s, ignore_eos=True))[0]
            for s in (5, 5 + 2**32, 5)]
    assert outs[0].token_ids == outs[2].token_ids != outs[1].token_ids


class _CPU:
    device = "cpu"


@pytest.mark.parametrize("method,options", [("lookahead", {}), ("lookahead", {"window": 3, "ngram": 3, "guesses": 2}),
                                            ("ngram", {"num_candidates": 3, "min_ngram": 1}), ("suffix", {"global_max_tokens": 0})])
def test_a_rows_draft_follows_its_own_depth_bound(method, options):
    """The engine drafts to the deepest row's k and cuts each row's draft to its own (ks). A row's
    draft and state must come from its own bound: lookahead built its Jacobi window to the batch's
    k, so a seeded request's tokens changed with an unseeded neighbour's acceptance."""
    from quickdraft.proposers import PROPOSERS
    from quickdraft.proposers.base import ProposeBatch

    mine = [0, 5, 7, 9, 11, 5, 7, 9, 11, 5, 7, 9, 11, 5]
    other = [0, 20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21]
    alone, beside = (PROPOSERS[method].build(target=_CPU(), **options) for _ in range(2))
    alone.start(0, mine)
    beside.start(0, mine)
    beside.start(1, other)
    for k_mine in (1, 2):
        a = alone.propose(ProposeBatch([mine], k_mine, None, [], ks=[k_mine]))
        b = beside.propose(ProposeBatch([mine, other], 5, None, [], ks=[k_mine, 5]))
        want = [t for t in a.tokens[0].tolist() if t >= 0]
        assert [t for t in b.tokens[0].tolist() if t >= 0] == want and want
        if method == "lookahead":
            assert beside.rows[0].pending.inputs == alone.rows[0].pending.inputs
            alone.rows[0].pending = beside.rows[0].pending = None  # (no feedback: start the next step afresh)
