"""Chain verification: `greedy_verify_host` and `rejection_sample` (quickdraft/verify.py).

The distribution tests run many independent trials at once: a large batch of identical
rows (the same p and q), a draft token sampled from q in every row, and fresh U[0, 1)
draws per row (accept tests and the final token). Rows are independent trials, so the emitted tokens at a
position form an i.i.d. sample that a chi-square test compares with the target p.

Every distribution check is paired with a control (the draft's q, or a slightly perturbed
p) that the same check must reject, so a check that cannot fail would show up here.
All randomness is seeded: the tests are deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from quickdraft.sampling import BatchSampling, SamplingParams, process_logits
from quickdraft.sampling import draw as draw_index
from quickdraft.verify import greedy_verify_host, rejection_sample

pytestmark = pytest.mark.usefixtures("verify_path")  # every test on the kernels and the tensor versions (conftest)

N = 200_000  # trials per distribution test
PASS = 1e-3  # a correct distribution must give a p-value above this
FAIL = 1e-6  # a wrong control must give a p-value below this

# Hand-made temperature-1 distributions over V = 5 tokens: no tiny probabilities (so every
# chi-square cell expects hundreds of counts) and p far enough from q for the controls.
P_TABLE = torch.tensor([
    [0.30, 0.25, 0.20, 0.15, 0.10],
    [0.05, 0.40, 0.10, 0.25, 0.20],
    [0.22, 0.08, 0.35, 0.05, 0.30],
    [0.15, 0.15, 0.10, 0.40, 0.20],
])
Q_TABLE = torch.tensor([
    [0.10, 0.15, 0.20, 0.25, 0.30],
    [0.20, 0.20, 0.20, 0.20, 0.20],
    [0.30, 0.10, 0.20, 0.30, 0.10],
])


# ---------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are small (~1e6 elements): one intra-op thread is fastest and keeps the
    file quick on a shared 2-core CPU, where thread hand-offs cost more than the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gof_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of 1-D token samples against `probs`.

    A sample outside the vocabulary or on a token with probability 0 is an impossible
    event: the p-value is then 0. Zero-probability cells are left out of the test itself.
    """
    probs = np.asarray(probs, dtype=np.float64)
    samples = samples.numpy()
    assert samples.size > 0
    if (samples < 0).any() or (samples >= len(probs)).any():
        return 0.0
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    if support.sum() == 1:
        return 1.0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


def tv_distance(samples: torch.Tensor, probs: torch.Tensor) -> float:
    probs = np.asarray(probs, dtype=np.float64)
    counts = np.bincount(samples.numpy(), minlength=len(probs))
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def perturbed(probs: torch.Tensor, delta: float = 0.05) -> torch.Tensor:
    """Move `delta` mass from the most to the least likely (non-zero) token."""
    out = probs.clone().double()
    hi = int(out.argmax())
    lo = int(torch.where(out > 0, out, torch.inf).argmin())
    out[hi] -= delta
    out[lo] += delta
    return out


def draw(q: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """(n, k) draft tokens, column j sampled from q[j]."""
    k, _ = q.shape
    if k == 0:
        return torch.empty(n, 0, dtype=torch.long)
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], dim=1)


def trials(p: torch.Tensor, q: torch.Tensor | None, n: int = N, seed: int = 0, draft: torch.Tensor | None = None):
    """Run n independent verification trials of one chain.

    p (k + 1, V) target probabilities, q (k, V) draft probabilities or None (deterministic
    proposer; then `draft` (n, k) must be given). Returns draft (n, k), tokens (n, k + 1),
    num_accepted (n,).
    """
    g = torch.Generator().manual_seed(seed)
    k1, V = p.shape
    k = k1 - 1
    if draft is None:
        draft = draw(q, n, g)
    target_probs = p.expand(n, k + 1, V).contiguous()
    draft_probs = None if q is None else q.expand(n, k, V).contiguous()
    uniform = torch.rand(n, k, generator=g)
    final = torch.rand(n, dtype=torch.float64, generator=g)
    tokens, num_accepted = rejection_sample(draft, target_probs, draft_probs, uniform, final)
    return draft, tokens, num_accepted


