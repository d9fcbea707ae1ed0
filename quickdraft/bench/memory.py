"""Memory footprint of a target/draft pair: weights and KV caches, plain vs speculative.

Counted from the tensors themselves (parameters, buffers and the preallocated caches the
engine would build for `batch` requests of `context` tokens), which is what the engine
holds resident; on CUDA, `measure_peak` also reads the allocator's peak for a real run.
"""

from __future__ import annotations

import torch

from ..model.quant import weight_bytes


def cache_bytes(model, batch: int, context: int) -> int:
    """Bytes of a KVCache of `batch` slots x `context` positions (+ the trash column)."""
    cfg = model.config
    element = model.model.embed_tokens.weight.element_size()  # KVCache.for_model uses the embedding's dtype
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * (context + 1) * cfg.head_dim * element


def footprint(llm, batch: int = 1, context: int | None = None) -> dict:
    """Bytes of target / draft weights and caches; the draft's share over plain decoding."""
    engine = llm.engine
    context = context or engine.max_model_len
    room = engine._draft_room
    target_w = weight_bytes(llm.target)
    target_c = cache_bytes(llm.target, batch, context + room)
    plain = target_w + cache_bytes(llm.target, batch, context)
    out = {"batch": batch, "context": context, "target_weights": target_w, "target_cache": target_c,
           "plain_total": plain}
    if llm.draft is not None:
        draft_w = weight_bytes(llm.draft)
        draft_c = cache_bytes(llm.draft, batch, context + room)
        spec = target_w + target_c + draft_w + draft_c
        out.update(draft_weights=draft_w, draft_cache=draft_c, speculative_total=spec,
                   added_fraction=(spec - plain) / plain)
    else:
        spec = target_w + target_c
        out.update(speculative_total=spec, added_fraction=(spec - plain) / plain)
    return out


def measure_peak(llm, prompts, params) -> int | None:
    """Peak CUDA memory allocated while generating (None off CUDA)."""
    if llm.target.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()
