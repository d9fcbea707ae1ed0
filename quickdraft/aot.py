"""Ahead-of-time compiled forward steps on CPU: AOTInductor packages, built once, cached on disk.

On a CPU, eager PyTorch spends a few microseconds of dispatch on every operator: ~40 per
layer, which at batch 1 is a quarter of SmolLM2-135M's step and a third of the bundled
target's (benchmarks/results/llamacpp_cpu.md). `torch.compile` removes it but re-traces the
model at every start-up (25-75 s here, even with Inductor's disk cache). An AOTInductor
package is the compiled step as a shared library: loading it takes a fraction of a second.

- One package per model *shape* (config, weight formats, dtype), torch version and CPU
  capability, under `<cache>/aot/` (`QUICKDRAFT_CACHE`, else ~/.cache/quickdraft). The
  weights are not in it: they are handed to the package at load time (the model's own
  tensors, shared, not copied), so one package serves every checkpoint of that shape.
  Except int4 on PyTorch's own kernel (CPUs without AVX-512): Inductor turns the kernel's
  group size into tensor constants of its own, which only a package with its weights inside
  carries; such a package embeds them (a second copy of the packed weights in memory, 0.56
  byte per weight) and its key includes a fingerprint of the weights. int4 on quickdraft's
  blocked kernel does not.
- Exported with symbolic batch size, query length, key length, cache rows and cache
  capacity: one package serves decode (1 token), verify (k + 1 tokens) and every context length.
- What it covers: `model(input_ids, positions, cache, kv_len=...)`, the decode and chain
  verify steps (and a draft model's one-token steps), and an EAGLE-3 head's chain calls: two
  packages per head, one reading the target's states (`-e3p`), one drafting from its own
  output (`-e3d`), the target's embedding handed over like the head's weights
  (`HeadAOTStep`). Token trees (a step with slots and an attention mask: the target's tree
  verify, an EAGLE-3 head's tree depths) have packages of their own (`-t`), built when the
  proposer may draft trees. Prefill and gathers run eagerly, as before; so do calls with
  more rows than a linear keeps on the path the package traced (`FastLinear.kernel_rows`: int8 /
  int4 on PyTorch's kernels switch to a dense GEMM past 16 rows; quickdraft's kernels never switch).
- `build(model)` compiles (about a minute per model here, once); `load(model)` returns the
  cached step or None. `LLM(compile="aot")` / `--aot` builds what is missing before the first
  token. By default a CPU engine uses the packages cached for its models; where some are
  missing it decodes eagerly at once while a `BackgroundBuild` (a separate process at low
  priority, one thread, outliving this one) builds them, and switches to them when it is done,
  at a step boundary with no request in flight (a request never runs partly eagerly and
  partly compiled: the two round differently; `Engine.switch_when_built`); a process that starts
  while another builds the same packages waits for that build (`running_build`); later
  processes load them (`QUICKDRAFT_AOT_BUILD=0`: no background build). A build holds a lock per
  package (`BuildLock`: a second builder waits, a dead or silent holder's lock is broken, never
  a hang) and writes a temporary file that only a complete build renames into place. A package whose folder or file another user owns or
  others can write to is not loaded (one warning; the step runs eagerly): see
  `quickdraft.paths.unsafe_to_load`, the kernels' check too.

The outputs equal the eager forward's to float rounding (Inductor fuses the elementwise ops);
tests check greedy decoding through a package against plain decoding and the logits against
eager ones.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .cache import CacheView, cache_dtype
from .errors import QuickdraftError
from . import kernels
from .model import eagle3, formats, quant, transformer
from .model.formats import FastLinear
from .model.sources import cache_dir
from .paths import unsafe_to_load

log = logging.getLogger("quickdraft")

MIN_TORCH = "2.13"  # the first version whose packages without weights load (2.13.0 tested)
# upper bounds of the symbolic sizes (export needs them finite; they are far above use)
_MAX_ROWS, _MAX_QUERY, _MAX_SLOTS = 4096, 4096, 1 << 20
# prompt tokens one packed (mixed-step) call computes at most: an engine whose chunks run that package
# caps its per-step token budget here (a whole 10,000-token prompt is prefilled in three steps)
MAX_CHUNK_TOKENS = _MAX_QUERY


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot have a package here, or None."""
    if model.device.type != "cpu":
        return f"AOT steps are for CPU (this model is on {model.device.type}; CUDA uses CUDA graphs)"
    if torch.torch_version.TorchVersion(torch.__version__) < MIN_TORCH:
        # torch 2.11 builds such packages but dies with a segmentation fault loading them
        # (seen on the H200 machine: benchmarks/results/gpu_check_h200_formats.md)
        return f"AOT steps need torch >= {MIN_TORCH} (this is {torch.__version__})"
    return next((m.export_blocker for m in _linears(model) if m.export_blocker), None)


def _linears(model: nn.Module) -> list[FastLinear]:
    return [m for m in model.modules() if isinstance(m, FastLinear)]


def _calls_kernels(model: nn.Module) -> bool:
    return any(m.calls_kernels for m in _linears(model))


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """The code a package was traced from: a change to the forward invalidates old packages."""
    h = hashlib.sha256()
    for module in (transformer, quant, formats, kernels, eagle3):
        h.update(inspect.getsource(module).encode())
    for source in kernels.SOURCES:  # the blocked format's kernels, which packages call
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def _embeds_weights(model: nn.Module) -> bool:
    return any(m.embeds_weights for m in _linears(model))


