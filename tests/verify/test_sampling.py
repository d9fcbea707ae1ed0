"""SamplingParams validation and the pure functions of quickdraft/sampling.py:
process_logits (temperature, top-k, top-p, min-p, greedy), draw (inverse CDF) and the counter-based
per-request randomness (StepRandom)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats

from quickdraft import QuickdraftError, kernels
from quickdraft.sampling import BatchSampling, SamplingParams, StepRandom, Stream, draw, process_logits, seed_key

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one intra-op thread is fastest on a shared 2-core CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gof_pvalue(samples: torch.Tensor, probs) -> float:
    """Chi-square goodness-of-fit p-value; 0 when a sample falls on a zero-probability token."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    counts = np.bincount(samples.numpy(), minlength=len(probs))
    if len(counts) > len(probs) or counts[probs == 0].sum() > 0:
        return 0.0
    support = probs > 0
    return float(stats.chisquare(counts[support], probs[support] * counts.sum()).pvalue)


def build(*params: SamplingParams) -> BatchSampling:
    return BatchSampling.build(list(params), CPU)


# ------------------------------------------------------------ SamplingParams validation


BAD_PARAMS = [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=-1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=-math.inf), "temperature"),
    (dict(temperature=100.5), "temperature"),
    (dict(temperature="1.0"), "temperature"),
    (dict(temperature=None), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.0001), "top_p"),
    (dict(top_p=2), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_k="3"), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=None), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.01), "min_p"),
    (dict(min_p=math.nan), "min_p"),
    (dict(min_p=math.inf), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_tokens=16.0), "max_tokens"),
    (dict(max_tokens="16"), "max_tokens"),
    (dict(max_tokens=None), "max_tokens"),
    (dict(max_tokens=False), "max_tokens"),
    (dict(seed=1.5), "seed"),
    (dict(seed="7"), "seed"),
    (dict(seed=True), "seed"),
    (dict(stop=5), "stop"),
    (dict(stop=b"x"), "stop"),
    (dict(stop=["a", 3]), "stop"),
    (dict(stop={"a"}), "stop"),
    (dict(stop=""), "stop"),
    (dict(stop=["a", ""]), "stop"),
    (dict(ignore_eos="yes"), "ignore_eos"),
]


@pytest.mark.parametrize("kwargs, field", BAD_PARAMS, ids=[f"{f}={v!r}" for kw, f in BAD_PARAMS for v in kw.values()])
def test_bad_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(QuickdraftError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    assert field in str(info.value) and info.value.field == field
    # the message names the offending field, not some other one
    others = {"temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop", "ignore_eos"} - {field}
    assert not any(f"invalid {o}" in str(info.value) for o in others)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_huge_int_raises_quickdraft_error(field):
    # e.g. a JSON request body {"temperature": 1e400 written as an integer literal}
    with pytest.raises(QuickdraftError, match=field):
        SamplingParams(**{field: 10**400})


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_out_of_64_bit_range_rejected_or_usable(seed):
    try:
        params = SamplingParams(seed=seed)
    except QuickdraftError as e:  # rejecting it at validation is fine
        assert "seed" in str(e)
        return
    StepRandom([seed_key(params.seed)], [0], CPU).draws(Stream.SAMPLE, 4)  # else it must be usable


def test_quickdraft_error_is_value_error():
    assert issubclass(QuickdraftError, ValueError)


def test_quickdraft_error_field_keeps_the_message():
    import pickle

    exc = QuickdraftError("invalid top_p: must be in (0, 1]", field="top_p")
    assert str(exc) == "invalid top_p: must be in (0, 1]" and exc.args == ("invalid top_p: must be in (0, 1]",)
    assert exc.field == "top_p" and QuickdraftError("no field").field is None
    again = pickle.loads(pickle.dumps(exc))  # across processes (tensor-parallel ranks, deploy) too
    assert str(again) == str(exc) and again.field == "top_p"


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(temperature=0), dict(temperature=0.0), dict(temperature=2), dict(temperature=1e-4),
    dict(top_p=1), dict(top_p=1e-6), dict(top_p=0.5),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=10**6),
    dict(min_p=0), dict(min_p=1), dict(min_p=0.05),
    dict(max_tokens=1), dict(seed=0), dict(seed=-5), dict(seed=2**62), dict(seed=None),
    dict(stop=None), dict(stop=[]), dict(ignore_eos=True),
])
def test_good_params_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_normalised_to_tuple():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("a",)).stop == ("a",)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams().stop == ()
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop=("a",)))  # frozen and hashable


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


