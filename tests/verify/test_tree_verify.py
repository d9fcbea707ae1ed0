"""Token-tree verification: `tree_greedy_verify` and `tree_rejection_sample`
(quickdraft/verify.py) and the tree helpers `tree_structure` and `tree_mask`
(quickdraft/tree.py).

Tree format (proposers.base.Draft): tokens (B, N), -1 = unused node; parents (B, N),
-1 = under the root (the last committed token), parents[i] < i; siblings are tried in
index order. target_probs / target_argmax index 0 is "after the root", 1 + i "after node i".

Losslessness is tested as in tests/test_verify.py: many independent rows (trials) in one
batched call, seeded draws, and a chi-square test of the emitted tokens. The target is a
second-order Markov chain (the next token depends on the last two tokens: p0 after the
root, P1[a] after a, P2[a, b] after (a, b)), so every tree node has its own distribution
and a verifier that mixes up nodes (a sibling's or a cousin's p) would be caught. A row
that stops early (the tree emitted fewer tokens) is completed by sampling the chain
itself with an independent generator; the completed sequences of length L must then
follow the exact joint p0(a) P1[a](b) P2[a, b](c) ... This tests the joint distribution of
everything the verifier emits, not only per-position marginals.

Every distribution check is paired with controls that the same check must reject: the
draft's distribution, a slightly perturbed target, and known-wrong verifiers implemented
here (resampling from p instead of the residual; testing every sibling against the node's
p instead of the running residual). All randomness is seeded: the tests are deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from quickdraft.tree import tree_mask, tree_structure
from quickdraft.verify import tree_greedy_verify, tree_rejection_sample

pytestmark = pytest.mark.usefixtures("verify_path")  # every test on the kernels and the tensor versions (conftest)

N_TRIALS = 200_000  # rows per distribution test
PASS = 1e-3  # a correct distribution must give a p-value above this
FAIL = 1e-6  # a wrong control must give a p-value below this
V = 5




# ---------------------------------------------------------------------------- helpers


def pad_trees(rows: list[tuple[list[int], list[int]]], width: int | None = None):
    """Per-row (tokens, parents) lists -> padded (B, N) tensors (token -1 = unused)."""
    width = width or max(1, max(len(t) for t, _ in rows))
    tokens = torch.full((len(rows), width), -1, dtype=torch.long)
    parents = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, (toks, pars) in enumerate(rows):
        tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        parents[b, : len(pars)] = torch.tensor(pars, dtype=torch.long)
    return tokens, parents


def depths(parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Reference depths by walking parents (0 for unused nodes)."""
    B, N = tokens.shape
    out = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for i in range(N):
            if tokens[b, i] >= 0:
                par = int(parents[b, i])
                out[b, i] = 1 if par < 0 else out[b, par] + 1
    return out


def check_tree_format(tokens, parents, emitted, num_accepted, path, vocab: int) -> None:
    """emitted (B, D + 1) = the tokens along `path` then one more, -1 padded; path (B, D) a
    root-to-node chain of real nodes in depth order, -1 padded."""
    B, N = tokens.shape
    D = int(depths(parents, tokens).max()) if N else 0
    assert emitted.shape == (B, D + 1) and path.shape == (B, D) and num_accepted.shape == (B,)
    assert emitted.dtype == path.dtype == num_accepted.dtype == torch.long
    assert ((num_accepted >= 0) & (num_accepted <= D)).all()
    for b in range(B):
        a = int(num_accepted[b])
        prev = -1
        for j in range(a):
            node = int(path[b, j])
            assert 0 <= node < N and tokens[b, node] >= 0, f"row {b}: path holds a non-node"
            assert int(parents[b, node]) == prev, f"row {b}: path is not a root-down chain"
            assert emitted[b, j] == tokens[b, node]
            prev = node
        assert (path[b, a:] == -1).all()
        assert 0 <= int(emitted[b, a]) < vocab
        assert (emitted[b, a + 1:] == -1).all()