def _fingerprint(model: nn.Module, project: bool | None = None) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(_constants(_HeadStep(model, bool(project)) if _is_head(model) else _Step(model)).items()):
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def shape_key(model: nn.Module) -> str:
    """What a package depends on besides the weights."""
    formats = [(name, type(m).__name__, m.out_features, m.in_features,  # (with a packed layout's shape: int4's
                tuple(m.qpacked.shape) if hasattr(m, "qpacked") else None)   # three layouts share a class)
               for name, m in model.named_modules() if isinstance(m, FastLinear)]
    spec = {"config": asdict(model.config), "dtype": str(model.dtype), "formats": formats,
            "kv_dtype": str(cache_dtype(model)),
            "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "source": _source_hash()}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:24]


def aot_dir() -> Path:
    """Where packages live: `QUICKDRAFT_AOT_DIR`, else `<cache>/aot` (a background build is told
    its parent's folder this way)."""
    env = os.environ.get("QUICKDRAFT_AOT_DIR")
    return Path(env).expanduser() if env else cache_dir() / "aot"


def package_path(model: nn.Module, hidden_at: tuple[int, ...] | None = None, project: bool | None = None,
                 tree: bool = False, packed: bool = False) -> Path:
    """`<cache>/aot/<shape key>[-h<layers>][-t|-m].pt2`, with the weights' fingerprint appended
    where they are inside; `-h<layers>` for the variant that also returns those layers' states,
    `-t` for token trees (slots and a mask), `-m` for mixed steps (the running rows and prompt
    chunks in one forward: _PackedStep); an EAGLE-3 head's variants end in `-e3p` (from the
    target's states) and `-e3d` (drafting; `-e3d-...-t` for tree depths)."""
    name = (_prefix(model, hidden_at, project, tree, packed)
            + (f"-{_fingerprint(model, project)}" if _embeds_weights(model) else ""))
    return aot_dir() / f"{name}.pt2"


def _prefix(model: nn.Module, hidden_at, project, tree: bool, packed: bool = False) -> str:
    return (shape_key(model) + _hidden_suffix(hidden_at) + _head_suffix(model, project) + ("-t" if tree else "")
            + ("-m" if packed else ""))


def _is_head(model: nn.Module) -> bool:
    return isinstance(model, eagle3.Eagle3Head)


def _head_suffix(model: nn.Module, project: bool | None) -> str:
    if not _is_head(model):
        return ""
    hc = model.head_config  # what the graph depends on beyond the layer's config and formats
    extra = f"{hc.target_hidden_size}-{len(model.aux_layers)}-{int(hc.norm_before_residual)}"
    return f"-e3{'p' if project else 'd'}-" + hashlib.sha256(extra.encode()).hexdigest()[:8]


def _hidden_suffix(hidden_at: tuple[int, ...] | None) -> str:
    return "" if hidden_at is None else "-h" + "_".join(map(str, hidden_at))


class _Step(nn.Module):
    """The exported signature: tensors only (key_pos's length is the key length)."""

    def __init__(self, model: nn.Module, hidden_at: tuple[int, ...] | None = None):
        super().__init__()
        self.model = model
        self.hidden_at = hidden_at

    def forward(self, input_ids, positions, key_pos, ks, vs):
        cache = CacheView(list(ks), list(vs), ks[0].shape[2] - 1)
        return self.call(input_ids, positions, cache, kv_len=key_pos.shape[0])

    def call(self, *args, **kwargs):
        """The model's forward, or with hidden_at its forward_hidden (a tuple)."""
        if self.hidden_at is None:
            return self.model(*args, **kwargs)
        return self.model.forward_hidden(*args, **kwargs, hidden_at=self.hidden_at)


class _TreeStep(_Step):
    """A token-tree step: where each query's k/v goes (slots) and which keys it reads (the mask,
    whose length is the key length)."""

    def forward(self, input_ids, positions, slots, attn_mask, ks, vs):
        cache = CacheView(list(ks), list(vs), ks[0].shape[2] - 1)
        return self.call(input_ids, positions, cache, kv_len=attn_mask.shape[-1], slots=slots, attn_mask=attn_mask)


class _HeadStep(nn.Module):
    """An EAGLE-3 head's exported signature. The target's embedding, which the head reads but
    does not own, is registered here so the package takes it at load time like the head's
    own weights (shared, not copied)."""

    def __init__(self, head: nn.Module, project: bool):
        super().__init__()
        self.head = head
        self.embed_tokens = head.embed_tokens
        self.project = project

    def forward(self, input_ids, hidden, positions, key_pos, k, v):
        cache = CacheView([k], [v], k.shape[2] - 1)
        return self.head(input_ids, hidden, positions, cache, kv_len=key_pos.shape[0], project=self.project)


class _HeadTreeStep(_HeadStep):
    """An EAGLE-3 head's tree depth: drafting from its own output (project=False) with slots and
    a mask."""

    def forward(self, input_ids, hidden, positions, slots, attn_mask, k, v):
        cache = CacheView([k], [v], k.shape[2] - 1)
        return self.head(input_ids, hidden, positions, cache, kv_len=attn_mask.shape[-1], slots=slots,
                         attn_mask=attn_mask, project=False)


class _PackedStep(_Step):
    """A mixed step (Transformer.forward_packed over two blocks): block a, the running rows'
    verify tokens (B, T) on cache views of their own (ks_a, vs_a: the running rows), logits at
    every position; block b, prompt chunks (Bc, C), right-padded (position -1), on the prefilling
    rows' views (ks_b, vs_b), logits after each row's last token (last_b (Bc, 1)). Every token
    goes through the same linear layers and pointwise code whatever block it is in and whatever
    else the call holds, so an engine that runs all its chunks and mixed steps through this one
    package gives a prompt the same bits mixed or not."""

    def forward(self, ids_a, pos_a, key_pos_a, ids_b, pos_b, last_b, key_pos_b, ks_a, vs_a, ks_b, vs_b):
        view_a = CacheView(list(ks_a), list(vs_a), ks_a[0].shape[2] - 1)
        view_b = CacheView(list(ks_b), list(vs_b), ks_b[0].shape[2] - 1)
        blocks = [transformer.Block(ids_a, pos_a, 0, key_pos_a.shape[0], cache=view_a),
                  transformer.Block(ids_b, pos_b, 0, key_pos_b.shape[0], logits_at=last_b, cache=view_b)]
        (la, ha), (lb, hb) = self.model.forward_packed(blocks, None, self.hidden_at)
        return (la, lb) if self.hidden_at is None else (la, ha, lb, hb)


def _constants(step: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(step.named_parameters(remove_duplicate=False))
    named.update(step.named_buffers(remove_duplicate=False))
    return {name: t.detach() for name, t in named.items()}


def build(model: nn.Module, path: Path | None = None, hidden_at: tuple[int, ...] | None = None,
          project: bool | None = None, tree: bool = False, packed: bool = False) -> Path:
    """Export and compile `model`'s decode/verify forward into a package (once per shape); with
    `hidden_at`, the forward that also returns those layers' states (Transformer.forward_hidden). For
    an EAGLE-3 head, `project` picks the variant: reading the target's states (True) or its own
    previous output (False). `tree`: the step with slots and an attention mask (token trees;
    for a head, drafting only). `packed`: the mixed step (_PackedStep; a target's only)."""
    if tree and _is_head(model) and project:
        raise QuickdraftError("an EAGLE-3 head's tree package drafts from its own output (project=False)")
    if packed and (tree or _is_head(model)):
        raise QuickdraftError("the packed (mixed-step) package is a target's chain step only")
    reason = unsupported(model)
    if reason:
        raise QuickdraftError(reason)
    from torch.export import Dim, export

    from .cache import KVCache

    head = _is_head(model)
    path = path or package_path(model, hidden_at, project, tree, packed)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # private: packages are code this process runs
    start = time.perf_counter()
    # example sizes: all > 1 and distinct, so none is specialised
    cache = (KVCache(1, 3, model.config.num_key_value_heads, 16, model.config.head_dim, model.dtype, model.device)
             if head else KVCache.for_model(model, 3, 16))
    ids = torch.zeros(2, 2, dtype=torch.long)
    positions = torch.tensor([[5, 6], [7, 8]])
    key_pos = torch.arange(9)
    B, T = Dim("batch", max=_MAX_ROWS), Dim("query", max=_MAX_QUERY)
    S, R, C = Dim("keys", min=2, max=_MAX_SLOTS), Dim("rows", max=_MAX_ROWS), Dim("slots", min=3, max=_MAX_SLOTS)
    per_layer = [{0: R, 2: C}] * len(cache.k)
    # a tree step takes (slots, mask) where a chain step takes the key length
    keys = ((positions.clone(), torch.ones(2, 2, 9, dtype=torch.bool)) if tree else (key_pos,))
    key_dims = ({0: B, 1: T}, {0: B, 1: T, 2: S}) if tree else ({0: S},)
    if head:  # (input_ids, hidden, positions, key_pos | slots + mask, k, v): one layer
        width = (len(model.aux_layers) * model.head_config.target_hidden_size if project
                 else model.config.hidden_size)
        step = (_HeadTreeStep(model, False) if tree else _HeadStep(model, bool(project))).eval()
        args = (ids, torch.zeros(2, 2, width, dtype=model.dtype), positions, *keys, cache.k[0], cache.v[0])
        dims = ({0: B, 1: T}, {0: B, 1: T}, {0: B, 1: T}, *key_dims, {0: R, 2: C}, {0: R, 2: C})
    elif packed:  # two blocks, each with its own sizes and cache views
        step = _PackedStep(model, hidden_at).eval()
        cache_b = KVCache.for_model(model, 5, 18)
        Bb, Tb = Dim("chunk_rows", max=_MAX_ROWS), Dim("chunk", max=_MAX_QUERY)
        Sb, Rb, Cb = (Dim("chunk_keys", min=2, max=_MAX_SLOTS), Dim("chunk_cache_rows", max=_MAX_ROWS),
                      Dim("chunk_slots", min=3, max=_MAX_SLOTS))
        args = (ids, positions, key_pos, torch.zeros(4, 7, dtype=torch.long), torch.arange(3, 10).expand(4, 7).clone(),
                torch.full((4, 1), 6), torch.arange(11), cache.k, cache.v, cache_b.k, cache_b.v)
        chunk_layer = [{0: Rb, 2: Cb}] * len(cache_b.k)
        dims = ({0: B, 1: T}, {0: B, 1: T}, {0: S}, {0: Bb, 1: Tb}, {0: Bb, 1: Tb}, {0: Bb}, {0: Sb},
                per_layer, per_layer, chunk_layer, chunk_layer)
    else:
        step = (_TreeStep if tree else _Step)(model, hidden_at).eval()
        args = (ids, positions, *keys, cache.k, cache.v)
        dims = ({0: B, 1: T}, {0: B, 1: T}, *key_dims, per_layer, per_layer)
    with BuildLock(path):
        if path.exists():  # built by another process while this one waited for the lock
            return path
        for stale in path.parent.glob(f"{path.stem}.*.tmp.pt2"):  # left by a build that was killed
            stale.unlink(missing_ok=True)
        # a name of this process's own, renamed into place only when complete: a failed or killed
        # build never leaves a package that looks complete
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
        try:
            with torch.no_grad(), formats.kernels_only():
                program = export(step, args, dynamic_shapes=dims, strict=False)
                configs = {"aot_inductor.package_constants_in_so": _embeds_weights(model)}
                if _calls_kernels(model):
                    configs.update(kernels.aoti_config())  # direct calls, not the proxy executor
                if hasattr(torch._inductor.config, "emulate_precision_casts"):
                    configs["emulate_precision_casts"] = True  # bf16 activations rounded where eager rounds them
                torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=configs)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    log.info("quickdraft: AOT step built in %.1f s: %s", time.perf_counter() - start, path)
    return path


class BuildLock:
    """Who builds a package: `<package>.lock`, created exclusively, holding its owner's pid, host
    and start time, touched every HEARTBEAT_S while held. A second builder waits for it, then
    finds the package built. A lock is broken (with one line saying why) when its process is
    gone (same host), when it has not been touched for STALE_S (the holder was killed or its
    machine stopped), or when it is older than MAX_S: a killed build never blocks the next one.
    (Two waiters breaking the same stale lock at once can both build: each writes its own
    temporary file and renames a complete package, so the cost is time, never a broken file.)"""

    HEARTBEAT_S = 10.0
    STALE_S = 60.0
    MAX_S = 3600.0
    POLL_S = 0.5

    def __init__(self, package: Path):
        self.path = package.with_name(package.name + ".lock")
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> "BuildLock":
        said = False
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                why = self.stale()
                if why:
                    log.warning("quickdraft: breaking the AOT build lock %s (%s)", self.path, why)
                    self.path.unlink(missing_ok=True)
                    continue
                if not said:
                    log.warning("quickdraft: waiting for another process's build of %s", self.path.name[:-5])
                    said = True
                time.sleep(self.POLL_S)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "created": time.time(),
                           "token": self.token}, f)
            self._stop.clear()
            self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="quickdraft-aot-lock")
            self._beat.start()
            return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self._owner() == self.token:
            self.path.unlink(missing_ok=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # broken by someone who judged it stale: nothing to keep alive
                return

    def _info(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):  # gone, or being written this instant
            return {}

    def _owner(self) -> str | None:
        return self._info().get("token")

    def stale(self) -> str | None:
        """Why the lock's holder no longer builds (then the lock may be broken), or None."""
        try:
            touched = self.path.stat().st_mtime
        except FileNotFoundError:
            return None  # released meanwhile: the next try takes it
        info, now = self._info(), time.time()
        if now - touched > self.STALE_S:
            return f"not touched for {now - touched:.0f} s"
        if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int) \
                and not _alive(info["pid"]):
            return f"its process {info['pid']} is gone"
        if isinstance(info.get("created"), (int, float)) and now - info["created"] > self.MAX_S:
            return f"held for {now - info['created']:.0f} s"
        return None


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return True


