"""Should the draft's q apply the request's penalties too? (issue 18)

Rejection sampling is exact whichever q the draft samples from, so the choice only moves the
acceptance rate. This measures it on the bundled pair: the target generates with the penalties
(greedy and sampled); at every generated position, with the same context, the target's
penalised distribution p is compared with the draft's distribution q computed both ways:
- q ignores the penalties (what quickdraft does), or
- q is penalised exactly as p (the same logit_bias / repetition / frequency / presence rule,
  on the draft's logits).
Reported: the probability that one draft token is accepted at that position, sum_x min(p, q)
(at temperature 0: whether argmax q == argmax p), averaged over positions and prompts.

    python benchmarks/penalty_acceptance.py --out benchmarks/results/penalty_acceptance_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.bench.hardware import cpu_model, provenance
from quickdraft.bench.workloads import code_completion
from quickdraft.llm import default_model_dirs
from quickdraft.sampling import BatchSampling, PenaltyState, process_logits
from quickdraft.train.corpus import load_corpus

SETTINGS = {
    "none": {},
    "repetition-1.1": {"repetition_penalty": 1.1},
    "repetition-1.3": {"repetition_penalty": 1.3},
    "frequency-0.5": {"frequency_penalty": 0.5},
    "presence-0.5": {"presence_penalty": 0.5},
    "freq-0.3+pres-0.3+rep-1.05": {"frequency_penalty": 0.3, "presence_penalty": 0.3, "repetition_penalty": 1.05},
}


def acceptance(target, draft, prompt: list[int], params: SamplingParams) -> tuple[list[float], list[float]]:
    """Per generated position: (acceptance with q unpenalised, with q penalised)."""
    out = target.generate([prompt], params)[0].token_ids
    seq = torch.tensor([prompt + out])
    with torch.no_grad():
        p_logits = target.target(seq)[0, len(prompt) - 1:-1]  # the distribution each output token came from
        q_logits = draft.target(seq)[0, len(prompt) - 1:-1]
    vocab = p_logits.shape[-1]
    pen = PenaltyState.build([params], [prompt], vocab, torch.device("cpu"))
    s = BatchSampling.build([params], torch.device("cpu"))
    raw_acc, pen_acc = [], []
    for t in range(len(out)):
        p_t, q_t = p_logits[t][None], q_logits[t][None]
        if pen is not None:
            p_t = pen.apply(p_t, [out[:t]])
            q_pen = pen.apply(q_t, [out[:t]])
        else:
            q_pen = q_t
        p = process_logits(p_t, s)[0]
        q_raw, q_p = process_logits(q_t, s)[0], process_logits(q_pen, s)[0]
        raw_acc.append(float(torch.minimum(p, q_raw).sum()))
        pen_acc.append(float(torch.minimum(p, q_p).sum()))
    return raw_acc, pen_acc


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/penalty_acceptance_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_dir, d_dir = default_model_dirs()
    target, draft = LLM(t_dir, method="none", compile=False), LLM(d_dir, method="none", compile=False)
    prompts = [target.tokenizer.encode(t) for t in code_completion(load_corpus(None).heldout, args.prompts)]
    rows = []
    for temp in args.temperatures:
        for name, kw in SETTINGS.items():
            raw, pen = [], []
            for i, prompt in enumerate(prompts):
                params = SamplingParams(temperature=temp, seed=i, max_tokens=args.new_tokens, ignore_eos=True, **kw)
                a, b = acceptance(target, draft, prompt, params)
                raw += a
                pen += b
            row = {"temperature": temp, "setting": name, "positions": len(raw),
                   "acceptance_q_unpenalized": sum(raw) / len(raw), "acceptance_q_penalized": sum(pen) / len(pen)}
            rows.append(row)
            print(f"T={temp} {name}: q unpenalised {row['acceptance_q_unpenalized']:.3f}, "
                  f"q penalised {row['acceptance_q_penalized']:.3f} ({len(raw)} positions)", flush=True)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": cpu_model(), "cores": os.cpu_count(),
            "torch": torch.__version__, "models": "bundled target + bundled draft",
            "command": f"python benchmarks/penalty_acceptance.py --prompts {args.prompts} --new-tokens "
                       f"{args.new_tokens} --temperatures {' '.join(map(str, args.temperatures))} --out {args.out}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "provenance": provenance("cpu", 1)}, indent=1))


if __name__ == "__main__":
    main()
