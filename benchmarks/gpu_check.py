"""One prepared device check: the GPU figures quickdraft's CPU results cannot give.

    PYTHONPATH=. python benchmarks/gpu_check.py --out $OUT            # GPU, within ~8 minutes
    PYTHONPATH=. python benchmarks/gpu_check.py --out /tmp/x --small  # any device, tiny shapes, < 1 minute

Writes OUT/gpu_check.json after every part (so a timeout or a failing part still leaves the
rest), plus OUT/tune_default_pair.json and OUT/bench_default_pair.{json,md} from part e.
Every part runs in its own try/except; a failure is recorded as {"error", "traceback"}.

a. hardware: device, memory, versions, driver.
b. bandwidth: median time of cloning a large tensor; GB/s counts the bytes read and written.
c. decode: a randomly initialised Llama-3-8B-shaped target (hidden 4096, 32 layers, 32 heads,
   8 kv heads, intermediate 14336, vocab 128256), built with quickdraft's own Transformer
   directly on the device in bf16 (normal(0, 0.02) weights, no checkpoint); plain decoding's
   ms/token at batch 1 through quickdraft's engine, against the memory roofline (bytes of the
   weights read per token / measured bandwidth) as a fraction.
d. verify: the same target's step time T(B, q) (quickdraft's KV cache, `context` tokens
   cached per row) for q = 1..16 and B = 1..64, and T(B, q) / T(B, 1): what verifying q - 1
   drafts costs over a plain step at each batch size.
   The same with the engine's compiled steps (CUDA graphs), beside it.
e. tune and bench of the bundled pair on the device (quickdraft.bench.tune.tune and
   quickdraft.bench.compare.run_bench, modest settings, float32 so that greedy outputs compare exactly),
   bench with transformers as peers when it is installed.

f. benchmarks/compiled.py on the device: the bundled pair with eager vs compiled steps and a
   full-precision vs an int8 draft (speedup over plain decoding of the same mode, acceptance).

g. weight formats on the device: the bundled pair with quantization none / int8 / int4 (the
   target's; eager, and CUDA graphs for none): plain and draft (k=3) greedy tokens/s, whether the
   speculative output equals plain decoding's, and the format each linear got (PyTorch has no
   int8 / int4 weight-only kernel for CUDA: those dequantise per call, labelled so).
h. ahead-of-time compiled CPU steps (quickdraft.aot) on the device machine's CPU and its torch:
   build and load time of the bundled target's package, eager vs package ms/token (4 threads),
   greedy output equality. With --small, the bundled draft's (2 layers instead of 8: a quarter
   of the build, the same steps).

A part that would start past the time budget (--budget-s) is skipped and says so.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

LLAMA3_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 8192}
TINY = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024}


@dataclass(frozen=True)
class Settings:
    shape: dict  # model config of the random target (parts c, d)
    dtype: str  # of the random target
    copy_mib: int  # tensor cloned in part b
    copy_iters: int
    decode_prompt: int  # prompt tokens, part c
    decode_tokens: int  # new tokens per timed generate, part c
    decode_repeats: int
    batch_sizes: tuple[int, ...]  # part d
    query_lengths: tuple[int, ...]
    context: int  # cached tokens per row, part d
    step_iters: int
    tune_batch_sizes: tuple[int, ...]  # part e
    tune_k_max: int
    tune_prompts: int
    tune_max_tokens: int
    tune_iters: int
    bench_batch_sizes: tuple[int, ...]
    bench_ks: tuple[int, ...]
    bench_prompts: int
    bench_new_tokens: int
    bench_repeats: int
    bench_iters: int


FULL = Settings(shape=LLAMA3_8B, dtype="bfloat16", copy_mib=4096, copy_iters=20, decode_prompt=128,
                decode_tokens=128, decode_repeats=3, batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                query_lengths=tuple(range(1, 17)), context=512, step_iters=8, tune_batch_sizes=(1, 4, 16, 64),
                tune_k_max=6, tune_prompts=8, tune_max_tokens=64, tune_iters=5, bench_batch_sizes=(1, 8, 32),
                bench_ks=(2, 4), bench_prompts=4, bench_new_tokens=64, bench_repeats=3, bench_iters=5)
SMALL = Settings(shape=TINY, dtype="bfloat16", copy_mib=64, copy_iters=5, decode_prompt=16, decode_tokens=16,
                 decode_repeats=2, batch_sizes=(1, 2, 4), query_lengths=(1, 2, 3, 4), context=32, step_iters=2,
                 tune_batch_sizes=(1, 2), tune_k_max=2, tune_prompts=2, tune_max_tokens=8, tune_iters=1,
                 bench_batch_sizes=(1,), bench_ks=(2,), bench_prompts=2, bench_new_tokens=8, bench_repeats=1,
                 bench_iters=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def hardware(device: torch.device) -> dict:
    from quickdraft.bench.hardware import cpu_model, device_name

    info = {"device": device.type, "name": device_name(device), "cpu_model": cpu_model(),
            "logical_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "torch_hip": getattr(torch.version, "hip", None)}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(total_memory_gib=p.total_memory / 2**30, multiprocessors=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", device_count=torch.cuda.device_count(),
                    bf16_supported=torch.cuda.is_bf16_supported())
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                "clocks.max.memory,power.limit", "--format=csv"], capture_output=True, text=True,
                               timeout=20)
            info["nvidia_smi"] = (r.stdout + r.stderr).strip()
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvidia_smi"] = f"unavailable: {exc}"
    return info  # commit, command, CPU features and load: the report's "provenance"


def bandwidth(device: torch.device, s: Settings) -> dict:
    x = torch.empty(s.copy_mib * 2**20 // 2, dtype=torch.bfloat16, device=device).normal_()
    for _ in range(2):  # warm-up (allocator, clocks)
        x.clone()
    times = [timed(lambda: x.clone(), device) for _ in range(s.copy_iters)]
    nbytes = x.numel() * x.element_size()
    t = statistics.median(times)
    return {"tensor_mib": s.copy_mib, "iters": s.copy_iters, "median_s": t, "min_s": min(times),
            "gb_per_s": 2 * nbytes / t / 1e9, "gb_per_s_best": 2 * nbytes / min(times) / 1e9,
            "definition": "2 x tensor bytes (read + write) / median time of x.clone()"}


def build_random_target(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """quickdraft's Transformer for a Llama config, materialised directly on `device` in `dtype`
    with normal(0, 0.02) weights and unit norms: no checkpoint, no host copy."""
    from quickdraft.config import ModelConfig
    from quickdraft.model.transformer import Transformer

    cfg = ModelConfig.from_hf({"model_type": "llama", "torch_dtype": str(dtype).removeprefix("torch."), **shape})
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def decode(model, device: torch.device, bw: dict | None, s: Settings, compile: bool = False) -> dict:
    """compile: the engine's compiled steps (CUDA graphs on CUDA: quickdraft.compile)."""
    from quickdraft import SamplingParams
    from quickdraft.config import EngineConfig, SpecConfig
    from quickdraft.engine import Engine

    cfg = model.config
    engine = Engine(model, None, EngineConfig(spec=SpecConfig(method="none"), max_num_seqs=1,
                                              max_model_len=s.decode_prompt + s.decode_tokens + 8, compile=compile))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (s.decode_prompt,), generator=gen).tolist()

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return timed(lambda: engine.generate([(prompt, params)]), device)

    run(s.decode_tokens)  # warm-up
    pairs = []
    for _ in range(s.decode_repeats):  # prefill + 1 token, then prefill + n tokens: the difference is n - 1 steps
        t1, tn = run(1), run(s.decode_tokens)
        pairs.append((tn - t1) / (s.decode_tokens - 1))
    per_token = statistics.median(pairs)
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = params["model.embed_tokens.weight"]
    # per token the embedding table gives one row; every other weight is read whole
    read = total - (0 if cfg.tie_word_embeddings else embed.numel() * embed.element_size())
    out = {"shape": dict(s.shape), "dtype": str(model.dtype).removeprefix("torch."),
           "parameters": sum(p.numel() for p in params.values()), "weight_bytes": total,
           "weight_bytes_read_per_token": read, "prompt_tokens": s.decode_prompt, "new_tokens": s.decode_tokens,
           "repeats": s.decode_repeats, "ms_per_token": 1e3 * per_token, "ms_per_token_per_repeat": [1e3 * x for x in pairs],
           "tokens_per_s": 1 / per_token, "compiled": compile,
           "compile_fell_back": getattr(engine._forward, "failed", None),
           "timing": "quickdraft Engine, method none, greedy, batch 1: (t(n tokens) - t(1 token)) / (n - 1)"}
    if bw is not None and "gb_per_s" in bw:
        roof = read / (bw["gb_per_s"] * 1e9)
        out.update(roofline_ms_per_token=1e3 * roof, fraction_of_roofline=roof / per_token,
                   roofline_definition="weight bytes read per token / measured copy bandwidth (part b); "
                                       "1.0 = decoding at the memory roofline")
    return out