def mixed_packages_enabled() -> bool:
    """Whether a CPU engine with a row-invariant target uses (and builds) the packed mixed-step
    package (QUICKDRAFT_AOT_MIXED=0: never; its prompt chunks and decode steps then alternate)."""
    return os.environ.get("QUICKDRAFT_AOT_MIXED", "1").strip().lower() not in ("0", "false", "no", "off")


def background_builds_enabled() -> bool:
    """Whether a CPU engine may build its missing packages in the background (QUICKDRAFT_AOT_BUILD=0: never)."""
    return os.environ.get("QUICKDRAFT_AOT_BUILD", "1").strip().lower() not in ("0", "false", "no", "off")


class BackgroundBuild:
    """Packages built by another process while this one decodes eagerly: `python -c` calling
    `entry(payload)` (a function that builds them, e.g. LLM(..., compile="aot")), at low priority
    (nice 10) with one thread, so that the decoding process keeps the other cores. It runs in its
    own session and outlives this process: a short run that exits before the build is done
    still leaves the packages for the next start. Its output goes to `log_path`."""

    def __init__(self, entry: str, payload: str, name: str):
        module, func = entry.rsplit(".", 1)
        folder = aot_dir()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.log_path = folder / f"build-{name}.log"
        root = str(Path(__file__).resolve().parents[1])  # this quickdraft, whatever the child's path says
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                   QUICKDRAFT_AOT_DIR=str(folder), QUICKDRAFT_AOT_BUILD="0",
                   PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        code = f"import sys; from {module} import {func}; {func}(sys.argv[1])"
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen([sys.executable, "-c", code, payload], stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started = time.perf_counter()
        try:  # (for running_build: another process with the same recipe waits on this one)
            (folder / f"build-{name}.pid").write_text(str(self.process.pid))
        except OSError:
            pass

    @property
    def pid(self) -> int:
        return self.process.pid

    def done(self) -> bool:
        """Whether the build process has ended (a cheap, non-blocking check)."""
        return self.process.poll() is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build ends (or `timeout` seconds pass); whether it ended."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def failure(self) -> str | None:
        """Why the ended build failed (its exit status and its log's last line), or None."""
        code = self.process.poll()
        if code == 0:
            return None
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return f"exit status {code}" + (f": {lines[-1].strip()}" if lines else "") + f"; log: {self.log_path}"


def _stat(pid: int) -> list[str] | None:
    """Process `pid`'s /proc stat fields after its name (state first), or None where it has none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie waiting for its parent has)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def _age(pid: int) -> float:
    """Seconds since process `pid` started (0 where /proc cannot tell)."""
    try:
        start_ticks = int(_stat(pid)[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, TypeError):
        return 0.0


class RunningBuild:
    """A background build of the same recipe that another process started and that still runs
    (running_build), waited on instead of started again: each further start held a Python
    process of ~0.5 GB waiting on the first one's lock (8 of them seen after short runs in a row)."""

    def __init__(self, pid: int, log_path: Path):
        self.pid, self.log_path = pid, log_path
        self.started = time.perf_counter() - _age(pid)  # (BackgroundBuild's clock: the switch's log line)

    def done(self) -> bool:
        return not _running(self.pid)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.25)
        return True

    def failure(self) -> str | None:
        """None: its exit status is its parent's to read; the packages it left, or not, say the
        rest (an engine that finds none keeps its eager steps and says so)."""
        return None


