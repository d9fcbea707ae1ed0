"""EAGLE-3 heads (quickdraft.model.eagle3, method "eagle3"): parity with vLLM's `speculators`
package on the same random weights, both folder layouts, losslessness through the engine,
and training (quickdraft.train.eagle3)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from quickdraft import LLM, QuickdraftError, SamplingParams
from quickdraft.model.eagle3 import Eagle3Config, load_eagle3, new_head, save_eagle3
from quickdraft.model.loader import load_model

from conftest import make_checkpoint

V, H = 50, 64
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("e3") / "t", vocab=V, seed=0, layers=4, tokenizer=False,
                           initializer_range=0.3)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype="float32")


def speculators_head(folder, target, *, norm_before_residual: bool, draft_vocab: int = 25, seed: int = 0):
    """A random speculators Eagle3DraftModel for `target`, saved by the package itself."""
    pytest.importorskip("speculators")
    from transformers import LlamaConfig
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tc = target.config
    layer = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=[1, 2, 4],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "norm" not in name else 0.2) + ("norm" in name))
        model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_logits_match_the_speculators_package(tmp_path, target, norm_before_residual):
    """The same random weights, saved by `speculators` (vLLM's library) and loaded here: the
    head's draft logits equal the package's, for the catch-up pass over a sequence (its
    training-time-test step 0) and for the next draft step fed the head's own state (step 1)."""
    theirs = speculators_head(tmp_path / "h", target, norm_before_residual=norm_before_residual)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    ours = load_eagle3(tmp_path / "h", target)
    assert ours.head_config.layout == "speculators" and ours.aux_layers == (1, 2, 4)
    T = 12
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, T, 3 * H, generator=g)
    ids = torch.randint(0, V, (1, T), generator=g)
    captured = []
    hook = theirs.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    with torch.no_grad():
        theirs(feats, ids, torch.zeros(1, T, dtype=torch.long), ttt_steps=2)
    hook.remove()
    from quickdraft.cache import KVCache

    cache = KVCache(1, 1, ours.config.num_key_value_heads, 64, ours.config.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        logits, out = ours(ids, feats, torch.arange(T)[None], cache.rows(0, 1))
        assert (logits - captured[0]).abs().max() < 1e-4
        # step 1 at index T-2: the head's own state there with the token at T-1, one position on
        step, _ = ours(ids[:, T - 1:], out[:, T - 2:T - 1], torch.tensor([[T - 1]]), cache.rows(0, 1),
                       kv_len=T, project=False)
    assert (step[0, 0] - captured[1][0, T - 2]).abs().max() < 1e-4
    # mapped into the target vocabulary: the draft ids land on their target ids, -inf elsewhere
    full = ours.to_target(logits[0, :1], V)[0]
    d2t = theirs.d2t
    assert torch.equal(full[torch.arange(25) + d2t], logits[0, 0]) and torch.isinf(full).sum() == V - 25


def test_eagle_layout_round_trip_and_renamed_weights(tmp_path, target):
    """EAGLE's own folders (midlayer.* names, eagle_config) load as save_eagle3 writes them."""
    torch.manual_seed(0)
    head = new_head(target, torch.arange(0, V, 2))
    save_eagle3(head, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == V // 2
    loaded = load_eagle3(tmp_path / "h", target)
    assert loaded.head_config.layout == "eagle3" and loaded.aux_layers == head.aux_layers == (2, 2, 1)
    for name, p in head.state_dict().items():
        assert torch.equal(p, loaded.state_dict()[name]), name
    # EAGLE's published heads are pytorch_model.bin files
    from safetensors.torch import load_file

    torch.save(load_file(str(tmp_path / "h" / "model.safetensors")), tmp_path / "h" / "pytorch_model.bin")
    (tmp_path / "h" / "model.safetensors").unlink()
    from_bin = load_eagle3(tmp_path / "h", target)
    assert all(torch.equal(p, from_bin.state_dict()[n]) for n, p in head.state_dict().items())


@pytest.mark.parametrize("change,message", [
    (lambda c, s: c.update(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 head folder"),
    (lambda c, s: c.update(num_hidden_layers=2), "2 decoder layers are not supported"),
    (lambda c, s: c.update(hidden_size=32, head_dim=8), "shape"),
    (lambda c, s: s.pop("fc.weight"), "missing tensors: fc.weight"),
    (lambda c, s: s.update(extra=torch.zeros(1)), "unexpected tensor extra"),
    (lambda c, s: s.update(d2t=torch.full((V // 2,), 40)), "d2t does not map"),
    (lambda c, s: s.pop("d2t"), "missing tensors: d2t"),
    (lambda c, s: c.update(vocab_size=V + 2), "vocabulary of 52 tokens; the target has 50"),
    (lambda c, s: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 9, 2]), "reads target layers"),
])
def test_bad_head_folders_are_one_line_errors(tmp_path, target, change, message):
    torch.manual_seed(0)
    folder = save_eagle3(new_head(target, torch.arange(0, V, 2)), tmp_path / "h")
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    change(cfg, state)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(QuickdraftError, match=message) as err:
        load_eagle3(folder, target)
    assert "\n" not in str(err.value)


def test_head_for_another_target_is_refused(tmp_path, target, tmp_path_factory):
    other = load_model(make_checkpoint(tmp_path / "o", vocab=V, seed=1, layers=2, tokenizer=False,
                                       hidden_size=32, num_attention_heads=2, num_key_value_heads=1), dtype="float32")
    folder = save_eagle3(new_head(target), tmp_path / "h")
    with pytest.raises(QuickdraftError, match="hidden states of size 64; the target's are 32"):
        load_eagle3(folder, other)
    with pytest.raises(QuickdraftError, match="method 'eagle3' needs a draft"):
        LLM(make_checkpoint(tmp_path / "t", vocab=V, tokenizer=False), method="eagle3", policy="fixed")


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory, target_dir):
    """A head trained for a few seconds on the target's own greedy text. The random target's
    distributions are nearly flat, so it is accepted only now and then (~5%), enough that the
    engine's bookkeeping of accepted states is exercised (a real target: benchmarks/results)."""
    from quickdraft.train.distill import generate_pool
    from quickdraft.train.eagle3 import train_head

    target = load_model(target_dir, dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (4,), generator=g).tolist() for _ in range(48)]
    seqs = generate_pool(target, prompts, 60, seed=0, greedy=[True] * 48)
    torch.manual_seed(0)
    head = new_head(target, intermediate_size=128)
    history = train_head(head, target, seqs, epochs=8, batch_size=8, seq_len=64, lr=1e-2)
    assert history[-1]["loss"] < history[0]["loss"]
    return save_eagle3(head, tmp_path_factory.mktemp("trained") / "h")


@pytest.mark.parametrize("options", [{}, {"tree_width": 3}, {"tree_width": 4, "tree_nodes": 6}],
                         ids=["chain", "tree", "tree-pruned"])
def test_greedy_output_equals_plain_decoding(target_dir, trained_head, options):
    """Greedy with the head == plain decoding, token for token, for ragged prompts in one batch,
    k=1 and 4, chains and dynamic trees, and the head is accepted at times (so states of
    accepted drafts, and accepted tree paths, are used)."""
    plain = LLM(target_dir, method="none", dtype="float32", compile=False)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[3, 7, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [4, 4, 4, 4]]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    for k in (1, 4):
        spec = LLM(target_dir, method="eagle3", draft=trained_head, dtype="float32", num_speculative_tokens=k,
                   compile=False, max_num_seqs=3, spec_options=options, policy="fixed")  # 4 prompts in 3 rows: one joins mid-batch
        got = [o.token_ids for o in spec.generate(prompts, params)]
        assert got == want, k
        assert spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("params,options", [
    (SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True), {}),
    (SamplingParams(temperature=1.5, top_p=0.9, top_k=6, max_tokens=3, ignore_eos=True), {}),
    (SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True), {"tree_width": 3, "tree_nodes": 4}),
], ids=["chain", "chain-truncated", "tree"])
def test_sampled_output_keeps_the_target_distribution(tmp_path, params, options):
    """Chi-square of (x2, x3) after a fixed prompt (the lossless suite's check, its 12-token
    vocabulary): the eagle3 engine's samples against the exact joint of the target alone, with
    a head whose draft vocabulary covers 8 of the 12 tokens (q is 0 on the other 4)."""
    import dataclasses

    import numpy as np

    from engine.test_lossless import PROMPT, V as V12, chi2_pvalue, exact_joint

    target_dir = make_checkpoint(tmp_path / "t", vocab=V12, seed=0, layers=4, tokenizer=False, initializer_range=0.3)
    torch.manual_seed(3)
    head = new_head(load_model(target_dir, dtype="float32"), torch.tensor([0, 1, 2, 4, 5, 7, 9, 11]))
    with torch.no_grad():  # a sharper random head: its q differs from p, so rejections happen too
        head.lm_head.weight.mul_(20)
    save_eagle3(head, tmp_path / "h")
    spec = LLM(target_dir, method="eagle3", draft=tmp_path / "h", dtype="float32", num_speculative_tokens=2,
               compile=False, spec_options=options, policy="fixed")
    n = 6000
    outs = spec.generate([PROMPT] * n, [dataclasses.replace(params, seed=i) for i in range(n)])
    counts = np.zeros((V12, V12))
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    stats = spec.stats
    assert 0.05 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.95 * stats.num_draft_tokens
    assert chi2_pvalue(counts, exact_joint(target_dir, params)) > 1e-3


def test_head_config_reads_both_layouts(tmp_path):
    base = {"model_type": "llama", "vocab_size": V, "hidden_size": H, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1}
    (tmp_path / "a.json").write_text(json.dumps({**base, "architectures": ["LlamaForCausalLMEagle3"],
                                                 "draft_vocab_size": 20, "eagle_config": {
                                                     "eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}))
    (tmp_path / "b.json").write_text(json.dumps({"speculators_model_type": "eagle3", "transformer_layer_config": base,
                                                 "draft_vocab_size": 30, "norm_before_residual": True,
                                                 "target_hidden_size": 128}))
    a, b = Eagle3Config.from_file(tmp_path / "a.json"), Eagle3Config.from_file(tmp_path / "b.json")
    assert (a.layout, a.draft_vocab_size, a.aux_layers, a.norm_before_residual) == ("eagle3", 20, (1, 3, 5), False)
    assert (b.layout, b.draft_vocab_size, b.aux_layers, b.norm_before_residual, b.target_hidden_size) == \
        ("speculators", 30, None, True, 128)


def test_shipped_head_for_the_bundled_target():
    """The head quickdraft ships for its bundled target: a bfloat16 EAGLE-3 folder found by name,
    greedy output identical to plain decoding and accepted often on code."""
    from quickdraft.llm import default_model_dirs
    from quickdraft.model.eagle3 import is_eagle3_head
    from quickdraft.model.sources import resolve_model

    folder = resolve_model("target-eagle3")
    assert is_eagle3_head(folder) and json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (folder / "model.safetensors").stat().st_size <= 16e6 and "Reproduce" in (folder / "README.md").read_text()
    target, _ = default_model_dirs()
    spec = LLM(target, draft="target-eagle3", num_speculative_tokens=4, compile=False, policy="fixed")  # a head: method eagle3
    assert spec.engine.config.spec.method == "eagle3"
    default = LLM(method="eagle3", compile=False, policy="fixed")  # no target, no draft: the bundled target and its head
    assert default.draft.checkpoint_path == folder
    prompts = [spec.tokenizer.encode("def read_config(path):\n    with open(path) as f:\n"),
               spec.tokenizer.encode("class Stack:\n    def __init__(self):\n        self.items = []\n")]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = LLM(target, method="none", compile=False)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    assert spec.stats.acceptance_rate > 0.15


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tune_measures_the_heads_propose_time(target_dir, trained_head, temperature):
    """`quickdraft tune`'s propose timing runs an eagle3 proposer (the head's catch-up on one
    pending pair, then k drafts), greedy and sampled; its times feed the goodput policy."""
    from quickdraft.bench.measure import measure_propose

    llm = LLM(target_dir, method="eagle3", draft=trained_head, dtype="float32", num_speculative_tokens=3,
              compile=False, policy="fixed")
    times = measure_propose(llm, [1, 2], [1, 3], context=16, iters=2, temperature=temperature)
    assert len(times) == 2 and all(len(row) == 2 and all(t > 0 for t in row) for row in times)


def test_training_resumes_from_its_checkpoint(tmp_path, target):
    """A run stopped after its first epoch and resumed from checkpoint.pt ends with the very
    weights of an uninterrupted run (optimiser, schedule and data order restored)."""
    from quickdraft.train.eagle3 import train_head

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (40,), generator=g).tolist() for _ in range(12)]
    kwargs = dict(epochs=3, batch_size=4, seq_len=32, lr=1e-2)

    def fresh():
        torch.manual_seed(0)
        return new_head(target, intermediate_size=64)

    whole = fresh()
    train_head(whole, target, seqs, **kwargs)

    class Stop(Exception):
        pass

    def stop_after_first(entry):
        if entry.get("epoch") == 0:
            raise Stop

    ckpt = tmp_path / "checkpoint.pt"
    with pytest.raises(Stop):
        train_head(fresh(), target, seqs, checkpoint=ckpt, log=stop_after_first, **kwargs)
    resumed = fresh()
    history = train_head(resumed, target, seqs, checkpoint=ckpt, **kwargs)
    assert [h["epoch"] for h in history] == [0, 1, 2]
    for name, p in whole.state_dict().items():
        assert torch.allclose(p, resumed.state_dict()[name], atol=1e-6), name


def test_cached_target_states_train_like_recomputed_ones(target):
    """Training reads the target's states once per window (`cache_features`): the loss on a
    batch and the trained weights are those of recomputing the target for every batch."""
    from quickdraft.train.eagle3 import cache_features, train_head, ttt_loss

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 40, 33, 40, 25, 40)]
    vocab = torch.randperm(V, generator=g)[: V // 2]

    def fresh():
        torch.manual_seed(0)
        return new_head(target, vocab, intermediate_size=64)

    head = fresh()
    ids = torch.tensor([s[:25] for s in seqs])
    (feats, final), = [tuple(torch.stack(part) for part in zip(*cache_features(head, target, [s[:25] for s in seqs])))]
    recomputed, agree = ttt_loss(head, target, ids)
    cached, agree_cached = ttt_loss(head, target, ids, features=(feats, final))
    assert torch.allclose(recomputed, cached, rtol=1e-5) and agree == agree_cached
    kwargs = dict(epochs=2, batch_size=4, seq_len=32, lr=1e-2)
    a, b = fresh(), fresh()
    train_head(a, target, seqs, **kwargs)
    train_head(b, target, seqs, cache_limit_bytes=0, **kwargs)
    for name, p in a.state_dict().items():
        assert torch.allclose(p, b.state_dict()[name], atol=1e-4), name
