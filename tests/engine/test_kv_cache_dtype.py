"""kv_cache_dtype: the target's KV cache in float16 or bfloat16 (halving the bytes a step reads per
cached token). Speculative output equals plain decoding's on the same cache (greedy, every
proposer, any batch; eagerly and through the AOT packages, which are keyed by it), sampled
output follows the distribution of the target attending over its 16-bit keys and values, and
the KV budget counts 2 bytes per element."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.cache import KVCache
from quickdraft.config import EngineConfig, check_kv_cache_dtype
from quickdraft.errors import QuickdraftError
from quickdraft.sampling import BatchSampling, process_logits

from conftest import make_checkpoint
from test_lossless import PROMPT, V, chi2_pvalue

PROMPTS = [[5, 9, 2, 7, 5, 9, 2], [1, 2, 3, 4, 1, 2, 3, 4, 1], [11, 30, 7], [8] * 12]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_the_setting_is_checked_once_everywhere():
    assert check_kv_cache_dtype(None) == "auto" and check_kv_cache_dtype(" FP16 ") == "float16"
    assert check_kv_cache_dtype("bf16") == "bfloat16" and check_kv_cache_dtype("float32") == "float32"
    for bad in ("int8", "fp8", 16, torch.float16):
        with pytest.raises(QuickdraftError, match="kv_cache_dtype must be"):
            check_kv_cache_dtype(bad)
    with pytest.raises(QuickdraftError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="half precision")


@pytest.mark.parametrize("name,dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_a_16_bit_cache_holds_its_dtype_and_halves_the_bytes_per_token(target_dir, name, dtype):
    plain = LLM(target_dir, method="none")
    wide = KVCache.token_bytes(plain.target)
    llm = LLM(target_dir, method="none", kv_cache_dtype=name)
    assert KVCache.token_bytes(llm.target) * 2 == wide
    assert llm.engine.budget.token_bytes * 2 == plain.engine.budget.token_bytes
    llm.generate([PROMPTS[0]], GREEDY)
    assert all(t.dtype == dtype for t in llm.engine.cache.k + llm.engine.cache.v)
    # "float32" on a float32 target is the default cache, not another one
    assert LLM(target_dir, method="none", kv_cache_dtype="float32").target.kv_cache_dtype is None


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_auto_is_float16_for_int8_and_int4_layers_on_a_cpu(target_dir, quantization):
    """llama.cpp's f16 cache for a quantised target (config.AUTO_QUANTISED_KV_CACHE_DTYPE); a float32
    target keeps its dtype, and "float32" keeps a quantised target's cache in float32."""
    assert LLM(target_dir, method="none").target.kv_cache_dtype is None
    llm = LLM(target_dir, method="none", quantization=quantization)
    assert llm.target.kv_cache_dtype == torch.float16
    wide = LLM(target_dir, method="none", quantization=quantization, kv_cache_dtype="float32")
    assert wide.target.kv_cache_dtype is None and wide.engine.budget.token_bytes == 2 * llm.engine.budget.token_bytes
    out = llm.generate([PROMPTS[1]], GREEDY)[0].token_ids
    assert all(t.dtype == torch.float16 for t in llm.engine.cache.k + llm.engine.cache.v) and len(out) == 24
    assert LLM(target_dir, method="none", quantization=quantization,
               kv_cache_dtype="bfloat16").target.kv_cache_dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("method,options", [("draft", {}), ("draft", {"tree_width": 2}), ("suffix", {}),
                                            ("ngram", {"min_ngram": 1, "max_ngram": 2}), ("lookahead", {})])