def running_build(name: str, payload: str) -> RunningBuild | None:
    """The build of `payload` (BackgroundBuild's name for it: `name`) that another process started
    and that still runs: its pid file in the AOT folder names a live process whose command line
    ends with the same recipe; else None (also where /proc is not there to tell)."""
    folder = aot_dir()
    try:
        pid = int((folder / f"build-{name}.pid").read_text())
        args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except (OSError, ValueError):
        return None
    if len(args) < 2 or args[-1] != payload or "build_aot" not in args[-2] or not _running(pid):
        return None
    return RunningBuild(pid, folder / f"build-{name}.log")


def lower_priority() -> None:
    """For a background build: nice 10 and one thread, so that decoding keeps its cores. Where
    Linux groups processes by session for scheduling (autogroups, on by default in most
    distributions), a nice value counts only within the group, and the build, in a session of its
    own, would share a busy core half and half with the decoding process: so a build that leads
    its own session gives its group nice 10 too (/proc/self/autogroup; measured with README's
    first command from an empty cache: benchmarks/results/first_command_fresh_smollm2_cpu.md)."""
    try:
        os.nice(10)
    except (AttributeError, OSError):  # not on this platform / not allowed: it still runs
        pass
    if hasattr(os, "getsid") and os.getsid(0) == os.getpid():  # its own session (never a user's shell's group)
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write("10")
        except OSError:  # no autogroups (kernel option off, not Linux): nice alone counts
            pass
    torch.set_num_threads(1)


