"""The statistical losslessness check behind `quickdraft verify` for a user's own target, proposer
and sampling settings.

Speculative decoding is lossless when every emitted token follows the target's processed
distribution p. The first generated token comes from the prefill (no speculation), so
the check looks at the tokens after it, which come out of speculative steps:

- For each prompt, `samples` seeded continuations are generated with speculation and as
  many without (plain decoding, the control sample). For the most frequent first token x1
  (and the second most frequent when it has enough rows) the distribution of token 2 over
  the rows with that x1 is compared with the exact p(. | prompt, x1) from one target
  forward; likewise token 3 for the most frequent (x1, x2). Selecting a context by the
  frequency of the earlier tokens does not bias the token after it, so each comparison is
  a plain chi-square goodness-of-fit test (`top` likeliest tokens plus an "other" bin,
  cells expected below 5 pooled). Sampling a token of probability 0 fails at once.
- Power: the same speculative samples tested against a wrong distribution (the draft's
  own q, or the target at another temperature) must be rejected, else the test could not
  have seen a real bug and says so.
- Greedy: temperature-0 speculative output equals plain greedy output token for token.

Samples run to 4 tokens, not 3: the engine caps a step's draft at remaining - 1, so only
with 4 does the first speculative step draft 2 tokens, and token 3 covers an accepted
second draft as well as a recovered or bonus token.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import QuickdraftError

DEFAULT_PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
MAX_TOKENS = 4  # see the module docstring
GREEDY_TOKENS = 32
MIN_ROWS = 100  # fewest rows that share a context for that context to be tested
MIN_EXPECTED = 5.0  # chi-square cells expected below this are pooled


# ---- statistics (pure) -------------------------------------------------------------------

def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)
    (series below a + 1, Lentz continued fraction above; Numerical Recipes 6.2)."""
    if df <= 0:
        return 1.0
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    log_front = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1:  # P(a, z) by its series, Q = 1 - P
        term = total = 1.0 / a
        ap = a
        for _ in range(10000):
            ap += 1
            term *= z / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return min(1.0, math.exp(log_front) * h)


def _chisquare_pvalue(observed: list[float], expected: list[float]) -> float:
    try:
        from scipy.stats import chisquare
    except ImportError:
        stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
        return chi2_sf(stat, len(observed) - 1)
    return float(chisquare(observed, expected).pvalue)


def goodness_of_fit(counts: dict[int, int], probs: Sequence[float], top: int = 20) -> dict[str, Any]:
    """Chi-square test of token `counts` against the exact distribution `probs` (length V).

    Bins: the `top` likeliest tokens, each its own bin when it expects >= 5 samples, and
    one "other" bin for the rest; while "other" expects < 5 (but more than nothing) the
    smallest kept bin joins it.
    A sampled token with probability 0 gives p-value 0 (`impossible` counts them)."""
    n = sum(counts.values())
    total = float(sum(probs))
    impossible = sum(c for t, c in counts.items() if probs[t] <= 0)
    out = {"n": n, "bins": 0, "impossible": impossible, "pvalue": None}
    if n == 0:
        return out
    if impossible:
        out["pvalue"] = 0.0
        return out
    order = sorted(range(len(probs)), key=lambda t: -probs[t])[:top]
    kept = [t for t in order if probs[t] / total * n >= MIN_EXPECTED]  # descending probability
    while kept:
        other_exp = n * (1 - sum(probs[t] for t in kept) / total)
        if other_exp >= MIN_EXPECTED or other_exp <= 1e-9 * n or len(kept) == 1:  # enough, or no tail at all
            break
        kept.pop()
    observed = [float(counts.get(t, 0)) for t in kept]
    expected = [probs[t] / total * n for t in kept]
    other_obs, other_exp = n - sum(observed), n - sum(expected)
    if other_exp > 1e-9 * n or other_obs > 0:
        observed.append(float(other_obs))
        expected.append(max(other_exp, 1e-12 * n))
    out["bins"] = len(observed)
    out["pvalue"] = 1.0 if len(observed) < 2 else _chisquare_pvalue(observed, expected)
    return out


# ---- the check -----------------------------------------------------------------------------

