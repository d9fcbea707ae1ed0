"""Lossless suite, end to end: the engine's sampled output follows the target's exact
distribution, with a real draft model, at temperature 1 and with truncation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from quickdraft import LLM, SamplingParams
from quickdraft.sampling import BatchSampling, process_logits

from conftest import make_checkpoint, ref_penalize

V = 12
PROMPT = [3, 7, 5]
N = 6000


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    # a large init scale gives peaked, non-uniform distributions: a sharper test
    t = make_checkpoint(root / "t", vocab=V, seed=0, tokenizer=False, initializer_range=0.3)
    d = make_checkpoint(root / "d", vocab=V, seed=5, layers=1, tokenizer=False, initializer_range=0.3)
    return t, d


def exact_joint(model_dir, params: SamplingParams, quantization: str | None = None) -> np.ndarray:
    """P(x2, x3 | prompt) = sum over x1 of P(x1) P(x2 | x1) P(x3 | x1, x2), (V, V).

    The first token comes from the prefill; x2 and x3 come from a speculative step
    (drafted, verified, recovered or bonus), so this is the distribution that step must keep."""
    model = LLM(model_dir, method="none", quantization=quantization).target

    def probs(seqs):
        s = BatchSampling.build([params] * len(seqs), torch.device("cpu"))
        with torch.no_grad():
            return process_logits(model(torch.tensor(seqs))[:, -1], s).double()

    p1 = probs([PROMPT])[0]  # (V,)
    p2 = probs([PROMPT + [a] for a in range(V)])  # (V, V): [x1, x2]
    p3 = probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)  # [x1, x2, x3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).numpy()


def sampled_joint(llm: LLM, params_for_seed) -> np.ndarray:
    outs = llm.generate([PROMPT] * N, [params_for_seed(i) for i in range(N)])
    counts = np.zeros((V, V))
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of `counts` under `probs`; 0 when a cell of probability 0 was sampled."""
    counts, probs = counts.ravel(), probs.ravel() / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5  # pool small cells into one bin so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.3, min_p=0.1),
], ids=["t1", "topk", "topp", "minp"])
def test_speculative_sampling_matches_target_distribution(pair, kw):
    target, draft = pair
    llm = LLM(target, draft=draft, num_speculative_tokens=2, max_num_seqs=N, policy="fixed")
    counts = sampled_joint(llm, lambda i: SamplingParams(max_tokens=4, seed=i, ignore_eos=True, **kw))
    probs = exact_joint(target, SamplingParams(**kw))
    assert 0.05 < llm.stats.acceptance_rate < 0.95  # both accept and reject paths were taken
    assert chi2_pvalue(counts, probs) > 1e-3
    # controls the same test must reject: the draft's distribution, and the target's mixed with it
    wrong = exact_joint(draft, SamplingParams(**kw))
    assert chi2_pvalue(counts, wrong) < 1e-6
    assert chi2_pvalue(counts, 0.7 * probs + 0.3 * wrong) < 1e-6


def test_plain_sampling_matches_target_distribution(pair):
    target, _ = pair
    llm = LLM(target, method="none", max_num_seqs=N)
    counts = sampled_joint(llm, lambda i: SamplingParams(max_tokens=4, seed=i, ignore_eos=True))
    assert chi2_pvalue(counts, exact_joint(target, SamplingParams())) > 1e-3


OTHER_METHODS = [
    ("draft", dict(tree_width=3), dict(temperature=1.0)),
    ("draft", dict(tree_width=2), dict(temperature=0.8, top_p=0.9)),
    ("draft", dict(tree_width=3, tree_sampled=True), dict(temperature=1.0)),
    ("draft", dict(tree_width=2, tree_sampled=True), dict(temperature=0.7, top_k=4)),
    ("ngram", dict(min_ngram=1, max_ngram=2), dict(temperature=1.0)),
    ("ngram", dict(min_ngram=1, max_ngram=2, num_candidates=3), dict(temperature=1.0, top_k=5)),
    ("suffix", dict(), dict(temperature=1.0)),
    ("lookahead", dict(), dict(temperature=1.0)),
]


@pytest.mark.parametrize("method,options,kw", OTHER_METHODS,
                         ids=["draft-tree", "draft-tree-topp", "draft-sampled-tree", "draft-sampled-tree-topk", "ngram", "ngram-tree-topk", "suffix", "lookahead"])
