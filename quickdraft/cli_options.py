"""Command-line options shared by `quickdraft generate` and `quickdraft serve` (how the
models are loaded and run), defined once so their flags and help read the same."""

from __future__ import annotations

import typer

COMPILE = typer.Option(None, "--compile/--no-compile", help="torch.compile the steps (default: on for CUDA/ROCm only).")
QUANTIZATION = typer.Option(None, "--quantization", help="Target weights: int8 (weight-only).")
DRAFT_QUANTIZATION = typer.Option(None, "--draft-quantization", help="Draft weights: int8 (weight-only).")
DRAFT_DTYPE = typer.Option(None, "--draft-dtype", help="The draft's precision, when it should differ from --dtype "
                           "(changes speed only, not the output).")
