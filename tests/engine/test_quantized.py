"""Inference weight formats in the engine (issue 19): every precision keeps speculative decoding
lossless with respect to the model as loaded. A quantised (or bf16) target's speculative output
equals its own plain output, greedy and in distribution; a quantised draft changes acceptance only."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.model.formats import FastLinear
from quickdraft.model.quant import blocked_supported, onednn_bf16_supported, row_invariant, weight_bytes, weight_format

from test_lossless import N, chi2_pvalue, exact_joint, pair, sampled_joint  # noqa: F401

PROMPTS = [[0, 5, 7, 9, 11], [0, 3], [0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PRECISIONS = [("float32", "int8"), ("float32", "int4"), ("bfloat16", None), ("bfloat16", "int4")]


F32 = weight_format(torch.device("cpu"), torch.float32, None)  # "blocked" with AVX-512 and the kernel built


def formats(model) -> set[str]:
    return {m.fmt for m in model.modules() if isinstance(m, FastLinear)}


@pytest.fixture(scope="module")
def plain_out(target_dir):
    return [o.token_ids for o in LLM(target_dir, method="none").generate(PROMPTS, GREEDY)]


def test_default_formats_are_fused_and_packed(target_dir, draft_dir):
    llm = LLM(target_dir, draft_dir, num_speculative_tokens=3, policy="fixed")
    assert formats(llm.target) == {F32}  # float32 on CPU
    # a draft model is int8 where quickdraft's kernels run (its step reads weights the target's evicts)
    assert formats(llm.draft) == ({"int8"} if blocked_supported() else {F32})
    assert formats(LLM(target_dir, draft_dir, num_speculative_tokens=3, draft_quantization="none").draft) == {F32}
    assert formats(LLM(target_dir, draft_dir, num_speculative_tokens=3, draft_dtype="float32").draft) == {F32}
    layer = llm.target.model.layers[0]
    assert layer.self_attn.q_proj is None and layer.self_attn.qkv_proj.splits[0] == layer.self_attn.qkv_proj.in_features
    assert layer.mlp.gate_up_proj is not None and not any(isinstance(m, torch.nn.Linear) for m in llm.target.modules())
    bf16 = "blocked_bf16" if blocked_supported() else "onednn" if onednn_bf16_supported() else "dense"
    assert formats(LLM(target_dir, method="none", dtype="bfloat16").target) == {bf16}


@pytest.mark.parametrize("dtype,quant", PRECISIONS)
def test_quantised_target_speculative_output_equals_its_plain_output(target_dir, dtype, quant):
    # the float32 model drafts for its own quantised self: most drafts are accepted, some are not
    plain = LLM(target_dir, method="none", dtype=dtype, quantization=quant)
    spec = LLM(target_dir, target_dir, num_speculative_tokens=3, dtype=dtype, quantization=quant,
               draft_dtype="float32", policy="fixed")
    assert formats(spec.target) == {quant or weight_format(torch.device("cpu"), torch.bfloat16, None)}
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert spec.stats.num_accepted_tokens > 0


def test_mkl_float32_format_is_lossless_and_agrees_with_the_default(target_dir, draft_dir, plain_out, monkeypatch):
    """Machines without AVX-512 (or a compiler) keep MKL's `transposed` format: still lossless,
    and its logits are the default format's to float rounding."""
    monkeypatch.setenv("QUICKDRAFT_KERNELS", "0")
    spec = LLM(target_dir, draft_dir, num_speculative_tokens=3, policy="fixed")
    assert formats(spec.target) == formats(spec.draft) == {"transposed"}
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == plain_out
    plain = LLM(target_dir, method="none")
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == plain_out
    monkeypatch.delenv("QUICKDRAFT_KERNELS")
    ids = torch.tensor([PROMPTS[2]])
    with torch.inference_mode():
        assert torch.allclose(LLM(target_dir, method="none").target(ids), plain.target(ids), atol=1e-4)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantised_draft_is_lossless_and_smaller(target_dir, draft_dir, plain_out, quant):
    full = LLM(target_dir, draft_dir, num_speculative_tokens=3, draft_quantization="none", policy="fixed")
    small = LLM(target_dir, draft_dir, num_speculative_tokens=3, draft_quantization=quant, policy="fixed")
    assert formats(small.draft) == {quant} and formats(small.target) == {F32}
    assert weight_bytes(small.draft) < weight_bytes(full.draft)
    assert [o.token_ids for o in small.generate(PROMPTS, GREEDY)] == plain_out
    assert small.stats.num_draft_tokens > 0


def test_draft_precision_differs_from_the_target_and_output_does_not_change(target_dir, plain_out):
    # the target as its own draft: a float32 draft would agree on every token; in bfloat16 it
    # agrees on most, and the output is still exactly the float32 target's
    llm = LLM(target_dir, target_dir, num_speculative_tokens=3, draft_dtype="bfloat16", policy="fixed")
    assert llm.target.dtype == torch.float32 and llm.draft.dtype == torch.bfloat16
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_out
    assert llm.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("target_quant,draft_quant", [(None, "int8"), ("int4", None)])