class AOTStep:
    """A drop-in for calling the model in the decode / verify / draft paths: the package runs
    `model(input_ids, positions, cache, kv_len=...)`; every other call goes to the model."""

    def __init__(self, model: nn.Module, runner, path: Path, hidden_at: tuple[int, ...] | None = None,
                 tree: tuple | None = None, packed: tuple | None = None):
        self.model = model
        self.runner = runner
        self.path = path
        self.hidden_at = hidden_at  # the states this package returns with the logits (None: logits only)
        self.tree_runner, self.tree_path = tree or (None, None)  # token trees' package, if loaded
        self.packed_runner, self.packed_path = packed or (None, None)  # mixed steps' package, if loaded
        self.max_rows = _max_rows(model)
        self._key_pos = torch.arange(0)
        self._scratch = None  # a 1-row cache for the block a packed call without one computes (one token)

    def packed(self, a: tuple | None, b: tuple | None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """A mixed step on the packed package (_PackedStep): a = (input_ids (B, T), positions, cache
        view of the B rows, kv_len), the running rows' verify tokens; b = (input_ids (Bc, C),
        positions (-1: padding), last (Bc, 1): each row's last chunk token, view of the Bc rows,
        kv_len), the prompt chunks. Either may be None (a step with the other alone): then one
        token on a scratch row of its own stands in (its outputs dropped), so that every chunk and
        every mixed step runs the same package. Returns [(logits_a (B, T, V), hidden_a | None),
        (logits_b (Bc, 1, V), hidden_b | None)], None for a missing block."""
        if a is None or b is None:
            if self._scratch is None:
                from .cache import KVCache

                self._scratch = KVCache.for_model(self.model, 1, 2).rows(0, 1)
            one = torch.zeros(1, 1, dtype=torch.long)
            a = a or (one, one, self._scratch, 2)
            b = b or (one, one, one, self._scratch, 2)
            missing = 0 if a[2] is self._scratch else 1
        else:
            missing = None
        ids_a, pos_a, view_a, len_a = a
        ids_b, pos_b, last_b, view_b, len_b = b
        longest = max(len_a, len_b, 2)
        if self._key_pos.shape[0] < longest:
            self._key_pos = torch.arange(max(longest, 2 * self._key_pos.shape[0]))
        out = self.packed_runner(ids_a.contiguous(), pos_a.contiguous(), self._key_pos[:max(len_a, 2)],
                                 ids_b.contiguous(), pos_b.contiguous(), last_b.contiguous(),
                                 self._key_pos[:max(len_b, 2)], view_a.k, view_a.v, view_b.k, view_b.v)
        pairs = [(out[0], None), (out[1], None)] if self.hidden_at is None else [(out[0], out[1]), (out[2], out[3])]
        if missing is not None:
            pairs[missing] = None
        return pairs

    def packed_agrees(self) -> bool:
        """Whether the packed package gives running rows the bits this step's package gives them (a
        probe on caches of its own: 2 rows x 2 tokens beside a 3-token chunk). Both are compiled from
        the same per-token code, so they agree where Inductor generates the same kernels for it; a
        mixed step would otherwise change what the running requests output."""
        from .cache import KVCache

        g = torch.Generator().manual_seed(0)
        V, n = self.model.config.vocab_size, self.model.config.num_hidden_layers
        ids, positions = torch.randint(0, V, (2, 2), generator=g), torch.tensor([[3, 4], [5, 6]])
        caches = [KVCache.for_model(self.model, 3, 8) for _ in range(2)]
        for c in caches:  # the same context in both (random keys and values)
            for t in c.k + c.v:
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(n)).to(t.dtype))
        with torch.inference_mode():
            alone = self._package(ids, positions, caches[0].rows(0, 2), 7, None, None, None)
            chunk = (torch.randint(0, V, (1, 3), generator=g), torch.arange(3)[None], torch.tensor([[2]]),
                     caches[1].rows(2, 3), 3)
            (logits, hidden), _ = self.packed((ids, positions, caches[1].rows(0, 2), 7), chunk)
        want = (alone, None) if self.hidden_at is None else tuple(alone)
        return (torch.equal(want[0], logits) and (hidden is None or torch.equal(want[1], hidden))
                and all(torch.equal(a[:2], b[:2]) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v)))

    def __call__(self, input_ids, positions=None, cache: CacheView | None = None, *, kv_len=None,
                 slots=None, attn_mask=None, logits_at=None) -> torch.Tensor:
        """The model's forward: logits (from the package when it returns logits only and fits)."""
        if self.hidden_at is None:
            out = self._package(input_ids, positions, cache, kv_len, slots, attn_mask, logits_at)
            if out is not None:
                return out
        return self.model(input_ids, positions, cache, kv_len=kv_len, slots=slots, attn_mask=attn_mask,
                          logits_at=logits_at)

    def forward_hidden(self, input_ids, positions=None, cache: CacheView | None = None, *, kv_len=None,
                       slots=None, attn_mask=None, logits_at=None, hidden_at) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward_hidden: (logits, hidden), from the package when it returns these
        layers' states and fits."""
        if tuple(hidden_at) == self.hidden_at:
            out = self._package(input_ids, positions, cache, kv_len, slots, attn_mask, logits_at)
            if out is not None:
                return tuple(out)
        return self.model.forward_hidden(input_ids, positions, cache, kv_len=kv_len, slots=slots, attn_mask=attn_mask,
                                         logits_at=logits_at, hidden_at=hidden_at)

    def _package(self, input_ids, positions, cache, kv_len, slots, attn_mask, logits_at):
        """The package's output for a call it serves, else None (then the model runs)."""
        B, T = input_ids.shape
        if slots is not None or attn_mask is not None:
            if (self.tree_runner is not None and _tree_call_fits(positions, cache, kv_len, slots, attn_mask, B * T,
                                                                 self.max_rows)
                    and logits_at is None):
                return self.tree_runner(input_ids.contiguous(), positions.contiguous(), slots.contiguous(),
                                        attn_mask.contiguous(), cache.k, cache.v)
            return None
        if (cache is None or positions is None or B * T > self.max_rows or T > _MAX_QUERY
                or not cache.k[0].is_contiguous()):
            return None
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        if self._key_pos.shape[0] < kv_len:
            self._key_pos = torch.arange(max(kv_len, 2 * self._key_pos.shape[0]))
        # the package assumes the strides it was traced with (contiguous): an expanded view
        # (stride 0) would be read as if it were not
        out = self.runner(input_ids.contiguous(), positions.contiguous(), self._key_pos[:max(kv_len, 2)],
                          cache.k, cache.v)
        if logits_at is None:
            return out
        # the logits at `logits_at` (B, n) only, as the model's forward gives them: the package computes
        # every position's (a draft's catch-up: 2 tokens a row), the rows' bits the same either way
        pick = logits_at.to(input_ids.device)[..., None]
        if self.hidden_at is None:
            return out.gather(1, pick.expand(-1, -1, out.shape[-1]))
        return (out[0].gather(1, pick.expand(-1, -1, out[0].shape[-1])), out[1])

    def __repr__(self) -> str:
        return f"AOTStep({self.path.name}{'' if self.tree_path is None else ', ' + self.tree_path.name})"