def check_chain_distribution(p: torch.Tensor, tokens: torch.Tensor, num_accepted: torch.Tensor,
                             min_samples: int = 2000) -> None:
    """Emitted token j, among the rows that accepted at least j drafts (so that token j
    was emitted after the target's own prefix), is distributed as p[j]."""
    k = p.shape[0] - 1
    for j in range(k + 1):
        rows = num_accepted >= j
        assert int(rows.sum()) >= min_samples, f"too few trials reach position {j}"
        pv = gof_pvalue(tokens[rows, j], p[j])
        assert pv > PASS, f"position {j}: emitted tokens do not follow p[{j}] (p-value {pv:.2e})"
        pv_bad = gof_pvalue(tokens[rows, j], perturbed(p[j]))
        assert pv_bad < FAIL, f"position {j}: control (perturbed p) not rejected (p-value {pv_bad:.2e})"


def check_format(draft: torch.Tensor, tokens: torch.Tensor, num_accepted: torch.Tensor, V: int) -> None:
    B, k = draft.shape
    assert tokens.shape == (B, k + 1) and num_accepted.shape == (B,)
    assert tokens.dtype == torch.long and num_accepted.dtype == torch.long
    assert ((num_accepted >= 0) & (num_accepted <= k)).all()
    cols = torch.arange(k + 1)
    emitted = cols <= num_accepted[:, None]  # (B, k + 1): num_accepted + 1 tokens per row
    assert (tokens[~emitted] == -1).all(), "positions after the emitted tokens must be -1"
    assert ((tokens[emitted] >= 0) & (tokens[emitted] < V)).all()
    prefix = cols[:k] < num_accepted[:, None]  # the accepted draft tokens are kept as they are
    assert (tokens[:, :k][prefix] == draft[prefix]).all()


def process(logits: torch.Tensor, **params) -> torch.Tensor:
    """(k, V) logits -> (k, V) processed probabilities for one request."""
    s = BatchSampling.build([SamplingParams(**params)], torch.device("cpu"))
    return process_logits(logits[None], s)[0]


# ------------------------------------------------------------------ output format


@pytest.mark.parametrize("deterministic", [False, True])
def test_output_format(deterministic):
    k, V = 3, 5
    p, q = P_TABLE[: k + 1], Q_TABLE[:k]
    g = torch.Generator().manual_seed(1)
    draft = draw(q, 5000, g)
    draft, tokens, num_accepted = trials(p, None if deterministic else q, n=5000, seed=1, draft=draft)
    check_format(draft, tokens, num_accepted, V)
    # ragged: the batch holds every accepted count from 0 to k
    assert set(num_accepted.tolist()) == set(range(k + 1))


def test_accept_rule_is_u_below_p_over_q():
    """x is accepted iff u < p(x) / q(x): probe both sides of the threshold 0.5."""
    V = 4
    p = torch.tensor([[0.3, 0.2, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.6, 0.1, 0.2, 0.1]])
    uniform = torch.tensor([[0.0], [0.49], [0.51], [0.999]])
    B = len(uniform)
    draft = torch.zeros(B, 1, dtype=torch.long)  # token 0: p = 0.3, q = 0.6, ratio 0.5
    final = torch.zeros(B, dtype=torch.float64)
    _, acc = rejection_sample(draft, p.expand(B, 2, V), q.expand(B, 1, V), uniform, final)
    assert acc.tolist() == [1, 1, 0, 0]
    # p(x) >= q(x): always accepted, whatever u in [0, 1)
    draft = torch.full((B, 1), 2)
    _, acc = rejection_sample(draft, p.expand(B, 2, V), q.expand(B, 1, V), uniform, final)
    assert acc.tolist() == [1, 1, 1, 1]
    # p(x) = 0: never accepted, even with u = 0
    p0 = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.zeros(B, 1, dtype=torch.long)
    tokens, acc = rejection_sample(draft, p0.expand(B, 2, V), q.expand(B, 1, V), uniform, final)
    assert acc.tolist() == [0, 0, 0, 0]
    assert set(tokens[:, 0].tolist()) <= {1, 2}


def test_rejection_stops_at_first_rejection():
    """A draft after a rejected one is not accepted, even when its own test passes."""
    p = torch.tensor([[0.0, 1.0, 0.0]] * 3)
    draft = torch.tensor([[0, 1]])  # x1 rejected (p = 0), x2 would be accepted
    tokens, acc = rejection_sample(draft, p[None], None, torch.zeros(1, 2), torch.zeros(1, dtype=torch.float64))
    assert acc.tolist() == [0]
    assert tokens.tolist() == [[1, -1, -1]]


# ------------------------------------------------------- distribution: sampled draft


