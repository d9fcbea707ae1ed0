"""Issue 32 in the library: constraints (JSON schema, regex, choice, grammar) mask the target's
logits the same way in plain decoding and at every verify position, so that greedy speculative
output equals plain constrained output for every proposer and sampled output follows the exact
masked distribution (tokens 2-3 at T = 1, as test_lossless.py's tests do)."""

from __future__ import annotations

import json
import pickle
import threading

import jsonschema
import numpy as np
import pytest
import torch

from quickdraft import LLM, QuickdraftError, SamplingParams
from quickdraft.constraints import Constraint, GrammarVocabulary
from quickdraft.model.tokenizer import Tokenizer
from quickdraft.sampling import BatchSampling, process_logits

from conftest import make_checkpoint, slow_schema
from test_lossless import N, PROMPT, V, chi2_pvalue, sampled_joint

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["def", "class"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "n", "kind", "tags"], "additionalProperties": False}
CONSTRAINTS = [{"json_schema": SCHEMA}, {"regex": r"(def|class) [a-z_]{1,12}\((x|y)(, (x|y)){0,2}\):"},
               {"choice": ["def add", "class Point", "import os"]}, {"json_object": True},
               {"grammar": 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]/'},
               {"grammar": 'root ::= "for " [a-z] " in range(" [0-9] "):"'}]
PROMPTS = ["def add(a, b):\n", "class Point:\n", "import os\n", "for i in range(10):\n"]


@pytest.mark.parametrize("value,field", [
    ({"json_schema": "{"}, "json_schema"), ({"json_schema": {"type": "foo"}}, "json_schema"),
    ({"json_schema": [1]}, "json_schema"), ({"regex": "(a"}, "regex"), ({"grammar": "start: foo"}, "grammar"),
    ({"grammar": "root ::= bar"}, "grammar"), ({"choice": []}, "choice"), ({"choice": "a"}, "choice"),
    ({"nope": 1}, "constraint"), (["x"], "constraint"), ({"regex": 5}, "regex"),
])
def test_bad_constraints_are_clear_errors_naming_their_field(value, field):
    with pytest.raises(QuickdraftError) as e:
        SamplingParams(constraint=value)
    assert e.value.field == field


