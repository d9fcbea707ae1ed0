"""llguidance vs xgrammar (issue 32, item 2): vocabulary setup, schema compile + first mask, and the
per-token mask while stepping through a valid instance, on SmolLM2's 49k vocabulary and Llama 3's
128k one (rebuilt from llama.cpp's ggml-vocab-llama-bpe.gguf by quickdraft's GGUF tokenizer reader:
no 128k tokenizer.json is on this machine). One thread.

llguidance is measured through quickdraft's own path (constraints.GrammarVocabulary, Constraint,
Matcher); xgrammar through its Python API (TokenizerInfo, GrammarCompiler.compile_json_schema,
GrammarMatcher.fill_next_token_bitmask / accept_token). Each library is optional: xgrammar is not a
quickdraft dependency, so run this in a throwaway environment that has it:

    python -m venv --system-site-packages /tmp/xg && /tmp/xg/bin/pip install xgrammar
    PYTHONPATH=$PWD /tmp/xg/bin/python benchmarks/grammar_engines.py --out benchmarks/results/grammar_engines_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import hf_folder  # noqa: E402 - the float32 SmolLM2 folder (its tokenizer)

from quickdraft.bench.hardware import loadavg, provenance, provenance_line  # noqa: E402
from quickdraft.constraints import Constraint, GrammarVocabulary
from quickdraft.model.gguf import read_gguf
from quickdraft.model.gguf_tokenizer import build_tokenizer
from quickdraft.model.sources import resolve_model
from quickdraft.model.tokenizer import Tokenizer, eos_token_ids

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string", "pattern": "^[a-z.]{1,40}@[a-z]{1,20}\\.com$"},
    "role": {"enum": ["admin", "editor", "viewer"]},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "role", "address", "tags", "active"], "additionalProperties": False}
INSTANCE = {"name": "Maria Lopez", "age": 34, "email": "maria.lopez@example.com", "role": "editor",
            "address": {"city": "Lisbon", "zip": "10115"}, "tags": ["sales", "remote"], "active": True}
LLAMA3_VOCAB = "llama.cpp-0.3.36/source/models/ggml-vocab-llama-bpe.gguf"


def vocabularies() -> dict[str, Path]:
    """name -> a folder with tokenizer.json (+ config)."""
    from quickdraft.paths import cache_dir

    out = {"smollm2-49k": hf_folder(resolve_model("smollm2"))}
    gguf = cache_dir() / "peers" / LLAMA3_VOCAB
    if gguf.exists():
        folder = Path(tempfile.mkdtemp(prefix="llama3-vocab-"))
        tok = build_tokenizer(read_gguf(gguf).metadata)
        (folder / "tokenizer.json").write_text(tok.tokenizer_json)
        (folder / "tokenizer_config.json").write_text(json.dumps(tok.config))
        out["llama3-128k"] = folder
    return out


def steps(times: list[float]) -> dict:
    ms = sorted(t * 1e3 for t in times)
    return {"median_ms": round(statistics.median(ms), 4), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 4),
            "mean_ms": round(statistics.fmean(ms), 4), "tokens": len(ms)}


def bench_llguidance(folder: Path, ids: list[int], repeats: int) -> dict:
    import llguidance

    tok = Tokenizer(folder)
    eos = eos_token_ids(folder, tok) or (tok.eos_token_id,)
    t = time.perf_counter()
    vocab = GrammarVocabulary(tok, tok.vocab_size, eos)
    setup = time.perf_counter() - t
    compiles, masks = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        c = Constraint("json_schema", json.dumps(SCHEMA))  # the notation's check, then the compile for the vocabulary
        c.compiled(vocab)
        compiles.append(time.perf_counter() - t)
        m = vocab.matcher(c)
        out = torch.empty(vocab.words, dtype=torch.int32)
        for i in ids:
            t = time.perf_counter()
            m._fill(out)
            masks.append(time.perf_counter() - t)
            assert m.commit(i), "the instance's token is forbidden"
    return {"version": llguidance.__version__ if hasattr(llguidance, "__version__") else _version("llguidance"),
            "vocab_setup_s": round(setup, 3), "compile_first_mask_ms": round(statistics.median(compiles) * 1e3, 3),
            "mask": steps(masks)}


def bench_xgrammar(folder: Path, ids: list[int], repeats: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    setup = time.perf_counter() - t
    compiles, masks = [], []
    for _ in range(repeats):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        t = time.perf_counter()
        g = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        m = xgr.GrammarMatcher(g)
        m.fill_next_token_bitmask(bitmask)
        compiles.append(time.perf_counter() - t)
        for i in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - t)
            assert m.accept_token(i), "the instance's token is forbidden"
    return {"version": _version("xgrammar"), "vocab_setup_s": round(setup, 3),
            "compile_first_mask_ms": round(statistics.median(compiles) * 1e3, 3), "mask": steps(masks)}


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocabularies", default="smollm2-49k,llama3-128k", help="comma-separated subset")
    ap.add_argument("--out", required=True, help="path stem: STEM.json and STEM.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = loadavg()
    text = json.dumps(INSTANCE, separators=(", ", ": "))
    report = {"command": " ".join(["python", *sys.argv]), "load_before": os.getloadavg(), "schema": SCHEMA,
              "instance": text, "vocabularies": {}}
    for name, folder in vocabularies().items():
        if name not in args.vocabularies.split(","):
            continue
        ids = Tokenizer(folder).encode(text, add_special_tokens=False)
        row = {"instance_tokens": len(ids)}
        for lib, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            try:
                row[lib] = fn(folder, ids, args.repeats)
            except ImportError as exc:
                row[lib] = {"skipped": str(exc)}
            print(name, lib, row[lib], flush=True)
        report["vocabularies"][name] = row
    report["load_after"] = os.getloadavg()
    report["provenance"] = provenance(threads=1, load_before=load_before)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# llguidance vs xgrammar", "", f"`{report['command']}`; load average {report['load_before'][0]:.1f} "
             f"before, {report['load_after'][0]:.1f} after; one thread. Schema: 7 properties (nested object, enum, "
             "patterns, array, boolean), stepped through a valid instance.", "",
             "| vocabulary | library | vocab setup s | compile + first mask ms | mask median ms | mask p90 ms |",
             "|---|---|---|---|---|---|"]
    for name, row in report["vocabularies"].items():
        for lib in ("llguidance", "xgrammar"):
            r = row[lib]
            if "skipped" in r:
                lines.append(f"| {name} | {lib} | skipped: {r['skipped']} | | | |")
            else:
                lines.append(f"| {name} ({row['instance_tokens']} tokens) | {lib} {r['version']} | {r['vocab_setup_s']} | "
                             f"{r['compile_first_mask_ms']} | {r['mask']['median_ms']} | {r['mask']['p90_ms']} |")
    lines += ["", provenance_line(report["provenance"])]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