def verify_cost(model, device: torch.device, s: Settings) -> dict:
    from quickdraft.bench.measure import measure_target_steps

    steps = measure_target_steps(model, list(s.batch_sizes), list(s.query_lengths), s.context, s.step_iters)
    return {"batch_sizes": list(s.batch_sizes), "query_lengths": list(s.query_lengths), "context": s.context,
            "iters": s.step_iters, "target_step_s": steps,
            "ratio_to_q1": [[t / row[0] for t in row] for row in steps],
            "tokens_per_s_q1": [b / row[0] for b, row in zip(s.batch_sizes, steps)],
            "definition": "T(B, q): median seconds of one forward over q query tokens per row for B rows, "
                          "each row with `context` tokens in quickdraft's KV cache; ratio_to_q1 = T(B, q) / T(B, 1)"}


def tune_default_pair(device: torch.device, out: Path, s: Settings) -> dict:
    from quickdraft.bench.tune import TuneConfig, tune
    from quickdraft.llm import default_model_dirs

    target, draft = default_model_dirs()
    plot = out / "tune_default_pair.png" if importlib.util.find_spec("matplotlib") is not None else None
    config = TuneConfig(target=target, draft=draft, methods=("draft", "ngram"), k_max=s.tune_k_max,
                        batch_sizes=s.tune_batch_sizes, num_prompts=s.tune_prompts, max_tokens=s.tune_max_tokens,
                        iters=s.tune_iters, out=out / "tune_default_pair.json", plot=plot, dtype="float32",
                        device=device.type, command="benchmarks/gpu_check.py (part e)")
    profile = tune(config)
    plain = {str(b): profile.goodput("draft", b, 0) for b in profile.batch_sizes}
    return {"profile": str(config.out), "plot": None if plot is None else str(plot), "best_k": profile.best_k_by_batch,
            "predicted_plain_tokens_per_s": plain,
            "predicted_speedup_at_best_k": {m: {str(b): profile.goodput(m, b, profile.best_k(m, b)) / plain[str(b)]
                                                for b in profile.batch_sizes} for m in profile.methods},
            "target_step_s": profile.target_step_s, "batch_sizes": profile.batch_sizes,
            "query_lengths": profile.query_lengths}