# -------------------------------------------------------------------- process_logits


def test_output_is_float32_and_normalised():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=3, temperature=0.5),
              SamplingParams(top_p=0.6), SamplingParams(min_p=0.2, temperature=2.0)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        logits = (torch.randn(len(params), 3, 11, generator=g) * 3).to(dtype)
        probs = process_logits(logits, build(*params))
        assert probs.dtype == torch.float32
        assert probs.shape == logits.shape
        assert (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(params), 3), atol=1e-5, rtol=0)


def test_temperature_one_is_softmax_and_temperature_scales():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    probs = process_logits(logits, build(SamplingParams(), SamplingParams(temperature=2.0),
                                         SamplingParams(temperature=0.5)))
    torch.testing.assert_close(probs[0], logits[0].softmax(-1))
    torch.testing.assert_close(probs[1], (logits[1] / 2).softmax(-1))
    torch.testing.assert_close(probs[2], (logits[2] * 2).softmax(-1))


def test_all_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 1.0, 1.0, 1.0]])
    probs = process_logits(logits, build(SamplingParams(temperature=0), SamplingParams(temperature=0, top_k=2)))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_greedy_row_next_to_sampled_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 2, 9, generator=g) * 2  # (B, k + 1, V) as for target_probs
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.5), SamplingParams(),
              SamplingParams(temperature=0), SamplingParams(top_k=3)]
    probs = process_logits(logits, build(*params))
    for b in (0, 2):
        expected = torch.nn.functional.one_hot(logits[b].argmax(-1), 9).float()
        assert torch.equal(probs[b], expected)
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))
    assert ((probs[3] > 0).sum(-1) == 3).all()


def test_top_k_keeps_exactly_the_k_largest():
    g = torch.Generator().manual_seed(2)
    V = 10
    logits = torch.randn(6, V, generator=g)
    ks = [1, 2, 3, 5, V, 100]  # k >= V keeps everything
    probs = process_logits(logits, build(*[SamplingParams(top_k=k) for k in ks]))
    for row, k in enumerate(ks):
        kept = probs[row] > 0
        top = logits[row].topk(min(k, V)).indices
        assert kept.sum() == min(k, V)
        assert kept[top].all()
        expected = torch.zeros(V)
        expected[top] = logits[row, top].softmax(-1)
        torch.testing.assert_close(probs[row], expected)


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off(top_k):
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    probs = process_logits(logits, build(SamplingParams(top_k=top_k)))
    torch.testing.assert_close(probs[0], logits[0].softmax(-1))


def test_top_p_worked_example():
    """probs 0.4, 0.3, 0.2, 0.1 (shuffled): the kept set is the smallest most-likely prefix
    whose mass reaches top_p."""
    base = torch.tensor([0.2, 0.4, 0.1, 0.3])  # sorted: 0.4 (1), 0.3 (3), 0.2 (0), 0.1 (2)
    logits = base.log().expand(5, 4)
    top_ps = [0.35, 0.65, 0.75, 0.95, 1.0]
    probs = process_logits(logits, build(*[SamplingParams(top_p=t) for t in top_ps]))
    expected = torch.tensor([
        [0.0, 1.0, 0.0, 0.0],  # 0.4 >= 0.35
        [0.0, 4 / 7, 0.0, 3 / 7],  # 0.4 < 0.65 <= 0.7
        [2 / 9, 4 / 9, 0.0, 3 / 9],  # 0.7 < 0.75 <= 0.9
        [0.2, 0.4, 0.1, 0.3],  # 0.9 < 0.95
        [0.2, 0.4, 0.1, 0.3],  # off
    ])
    torch.testing.assert_close(probs, expected)


