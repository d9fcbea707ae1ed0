"""The bundled default pair: present, within its size limits, loadable by quickdraft and
transformers, used by LLM() and the CLI with no model arguments, and lossless; and the tracked
tree small enough for the GPU machine (which receives the working tree only up to 64 MiB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quickdraft import LLM, SamplingParams, load_model
from quickdraft.llm import default_model_dirs

TARGET, DRAFT = default_model_dirs()


def n_params(folder) -> int:
    return sum(p.numel() for p in load_model(folder).parameters())


def test_pair_is_bundled_within_limits():
    for folder in (TARGET, DRAFT):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "README.md"):
            assert (folder / name).exists(), folder / name
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] in ("bfloat16", "float16")
        assert "Reproduce" in (folder / "README.md").read_text()
        assert json.loads((folder / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    size = sum((f / "model.safetensors").stat().st_size for f in (TARGET, DRAFT))
    assert size <= 40 * 2**20
    t, d = n_params(TARGET), n_params(DRAFT)
    assert 15e6 <= t <= 40e6 and d <= t / 10
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()


def test_tracked_tree_fits_the_gpu_machine():
    """The tracked files stay under 48 MiB (the GPU machine takes the tree up to 64 MiB, shared/
    and untracked files included): weights that are not shipped never enter git."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    total = sum((root / f.decode()).stat().st_size for f in files if f and (root / f.decode()).is_file())
    assert total <= 48 * 2**20, f"the tracked tree is {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("folder", [TARGET, DRAFT], ids=["target", "draft"])
def test_transformers_loads_the_same_model(folder):
    """transformers reads the bundled int8 (compressed-tensors) folders too, dequantising them."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from quickdraft.model.compressed import transformers_kwargs

    ids = torch.tensor([[0, 100, 200, 300, 400]])
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **transformers_kwargs(folder)).eval()
    with torch.no_grad():
        # transformers multiplies int8 by the float16 scales in float16; quickdraft in float32
        assert (load_model(folder)(ids) - ref(ids).logits).abs().max().item() <= 1e-2


def test_default_llm_is_the_bundled_pair_and_lossless():
    llm = LLM()
    assert llm.draft is not None and llm.engine.k == 5
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
    spec = llm.generate(prompts, params)
    plain = LLM(method="none").generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.stats.acceptance_rate > 0.3  # a distilled draft, not a random one


@pytest.mark.slow
def test_cli_uses_the_default_pair():
    r = subprocess.run([sys.executable, "-m", "quickdraft.cli", "generate", "--max-tokens", "16", "--json",
                        "def add(a, b):"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["num_draft_tokens"] > 0 and len(out["token_ids"]) <= 16
