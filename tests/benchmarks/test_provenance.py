"""quickdraft.bench.hardware.provenance: the record every benchmark result file carries."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from quickdraft.bench.hardware import cpu_features, git_commit, provenance, provenance_line

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_features_from_flags():
    x86 = {"fpu", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}
    assert cpu_features(x86) == ["AVX-512", "AVX512_BF16", "AVX512_VNNI", "AVX2", "AMX"]
    assert cpu_features({"fpu", "avx", "avx2", "fma"}) == ["AVX2"]
    assert cpu_features({"fp", "asimd", "sve"}) == ["NEON", "SVE"]


def test_git_commit_marks_a_dirty_tree(tmp_path):
    assert git_commit(tmp_path) is None  # not a checkout
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "f").write_text("1")
    run("add", "f")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "untracked").write_text("results are written next to the code")
    assert git_commit(tmp_path) == head
    (tmp_path / "f").write_text("2")
    assert git_commit(tmp_path) == head + "+dirty"


def test_provenance_record_and_line():
    p = provenance(threads=3, argv=["benchmarks/x.py", "--out", "a b"], load_before=[1.0, 2.0, 3.0])
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", p["commit"]) and p["commit"].startswith(git_commit(ROOT)[:40])
    assert p["command"].endswith("benchmarks/x.py --out 'a b'")
    m = p["machine"]
    assert m["threads"] == 3 and m["cores"] >= 1 and m["torch"] and m["cpu"] and m["gpu"] is None
    assert p["loadavg_before"] == [1.0, 2.0, 3.0] and len(p["loadavg_after"]) == 3
    json.dumps(p)  # JSON as it is
    line = provenance_line(p)
    assert line.startswith("Provenance: commit ") and "3 threads" in line and "load 1.00 -> " in line
    assert "\n" not in line