def test_quantised_models_keep_the_distribution(pair, target_quant, draft_quant):  # noqa: F811
    """Sampled output of speculative decoding follows the (quantised) target's own distribution."""
    target, draft = pair
    llm = LLM(target, draft=draft, num_speculative_tokens=2, max_num_seqs=N,
              quantization=target_quant, draft_quantization=draft_quant, policy="fixed")
    counts = sampled_joint(llm, lambda i: SamplingParams(max_tokens=4, seed=i, ignore_eos=True))
    assert 0.05 < llm.stats.acceptance_rate < 0.95
    assert chi2_pvalue(counts, exact_joint(target, SamplingParams(), quantization=target_quant)) > 1e-3


# 16 ragged prompts (2-24 tokens): a batch's verify step has 16 x (k + 1) = 96 rows and its prefill
# 16 x 24, past every row count where a matmul used to switch paths (PyTorch's int8 / int4 kernels:
# 16; quickdraft's, to a bf16 dense GEMM, before it stayed on the kernel: 64) and past where
# attention's kernel used to hand rows to PyTorch's (12 query rows)
BATCH = [[0] + [(7 * i + 3 * j) % 300 + 2 for j in range(1 + (5 * i) % 23)] for i in range(16)]
# float32 (the default CPU format), int8, int4, and bfloat16 (its weights widened in the kernel,
# attention widened to float32)
EXACT = [("float32", None), ("float32", "int8"), ("float32", "int4"), ("bfloat16", None)]


def needs_row_invariant_kernels():
    if not blocked_supported():
        pytest.skip("no vector path (AVX-512, AVX2) here: PyTorch's GEMMs promise no row invariance")


@pytest.mark.parametrize("dtype,quant", EXACT)
def test_speculative_output_equals_plain_past_every_row_threshold(target_dir, dtype, quant):
    """Greedy, k = 5, a batch of 16 ragged prompts: the speculative output is the same target's
    plain output, and plain decoding of a prompt gives the same tokens alone and in the batch;
    the tokens' logprobs too, to the bit (a verify row's logits are the decode row's)."""
    needs_row_invariant_kernels()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    plain = LLM(target_dir, method="none", dtype=dtype, quantization=quant)
    # the float32 target drafts for its quantised self: most drafts are accepted, some are not
    spec = LLM(target_dir, target_dir, num_speculative_tokens=5, dtype=dtype, quantization=quant,
               draft_dtype="float32", draft_quantization="none", policy="fixed")
    assert row_invariant(plain.target) and row_invariant(spec.target) and row_invariant(spec.draft)
    want = [(o.token_ids, o.logprobs) for o in plain.generate(BATCH, greedy)]
    assert [(o.token_ids, o.logprobs) for o in spec.generate(BATCH, greedy)] == want
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens or (dtype, quant) == ("float32", None)
    alone = [plain.generate([BATCH[i]], greedy)[0] for i in (0, 7)]
    assert [(o.token_ids, o.logprobs) for o in alone] == [want[0], want[7]]


@pytest.mark.parametrize("dtype,quant", EXACT)
def test_token_trees_give_the_plain_output_to_the_bit(target_dir, dtype, quant):
    """Greedy, a draft tree (3 candidates per node) over a batch of 16 ragged prompts: the
    tokens and their logprobs are plain decoding's to the bit, also where a node that is not its
    parent's first child is accepted (its key sat in a later slot than its position)."""
    needs_row_invariant_kernels()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    plain = LLM(target_dir, method="none", dtype=dtype, quantization=quant)
    spec = LLM(target_dir, target_dir, num_speculative_tokens=3, dtype=dtype, quantization=quant,
               draft_dtype="float32", draft_quantization="int4", policy="fixed",
               spec_options={"tree_width": 3})
    want = [(o.token_ids, o.logprobs) for o in plain.generate(BATCH, greedy)]
    assert [(o.token_ids, o.logprobs) for o in spec.generate(BATCH, greedy)] == want
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens


@pytest.mark.parametrize("dtype,quant", EXACT)
def test_seeded_request_does_not_depend_on_its_batch(target_dir, draft_dir, dtype, quant):
    """A seeded sampled request (its prompt 4 tokens, so alone its prefill has 4 rows) gives the
    same tokens and logprobs (to the bit) alone and beside 15 others, plain and speculative (k = 5,
    a draft quantised alike)."""
    needs_row_invariant_kernels()
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True, logprobs=1)
    others = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True) for i in range(15)]
    prompt = BATCH[12][:4]
    prompts = BATCH[:7] + [prompt] + BATCH[8:]  # the seeded one in the middle
    for llm in (LLM(target_dir, method="none", dtype=dtype, quantization=quant),
                LLM(target_dir, draft_dir, num_speculative_tokens=5, dtype=dtype, quantization=quant,
                    draft_quantization=quant, policy="fixed")):
        alone = llm.generate([prompt], seeded)[0]
        beside = llm.generate(prompts, others[:7] + [seeded] + others[7:])[7]
        assert (beside.token_ids, beside.logprobs) == (alone.token_ids, alone.logprobs)
