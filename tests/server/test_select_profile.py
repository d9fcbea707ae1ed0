"""`quickdraft serve --profile` with a `quickdraft select` profile: the server runs its choice
(here a self-draft, `--draft self`'s path) and answers as plain decoding would."""

from __future__ import annotations

import httpx

from quickdraft import LLM, SamplingParams
from quickdraft.policy.costs import Choice, Profile, save_profile

from server_util import ServerProcess


def test_serve_runs_the_profiles_choice_a_self_draft(target_dir, tmp_path):
    path = tmp_path / "select.json"
    save_profile(path, Profile("cpu", "test", "x", str(target_dir), "float32", 8, [1], [1, 2, 3, 4],
                               [[1.0, 1.1, 1.2, 1.3]], {}, choice=Choice("draft", 3, "self", speedup=1.5)))
    prompt = [0, 5, 7, 9]
    plain = LLM(target_dir, method="none").generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                                             ignore_eos=True))[0].token_ids
    s = ServerProcess("--target", str(target_dir), "--profile", str(path), "--max-num-seqs", "2",
                      "--served-model-name", "tiny")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                        "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        spec = body["usage"]["speculation"]
        assert spec["method"] == "draft" and spec["num_drafts"] > 0 and spec["draft_tokens"] <= 3 * spec["num_drafts"]
        assert spec["accepted_tokens"] > 0
        assert body["choices"][0]["text"] == LLM(target_dir, method="none").tokenizer.decode(plain)
    finally:
        s.stop()
