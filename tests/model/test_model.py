"""Model loading and logits parity with transformers (the reference implementation)."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft import QuickdraftError, UnsupportedModelError, load_model
from quickdraft.cache import KVCache
from quickdraft.config import ModelConfig

from conftest import make_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}

CASES = {
    "llama": dict(kind="llama"),
    "llama3-rope-bias": dict(kind="llama", rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True),
    "qwen2": dict(kind="qwen2"),
    "qwen3": dict(kind="qwen3"),
    "mistral-window": dict(kind="mistral", sliding_window=8),
    "tied": dict(kind="llama", tie_word_embeddings=True),
    "mha-head-dim": dict(kind="llama", num_key_value_heads=4, head_dim=32),
    "sharded": dict(kind="qwen2", max_shard_size="100KB"),
}


def hf_logits(folder, ids):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(ids).logits


@pytest.mark.parametrize("name", list(CASES))
def test_logits_parity_with_transformers(tmp_path, name):
    folder = make_checkpoint(tmp_path / name, tokenizer=False, **CASES[name])
    if name == "sharded":
        assert (folder / "model.safetensors.index.json").exists()
        assert len(list(folder.glob("model-*.safetensors"))) > 1
    if name == "tied":
        from safetensors import safe_open
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()
    torch.manual_seed(0)
    ids = torch.randint(0, 384, (2, 40))  # longer than the Mistral window (8)
    ours = load_model(folder, dtype="float32")(ids)
    ref = hf_logits(folder, ids)
    assert ours.shape == (2, 40, 384)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_parity_is_sensitive(tmp_path):
    """The parity check can fail: a perturbed weight shows up in the logits."""
    folder = make_checkpoint(tmp_path / "m", tokenizer=False, kind="qwen3")
    model = load_model(folder)
    model.model.layers[0].self_attn.q_norm.weight.data += 0.05
    ids = torch.randint(0, 384, (1, 16))
    assert (model(ids) - hf_logits(folder, ids)).abs().max().item() > 1e-4


def test_long_context_llama3_rope(tmp_path):
    # positions beyond original_max_position_embeddings exercise every band of llama3 scaling
    folder = make_checkpoint(tmp_path / "m", tokenizer=False, rope_parameters=LLAMA3_ROPE)
    ids = torch.randint(0, 384, (1, 300))
    assert (load_model(folder)(ids) - hf_logits(folder, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_cache_forward_matches_full_forward(tmp_path, kind):
    """Incremental decoding through the KV cache, ragged across rows, equals one full forward."""
    folder = make_checkpoint(tmp_path / kind, tokenizer=False, kind=kind,
                             **({"sliding_window": 6} if kind == "mistral" else {}))
    model = load_model(folder)
    ids = torch.randint(0, 384, (2, 24))
    full = model(ids)
    cache = KVCache.for_model(model, 2, 32)
    view = cache.rows(0, 2)
    # row 0 fed in chunks of 5, row 1 in chunks of 3 (padding with position -1)
    got = [[], []]
    pos = [0, 0]
    while min(pos) < 24:
        chunk = [min(5, 24 - pos[0]), min(3, 24 - pos[1])]
        T = max(chunk)
        x = torch.zeros(2, T, dtype=torch.long)
        p = torch.full((2, T), -1)
        for b in range(2):
            x[b, :chunk[b]] = ids[b, pos[b]:pos[b] + chunk[b]]
            p[b, :chunk[b]] = torch.arange(pos[b], pos[b] + chunk[b])
        out = model(x, p, view)
        for b in range(2):
            got[b].append(out[b, :chunk[b]])
            pos[b] += chunk[b]
    for b in range(2):
        assert (torch.cat(got[b]) - full[b]).abs().max().item() <= 1e-4


def test_bfloat16_and_float16_load(tmp_path):
    folder = make_checkpoint(tmp_path / "m", tokenizer=False)
    ids = torch.randint(0, 384, (1, 8))
    ref = load_model(folder)(ids)
    for dtype in ("bfloat16", "float16", torch.bfloat16):
        model = load_model(folder, dtype=dtype)
        assert model.dtype in (torch.bfloat16, torch.float16)
        out = model(ids).float()
        assert torch.isfinite(out).all()
        assert (out - ref).abs().max().item() < 0.1


def write_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, needle", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "yarn"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_unsupported_config_is_a_clear_error(tmp_path, changes, needle):
    folder = make_checkpoint(tmp_path / "m", tokenizer=False)
    write_config(folder, **changes)
    with pytest.raises(QuickdraftError, match=needle):
        load_model(folder)


def test_qwen_per_layer_sliding_window_rejected():
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_hf({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "use_sliding_window": True})


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(QuickdraftError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(QuickdraftError, match="config.json"):
        load_model(tmp_path / "empty")
    folder = make_checkpoint(tmp_path / "m", tokenizer=False)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(QuickdraftError, match="cannot read"):
        load_model(folder)
    folder = make_checkpoint(tmp_path / "w", tokenizer=False)
    (folder / "model.safetensors").unlink()
    with pytest.raises(QuickdraftError, match="model.safetensors"):
        load_model(folder)


def test_shape_mismatch_and_extra_tensor_are_errors(tmp_path):
    folder = make_checkpoint(tmp_path / "m", tokenizer=False)
    write_config(folder, intermediate_size=96)
    with pytest.raises(QuickdraftError, match="shape"):
        load_model(folder)
    folder = make_checkpoint(tmp_path / "b", tokenizer=False, attention_bias=True)
    write_config(folder, attention_bias=False)
    with pytest.raises(QuickdraftError, match="unexpected tensors"):
        load_model(folder)
