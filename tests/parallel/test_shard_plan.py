"""The Megatron split itself: shards that put back together give the whole weight, GQA heads
split or replicated, bad sizes refused; and a real 2-rank gloo group over checkpoints of
every supported shape gives the single process's logits (float32, within 1e-5)."""

from __future__ import annotations

import pytest
import torch

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.parallel import ShardPlan, check_tensor_parallel

from conftest import assert_same_logits_through_cache


def _cfg(H=8, KV=2, F=64, D=4, V=50) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=V, hidden_size=H * D, intermediate_size=F, num_hidden_layers=1,
                       num_attention_heads=H, num_key_value_heads=KV, head_dim=D)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_shards_cover_each_weight_once_and_q_heads_read_their_kv_head(world):
    cfg = _cfg()
    D, H, KV = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_rows, f_rows = [], []
    for r in range(world):
        p = ShardPlan(cfg, r, world)
        q = p.slice_for("model.layers.0.self_attn.q_proj.weight")
        k = p.slice_for("model.layers.0.self_attn.k_proj.weight")
        q_rows += range(q.start, q.stop)
        f_rows += range(*(lambda s: (s.start, s.stop))(p.slice_for("model.layers.0.mlp.up_proj.weight")))
        o = p.slice_for("model.layers.0.self_attn.o_proj.weight")
        assert o.dim == 1 and (o.start, o.stop) == (q.start, q.stop)
        # every local q head's KV head (h // (H / KV)) is among this rank's KV heads, in the same order
        heads = range(q.start // D, q.stop // D)
        kv_heads = range(k.start // D, k.stop // D)
        local = p.local_config()
        group = local.num_attention_heads // local.num_key_value_heads
        for i, h in enumerate(heads):
            assert h // (H // KV) == kv_heads[i // group]
        bias = p.slice_for("model.layers.0.mlp.down_proj.bias")
        assert (bias is None) == (r == 0) and (bias is None or bias.zero)
        assert p.slice_for("model.embed_tokens.weight") is None  # replicated
    assert q_rows == list(range(H * D)) and f_rows == list(range(cfg.intermediate_size))


@pytest.mark.parametrize(("shape", "world", "message"), [
    (dict(H=8, KV=2), 3, "attention heads"),
    (dict(H=12, KV=4, F=66), 6, "key/value heads"),
    (dict(H=8, KV=8, F=66), 4, "intermediate_size"),
])
def test_sizes_that_do_not_split_are_refused(shape, world, message):
    with pytest.raises(QuickdraftError, match=message):
        check_tensor_parallel(_cfg(**shape), world)


def test_llm_refuses_a_bad_size_before_starting_processes():
    from quickdraft import LLM

    with pytest.raises(QuickdraftError, match="attention heads"):
        LLM(tensor_parallel_size=3, method="none")
    with pytest.raises(QuickdraftError, match="tensor_parallel_size must be >= 1"):
        LLM(tensor_parallel_size=0, method="none")
    with pytest.raises(QuickdraftError, match="lm_head"):
        LLM(tensor_parallel_size=2, method="none", tensor_parallel_options={"lm_head": "columns"})


SHAPES = {
    # 1 KV head on 2 ranks (replicated), biases on every projection, an untied head, an odd vocabulary
    "llama-kv1-bias-untied": (dict(kind="llama", num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=False, vocab=385), "vocab"),
    "qwen2-sharded-files": (dict(kind="qwen2", tie_word_embeddings=True, max_shard_size="40KB"), "rank0"),
    "qwen3-qk-norm": (dict(kind="qwen3", tie_word_embeddings=False), "vocab"),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_two_ranks_give_the_single_process_logits(ckpt_factory, name):
    from quickdraft.cache import KVCache
    from quickdraft.model.loader import load_model
    from quickdraft.parallel import load_tensor_parallel

    overrides, lm_head = SHAPES[name]
    path = ckpt_factory(f"tp-{name}", seed=3, **overrides)
    ref = load_model(path)
    tp = load_tensor_parallel(path, 2, lm_head=lm_head, timeout_s=60)
    try:
        assert_same_logits_through_cache(tp, ref, ref.config.vocab_size)
        with torch.inference_mode():  # this rank's KV heads only
            assert KVCache.for_model(tp, 2, 16).k[0].shape[1] == max(1, ref.config.num_key_value_heads // 2)
    finally:
        tp.close()