@pytest.mark.parametrize("k", [1, 3])
def test_first_token_follows_target(k):
    p, q = P_TABLE[: k + 1], Q_TABLE[:k]
    _, tokens, _ = trials(p, q, seed=10 + k)
    first = tokens[:, 0]
    assert gof_pvalue(first, p[0]) > PASS
    assert gof_pvalue(first, q[0]) < FAIL  # control: the draft's distribution
    assert gof_pvalue(first, perturbed(p[0])) < FAIL  # control: a nearby wrong distribution


@pytest.mark.parametrize("k", [1, 3])
def test_every_position_follows_target_given_acceptance(k):
    """Given the first j drafts were accepted, emitted token j follows p[j]; for j = k this
    is the bonus token."""
    p, q = P_TABLE[: k + 1], Q_TABLE[:k]
    draft, tokens, acc = trials(p, q, seed=20 + k)
    check_format(draft, tokens, acc, p.shape[-1])
    check_chain_distribution(p, tokens, acc)
    # control: token j (j >= 1) is not distributed as the draft's q[j]
    for j in range(1, k):
        assert gof_pvalue(tokens[acc >= j, j], q[j]) < FAIL


@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_rate_matches_theory(k):
    """P(accept x_j | x_1..x_{j-1} accepted) = sum_x min(p_j(x), q_j(x))."""
    p, q = P_TABLE[: k + 1], Q_TABLE[:k]
    _, _, acc = trials(p, q, seed=30 + k)
    alpha = torch.minimum(p[:k], q).sum(-1).double()
    for j in range(k):
        reached = acc >= j
        res = stats.binomtest(int((acc[reached] >= j + 1).sum()), int(reached.sum()), float(alpha[j]))
        assert res.pvalue > PASS, f"position {j}: acceptance {res.statistic:.4f} vs {float(alpha[j]):.4f}"
        wrong = stats.binomtest(int((acc[reached] >= j + 1).sum()), int(reached.sum()), float(alpha[j]) + 0.03)
        assert wrong.pvalue < FAIL


def test_recovered_token_follows_residual():
    """At a rejection of x_1 the recovered token follows normalize(max(0, p - q))."""
    p, q = P_TABLE[:2], Q_TABLE[:1]
    _, tokens, acc = trials(p, q, seed=40)
    recovered = tokens[acc == 0, 0]
    residual = (p[0] - q[0]).clamp_min(0)
    assert gof_pvalue(recovered, residual / residual.sum()) > PASS
    assert gof_pvalue(recovered, p[0]) < FAIL  # control: resampling from p would be wrong


def test_naive_resampling_is_caught():
    """Power check of the test method: a known-wrong verifier (on rejection, resample from
    p instead of the residual) fails the same first-token check the real one passes."""
    p, q = P_TABLE[:2], Q_TABLE[:1]
    g = torch.Generator().manual_seed(41)
    draft = draw(q, N, g)
    u = torch.rand(N, generator=g)
    final = torch.rand(N, dtype=torch.float64, generator=g)
    accept = u * q[0][draft[:, 0]] < p[0][draft[:, 0]]
    naive_first = torch.where(accept, draft[:, 0], draw_index(p[0].expand(N, 5), final))
    assert gof_pvalue(naive_first, p[0]) < FAIL
    _, tokens, _ = trials(p, q, seed=41)
    assert gof_pvalue(tokens[:, 0], p[0]) > PASS


def test_total_variation_shrinks_with_samples():
    p, q = P_TABLE[:2], Q_TABLE[:1]
    _, small, _ = trials(p, q, n=1_000, seed=50)
    _, large, _ = trials(p, q, n=100_000, seed=51)
    tv_small, tv_large = tv_distance(small[:, 0], p[0]), tv_distance(large[:, 0], p[0])
    assert tv_large < 0.01
    assert tv_large < tv_small
    # control: the draft's q stays far away however many samples
    assert tv_distance(large[:, 0], q[0]) > 0.1