def bench_default_pair(device: torch.device, out: Path, s: Settings) -> dict:
    from quickdraft.bench.compare import run_bench, write_outputs
    from quickdraft.bench.hardware import device_name
    from quickdraft.bench.peers import transformers_missing
    from quickdraft.bench.workloads import code_completion
    from quickdraft.llm import default_model_dirs
    from quickdraft.train.corpus import load_corpus

    target, draft = default_model_dirs()
    prompts = code_completion(load_corpus(None).heldout, s.bench_prompts)
    missing = transformers_missing()
    result = run_bench(target, draft, ["draft", "ngram"], {}, list(s.bench_batch_sizes), list(s.bench_ks), [0.0],
                       prompts, s.bench_new_tokens, s.bench_repeats, s.bench_iters, peers=missing is None,
                       dtype="float32", device=device.type)
    if missing:
        result["peers"] = {"skipped": missing}
    result["setup"] = {"hardware": device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": "benchmarks/gpu_check.py (part e): run_bench(methods draft, ngram; batch sizes "
                                  f"{list(s.bench_batch_sizes)}; ks {list(s.bench_ks)}; T 0; {s.bench_prompts} prompts; "
                                  f"{s.bench_new_tokens} new tokens; {s.bench_repeats} repeats; float32)"}
    paths = write_outputs(result, out, "bench_default_pair", device.type)
    summary = {"files": [str(p) for p in paths],
               "runs": [{k: r[k] for k in ("batch_size", "method", "k", "tokens_per_s", "plain_tokens_per_s", "speedup",
                                           "predicted_speedup", "tokens_per_step")} for r in result["runs"]]}
    peers = result.get("peers", {})
    if "ratios" in peers:
        summary["peers"] = {"ratios": {k: v["median_of_ratios"] for k, v in peers["ratios"].items()},
                            "identical_to_ours_plain": {k: v["identical_to_ours_plain"]
                                                        for k, v in peers["methods"].items()},
                            "tokens_per_s": {k: v["tokens_per_s"] for k, v in peers["methods"].items()}}
    else:
        summary["peers"] = peers
    return summary


def compiled_pair(out: Path, s: Settings) -> dict:
    """benchmarks/compiled.py on this device: the default pair, eager vs compiled steps,
    full vs int8 draft (its JSON lands in OUT)."""
    script = Path(__file__).with_name("compiled.py")
    prompts, tokens, repeats = (2, 8, 1) if s is SMALL else (4, 64, 3)
    cmd = [sys.executable, str(script), "--prompts", str(prompts), "--new-tokens", str(tokens), "--repeats",
           str(repeats), "--out-dir", str(out), "--name", "compiled_pair"]
    if s is SMALL:  # a quick pass through the script without compiling the bundled pair
        cmd += ["--configs", "plain-eager", "draft-eager", "int8-draft-eager", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        raise RuntimeError(f"compiled.py exited {done.returncode}: {done.stderr[-2000:]}")
    result = json.loads((out / "compiled_pair.json").read_text())
    return {name: {k: v for k, v in c.items() if k not in ("repeats", "memory")}
            for name, c in result["configs"].items()}


def _generate(llm, prompts, tokens: int, device: torch.device) -> tuple[list[list[int]], float]:
    from quickdraft import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up at the same batch shape: CUDA graphs are captured per shape
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - t0
    return [o.token_ids for o in outs], len(prompts) * tokens / seconds


def weight_formats(device: torch.device, s: Settings) -> dict:
    from quickdraft.llm import LLM
    from quickdraft.model.formats import FastLinear

    prompts = ["def fibonacci(n):", "The capital of France is", "Once upon a time", "import numpy as np\n"]
    tokens = 16 if s is SMALL else 96
    result = {"prompts": len(prompts), "new_tokens": tokens, "draft_k": 3, "configs": {}}
    configs = [(None, False), (None, True), ("int8", False), ("int4", False)]
    for quant, compile in configs[:1] + configs[2:] if s is SMALL else configs:  # small: no compile on CPU
        name = f"{quant or 'none'}-{'compiled' if compile else 'eager'}"
        try:
            plain = LLM(method="none", device=str(device), dtype="float32", quantization=quant, compile=compile)
            linear = next(m for m in plain.target.modules() if isinstance(m, FastLinear))
            want, plain_tps = _generate(plain, prompts, tokens, device)
            del plain
            spec = LLM(method="draft", num_speculative_tokens=3, device=str(device), dtype="float32",
                       quantization=quant, compile=compile, policy="fixed")
            got, spec_tps = _generate(spec, prompts, tokens, device)
            result["configs"][name] = {"format": repr(linear), "plain_tokens_per_s": plain_tps,
                                       "draft_tokens_per_s": spec_tps, "speedup": spec_tps / plain_tps,
                                       "identical_to_plain": got == want,
                                       "tokens_equal": sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)),
                                       "tokens": sum(len(w) for w in want)}
        except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others
            result["configs"][name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0],
                                       "traceback": traceback.format_exc()}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def aot_cpu(s: Settings) -> dict:
    """The bundled target's AOT package on this machine's CPU (a scratch cache folder); --small:
    the bundled draft's, a smaller model through the same build, load and engine."""
    import tempfile

    from quickdraft import aot
    from quickdraft.llm import LLM, default_model_dirs

    model = default_model_dirs()[1 if s is SMALL else 0]

    threads, cache = torch.get_num_threads(), os.environ.get("QUICKDRAFT_CACHE")
    torch.set_num_threads(1 if s is SMALL else 4)
    os.environ["QUICKDRAFT_CACHE"] = tempfile.mkdtemp(prefix="quickdraft-aot-")
    try:
        eager = LLM(model, method="none", device="cpu", dtype="float32", compile=False)
        t0 = time.perf_counter()
        aot.build(eager.target)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        step = aot.load(eager.target)
        loaded = time.perf_counter() - t0
        prompts = ["def fibonacci(n):", "The capital of France is"]
        tokens = 16 if s is SMALL else 96
        cpu = torch.device("cpu")
        want, eager_tps = _generate(eager, prompts[:1], tokens, cpu)
        packaged = LLM(model, method="none", device="cpu", dtype="float32", compile="auto")
        got, aot_tps = _generate(packaged, prompts[:1], tokens, cpu)
        return {"model": f"bundled {model.name}", "torch": torch.__version__, "threads": torch.get_num_threads(),
                "build_s": built, "load_s": loaded,
                "loaded": repr(step), "engine_step": type(packaged.engine._forward).__name__,
                "eager_ms_per_token": 1e3 / eager_tps, "aot_ms_per_token": 1e3 / aot_tps,
                "identical": got == want, "new_tokens": tokens,
                "timing": "one prompt, batch 1, greedy, generate() wall time / new tokens (prefill included)"}
    finally:
        torch.set_num_threads(threads)
        if cache is None:
            os.environ.pop("QUICKDRAFT_CACHE")
        else:
            os.environ["QUICKDRAFT_CACHE"] = cache


