"""What sampling costs on this CPU: the draws alone, and SmolLM2's plain decoding sampled against greedy.

1. Draws and verifiers: a sampled token for B rows over SmolLM2's vocabulary (49,152; the verifier's
   final token), a 5-deep draft chain's tokens (what a draft model or EAGLE-3 head draws per step),
   and the sampled verifiers on B rows (a 5-token chain; a 6-node tree, two siblings a depth),
   thread-clock medians.
2. Decoding: a model (default SmolLM2 as shipped, `quickdraft pull smollm2`), method none, batch B,
   temperature 1.0 (seeded) and 0.0 in the same process: tokens a second and their ratio (the sampled step's
   overhead over a greedy one, which the machine's drift from process to process leaves alone).

Run it in two trees in turn to compare them (PYTHONPATH=TREE); it uses whichever API the tree has
(`sampling.draw` since it replaced the exponential race).

    taskset -c 1 python benchmarks/sampling_cost.py --threads 1 --batch 1 4 --tokens 96 --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from quickdraft.bench.hardware import provenance

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "Give three tips for learning Python.",
           "What is the capital of France and why is it famous?", "Describe a sunrise.", "How do vaccines work?",
           "Summarise the plot of Hamlet.", "What is speculative decoding?"]


def draw_costs(batches: list[int], vocab: int = 49152, repeats: int = 7) -> dict:
    import quickdraft.sampling as S

    g = torch.Generator().manual_seed(0)
    out = {"api": "draw" if hasattr(S, "draw") else "race"}
    for B in batches:
        probs = torch.softmax(torch.randn(B, vocab, generator=g) * 3, -1)
        rnd = S.StepRandom([S.seed_key(b) for b in range(B)], [100 + b for b in range(B)], "cpu")
        if hasattr(S, "draw"):
            def final():
                return S.draw(probs, rnd.draws(S.Stream.FINAL)[:, 0])

            def chain():
                d = rnd.draft_draws(5)
                return [S.draw(probs, d[:, i, 0]) for i in range(5)]
        else:  # the exponential race of earlier versions
            def final():
                return S.race(probs, rnd.exponential(S.Stream.FINAL, vocab))

            def chain():
                n = rnd.draft_noise(5, vocab)
                return [S.race(probs, n[:, i]) for i in range(5)]
        cases = [("final", final), ("chain5", chain)]
        if hasattr(S, "draw"):
            cases += verifier_cases(S, B, vocab, rnd, g)
        for name, f in cases:
            f()
            times = []
            for _ in range(repeats):
                t = time.thread_time()
                for _ in range(10):
                    f()
                times.append((time.thread_time() - t) / 10 * 1e3)
            out[f"{name}_B{B}_ms"] = statistics.median(times)
    return out


def verifier_cases(S, B: int, vocab: int, rnd, g: torch.Generator) -> list:
    """The sampled verifiers on B rows: a 5-token chain drawn from q (rejection_sample) and a sampled
    6-node tree (two siblings a depth, three deep: tree_rejection_sample), q a perturbed p, so
    that some tokens are accepted and some rejected."""
    from quickdraft.verify import rejection_sample, tree_rejection_sample

    def pair(n: int):
        z = torch.randn(B, n + 1, vocab, generator=g) * 3
        p = torch.softmax(z, -1)
        q = torch.softmax(z[:, :n] + torch.randn(B, n, vocab, generator=g), -1)
        x = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(B, n)
        return p, q, x

    p, q, x = pair(5)
    u5, final = rnd.uniform(S.Stream.ACCEPT, 5), rnd.draws(S.Stream.FINAL)[:, 0]
    tp, tq, tx = pair(6)
    parents = torch.tensor([[-1, -1, 0, 0, 2, 2]] * B)
    u6 = rnd.uniform(S.Stream.ACCEPT, 6)
    return [("verify_chain5", lambda: rejection_sample(x, p, q, u5, final)),
            ("verify_tree6", lambda: tree_rejection_sample(tx, parents, tp, tq, u6, final))]


def decoding(model: str, batches: list[int], tokens: int) -> dict:
    from quickdraft import LLM, SamplingParams

    llm = LLM(model, method="none")
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    llm.generate(ids[:4], SamplingParams(temperature=1.0, seed=0, max_tokens=16, ignore_eos=True))  # warm
    out = {}
    for B in batches:
        for temperature in (1.0, 0.0):
            s = llm.stats
            el0, tok0 = s.elapsed_s, s.num_output_tokens
            for start in range(0, len(ids), B):
                llm.generate(ids[start:start + B], [SamplingParams(temperature=temperature, seed=i, max_tokens=tokens,
                                                                   ignore_eos=True) for i in range(start, start + B)])
            s = llm.stats
            out[f"T{temperature}_B{B}_tok_s"] = (s.num_output_tokens - tok0) / (s.elapsed_s - el0)
        out[f"sampled_over_greedy_B{B}"] = out[f"T1.0_B{B}_tok_s"] / out[f"T0.0_B{B}_tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per request")
    ap.add_argument("--model", default="smollm2", help="what LLM() takes: a name, folder or GGUF file")
    ap.add_argument("--skip-decoding", action="store_true", help="the draws only (no model)")
    ap.add_argument("--out", help="write the result here (JSON, with its provenance)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, **draw_costs(args.batch)}
    if not args.skip_decoding:
        result.update({"model": args.model, **decoding(args.model, args.batch, args.tokens)})
    result["provenance"] = provenance("cpu", args.threads)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