def test_top_p_applies_after_top_k_and_temperature():
    base = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=3 renormalises to 4/9, 3/9, 2/9; top_p=0.75: 4/9 = 0.44 < 0.75 <= 7/9 keeps two
    probs = process_logits(base.log()[None], build(SamplingParams(top_k=3, top_p=0.75)))
    torch.testing.assert_close(probs[0], torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    # temperature 0.5 squares the probs: 16, 9, 4, 1 (/30); top_p=0.6 keeps 16/30 < 0.6 -> two
    probs = process_logits(base.log()[None], build(SamplingParams(temperature=0.5, top_p=0.6)))
    torch.testing.assert_close(probs[0], torch.tensor([16 / 25, 9 / 25, 0.0, 0.0]))


def test_min_p_worked_example():
    base = torch.tensor([0.1, 0.5, 0.15, 0.25])
    logits = base.log().expand(4, 4)
    probs = process_logits(logits, build(*[SamplingParams(min_p=m) for m in (0.0, 0.25, 0.4, 1.0)]))
    expected = torch.tensor([
        [0.1, 0.5, 0.15, 0.25],
        [0.0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9],  # threshold 0.125 drops 0.1
        [0.0, 0.5 / 0.75, 0.0, 0.25 / 0.75],  # threshold 0.2 drops 0.1 and 0.15
        [0.0, 1.0, 0.0, 0.0],  # only the maximum survives
    ])
    torch.testing.assert_close(probs, expected)


def test_mixed_batch_rows_are_independent():
    """Each row is processed with its own parameters, as if alone in the batch."""
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=2, temperature=0.7),
              SamplingParams(top_p=0.5), SamplingParams(min_p=0.3), SamplingParams(temperature=0),
              SamplingParams(top_k=4, top_p=0.8, min_p=0.1, temperature=1.3)]
    logits = torch.randn(len(params), 3, 12, generator=g) * 2
    probs = process_logits(logits, build(*params))
    for b, p in enumerate(params):
        alone = process_logits(logits[b: b + 1], build(p))[0]
        torch.testing.assert_close(probs[b], alone)
        torch.testing.assert_close(probs[b], torch.from_numpy(reference(logits[b].double().numpy(), p)).float(),
                                   atol=1e-5, rtol=1e-4)


def test_rows_are_bit_identical_alone_and_in_any_batch():
    """A row's probabilities have the same bits alone and beside any other row (min_p, top-k,
    top-p, greedy), in any position: a min_p neighbour does not renormalise the others."""
    g = torch.Generator().manual_seed(11)
    params = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(min_p=0.2),
              SamplingParams(top_k=5, temperature=0.6), SamplingParams(top_p=0.7), SamplingParams(temperature=0),
              SamplingParams(top_k=8, top_p=0.9, min_p=0.05, temperature=1.2)]
    logits = torch.randn(len(params), 2, 4096, generator=g) * 3
    alone = [process_logits(logits[b: b + 1], build(p))[0] for b, p in enumerate(params)]
    for order in ([0, 2], [2, 0], [1, 2, 3], list(range(len(params))), [6, 5, 4, 3, 2, 1, 0]):
        probs = process_logits(logits[order], build(*[params[b] for b in order]))
        for i, b in enumerate(order):
            assert torch.equal(probs[i], alone[b]), (order, b)


def reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Straightforward float64 reference of the documented pipeline, per row of (..., V)."""
    if logits.ndim > 1:
        return np.stack([reference(row, p) for row in logits])
    V = len(logits)
    if p.temperature == 0:
        return np.eye(V)[np.argmax(logits)]
    z = logits / p.temperature
    keep = np.ones(V, dtype=bool)
    order = np.argsort(-z, kind="stable")
    if p.top_k > 0:
        keep[:] = False
        keep[order[: p.top_k]] = True

    def renorm() -> np.ndarray:
        w = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        return w / w.sum()

    probs = renorm()
    if p.top_p < 1:
        mass = 0.0
        for i in order:
            if not keep[i]:
                continue
            if mass >= p.top_p:
                keep[i] = False
            mass += probs[i]
        probs = renorm()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


def _near_boundary(logits: np.ndarray, p: SamplingParams) -> bool:
    """Inputs where float32 and float64 may legitimately disagree about a cut-off."""
    if p.temperature == 0:
        s = np.sort(logits)
        return len(s) > 1 and s[-1] - s[-2] < 1e-4
    z = np.sort(logits / p.temperature)[::-1]
    if np.min(np.abs(np.diff(z))) < 1e-4:
        return True  # near ties around the top-k / top-p cut
    k = p.top_k if p.top_k > 0 else len(z)
    w = np.exp(z[:k] - z[0])
    w /= w.sum()
    mass_before = np.cumsum(w) - w
    if p.top_p < 1 and np.min(np.abs(mass_before - p.top_p)) < 1e-4:
        return True
    probs = reference(logits, SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p))
    kept = probs[probs > 0]
    return p.min_p > 0 and np.min(np.abs(kept - p.min_p * kept.max())) < 1e-4


params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 4.0)),
    top_k=st.one_of(st.just(0), st.just(-1), st.integers(1, 10)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(params_strategy, st.lists(st.floats(-8, 8), min_size=6, max_size=6)),
                     min_size=1, max_size=5))
def test_process_logits_matches_reference(rows):
    params = [p for p, _ in rows]
    logits = np.array([row for _, row in rows], dtype=np.float32)
    assume(not any(_near_boundary(logits[b].astype(np.float64), p) for b, p in enumerate(params)))
    probs = process_logits(torch.from_numpy(logits), build(*params))
    expected = np.stack([reference(logits[b].astype(np.float64), p) for b, p in enumerate(params)])
    np.testing.assert_allclose(probs.numpy(), expected, atol=1e-5, rtol=1e-4)
    # same support (up to float32 underflow of tokens far below the maximum)
    assert ((expected == 0) <= (probs.numpy() == 0)).all()
    assert ((expected > 1e-30) <= (probs.numpy() > 0)).all()


# ------------------------------------------------------------------ draw and StepRandom


def test_draw_follows_weights(draw_path):
    n = 100_000
    weights = torch.tensor([1.0, 2.0, 0.0, 3.0, 4.0])  # unnormalised, with a zero
    g = torch.Generator().manual_seed(4)
    tokens = draw(weights.expand(n, 5), torch.rand(n, dtype=torch.float64, generator=g))
    assert tokens.shape == (n,) and tokens.dtype == torch.long
    assert (tokens != 2).all()
    assert gof_pvalue(tokens, weights) > 1e-3
    assert gof_pvalue(tokens, [1.0, 2.0, 0.0, 3.1, 3.9]) < 1e-6  # control: slightly wrong weights
    assert gof_pvalue(tokens, [1.0, 1.0, 0.0, 1.0, 1.0]) < 1e-6  # control: uniform


def test_draw_batched_per_row_weights(draw_path):
    n = 50_000
    w = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    g = torch.Generator().manual_seed(5)
    tokens = draw(w.repeat(n, 1), torch.rand(2 * n, dtype=torch.float64, generator=g)).view(n, 2)
    assert gof_pvalue(tokens[:, 0], w[0]) > 1e-3 and gof_pvalue(tokens[:, 1], w[1]) > 1e-3
    assert gof_pvalue(tokens[:, 0], w[1]) < 1e-6


def test_draw_one_hot_is_deterministic(draw_path):
    w = torch.nn.functional.one_hot(torch.tensor([3, 0, 2]), 4).float()
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert draw(w, torch.rand(3, dtype=torch.float64, generator=g)).tolist() == [3, 0, 2]


def test_draw_edges_land_on_positive_weights(draw_path):
    """u at the ends of [0, 1) and weights with zeros at either end, tiny or huge totals: always
    a token of positive weight (never one that top-k / top-p / a grammar removed); all-zero
    weights give index 0."""
    w = torch.tensor([[0.0, 0.0, 1e-30, 0.0, 2e-30, 0.0, 0.0],
                      [0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 5e30],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    top = 1.0 - 2.0**-53  # the largest StepRandom.draws value
    for u, expect in ((0.0, [2, 1, 0]), (top, [4, 6, 0]), (0.5, [4, 6, 0])):
        assert draw(w, torch.full((3,), u, dtype=torch.float64)).tolist() == expect
    # u * total rounds to the total for totals like this one; the threshold stays below it
    w = torch.tensor([1.5, 0.0])
    assert draw(w, torch.tensor(top, dtype=torch.float64)).item() == 0
    # a row's token depends on its own weights and uniform only, however many rows share the call
    g = torch.Generator().manual_seed(8)
    p = torch.rand(64, 1000, generator=g) ** 8
    u = torch.rand(64, dtype=torch.float64, generator=g)
    alone = torch.stack([draw(p[b:b + 1], u[b:b + 1])[0] for b in range(64)])
    assert torch.equal(alone, draw(p, u))


def test_draw_across_blocks(draw_path):
    """Vocabularies over DRAW_BLOCK (a multiple of it or not): a chi-square over tokens spread
    across blocks, and thresholds at and just under every block boundary (where a block's own
    running sum and its float64 block sum may round apart) land on positive weights."""
    from quickdraft.sampling import DRAW_BLOCK

    g = torch.Generator().manual_seed(12)
    for V in (2 * DRAW_BLOCK, 3 * DRAW_BLOCK + 77):
        w = torch.zeros(V)
        hot = torch.tensor([0, DRAW_BLOCK - 1, DRAW_BLOCK, V - 1])  # both sides of a boundary, the last token
        w[hot] = torch.tensor([1.0, 2.0, 3.0, 4.0])
        n = 40_000
        tokens = draw(w.expand(n, V), torch.rand(n, dtype=torch.float64, generator=g))
        assert set(tokens.unique().tolist()) <= set(hot.tolist())
        ranks = torch.searchsorted(hot, tokens)
        assert gof_pvalue(ranks, [1.0, 2.0, 3.0, 4.0]) > 1e-3
        assert gof_pvalue(ranks, [1.0, 2.0, 3.2, 3.8]) < 1e-6  # control
        # random weights with zeros sprinkled in (so blocks often end on zeros); u at the boundaries
        p = torch.rand(V, generator=g) * (torch.rand(V, generator=g) < 0.5)
        ends = p.view(-1)[: V - V % DRAW_BLOCK].view(-1, DRAW_BLOCK).sum(-1, dtype=torch.float64).cumsum(0)
        total = p.double().sum()
        u = (ends[:-1] / total).clamp(max=1 - 2.0**-53)
        u = torch.cat([u, torch.nextafter(u, torch.zeros_like(u)), torch.tensor([0.0, 1 - 2.0**-53], dtype=torch.float64)])
        got = draw(p.expand(len(u), V), u)
        assert (p[got] > 0).all()


def test_draw_kernel_equals_the_tensor_version(monkeypatch):
    """The kernel's index is the tensor version's (they differ only where a threshold falls within
    rounding of a block's end: never in these draws), for vocabularies under, at and over a block,
    peaked and flat weights with zeros, one row or many."""
    if not kernels.available():
        pytest.skip("quickdraft's kernels are not available here")
    g = torch.Generator().manual_seed(21)
    for V in (1, 7, 256, 300, 8192, 49152):
        for rows in (1, 5):
            w = torch.rand(rows, V, generator=g) ** 6 * (torch.rand(rows, V, generator=g) < 0.7)
            w = torch.cat([w, torch.softmax(torch.randn(rows, V, generator=g) * 4, -1)])
            u = torch.rand(2 * rows, 200, dtype=torch.float64, generator=g)
            wide = w[:, None].expand(-1, 200, -1)
            kernel = draw(wide, u)
            with monkeypatch.context() as m:
                m.setenv("QUICKDRAFT_KERNELS", "0")
                tensor = draw(wide, u)
            assert torch.equal(kernel, tensor), V


def test_draw_with_step_random_follows_probs(draw_path):
    """What the engine samples with: one StepRandom draw per request."""
    n = 20_000
    probs = torch.tensor([0.1, 0.6, 0.3])
    rnd = StepRandom([seed_key(6)] * n, list(range(n)), CPU)  # n positions of one request
    tokens = draw(probs.expand(n, 3), rnd.draws(Stream.SAMPLE)[:, 0])
    assert gof_pvalue(tokens, probs) > 1e-3
    assert gof_pvalue(tokens, [0.15, 0.55, 0.3]) < 1e-6


def test_same_seed_same_draws_different_seed_different_draws():
    def tokens(seed):
        rnd = StepRandom([seed_key(seed)] * 20, list(range(20)), CPU)
        return draw(torch.full((20, 50), 1 / 50), rnd.draws(Stream.SAMPLE)[:, 0])

    assert torch.equal(tokens(123), tokens(123))
    assert not torch.equal(tokens(123), tokens(124))
    a, b = StepRandom([seed_key(7)], [3], CPU), StepRandom([seed_key(7)], [3], CPU)
    assert torch.equal(a.draws(Stream.FINAL, 8), b.draws(Stream.FINAL, 8))
    assert torch.equal(a.uniform(Stream.ACCEPT, 8), b.uniform(Stream.ACCEPT, 8))


def test_unseeded_requests_differ():
    a, b = StepRandom([seed_key(None)], [0], CPU), StepRandom([seed_key(None)], [0], CPU)
    assert not torch.equal(a.draws(Stream.SAMPLE, 16), b.draws(Stream.SAMPLE, 16))


def test_draw_shapes_and_ranges():
    rnd = StepRandom([seed_key(s) for s in range(4)], [0] * 4, CPU)
    d = rnd.draws(Stream.FINAL, 1000)
    u = rnd.uniform(Stream.ACCEPT, 1000)
    assert d.shape == u.shape == (4, 1000) and d.dtype == torch.float64
    assert ((d >= 0) & (d < 1)).all() and ((u >= 0) & (u < 1)).all()
    assert stats.kstest(d.flatten().numpy(), "uniform").pvalue > 1e-3
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    assert not torch.equal(d[0], d[1])  # rows have their own keys
    assert (d * 2.0**53 == (d * 2.0**53).round()).all() and len(set(d.flatten().tolist())) == d.numel()


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-38, 1e-300, 5e-324, 1e-7, 9.9e-6])
def test_tiny_temperatures_are_greedy_never_nan(temperature):
    """Below GREEDY_BELOW a temperature is greedy: float32 logits divided by it overflow
    (NaN, token 0 repeated), and 1e-300 rounds to 0.0 in float32."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(9)) * 3
    logits[:, 0] = -5.0  # token 0 is never the argmax here: "token 0 repeated" would fail
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    s = BatchSampling.build([params, SamplingParams(temperature=1.0)] * 2, CPU)
    probs = process_logits(logits, s)
    assert not torch.isnan(probs).any()
    assert torch.equal(probs[0::2], torch.nn.functional.one_hot(logits[0::2].argmax(-1), 50).float())
    tokens = draw(probs, StepRandom([seed_key(i) for i in range(4)], [0] * 4, CPU).draws(Stream.SAMPLE)[:, 0])
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))


