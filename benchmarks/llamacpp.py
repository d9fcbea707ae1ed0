"""quickdraft against llama.cpp on this CPU, batch 1, greedy (issue 19, the peer benchmark).

Not part of CI: the first run builds llama.cpp (about 10 minutes on 2 cores) and converts the
models; both are cached outside the repository, under the quickdraft cache
(`QUICKDRAFT_CACHE`, else ~/.cache/quickdraft):

- peers/llama.cpp-<v>/source: llama.cpp as vendored in the PyPI sdist of llama-cpp-python==<v>
  (`pip download --no-binary :all:`), built into peers/llama.cpp-<v>/build/bin with cmake + the
  system C++ compiler (CPU only, -DGGML_NATIVE=ON, static; AMX left out where the CPU lists it:
  llama.cpp's AMX kernels crashed on prompts there, cmake_flags);
  with `--isa avx2` a second build in peers/llama.cpp-<v>/build-avx2 (-DGGML_NATIVE=OFF, SSE4.2,
  AVX, AVX2, FMA, F16C, BMI2 on; AVX-VNNI, AVX-512 and AMX off: a Zen 3 / Intel Core 12th+ CPU);
- peers/pydeps: sentencepiece, which llama.cpp's convert_hf_to_gguf.py imports (installed with
  `pip install --target`, so the project's virtual environment is left as it is);
- peers/models: the GGUF files llama.cpp runs, all made from the same weights ours loads:
  F32 (BF16 for big) and Q8_0 by convert_hf_to_gguf.py, Q4_0 and Q4_K_M by llama-quantize from
  the F32 (BF16) file; and big-1.7b, the big model's folder.

Models:
- smollm2: SmolLM2-135M-Instruct. quickdraft's catalogue ships it as a Q4_1 GGUF; the float32
  folder dequantised from it (the one benchmarks/real_model.py gives transformers) is the
  reference weights of both engines (the Q4_1 rounding is in both). Prompts are rendered with
  the chat template (chat / code / editing requests of quickdraft.bench.workloads); llama.cpp
  adds no BOS for this vocabulary, so both engines see the same token ids.
- bundled: the 28M code model shipped in quickdraft/default_models/target and its draft,
  prompts are raw text (function openings, and the editing workload), BOS added by both.
  Converted from a copy in the cache: its BPE pre-tokenizer is declared "gpt-2" (llama.cpp's
  converter does not recognise the tokenizer by hash) and a config without "architectures"
  gets one.
- big: a randomly initialised model of SmolLM2-1.7B's shape (24 layers, hidden 2048, MLP 8192,
  32 heads, 32 kv heads, vocabulary 49,152, rope theta 130000, tied embeddings) with SmolLM2's
  tokenizer and chat template: bfloat16 weights from N(0, 0.02) (norms 1), seed 0, made once into
  peers/models/big-1.7b (3.4 GB). Speed only: its text is noise and acceptance means nothing.
  Its reference is bfloat16 (configuration bf16 vs the BF16 GGUF); float32 rows are skipped.
The token ids llama.cpp makes of every prompt are read back (`--verbose-prompt`) and compared
with ours before anything is timed.

Configurations (ours vs llama.cpp):
- f32: dtype float32 vs the F32 GGUF (the outputs should be the same text);
- bf16: dtype bfloat16 vs the BF16 GGUF (same weights, same bytes per weight);
- bf16-q8_0: dtype bfloat16 vs Q8_0;  int8-q8_0: quantization="int8" vs Q8_0;
- int4-q4_0, int4-q4_k_m: quantization="int4" vs Q4_0 / Q4_K_M; int4-super-q4_0: the same in the
  int4 kernel's super-block layout (4.625 bits a weight against 5, where a layer's inputs are a
  multiple of 256; quant.INT4_SUPER_BLOCKS, not the default);
- ngram, suffix: method "ngram" / "suffix", k=8, float32, vs llama-lookup (8 draft tokens,
  F32), editing prompts only. Suffix decoding keeps no outputs across requests
  (global_max_tokens=0), as llama-lookup keeps none (no lookup cache files);
- draft-k3, draft-k5: the model's draft (bundled pair), float32, fixed k, vs
  llama-speculative-simple with the F32 draft, --spec-type draft-simple --spec-draft-n-max k
  --spec-draft-n-min 0 --spec-draft-p-min 0 (always draft k, as ours does with the fixed policy);
- eagle3-k3, eagle3-k3-vs-lookup, eagle3-tree3x8: ours with the EAGLE-3 head quickdraft ships
  for the model (default_models/smollm2-eagle3, target-eagle3; chain k=3, or a dynamic tree of
  width 3, depth 4, 8 nodes), float32, vs llama.cpp's plain decoding and vs llama-lookup (k 8):
  llama.cpp runs no EAGLE-3 heads on CPU and has no draft model for SmolLM2, so these are its
  best methods here. Chat and code workloads.

- shipped, prefill-shipped: the model's GGUF as quickdraft's catalogue ships it (SmolLM2's Q4_1
  file: 4-bit layers, Q8_0 embedding and lm_head), both engines on the same file, ours with its
  defaults (no dtype or quantization given: what `--target smollm2` runs); decode, and the
  prompt phase as below. Skipped for models with no shipped GGUF.
- gguf-q4_0, prefill-gguf-q4_0: both engines load the one Q4_0 GGUF llama-quantize made from the
  reference weights (the same bytes: its 4-bit layers as they are, symmetric int4 on our side,
  and its wider token embedding / lm_head), ours with its defaults, as for shipped; decode, and the
  prompt phase as below. gguf-q4_k_m: the same with llama-quantize's Q4_K_M file (its Q4_K layers
  on the int4 kernel, its Q6_K ones on the int8 kernel).
- long-shipped, long-shipped-f32kv, long-shipped-f16kv: decoding after a 3,000-token prompt
  (stretches of held-out source files, as prefill's; workload "long"), both engines on the shipped
  file: ours with its defaults (a float16 KV cache for its int4 layers), with kv_cache_dtype=
  "float32", and with "float16" named; llama.cpp keeps its default f16 cache in all. At that
  context a float32 cache is about as many bytes a step as the weights.
- prefill, prefill-int8-q8_0, prefill-int4-q4_0: the prompt phase of 512-token prompts
  (stretches of held-out source files, raw text, the same ids in both engines), 1 new token:
  the model's reference weights (f32; bf16 for big), int8 vs Q8_0, int4 vs Q4_0. tok/s = prompt
  tokens / prompt seconds (ours: the first `LLM.stream` step, prefill and first token;
  llama.cpp: its prompt eval time), ratio ours / llama.cpp as for decoding.

ISA (`--isa`): native (default) lets both engines use all this CPU has; `--isa avx2` runs both as
on an AVX2 + FMA machine without AVX-512: llama.cpp from its build-avx2 build, ours started again
with QUICKDRAFT_ISA=avx2 QUICKDRAFT_VNNI=0 (no AVX-VNNI: as the llama.cpp build) ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 set before torch is imported (it stops unless quickdraft's kernels and
ATen both report AVX2). Both sides' ISA (llama.cpp's system_info line) are in the JSON and the
markdown; the files are llamacpp_<model>_cpu_avx2.* then.

Loading: per configuration, the wall time of `LLM(folder, ...)` (reading, quantising, packing
and, with --compile aot, building or loading the AOT steps) and the first request's prompt
phase after it (one-time costs included), at the largest --threads: "loads" in the JSON, a table in
the markdown.

Timing. Batch 1, greedy, N new tokens, eos ignored (llama.cpp's --ignore-eos bans end-of-generation
tokens; ours keeps sampling past eos, so outputs are compared up to ours' first special token).
Each (configuration, workload, threads) block: one short warm-up of ours, then `--repeats`
repeats; in repeat r every prompt runs on both engines back to back, ours first in even repeats,
llama.cpp first in odd ones. llama.cpp runs as a fresh process per prompt (model load and its
own warm-up not timed). Decode phase only:
- ours: the prompt phase is the first `LLM.stream` step (prefill and the first token); decode
  tok/s = the tokens after it / the time after it;
- llama-completion: decode tok/s = eval runs / (eval time + sampling time) of its perf print
  (its own eval-only rate is kept in the JSON); prompt time = its prompt eval time;
- llama-lookup, llama-speculative-simple: their "decoded N tokens in S seconds" and
  "encoded ... in S seconds" lines (the decode loop's wall time, drafting included). llama.cpp's
  draft model reads the prompt in its prompt phase; ours catches up on it in the first decode step.
Per repeat a block's tok/s is its decode tokens / decode seconds over all prompts; the ratio
ours / llama.cpp is taken per repeat and its median reported, with the medians of both rates.
Threads: ours torch.set_num_threads(t) (OMP_NUM_THREADS=t set too), llama.cpp -t t -tb t.

    python benchmarks/llamacpp.py --models smollm2 bundled   # the small models, everything: about 3-4 h on 2 cores
    # issue 36's bars on a quiet machine, both ISAs: each about 30-45 min on 2 cores the first time
    # (7 AOT step builds, one per model and format, of ~2-5 min; ~10 min more for the AVX2
    # llama.cpp build), ~20 min with everything cached
    python benchmarks/llamacpp.py --models big smollm2 --configs f32 bf16 int8-q8_0 int4-q4_0 prefill \
        --workloads chat --threads 1 2 --repeats 3 --prompts 1 --new-tokens 64 --out-dir /tmp/lc-native
    python benchmarks/llamacpp.py --isa avx2 --models big smollm2 --configs f32 bf16 int8-q8_0 int4-q4_0 \
        prefill --workloads chat --threads 1 2 --repeats 3 --prompts 1 --new-tokens 64 --out-dir /tmp/lc-avx2
    # (add prefill-int8-q8_0 prefill-int4-q4_0 int4-q4_k_m for the quantised prefill and Q4_K_M rows)
    python benchmarks/llamacpp.py --quick --threads 1 --out-dir /tmp/lc   # ~10 min after the build
    python benchmarks/llamacpp.py --models bundled --configs draft-k3 draft-k5 --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.model import quant
from quickdraft.bench.hardware import (cpu_model, cpu_seconds, loadavg, other_cpu_share, provenance, provenance_line,
                                       read_bandwidth)
from quickdraft.bench.workloads import (chat_requests, code_completion, code_requests, editing,
                                        editing_requests)
from quickdraft.errors import QuickdraftError
from quickdraft.llm import default_model_dirs
from quickdraft.model.eagle3 import is_eagle3_head
from quickdraft.model.quant import QUANTIZATIONS, bytes_read_per_token
from quickdraft.model.sources import cache_dir, default_draft, resolve_model
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.train.corpus import load_corpus
from real_model import hf_folder  # the float32 SmolLM2 folder, shared with real_model.py

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp we build
BINARIES = ("llama-completion", "llama-bench", "llama-speculative-simple", "llama-lookup", "llama-quantize")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF")
MODELS = ("smollm2", "bundled", "big")
DEFAULT_MODELS = ("smollm2", "bundled")  # big: 3.4 GB of weights and ~7 GB of GGUFs, made on first use
WORKLOADS = {"smollm2": ("chat", "code", "editing"), "bundled": ("code", "editing"), "big": ("chat", "code")}
PEER_TIMEOUT_S = 1800
COMPILE_MODES = {"aot": "aot", "auto": None, "off": False}  # --compile -> LLM(compile=...)


def log(msg: str) -> None:
    print(msg, flush=True)


def force_isa(isa: str) -> None:
    """Run this script again with ISA_ENV[isa] set, unless it is: torch, MKL and oneDNN read them
    when torch is imported, which this module has done already."""
    env = ISA_ENV[isa]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    log(f"--isa {isa}: starting again with {' '.join(f'{k}={v}' for k, v in env.items())}")
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def ours_isa(isa: str) -> dict:
    """What our side runs: quickdraft's kernel path and ATen's CPU capability; for a forced ISA,
    an error unless both took it."""
    from quickdraft import kernels

    got = {"quickdraft_kernels": kernels.isa(), "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "int4_vnni": kernels.int4_uses_vnni(), "env": {k: os.environ.get(k) for k in ISA_ENV["avx2"]}}
    if isa == "avx2" and (got["quickdraft_kernels"] != "avx2" or got["aten_cpu_capability"] != "AVX2"
                          or got["int4_vnni"]):
        raise QuickdraftError(f"--isa avx2 did not take on our side: {got}")
    return got


def peers_dir() -> Path:
    return cache_dir() / "peers"


def run_cmd(cmd: list[str], what: str, env: dict | None = None, cwd: Path | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a command, capturing its output as bytes; a non-zero exit is an error naming `what`."""
    proc = subprocess.run(cmd, capture_output=True, env=env, cwd=cwd, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).decode("utf-8", "replace")[-3000:]
        raise QuickdraftError(f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}")
    return proc


