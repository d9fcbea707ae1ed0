"""GGUF targets under tensor parallelism: each rank reads its own rows / columns of every tensor
(`gguf.GGUFWeights`, safetensors' get_slice for a GGUF), equal to the slice of the fully loaded
tensor; other ranks' bytes are never read where the blocks allow it; and 2 gloo ranks give the
single-process GGUF model's logits (float32, 1e-5) and its greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from quickdraft import LLM, QuickdraftError, SamplingParams
from quickdraft.config import ModelConfig
from quickdraft.model.gguf import GGUFWeights, _unpermute, gguf_state_dict, hf_config, read_gguf, read_part
from quickdraft.model.loader import checkpoint_dir, load_model
from quickdraft.model.formats import int4_zero_form
from quickdraft.parallel import ShardPlan, load_tensor_parallel

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_gguf import WIDE, hf_model, vocab_size, write_gguf  # noqa: E402

from conftest import assert_same_logits_through_cache  # noqa: E402

# arch, tensor type, model overrides (K-quant rows hold whole 256-value blocks: WIDE)
FILES = {
    "llama-F32": ("llama", "F32", dict(num_key_value_heads=1)),  # 1 KV head: replicated on 2 ranks
    "llama-Q8_0": ("llama", "Q8_0", {}),
    "qwen2-Q4_0": ("qwen2", "Q4_0", {}),
    "llama-Q4_K": ("llama", "Q4_K", WIDE),  # o_proj's 128 columns per rank cut its 256-value blocks
    "qwen3-Q6_K-tied": ("qwen3", "Q6_K", dict(WIDE, head_dim=64, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            arch, qtype, overrides = FILES[name]
            folder = tmp_path_factory.mktemp(name)
            made[name] = write_gguf(folder / f"{name}.gguf", hf_model(arch, vocab_size("gpt2"), seed=5, **overrides),
                                    arch, qtype=qtype)
        return made[name]

    return make


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _cut(t: torch.Tensor, s) -> torch.Tensor:
    if s is None:
        return t
    t = t[s.start:s.stop] if s.dim == 0 else t[:, s.start:s.stop]
    return torch.zeros_like(t) if s.zero else t


def _cut_groups(groups, s):
    if s is None:
        return groups
    q, scale, zero = groups
    if s.dim == 0:
        return q[s.start:s.stop], scale[s.start:s.stop], zero[s.start:s.stop]
    return q[:, s.start:s.stop], scale[:, s.start // 32:s.stop // 32], zero[:, s.start // 32:s.stop // 32]


def test_unpermuting_whole_heads_equals_slicing_the_unpermuted_tensor():
    heads, head_dim = 6, 8
    w = torch.randn(heads * head_dim, 5)
    for a, b in [(0, 2), (2, 5), (3, 4), (0, 6)]:
        part = _unpermute(w[a * head_dim:b * head_dim], b - a)
        assert torch.equal(part, _unpermute(w, heads)[a * head_dim:b * head_dim])
    # a cut inside a head is not: that is why such a range is cut after un-permuting everything
    assert not torch.equal(_unpermute(w[4:12], 1), _unpermute(w, heads)[4:12])


@pytest.mark.parametrize("name", list(FILES))
@pytest.mark.parametrize("world", [2, 4])
def test_each_ranks_slice_equals_the_slice_of_the_whole_tensor(files, name, world):
    path = files(name)
    g = read_gguf(path)
    cfg = ModelConfig.from_hf(hf_config(g))
    int4: dict = {}
    whole = gguf_state_dict(g, cfg, torch.float32, int4=int4)
    weights = GGUFWeights(path)
    assert sorted(weights.keys()) == sorted(whole)
    for rank in range(world):
        plan = ShardPlan(cfg, rank, world)
        for key, tensor in whole.items():
            s = plan.slice_for(key)
            index = slice(None) if s is None else slice(s.start, s.stop) if s.dim == 0 else (
                slice(None), slice(s.start, s.stop))
            got = weights.get_slice(key)[index]
            assert torch.equal(torch.zeros_like(got) if s is not None and s.zero else got, _cut(tensor, s)), key
            if key in int4 and not (s is not None and s.dim == 1 and s.stop - s.start < 32):
                got = weights.get_slice(key).int4(index)
                # (the loader keeps a Q4_K matrix's codes and factors; a rank reads them as scales and zeros)
                assert all(torch.equal(a, b) for a, b in zip(int4_zero_form(got), _cut_groups(int4_zero_form(int4[key]), s),
                                                             strict=True)), key
        vocab = slice(rank * plan.vocab_rows, (rank + 1) * plan.vocab_rows)  # the last one runs past the end
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        assert torch.equal(weights.get_slice(head)[vocab], whole[head][vocab])


@pytest.mark.parametrize("name", ["llama-Q8_0", "llama-Q4_K"])
def test_a_rank_reads_only_its_own_blocks(files, name):
    """Poison (NaN scales / values) every byte of the map outside a rank's part: its part still
    reads the same. Column ranges on block boundaries read only their blocks of each row."""
    path = files(name)
    ref = read_gguf(path)
    cfg = ModelConfig.from_hf(hf_config(ref))
    block, block_bytes = gguf.GGML_QUANT_SIZES[ref.tensors["blk.0.attn_q.weight"].tensor_type]
    cases = [("blk.0.attn_q.weight", cfg.num_attention_heads, (cfg.head_dim, 3 * cfg.head_dim), None),
             ("blk.0.attn_k.weight", cfg.num_key_value_heads, (cfg.head_dim, 2 * cfg.head_dim), None),
             ("blk.1.ffn_up.weight", None, (16, 48), None),
             ("output.weight", None, (100, 201), None),
             ("blk.0.ffn_down.weight", None, None, (block, 2 * block)),
             ("blk.1.ffn_down.weight", None, (8, 24), (0, block))]
    for gname, n_head, rows, cols in cases:
        want = read_part(ref.tensors[gname], n_head, rows, cols)
        t = read_gguf(path).tensors[gname]  # a copy-on-write map: poisoning it leaves the file alone
        keep = np.zeros(t.data.shape, dtype=bool)
        r = slice(*rows) if rows else slice(None)
        c = slice(cols[0] // block * block_bytes, cols[1] // block * block_bytes) if cols else slice(None)
        keep[r, c] = True
        t.data[~keep] = 0xFF  # f16 0xFFFF: NaN
        got = read_part(t, n_head, rows, cols)
        assert torch.isfinite(got).all() and torch.equal(got, want), gname
        assert not torch.isfinite(read_part(t, n_head)).all()  # the poison shows when everything is read


def test_int4_groups_cut_inside_a_group_is_a_clear_error(files):
    t = read_gguf(files("qwen2-Q4_0")).tensors["blk.0.attn_output.weight"]
    assert read_part(t, None, None, (32, 64), int4=True) is not None
    with pytest.raises(QuickdraftError, match="32-value int4 groups"):
        read_part(t, None, None, (16, 48), int4=True)


# --- 2 gloo ranks -------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "lm_head"), [("llama-F32", "vocab"), ("llama-Q8_0", "rank0"),
                                               ("llama-Q4_K", "vocab"), ("qwen3-Q6_K-tied", "vocab")])
def test_two_ranks_give_the_single_process_gguf_logits(files, name, lm_head):
    path = files(name)
    ref = load_model(path, dtype="float32")
    tp = load_tensor_parallel(checkpoint_dir(path), 2, dtype="float32", lm_head=lm_head, timeout_s=60)
    try:
        assert_same_logits_through_cache(tp, ref, ref.config.vocab_size)
    finally:
        tp.close()


def test_llm_greedy_output_with_a_gguf_target_equals_plain_single_process_decoding(files):
    path = files("llama-Q8_0")
    prompts = [[5, 9, 14, 3, 5, 9], [7, 7, 21]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 13)]
    plain = LLM(target=path, method="none", dtype="float32", compile=False)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llms = [LLM(target=path, method=m, dtype="float32", compile=False, tensor_parallel_size=2,
                tensor_parallel_options={"timeout_s": 60}, policy="fixed") for m in ("none", "ngram")]
    try:
        for llm in llms:  # one group, shared
            assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        for llm in llms:
            llm.close()


@pytest.mark.parametrize(("name", "lm_head"), [("qwen2-Q4_0", "vocab"), ("llama-Q4_K", "rank0")])
def test_int4_keeps_each_ranks_own_4bit_blocks(files, name, lm_head):
    """quantization="int4": every rank's linears hold their slices of the file's 4-bit blocks
    (not re-quantised), and the logits are the single-process int4 model's up to the order
    of the partial sums."""
    from quickdraft.model.formats import FastLinear
    from quickdraft.model.quant import prepare

    path = files(name)
    ref = prepare(load_model(path, dtype="float32", quantization="int4"), "int4")
    tp = load_tensor_parallel(checkpoint_dir(path), 2, dtype="float32", quantization="int4", lm_head=lm_head,
                              timeout_s=60)
    try:
        linears = [m for m in tp.shard.modules() if isinstance(m, FastLinear)]
        assert len(linears) == 4 * ref.config.num_hidden_layers + 1
        assert all("from GGUF blocks" in repr(m) for m in linears), [repr(m) for m in linears]
        # rank 0's int4 weights are the slices of the single process's, exactly
        F, HD = ref.config.intermediate_size // 2, ref.config.num_attention_heads // 2 * ref.config.head_dim
        KV = ref.config.num_key_value_heads * ref.config.head_dim  # 2 KV heads here: one per rank
        for mine, whole in zip(tp.shard.model.layers, ref.model.layers):
            q, k, v = whole.self_attn.qkv_proj.dequantized(torch.float32).split([2 * HD, KV, KV])
            assert torch.equal(mine.self_attn.qkv_proj.dequantized(torch.float32),
                               torch.cat([q[:HD], k[:KV // 2], v[:KV // 2]]))
            w = whole.mlp.gate_up_proj.dequantized(torch.float32)
            assert torch.equal(mine.mlp.gate_up_proj.dequantized(torch.float32), torch.cat([w[:F], w[2 * F:3 * F]]))
            assert torch.equal(mine.mlp.down_proj.linear.dequantized(torch.float32),
                               whole.mlp.down_proj.dequantized(torch.float32)[:, :F])
            assert torch.equal(mine.self_attn.o_proj.linear.dequantized(torch.float32),
                               whole.self_attn.o_proj.dequantized(torch.float32)[:, :HD])
        ids = torch.randint(0, ref.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():  # the CPU int4 kernel rounds activations to bfloat16: 2^-8 relative
            want = ref(ids)
            torch.testing.assert_close(tp(ids), want, atol=2 ** -5 * float(want.abs().max()), rtol=0)
    finally:
        tp.close()


def test_a_folder_without_weights_is_refused_before_starting_processes(tmp_path):
    with pytest.raises(QuickdraftError, match="safetensors checkpoint folders or GGUF files"):
        load_tensor_parallel(tmp_path, 2)