def test_temperature_just_above_the_greedy_threshold_is_sampled_without_nan():
    params = SamplingParams(temperature=2e-5)
    assert not params.greedy
    probs = process_logits(torch.randn(3, 40, generator=torch.Generator().manual_seed(10)) * 50,
                           BatchSampling.build([params] * 3, CPU))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("top_k", [2**31, 2**63, 2**70])
def test_huge_top_k_is_off(top_k):
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(11))
    s = BatchSampling.build([SamplingParams(top_k=top_k)] * 2, CPU)
    assert torch.allclose(process_logits(logits, s), logits.softmax(-1))


def test_seeds_use_all_64_bits():
    """PyTorch's CPU generator keeps the low 32 bits of a seed: s and s + 2**32 were one stream."""
    for s in (0, 7, 2**31 + 5):
        ra, rb = StepRandom([seed_key(s)], [5], CPU), StepRandom([seed_key(s + 2**32)], [5], CPU)
        assert not torch.equal(ra.draws(1, 32), rb.draws(1, 32))
        assert not torch.equal(ra.uniform(3, 8), rb.uniform(3, 8))
    assert len({seed_key(None) for _ in range(100)}) == 100


def test_step_random_rows_depend_on_their_own_key_and_position_only():
    keys = [seed_key(s) for s in (1, 2, 3)]
    alone = StepRandom(keys[:1], [10], CPU)
    batch = StepRandom([keys[2], keys[0], keys[1]], [4, 10, 99], CPU)
    assert torch.equal(alone.draws(Stream.FINAL, 50)[0], batch.draws(Stream.FINAL, 50)[1])
    assert torch.equal(alone.draws(Stream.FINAL, 3)[0], batch.draws(Stream.FINAL, 7)[1, :3])  # any width
    assert torch.equal(alone.uniform(Stream.ACCEPT, 3)[0], batch.uniform(Stream.ACCEPT, 7)[1, :3])
    assert torch.equal(alone.draft_draws(2, 3)[0], batch.draft_draws(5, 3)[1, :2])  # any depth
    # another position, another stream, another index: other numbers
    assert not torch.equal(alone.draws(Stream.FINAL, 50), StepRandom(keys[:1], [11], CPU).draws(4, 50))
    assert not torch.equal(alone.draws(Stream.FINAL, 50), alone.draws(Stream.SAMPLE, 50))
    assert not torch.equal(alone.draft_draws(2, 3)[0, 0], alone.draft_draws(2, 3)[0, 1])
    assert not torch.equal(alone.draws(Stream.DRAFT, 3, 0), alone.draws(Stream.DRAFT, 3, 1))


def test_step_random_distributions():
    from quickdraft.sampling import StepRandom, seed_key

    rnd = StepRandom([seed_key(s) for s in range(8)], list(range(8)), CPU)
    d, u = rnd.draws(4, 2000), rnd.uniform(3, 500)
    assert ((u >= 0) & (u < 1)).all() and ((d >= 0) & (d < 1)).all()
    assert stats.kstest(d.flatten().numpy(), "uniform").pvalue > 1e-3
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