# --- llama.cpp: fetch and build -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    root: Path  # peers/llama.cpp-<v>: source/ and one build folder per ISA
    cmake_flags: tuple[str, ...]  # what it was built with
    isa: str = "native"  # of ISAS: the build folder and the instructions it may use

    @property
    def source(self) -> Path:
        return self.root / "source"

    @property
    def build(self) -> Path:
        return self.root / ("build" if self.isa == "native" else f"build-{self.isa}")

    @property
    def bin(self) -> Path:
        return self.build / "bin"

    def exe(self, name: str) -> str:
        return str(self.bin / name)

    def version(self) -> str:
        out = subprocess.run([self.exe("llama-completion"), "--version"], capture_output=True, text=True)
        return " ".join((out.stdout + out.stderr).split())

    def system_info(self, gguf: Path) -> str:
        """The instruction sets the build runs (its system_info line, "CPU : SSE3 = 1 | ... |")."""
        proc = run_cmd([self.exe("llama-completion"), "-m", str(gguf), "-p", "a", "-n", "1", "-t", "1",
                        "-no-cnv", "--no-warmup", "-c", "64"], "llama-completion system_info")
        m = re.search(r"system_info: .*", proc.stderr.decode("utf-8", "replace"))
        return m.group(0).strip() if m else "?"