def test_other_proposers_match_target_distribution(pair, method, options, kw):
    """Trees and deterministic proposers keep the target's distribution too. Every request
    here repeats the same prompt, so the suffix proposer's global trie (earlier outputs) and
    the n-gram lookups find candidates, accepted sometimes and rejected sometimes."""
    target, draft = pair
    llm = LLM(target, draft=draft if method == "draft" else None, method=method, num_speculative_tokens=2,
              max_num_seqs=N // 4, spec_options=options, policy="fixed")
    counts = sampled_joint(llm, lambda i: SamplingParams(max_tokens=4, seed=i, ignore_eos=True, **kw))
    probs = exact_joint(target, SamplingParams(**kw))
    assert llm.stats.num_accepted_tokens > 100 and llm.stats.acceptance_rate < 0.95
    assert chi2_pvalue(counts, probs) > 1e-3
    assert chi2_pvalue(counts, exact_joint(draft, SamplingParams(**kw))) < 1e-6


# ---- penalties and logit_bias (issue 18): the exact penalised distribution ----------------------

def exact_joint_penalized(model_dir, params: SamplingParams) -> np.ndarray:
    """exact_joint, with each next-token distribution penalised for its own context."""
    model = LLM(model_dir, method="none").target
    s = BatchSampling.build([params], torch.device("cpu"))

    def probs(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            raw = model(torch.tensor([seq]))[0, -1]
        pen = ref_penalize(raw, PROMPT, seq[len(PROMPT):], params).float()
        return process_logits(pen[None], s)[0].double()

    p1 = probs(PROMPT)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        p2 = probs(PROMPT + [a])
        for b in range(V):
            joint[b] += p1[a] * p2[b] * probs(PROMPT + [a, b])
    return joint.numpy()


@pytest.fixture(scope="module")
def head(pair, tmp_path_factory):
    """An EAGLE-3 head for the lossless pair's target (random: over 12 tokens it still agrees
    with the target often enough to take both verify paths)."""
    from quickdraft.model.eagle3 import new_head, save_eagle3
    from quickdraft.model.loader import load_model

    torch.manual_seed(0)
    return save_eagle3(new_head(load_model(pair[0], dtype="float32")), tmp_path_factory.mktemp("head") / "h")


PENALIZED = dict(repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=-0.5, logit_bias={2: 1.5, 4: -2.0})
# lookups propose repeats, which penalties make unlikely: milder ones keep both verify paths busy
MILD = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=-0.2, logit_bias={2: 1.5, 4: -2.0})


@pytest.mark.parametrize("method,options,kw", [
    ("draft", dict(), dict(temperature=1.0)),
    ("draft", dict(tree_width=2, tree_sampled=True), dict(temperature=0.8, top_k=6)),
    ("draft", dict(tree_width=3), dict(temperature=1.0)),
    ("ngram", dict(min_ngram=1, max_ngram=2, num_candidates=3), dict(temperature=1.0, **MILD)),
    ("suffix", dict(), dict(temperature=1.0, top_p=0.9, **MILD)),
    ("lookahead", dict(), dict(temperature=1.0, **MILD)),
    ("eagle3", dict(), dict(temperature=1.0)),
    ("eagle3", dict(tree_width=2, tree_nodes=4), dict(temperature=0.9, min_p=0.05)),
    ("none", dict(), dict(temperature=1.0)),
], ids=["draft-chain", "draft-sampled-tree-topk", "draft-tree", "ngram-tree", "suffix-topp", "lookahead", "eagle3-chain",
        "eagle3-tree-minp", "plain"])
def test_penalized_sampling_matches_the_penalized_target(pair, head, method, options, kw):
    """Penalties at verify position i count the draft tokens before it (chains) or a node's
    ancestors (trees): the output follows the exact penalised distribution, and not the
    unpenalised one."""
    target, draft = pair
    k = 0 if method == "none" else 2
    llm = LLM(target, draft={"draft": draft, "eagle3": head}.get(method), method=method,
              num_speculative_tokens=k or 2, max_num_seqs=N // 4, spec_options=options, policy="fixed")  # (k: ignored by "none")
    params = {**PENALIZED, **kw}
    counts = sampled_joint(llm, lambda i: SamplingParams(max_tokens=4, seed=i, ignore_eos=True, **params))
    probs = exact_joint_penalized(target, SamplingParams(**params))
    if k:
        assert llm.stats.num_accepted_tokens > 50 and llm.stats.acceptance_rate < 0.95  # both paths ran
    assert chi2_pvalue(counts, probs) > 1e-3
    unpenalized = {n: v for n, v in params.items() if n in ("temperature", "top_k", "top_p")}
    assert chi2_pvalue(counts, exact_joint(target, SamplingParams(**unpenalized))) < 1e-6