def test_prefix_dependent_target():
    """In real decoding p[1] depends on the accepted x_1. Given x_1 = t was accepted, the
    next emitted token follows P1[t]."""
    V, k = 5, 2
    g = torch.Generator().manual_seed(60)
    P1 = torch.softmax(torch.randn(V, V, generator=g), -1)  # P1[t]: target after prefix t
    Q1 = torch.softmax(torch.randn(V, V, generator=g), -1)  # Q1[t]: draft after prefix t
    p0, q0 = P_TABLE[0], Q_TABLE[0]
    x1 = torch.multinomial(q0, N, replacement=True, generator=g)
    x2 = torch.multinomial(Q1[x1], 1, generator=g).squeeze(1)
    draft = torch.stack([x1, x2], 1)
    # p after (x1, x2) is irrelevant to the check here: any distribution will do
    target = torch.stack([p0.expand(N, V), P1[x1], P_TABLE[3].expand(N, V)], 1)
    draft_probs = torch.stack([q0.expand(N, V), Q1[x1]], 1)
    tokens, acc = rejection_sample(draft, target, draft_probs, torch.rand(N, k, generator=g),
                                   torch.rand(N, dtype=torch.float64, generator=g))
    assert gof_pvalue(tokens[:, 0], p0) > PASS
    for t in range(V):
        rows = (acc >= 1) & (x1 == t)
        assert rows.sum() > 1000
        assert gof_pvalue(tokens[rows, 1], P1[t]) > PASS
        assert gof_pvalue(tokens[rows, 1], P1[(t + 1) % V]) < FAIL  # control: another prefix's p


# ---------------------------------------------------- deterministic draft (q = None)


@pytest.mark.parametrize("k", [1, 3])
def test_deterministic_fixed_draft(k):
    """q = None: the draft is one-hot; accept with probability p(x), else sample from p with x
    removed. Fixed draft tokens, same in every row."""
    p = P_TABLE[: k + 1]
    fixed = torch.tensor([0, 1, 2][:k])  # likely tokens, so that many rows reach position k
    draft, tokens, acc = trials(p, None, seed=70 + k, draft=fixed.expand(N, k).contiguous())
    check_format(draft, tokens, acc, p.shape[-1])
    check_chain_distribution(p, tokens, acc)
    # acceptance of x_1 has probability p0(x_1)
    res = stats.binomtest(int((acc >= 1).sum()), N, float(p[0, fixed[0]]))
    assert res.pvalue > PASS
    # the recovered token never repeats the rejected draft token
    assert (tokens[acc == 0, 0] != fixed[0]).all()