# --isa: what each engine may use. native = everything this CPU has (llama.cpp -march=native,
# quickdraft's own choice); avx2 = an AVX2 + FMA machine without AVX-512 (Zen 3, Intel Core 12th+):
# llama.cpp built without -march=native with only those instruction sets, quickdraft's kernels,
# ATen, MKL and oneDNN capped at AVX2 through their environment variables.
ISAS = ("native", "avx2")
ISA_CMAKE_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
             "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF",
             "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"),
}
ISA_ENV = {  # set in our worker before torch is imported
    "native": {},
    "avx2": {"QUICKDRAFT_ISA": "avx2", "QUICKDRAFT_VNNI": "0", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def ensure_llama_cpp(isa: str = "native") -> LlamaCpp:
    """The cached build for `isa`, made first when a binary is missing or the build flags changed:
    download the sdist, unpack its vendor/llama.cpp, configure and build the binaries we run."""
    flags = cmake_flags(isa)
    llama = LlamaCpp(peers_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON}", tuple(flags), isa)
    stamp = llama.build / "quickdraft-cmake-flags.json"
    if all((llama.bin / b).exists() for b in BINARIES) and stamp.exists() and sorted(json.loads(stamp.read_text())) == sorted(flags):
        return llama
    if not (llama.source / "CMakeLists.txt").exists():
        fetch_source(llama.source)
    cmake = shutil.which("cmake") or install_cmake()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    log(f"building llama.cpp ({isa}) into {llama.build} (about 10 minutes on 2 cores)...")
    start = time.perf_counter()
    run_cmd([cmake, "-S", str(llama.source), "-B", str(llama.build), *generator, *flags], "cmake configure")
    run_cmd([cmake, "--build", str(llama.build), "-j", str(os.cpu_count() or 1), "--target", *BINARIES],
            "cmake build")
    stamp.write_text(json.dumps(flags) + "\n")
    log(f"built llama.cpp in {time.perf_counter() - start:.0f} s")
    return llama


def cmake_flags(isa: str = "native") -> list[str]:
    """CMAKE_FLAGS with the ISA's, plus (native) the compiler told to leave AMX out where the CPU
    lists it. llama.cpp's AMX kernels (llama-cpp-python 0.3.36's llama.cpp) crashed there: built
    with them on an Intel Xeon whose AMX runs (quickdraft's AMX kernels run and give their bits),
    llama-completion died with SIGSEGV on SmolLM2's Q8_0, Q4_0 and Q4_1 files given a prompt of 41
    tokens or more (its AMX path takes prompt batches; a 5-token prompt ran), and ran with
    `--no-repack`, which leaves that path out; its decode speed was the same either way (Q8_0,
    1 thread: 49 tok/s). So llama.cpp runs its AVX-512 kernels on such a CPU, prompts included,
    and ours may use AMX for prompts: the prefill rows compare the best each engine runs there."""
    flags = [*CMAKE_FLAGS, *ISA_CMAKE_FLAGS[isa]]
    if isa != "native" or not cpu_lists_amx():
        return flags
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return [*flags, f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]


def cpu_lists_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def fetch_source(dest: Path) -> None:
    """vendor/llama.cpp of the llama-cpp-python sdist, unpacked to `dest`."""
    log(f"downloading the llama-cpp-python=={LLAMA_CPP_PYTHON} sdist (its vendored llama.cpp)...")
    with tempfile.TemporaryDirectory() as tmp:
        run_cmd([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], "pip download")
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        vendored = Path(tmp) / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(vendored), str(dest))


def install_cmake() -> str:
    """cmake from PyPI into the peers' own package folder, when the system has none."""
    target = peers_dir() / "pydeps"
    run_cmd([sys.executable, "-m", "pip", "install", "--target", str(target), "cmake"], "pip install cmake")
    return str(target / "bin" / "cmake")


# --- models -------------------------------------------------------------------------------------

# Imports llama.cpp's converter with the BPE pre-tokenizer forced (argv: the converter's own).
_CONVERT_WITH_PRE = """
import runpy, sys
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


@dataclasses.dataclass
class ModelSet:
    """One model as both engines see it: ours loads `target` (and `draft`), llama.cpp loads
    GGUF files converted from `hf_target` / `hf_draft` (the same weights)."""

    name: str
    target: Path
    hf_target: Path
    draft: Path | None
    hf_draft: Path | None
    chat: bool  # prompts rendered with the chat template
    pre_tokenizer: str | None  # declared to llama.cpp's converter where it cannot tell
    draft_status: str
    head: Path | None = None  # the EAGLE-3 head quickdraft ships for the model (eagle3 rows)
    shipped: Path | None = None  # the GGUF file as the catalogue ships it (the shipped-* rows)
    # the unquantised weights both engines compare at: ours' dtype and llama.cpp's GGUF type (F32
    # for the small models; a 1.7B model's float32 copy, 6.8 GB, would only measure DRAM: BF16)
    dtype: str = "float32"
    reference: str = "F32"

    def gguf(self, llama: LlamaCpp, kind: str, draft: bool = False) -> Path:
        """The GGUF of the target (or draft) in `kind` (F32, BF16, Q8_0, Q4_0, Q4_K_M), made once:
        F32 / BF16 / Q8_0 by llama.cpp's converter from the folder, the others by llama-quantize
        from the reference GGUF."""
        stem = f"{self.name}-draft" if draft else self.name
        out = peers_dir() / "models" / f"{stem}-{kind}.gguf"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        if kind in ("F32", "BF16", "Q8_0"):
            convert(llama, self.hf_draft if draft else self.hf_target, out, kind.lower(), self.pre_tokenizer)
        else:
            ref = self.gguf(llama, self.reference, draft)
            log(f"quantising {ref.name} to {kind}")
            tmp = out.with_suffix(".tmp")
            run_cmd([llama.exe("llama-quantize"), str(ref), str(tmp), kind], "llama-quantize")
            tmp.rename(out)
        return out


def convert(llama: LlamaCpp, folder: Path, out: Path, outtype: str, pre_tokenizer: str | None) -> None:
    """convert_hf_to_gguf.py on `folder` (float32 or bfloat16 safetensors) into `out`."""
    log(f"converting {folder} to {out.name}")
    script = str(llama.source / "convert_hf_to_gguf.py")
    pydeps = peers_dir() / "pydeps"
    if not (pydeps / "sentencepiece").exists():  # the converter imports it for every Llama vocabulary
        run_cmd([sys.executable, "-m", "pip", "install", "--target", str(pydeps), "sentencepiece"],
                "pip install sentencepiece")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama.source), str(llama.source / "gguf-py"),
                                                         str(pydeps)])}
    tmp = out.with_suffix(".tmp")
    args = [str(folder), "--outtype", outtype, "--outfile", str(tmp)]
    if pre_tokenizer is None:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-c", _CONVERT_WITH_PRE.format(pre=pre_tokenizer, script=script), *args]
    run_cmd(cmd, f"convert_hf_to_gguf.py {folder.name}", env=env)
    tmp.rename(out)


def converter_copy(folder: Path, dest: Path) -> Path:
    """A copy of an HF folder for llama.cpp's converter, with "architectures" filled in where
    the config has none (the repository's files are never edited)."""
    if (dest / "model.safetensors").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):
        if (folder / name).exists():
            shutil.copy2(folder / name, tmp / name)
    config = json.loads((tmp / "config.json").read_text())
    if not config.get("architectures"):
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        config["architectures"] = [arch[config.get("model_type", "llama")]]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(dest)
    return dest


# SmolLM2-1.7B's shape (its published config.json), randomly initialised: speed only, never acceptance
BIG_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-05, "max_position_embeddings": 8192,
    "rope_theta": 130000.0, "rope_scaling": None, "tie_word_embeddings": True, "mlp_bias": False,
    "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
BIG_SEED, BIG_STD = 0, 0.02


def big_folder() -> Path:
    """peers/models/big-1.7b: a Hugging Face folder of SmolLM2-1.7B's shape with SmolLM2's tokenizer,
    bfloat16 weights drawn once from N(0, 0.02) (seeded; norms 1), tied embeddings as SmolLM2-1.7B.
    Both engines read it: llama.cpp through its converter, ours directly."""
    from safetensors.torch import save_file

    folder = peers_dir() / "models" / "big-1.7b"
    if (folder / "model.safetensors").exists():
        return folder
    tokenizer_from = hf_folder(resolve_model("smollm2"))
    log(f"making {folder}: SmolLM2-1.7B's shape, random bfloat16 weights (seed {BIG_SEED})")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(tokenizer_from / name, tmp / name)
    (tmp / "config.json").write_text(json.dumps(BIG_CONFIG, indent=2) + "\n")
    c = BIG_CONFIG
    h, inter, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({pre + "self_attn.q_proj.weight": (h, h), pre + "self_attn.k_proj.weight": (kv, h),
                       pre + "self_attn.v_proj.weight": (kv, h), pre + "self_attn.o_proj.weight": (h, h),
                       pre + "mlp.gate_proj.weight": (inter, h), pre + "mlp.up_proj.weight": (inter, h),
                       pre + "mlp.down_proj.weight": (h, inter), pre + "input_layernorm.weight": (h,),
                       pre + "post_attention_layernorm.weight": (h,)})
    gen = torch.Generator().manual_seed(BIG_SEED)
    state = {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * BIG_STD
                    ).to(torch.bfloat16) for name, shape in shapes.items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(folder)
    return folder


def model_set(name: str) -> ModelSet:
    if name == "big":
        folder = big_folder()
        return ModelSet(name, folder, folder, None, None, True, None,
                        "none (random weights: speed only, acceptance not measured)", dtype="bfloat16",
                        reference="BF16")
    if name == "smollm2":
        folder = hf_folder(resolve_model("smollm2"))
        try:
            draft = default_draft("smollm2")
        except QuickdraftError:
            draft = None
        head = draft if draft is not None and is_eagle3_head(draft) else None
        draft = None if head is not None else draft
        status = (f"shipped ({draft})" if draft else "no smollm2 draft model shipped (llama.cpp has none either): "
                  "draft rows skipped")
        hf_draft = None if draft is None else draft if draft.is_dir() else hf_folder(draft)
        return ModelSet(name, folder, folder, draft, hf_draft, True, None, status, head,
                        shipped=resolve_model("smollm2"))
    target, draft = default_model_dirs()
    models = peers_dir() / "models"
    return ModelSet(name, target, converter_copy(target, models / "bundled-target-hf"), draft,
                    converter_copy(draft, models / "bundled-draft-hf"), False, "gpt-2", f"bundled ({draft})",
                    resolve_model("target-eagle3"))


# --- prompts ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str  # what llama.cpp is given (rendered chat template included)
    ids: list[int]  # what ours is given


def workload_prompts(models: ModelSet, tokenizer: Tokenizer, workloads: list[str], n: int) -> dict[str, list[Prompt]]:
    """quickdraft's own workloads: chat requests through the chat template for a chat model,
    raw text (function openings, editing) for the bundled code model."""
    docs = load_corpus(None).heldout
    out: dict[str, list[Prompt]] = {}
    for w in workloads:
        if models.chat:
            conversations = (chat_requests(n) if w == "chat" else code_requests(n) if w == "code"
                             else [e.messages for e in editing_requests(docs, n)])
            texts = [tokenizer.apply_chat_template(c) for c in conversations]
            out[w] = [Prompt(t, tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        else:
            texts = code_completion(docs, n) if w == "code" else [e.text for e in editing(docs, n)]
            out[w] = [Prompt(t, tokenizer.encode(t)) for t in texts]
    return out


PREFILL_TOKENS = 512  # the prompt of a prefill block
PREFILL_NEW_TOKENS = 1  # what a prefill block generates: the prompt phase is what it times
LONG_TOKENS = 3000  # the prompt of a long block (decoding deep in a context)


def prefill_prompts(models: ModelSet, tokenizer: Tokenizer, n: int, length: int = PREFILL_TOKENS) -> list[Prompt]:
    """`n` raw-text prompts of exactly `length` token ids (BOS included where the model adds one):
    consecutive stretches of held-out source files, cut where the text gives back the ids."""
    text = "\n\n".join(t for _, t in load_corpus(None).heldout)
    bos = not models.chat  # the chat models' vocabulary adds no BOS (in either engine)
    ids = tokenizer.encode(text, add_special_tokens=False)
    out, start = [], 0
    while len(out) < n:
        if start + 2 * length > len(ids):
            raise QuickdraftError(f"the held-out corpus has too few tokens for {n} prefill prompts")
        for cut in sorted(range(length - 16, length + 16), key=lambda c: abs(c - length)):
            piece = tokenizer.decode(ids[start:start + cut])
            got = tokenizer.encode(piece, add_special_tokens=bos)
            if len(got) == length:
                out.append(Prompt(piece, got))
                start += 2 * length
                break
        else:
            start += 1  # (merges at the cut skip `length` here: the next start)
    return out


_VERBOSE_TOKEN = re.compile(r"^(?:\S+ I )?\s*(\d+) -> '", re.M)


def peer_prompt_ids(llama: LlamaCpp, gguf: Path, text: str) -> list[int]:
    """The token ids llama-completion makes of `text` (its --verbose-prompt listing)."""
    proc = run_cmd([llama.exe("llama-completion"), "-m", str(gguf), "-p", text, "-n", "1", "-t", "1",
                    "--temp", "0", "-no-cnv", "--no-escape", "--no-warmup", "--verbose-prompt",
                    "-c", "4096"], "llama-completion --verbose-prompt")
    err = proc.stderr.decode("utf-8", "replace")
    m = re.search(r"number of tokens in prompt = (\d+)", err)
    if m is None:
        raise QuickdraftError("llama-completion printed no prompt tokens")
    ids = [int(x) for x in _VERBOSE_TOKEN.findall(err[m.end():])]
    return ids[: int(m.group(1))]


# --- engines ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """One prompt on one engine."""

    prompt_s: float  # prompt processing (ours: prefill and the first token)
    decode_tokens: int
    decode_s: float
    text: str  # the generated text (llama.cpp's as printed; ours decoded, cut at a special token)
    extra: dict
    prompt_tokens: int = 0  # the prompt's tokens (what the prompt phase processed)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


class Ours:
    def __init__(self, llm: LLM, special_ids: set[int]):
        self.llm, self.special_ids = llm, special_ids
        self.bytes_per_token = bytes_read_per_token(llm.engine.target)  # the target's weights, one step

    def run(self, prompt: Prompt, n: int) -> Run:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        first = final = None
        for out in self.llm.stream(prompt.ids, params):
            if first is None:
                first = time.perf_counter()
            if out.finished:
                final = out
        end = time.perf_counter()
        ids = list(final.token_ids)
        cut = next((i for i, t in enumerate(ids) if t in self.special_ids), len(ids))
        text = self.llm.tokenizer.decode(ids[:cut]).rstrip("\ufffd")  # an unfinished character at the end
        s = final.stats
        extra = {"tokens": len(ids), "steps": s.num_steps, "tokens_per_step": s.tokens_per_step,
                 "special_token_at": None if cut == len(ids) else cut}
        if s.num_draft_tokens:
            extra["acceptance_rate"] = s.acceptance_rate
        return Run(first - start, len(ids) - 1, end - first, text, extra, len(prompt.ids))


_PERF = re.compile(r"(prompt eval time|eval time|sampling time) =\s+([\d.]+) ms(?: /\s+(\d+))?")
_SPEC = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNTS = re.compile(r"(n_drafted|n_accept|n_predict)\s+= (\d+)")


class Peer:
    """One llama.cpp binary on one GGUF (and draft), run as a fresh process per prompt."""

    def __init__(self, llama: LlamaCpp, binary: str, gguf: Path, flags: list[str], draft: Path | None = None):
        self.llama, self.binary, self.gguf, self.flags, self.draft = llama, binary, gguf, flags, draft

    def command(self, prompt: Prompt, n: int, threads: int) -> list[str]:
        cmd = [self.llama.exe(self.binary), "-m", str(self.gguf), "-p", prompt.text, "-n", str(n),
               "-t", str(threads), "-tb", str(threads), "-c", str(len(prompt.ids) + n + 64),
               "--temp", "0", "--seed", "0", "--ignore-eos", "--no-escape", "--perf", *self.flags]
        if self.draft is not None:
            cmd += ["-md", str(self.draft)]
        return cmd

    def describe(self) -> str:
        """The command line with the per-prompt parts as placeholders."""
        draft = f" -md {self.draft.name}" if self.draft else ""
        return (f"{self.binary} -m {self.gguf.name}{draft} -p PROMPT -n N -t T -tb T -c (PROMPT+N+64) --temp 0 "
                f"--seed 0 --ignore-eos --no-escape --perf {' '.join(self.flags)}").strip()

    def run(self, prompt: Prompt, n: int, threads: int) -> Run:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        start = time.perf_counter()
        proc = run_cmd(self.command(prompt, n, threads), self.binary, env=env, timeout=PEER_TIMEOUT_S)
        wall = time.perf_counter() - start
        out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
        extra: dict = {"process_s": wall}
        if self.binary == "llama-completion":
            perf = {m.group(1): (float(m.group(2)), int(m.group(3) or 0)) for m in _PERF.finditer(err)}
            if not {"prompt eval time", "eval time", "sampling time"} <= perf.keys():
                raise PeerFailed(f"{self.binary} printed no timings (exit {proc.returncode}): {err[-300:]!r}")
            (p_ms, p_tokens), (e_ms, runs), (s_ms, _) = (perf["prompt eval time"], perf["eval time"],
                                                          perf["sampling time"])
            extra.update({"eval_ms": e_ms, "sampling_ms": s_ms,
                          "eval_only_tokens_per_s": runs / e_ms * 1e3 if e_ms > 0 else None})
            return Run(p_ms / 1e3, runs, (e_ms + s_ms) / 1e3, out, extra, p_tokens)
        phases = {m.group(1): (int(m.group(2)), float(m.group(3))) for m in _SPEC.finditer(err)}
        counts = {k: int(v) for k, v in _COUNTS.findall(err)}
        extra.update(counts)
        if counts.get("n_drafted"):
            extra["acceptance_rate"] = counts["n_accept"] / counts["n_drafted"]
        at = out.find(prompt.text)  # stdout: the prompt as detokenised pieces, then the output
        text = out[at + len(prompt.text):] if at >= 0 else ""
        extra["prompt_echo_found"] = at >= 0
        (dec_tokens, dec_s), (enc_tokens, enc_s) = phases["decoded"], phases["encoded"]
        return Run(enc_s, dec_tokens, dec_s, text, extra, enc_tokens)


def same_output(ours: Run, peer: Run) -> tuple[bool, int]:
    """(llama.cpp's text starts with ours, length of their common prefix in characters).
    Ours is cut at its first special token: llama.cpp never samples one (--ignore-eos)."""
    a, b = ours.text, peer.text
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return b.startswith(a), common


# --- configurations -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
    """One comparison: how ours is built and which llama.cpp binary, GGUF and flags it meets."""

    name: str
    ours: dict  # LLM keyword arguments
    peer: str  # binary
    gguf: str  # GGUF kind of the target
    flags: tuple[str, ...] = ()
    draft: bool = False  # uses the model's draft (F32 GGUF for llama.cpp)
    head: bool = False  # ours uses the model's EAGLE-3 head (llama.cpp has no EAGLE-3 on CPU builds)
    workloads: tuple[str, ...] | None = None  # None: all of the model's
    needs: str | None = None  # a quantization quickdraft must offer
    reference: bool = False  # ours in the model's reference dtype, llama.cpp on its reference GGUF
    prefill: bool = False  # times the prompt phase of PREFILL_TOKENS-token prompts, not decoding
    long: bool = False  # decodes after a LONG_TOKENS-token prompt (workload "long")
    shipped: bool = False  # both engines load the GGUF file as shipped; ours with its defaults
    same_gguf: bool = False  # both engines load llama.cpp's GGUF of kind `gguf`; ours with its defaults
    int4_super: bool = False  # ours packs int4 in the kernel's super-block layout (quant.INT4_SUPER_BLOCKS)

    def resolved(self, models: ModelSet) -> tuple[dict, str]:
        """(ours' LLM keyword arguments, llama.cpp's GGUF kind) for this model."""
        if self.reference:
            return {"dtype": models.dtype, **self.ours}, models.reference
        return dict(self.ours), self.gguf


PLAIN_FLAGS = ("-no-cnv", "--no-display-prompt")
CONFIGS = {c.name: c for c in [
    Config("f32", {"dtype": "float32"}, "llama-completion", "F32", PLAIN_FLAGS),
    Config("bf16", {"dtype": "bfloat16"}, "llama-completion", "BF16", PLAIN_FLAGS),
    Config("bf16-q8_0", {"dtype": "bfloat16"}, "llama-completion", "Q8_0", PLAIN_FLAGS),
    Config("int8-q8_0", {"dtype": "float32", "quantization": "int8"}, "llama-completion", "Q8_0", PLAIN_FLAGS,
           needs="int8"),
    Config("int4-q4_0", {"dtype": "float32", "quantization": "int4"}, "llama-completion", "Q4_0", PLAIN_FLAGS,
           needs="int4"),
    Config("int4-q4_k_m", {"dtype": "float32", "quantization": "int4"}, "llama-completion", "Q4_K_M",
           PLAIN_FLAGS, needs="int4"),
    # int4 in the kernel's super-block layout (4.625 bits a weight, against the float16 layout's 5; not the default)
    Config("int4-super-q4_0", {"dtype": "float32", "quantization": "int4"}, "llama-completion", "Q4_0", PLAIN_FLAGS,
           needs="int4", int4_super=True),
    # prefill: the model's reference weights (f32 / bf16), int8 vs Q8_0, int4 vs Q4_0
    Config("prefill", {}, "llama-completion", "", PLAIN_FLAGS, reference=True, prefill=True),
    Config("prefill-int8-q8_0", {"dtype": "float32", "quantization": "int8"}, "llama-completion", "Q8_0",
           PLAIN_FLAGS, needs="int8", prefill=True),
    Config("prefill-int4-q4_0", {"dtype": "float32", "quantization": "int4"}, "llama-completion", "Q4_0",
           PLAIN_FLAGS, needs="int4", prefill=True),
    # the file as users get it (SmolLM2's Q4_1 GGUF), ours on its defaults: what `--target smollm2` runs
    Config("shipped", {}, "llama-completion", "shipped", PLAIN_FLAGS, shipped=True),
    Config("prefill-shipped", {}, "llama-completion", "shipped", PLAIN_FLAGS, shipped=True, prefill=True),
    # decoding deep in a long prompt: ours on its defaults (a float16 cache: llama.cpp's default), with a float32 one
    Config("long-shipped", {}, "llama-completion", "shipped", PLAIN_FLAGS, shipped=True, long=True),
    Config("long-shipped-f32kv", {"kv_cache_dtype": "float32"}, "llama-completion", "shipped", PLAIN_FLAGS,
           shipped=True, long=True),
    Config("long-shipped-f16kv", {"kv_cache_dtype": "float16"}, "llama-completion", "shipped", PLAIN_FLAGS,
           shipped=True, long=True),
    # one file for both: llama.cpp's Q4_0 GGUF (ours runs its 4-bit blocks as they are)
    Config("gguf-q4_0", {}, "llama-completion", "Q4_0", PLAIN_FLAGS, same_gguf=True),
    Config("prefill-gguf-q4_0", {}, "llama-completion", "Q4_0", PLAIN_FLAGS, same_gguf=True, prefill=True),
    Config("gguf-q4_k_m", {}, "llama-completion", "Q4_K_M", PLAIN_FLAGS, same_gguf=True),
    Config("ngram", {"dtype": "float32", "method": "ngram", "num_speculative_tokens": 8}, "llama-lookup", "F32",
           ("--spec-draft-n-max", "8")),
    Config("suffix", {"dtype": "float32", "method": "suffix", "num_speculative_tokens": 8,
                      "spec_options": {"global_max_tokens": 0}}, "llama-lookup", "F32",
           ("--spec-draft-n-max", "8")),
    *[Config(f"draft-k{k}", {"dtype": "float32", "method": "draft", "num_speculative_tokens": k},
             "llama-speculative-simple", "F32",
             ("--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
              "--spec-draft-p-min", "0"), draft=True)
      for k in (3, 5)],
    # EAGLE-3 (ours only): against llama.cpp's plain decoding and its prompt lookup, its best
    # methods for a model with no draft model (SmolLM2) and those the chat bar compares with
    *[Config(f"eagle3-k{k}{suffix}", {"dtype": "float32", "method": "eagle3", "num_speculative_tokens": k},
             peer, "F32", flags, head=True, workloads=("chat", "code"))
      for k in (1, 3) for suffix, peer, flags in (("", "llama-completion", PLAIN_FLAGS),
                                                ("-vs-lookup", "llama-lookup", ("--spec-draft-n-max", "8")))],
    *[Config(f"eagle3-tree{w}x{n}", {"dtype": "float32", "method": "eagle3", "num_speculative_tokens": 4,
                                      "spec_options": {"tree_width": w, "tree_nodes": n}},
             "llama-completion", "F32", PLAIN_FLAGS, head=True, workloads=("chat", "code"))
      for w, n in ((3, 8),)],
]}


def skip_reason(config: Config, models: ModelSet) -> str | None:
    if not config.reference and config.gguf == "F32" and models.reference != "F32":
        return (f"float32 is not run on this model (its reference weights are {models.dtype}: configuration "
                f"bf16; prefill)")
    if config.needs and config.needs not in QUANTIZATIONS:
        return f"quickdraft has no quantization={config.needs!r} yet (offers {', '.join(QUANTIZATIONS)})"
    if config.draft and models.draft is None:
        return models.draft_status
    if config.head and models.head is None:
        return "no EAGLE-3 head shipped for this model"
    if config.shipped and models.shipped is None:
        return "no GGUF file shipped for this model (it is made here from its reference weights)"
    return None


# --- measuring ----------------------------------------------------------------------------------

def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def summarise(runs: list[Run], prefill: bool = False) -> dict:
    """One repeat of a block: decode rate over all its prompts (prefill: prompt tokens over prompt
    seconds), prompt seconds summed."""
    tokens, secs = sum(r.decode_tokens for r in runs), sum(r.decode_s for r in runs)
    p_tokens, p_secs = sum(r.prompt_tokens for r in runs), sum(r.prompt_s for r in runs)
    rate = p_tokens / p_secs if prefill else tokens / secs if secs else 0.0
    out = {"decode_tokens": tokens, "decode_s": secs, "tokens_per_s": rate, "prompt_tokens": p_tokens,
           "prompt_s": p_secs}
    rates = [r.extra["acceptance_rate"] for r in runs if "acceptance_rate" in r.extra]
    if rates:
        out["acceptance_rate"] = statistics.mean(rates)
    return out


class PeerFailed(RuntimeError):
    """A llama.cpp run that gave no timings (crashed or printed something else)."""


def roofline(ours: Ours) -> dict:
    """This thread count's read bandwidth (the best of three probes over 1 GiB) and the least
    time a token of plain decoding can take: the target's weight bytes per step over it."""
    bw = max(read_bandwidth(3).values())
    return {"read_GBps": bw / 1e9, "bytes_per_token": ours.bytes_per_token,
            "min_ms_per_token": ours.bytes_per_token / bw * 1e3}


def run_block(ours: Ours, peer: Peer, prompts: list[Prompt], n: int, threads: int, repeats: int,
              prefill: bool = False) -> dict:
    """Paired repeats of one block. Decode blocks time the tokens after the first; prefill blocks
    (n = PREFILL_NEW_TOKENS) the prompt phase: ours the first `LLM.stream` step, llama.cpp its
    prompt eval time."""
    set_threads(threads)
    roof = None if prefill else roofline(ours)  # (a prefill is compute-bound: no weight-streaming bound)
    ours.run(prompts[0], min(n, 64))  # warm-up: one-time costs, and AMX units ramp up over ~100 tokens
    load_before, cpu0, t0 = os.getloadavg()[0], cpu_seconds(), time.perf_counter()
    reps: list[dict] = []
    identical: list[list[bool]] = []
    common: list[list[int]] = []
    for r in range(repeats):
        got: dict[str, list[Run]] = {"ours": [], "peer": []}
        for p in prompts:
            order = ("ours", "peer") if r % 2 == 0 else ("peer", "ours")
            for who in order:
                got[who].append(ours.run(p, n) if who == "ours" else peer.run(p, n, threads))
        checks = [same_output(a, b) for a, b in zip(got["ours"], got["peer"])]
        identical.append([c[0] for c in checks])
        common.append([c[1] for c in checks])
        o, q = summarise(got["ours"], prefill), summarise(got["peer"], prefill)
        reps.append({"ours": o, "peer": q, "ratio": o["tokens_per_s"] / q["tokens_per_s"],
                     "identical": identical[-1], "common_prefix_chars": common[-1],
                     "ours_runs": [dataclasses.asdict(x) for x in got["ours"]],
                     "peer_runs": [dataclasses.asdict(x) for x in got["peer"]]})
        log(f"      repeat {r + 1}/{repeats}: ours {o['tokens_per_s']:.1f} tok/s, llama.cpp "
            f"{q['tokens_per_s']:.1f} tok/s, ratio {reps[-1]['ratio']:.2f}, identical "
            f"{sum(identical[-1])}/{len(prompts)}")
    wall = time.perf_counter() - t0

    def med(who: str, key: str) -> float | None:
        values = [x[who][key] for x in reps if x[who].get(key) is not None]
        return statistics.median(values) if values else None

    ratios = [x["ratio"] for x in reps]
    if roof is not None:  # shares of the roofline's tokens/s (above 1: cache-resident or speculative)
        roof["ours_share"], roof["peer_share"] = (
            None if med(who, "tokens_per_s") is None else med(who, "tokens_per_s") * roof["min_ms_per_token"] / 1e3
            for who in ("ours", "peer"))
    return {
        "measures": "prefill" if prefill else "decode", "roofline": roof,
        "ours_tokens_per_s": med("ours", "tokens_per_s"), "peer_tokens_per_s": med("peer", "tokens_per_s"),
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "ours_prompt_s": med("ours", "prompt_s"), "peer_prompt_s": med("peer", "prompt_s"),
        "ours_acceptance_rate": med("ours", "acceptance_rate"), "peer_acceptance_rate": med("peer", "acceptance_rate"),
        "identical_prompts_min": min(sum(x) for x in identical), "prompts": len(prompts),
        "common_prefix_chars_min": min(min(c) for c in common),
        "seconds": wall, "repeats": reps,
        "machine": {"loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
                    "other_cpu_share": other_cpu_share(cpu0, cpu_seconds(), wall)},
    }


def special_token_ids(folder: Path) -> set[int]:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    return {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}


def check_prompt_ids(models: ModelSet, llama: LlamaCpp, prompts: dict[str, list[Prompt]]) -> dict:
    """Fail unless llama.cpp makes of every prompt's text the very token ids ours is given."""
    gguf = models.gguf(llama, models.reference)
    checked = {}
    for w, ps in prompts.items():
        for i, p in enumerate(ps):
            theirs = peer_prompt_ids(llama, gguf, p.text)
            checked[f"{w}[{i}]"] = {"tokens": len(p.ids), "llama_cpp_tokens": len(theirs), "same_ids": theirs == p.ids}
            if theirs != p.ids:
                raise QuickdraftError(f"{models.name} {w} prompt {i}: llama.cpp tokenises it differently "
                                      f"({len(theirs)} vs {len(p.ids)} tokens)")
    log(f"{models.name}: prompt token ids identical in both engines for all {len(checked)} prompts")
    return checked


def benchmark_model(name: str, llama: LlamaCpp, args) -> dict:
    """Every configuration asked for, at every thread count, on every workload it applies to."""
    models = model_set(name)
    tokenizer = Tokenizer(models.hf_target)
    workloads = [w for w in args.workloads or WORKLOADS[name] if w in WORKLOADS[name]]
    asked = [CONFIGS[c] for c in args.configs]
    prompts = workload_prompts(models, tokenizer, workloads if any(not (c.prefill or c.long) for c in asked) else [],
                               args.prompts)
    if any(c.prefill for c in asked):
        prompts["prefill"] = prefill_prompts(models, tokenizer, args.prompts)
    if any(c.long for c in asked):
        prompts["long"] = prefill_prompts(models, tokenizer, args.prompts, LONG_TOKENS)
    log(f"{name}: " + ", ".join(f"{w} {len(p)} prompts ({', '.join(str(len(x.ids)) for x in p)} tokens)"
                                for w, p in prompts.items()))
    checked = check_prompt_ids(models, llama, prompts)
    system_info = llama.system_info(models.gguf(llama, models.reference))

    blocks, skipped, peer_commands, loads = [], {}, {}, {}
    special = special_token_ids(models.hf_target)
    for cname in args.configs:
        config = CONFIGS[cname]
        reason = skip_reason(config, models)
        if reason:
            log(f"{name} {cname}: skipped ({reason})")
            skipped[cname] = reason
            continue
        block_workloads = (["prefill"] if config.prefill else ["long"] if config.long
                           else [w for w in config.workloads or workloads if w in prompts])
        if not block_workloads:
            continue
        draft_gguf = models.gguf(llama, "F32", draft=True) if config.draft else None
        ours_kwargs, gguf_kind = config.resolved(models)
        peer_file = models.shipped if config.shipped else models.gguf(llama, gguf_kind)
        peer = Peer(llama, config.peer, peer_file, list(config.flags), draft_gguf)
        kwargs = {"device": "cpu", "method": "none", "compile": COMPILE_MODES[args.compile], **ours_kwargs}
        try:
            load_threads = max(args.threads)  # every configuration loads at the same thread count
            set_threads(load_threads)
            started = time.perf_counter()
            draft = models.draft if config.draft else models.head if config.head else None
            target = peer_file if config.shipped or config.same_gguf else models.target
            with quant.int4_super_blocks(config.int4_super):
                llm = LLM(target, draft=draft, **kwargs, policy="fixed")
            load_s = time.perf_counter() - started
        except (QuickdraftError, RuntimeError, NotImplementedError) as exc:  # e.g. a kernel this CPU lacks
            log(f"{name} {cname}: skipped (quickdraft could not load it: {exc})")
            skipped[cname] = f"quickdraft could not load it: {exc}"
            continue
        ours = Ours(llm, special)
        first = prompts[block_workloads[0]][0]
        first_s = ours.run(first, 1).prompt_s  # the first request after loading: one-time costs included
        loads[cname] = {"load_s": load_s, "first_token_s": first_s, "time_to_first_token_s": load_s + first_s,
                        "first_prompt_tokens": len(first.ids), "threads": load_threads,
                        "steps": type(llm.engine._forward).__name__, "ours": kwargs}
        log(f"{name} {cname}: LLM() {load_s:.1f} s ({load_threads} threads), then the first token of a "
            f"{len(first.ids)}-token prompt {first_s:.2f} s; steps: {type(llm.engine._forward).__name__}")
        peer_commands[cname] = peer.describe()
        for threads in args.threads:
            for w in block_workloads:
                log(f"  {name} {cname}, {w}, {threads} thread(s):")
                try:
                    n = PREFILL_NEW_TOKENS if config.prefill else args.new_tokens
                    b = run_block(ours, peer, prompts[w], n, threads, args.repeats, config.prefill)
                except (PeerFailed, QuickdraftError) as exc:  # a failed llama.cpp run loses its block, not the run
                    log(f"    failed: {exc}")
                    skipped[f"{cname} {w} {threads} thread(s)"] = str(exc)
                    continue
                blocks.append({"config": cname, "workload": w, "threads": threads, "ours": kwargs,
                               "ours_steps": type(llm.engine._forward).__name__,
                               "peer_command": peer.describe(), **b})
                log(f"    median: ours {b['ours_tokens_per_s']:.1f} tok/s, llama.cpp {b['peer_tokens_per_s']:.1f} "
                    f"tok/s, ours/llama.cpp {b['ratio_median']:.2f}x")
        del llm, ours
    return {"model": name, "target": str(models.target), "llama_cpp_models": str(peers_dir() / "models"),
            "draft": models.draft_status, "prompt_check": checked, "peer_commands": peer_commands,
            "skipped": skipped, "loads": loads, "llama_cpp_system_info": system_info, "blocks": blocks}


# --- report -------------------------------------------------------------------------------------

def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def markdown(result: dict, model: dict) -> list[str]:
    s, h = result["setup"], result["hardware"]
    md = [f"# quickdraft vs llama.cpp, {model['model']} ({h['cpu_model']})", "",
          *([provenance_line(result["provenance"]), ""] if "provenance" in result else []),
          f"{result['date']}. llama.cpp {result['llama_cpp']['version']} (vendored in llama-cpp-python=="
          f"{LLAMA_CPP_PYTHON}, built with {' '.join(result['llama_cpp']['cmake_flags'])}). Batch 1, greedy, "
          f"{s['new_tokens']} new tokens (eos ignored), {s['prompts']} prompt(s) per workload, {s['repeats']} "
          f"repeats per block, ours "
          f"and llama.cpp alternating first. tok/s: decode phase only, medians over repeats; ratio: median of "
          f"per-repeat ours/llama.cpp (min - max); prompt: median per repeat of the prompt-phase seconds summed "
          f"over prompts. Identical: prompts whose llama.cpp output starts with ours (ours cut at its first "
          f"special token), fewest over repeats. Draft: {model['draft']}. Prefill rows (workload prefill): "
          f"{PREFILL_TOKENS}-token prompts, tok/s = prompt tokens / prompt seconds (ours: the first `LLM.stream` "
          f"step, prefill and first token; llama.cpp: its prompt eval time).", "",
          *([isa_line(result, model), ""] if "isa" in result else []),
          "| configuration | workload | threads | ours tok/s | llama.cpp tok/s | ours / llama.cpp | identical | "
          "ours prompt ms | llama.cpp prompt ms | acceptance ours / llama.cpp | roofline ms/token "
          "(GB/s) | ours / llama.cpp, share of roofline | other CPU |",
          "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for b in model["blocks"]:
        acc = ""
        if b["ours_acceptance_rate"] is not None or b["peer_acceptance_rate"] is not None:
            acc = " / ".join("-" if x is None else f"{x:.2f}" for x in (b["ours_acceptance_rate"],
                                                                         b["peer_acceptance_rate"]))
        other = b["machine"]["other_cpu_share"]
        roof = b.get("roofline")  # (results before the roofline columns have none)
        roof_cols = "- | -" if roof is None else (
            f"{roof['min_ms_per_token']:.2f} ({roof['read_GBps']:.1f}) | "
            + " / ".join("-" if x is None else f"{x:.2f}" for x in (roof["ours_share"], roof["peer_share"])))
        md.append(f"| {b['config']} | {b['workload']} | {b['threads']} | {b['ours_tokens_per_s']:.1f} | "
                  f"{b['peer_tokens_per_s']:.1f} | {b['ratio_median']:.2f}x ({b['ratio_min']:.2f} - "
                  f"{b['ratio_max']:.2f}) | {b['identical_prompts_min']}/{b['prompts']} | {_ms(b['ours_prompt_s'])} | "
                  f"{_ms(b['peer_prompt_s'])} | {acc} | {roof_cols} | {'-' if other is None else f'{100 * other:.0f}%'} |")
    md.append("")
    if model.get("loads"):
        md += ["Loading (ours, before any block: `LLM(folder, ...)` wall time, then the first request's "
               "prompt phase, one-time costs included):", "",
               "| configuration | LLM() s | first token s (prompt tokens) | time to first token s | threads | steps |",
               "|---|---:|---:|---:|---:|---|"]
        md += [f"| {c} | {x['load_s']:.1f} | {x['first_token_s']:.2f} ({x['first_prompt_tokens']}) | "
               f"{x['time_to_first_token_s']:.1f} | {x['threads']} | {x['steps']} |" for c, x in model["loads"].items()]
        md.append("")
    for cname, reason in model["skipped"].items():
        md.append(f"- {cname}: skipped, {reason}.")
    md += ["", "llama.cpp command per configuration:", ""]
    md += [f"- {c}: `{cmd}`" for c, cmd in model["peer_commands"].items()]
    load = (f"; load average {h['loadavg_1m_before']:.2f} before, {h['loadavg_1m_after']:.2f} after"
            if "loadavg_1m_before" in h else "")  # (newer results: in the provenance line)
    md += ["", f"Hardware: {h['cpu_model']}, {h['logical_cores']} logical cores{load}. torch "
           f"{result['software']['torch']}, Python {result['software']['python']}. 'other CPU': CPU time of other "
           f"processes during the block, as "
           f"a share of all cores (above ~10% the timings are unreliable). Roofline: the target's weight "
           f"bytes one plain decoding step reads (quickdraft's format for the configuration) over this thread "
           f"count's read bandwidth, measured before the block (1 GiB, best of sum / dot / mv); share = "
           f"tokens/s x that time, so 1.0 is the memory bound. A model that fits in the CPU's caches can pass "
           f"it, and so does speculation (several tokens per step); llama.cpp's share uses the same bytes, "
           f"though its Q4_0 blocks are 10% smaller than our int4 and its Q8_0 blocks 6% larger than our int8.", "",
           f"Command: `{result['command']}`", ""]
    return md


def isa_line(result: dict, model: dict) -> str:
    isa, ours = result["isa"], result["isa"]["ours"]
    env = " ".join(f"{k}={v}" for k, v in ours["env"].items() if v is not None) or "no ISA variables"
    return (f"ISA (--isa {isa['asked']}): ours: quickdraft's kernels {ours['quickdraft_kernels']}, ATen "
            f"{ours['aten_cpu_capability']} ({env}); llama.cpp: the {isa['llama_cpp']} build, "
            f"`{model.get('llama_cpp_system_info', '?')}`.")


# --- main ---------------------------------------------------------------------------------------

def split_list(values: list[str] | None) -> list[str] | None:
    """Accept both `--x a b` and `--x a,b`."""
    return None if values is None else [v for x in values for v in x.split(",") if v]


def main() -> None:
    from quickdraft.bench.hardware import steady_steps

    steady_steps()  # no background AOT build switching the steps mid-measurement
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"of {', '.join(MODELS)} (default: {' '.join(DEFAULT_MODELS)}; big only when named)")
    ap.add_argument("--configs", nargs="+", default=None, help=f"of {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--workloads", nargs="+", default=None, help="of chat, code, editing (default: the model's)")
    ap.add_argument("--threads", nargs="+", default=None, help="thread counts, one block each (default 1 2)")
    ap.add_argument("--repeats", type=int, default=3, help="paired repeats per block (default 3)")
    ap.add_argument("--new-tokens", type=int, default=None, help="per prompt (default 256; --quick 64)")
    ap.add_argument("--prompts", type=int, default=None, help="per workload (default 3; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="1 prompt per workload, 64 new tokens")
    ap.add_argument("--compile", choices=sorted(COMPILE_MODES), default="aot",
                    help="our steps: aot = ahead-of-time compiled CPU steps, built once (not timed) and cached "
                         "(default); auto = the cached ones if built; off = eager")
    ap.add_argument("--isa", choices=ISAS, default="native",
                    help="native: all this CPU has (default); avx2: both engines as on an AVX2 + FMA CPU without "
                         "AVX-512 (llama.cpp: its build-avx2 build; ours: " + " ".join(f"{k}={v}" for k, v in ISA_ENV["avx2"].items())
                         + "); results go to llamacpp_<model>_cpu_avx2.*")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results",
                    help="where llamacpp_<model>_cpu.json and .md go (default benchmarks/results)")
    args = ap.parse_args()
    args.models = split_list(args.models) or list(DEFAULT_MODELS)
    args.configs = split_list(args.configs) or list(CONFIGS)
    args.workloads = split_list(args.workloads)
    args.threads = [int(t) for t in split_list(args.threads) or ["1", "2"]]
    args.new_tokens = args.new_tokens or (64 if args.quick else 256)
    args.prompts = args.prompts or (1 if args.quick else 3)
    for flag, values, known in (("--models", args.models, MODELS), ("--configs", args.configs, CONFIGS),
                                ("--workloads", args.workloads or [], ("chat", "code", "editing"))):
        unknown = [v for v in values if v not in known]
        if unknown:
            ap.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if min(args.repeats, args.new_tokens, args.prompts, *args.threads) < 1:
        ap.error("--repeats, --new-tokens, --prompts and --threads must be >= 1")
    force_isa(args.isa)

    started, load_before = time.perf_counter(), loadavg()
    try:
        ours = ours_isa(args.isa)
        llama = ensure_llama_cpp(args.isa)
        log(f"llama.cpp: {llama.build} ({llama.version()}); ours: {ours}")
        results = [benchmark_model(m, llama, args) for m in args.models]
    except QuickdraftError as exc:
        sys.exit(f"error: {exc}")
    common = {
        "benchmark": "llamacpp",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/llamacpp.py " + shlex.join(sys.argv[1:]),
        "llama_cpp": {"llama_cpp_python_sdist": LLAMA_CPP_PYTHON, "version": llama.version(), "root": str(llama.root),
                      "build": str(llama.build), "cmake_flags": list(llama.cmake_flags)},
        "isa": {"asked": args.isa, "ours": ours, "llama_cpp": llama.isa},
        "setup": {"threads": args.threads, "repeats": args.repeats, "new_tokens": args.new_tokens,
                  "prompts": args.prompts, "quick": args.quick, "batch": 1, "temperature": 0, "ignore_eos": True},
        "hardware": {"device": "cpu", "cpu_model": cpu_model(), "logical_cores": os.cpu_count()},
        "provenance": provenance("cpu", args.threads, load_before=load_before),
        "software": {"python": platform.python_version(), "torch": torch.__version__},
        "seconds": time.perf_counter() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for model in results:
        stem = args.out_dir / f"llamacpp_{model['model']}_cpu{'' if args.isa == 'native' else '_' + args.isa}"
        result = {**common, **model}
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        md = markdown(result, model)
        stem.with_suffix(".md").write_text("\n".join(md))
        print("\n".join(md))
        log(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
