"""The parts of an eagle3 step on this CPU (issue 14's cost bar): one thread, float32, AOT steps,
(with --draft-quantization the head's weights int8 / int4, the target float32),
at a 400-token context, medians of 15 calls (ms): the target's plain step at 1 and 2 query
tokens, its step at 2 tokens that also returns the head's hidden states (what an eagle3 verify
with k = 1 runs), the head's catch-up over 2 pairs and one draft step, through the head's AOT
packages (what the engine runs: quickdraft.aot.HeadAOTStep) and eagerly.

    python benchmarks/eagle3_parts.py --model smollm2 --head DIR --out benchmarks/results/eagle3_parts_smollm2.json
    python benchmarks/eagle3_parts.py --model bundled --tiny --out /tmp/x.json   # a smoke test (eager, 3 calls)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from quickdraft import LLM, aot
from quickdraft.bench.hardware import loadavg, median_seconds as timed, provenance
from quickdraft.cache import KVCache
from quickdraft.llm import default_model_dirs
from quickdraft.model.quant import weight_bytes


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["bundled", "smollm2"], default="bundled")
    ap.add_argument("--head", default=None, help="a head folder (SmolLM2 ships none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-quantization", choices=["none", "int8", "int4"], default="none",
                    help="the head's weights (the target stays float32)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="eager steps (no AOT build), a 32-token context, "
                    "medians of 3 calls (a smoke test)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    ctx, calls = (32, 3) if args.tiny else (400, 15)
    target = "smollm2" if args.model == "smollm2" else default_model_dirs()[0]
    if args.model == "smollm2" and args.head is None:  # only the bundled target's head ships
        raise SystemExit("--model smollm2 needs --head DIR: a head trained with `quickdraft train-eagle3` "
                         "(docs/eagle3-and-training.md has the command for SmolLM2's)")
    head_name = args.head or "target-eagle3"
    llm = LLM(target, method="eagle3", draft=head_name, num_speculative_tokens=1,
              compile=False if args.tiny else "aot", dtype="float32",
              draft_quantization=args.draft_quantization, policy="fixed")  # "none": the head as stored
    tgt, step_h, head = llm.target, llm.engine._forward, llm.draft
    head_step = llm.engine.proposer._head  # the head's AOT packages (quickdraft.aot.HeadAOTStep) where built
    step_p = tgt if args.tiny else aot.load_or_build(tgt)  # the plain package (built once when missing)
    hidden_at = llm.engine._hidden_layers  # the target layers the head reads
    cache = KVCache.for_model(tgt, 1, 600)
    ids = torch.randint(0, min(1000, tgt.config.vocab_size), (1, ctx), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.inference_mode():
        tgt(ids, torch.arange(ctx)[None], cache.rows(0, 1), kv_len=ctx)
        view = cache.rows(0, 1)

        def med(fn):
            return round(timed(fn, calls) * 1e3, 2)

        out["target_T1_ms"] = med(lambda: step_p(ids[:, :1], torch.tensor([[ctx]]), view, kv_len=ctx + 1))
        out["target_T2_ms"] = med(lambda: step_p(ids[:, :2], torch.tensor([[ctx, ctx + 1]]), view, kv_len=ctx + 2))
        out["target_T2_with_hidden_ms"] = med(lambda: step_h.forward_hidden(ids[:, :2], torch.tensor([[ctx, ctx + 1]]), view,
                                                                            kv_len=ctx + 2, hidden_at=hidden_at))
        hc = KVCache(1, 1, head.config.num_key_value_heads, 600, head.config.head_dim, torch.float32, "cpu")
        width = 3 * tgt.config.hidden_size
        feats = torch.randn(1, 2, width)
        own = torch.randn(1, 1, tgt.config.hidden_size)
        for tag, fn in (("", head_step), ("_eager", head)):
            out[f"head_catch_up_2_pairs{tag}_ms"] = med(lambda: fn(ids[:, :2], feats, torch.tensor([[ctx - 2, ctx - 1]]),
                                                                   hc.rows(0, 1), kv_len=ctx))
            out[f"head_draft_step{tag}_ms"] = med(lambda: fn(ids[:, :1], own, torch.tensor([[ctx]]), hc.rows(0, 1),
                                                             kv_len=ctx + 1, project=False))
    out["head_step"] = type(head_step).__name__
    out["head_draft_step_over_target_step"] = round(out["head_draft_step_ms"] / out["target_T1_ms"], 3)
    out["head_draft_step_eager_over_target_step"] = round(out["head_draft_step_eager_ms"] / out["target_T1_ms"], 3)
    out.update(model=args.model, head_quantization=args.draft_quantization, threads=args.threads, context=ctx, calls=calls,
               head_weight_bytes=weight_bytes(head), target_weight_bytes=weight_bytes(tgt), torch=torch.__version__,
               provenance=provenance("cpu", args.threads, load_before=load_before))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
