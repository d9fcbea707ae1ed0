"""Named model sizes for `quickdraft train --size NAME`: Hugging Face Llama configs.

Every entry is a complete `config.json` body minus the token ids and dtype, which the
trainer fills in from the tokenizer and `--save-dtype`. The parameter counts in the
comments are exact (tied embeddings counted once); `tests/test_train.py` checks them
against a built model.
"""

from __future__ import annotations

from typing import Any


def _llama(**fields: Any) -> dict[str, Any]:
    base = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "initializer_range": 0.02,  # std of the normal init; residual outputs get it / sqrt(2 * layers)
        "tie_word_embeddings": True,  # saves vocab * hidden parameters, which dominate small models
        "use_cache": True,
    }
    base.update(fields)
    base["head_dim"] = base["hidden_size"] // base["num_attention_heads"]
    return base


SIZES: dict[str, dict[str, Any]] = {
    # 106,816 parameters: for tests, a few steps take a fraction of a second on a CPU.
    "tiny": _llama(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    # 2,360,256 parameters (1,572,864 of them the embedding): a draft for target-s.
    "draft-xs": _llama(vocab_size=8192, hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=1024),
    # 27,795,968 parameters (4,194,304 of them the embedding): the bundled target.
    "target-s": _llama(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024),
    # 14,944,512 parameters (12,582,912 of them the embedding): the draft for SmolLM2-135M-Instruct
    # (`smollm2`, 134,515,008 parameters: 11.1%, under 1/8; under 30 MB in bf16); its vocabulary,
    # under half its width and 4 of its 30 layers' depth, so a draft step costs a small part of a target step.
    "draft-smollm2": _llama(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                            rope_theta=100000.0),
}

# Peak learning rates (AdamW, batch of a few thousand tokens); smaller models take larger steps.
LEARNING_RATES: dict[str, float] = {"tiny": 3e-3, "draft-xs": 2e-3, "target-s": 1e-3, "draft-smollm2": 2e-3}


def count_params(cfg: dict[str, Any]) -> int:
    """Exact parameter count of a bias-free Llama config (tied embeddings counted once)."""
    d, f, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * hd
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d  # attention, MLP, two RMSNorms
    embeddings = vocab * d * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + d  # + final norm
