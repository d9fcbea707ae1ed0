"""Results of the bundled part of a benchmarks/hybrid.py run from its log (the run was stopped
before its SmolLM2 part; the log carries every figure the markdown shows)."""
import ast, json, re, sys
sys.path.insert(0, "benchmarks")
from hybrid import markdown
from quickdraft.bench.hardware import provenance
log, out, commit, command, load_before = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
res = {"rows": {}, "workloads": {}}
cur = None
for line in open(log):
    m = re.match(r"\[(\w+)\] (\w+): (\d+) prompts", line)
    if m:
        cur = res["workloads"][m.group(2)] = {"prompts": int(m.group(3)), "load_after": None, "rows": {}}
        continue
    m = re.match(r"\s+(\S+): ([\d.]+)x plain, ([\d.]+) tok/s, acc len ([\d.]+), identical (\w+)(?:, drafted by (\{.*\}))?", line)
    if m and cur is not None:
        r = {"speedup": float(m.group(2)), "tokens_per_s": float(m.group(3)),
             "mean_acceptance_length": float(m.group(4)), "identical": m.group(5) == "True"}
        if m.group(6):
            r["drafted_by"] = ast.literal_eval(m.group(6))
        cur["rows"][m.group(1)] = r
rows = {"plain": "none", "draft": "draft", "eagle3": "eagle3", "suffix": "suffix", "ngram": "ngram",
        "auto": "suffix,ngram,draft", "suffix,ngram,eagle3": "suffix,ngram,eagle3"}
res["rows"] = rows
prov = provenance("cpu", threads=1, load_before=[load_before, None, None])
prov["commit"] = commit
prov["command"] = command + "  (figures from its log: python benchmarks/results/hybrid_bundled_cpu_parse.py)"
prov["date"] = "2026-12-02T12:14:19+00:00 to 12:36:31+00:00"
result = {"command": command, "k": 5, "new_tokens": 64, "threads": 1, "pinned_cores": [0],
          "note": "**Measured under heavy load**: the 1-minute load average was 10.4 when the run started and 28 when its bundled part ended, on 2 cores (other sessions were running); the process was pinned to one core, but these ratios are noisy (a repeat of one row took 4x another of the same row), so read them as indications; the lead may re-measure. Figures parsed from the run's log (medians over repeats as printed; the run was stopped before its "
                  "SmolLM2 part, measured in a separate run)", "models": {"bundled": res}, "provenance": prov}
json.dump(result, open(out + ".json", "w"), indent=1)
open(out + ".md", "w").write("\n".join(markdown(result)) + "\n")
print("\n".join(markdown(result)))