def test_constraints_are_values():
    a = SamplingParams(constraint={"json_schema": SCHEMA})
    b = SamplingParams(constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    assert a == b and hash(a) == hash(b)
    assert pickle.loads(pickle.dumps(a)) == a


def test_a_constraint_needs_a_tokenizer(tmp_path):
    llm = LLM(make_checkpoint(tmp_path / "m", tokenizer=False), method="none", policy="fixed")
    with pytest.raises(QuickdraftError, match="tokenizer"):
        llm.generate([[0, 1, 2]], SamplingParams(constraint={"regex": "a+"}))


def _allowed(vocab: GrammarVocabulary, constraint: Constraint, prefix: list[int]) -> torch.Tensor:
    """The reference: a fresh llguidance matcher fed `prefix`, its mask as (V,) bool."""
    import llguidance

    m = llguidance.LLMatcher(vocab.tokenizer, constraint.grammar, log_level=0)
    assert m.consume_tokens(prefix), m.get_error()
    bits = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
    return vocab.to_bool(bits)


def test_masks_follow_each_draft_path(target_dir):
    tok = Tokenizer(target_dir)
    vocab = GrammarVocabulary(tok, 384, [1])
    c = Constraint.of({"json_schema": SCHEMA})
    good = tok.encode('{"name": "ab", "n": 12, "kind": "def", "tags": ["a"]}', add_special_tokens=False)
    m = vocab.matcher(c)
    for t in good[:3]:
        assert m.commit(t)
    done = good[:3]
    rest = good[3:8]
    bad = tok.encode("zz", add_special_tokens=False)[0]
    # a tree: the right chain (nodes 0..4), a branch off node 1 with a forbidden token, and an absent node
    nodes = rest + [bad, rest[2], -1]
    parents = [-1, 0, 1, 2, 3, 1, 0, -1]
    out = torch.zeros(1 + len(nodes), vocab.words, dtype=torch.int32)
    m.masks(nodes, parents, out)
    got = vocab.to_bool(out)
    paths = {0: rest[:1], 1: rest[:2], 2: rest[:3], 3: rest[:4], 4: rest[:5], 6: [rest[0], rest[2]]}
    assert torch.equal(got[0], _allowed(vocab, c, done))
    for n, path in paths.items():
        if _allowed(vocab, c, done + path[:-1])[path[-1]]:
            assert torch.equal(got[1 + n], _allowed(vocab, c, done + path)), n
        else:  # below a forbidden token: never read, row 0's mask
            assert torch.equal(got[1 + n], got[0])
    assert not _allowed(vocab, c, done + rest[:1])[bad]
    # a chain over the same tokens gives the chain's rows; the matcher is where it was
    chain = torch.zeros(1 + len(rest), vocab.words, dtype=torch.int32)
    m.masks(rest, None, chain)
    assert torch.equal(vocab.to_bool(chain)[1:], got[1:6])
    again = torch.zeros(1, vocab.words, dtype=torch.int32)
    m.masks([], None, again)
    assert torch.equal(vocab.to_bool(again)[0], got[0])


def _check(c: dict, out) -> None:
    """A finished constrained output matches its constraint."""
    text = out.text
    if "json_schema" in c:
        jsonschema.validate(json.loads(text), c["json_schema"])
    elif "json_object" in c and out.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    elif "choice" in c:
        assert text in c["choice"]
    elif "regex" in c:
        import re
        assert re.fullmatch(c["regex"], text), text


@pytest.fixture(scope="module")
def plain(target_dir):
    return LLM(target_dir, method="none", policy="fixed")


@pytest.fixture(scope="module")
def head(target_dir, tmp_path_factory):
    """An EAGLE-3 head trained for a few seconds on the target's greedy text (as test_eagle3.py's):
    a random one is never accepted over 384 tokens."""
    from quickdraft.model.eagle3 import new_head, save_eagle3
    from quickdraft.model.loader import load_model
    from quickdraft.train.distill import generate_pool
    from quickdraft.train.eagle3 import train_head

    target = load_model(target_dir, dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (4,), generator=g).tolist() for _ in range(48)]
    seqs = generate_pool(target, prompts, 60, seed=0, greedy=[True] * 48)
    torch.manual_seed(0)
    head = new_head(target, intermediate_size=128)
    train_head(head, target, seqs, epochs=8, batch_size=8, seq_len=64, lr=1e-2)
    return save_eagle3(head, tmp_path_factory.mktemp("head") / "h")


def test_plain_constrained_output_matches_its_constraint(plain):
    params = [SamplingParams(temperature=0, max_tokens=60, constraint=c) for c in CONSTRAINTS]
    outs = plain.generate([PROMPTS[i % 4] for i in range(len(params))], params)
    for c, o in zip(CONSTRAINTS, outs):
        if "json_object" not in c:
            assert o.finish_reason == "stop", (c, o.text)
        _check(c, o)
    free = plain.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20))[0]
    assert free.text != outs[0].text


@pytest.mark.parametrize("method,options", [
    ("draft", {}), ("draft", {"tree_width": 3}), ("eagle3", {}), ("eagle3", {"tree_width": 2, "tree_nodes": 6}),
    ("ngram", {"num_candidates": 3, "min_ngram": 1}), ("suffix", {}), ("lookahead", {}),
], ids=["draft-chain", "draft-tree", "eagle3-chain", "eagle3-tree", "ngram-tree", "suffix", "lookahead"])
def test_speculative_greedy_constrained_equals_plain(target_dir, noisy_draft, head, plain, method, options):
    llm = LLM(target_dir, draft={"draft": noisy_draft, "eagle3": head}.get(method), method=method,
              num_speculative_tokens=4, spec_options=options, policy="fixed")
    cs = CONSTRAINTS + [None]
    params = [SamplingParams(temperature=0, max_tokens=60, constraint=c) for c in cs]
    prompts = [PROMPTS[i % 4] for i in range(len(params))]
    expected = plain.generate(prompts, params)
    got = llm.generate(prompts, params)  # one batch: constrained and free rows side by side
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for c, o in zip(cs, got):
        if c is not None:
            _check(c, o)
    assert llm.generate([prompts[0]], params[0])[0].token_ids == expected[0].token_ids
    assert llm.stats.num_accepted_tokens > 0
    # a schema's keys, quotes and separators are forced: verified in the proposer's place, accepted
    assert got[0].stats.num_forced_tokens >= 5 and got[-1].stats.num_forced_tokens == 0
    for o in got:  # every forced token is labelled so (token origins), unless the end cut it off
        forced = o.token_origins.count("forced")
        assert forced <= o.stats.num_forced_tokens and (forced > 0) == (o.stats.num_forced_tokens > 0)