def _max_rows(model: nn.Module) -> int:
    """Rows a package call may have: the fewest up to which a linear stays on the path the
    package traced (`FastLinear.kernel_rows`; past them, eager mode switches paths, e.g. a
    quantised matmul on PyTorch's kernel to its dense path), else _MAX_ROWS."""
    return min((m.kernel_rows for m in _linears(model) if m.kernel_rows is not None), default=_MAX_ROWS)


def _tree_call_fits(positions, cache, kv_len, slots, attn_mask, rows: int, max_rows: int) -> bool:
    """Whether a call with slots and a mask is one the tree package takes."""
    return (cache is not None and positions is not None and slots is not None and attn_mask is not None
            and attn_mask.dtype == torch.bool and attn_mask.dim() == 3 and attn_mask.shape[-1] >= 2
            and (kv_len is None or kv_len == attn_mask.shape[-1]) and rows <= max_rows
            and positions.shape[1] <= _MAX_QUERY and cache.k[0].is_contiguous())


def load(model: nn.Module, path: Path | None = None, hidden_at: tuple[int, ...] | None = None, trees: bool = False,
         packed: bool = False):
    """The model's cached package as a step, or None (no package, or not loadable here). For an
    EAGLE-3 head: a HeadAOTStep over its two variants, or None unless both are cached. `trees`:
    with the token-tree package too where it is cached (tree steps run eagerly otherwise);
    `packed`: with the mixed-step package where it is cached (AOTStep.packed)."""
    if unsupported(model):
        return None
    if _is_head(model):
        runners = {p: _runner(model, None, None, p) for p in (True, False)}
        if not all(runners.values()):
            return None
        return HeadAOTStep(model, runners, _runner(model, None, None, False, tree=True) if trees else None)
    runner = _runner(model, path, hidden_at, None)
    if runner is None:
        return None
    tree = _runner(model, None, hidden_at, None, tree=True) if trees and path is None else None
    mixed = _runner(model, None, hidden_at, None, packed=True) if packed and path is None else None
    return AOTStep(model, runner[0], runner[1], hidden_at, tree, mixed)