def children_of(tokens_row: list[int], parents_row: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {-1: []}
    for i, (t, p) in enumerate(zip(tokens_row, parents_row)):
        if t >= 0:
            kids.setdefault(p, []).append(i)
            kids.setdefault(i, [])
    return kids


# ------------------------------------------------- the target: a 2nd-order Markov chain


class Chain2:
    """x1 ~ p0, x2 ~ p1[x1], x_n ~ p2[x_{n-2}, x_{n-1}] for n >= 3 (float32 tables)."""

    def __init__(self, p0: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor):
        self.p0, self.p1, self.p2 = p0.float(), p1.float(), p2.float()

    @classmethod
    def random(cls, seed: int, scale: float = 0.7, top_k: int | None = None) -> Chain2:
        g = torch.Generator().manual_seed(seed)
        logits = [torch.randn(V, generator=g) * scale, torch.randn(V, V, generator=g) * scale,
                  torch.randn(V, V, V, generator=g) * scale]
        if top_k is not None:  # top-k truncation: the other tokens are impossible
            logits = [x.masked_fill(x < x.topk(top_k, -1).values[..., -1:], -torch.inf) for x in logits]
        return cls(*(torch.softmax(x, -1) for x in logits))

    def one_hot(self) -> Chain2:
        """The greedy (temperature 0) version of this chain."""
        oh = lambda t: torch.nn.functional.one_hot(t.argmax(-1), V).float()  # noqa: E731
        return Chain2(oh(self.p0), oh(self.p1), oh(self.p2))

    def node_probs(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """(n, N) tree -> target_probs (n, N + 1, V): p after the root, then after each node."""
        n, N = tokens.shape
        tok = tokens.clamp(min=0)
        par_tok = tok.gather(1, parents.clamp(min=0))
        node = torch.where((parents < 0)[..., None], self.p1[tok], self.p2[par_tok, tok])
        return torch.cat([self.p0.expand(n, 1, V), node], 1)

    def next_probs(self, seq: torch.Tensor, j: int) -> torch.Tensor:
        """Distribution of token j given seq[:, :j]."""
        if j == 0:
            return self.p0.expand(len(seq), V)
        if j == 1:
            return self.p1[seq[:, 0]]
        return self.p2[seq[:, j - 2], seq[:, j - 1]]

    def joint(self, L: int) -> np.ndarray:
        """(V,) * L exact probabilities of the first L tokens (float64)."""
        p0, p1, p2 = (np.asarray(x, dtype=np.float64) for x in (self.p0, self.p1, self.p2))
        J = p0
        if L >= 2:
            J = J[:, None] * p1
        for _ in range(3, L + 1):
            J = J[..., None] * p2.reshape((1,) * (J.ndim - 2) + p2.shape)
        return J


def complete(emitted: torch.Tensor, num_accepted: torch.Tensor, target: Chain2, L: int,
             g: torch.Generator) -> torch.Tensor:
    """Extend each row's emitted tokens (num_accepted + 1 of them) to L tokens by sampling
    the target chain itself (an independent generator)."""
    assert L <= emitted.shape[1]
    seq = emitted[:, :L].clone()
    for j in range(1, L):
        need = num_accepted < j
        if need.any():
            seq[need, j] = torch.multinomial(target.next_probs(seq[need], j), 1, generator=g).squeeze(1)
    assert (seq >= 0).all()
    return seq


def joint_pvalue(seq: torch.Tensor, joint: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square p-value of sequences (n, L) against the exact joint (V,) * L. A sequence of
    probability 0 is an impossible event (p-value 0); cells expecting fewer than
    `min_expected` counts are pooled into one."""
    n, L = seq.shape
    probs = joint.reshape(-1)
    idx = torch.zeros(n, dtype=torch.long)
    for j in range(L):
        idx = idx * V + seq[:, j]
    counts = np.bincount(idx.numpy(), minlength=probs.size).astype(np.float64)
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    probs = probs[support] / probs[support].sum()
    counts = counts[support]
    expected = probs * n
    small = expected < min_expected
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(counts) < 2:
        return 1.0
    return float(stats.chisquare(counts, expected).pvalue)


def gof_pvalue(samples: torch.Tensor, probs) -> float:
    """Chi-square p-value of 1-D token samples (zero-probability hits -> 0)."""
    return joint_pvalue(samples[:, None], np.asarray(probs, dtype=np.float64))


def perturbed_chain(target: Chain2, delta: float = 0.03) -> Chain2:
    """Move `delta` of p0's mass from its most to its least likely (non-zero) token."""
    p0 = target.p0.clone().double()
    hi = int(p0.argmax())
    lo = int(torch.where(p0 > 0, p0, torch.inf).argmin())
    p0[hi] -= delta
    p0[lo] += delta
    return Chain2(p0, target.p1, target.p2)


# ------------------------------------------------------------------- the test trees

# Deterministic tree of depth 2, nodes interleaved (not breadth-first): root children are
# nodes 0, 2, 5 (tokens 2, 0, 4, tried in that order); node 0 has children 1, 3 (tokens
# 1, 3), node 2 has child 4 (token 2), node 5 is a leaf.
DET_TOKENS = [2, 1, 0, 3, 2, 4]
DET_PARENTS = [-1, 0, -1, 0, 2, -1]

# Sampled tree shape: three root children drawn i.i.d. from q0, two children of node 0
# and one of node 1 drawn i.i.d. from Q1[parent token]. Duplicates happen.
SAMPLED_PARENTS = [-1, -1, 0, -1, 0, 1]


def draft_tables(seed: int, scale: float = 0.7):
    g = torch.Generator().manual_seed(seed)
    return (torch.softmax(torch.randn(V, generator=g) * scale, -1),
            torch.softmax(torch.randn(V, V, generator=g) * scale, -1))


def sample_tree(parents: list[int], q0: torch.Tensor, q1: torch.Tensor, n: int, g: torch.Generator):
    """n sampled trees of one shape: root children ~ q0, others ~ q1[parent token].
    Returns tokens (n, N), parents (n, N), draft_probs (n, N, V) (each node's q)."""
    N = len(parents)
    tokens = torch.empty(n, N, dtype=torch.long)
    q = torch.empty(n, N, V)
    for i, par in enumerate(parents):
        q[:, i] = q0.expand(n, V) if par < 0 else q1[tokens[:, par]]
        tokens[:, i] = torch.multinomial(q[:, i], 1, generator=g).squeeze(1)
    return tokens, torch.tensor(parents).expand(n, N).contiguous(), q


def randomness(n: int, N: int, g: torch.Generator):
    return torch.rand(n, N, generator=g), torch.rand(n, dtype=torch.float64, generator=g)


def inverse_cdf(r: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The reference's final draw, written apart from sampling.draw: the first token whose
    float64 running sum of r passes u x its total."""
    c = r.double().cumsum(-1)
    return (c > u.double()[..., None] * c[..., -1:]).int().argmax(-1)


def fixed_tree(n: int, toks=DET_TOKENS, pars=DET_PARENTS):
    N = len(toks)
    return torch.tensor(toks).expand(n, N).contiguous(), torch.tensor(pars).expand(n, N).contiguous()


# ----------------------------------------------- a reference verifier, and wrong variants


def reference_verify(parents: list[int], tokens, target_probs, draft_probs, uniform, final,
                     variant: str = "exact"):
    """Vectorised over rows for one tree *shape* shared by all rows (tokens may differ).

    variant "exact": the documented rule (what tree_rejection_sample must do).
    variant "resample_from_p": on a rejection the residual is not updated: later siblings
        are tested against p and the final token is drawn from p (the classic wrong rule).
    variant "stale_accept": every sibling is tested against the node's own p rather than
        the running residual (the residual is still used for the final token).
    """
    n, N = tokens.shape
    rows = torch.arange(n)
    kids = children_of(list(range(N)), parents)
    level = [-1]
    at = torch.full((n,), -1, dtype=torch.long)
    alive = torch.ones(n, dtype=torch.bool)
    r = target_probs[:, 0].clone()
    own = r.clone()
    path = []
    while True:
        next_level = [c for node in level for c in kids[node]]
        if not next_level:
            break
        moved = torch.zeros(n, dtype=torch.bool)
        new_at = at.clone()
        for node in level:
            for c in kids[node]:
                here = alive & ~moved & (at == node)
                x = tokens[:, c : c + 1]
                q = torch.nn.functional.one_hot(x[:, 0], V).float() if draft_probs is None else draft_probs[:, c]
                q_x = q.gather(1, x).squeeze(1)
                test = own if variant == "stale_accept" else r
                acc = here & (uniform[:, c] * q_x < test.gather(1, x).squeeze(1))
                rej = here & ~acc
                if variant != "resample_from_p":
                    residual = (r - q).clamp_min(0.0)
                    mass = residual.sum(-1, keepdim=True)
                    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), r)
                    r = torch.where(rej[:, None], residual, r)
                moved |= acc
                new_at = torch.where(acc, c, new_at)
        path.append(torch.where(moved, new_at, -1))
        r = torch.where(moved[:, None], target_probs[rows, new_at + 1], r)
        own = torch.where(moved[:, None], target_probs[rows, new_at + 1], own)
        alive &= moved
        at = new_at
        level = next_level
    path = torch.stack(path, 1)
    num_accepted = (path >= 0).sum(1)
    emitted = torch.cat([torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1),
                         torch.full((n, 1), -1, dtype=torch.long)], 1)
    emitted[rows, num_accepted] = inverse_cdf(r, final)
    return emitted, num_accepted, path


# ===================================================================== tree_structure


def test_tree_structure_worked_example():
    #        root
    #       /  |   \
    #      0   1    5
    #     / \   \
    #    2   3   6
    #    |
    #    4          (node 7 unused)
    parents = torch.tensor([[-1, -1, 0, 0, 2, -1, 1, -1]])
    valid = torch.tensor([[True] * 7 + [False]])
    anc, depth = tree_structure(parents, valid)
    assert depth.tolist() == [[1, 1, 2, 2, 3, 1, 2, 0]]
    expected = {0: {0}, 1: {1}, 2: {0, 2}, 3: {0, 3}, 4: {0, 2, 4}, 5: {5}, 6: {1, 6}, 7: set()}
    for i, js in expected.items():
        assert {j for j in range(8) if anc[0, i, j]} == js, f"node {i}"
    assert anc.shape == (1, 8, 8) and anc.dtype == torch.bool and depth.dtype == torch.long


def test_tree_structure_ragged_batch_and_chain():
    tokens, parents = pad_trees([
        ([5, 6, 7], [-1, 0, 1]),  # a chain: node i at depth i + 1
        ([5, 6], [-1, -1]),  # two root children
        ([9], [-1]),
    ], width=4)
    anc, depth = tree_structure(parents, tokens >= 0)
    assert depth.tolist() == [[1, 2, 3, 0], [1, 1, 0, 0], [1, 0, 0, 0]]
    assert anc[0].tolist() == [[True, False, False, False], [True, True, False, False],
                               [True, True, True, False], [False] * 4]
    assert anc[1].tolist() == [[True, False, False, False], [False, True, False, False], [False] * 4, [False] * 4]
    assert torch.equal(depth, depths(parents, tokens))


# =========================================================================== tree_mask


def test_tree_mask_worked_example():
    # row 0: L = 3, tree: 0 and 1 under the root, 2 under 0, 3 under 2
    # row 1: L = 5, tree: a chain 0 -> 1, nodes 2, 3 unused
    tokens, parents = pad_trees([([1, 2, 3, 4], [-1, -1, 0, 2]), ([7, 8], [-1, 0])], width=4)
    anc, _ = tree_structure(parents, tokens >= 0)
    lengths = torch.tensor([3, 5])
    kv_len = 10
    query_nodes = torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 1, -1, -1]])
    mask = tree_mask(lengths, query_nodes, anc, kv_len)
    assert mask.shape == (2, 5, kv_len) and mask.dtype == torch.bool

    def seen(b, t):
        return [s for s in range(kv_len) if mask[b, t, s]]

    # row 0: committed slots 0..2, node j at slot 3 + j
    assert seen(0, 0) == [0, 1, 2]  # the root / a padding query: committed only
    assert seen(0, 1) == [0, 1, 2, 3]  # node 0: itself
    assert seen(0, 2) == [0, 1, 2, 4]  # node 1: itself, not its sibling node 0 (slot 3)
    assert seen(0, 3) == [0, 1, 2, 3, 5]  # node 2: parent 0 and itself, not node 1 (slot 4)
    assert seen(0, 4) == [0, 1, 2, 3, 5, 6]  # node 3: 0, 2, itself
    # row 1: committed slots 0..4, node j at slot 5 + j
    assert seen(1, 0) == [0, 1, 2, 3, 4]
    assert seen(1, 1) == [0, 1, 2, 3, 4, 5]
    assert seen(1, 2) == [0, 1, 2, 3, 4, 5, 6]
    assert seen(1, 3) == seen(1, 4) == [0, 1, 2, 3, 4]  # padding queries


def test_tree_mask_matches_definition_on_random_trees():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        B, N = 3, 6
        rows = []
        for _b in range(B):
            n = int(torch.randint(0, N + 1, (1,), generator=g))
            pars = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
            rows.append(([1] * n, pars))
        tokens, parents = pad_trees(rows, width=N)
        anc, _ = tree_structure(parents, tokens >= 0)
        lengths = torch.randint(1, 6, (B,), generator=g)
        kv_len = int(lengths.max()) + N + 2
        query_nodes = torch.randint(-1, N, (B, 7), generator=g)
        query_nodes = torch.where(torch.gather(tokens, 1, query_nodes.clamp(min=0)) >= 0, query_nodes, -1)
        mask = tree_mask(lengths, query_nodes, anc, kv_len)
        for b in range(B):
            L = int(lengths[b])
            for t in range(query_nodes.shape[1]):
                qn = int(query_nodes[b, t])
                want = set(range(L))
                if qn >= 0:
                    node = qn
                    while node >= 0:  # itself and every ancestor
                        want.add(L + node)
                        node = int(parents[b, node])
                assert {s for s in range(kv_len) if mask[b, t, s]} == want


# ================================================================== tree_greedy_verify


def test_greedy_second_sibling_matches():
    # root children: node 0 (5), node 1 (7); node 2 (1) under 0, node 3 (2) under 1
    tokens, parents = pad_trees([([5, 7, 1, 2], [-1, -1, 0, 1])])
    # argmax after: root, node 0, node 1, node 2, node 3
    target_argmax = torch.tensor([[7, 1, 2, 0, 4]])
    emitted, acc, path = tree_greedy_verify(tokens, parents, target_argmax)
    assert acc.tolist() == [2]
    assert path.tolist() == [[1, 3]]
    assert emitted.tolist() == [[7, 2, 4]]  # path tokens, then the argmax after node 3
    check_tree_format(tokens, parents, emitted, acc, path, 8)


def test_greedy_deep_path_fully_accepted_bonus_from_last_node():
    # a depth-3 path 0 -> 1 -> 3 with a side branch (node 2 under 0)
    tokens, parents = pad_trees([([3, 4, 9, 5], [-1, 0, 0, 1])])
    target_argmax = torch.tensor([[3, 4, 5, 8, 6]])
    emitted, acc, path = tree_greedy_verify(tokens, parents, target_argmax)
    assert acc.tolist() == [3]
    assert path.tolist() == [[0, 1, 3]]
    assert emitted.tolist() == [[3, 4, 5, 6]]  # bonus: argmax after node 3 (index 1 + 3)


def test_greedy_no_child_matches():
    tokens, parents = pad_trees([([1, 2, 3], [-1, -1, 0])])
    target_argmax = torch.tensor([[0, 3, 4, 4]])  # node 2 would match its parent's argmax
    emitted, acc, path = tree_greedy_verify(tokens, parents, target_argmax)
    assert acc.tolist() == [0]
    assert path.tolist() == [[-1, -1]]
    assert emitted.tolist() == [[0, -1, -1]]  # the target's argmax after the root


def test_greedy_match_below_a_rejected_node_does_not_count():
    # node 0 (4) rejected at the root; its child node 1 equals node 0's argmax but is not
    # reachable; node 2 (6) is accepted and its child node 3 is not.
    tokens, parents = pad_trees([([4, 1, 6, 2], [-1, 0, -1, 2])])
    target_argmax = torch.tensor([[6, 1, 1, 3, 0]])
    emitted, acc, path = tree_greedy_verify(tokens, parents, target_argmax)
    assert acc.tolist() == [1]
    assert path.tolist() == [[2, -1]]
    assert emitted.tolist() == [[6, 3, -1]]  # argmax after node 2 (index 3)


def test_greedy_ragged_batch_with_padding():
    rows = [
        ([5, 7, 1, 2], [-1, -1, 0, 1]),  # second sibling, then its child: 2 accepted
        ([3, 4, 9, 5, 8], [-1, 0, 0, 1, 3]),  # a depth-4 chain accepted down to node 3
        ([1], [-1]),  # a single node, rejected
    ]
    tokens, parents = pad_trees(rows)  # N = 5, row 0 and row 2 padded with -1
    target_argmax = torch.tensor([
        [7, 1, 2, 0, 4, 9],
        [3, 4, 5, 8, 2, 6],  # after node 3: 2, but node 4 is 8: rejected there
        [6, 0, 0, 0, 0, 0],  # padded nodes' entries are arbitrary
    ])
    emitted, acc, path = tree_greedy_verify(tokens, parents, target_argmax)
    assert acc.tolist() == [2, 3, 0]
    assert path.tolist() == [[1, 3, -1, -1], [0, 1, 3, -1], [-1, -1, -1, -1]]
    assert emitted.tolist() == [[7, 2, 4, -1, -1], [3, 4, 5, 2, -1], [6, -1, -1, -1, -1]]
    check_tree_format(tokens, parents, emitted, acc, path, 10)
    # each row alone gives the same result (rows do not interact)
    for b, (toks, pars) in enumerate(rows):
        t1, p1 = pad_trees([(toks, pars)])
        e1, a1, path1 = tree_greedy_verify(t1, p1, target_argmax[b : b + 1, : len(toks) + 1])
        assert a1.item() == acc[b]
        D1 = path1.shape[1]
        assert path1[0].tolist() == path[b, :D1].tolist() and (path[b, D1:] == -1).all()
        assert e1[0].tolist() == emitted[b, : D1 + 1].tolist() and (emitted[b, D1 + 1:] == -1).all()


def test_greedy_padding_node_never_matches():
    # a padded node (token -1) sits where the argmax would be "-1 matched"; real argmax
    # values are >= 0, but the padded node must not be followed even by index arithmetic
    tokens, parents = pad_trees([([2, -1, 3], [-1, -1, 0])])
    target_argmax = torch.tensor([[2, 3, 7, 5]])
    emitted, acc, path = tree_greedy_verify(tokens, parents, target_argmax)
    assert acc.tolist() == [2] and path.tolist() == [[0, 2]] and emitted.tolist() == [[2, 3, 5]]


def test_greedy_duplicate_siblings_deepest_then_first():
    """Sampled siblings may repeat a token (at temperature 0 a sampled proposer repeats it).
    Greedy follows the deepest matching node, the first one among equally deep."""
    # nodes 0 and 1 both token 3 under the root; node 2 (token 5) under node 1
    tokens, parents = pad_trees([([3, 3, 5], [-1, -1, 1]), ([3, 3, 5], [-1, -1, 1])])
    target_argmax = torch.tensor([[3, 5, 5, 7], [3, 5, 6, 7]])
    emitted, acc, path = tree_greedy_verify(tokens, parents, target_argmax)
    assert acc.tolist() == [2, 1]
    assert path.tolist() == [[1, 2], [0, -1]]  # row 0: the deeper path; row 1: a tie, the first
    assert emitted.tolist() == [[3, 5, 7], [3, 5, -1]]


def test_greedy_chain_tree_equals_chain_verifier():
    from quickdraft.verify import greedy_verify_host

    g = torch.Generator().manual_seed(5)
    B, k = 64, 4
    target_argmax = torch.randint(0, 3, (B, k + 1), generator=g)
    other = torch.randint(0, 3, (B, k), generator=g)
    draft = torch.where(torch.rand(B, k, generator=g) < 0.7, target_argmax[:, :k], other)
    parents = (torch.arange(k) - 1).expand(B, k).contiguous()
    emitted, acc, path = tree_greedy_verify(draft, parents, target_argmax)
    tokens_chain, acc_chain = greedy_verify_host(draft.tolist(), target_argmax.tolist())
    assert acc.tolist() == acc_chain
    assert emitted.tolist() == [t + [-1] * (k + 1 - len(t)) for t in tokens_chain]
    assert torch.equal(path, torch.where(torch.arange(k) < acc[:, None], torch.arange(k), -1))


# ================================================= tree_rejection_sample: worked examples


def test_rejection_worked_example_deterministic():
    # root children: node 0 (token 1), node 1 (token 2); node 2 (token 3) under node 1
    tokens, parents = pad_trees([([1, 2, 3], [-1, -1, 1])] * 2)
    p = torch.tensor([
        [0.1, 0.6, 0.2, 0.1],  # after the root
        [0.0, 0.0, 0.0, 1.0],  # after node 0
        [0.3, 0.3, 0.4, 0.0],  # after node 1
        [0.25, 0.25, 0.25, 0.25],  # after node 2
    ])
    uniform = torch.tensor([
        [0.7, 0.4, 0.0],  # node 0: 0.7 >= 0.6 rejected; r = (.25, 0, .5, .25); node 1: 0.4 < 0.5 accepted;
                          # node 2: p(3) = 0, rejected even with u = 0; final token from p after node 1
        [0.59, 0.0, 0.0],  # node 0 accepted (0.59 < 0.6); a leaf: bonus from p after node 0
    ])
    final = torch.tensor([0.9, 0.9], dtype=torch.float64)  # past 0.6 of the mass: token 2 after node 1
    emitted, acc, path = tree_rejection_sample(tokens, parents, p.expand(2, 4, 4), None, uniform, final)
    assert acc.tolist() == [1, 1]
    assert path.tolist() == [[1, -1], [0, -1]]
    assert emitted.tolist() == [[2, 2, -1], [1, 3, -1]]
    check_tree_format(tokens, parents, emitted, acc, path, 4)


def test_rejection_deterministic_rejected_children_are_excluded():
    # every child rejected: the final token comes from p with the children's tokens removed
    tokens, parents = pad_trees([([0, 1], [-1, -1])])
    p = torch.tensor([[[0.5, 0.3, 0.2, 0.0]] * 3])
    final = torch.tensor([0.0], dtype=torch.float64)  # would pick 0 if it were still in r
    emitted, acc, _ = tree_rejection_sample(tokens, parents, p, None, torch.tensor([[0.99, 0.99]]), final)
    assert acc.tolist() == [0] and emitted.tolist() == [[2, -1]]


def test_rejection_worked_example_sampled_residual_carries_over_siblings():
    # two sampled siblings, both token 1 (duplicates are legal for sampled siblings)
    tokens, parents = pad_trees([([1, 1], [-1, -1])])
    p = torch.tensor([[[0.6, 0.4, 0.0, 0.0]] * 3])
    q = torch.tensor([[[0.2, 0.6, 0.2, 0.0]] * 2])
    # sibling 1: accept iff u < p/q = 2/3: u = 0.9 rejects; r = norm(max(p - q, 0)) = (1, 0, 0, 0)
    # sibling 2: r(1) = 0, rejected even with u = 0 (testing against p would accept it)
    emitted, acc, path = tree_rejection_sample(tokens, parents, p, q, torch.tensor([[0.9, 0.0]]), torch.tensor([0.5], dtype=torch.float64))
    assert acc.tolist() == [0] and emitted.tolist() == [[0, -1]] and path.tolist() == [[-1]]
    # sibling 1 accepted: u = 0.6 < 2/3
    emitted, acc, path = tree_rejection_sample(tokens, parents, p, q, torch.tensor([[0.6, 0.0]]), torch.tensor([0.5], dtype=torch.float64))
    assert acc.tolist() == [1] and path.tolist() == [[0]] and emitted[0, 0] == 1


def test_rejection_padding_and_ragged_batch():
    rows = [([2, 0, 1], [-1, -1, 0]), ([3], [-1]), ([0, 1, 2, 3, 4], [-1, 0, 1, 2, 3])]
    tokens, parents = pad_trees(rows)
    B, N = tokens.shape
    p = torch.nn.functional.one_hot(torch.tensor([
        [0, 3, 4, 1, 1, 1],  # root -> 0 (node 1; node 0, token 2, rejected); a leaf: bonus 4
        [2, 0, 0, 0, 0, 0],  # root -> 2: node 0 (token 3) rejected; recovered 2
        [0, 1, 2, 3, 4, 2],  # the whole chain accepted; bonus 2
    ]), V).float()
    final = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    emitted, acc, path = tree_rejection_sample(tokens, parents, p, None, torch.full((B, N), 0.5), final)
    assert acc.tolist() == [1, 0, 5]
    assert path.tolist() == [[1, -1, -1, -1, -1], [-1] * 5, [0, 1, 2, 3, 4]]
    assert emitted.tolist() == [[0, 4, -1, -1, -1, -1], [2, -1, -1, -1, -1, -1], [0, 1, 2, 3, 4, 2]]
    check_tree_format(tokens, parents, emitted, acc, path, V)


# ------------------------------------- exact agreement with the reference on random trees


def random_tree_rows(B: int, N: int, g: torch.Generator, distinct: bool = True, max_depth: int = 4):
    """Random ragged trees: random parents, tokens distinct among siblings if `distinct`
    (a node with no distinct token left is unused, with its subtree), random padding."""
    rows = []
    for _ in range(B):
        n = int(torch.randint(0, N + 1, (1,), generator=g))
        toks, pars, depth = [], [], []
        for i in range(n):
            par = int(torch.randint(-1, i, (1,), generator=g))
            if par >= 0 and (toks[par] < 0 or depth[par] >= max_depth):
                par = -1
            used = {toks[j] for j in range(i) if pars[j] == par and toks[j] >= 0}
            free = [t for t in range(V) if t not in used] if distinct else list(range(V))
            tok = free[int(torch.randint(0, len(free), (1,), generator=g))] if free else -1
            toks.append(tok)
            pars.append(par)
            depth.append(1 if par < 0 else depth[par] + 1)
        rows.append((toks, pars))
    tokens, parents = pad_trees(rows, width=N)
    # unused nodes' own parents are arbitrary (< i) in real drafts; keep them
    return tokens, parents


def scalar_reference(tokens, parents, target_probs, draft_probs, uniform, final):
    """Row by row, node by node, in float64: the rule as the docstring states it."""
    B, N = tokens.shape
    out = []
    for b in range(B):
        kids = children_of(tokens[b].tolist(), parents[b].tolist())
        node, path = -1, []
        r = target_probs[b, 0].double()
        while True:
            moved = False
            for c in kids[node]:
                x = int(tokens[b, c])
                q = torch.nn.functional.one_hot(torch.tensor(x), V).double() if draft_probs is None \
                    else draft_probs[b, c].double()
                if uniform[b, c] * q[x] < r[x]:  # accept with prob min(1, r(x) / q(x))
                    node, moved = c, True
                    path.append(c)
                    r = target_probs[b, 1 + c].double()
                    break
                res = (r - q).clamp_min(0)
                if res.sum() > 0:
                    r = res / res.sum()
            if not moved:
                break
        out.append((path, int(inverse_cdf(r, final[b]))))
    return out


@pytest.mark.parametrize("sampled", [False, True])
def test_rejection_matches_scalar_reference_on_random_trees(sampled):
    g = torch.Generator().manual_seed(11 + sampled)
    B, N = 400, 8
    tokens, parents = random_tree_rows(B, N, g, distinct=not sampled)
    target_probs = torch.softmax(torch.randn(B, N + 1, V, generator=g) * 1.5, -1)
    target_probs[:, :, 4] *= torch.rand(B, N + 1, generator=g) < 0.5  # some zeros in p
    target_probs /= target_probs.sum(-1, keepdim=True)
    draft_probs = torch.softmax(torch.randn(B, N, V, generator=g), -1) if sampled else None
    uniform, final = randomness(B, N, g)
    emitted, acc, path = tree_rejection_sample(tokens, parents, target_probs, draft_probs, uniform, final)
    check_tree_format(tokens, parents, emitted, acc, path, V)
    for b, (ref_path, last) in enumerate(scalar_reference(tokens, parents, target_probs, draft_probs, uniform, final)):
        assert path[b, : len(ref_path)].tolist() == ref_path and acc[b] == len(ref_path), f"row {b}"
        assert emitted[b, len(ref_path)] == last, f"row {b}"
    assert len(set(acc.tolist())) >= 3  # the batch is ragged in accepted lengths


# ============================================ one-hot (greedy) target == tree_greedy_verify


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 6), N=st.integers(1, 8), seed=st.integers(0, 2**31 - 1), match=st.floats(0.0, 1.0))
def test_one_hot_target_equals_greedy(B, N, seed, match):
    """A greedy row (one-hot p) makes tree_rejection_sample exactly tree_greedy_verify,
    whatever the draws, with q = None, one-hot q, or a soft q."""
    g = torch.Generator().manual_seed(seed)
    tokens, parents = random_tree_rows(B, N, g, distinct=True)
    target_argmax = torch.randint(0, V, (B, N + 1), generator=g)
    # make a share of the nodes match their parent's argmax, so that deep paths occur
    want = target_argmax.gather(1, parents + 1)
    copy = (torch.rand(B, N, generator=g) < match) & (tokens >= 0)
    for b in range(B):  # keep siblings distinct: copy only if no sibling has that token yet
        for i in range(N):
            if copy[b, i]:
                sib = (parents[b] == parents[b, i]) & (tokens[b] == want[b, i])
                if not sib.any():
                    tokens[b, i] = want[b, i]
    p = torch.nn.functional.one_hot(target_argmax, V).float()
    uniform, final = randomness(B, N, g)
    expected = tree_greedy_verify(tokens, parents, target_argmax)
    check_tree_format(tokens, parents, *expected, V)
    one_hot_q = torch.nn.functional.one_hot(tokens.clamp(min=0), V).float()
    soft_q = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    for q in (None, one_hot_q, soft_q):
        got = tree_rejection_sample(tokens, parents, p, q, uniform, final)
        for a, e in zip(got, expected):
            assert torch.equal(a, e)


def test_one_hot_q_equals_deterministic():
    """q = one-hot(token) is the same as q = None (deterministic candidates), exactly."""
    g = torch.Generator().manual_seed(21)
    B, N = 2000, 8
    tokens, parents = random_tree_rows(B, N, g)
    target_probs = torch.softmax(torch.randn(B, N + 1, V, generator=g), -1)
    uniform, final = randomness(B, N, g)
    q = torch.nn.functional.one_hot(tokens.clamp(min=0), V).float()
    a = tree_rejection_sample(tokens, parents, target_probs, None, uniform, final)
    b = tree_rejection_sample(tokens, parents, target_probs, q, uniform, final)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ================================================= distribution tests (losslessness)


def run_deterministic(target: Chain2, n: int, seed: int, toks=DET_TOKENS, pars=DET_PARENTS):
    g = torch.Generator().manual_seed(seed)
    tokens, parents = fixed_tree(n, toks, pars)
    uniform, final = randomness(n, len(toks), g)
    args = (tokens, parents, target.node_probs(tokens, parents), None, uniform, final)
    return args, tree_rejection_sample(*args)


def run_sampled(target: Chain2, q0, q1, n: int, seed: int, pars=SAMPLED_PARENTS):
    g = torch.Generator().manual_seed(seed)
    tokens, parents, q = sample_tree(pars, q0, q1, n, g)
    uniform, final = randomness(n, len(pars), g)
    args = (tokens, parents, target.node_probs(tokens, parents), q, uniform, final)
    return args, tree_rejection_sample(*args)


def check_lossless(target: Chain2, emitted, acc, seed: int, L: int = 3) -> torch.Tensor:
    """The completed first-L tokens follow the target's joint; the first token's marginal
    follows p0; the controls (a perturbed target) are rejected. Returns the sequences."""
    seq = complete(emitted, acc, target, L, torch.Generator().manual_seed(10_000 + seed))
    pv = joint_pvalue(seq, target.joint(L))
    assert pv > PASS, f"emitted tokens do not follow the target (joint p-value {pv:.2e})"
    assert gof_pvalue(emitted[:, 0], target.p0) > PASS
    pv_bad = joint_pvalue(seq, perturbed_chain(target).joint(L))
    assert pv_bad < FAIL, f"control (perturbed target) not rejected (p-value {pv_bad:.2e})"
    return seq


def test_lossless_deterministic_tree():
    target = Chain2.random(100)
    (tokens, parents, *_), (emitted, acc, path) = run_deterministic(target, N_TRIALS, seed=1)
    check_tree_format(tokens[:300], parents[:300], emitted[:300], acc[:300], path[:300], V)
    assert set(acc.tolist()) == {0, 1, 2} and (acc == 2).sum() > 10_000
    check_lossless(target, emitted, acc, seed=1)
    # Deterministic candidates: a child is accepted iff the emitted token is one of the
    # candidates (rejected candidates are removed from the residual), so P(accept at the
    # root) = p0(2) + p0(0) + p0(4) exactly.
    root_tokens = torch.tensor([2, 0, 4])
    assert torch.equal(acc >= 1, torch.isin(emitted[:, 0], root_tokens))
    res = stats.binomtest(int((acc >= 1).sum()), N_TRIALS, float(target.p0[root_tokens].sum()))
    assert res.pvalue > PASS
    # the same below node 0 (token 2): children tokens 1 and 3
    at0 = path[:, 0] == 0
    assert torch.equal(acc[at0] == 2, torch.isin(emitted[at0, 1], torch.tensor([1, 3])))
    # node 5 (token 4) is a leaf: its rows emit a bonus token from P1[4]
    at5 = path[:, 0] == 5
    assert gof_pvalue(emitted[at5, 1], target.p1[4]) > PASS
    assert gof_pvalue(emitted[at5, 1], target.p1[2]) < FAIL  # control: another node's p


def test_lossless_sampled_siblings():
    target = Chain2.random(200)
    q0, q1 = draft_tables(201)
    (tokens, parents, _, q, *_), (emitted, acc, path) = run_sampled(target, q0, q1, N_TRIALS, seed=2)
    # the trees really have duplicate siblings in a good share of rows
    root = tokens[:, [0, 1, 3]]
    assert ((root[:, :, None] == root[:, None, :]).sum((1, 2)) > 3).float().mean() > 0.3
    check_tree_format(tokens[:300], parents[:300], emitted[:300], acc[:300], path[:300], V)
    assert (acc == 2).sum() > 10_000
    check_lossless(target, emitted, acc, seed=2)
    # control: the draft's own distribution is not the answer
    assert gof_pvalue(emitted[:, 0], q0) < FAIL
    draft_chain = Chain2(q0, q1, target.p2)
    seq = complete(emitted, acc, target, 2, torch.Generator().manual_seed(3))
    assert joint_pvalue(seq, draft_chain.joint(2)) < FAIL


@pytest.mark.parametrize("sampled", [False, True])
def test_lossless_truncated_target(sampled):
    """Top-k truncated p (zeros: impossible tokens) with a draft that puts mass where p is
    0 (untruncated q, and deterministic candidates the target rules out)."""
    target = Chain2.random(300, scale=1.0, top_k=3)
    assert (target.p0 == 0).sum() == 2
    q0, q1 = draft_tables(301, scale=0.3)
    if sampled:
        (tokens, *_), (emitted, acc, path) = run_sampled(target, q0, q1, N_TRIALS, seed=3)
        assert (target.p0[tokens[:, 0]] == 0).float().mean() > 0.2  # proposals p rules out
    else:
        impossible = int(torch.nonzero(target.p0 == 0)[0])
        likely = target.p0.argsort(descending=True).tolist()
        toks = [impossible, likely[1], likely[0], likely[2], likely[0]]
        pars = [-1, -1, 1, 1, 2]
        (tokens, *_), (emitted, acc, path) = run_deterministic(target, N_TRIALS, 3, toks, pars)
        assert (path[:, 0] != 0).all()  # the impossible candidate is never accepted
    # nothing outside the target's support is ever emitted (exact)
    assert (target.p0[emitted[:, 0]] > 0).all()
    two = acc >= 1
    assert (target.p1[emitted[two, 0], emitted[two, 1]] > 0).all()
    check_lossless(target, emitted, acc, seed=4)


def test_lossless_mixed_batch():
    """One call, four kinds of rows: sampled trees (soft q), a deterministic tree and a
    deeper ragged one (given as one-hot q), and greedy rows (one-hot p) that must match
    tree_greedy_verify exactly."""
    target = Chain2.random(400)
    greedy = target.one_hot()
    q0, q1 = draft_tables(401)
    g = torch.Generator().manual_seed(402)
    n = N_TRIALS // 4
    N = 7
    groups = []
    # A: sampled, shape SAMPLED_PARENTS (6 nodes) padded to 7
    t, par, q = sample_tree(SAMPLED_PARENTS, q0, q1, n, g)
    groups.append((t, par, q, target))
    # B: deterministic tree, padded to 7
    t, par = fixed_tree(n)
    groups.append((t, par, None, target))
    # C: a deeper deterministic tree (depth 3) using all 7 nodes
    t, par = fixed_tree(n, [1, 3, 2, 0, 4, 0, 3], [-1, 0, 1, -1, 3, 0, -1])
    groups.append((t, par, None, target))
    # D: greedy rows with sampled trees (distinct siblings after the draw are not required)
    t, par, q = sample_tree(SAMPLED_PARENTS, q0, q1, n, g)
    groups.append((t, par, q, greedy))

    tokens = torch.full((4 * n, N), -1, dtype=torch.long)
    parents = torch.full((4 * n, N), -1, dtype=torch.long)
    draft_probs = torch.full((4 * n, N, V), 1.0 / V)
    target_probs = torch.empty(4 * n, N + 1, V)
    for i, (t, par, q, tg) in enumerate(groups):
        s = slice(i * n, (i + 1) * n)
        w = t.shape[1]
        tokens[s, :w], parents[s, :w] = t, par
        draft_probs[s, :w] = torch.nn.functional.one_hot(t, V).float() if q is None else q
        target_probs[s] = tg.node_probs(tokens[s], parents[s])
    perm = torch.randperm(4 * n, generator=g)  # interleave the kinds of rows
    tokens, parents, draft_probs, target_probs = tokens[perm], parents[perm], draft_probs[perm], target_probs[perm]
    kind = torch.arange(4 * n)[perm] // n
    uniform, final = randomness(4 * n, N, g)
    emitted, acc, path = tree_rejection_sample(tokens, parents, target_probs, draft_probs, uniform, final)
    assert emitted.shape == (4 * n, 4) and path.shape == (4 * n, 3)  # D = 3 from group C
    for k in range(3):
        rows = kind == k
        check_lossless(target, emitted[rows], acc[rows], seed=10 + k, L=4 if k == 2 else 3)
    assert (acc[kind == 2] == 3).sum() > 300  # group C reaches depth 3
    # greedy rows: every emitted token is the target's argmax after the previous ones, and
    # where the tree has no duplicate siblings the result is exactly tree_greedy_verify's
    rows = kind == 3
    e, a, pth = emitted[rows], acc[rows], path[rows]
    seq = complete(e, a, greedy, 3, g)
    assert joint_pvalue(seq, greedy.joint(3)) == 1.0  # only the single greedy sequence occurs
    ge, ga, gp = tree_greedy_verify(tokens[rows], parents[rows], target_probs[rows].argmax(-1))
    t3 = tokens[rows][:, [0, 1, 3]]
    distinct = (t3[:, :, None] == t3[:, None, :]).sum((1, 2)) == 3
    distinct &= tokens[rows][:, 2] != tokens[rows][:, 4]
    assert distinct.sum() > 1000
    assert ge.shape[1] == 3 and (e[:, 3] == -1).all() and (pth[:, 2] == -1).all()  # group D has depth 2
    assert torch.equal(ge[distinct], e[distinct, :3]) and torch.equal(ga[distinct], a[distinct])
    assert torch.equal(gp[distinct], pth[distinct, :2])
    assert (a <= ga).all()  # with duplicate siblings the first match is followed


# ============================================= controls: the tests have power


@pytest.mark.parametrize("sampled", [False, True])
def test_reference_is_the_implementation(sampled):
    """The test's vectorised reference ("exact") reproduces tree_rejection_sample exactly on
    the distribution-test trees, so its wrong variants below differ from the implementation
    only by the one deliberate mistake."""
    target = Chain2.random(500)
    if sampled:
        args, got = run_sampled(target, *draft_tables(501), 50_000, seed=5)
        pars = SAMPLED_PARENTS
    else:
        args, got = run_deterministic(target, 50_000, seed=5)
        pars = DET_PARENTS
    ref = reference_verify(pars, args[0], *args[2:])
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("variant", ["resample_from_p", "stale_accept"])
def test_wrong_verifiers_are_caught(sampled, variant):
    """Known-wrong verifiers fail the same joint check that the real one passes."""
    target = Chain2.random(600 + sampled)
    if sampled:
        args, _ = run_sampled(target, *draft_tables(602), N_TRIALS // 2, seed=6)
        pars = SAMPLED_PARENTS
    else:
        args, _ = run_deterministic(target, N_TRIALS // 2, seed=6)
        pars = DET_PARENTS
    emitted, acc, _ = reference_verify(pars, args[0], *args[2:], variant=variant)
    seq = complete(emitted, acc, target, 3, torch.Generator().manual_seed(7))
    pv = joint_pvalue(seq, target.joint(3))
    assert pv < FAIL, f"wrong verifier {variant!r} not caught (p-value {pv:.2e})"
    emitted, acc, _ = tree_rejection_sample(*args)  # the real one passes on the same inputs
    seq = complete(emitted, acc, target, 3, torch.Generator().manual_seed(7))
    assert joint_pvalue(seq, target.joint(3)) > PASS