@pytest.mark.parametrize("k", [1, 3])
def test_deterministic_arbitrary_draft(k):
    """q = None with draft tokens chosen by some process the verifier knows nothing about."""
    p = P_TABLE[: k + 1]
    g = torch.Generator().manual_seed(80 + k)
    draft = torch.randint(0, 5, (N, k), generator=g)
    draft[: N // 2] = torch.tensor([0, 1, 2][:k])  # half the rows propose a likely constant chain
    draft, tokens, acc = trials(p, None, seed=80 + k, draft=draft)
    check_format(draft, tokens, acc, p.shape[-1])
    check_chain_distribution(p, tokens, acc)


# ---------------------------------------------------- truncated p and q (zeros in p)


TRUNC_TARGET = torch.tensor([
    [1.0, 2.2, 0.3, 1.8, -0.5, 2.0],
    [0.1, 1.9, 1.5, -1.0, 2.1, 0.0],
    [2.0, -0.3, 0.4, 1.7, 1.0, 1.9],
    [0.5, 0.6, 2.2, 2.0, 1.4, -2.0],
])
TRUNC_DRAFT = torch.tensor([
    [0.8, 2.0, 1.0, 1.2, 0.9, 1.5],
    [1.0, 1.2, 1.8, 0.0, 1.7, 0.2],
    [1.5, 0.5, 0.2, 2.0, 1.1, 1.0],
])


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("target_params, draft_params", [
    (dict(top_k=3), dict(top_k=3)),
    (dict(top_p=0.8), dict(top_p=0.8)),
    (dict(top_k=4, top_p=0.9, min_p=0.1, temperature=0.8), dict(top_k=4, top_p=0.9, min_p=0.1, temperature=0.8)),
    # supports differ: the draft proposes tokens the target has truncated away
    (dict(top_k=2), dict(top_p=0.9)),
])
def test_truncated_distributions(k, target_params, draft_params):
    p = process(TRUNC_TARGET[: k + 1], **target_params)
    q = process(TRUNC_DRAFT[:k], **draft_params)
    assert (p == 0).any() and (q == 0).any(), "the case must exercise truncation"
    draft, tokens, acc = trials(p, q, seed=90 + k)
    check_format(draft, tokens, acc, p.shape[-1])
    check_chain_distribution(p, tokens, acc, min_samples=1000)
    # the draft's q is a wrong answer wherever it differs from p
    if not torch.allclose(p[0], q[0], atol=0.05):
        assert gof_pvalue(tokens[:, 0], q[0]) < FAIL


def test_truncated_target_never_emits_outside_support():
    p = process(TRUNC_TARGET[:2], top_k=2)
    q = process(TRUNC_DRAFT[:1], temperature=1.0)  # untruncated draft: proposes anything
    draft, tokens, acc = trials(p, q, seed=99)
    assert (q[0][draft[:, 0]] > 0).all()
    assert (p[0][tokens[:, 0]] > 0).all()
    assert (p[1][tokens[acc >= 1, 1]] > 0).all()
    assert ((p[0][draft[:, 0]] == 0) <= (acc == 0)).all()  # a draft outside p's support is rejected


# ---------------------------------------------------------------- bonus and k = 0


@pytest.mark.parametrize("k", [1, 3])
def test_q_equals_p_accepts_all_and_bonus_follows_p(k):
    p = P_TABLE[: k + 1]
    draft, tokens, acc = trials(p, p[:k], seed=100 + k)
    assert (acc == k).all(), "q == p must accept every draft"
    assert torch.equal(tokens[:, :k], draft)
    bonus = tokens[:, k]
    assert gof_pvalue(bonus, p[k]) > PASS
    assert gof_pvalue(bonus, p[k - 1]) < FAIL  # control: the previous position's p


def test_k0_samples_from_target():
    p = P_TABLE[:1]
    draft, tokens, acc = trials(p, Q_TABLE[:0], seed=110)
    assert tokens.shape == (N, 1) and (acc == 0).all()
    assert gof_pvalue(tokens[:, 0], p[0]) > PASS
    assert gof_pvalue(tokens[:, 0], perturbed(p[0])) < FAIL
    tokens_none, acc_none = rejection_sample(draft, p.expand(N, 1, 5), None, torch.rand(N, 0),
                                             torch.rand(N, dtype=torch.float64))
    assert tokens_none.shape == (N, 1) and (acc_none == 0).all()


# ------------------------------------------------------------------ greedy verification


def greedy_reference(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy rule as tensors, written independently of quickdraft: accept drafts while
    they equal the target's argmax, then the target's own choice. Returns tokens (B, k + 1)
    padded with -1 and num_accepted (B,), the verifiers' output format."""
    B, k = draft_tokens.shape
    num_accepted = (draft_tokens == target_argmax[:, :k]).long().cumprod(-1).sum(-1)
    tokens = torch.full((B, k + 1), -1, dtype=torch.long)
    for b in range(B):
        n = int(num_accepted[b])
        tokens[b, :n] = draft_tokens[b, :n]
        tokens[b, n] = target_argmax[b, n]
    return tokens, num_accepted


def greedy_host(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_verify_host (the engine's greedy verifier) in the verifiers' tensor format."""
    k = draft_tokens.shape[1]
    tokens, acc = greedy_verify_host(draft_tokens.tolist(), target_argmax.tolist())
    return torch.tensor([t + [-1] * (k + 1 - len(t)) for t in tokens]), torch.tensor(acc)


def test_greedy_worked_examples():
    draft = torch.tensor([
        [1, 2, 3],  # all accepted: bonus 4
        [1, 2, 3],  # rejected at 0: target says 0
        [1, 2, 3],  # rejected in the middle: target says 0 at position 2
        [1, 2, 3],  # rejected at 1; the match at position 2 must not count
        [7, 7, 7],
    ])
    target_argmax = torch.tensor([
        [1, 2, 3, 4],
        [0, 2, 3, 4],
        [1, 2, 0, 4],
        [1, 5, 3, 4],
        [7, 7, 7, 7],
    ])
    tokens, acc = greedy_host(draft, target_argmax)
    assert acc.tolist() == [3, 0, 2, 1, 3]
    assert tokens.tolist() == [
        [1, 2, 3, 4],
        [0, -1, -1, -1],
        [1, 2, 0, -1],
        [1, 5, -1, -1],
        [7, 7, 7, 7],
    ]
    check_format(draft, tokens, acc, 8)


def test_greedy_single_row_and_k1():
    tokens, acc = greedy_host(torch.tensor([[5]]), torch.tensor([[5, 9]]))
    assert tokens.tolist() == [[5, 9]] and acc.tolist() == [1]
    tokens, acc = greedy_host(torch.tensor([[5]]), torch.tensor([[6, 9]]))
    assert tokens.tolist() == [[6, -1]] and acc.tolist() == [0]


@settings(max_examples=80, deadline=None)
@given(B=st.integers(1, 6), k=st.integers(0, 6), V=st.integers(2, 4), seed=st.integers(0, 2**31 - 1))
def test_greedy_on_host_lists_decides_as_the_reference(B, k, V, seed):
    """The engine's all-greedy steps decide on host lists (greedy_verify_host): the same tokens
    and counts as the greedy rule written as tensors, chains ending early (-1) included."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, V, (B, k), generator=g)
    ends = torch.randint(0, k + 1, (B,), generator=g)
    draft = torch.where(torch.arange(k) < ends[:, None], draft, -1)
    target = torch.randint(0, V, (B, k + 1), generator=g)
    tokens, acc = greedy_reference(draft, target)
    host_tokens, host_acc = greedy_verify_host(draft.tolist(), target.tolist())
    assert host_acc == acc.tolist()
    assert host_tokens == [row[:n + 1] for row, n in zip(tokens.tolist(), host_acc)]


def test_greedy_k0_emits_one_token_per_row():
    draft = torch.empty(3, 0, dtype=torch.long)
    tokens, acc = greedy_host(draft, torch.tensor([[4], [0], [2]]))
    assert tokens.tolist() == [[4], [0], [2]]
    assert acc.tolist() == [0, 0, 0]


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 8), k=st.integers(0, 5), V=st.integers(2, 6), seed=st.integers(0, 2**31 - 1),
       match=st.floats(0.0, 1.0))
def test_rejection_sample_one_hot_equals_greedy(B, k, V, seed, match):
    """Greedy rows (one-hot p from process_logits at temperature 0) make rejection_sample
    exactly the greedy rule (greedy_verify_host), whatever the draws, with a one-hot q, with q = None, and even
    with a non-degenerate q (a sampling draft verified by a greedy target)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, k + 1, V, generator=g)
    p = process_logits(logits, BatchSampling.build([SamplingParams(temperature=0)] * B, torch.device("cpu")))
    target_argmax = logits.argmax(-1)
    assert torch.equal(p, torch.nn.functional.one_hot(target_argmax, V).float())
    copy = torch.rand(B, k, generator=g) < match
    draft = torch.where(copy, target_argmax[:, :k], torch.randint(0, V, (B, k), generator=g))
    q = torch.nn.functional.one_hot(draft, V).float()
    uniform = torch.rand(B, k, generator=g)
    final = torch.rand(B, dtype=torch.float64, generator=g)
    q_soft = torch.softmax(torch.randn(B, k, V, generator=g), -1)  # a sampled draft against a greedy target
    expected = greedy_host(draft, target_argmax)
    for draft_probs in (q, None, q_soft):
        tokens, acc = rejection_sample(draft, p, draft_probs, uniform, final)
        assert torch.equal(tokens, expected[0])
        assert torch.equal(acc, expected[1])
    check_format(draft, *expected, V)


@pytest.mark.parametrize("sampled", [False, True])
def test_kernel_equals_the_tensor_version(verify_path, monkeypatch, sampled):
    """The kernel's chains decide and draw as the tensor version does (the draw's block sums aside,
    which differ only within rounding of a block's end: never in these rows), over a vocabulary of
    several blocks, with chains of every length, ended early (-1), accepted in full or not at all."""
    if verify_path == "tensor":
        pytest.skip("compares the two paths")
    g = torch.Generator().manual_seed(31 + sampled)
    B, k, V = 300, 4, 1000
    z = torch.randn(B, k + 1, V, generator=g) * 2
    p = torch.softmax(z, -1)
    q = torch.softmax(z[:, :k] + torch.randn(B, k, V, generator=g), -1) if sampled else None
    tokens = torch.multinomial((q if sampled else p[:, :k]).reshape(-1, V), 1, generator=g).view(B, k)
    tokens[torch.rand(B, k, generator=g) < 0.05] = -1  # some chains end early
    tokens = torch.where((tokens < 0).cumsum(1) > 0, -1, tokens)
    uniform = torch.rand(B, k, generator=g)
    uniform[:20] = 0.0  # every token passes
    final = torch.rand(B, dtype=torch.float64, generator=g)
    got = rejection_sample(tokens, p, q, uniform, final)
    with monkeypatch.context() as m:
        m.setenv("QUICKDRAFT_KERNELS", "0")
        want = rejection_sample(tokens, p, q, uniform, final)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    lengths = set(got[1].tolist())
    assert {0, k} <= lengths and len(lengths) >= 4  # none, all, and lengths between