def test_speculative_greedy_output_is_plain_decodings_on_a_16_bit_cache(target_dir, noisy_draft, name, method,
                                                                       options):
    plain = LLM(target_dir, method="none", kv_cache_dtype=name, max_num_seqs=4)
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    alone = [plain.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert want == alone  # a row's tokens do not depend on its batch
    llm = LLM(target_dir, draft=noisy_draft if method == "draft" else None, method=method, num_speculative_tokens=4,
              kv_cache_dtype=name, spec_options=options, policy="fixed", max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == want
    assert llm.stats.num_accepted_tokens > 0


def test_a_prefix_cache_hit_gives_the_tokens_of_a_miss_on_a_16_bit_cache(target_dir, noisy_draft):
    shared = [4, 8, 15, 16, 23, 42] * 6
    prompts = [shared + [1, 2], shared + [3], shared + [1, 2]]
    cold = LLM(target_dir, draft=noisy_draft, kv_cache_dtype="float16", policy="fixed")
    want = [cold.generate([p], GREEDY)[0].token_ids for p in prompts]
    warm = LLM(target_dir, draft=noisy_draft, kv_cache_dtype="float16", policy="fixed", enable_prefix_caching=True,
               prefix_cache_check="raise")
    assert [warm.generate([p], GREEDY)[0].token_ids for p in prompts] == want
    assert warm.engine.prefix_cache.stats.hits > 0


def exact_joint_through_cache(model, params: SamplingParams) -> np.ndarray:
    """P(x2, x3 | PROMPT) of `model` reading its keys and values back from its own cache (a 16-bit
    cache rounds them): every sequence prefilled through a KVCache of the model's cache dtype."""
    def probs(seqs):
        n = len(seqs[0])
        cache = KVCache.for_model(model, len(seqs), n + 1)
        s = BatchSampling.build([params] * len(seqs), torch.device("cpu"))
        with torch.no_grad():
            logits = model(torch.tensor(seqs), torch.arange(n).expand(len(seqs), n), cache.rows(0, len(seqs)))
        return process_logits(logits[:, -1], s).double()

    p1 = probs([PROMPT])[0]
    p2 = probs([PROMPT + [a] for a in range(V)])
    p3 = probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).numpy()


def test_sampling_on_a_16_bit_cache_follows_that_targets_distribution(tmp_path):
    """Temperature 1 with a draft model on a float16 cache: the pairs (x2, x3) follow the target
    that attends over float16 keys and values, not the draft (the wrong-verifier control)."""
    t = make_checkpoint(tmp_path / "t", vocab=V, seed=0, tokenizer=False, initializer_range=0.3)
    d = make_checkpoint(tmp_path / "d", vocab=V, seed=5, layers=1, tokenizer=False, initializer_range=0.3)
    n = 4000
    llm = LLM(t, draft=d, num_speculative_tokens=2, max_num_seqs=n // 4, policy="fixed", kv_cache_dtype="float16")
    params = SamplingParams(temperature=1.0)
    outs = llm.generate([PROMPT] * n, [SamplingParams(max_tokens=4, seed=i, ignore_eos=True, temperature=1.0)
                                       for i in range(n)])
    counts = np.zeros((V, V))
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    assert llm.stats.num_accepted_tokens > 100 and llm.stats.acceptance_rate < 0.95
    assert chi2_pvalue(counts, exact_joint_through_cache(llm.target, params)) > 1e-3
    assert chi2_pvalue(counts, exact_joint_through_cache(llm.draft, params)) < 1e-6


@pytest.mark.slow
def test_aot_packages_are_keyed_by_the_cache_dtype_and_stay_exact(target_dir, noisy_draft):
    from quickdraft import aot

    plain = LLM(target_dir, method="none", kv_cache_dtype="float16", compile="aot")
    wide = LLM(target_dir, method="none", compile="aot")
    assert aot.shape_key(plain.target) != aot.shape_key(wide.target)
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = LLM(target_dir, draft=noisy_draft, num_speculative_tokens=4, kv_cache_dtype="float16", compile="aot",
              policy="fixed", max_num_seqs=4)
    assert llm.engine.cache is None or llm.engine.cache.k[0].dtype == torch.float16
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert llm.engine.cache.k[0].dtype == torch.float16