def main(argv: list[str] | None = None) -> int:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and part e's files")
    ap.add_argument("--small", action="store_true", help="tiny shapes and few iterations (CPU, tests)")
    ap.add_argument("--device", default=None, help="cuda | cpu | mps (default: cuda if available, else cpu)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip parts that would start after this many seconds (default 420, 50 with --small)")
    ap.add_argument("--parts", default="abcdefgh", help="which parts to run, e.g. abcd (default: all)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device")
    if device.type == "cpu" and not args.small:
        ap.error("the full check builds an 8B-parameter model: it needs a GPU (use --small on CPU)")
    if set(args.parts) - set("abcdefgh") or not args.parts:
        ap.error(f"--parts takes letters from abcdefgh, got {args.parts!r}")
    s = SMALL if args.small else FULL
    if args.small and device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes gain nothing from threads; on a shared CPU extra ones stall
    budget = args.budget_s if args.budget_s is not None else (50.0 if args.small else 420.0)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.json"
    start = time.perf_counter()
    from quickdraft.bench.hardware import loadavg, provenance

    load_before = loadavg()

    def write() -> None:
        report["provenance"] = provenance(device, argv=None if argv is None else [sys.argv[0], *argv],
                                          load_before=load_before)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    report: dict = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
                    "small": args.small, "device": str(device), "budget_s": budget, "settings": asdict(s),
                    "seconds": {}}

    def part(key: str, letter: str, fn, min_left: float = 0.0):
        if letter not in args.parts:
            return None
        elapsed = time.perf_counter() - start
        if elapsed > budget - min_left:
            report[key] = {"skipped": f"time budget: {elapsed:.0f} s spent of {budget:.0f} s, part needs ~{min_left:.0f} s"}
        else:
            t0 = time.perf_counter()
            try:
                report[key] = fn()
            except Exception as exc:  # one part failing must not lose the others
                report[key] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0], "traceback": traceback.format_exc()}
            report["seconds"][key] = time.perf_counter() - t0
        write()
        print(f"[{time.perf_counter() - start:6.1f} s] {key}: "
              + ("ok" if "error" not in report[key] and "skipped" not in report[key]
                 else report[key].get("error") or report[key]["skipped"]), flush=True)
        return report[key]

    part("hardware", "a", lambda: hardware(device))
    bw = part("bandwidth", "b", lambda: bandwidth(device, s))
    model = None
    if "c" in args.parts or "d" in args.parts:
        try:
            t0 = time.perf_counter()
            model = build_random_target(s.shape, getattr(torch, s.dtype), device)
            report["random_target"] = {"seconds_to_build": time.perf_counter() - t0,
                                       "parameters": sum(p.numel() for p in model.parameters())}
        except Exception as exc:
            report["random_target"] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0],
                                       "traceback": traceback.format_exc()}
    if model is not None:
        part("decode", "c", lambda: decode(model, device, bw, s))
        part("decode_compiled", "c", lambda: decode(model, device, bw, s, compile=True),
             min_left=90.0 if not args.small else 5.0)
        part("verify", "d", lambda: verify_cost(model, device, s), min_left=60.0 if not args.small else 5.0)
    elif "c" in args.parts or "d" in args.parts:
        for key, letter in (("decode", "c"), ("verify", "d")):
            if letter in args.parts:
                report[key] = {"error": "the random target could not be built (see random_target)"}
    model = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    part("tune", "e", lambda: tune_default_pair(device, args.out, s), min_left=150.0 if not args.small else 15.0)
    part("bench", "e", lambda: bench_default_pair(device, args.out, s), min_left=120.0 if not args.small else 10.0)
    part("weight_formats", "g", lambda: weight_formats(device, s), min_left=90.0 if not args.small else 10.0)
    part("aot_cpu", "h", lambda: aot_cpu(s), min_left=90.0 if not args.small else 10.0)
    part("compiled_pair", "f", lambda: compiled_pair(args.out, s), min_left=120.0 if not args.small else 10.0)
    report["total_seconds"] = time.perf_counter() - start
    if device.type == "cuda":
        report["cuda_max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    write()
    print(f"wrote {path} in {report['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
