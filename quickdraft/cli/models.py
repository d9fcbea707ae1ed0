"""`quickdraft models`, `quickdraft pull NAME` and `quickdraft convert FILE.gguf --out DIR`:
the catalogue of named models, fetching one into the cache, and GGUF -> Hugging Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import common as opts
from .common import out, user_errors


@user_errors
def models_command() -> None:
    """List quickdraft's named models (usable as --target NAME) and whether each is cached."""
    from rich.table import Table

    from ..model.sources import cache_dir, catalogue

    table = Table(title=f"named models (cache: {cache_dir()})")
    for column in ("name", "description", "size", "license", "default draft", "KV per token", "cached"):
        table.add_column(column)
    for info in catalogue():
        e = info.entry
        table.add_row(e.name, e.description, f"{e.size / 1e6:.0f} MB", e.license, e.default_draft or "-",
                      _kv_per_token(info.path) if info.cached else "-",
                      str(info.path) if info.cached else "no (fetched on first use, or `quickdraft pull`)")
    out.print(table)
    out.print("KV per token: the KV cache one token of a request takes (2 x layers x kv_heads x head_dim x 4 bytes "
              "in float32; half in 16 bits: bfloat16, or float16, the default for int8 / int4 layers on a CPU), "
              "what --kv-cache-memory is spent on; a draft "
              "model's or EAGLE-3 head's own cache adds its share (docs/server.md, \"KV memory\").")


def _kv_per_token(path: Path) -> str:
    """A cached model's KV bytes per token, float32 / bfloat16 (its config read, no weights)."""
    from ..config import ModelConfig, format_bytes
    from ..model.gguf import hf_config, is_gguf_file, read_gguf

    try:
        cfg = ModelConfig.from_hf(hf_config(read_gguf(path))) if is_gguf_file(path) else \
            ModelConfig.from_file(Path(path) / "config.json")
    except Exception as exc:  # noqa: BLE001 - a listing never fails on one unreadable file
        return f"? ({type(exc).__name__})"
    return f"{format_bytes(cfg.kv_token_bytes(4))} / {format_bytes(cfg.kv_token_bytes(2))}"


@user_errors
def pull_command(name: str = typer.Argument(..., help="A named model (see `quickdraft models`).")) -> None:
    """Fetch a named model into the cache (checksum-verified; nothing is kept on failure)."""
    from ..model.sources import pull

    out.print(str(pull(name)))


@user_errors
def convert_command(
    gguf_file: Path = typer.Argument(..., help="The GGUF file to convert."),
    out_dir: Path = typer.Option(..., "--out", help="The Hugging Face folder to write (new or empty)."),
    dtype: Optional[str] = opts.SAVE_DTYPE,
) -> None:
    """Write a GGUF model as a Hugging Face folder (safetensors, config, tokenizer, chat template)
    that transformers and quickdraft load."""
    from ..model.gguf import convert_gguf

    out.print(f"wrote {convert_gguf(gguf_file, out_dir, dtype=dtype)}")
