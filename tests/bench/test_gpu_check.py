"""benchmarks/gpu_check.py, the prepared device check, run with --small on CPU: every part
writes its figures (no part fails), and bad arguments are one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


@pytest.mark.slow
def test_gpu_check_small_on_cpu(tmp_path):
    r = _run("--small", "--device", "cpu", "--out", str(tmp_path), "--budget-s", "600")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    for key in ("hardware", "bandwidth", "random_target", "decode", "decode_compiled", "verify", "tune", "bench",
                "compiled_pair", "weight_formats", "aot_cpu"):
        assert "error" not in data[key] and "skipped" not in data[key], (key, data[key])
    assert data["small"] is True and data["device"] == "cpu"
    assert data["hardware"]["device"] == "cpu" and data["hardware"]["torch"]
    assert data["bandwidth"]["gb_per_s"] > 0
    d = data["decode"]
    assert d["dtype"] == "bfloat16" and d["ms_per_token"] > 0 and d["roofline_ms_per_token"] > 0
    assert 0 < d["fraction_of_roofline"] == pytest.approx(d["roofline_ms_per_token"] / d["ms_per_token"])
    assert d["weight_bytes_read_per_token"] < d["weight_bytes"] == 2 * d["parameters"]
    c = data["decode_compiled"]
    assert c["compiled"] is True and c["compile_fell_back"] is None and c["ms_per_token"] > 0
    assert set(data["compiled_pair"]) == {"plain-eager", "draft-eager", "int8-draft-eager"}
    formats = data["weight_formats"]["configs"]
    assert set(formats) == {"none-eager", "int8-eager", "int4-eager"}
    assert all(f["identical_to_plain"] and "error" not in f for f in formats.values()), formats
    assert "int4" in formats["int4-eager"]["format"] and "dequantised per call" not in formats["int4-eager"]["format"]
    a = data["aot_cpu"]
    assert a["identical"] and a["engine_step"] == "AOTStep" and a["build_s"] > 0 and a["model"] == "bundled draft"
    assert all(x["identical_to_plain"] for x in data["compiled_pair"].values())
    v = data["verify"]
    assert v["batch_sizes"] == [1, 2, 4] and v["query_lengths"] == [1, 2, 3, 4]
    assert len(v["ratio_to_q1"]) == 3 and all(len(row) == 4 and row[0] == 1.0 for row in v["ratio_to_q1"])
    assert all(t > 0 for row in v["target_step_s"] for t in row)
    t = data["tune"]
    assert set(t["best_k"]) == {"draft", "ngram"} and (tmp_path / "tune_default_pair.json").exists()
    b = data["bench"]
    assert {(x["method"], x["batch_size"], x["k"]) for x in b["runs"]} == {("draft", 1, 2), ("ngram", 1, 2)}
    assert (tmp_path / "bench_default_pair.md").exists()
    # transformers runs in this test environment: peers ran and wrote the same greedy tokens in float32
    assert set(b["peers"]["ratios"]) == {"ours-plain / hf-plain", "ours-draft-k2 / hf-assisted",
                                         "ours-ngram-k2 / hf-prompt-lookup-k2"}
    assert all(b["peers"]["identical_to_ours_plain"].values()), b["peers"]


@pytest.mark.slow
def test_gpu_check_part_selection_and_bad_arguments(tmp_path):
    r = _run("--small", "--device", "cpu", "--out", str(tmp_path), "--parts", "ab")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["bandwidth"]["gb_per_s"] > 0 and "decode" not in data and "tune" not in data

    r = _run("--device", "cpu", "--out", str(tmp_path))
    assert r.returncode == 2 and "needs a GPU (use --small on CPU)" in r.stderr
    r = _run("--small", "--device", "cpu", "--out", str(tmp_path), "--parts", "xyz")
    assert r.returncode == 2 and "--parts takes letters from abcdef" in r.stderr


def test_gpu_check_records_a_skipped_part(tmp_path):
    # a budget already spent: later parts say why they did not run, and the file is still written
    r = _run("--small", "--device", "cpu", "--out", str(tmp_path), "--parts", "e", "--budget-s", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "hardware" not in data and not (tmp_path / "tune_default_pair.json").exists()
    assert data["tune"]["skipped"].startswith("time budget") and data["bench"]["skipped"].startswith("time budget")