class _DirectRunner:
    """A loaded package called without torch's per-call wrapper, which parses the package's
    input and output specs from text and flattens the arguments on every call (~70 us a step
    on a 2 GHz core: the bundled int4 step took 2091 instead of 2159 us without it). Our steps pass tensors and lists of tensors
    only, in the order the package was traced with, so the flat inputs are the arguments'
    leaves; outputs come back as one tensor or a tuple, as the spec parsed once here says.
    `run` takes the flat inputs; `call_spec` is the package's (inputs, outputs) spec."""

    def __init__(self, run, call_spec: list[str]):
        self._run = run
        self._single = pytree.treespec_loads(call_spec[1]).is_leaf()

    def __call__(self, *args):
        flat: list[torch.Tensor] = []
        for a in args:
            if isinstance(a, torch.Tensor):
                flat.append(a)
            else:
                flat.extend(a)
        out = self._run(flat)
        return out[0] if self._single else tuple(out)


class _PackageRunner(_DirectRunner):
    """A package loaded through quickdraft's runner (kernels.aot_package_class()), which releases
    the GIL while a step runs. PyTorch's loader holds it: a server's event loop, which streams
    tokens, then waits for every step, and a 4,000-token prompt's mixed steps stalled four streams
    for up to 700 ms each (benchmarks/results/chunked_prefill_aot_*)."""

    def __init__(self, package):
        self.package = package
        super().__init__(package.run, package.call_spec())

    def get_constant_fqns(self) -> list[str]:
        return self.package.constant_fqns()

    def load_constants(self, constants: dict, check_full_update: bool = False, user_managed: bool = False) -> None:
        self.package.load_constants(constants, check_full_update, user_managed)


class _WrappedRunner(_DirectRunner):
    """PyTorch's loaded package (torch._inductor.aoti_load_package) called through its loader."""

    def __init__(self, compiled, loader):
        self.compiled = compiled
        super().__init__(loader.boxed_run, loader.get_call_spec())

    def __getattr__(self, name):  # load_constants, get_constant_fqns, ...
        return getattr(self.compiled, name)


def _load_package(path: Path):
    """The package at `path`, loaded through quickdraft's runner where it is available (steps
    release the GIL), else through PyTorch's loader (behind a _WrappedRunner where this torch
    exposes the loader, else as torch returns it)."""
    package_class = kernels.aot_package_class()
    if package_class is not None:
        return _PackageRunner(package_class(str(path)))
    compiled = torch._inductor.aoti_load_package(str(path))
    loader = getattr(compiled, "loader", None)
    if loader is None or not hasattr(loader, "boxed_run") or not hasattr(loader, "get_call_spec"):
        return compiled
    try:
        return _WrappedRunner(compiled, loader)
    except Exception:  # noqa: BLE001 - a spec this torch writes differently: the wrapper copes
        return compiled


_REFUSED: set[Path] = set()  # packages refused as unsafe (said once each)


