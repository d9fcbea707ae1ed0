"""Write a trained model as a Hugging Face checkpoint folder.

config.json, model.safetensors and generation_config.json, as transformers'
`save_pretrained` would write them for a LlamaForCausalLM: with tied embeddings only
`model.embed_tokens.weight` is stored (no `lm_head.weight`), and the file carries the
`{"format": "pt"}` metadata transformers checks for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from ..errors import QuickdraftError
from ..model.transformer import Transformer

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_config(size_config: dict[str, Any], vocab_size: int, bos_id: int, eos_id: int, pad_id: int | None,
              save_dtype: str) -> dict[str, Any]:
    """The full config.json body for a named size and a tokenizer."""
    cfg = dict(size_config)
    cfg.update(vocab_size=vocab_size, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
               torch_dtype=save_dtype, dtype=save_dtype)  # transformers 4.x reads torch_dtype, 5.x dtype
    # transformers 5 spells the rotary settings rope_parameters; 4.x reads rope_theta.
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    return dict(sorted(cfg.items()))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def save_hf_folder(model: Transformer, config: dict[str, Any], out_dir: Path, save_dtype: str) -> None:
    if save_dtype not in SAVE_DTYPES:
        raise QuickdraftError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}, got {save_dtype!r}")
    dtype = SAVE_DTYPES[save_dtype]
    state = {}
    for name, tensor in model.state_dict().items():
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue  # the embedding is the head
        state[name] = tensor.detach().to("cpu", dtype).contiguous()
    tmp = out_dir / "model.safetensors.tmp"
    tmp.write_bytes(save(state, metadata={"format": "pt"}))  # save_file would make it owner-only (0600)
    os.replace(tmp, out_dir / "model.safetensors")
    _write_json(out_dir / "config.json", config)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if config.get("pad_token_id") is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    _write_json(out_dir / "generation_config.json", generation)
