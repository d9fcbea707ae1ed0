"""The bundled models as shipped (int8 weights, group-wise float16 scales, compressed-tensors
layout) against the bfloat16 folders they were made from: held-out loss of target and draft,
acceptance of the draft (greedy k = 5 on held-out function openings, as the draft's card measures
it) and of the EAGLE-3 head (greedy k = 5, as the head's card), and the speculative speedup over
plain decoding of both (batch 1, 128 new tokens, draft k = 5), paired repeats at one thread.

usage: python benchmarks/bundled_int8.py --original DIR [--out-dir benchmarks/results] [--name bundled_int8_cpu]
  DIR holds the bfloat16 folders target/, draft/ and target-eagle3/ (e.g. from git history:
  `git show 1e65a00:quickdraft/default_models/target/model.safetensors > DIR/target/model.safetensors`, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quickdraft import LLM, SamplingParams, load_model  # noqa: E402
from quickdraft.bench.hardware import provenance  # noqa: E402
from quickdraft.model.eagle3 import load_eagle3  # noqa: E402
from quickdraft.model.tokenizer import Tokenizer, eos_token_ids  # noqa: E402
from quickdraft.train.corpus import load_corpus  # noqa: E402
from quickdraft.train.data import eval_windows, tokenize  # noqa: E402
from quickdraft.train.distill import measure_acceptance  # noqa: E402
from quickdraft.train.eagle3 import measure_head  # noqa: E402
from quickdraft.train.pretrain import evaluate  # noqa: E402
from quickdraft.train.prompts import opening_prompts  # noqa: E402

SHIPPED = ROOT / "quickdraft" / "default_models"


def heldout_windows(tok: Tokenizer, corpus, n: int = 64, seq_len: int = 256) -> torch.Tensor:
    """The pretraining run's held-out evaluation: n windows of seq_len tokens over the held-out files."""
    stream = tokenize(tok._tok, [text for _, text in corpus.heldout], tok.bos_token_id, eos_token_ids(SHIPPED / "target", tok)[0])
    return eval_windows(stream, seq_len, n)


def speed(folder: Path, prompts: list[list[int]], method: str, repeats: int, tokens: int) -> list[float]:
    llm = LLM(folder / "target", draft=folder / "draft" if method == "draft" else None, method=method,
              num_speculative_tokens=5, compile=False, policy="fixed")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up
    out = []
    for _ in range(repeats):  # batch 1: one prompt after another
        t = time.perf_counter()
        n = sum(len(llm.generate([p], params)[0].token_ids) for p in prompts)
        out.append(n / (time.perf_counter() - t))
    return out


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser()
    ap.add_argument("--original", type=Path, required=True)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="bundled_int8_cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--head-prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speed-prompts", type=int, default=4, help="prompts timed at batch 1, 128 new tokens each")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="a smoke test: 2 windows, 8 new tokens, 1 prompt")
    args = ap.parse_args()
    new_tokens, speed_tokens, n_windows = (8, 8, 2) if args.tiny else (64, 128, 64)
    if args.tiny:
        args.prompts = args.head_prompts = args.speed_prompts = 1
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    tok = Tokenizer.from_dir(SHIPPED / "target")
    corpus = load_corpus()
    prompts = [tok.encode(p) for p in opening_prompts(corpus.heldout, args.prompts)]
    windows = heldout_windows(tok, corpus, n_windows)
    result: dict = {"rows": {}}
    for label, folder in (("bfloat16 (original)", args.original), ("int8 (shipped)", SHIPPED)):
        target, draft = load_model(folder / "target"), load_model(folder / "draft")
        head = load_eagle3(folder / "target-eagle3", target, dtype=torch.float32)
        row = {
            "target_heldout_loss": round(evaluate(target, windows, 16, torch.device("cpu"), False), 4),
            "draft_heldout_loss": round(evaluate(draft, windows, 16, torch.device("cpu"), False), 4),
            "draft_acceptance": measure_acceptance(target, draft, prompts, k=5, max_tokens=new_tokens),
            "head_acceptance": measure_head(target, head, prompts[:args.head_prompts], k=5, max_tokens=new_tokens),
        }
        result["rows"][label] = row
        print(label, json.dumps(row), flush=True)
    # speed: the two pairs side by side, plain and draft k = 5, order alternating per repeat
    timing: dict[str, list[float]] = {}
    for r in range(args.repeats):
        order = [("bfloat16 (original)", args.original), ("int8 (shipped)", SHIPPED)]
        for label, folder in (order if r % 2 == 0 else order[::-1]):
            for method in ("none", "draft"):
                timing.setdefault(f"{label} {method}", []).extend(speed(folder, prompts[:args.speed_prompts], method, 1, speed_tokens))
    result["tokens_per_second"] = {k: round(statistics.median(v), 1) for k, v in timing.items()}
    result["speedup_draft_vs_plain"] = {
        label: round(statistics.median([d / p for d, p in zip(timing[f"{label} draft"], timing[f"{label} none"])]), 3)
        for label in ("bfloat16 (original)", "int8 (shipped)")}
    result["provenance"] = provenance("cpu", args.threads, sys.argv, load_before)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=2))


if __name__ == "__main__":
    main()