def _runner(model: nn.Module, path: Path | None, hidden_at: tuple[int, ...] | None, project: bool | None,
            tree: bool = False, packed: bool = False):
    """(the loaded package, its path), its weights handed over from the model; or None."""
    if path is None:
        prefix = _prefix(model, hidden_at, project, tree, packed)
        if not any(p.name == f"{prefix}.pt2" or (_embeds_weights(model) and p.name.startswith(prefix + "-"))
                   for p in aot_dir().glob(f"{prefix}*.pt2")):
            return None  # (before fingerprinting an int4 model's weights)
        path = package_path(model, hidden_at, project, tree, packed)
    if not path.exists():
        return None
    problem = unsafe_to_load(aot_dir(), path.parent, path)
    if problem:  # someone else could have put code there: never load it
        if path not in _REFUSED:
            _REFUSED.add(path)
            log.warning("quickdraft: the AOT step %s is not loaded from a folder or file others can change (%s); "
                        "running eagerly", path, problem)
        return None
    try:
        if _calls_kernels(model) and not kernels.available():
            raise QuickdraftError("the package calls quickdraft's CPU kernel, which is not available")
        runner = _load_package(path)
        if _embeds_weights(model):
            return runner, path
        constants = _constants(_HeadStep(model, bool(project)) if _is_head(model) else _Step(model))
        wanted = runner.get_constant_fqns()
        missing = [name for name in wanted if name not in constants]
        if missing:
            raise QuickdraftError(f"the package wants tensors the model lacks: {missing[:3]}")
        runner.load_constants({name: constants[name] for name in wanted}, check_full_update=True, user_managed=True)
    except Exception as exc:  # noqa: BLE001 - a stale or foreign package: run eagerly, say why once
        log.warning("quickdraft: the AOT step %s did not load (%s: %s); running eagerly", path, type(exc).__name__, exc)
        return None
    return runner, path


def load_or_build(model: nn.Module, hidden_at: tuple[int, ...] | None = None, trees: bool = False,
                  packed: bool = False):
    """The cached step, built first when missing (None where packages are unsupported); with
    `trees`, the token-tree package too; with `packed`, the mixed-step one."""
    reason = unsupported(model)
    if reason:
        log.warning("quickdraft: %s; running eagerly", reason)
        return None
    wanted = [(p, False, False) for p in ((True, False) if _is_head(model) else (None,))]
    if trees:
        wanted.append((False if _is_head(model) else None, True, False))
    packed = packed and not _is_head(model)
    if packed:
        wanted.append((None, False, True))
    step = load(model, hidden_at=hidden_at, trees=trees, packed=packed)
    if step is None or (trees and step.tree_runner is None) or (packed and step.packed_runner is None):
        for project, tree, mixed in wanted:
            if _runner(model, None, hidden_at, project, tree, mixed) is None:
                build(model, hidden_at=hidden_at, project=project, tree=tree, packed=mixed)
        step = load(model, hidden_at=hidden_at, trees=trees, packed=packed)
    return step


class HeadAOTStep:
    """A drop-in for calling an EAGLE-3 head: chains and catch-ups run its packages (one per
    `project` variant), tree depths (slots, a mask) the tree package where loaded; other and
    oversized calls run the head eagerly."""

    def __init__(self, head: nn.Module, runners: dict, tree: tuple | None = None):
        self.head = head
        self.runners = {p: r[0] for p, r in runners.items()}
        self.paths = [r[1] for r in runners.values()]
        self.tree_runner = None
        if tree is not None:
            self.tree_runner = tree[0]
            self.paths.append(tree[1])
        self.max_rows = _max_rows(head)
        self._key_pos = torch.arange(0)

    def __call__(self, input_ids, hidden, positions, cache: CacheView | None = None, kv_len=None, slots=None,
                 attn_mask=None, project: bool = True):
        B, T = input_ids.shape
        if slots is not None or attn_mask is not None:
            if (self.tree_runner is not None and not project
                    and _tree_call_fits(positions, cache, kv_len, slots, attn_mask, B * T, self.max_rows)):
                return tuple(self.tree_runner(input_ids.contiguous(), hidden.to(self.head.dtype).contiguous(),
                                              positions.contiguous(), slots.contiguous(), attn_mask.contiguous(),
                                              cache.k[0], cache.v[0]))
            return self.head(input_ids, hidden, positions, cache, kv_len=kv_len, slots=slots, attn_mask=attn_mask,
                             project=project)
        if (cache is None or B * T > self.max_rows
                or T > _MAX_QUERY or not cache.k[0].is_contiguous()):
            return self.head(input_ids, hidden, positions, cache, kv_len=kv_len, slots=slots, attn_mask=attn_mask,
                             project=project)
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        if self._key_pos.shape[0] < kv_len:
            self._key_pos = torch.arange(max(kv_len, 2 * self._key_pos.shape[0]))
        out = self.runners[bool(project)](input_ids.contiguous(), hidden.to(self.head.dtype).contiguous(),
                                          positions.contiguous(), self._key_pos[:max(kv_len, 2)], cache.k[0], cache.v[0])
        return tuple(out)

    def __getattr__(self, name):  # the head's attributes (to_target, config, ...)
        return getattr(self.head, name)

    def __repr__(self) -> str:
        return f"HeadAOTStep({', '.join(p.name for p in self.paths)})"
