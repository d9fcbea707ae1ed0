"""Crafted and mutated GGUF files: each is one clear QuickdraftError (or a correct load), within
a memory bound set by the file's size and the model it declares, and quickly. The header is
validated before anything is dequantised: entries the model does not have, entries sharing
bytes, a layer count the tensors do not match, a zero or odd alignment, arrays nested without
end, dimensions whose product overflows."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest

from quickdraft import QuickdraftError
from quickdraft.model.loader import checkpoint_dir, load_model

gguf = pytest.importorskip("gguf")

MiB = 1 << 20
U8, I32, U32, F32, BOOL, STR, ARR, U64 = 0, 5, 4, 6, 7, 8, 9, 10
HIDDEN, HEADS, KV, FF, VOCAB, LAYERS = 64, 4, 2, 128, 256, 2


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))


# --- measuring: the peak resident memory of one call (Linux resets the peak on request) ------

def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _can_measure() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


MEASURE = _can_measure()


def measured(fn):
    """(result or the exception raised, seconds, peak bytes above the resident size before)."""
    if MEASURE:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
    start = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - returned for the caller to judge
        out = exc
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - before if MEASURE else 0
    return out, seconds, peak


# --- raw GGUF bytes --------------------------------------------------------------------------

def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv(key: str, kind: int, value) -> bytes:
    fmt = {U8: "<B", I32: "<i", U32: "<I", F32: "<f", BOOL: "<?", U64: "<Q"}
    body = s(value) if kind == STR else value if kind == ARR else struct.pack(fmt[kind], value)
    return s(key) + struct.pack("<I", kind) + body


def model_kvs(**override) -> list[bytes]:
    meta = {"general.architecture": (STR, "llama"), "llama.block_count": (U32, LAYERS),
            "llama.context_length": (U32, 256), "llama.embedding_length": (U32, HIDDEN),
            "llama.feed_forward_length": (U32, FF), "llama.attention.head_count": (U32, HEADS),
            "llama.attention.head_count_kv": (U32, KV), "llama.rope.dimension_count": (U32, HIDDEN // HEADS),
            "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5)}
    meta.update(override)
    return [kv(k, *v) for k, v in meta.items() if v is not None]


def model_tensors(layers: int = LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    """(name, ggml dims: innermost first) of a tiny llama."""
    hd = HIDDEN // HEADS
    out = [("token_embd.weight", (HIDDEN, VOCAB)), ("output_norm.weight", (HIDDEN,)),
           ("output.weight", (HIDDEN, VOCAB))]
    for i in range(layers):
        out += [(f"blk.{i}.attn_norm.weight", (HIDDEN,)), (f"blk.{i}.ffn_norm.weight", (HIDDEN,)),
                (f"blk.{i}.attn_q.weight", (HIDDEN, HEADS * hd)), (f"blk.{i}.attn_k.weight", (HIDDEN, KV * hd)),
                (f"blk.{i}.attn_v.weight", (HIDDEN, KV * hd)), (f"blk.{i}.attn_output.weight", (HEADS * hd, HIDDEN)),
                (f"blk.{i}.ffn_gate.weight", (HIDDEN, FF)), (f"blk.{i}.ffn_up.weight", (HIDDEN, FF)),
                (f"blk.{i}.ffn_down.weight", (FF, HIDDEN))]
    return out


def raw_gguf(kvs: list[bytes], tensors: list[tuple[str, tuple[int, ...]]], *, offsets=None, data: bytes | None = None,
             align: int = 32, kind: int = 0, n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """GGUF v3 bytes: F32 tensors (ggml type `kind`) laid out one after another unless `offsets`
    says where each starts; `data` replaces the random data."""
    sizes = [4 * int(np.prod(d, dtype=object)) for _, d in tensors]
    if offsets is None:
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += n + (-n % 32)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b"".join(kvs)
    for (name, dims), off in zip(tensors, offsets):
        head += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        head += struct.pack("<IQ", kind, off)
    head += b"\0" * (-len(head) % align if align > 0 else 0)
    if data is None:
        end = max((o + n for o, n in zip(offsets, sizes)), default=0)
        rng = np.random.default_rng(0)
        data = (rng.standard_normal(end // 4) * 0.05).astype(np.float32).tobytes()
    return head + data


def write(tmp_path: Path, b: bytes, name: str = "m.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(b)
    return path


@pytest.fixture(scope="module", autouse=True)
def warm(tmp_path_factory):
    """One good load first, so lazy imports do not count against the first measured case."""
    path = write(tmp_path_factory.mktemp("good"), raw_gguf(model_kvs(), model_tensors()))
    model = load_model(path)
    assert model.config.num_hidden_layers == LAYERS
    return path


def one_clear_error(path: Path, seconds: float = 2.0, peak: int = 50 * MiB, match: str | None = None) -> str:
    out, took, used = measured(lambda: load_model(path))
    assert isinstance(out, QuickdraftError), f"{type(out).__name__}: {out}"
    message = str(out)
    assert "\n" not in message and message
    if match is not None:
        assert match in message, message
    assert took < seconds, f"{took:.1f} s: {message}"
    assert used < peak, f"{used / MiB:.0f} MiB: {message}"
    return message


# --- the crafted files of issue 34 ---------------------------------------------------------

def test_entries_sharing_bytes_are_rejected_before_any_is_read(tmp_path):
    """~1 MiB of data, 301 entries over the same bytes (unknown names): was ~300 MiB."""
    tensors = model_tensors() + [(f"junk.{i}.weight", (512, 512)) for i in range(301)]
    sizes = [4 * int(np.prod(d)) for _, d in model_tensors()]
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n + (-n % 32)
    data_len = at + 512 * 512 * 4
    path = write(tmp_path, raw_gguf(model_kvs(), tensors, offsets=offsets + [at] * 301,
                                    data=np.zeros(data_len // 4, np.float32).tobytes()))
    assert path.stat().st_size < 2 * MiB
    one_clear_error(path, match="share bytes")


def test_unknown_entries_are_never_dequantised(tmp_path):
    """Each its own bytes, names no model has: rejected by name before any data is read."""
    tensors = model_tensors() + [(f"junk.{i}.weight", (256, 64)) for i in range(16)]  # 1 MiB in all
    path = write(tmp_path, raw_gguf(model_kvs(), tensors))
    one_clear_error(path, peak=8 * MiB, match="unexpected tensors")


@pytest.mark.parametrize("count", [8000, 2**32 - 1, 0, 1])
def test_block_count_must_match_the_layers_present(tmp_path, count):
    path = write(tmp_path, raw_gguf(model_kvs(**{"llama.block_count": (U32, count)}), model_tensors()))
    one_clear_error(path, seconds=1.0, match="block_count")


@pytest.mark.parametrize("key,value", [
    ("llama.embedding_length", 2**31), ("llama.feed_forward_length", 2**32 - 1), ("llama.attention.head_count", 10**6),
    ("llama.attention.head_count_kv", 3), ("llama.context_length", 2**32 - 1), ("llama.feed_forward_length", 64),
])
def test_sizes_are_bounded_by_the_tensors(tmp_path, key, value):
    path = write(tmp_path, raw_gguf(model_kvs(**{key: (U32, value)}), model_tensors()))
    one_clear_error(path, seconds=1.0)


@pytest.mark.parametrize("align", [0, 3, 48])
def test_alignment_must_be_a_power_of_two(tmp_path, align):
    path = write(tmp_path, raw_gguf(model_kvs(**{"general.alignment": (U32, align)}), model_tensors(), align=32))
    one_clear_error(path, match="general.alignment")


def test_deeply_nested_arrays_are_one_error(tmp_path):
    nested = struct.pack("<IQ", ARR, 1) * 100_000 + struct.pack("<IQ", U8, 0)  # 100,000 arrays, each holding the next
    path = write(tmp_path, raw_gguf(model_kvs(**{"junk.nested": (ARR, nested)}), model_tensors()))
    one_clear_error(path, match="nested")


@pytest.mark.parametrize("dims", [(2**32, 2**32, 2**32, 2**32), (2**63, 2**63), (2**64 - 1, 1), (64, 2**61)])
def test_dimension_products_are_checked(tmp_path, dims):
    tensors = model_tensors()
    tensors[0] = ("token_embd.weight", dims)
    path = write(tmp_path, raw_gguf(model_kvs(), tensors, offsets=[0] + [32 * i for i in range(1, len(tensors))],
                                    data=b"\0" * 4096))
    one_clear_error(path, match="runs past the end")


@pytest.mark.parametrize("n_kv,n_tensors", [(2**62, None), (None, 2**62), (10**6, None)])
def test_counts_are_bounded_by_the_file_size(tmp_path, n_kv, n_tensors):
    path = write(tmp_path, raw_gguf(model_kvs(), model_tensors(), n_kv=n_kv, n_tensors=n_tensors))
    one_clear_error(path, match="cannot fit")


def test_huge_array_count_is_bounded_by_the_file_size(tmp_path):
    path = write(tmp_path, raw_gguf(model_kvs(**{"junk.big": (ARR, struct.pack("<IQ", I32, 2**60))}), model_tensors()))
    one_clear_error(path, match="cannot fit")


def test_misshapen_and_duplicate_entries(tmp_path):
    tensors = model_tensors()
    tensors[3] = ("blk.0.attn_norm.weight", (HIDDEN * 2,))
    one_clear_error(write(tmp_path, raw_gguf(model_kvs(), tensors), "a.gguf"), match="config implies")
    tensors = model_tensors() + [("output.weight", (HIDDEN, VOCAB))]
    one_clear_error(write(tmp_path, raw_gguf(model_kvs(), tensors), "b.gguf"), match="appears twice")
    tensors = model_tensors() + [("lm_head.weight", (HIDDEN, VOCAB))]  # a second name for output.weight
    one_clear_error(write(tmp_path, raw_gguf(model_kvs(), tensors), "c.gguf"), match="are both")


@pytest.mark.parametrize("key,kind,value", [
    ("llama.block_count", STR, "2"), ("llama.embedding_length", F32, 64.0),
    ("llama.attention.layer_norm_rms_epsilon", STR, "x"), ("llama.rope.freq_base", F32, float("nan")),
    ("tokenizer.ggml.eos_token_id", U32, 10**6), ("llama.rope.scaling.type", U32, 1),
])
def test_values_of_the_wrong_type_are_one_error(tmp_path, key, kind, value):
    path = write(tmp_path, raw_gguf(model_kvs(**{key: (kind, value)}), model_tensors()))
    one_clear_error(path, seconds=1.0)


# --- fuzz: mutations of a valid file --------------------------------------------------------

def _fuzz(tmp_path, examples: int):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good = raw_gguf(model_kvs(**{"tokenizer.ggml.bos_token_id": (U32, 1), "tokenizer.ggml.eos_token_id": (U32, 2),
                                 "general.alignment": (U32, 32)}), model_tensors())
    header_end = good.index(b"\0" * 64) + 64 if b"\0" * 64 in good else 2048
    header_end = min(len(good), max(header_end, 1600))
    widths = {1: "<B", 4: "<I", 8: "<Q"}
    extremes = [0, 1, 2, 3, 31, 33, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1]
    path = tmp_path / "fuzz.gguf"
    bound = 4 * len(good) + 48 * MiB  # the file, the model it declares (~0.3 MiB of weights), the process's slack

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.integers(0, header_end - 1), st.sampled_from([1, 4, 8]),
                              st.one_of(st.sampled_from(extremes), st.integers(0, 2**64 - 1))),
                    min_size=1, max_size=4),
           st.one_of(st.none(), st.integers(4, len(good))))
    def case(edits, cut):
        b = bytearray(good)
        for at, width, value in edits:
            if at + width <= len(b):
                b[at:at + width] = struct.pack(widths[width], value % (1 << (8 * width)))
        if cut is not None:
            del b[cut:]
        path.write_bytes(bytes(b))
        out, took, used = measured(lambda: load_model(path))
        if isinstance(out, Exception):
            assert isinstance(out, QuickdraftError) and "\n" not in str(out), f"{type(out).__name__}: {out}"
        else:
            outcomes.add("loaded")
        assert took < 2.0, (took, out)
        assert used < bound, (used / MiB, out)

    outcomes: set[str] = set()
    case()
    assert outcomes  # some mutations (in names, in data) still load


def test_mutated_files_fail_cleanly(tmp_path):
    _fuzz(tmp_path, 200)


@pytest.mark.slow
def test_mutated_files_fail_cleanly_2000(tmp_path):
    _fuzz(tmp_path, 2000)


@pytest.mark.parametrize("examples", [40, pytest.param(400, marks=pytest.mark.slow)])
def test_mutated_tokenizer_metadata_fails_cleanly(tmp_path, monkeypatch, examples):
    """The metadata folder (config and tokenizer from the header) of mutated files with a vocabulary."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from test_gguf import hf_model, vocab_size, write_gguf

    good = write_gguf(tmp_path / "good.gguf", hf_model("llama", vocab_size("gpt2")), "llama").read_bytes()
    header_end = 60_000 if len(good) > 60_000 else len(good)  # the vocabulary and merges come first
    path = tmp_path / "fuzz.gguf"
    n = [0]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.integers(0, header_end - 8), st.sampled_from([1, 4, 8]),
                              st.integers(0, 2**64 - 1)), min_size=1, max_size=3))
    def case(edits):
        b = bytearray(good)
        for at, width, value in edits:
            b[at:at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
        n[0] += 1
        monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / f"cache{n[0]}"))
        path.write_bytes(bytes(b))
        out, took, _ = measured(lambda: checkpoint_dir(path))
        if isinstance(out, Exception):
            assert isinstance(out, QuickdraftError) and "\n" not in str(out), f"{type(out).__name__}: {out}"
        assert took < 5.0, (took, out)

    case()