def _validate(method: str, draft, k: int, samples: int, batch: int, top: int, alpha: float, seed: int) -> None:
    from .. import proposers

    try:  # one method, "auto" or a list of them ("suffix,draft"): the registry's one check
        cls = proposers.get(method)
    except QuickdraftError:
        cls = None
    if cls is None:
        raise QuickdraftError(f"--method must be one of {', '.join(sorted(proposers.PROPOSERS))}, auto or a list "
                              f"of them (a speculative method to check against plain decoding), got {method!r}")
    if cls.needs_draft_model and draft is None:
        raise QuickdraftError(f"method {method!r} needs a draft model: pass --draft DIR (or pick --method ngram, "
                              "suffix or lookahead)")
    for name, value, low in (("k", k, 1), ("samples", samples, 100), ("batch", batch, 1), ("top", top, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise QuickdraftError(f"{name} must be an integer >= {low}, got {value!r}"
                                  + (" (a chi-square test needs hundreds of samples)" if name == "samples" else ""))
    if not 0 < alpha < 1:
        raise QuickdraftError(f"alpha must be in (0, 1), got {alpha}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise QuickdraftError(f"seed must be an integer in [0, 2**31), got {seed!r}")


def _default_prompts(llm, vocab: int) -> list:
    if llm.tokenizer is not None:
        return list(DEFAULT_PROMPTS)
    return [[3 % vocab, 7 % vocab, 5 % vocab], [2 % vocab], [11 % vocab, 4 % vocab, 9 % vocab, 6 % vocab]]


def _next_token_probs(model, seq: list[int], params, prompt_len: int) -> list[float]:
    """Exact processed p(. | seq) from one full forward, as float64 values: penalised (logit
    bias, repetition / frequency / presence penalties) with seq[prompt_len:] as the output so
    far, then temperature and truncation."""
    import torch

    from ..sampling import BatchSampling, PenaltyState, process_logits

    with torch.inference_mode():
        logits = model(torch.tensor([seq], device=model.device))[:, -1].float()
        penalties = PenaltyState.build([params], [seq[:prompt_len]], logits.shape[-1], model.device)
        if penalties is not None:
            logits = penalties.apply(logits, [seq[prompt_len:]])
        probs = process_logits(logits, BatchSampling.build([params], model.device))
    return probs[0].double().cpu().tolist()


def _contexts(outputs: list[list[int]]) -> list[tuple[int, ...]]:
    """The contexts to test: the most frequent x1, the second if it has MIN_ROWS rows,
    and the most frequent (x1, x2); each a tuple of the tokens before the tested one."""
    firsts = Counter(o[0] for o in outputs).most_common(2)
    ctxs = [(firsts[0][0],)]
    if len(firsts) > 1 and firsts[1][1] >= MIN_ROWS:
        ctxs.append((firsts[1][0],))
    pair, _ = Counter((o[0], o[1]) for o in outputs).most_common(1)[0]
    return ctxs + [pair]


def _rows_after(outputs: list[list[int]], ctx: tuple[int, ...]) -> dict[int, int]:
    return dict(Counter(o[len(ctx)] for o in outputs if tuple(o[: len(ctx)]) == ctx))


def verify_lossless(target, draft=None, method: str = "draft", k: int = 4, spec_options: dict | None = None,
                    params=None, prompts: list | None = None, samples: int = 4000, seed: int = 0,
                    batch: int = 256, top: int = 20, alpha: float = 1e-3, dtype: str | None = "float32",
                    device: str | None = None, llm_factory: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Check statistically that `method` (with `draft`, `k`, `spec_options`) keeps the
    target's distribution under sampling `params` (a SamplingParams; its max_tokens, seed
    and ignore_eos are ignored) on `prompts` (text or token ids; default: short code
    prompts, or token ids for a folder without a tokenizer). `llm_factory(**LLM kwargs)`
    builds the speculative LLM (default quickdraft.LLM); plain decoding shares its target.

    Returns a JSON-ready dict; `passed` is True when every speculative p-value exceeds
    alpha / (number of tests), plain decoding passes the same test, the wrong-distribution
    control is rejected (`control.rejected`), and greedy outputs are identical."""
    from ..config import EngineConfig, SpecConfig
    from ..engine import Engine
    from ..llm import LLM
    from ..sampling import SamplingParams

    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise QuickdraftError("params must be a quickdraft.SamplingParams")
    _validate(method, draft, k, samples, batch, top, alpha, seed)
    started = time.perf_counter()
    factory = llm_factory or LLM
    llm = factory(target=target, draft=draft, method=method, num_speculative_tokens=k, dtype=dtype, device=device,
                  max_num_seqs=batch, spec_options=dict(spec_options or {}),
                  policy="fixed")  # speculate every step: what is tested
    plain = Engine(llm.target, None, EngineConfig(spec=SpecConfig(method="none"), max_num_seqs=batch),
                   llm.tokenizer, tuple(llm.engine.eos_token_ids))
    vocab = llm.target.config.vocab_size
    prompt_list = list(prompts) if prompts else _default_prompts(llm, vocab)
    encoded = [llm.encode(p) for p in prompt_list]
    tok = llm.tokenizer

    def show(ids: Sequence[int]) -> str:
        return repr(tok.decode(list(ids), skip_special_tokens=False)) if tok is not None else str(list(ids))

    result: dict[str, Any] = {
        "config": {"target": str(target), "draft": None if draft is None else str(draft), "method": method, "k": k,
                   "spec_options": dict(spec_options or {}), "temperature": params.temperature,
                   "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
                   "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                   "repetition_penalty": params.repetition_penalty,
                   "logit_bias": None if params.logit_bias is None else dict(params.logit_bias), "samples": samples,
                   "seed": seed, "batch": batch, "top": top, "alpha": alpha, "dtype": str(llm.target.dtype),
                   "device": str(llm.target.device), "max_tokens": MAX_TOKENS},
        "prompts": [{"prompt": p if isinstance(p, str) else list(p), "token_ids": ids}
                    for p, ids in zip(prompt_list, encoded)],
    }

    # -- distribution check: speculative and plain samples, the same seeds
    dist: dict[str, Any] = {"tests": [], "skipped": None}
    control: dict[str, Any] = {"kind": None, "min_pvalue": None, "rejected": None}
    if params.greedy:
        dist["skipped"] = "temperature 0: the output is deterministic, see the greedy check"
    else:
        sampled = [replace(params, max_tokens=MAX_TOKENS, seed=seed * 2**32 + i, ignore_eos=True, stop=())
                   for _ in encoded for i in range(samples)]
        reqs = [ids for ids in encoded for _ in range(samples)]
        spec_out = [o.token_ids for o in llm.generate(reqs, sampled)]
        plain_out = [o.token_ids for o in plain.generate(list(zip(reqs, sampled)))]
        if llm.draft is not None and llm.engine.proposer.hidden_layers is None:  # a head is no model of its own
            wrong_model, wrong_params = llm.draft, params
            control["kind"] = "the draft model's own distribution"
        else:
            wrong_t = params.temperature * 1.5 + 0.5
            wrong_model = llm.target
            wrong_params = replace(params, temperature=wrong_t)
            control["kind"] = f"the target's distribution at temperature {wrong_t:g}"
        for pi, ids in enumerate(encoded):
            spec_rows = spec_out[pi * samples:(pi + 1) * samples]
            plain_rows = plain_out[pi * samples:(pi + 1) * samples]
            for ctx in _contexts(spec_rows):
                spec_counts = _rows_after(spec_rows, ctx)
                n = sum(spec_counts.values())
                test = {"prompt_index": pi, "position": len(ctx) + 1, "context": list(ctx), "context_text": show(ctx)}
                if n < MIN_ROWS:
                    test.update(n_speculative=n, skipped=f"only {n} rows (< {MIN_ROWS})")
                    dist["tests"].append(test)
                    continue
                exact = _next_token_probs(llm.target, ids + list(ctx), params, len(ids))
                wrong = _next_token_probs(wrong_model, ids + list(ctx), wrong_params, len(ids))
                spec = goodness_of_fit(spec_counts, exact, top)
                ref = goodness_of_fit(_rows_after(plain_rows, ctx), exact, top)
                ctl = goodness_of_fit(spec_counts, wrong, top)
                test.update(n_speculative=n, n_plain=ref["n"], bins=spec["bins"], p_speculative=spec["pvalue"],
                            p_plain=ref["pvalue"], p_control=ctl["pvalue"], impossible_speculative=spec["impossible"],
                            impossible_plain=ref["impossible"], skipped=None)
                dist["tests"].append(test)
    tests = [t for t in dist["tests"] if not t.get("skipped")]
    m = max(1, len(tests))
    corrected = alpha / m
    dist["alpha_corrected"] = corrected
    dist["num_tests"] = len(tests)
    if dist["skipped"] is None:
        dist["inconclusive"] = not tests
        if not tests:
            dist["skipped"] = f"inconclusive: no context had {MIN_ROWS} rows (a flat distribution); increase --samples"
        dist["speculative_passed"] = all(t["p_speculative"] > corrected for t in tests) if tests else None
        plain_ps = [t["p_plain"] for t in tests if t["p_plain"] is not None and t["n_plain"] >= MIN_ROWS]
        dist["plain_passed"] = all(p > corrected for p in plain_ps)
        if tests:
            control["min_pvalue"] = min(t["p_control"] for t in tests)
            control["rejected"] = control["min_pvalue"] <= corrected
    else:
        dist["speculative_passed"] = dist["plain_passed"] = None
        dist["inconclusive"] = False
    result["distribution"], result["control"] = dist, control
    result["stats"] = llm.stats.to_dict()  # of the sampled run

    # -- greedy equality (exact only in float32, DESIGN.md)
    greedy = replace(params, temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, seed=None, stop=())
    spec_g_out = llm.generate(encoded, greedy)
    spec_g = [o.token_ids for o in spec_g_out]
    plain_g = [o.token_ids for o in plain.generate([(ids, greedy) for ids in encoded])]
    mismatches = [{"prompt_index": i, "first_difference": next(j for j, (a, b) in enumerate(zip(s, p)) if a != b)
                   if any(a != b for a, b in zip(s, p)) else min(len(s), len(p))}
                  for i, (s, p) in enumerate(zip(spec_g, plain_g)) if s != p]
    exact_dtype = str(llm.target.dtype) == "torch.float32"
    result["greedy"] = {"equal": len(encoded) - len(mismatches), "total": len(encoded), "tokens": GREEDY_TOKENS,
                        "mismatches": mismatches, "float32": exact_dtype, "passed": not mismatches or not exact_dtype,
                        "num_draft_tokens": sum(o.stats.num_draft_tokens for o in spec_g_out),
                        "num_accepted_tokens": sum(o.stats.num_accepted_tokens for o in spec_g_out)}

    result["passed"] = bool(dist["speculative_passed"] is not False and dist["plain_passed"] is not False
                            and control["rejected"] is not False and result["greedy"]["passed"]
                            and not dist["inconclusive"])
    result["elapsed_s"] = time.perf_counter() - started
    return result


# ---- the command -------------------------------------------------------------------------

def _fmt(p: float | None) -> str:
    return "-" if p is None else f"{p:.3g}"


def report_lines(r: dict[str, Any]) -> list[tuple[str, str]]:
    """(status, text) per check: PASS, FAIL, SKIP or WARN."""
    lines: list[tuple[str, str]] = []
    dist, control, greedy = r["distribution"], r["control"], r["greedy"]
    cut = dist["alpha_corrected"]
    for t in dist["tests"]:
        where = f"prompt {t['prompt_index']}, token {t['position']} after {t['context_text']}"
        if t.get("skipped"):
            lines.append(("SKIP", f"{where}: {t['skipped']}"))
            continue
        bad = f", {t['impossible_speculative']} samples of probability 0" if t["impossible_speculative"] else ""
        lines.append(("PASS" if t["p_speculative"] > cut else "FAIL",
                      f"{where} (n={t['n_speculative']}, {t['bins']} bins): speculative p={_fmt(t['p_speculative'])}"
                      f"{bad}, plain p={_fmt(t['p_plain'])} (n={t['n_plain']})"))
    if dist["skipped"]:
        lines.append(("SKIP" if r["config"]["temperature"] == 0 else "FAIL", f"distribution: {dist['skipped']}"))
    else:
        lines.append(("PASS" if dist["plain_passed"] else "FAIL",
                      "plain decoding (control sample) follows the exact distribution" if dist["plain_passed"] else
                      "plain decoding also deviates from the exact distribution: the reference itself is off "
                      "(precision? try --dtype float32)"))
    if control["rejected"] is not None:
        against = f"{control['kind']}, min p={_fmt(control['min_pvalue'])}"
        if control["rejected"]:
            lines.append(("PASS", f"power: control rejected: yes ({against})"))
        else:
            lines.append(("FAIL", f"power: control rejected: no ({against}): the test has too little power here, "
                                  "increase --samples"))
    g = f"greedy equality: {greedy['equal']}/{greedy['total']} prompts identical over {greedy['tokens']} tokens"
    if greedy["mismatches"] and not greedy["float32"]:
        lines.append(("WARN", g + f" (not float32: {r['config']['dtype']} rounding can differ)"))
    else:
        lines.append(("PASS" if greedy["passed"] else "FAIL", g))
    if greedy["num_draft_tokens"] == 0:
        lines.append(("WARN", "no draft tokens were proposed in the greedy check: it did not exercise speculation"))
    s = r["stats"]
    if r["config"]["temperature"] > 0 and s["num_draft_tokens"] == 0:
        lines.append(("WARN", "no draft tokens were proposed: the sampled check did not exercise speculation"))
    return lines
