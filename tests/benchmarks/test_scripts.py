"""Every benchmark script runs against the current API: each one on a tiny setting, as a
subprocess (the way people run them), writing into a temporary folder; it must exit 0 and every
result file it writes must carry the provenance record (quickdraft.bench.hardware.provenance:
"provenance" in JSON, the "Provenance: commit ..." line in markdown and text). No run may write
into benchmarks/results.

Scripts that need what a fast test cannot have are marked slow: replicas.sh starts Ray Serve,
serve.py servers, tensor_parallel.py process groups. Two are not run here at all (`run=None`, with
the reason): llamacpp.py builds llama.cpp from source (about 10 minutes on 2 cores, too long for
CI's 30 minutes), and real_model.py's quick run is tests/bench/test_real_model.py's. Every
slow or unrun script runs `--help` in the fast set, which imports everything it imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"


def _same_perplexity_through_a_float32_cache(out: Path) -> None:
    """A float32 KV cache filled in chunks scores what one forward pass does; a float16 one is its own."""
    got = {line.split(" perplexity ")[0].split(None, 1)[1]: float(line.split(" perplexity ")[1].split()[0])
           for line in (out / "ppl.txt").read_text().splitlines() if " perplexity " in line and not line.startswith("#")}
    assert got["docs/*.md kv float32"] == got["docs/*.md"] and "docs/*.md kv float16" in got


@dataclass
class Case:
    args: list[str]  # after the script; {out} is the output folder, {profile} a tiny tune profile
    files: list[str]  # result files the run must write, relative to {out}
    marks: list = field(default_factory=list)
    timeout: float = 240
    check: object = None  # optional fn(out: Path) -> None with script-specific checks
    skip_run: str | None = None  # why the tiny run is not part of the suite (its --help still runs)


def _json(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def _check_cpu_kernels(out: Path) -> None:
    kernels = _json(out, "ck.json")["threads"]["1"]["kernels"]
    for name in ("f32 F.linear W[out,in]", "f32 quickdraft blocked_mm"):  # always there on x86 and ARM
        assert "error" not in kernels.get(name, {"error": "missing"}), (name, kernels.get(name))
    for name in ("int8 quickdraft blocked_mm_int8, f32 x", "int4 g32 quickdraft blocked_mm_int4, f32 x"):
        assert "error" not in kernels.get(name, {}), (name, kernels.get(name))  # (packed as the kernel wants)


def _check_gc_pause(out: Path) -> None:
    rows = _json(out, "gc.json")["rows"]
    loaded, frozen = rows["loaded"], rows["after freeze_heap"]
    assert frozen["frozen_objects"] >= loaded["tracked_objects"] > 10 * frozen["tracked_objects"]


def _check_sampling_cost(out: Path) -> None:
    result = _json(out, "sc.json")
    for name in ("final", "chain5", "verify_chain5", "verify_tree6"):
        assert all(result[f"{name}_B{b}_ms"] > 0 for b in (1, 2))
    assert 0 < result["sampled_over_greedy_B2"] < 10


def _check_kv_growth(out: Path) -> None:
    runs = _json(out, "kv.json")["runs"]
    assert set(runs) == {"reserved rows (view)", "no reservation (copy)", "target's rows reserved, the proposer's copied",
                         "reservation's bytes kept at a new capacity"}
    assert all(r["rows"][1] > r["rows"][0] for rs in runs.values() for r in rs)  # the admission grew the rows


def _check_default_pair(out: Path) -> None:
    runs = _json(out, "default_pair_cpu.json")["runs"]
    assert set(runs) == {"0.0", "0.8"} and runs["0.0"]["repeats"][0]["greedy_identical"] is True


def _check_eagle3(out: Path) -> None:
    blocks = _json(out, "eagle3_cpu.json")["blocks"]
    assert [b["temperature"] for b in blocks] == [0.0, 0.8]
    assert all(r["identical_to_plain"] for r in blocks[0]["rows"].values())


def _check_gpu_check(out: Path) -> None:
    data = _json(out, "gpu_check.json")
    for key in ("hardware", "bandwidth", "tune", "bench"):
        assert "error" not in data[key] and "skipped" not in data[key], (key, data[key])


def _check_multi_turn(data: dict) -> None:
    turns = data["servers"]["url"]["turns"]  # the server with prefix caching
    assert [t["turn"] for t in turns] == [1, 2] and all(t["completed"] == 1 for t in turns)
    assert turns[1]["cached_tokens"]["median"] >= 32  # the second turn reuses the first one's KV
    assert [p["same_text"] for p in data["paired"]["turns"]] == [1, 1]  # the uncached server answered alike


def _check_hybrid(data: dict) -> None:
    rows = data["models"]["bundled"]["workloads"]["code"]["rows"]
    assert set(rows) == {"plain", "suffix", "auto"} and all(r["identical"] for r in rows.values())


def _check_self_draft(data: dict) -> None:
    (row,) = data["bundled"]["formats"]["int4"]["rows"]
    assert row["k"] == 2 and row["identical"] and row["c"] > 0 and row["tokens_per_step"] >= 1


def _check_select_check(data: dict) -> None:
    rows = data["check"]["rows"]
    assert rows[0]["config"] == "plain" and len(rows) >= 2 and all(r["identical"] for r in rows)
    assert 0 < data["check"]["choice_over_best"] <= 1


def _check_first_command(data: dict) -> None:
    assert [r["example"] for r in data["runs"]] == ["code", "code, --quantization int8"]
    for run in data["runs"]:
        assert run["identical"] and run["tokens"] == 4 and run["speedup"] > 0 and run["tokens_per_s"] > 0
        assert run["steps"] == "eager"  # the tests build no AOT packages (QUICKDRAFT_AOT_BUILD=0)
    assert set(data["summary"]) == {"code", "code, --quantization int8"}


def _check_chunked_prefill(data: dict) -> None:
    (row,) = data["table"]
    assert row["max_num_batched_tokens"] == 16 and row["num_window"] > 0 and row["long_ttft_s"] > 0


def _check_attend_split(data: dict) -> None:
    """Both modes' tokens are the same (the split keeps every row's bits), and every row is timed."""
    decode = [r for r in data["rows"] if r["what"] == "decode"]
    assert [r["context"] for r in decode] == [40, 300] and all(r["identical"] for r in decode), decode
    assert all(r["auto_over_off"] > 0 for r in data["rows"])


def _check_mixed_steps(data: dict) -> None:
    steps = {(r["step"], r["chunk_tokens"], r["chunk_position"]) for r in data["table"]}
    assert steps == {("decode", 0, 0), ("chunk", 4, 0), ("chunk", 4, 40), ("mixed", 4, 0), ("mixed", 4, 40)}
    assert all(r["median_ms"] > 0 for r in data["table"])


def _check_structured(data: dict) -> None:
    rows = data["models"]["bundled"]["workloads"]["all"]
    assert rows["plain"]["valid"] == 1.0 and rows["suffix"]["identical_to_plain"] == rows["suffix"]["requests"] == 3


def _check_int4_layouts(out: Path) -> None:
    # the bundled target's 512-input layers take super-blocks, its 1408-input down projection the float16 layout
    data = _json(out, "il.json")
    assert 0.9 < data["bytes_per_token"]["super"] / data["bytes_per_token"]["float16"] < 1.0
    assert all(v > 0 for row in data["rows"] for v in row["tok_s"].values())


CASES: dict[str, Case] = {
    "ar_vs_transformers.py": Case(["--repeats", "1", "--warmup", "0", "--new-tokens", "4", "--prompt-len", "8",
                                   "--out-dir", "{out}"], ["ar_vs_transformers_cpu.json", "ar_vs_transformers_cpu.md"]),
    "ab_commits.py": Case(["--a", str(ROOT), "--b", str(ROOT), "--repeats", "1", "--tokens", "4", "--configs",
                           "bundled plain", "--out-dir", "{out}", "--name", "ab"], ["ab.json", "ab.md"]),
    "bundled_int8.py": Case(["--original", str(ROOT / "quickdraft" / "default_models"), "--tiny", "--repeats", "1",
                             "--out-dir", "{out}", "--name", "b8"], ["b8.json"]),
    "attention.py": Case(["--threads", "1", "--models", "bundled", "--keys", "16", "--rows", "1", "2", "--repeats", "1",
                          "--calls", "1", "--out", "{out}/attention.json"], ["attention.json"]),
    "attention_rows.py": Case(["--isas", "portable", "--keys", "16", "--rows", "1", "3", "--repeats", "1", "--calls", "1",
                               "--out", "{out}/attention_rows.json"], ["attention_rows.json"]),
    "blocked_rows.py": Case(["--tiny", "--out", "{out}/blocked_rows.txt"], ["blocked_rows.txt"]),
    "int4_layouts.py": Case(["--tiny", "--out-dir", "{out}", "--name", "il"], ["il.json", "il.md"],
                            check=_check_int4_layouts),
    "perplexity.py": Case(["--tiny", "--kv-cache-dtypes", "float32,float16", "--out", "{out}/ppl.txt"], ["ppl.txt"],
                          check=_same_perplexity_through_a_float32_cache),
    "blocked_vs_dense_rows.py": Case(["1", "--tiny", "--out", "{out}/bvd.txt"], ["bvd.txt"]),
    "compiled.py": Case(["--configs", "plain-eager", "draft-eager", "int8-draft-eager", "--prompts", "1",
                         "--new-tokens", "4", "--repeats", "1", "-k", "2", "--out-dir", "{out}"],
                        ["compiled_cpu.json", "compiled_cpu.md"]),
    "cpu_kernels.py": Case(["--tiny", "--threads", "1", "--repeats", "1", "--rows", "1", "4", "--out", "{out}/ck.json"],
                           ["ck.json", "ck.md"], check=_check_cpu_kernels),
    "default_pair.py": Case(["--prompts", "1", "--new-tokens", "4", "--repeats", "1", "--iters", "1", "-k", "2",
                             "--temperatures", "0", "0.8", "--out-dir", "{out}"],
                            ["default_pair_cpu.json", "default_pair_cpu.md"], check=_check_default_pair),
    "eagle3.py": Case(["--models", "bundled", "--threads", "1", "--ks", "2", "--trees", "2x4x2", "--draft-ks", "2",
                       "--temperatures", "0", "0.8", "--prompts", "1", "--new-tokens", "4", "--repeats", "1",
                       "--compile", "eager", "--out-dir", "{out}"], ["eagle3_cpu.json", "eagle3_cpu.md"],
                      check=_check_eagle3),
    "attend_split.py": Case(["--target", "bundled", "--compile", "eager", "--threads", "1", "--contexts", "40,300",
                             "--repeats", "2", "--calls", "3", "--new-tokens", "4", "--out-dir", "{out}", "--name", "as"],
                            ["as.json", "as.md"],
                            check=lambda out: _check_attend_split(_json(out, "as.json"))),
    "eagle3_parts.py": Case(["--model", "bundled", "--tiny", "--out", "{out}/parts.json"], ["parts.json"]),
    "kv_growth.py": Case(["--method", "draft", "--first", "16", "--repeats", "1", "--decoded", "8", "--out-dir", "{out}",
                          "--name", "kv"],
                         ["kv.json", "kv.md"],
                         check=_check_kv_growth),
    "sampling_cost.py": Case(["--batch", "1", "2", "--tokens", "4", "--model", str(ROOT / "quickdraft" / "default_models" / "target"),
                              "--out", "{out}/sc.json"], ["sc.json"], check=_check_sampling_cost),
    "gc_pause.py": Case(["--repeats", "1", "--out-dir", "{out}", "--name", "gc"], ["gc.json", "gc.md"],
                        check=_check_gc_pause),
    "gpu_check.py": Case(["--small", "--device", "cpu", "--parts", "abe", "--budget-s", "600", "--out", "{out}"],
                         ["gpu_check.json", "tune_default_pair.json", "bench_default_pair.json",
                          "bench_default_pair.md"], check=_check_gpu_check,
                         skip_run="tests/bench/test_gpu_check.py runs every part of it (--small on CPU)"),
    "llamacpp.py": Case(["--models", "bundled", "--configs", "f32", "--threads", "1", "--repeats", "1", "--prompts", "1",
                         "--new-tokens", "4", "--compile", "off", "--out-dir", "{out}"],
                        ["llamacpp_bundled_cpu.json", "llamacpp_bundled_cpu.md"], marks=[pytest.mark.slow],
                        skip_run="builds llama.cpp from source: about 10 minutes on 2 cores (run it by hand)",
                        timeout=3600),
    "multi_turn.py": Case(["--turns", "2", "--conversations", "1", "--system-words", "40", "--max-tokens", "4",
                           "--chat-template", str(BENCH / "plain_chat_template.jinja"),
                           "--method", "draft", "--out-dir", "{out}", "--name", "mt"], ["mt.json", "mt.md"],
                          check=lambda out: _check_multi_turn(_json(out, "mt.json"))),
    "hybrid.py": Case(["--models", "bundled", "--rows", "suffix", "auto", "--workloads", "code", "--prompts", "1",
                       "--repeats", "1", "--new-tokens", "4", "-k", "2", "--cores", "0", "--out-dir", "{out}",
                       "--name", "hy"], ["hy.json", "hy.md"], check=lambda out: _check_hybrid(_json(out, "hy.json"))),
    "self_draft.py": Case(["--model", "bundled", "--formats", "int4", "--ks", "2", "--prompts", "1", "--new-tokens",
                           "4", "--repeats", "1", "--iters", "1", "--cores", "0", "--out-dir", "{out}", "--name", "sd"],
                          ["sd.json", "sd.md"], check=lambda out: _check_self_draft(_json(out, "sd.json"))),
    "select_check.py": Case(["--target", "bundled", "--workload", "code", "--prompts", "1", "--max-tokens", "6",
                             "--ks", "2", "--select-repeats", "1", "--repeats", "1", "--top", "1", "--cores", "0",
                             "--out-dir", "{out}", "--name", "sc"], ["sc.json", "sc.md"],
                            check=lambda out: _check_select_check(_json(out, "sc.json"))),
    "first_command.py": Case(["--target", "bundled", "--method", "ngram", "--examples", "code", "--runs", "1",
                              "--max-tokens", "4", "--quantizations", "default", "int8", "--cores", "0", "--out-dir", "{out}",
                              "--name", "fc"],
                             ["fc.json", "fc.md"], check=lambda out: _check_first_command(_json(out, "fc.json"))),
    "chunked_prefill.py": Case(["--sizes", "16", "--repeats", "1", "--streams", "1", "--stream-tokens", "400",
                                "--long-tokens", "200", "--steady", "1", "--out-dir", "{out}", "--name", "cp"],
                               ["cp.json", "cp.md"], check=lambda out: _check_chunked_prefill(_json(out, "cp.json"))),
    "mixed_steps.py": Case(["--modes", "eager", "--rows", "2", "--context", "16", "--positions", "0,40",
                            "--chunks", "4", "--repeats", "1", "--out-dir", "{out}", "--name", "ms"], ["ms.json", "ms.md"],
                           check=lambda out: _check_mixed_steps(_json(out, "ms.json"))),
    "openai_fields.py": Case(["--baseline", "", "--models", "bundled", "--prompts", "1", "--new-tokens", "4",
                              "--repeats", "1", "--compile", "eager", "--out-dir", "{out}"],
                             ["openai_fields_cpu.json", "openai_fields_cpu.md"]),
    "peers.py": Case(["--prompts", "1", "--new-tokens", "4", "--repeats", "1", "--draft-k", "2", "--ngram-k", "2",
                      "--out-dir", "{out}"], ["peers_cpu.json", "peers_cpu.md"]),
    "penalty_acceptance.py": Case(["--prompts", "1", "--new-tokens", "4", "--temperatures", "0", "1",
                                   "--out", "{out}/penalty.json"], ["penalty.json"]),
    "policies.py": Case(["--profile", "{profile}", "--batch-sizes", "1", "2", "--fixed-k", "2", "-k", "2",
                         "--new-tokens", "4", "--repeats", "1", "--out-dir", "{out}"],
                        ["policies_cpu.json", "policies_cpu.md"]),
    "proposers.py": Case(["--prompts", "1", "--new-tokens", "4", "--repeats", "1", "--temperature", "0.8",
                          "--cost-context", "64", "--cost-iters", "2", "-k", "2", "--out-dir", "{out}"],
                         ["proposers_cpu.json", "proposers_cpu.md"]),
    "real_model.py": Case(["--quick", "--out-dir", "{out}", "--name", "rm"], ["rm.json", "rm.md"], marks=[pytest.mark.slow],
                          timeout=1800, skip_run="tests/bench/test_real_model.py runs its --quick setting"),
    "serve.py": Case(["--rates", "4", "--num-requests", "2", "--max-tokens", "4", "--warmup", "0", "--max-num-seqs", "2",
                      "--profile", "{profile}", "--out-dir", "{out}"], ["serve_cpu.json", "serve_cpu.md"],
                     marks=[pytest.mark.slow]),
    "small_m_gemm.py": Case(["--tiny", "--out", "{out}/small_m.json"], ["small_m.json"]),
    "structured.py": Case(["--models", "bundled", "--methods", "plain,suffix", "--extraction", "1", "--classification",
                           "1", "--tools", "1", "-k", "2", "--no-llamacpp", "--out", "{out}/st"], ["st.json", "st.md"],
                          check=lambda out: _check_structured(_json(out, "st.json"))),
    "grammar_engines.py": Case(["--repeats", "1", "--vocabularies", "smollm2-49k", "--out", "{out}/ge"],
                               ["ge.json", "ge.md"], marks=[pytest.mark.slow],
                               skip_run="needs SmolLM2's tokenizer (a download) and xgrammar in its own environment"),
    "tensor_parallel.py": Case(["--repeats", "1", "--iters", "1", "--new-tokens", "4", "--out-dir", "{out}"],
                               ["tensor_parallel_cpu.json", "tensor_parallel_cpu.md"], marks=[pytest.mark.slow]),
    "verify_cost.py": Case(["--model", "bundled", "--tiny", "--rounds", "1", "--out", "{out}/vc.json"], ["vc.json"]),
    "verify_table.py": Case(["--tiny", "--kernels", "--out", "{out}/vt.json"], ["vt.json", "vt.md"]),
    "kv_cache_dtype.py": Case(["--tiny", "--out", "{out}/kv.json"], ["kv.json", "kv.md"]),
    "replicas.sh": Case(["1", "{out}", "2", "4"],
                        ["one_engine-round1.json", "one_engine-round1.md", "two_replicas-round1.json",
                         "two_replicas-round1.md"], marks=[pytest.mark.slow], timeout=900),
}
# the scripts whose tiny run is marked slow: their imports and argument parsing still run fast
HELP_ONLY = sorted(name for name, c in CASES.items() if (c.marks or c.skip_run) and name.endswith(".py"))
RUN = [name for name, c in CASES.items() if not c.skip_run]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _command(script: str, args: list[str]) -> list[str]:
    path = BENCH / script
    return ["bash", str(path), *args] if script.endswith(".sh") else [sys.executable, str(path), *args]


def _results_snapshot() -> dict:
    return {p: p.stat().st_mtime_ns for p in RESULTS.rglob("*") if p.is_file()} if RESULTS.is_dir() else {}


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    """A tiny `quickdraft tune` profile of the bundled pair (policies.py and serve.py read one)."""
    from quickdraft.bench.tune import TuneConfig, tune

    path = tmp_path_factory.mktemp("profile") / "profile.json"
    tune(TuneConfig(methods=("draft",), k_max=2, batch_sizes=(1, 2), context=16, iters=1, num_prompts=1,
                    max_tokens=8, out=path))
    return path


def _assert_provenance(path: Path, script: str) -> None:
    if path.suffix == ".json":
        record = json.loads(path.read_text()).get("provenance")
        assert record is not None, f"{path.name} has no provenance record"
        assert record["commit"] and record["date"] and record["machine"]["cpu"], record
        assert record["machine"]["cores"] >= 1 and record["machine"]["threads"] and record["machine"]["torch"], record
        assert isinstance(record["machine"]["cpu_features"], list) and "loadavg_after" in record, record
        if script.endswith(".py"):
            assert script in record["command"], (script, record["command"])
    else:
        assert "Provenance: commit " in path.read_text(), f"{path.name} has no provenance line"


@pytest.mark.parametrize("script", [pytest.param(name, marks=CASES[name].marks) for name in RUN])
def test_script_runs_on_a_tiny_setting(script, tmp_path, request):
    case = CASES[script]
    if script == "replicas.sh":
        pytest.importorskip("ray")
    out = tmp_path / "out"
    out.mkdir()
    profile = request.getfixturevalue("profile") if any("{profile}" in a for a in case.args) else None
    args = [a.replace("{out}", str(out)).replace("{profile}", str(profile)) for a in case.args]
    before = _results_snapshot()
    run = subprocess.run(_command(script, args), cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=case.timeout)
    assert run.returncode == 0, f"{script} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert _results_snapshot() == before, f"{script} wrote into benchmarks/results"
    for name in case.files:
        assert (out / name).is_file(), f"{script} did not write {name}: {sorted(p.name for p in out.iterdir())}"
    written = [p for p in out.rglob("*") if p.suffix in (".json", ".md", ".txt") and not p.name.endswith(".log")
               and p.name != "load.txt"]
    for path in written:
        _assert_provenance(path, script)
    if case.check is not None:
        case.check(out)


@pytest.mark.parametrize("script", HELP_ONLY)
def test_slow_scripts_import_and_parse_arguments(script, tmp_path):
    run = subprocess.run(_command(script, ["--help"]), cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-3000:]


def test_every_script_has_a_case():
    scripts = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
    assert scripts == set(CASES), f"scripts without a tiny-setting case: {sorted(scripts - set(CASES))}; " \
                                  f"cases without a script: {sorted(set(CASES) - scripts)}"