def test_a_constraint_cut_by_max_tokens_ends_with_length(plain):
    o = plain.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, constraint={"json_schema": SCHEMA}))[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 5 and o.text.startswith('{"')


# ---- the exact masked distribution (tokens 2-3 at T = 1), with a wrong-verifier control --------

WORDS = ["<s>", "</s>", "a", "b", "c", "d", "ac", "ca", "x", "y", "z", "q"]  # V = 12 tokens
REGEX = "((a|b)(c|d))*(x|y|z)*"  # what each position allows depends on the tokens before it
FORCING = "((ac|bd)x)*y*"  # after a: c and x forced (or "ac" then x): forced runs, rejected when the target writes "ac"


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """test_lossless's pair (the same seeds) with a 12-word tokenizer, so that a grammar can
    constrain them."""
    from tokenizers import Tokenizer as HF, models

    root = tmp_path_factory.mktemp("constrained")
    t = make_checkpoint(root / "t", vocab=V, seed=0, tokenizer=False, initializer_range=0.3)
    d = make_checkpoint(root / "d", vocab=V, seed=5, layers=1, tokenizer=False, initializer_range=0.3)
    for folder in (t, d):
        tok = HF(models.BPE({w: i for i, w in enumerate(WORDS)}, [("a", "c"), ("c", "a")], unk_token="q"))
        tok.add_special_tokens(["<s>", "</s>"])
        tok.save(str(folder / "tokenizer.json"))
    return t, d


def exact_joint_masked(model_dir, params: SamplingParams) -> np.ndarray:
    """P(x2, x3 | prompt) with each next-token distribution masked by the grammar after its own
    context (a fresh matcher per context), then processed as plain decoding processes it."""
    llm = LLM(model_dir, method="none", policy="fixed")
    vocab = GrammarVocabulary(llm.tokenizer, V, [1])
    s = BatchSampling.build([params], torch.device("cpu"))

    def probs(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            raw = llm.target(torch.tensor([seq]))[0, -1].float()
        masked = raw.masked_fill(~_allowed(vocab, params.constraint, seq[len(PROMPT):]), -float("inf"))
        return process_logits(masked[None], s)[0].double()

    p1 = probs(PROMPT)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = probs(PROMPT + [a])
        for b in range(V):
            if p2[b] > 0:
                joint[b] += p1[a] * p2[b] * probs(PROMPT + [a, b])
    return joint.numpy()


@pytest.mark.slow  # ~1 minute each on 2 busy cores
@pytest.mark.parametrize("method,options,kw,regex", [
    ("draft", {}, dict(temperature=1.0, top_p=0.9), REGEX),
    ("draft", {"tree_width": 3}, dict(temperature=1.0), REGEX),
    ("suffix", {}, dict(temperature=1.0, top_p=0.9), REGEX),
    ("none", {}, dict(temperature=1.0), REGEX),
    ("draft", {}, dict(temperature=1.0, top_p=0.9), FORCING),
    ("draft", {"tree_width": 2, "tree_sampled": True}, dict(temperature=1.0), FORCING),
    ("suffix", {}, dict(temperature=1.0), FORCING),
], ids=["draft-chain-topp", "draft-tree", "suffix-topp", "plain", "forced-draft-chain-topp", "forced-draft-sampled-tree",
        "forced-suffix"])
def test_constrained_sampling_matches_the_masked_target(worded, method, options, kw, regex):
    """With FORCING, most steps verify the grammar's forced tokens in the proposer's place (one-hot
    q), the rest the proposer's own draft."""
    target, draft = worded
    llm = LLM(target, draft=draft if method == "draft" else None, method=method, num_speculative_tokens=2,
              max_num_seqs=N // 4, spec_options=options, policy="fixed")
    c = {"regex": regex}
    counts = sampled_joint(llm, lambda i: SamplingParams(max_tokens=4, seed=i, ignore_eos=True, constraint=c, **kw))
    probs = exact_joint_masked(target, SamplingParams(constraint=c, **kw))
    if method != "none":  # both verify paths taken: accepted and rejected drafts
        s = llm.stats
        assert s.num_accepted_tokens > 100 and s.num_draft_tokens - s.num_accepted_tokens > 100
        assert (s.num_forced_tokens > 1000) == (regex == FORCING)
        assert llm.stats.num_accepted_tokens > llm.stats.num_forced_tokens
    assert chi2_pvalue(counts, probs) > 1e-3
    # controls the same test must reject: the masked draft, and the target mixed with it
    wrong = exact_joint_masked(draft, SamplingParams(constraint=c, **kw))
    assert chi2_pvalue(counts, wrong) < 1e-6
    assert chi2_pvalue(counts, 0.7 * probs + 0.3 * wrong) < 1e-6


def test_a_constraint_past_its_compile_time_limit_is_refused(target_dir):
    llm = LLM(target_dir, method="none", policy="fixed", constraint_compile_timeout=0.05)
    with pytest.raises(QuickdraftError, match="did not compile within 0.05 s") as e:
        llm.generate([[0, 1, 2]], SamplingParams(max_tokens=4, constraint={"json_schema": slow_schema()}))
    assert e.value.field == "json_schema"
    # the abandoned compile finishes on its own thread (about a second); let it, so that it does
    # not take the CPU the next compile's 0.05 s needs (the suite runs a worker on each core)
    for t in threading.enumerate():
        if t.name == "quickdraft-constraint-compile":
            t.join(timeout=120)
    # the engine is untouched: a sane constraint (compiled within the limit) still runs
    out = llm.generate([[0, 1, 2]], SamplingParams(temperature=0, max_tokens=4, constraint={"regex": "[ab]+"}))[0]
    assert out.text and set(out.text) <= {"a", "b"}


@pytest.mark.parametrize("value", [0, -1, float("inf"), "5", True])
def test_the_compile_time_limit_is_checked(target_dir, value):
    with pytest.raises(QuickdraftError, match="constraint_compile_timeout"):
        LLM(target_dir, method="none", policy="fixed", constraint_compile_timeout=value)


def test_a_compiled_constraint_is_reused_and_copied_per_request(target_dir):
    llm = LLM(target_dir, method="none", policy="fixed")
    params = SamplingParams(temperature=0, max_tokens=12, constraint={"json_schema": SCHEMA})
    a, b = llm.generate([[0, 1, 2], [3, 4]], params)  # one compile; each request its own grammar state
    for o in (a, b):
        assert o.finish_reason == "length" or jsonschema.validate(json.loads(o.text), SCHEMA) is None
    first = params.constraint.compiled(llm.engine._grammar.get())
    assert params.constraint.compiled(llm.engine._grammar.get()) is first
    # requests with an equal constraint (each its own SamplingParams, as a server builds them) share
    # the compile; the engine keeps the last COMPILED_CACHE_SIZE distinct ones
    from quickdraft import constraints

    again = SamplingParams(temperature=0, max_tokens=12, constraint={"json_schema": SCHEMA})
    assert again.constraint is not params.constraint and again.constraint.compiled(llm.engine._grammar.get()) is first
    vocab = llm.engine._grammar.get()
    for i in range(constraints.COMPILED_CACHE_SIZE):
        Constraint("regex", f"x{i}").compiled(vocab)
    assert Constraint("json_schema", SCHEMA).compiled(vocab) is not first
    assert Constraint("regex", f"x{constraints.COMPILED_CACHE_SIZE - 1}").compiled(vocab) is \
        Constraint("regex", f"x{constraints.COMPILED_CACHE_SIZE - 1}").compiled(vocab)
