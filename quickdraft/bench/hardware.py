"""Name the hardware a benchmark ran on, so committed results say where they came from."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def device_name(device: torch.device | str) -> str:
    """The accelerator's name for cuda/mps devices, the CPU model otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    return cpu_model()


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the machine has been busy, CPU seconds of this process and its children),
    or None off Linux: their difference over a block is the work of other processes."""
    try:
        import resource  # POSIX only

        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (ImportError, OSError, ValueError):
        return None
    mine = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))
    return (sum(fields) - fields[3] - fields[4]) / tick, mine  # busy: all but idle and iowait


def other_cpu_share(before, after, wall: float) -> float | None:
    """The share of the machine's CPUs other processes used between two cpu_seconds() readings."""
    if before is None or after is None or wall <= 0:
        return None
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / (wall * (os.cpu_count() or 1)))


def median_seconds(fn, repeats: int) -> float:
    """The median wall time of `repeats` calls of fn, after one call to warm up."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth(repeats: int, nbytes: int = 1 << 30) -> dict[str, float]:
    """Bytes/s of streaming reads over float32 buffers larger than any cache, at the current
    torch thread count, by three probes (`sum`, `dot` of two halves, `mv` of a matrix), each the
    median of `repeats` calls; the best is a memory roofline's denominator."""
    x = torch.ones(nbytes // 4)
    half = x.numel() // 2
    a, b = x[:half], x[half:]
    m = x.view(-1, 4096)
    v = torch.ones(4096)

    return {"sum": nbytes / median_seconds(lambda: x.sum(), repeats),
            "dot": nbytes / median_seconds(lambda: torch.dot(a, b), repeats),
            "mv": nbytes / median_seconds(lambda: torch.mv(m, v), repeats)}


# -- provenance: what every benchmark result file records about where it came from ---------

def loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


_LOAD_AT_START = loadavg()  # read when the benchmark first imported this module


def _cpuinfo_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo ("flags" on x86, "Features" on ARM)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# the features the CPU kernels and torch's own care about: (name in records, flags that show it)
_FEATURES = [("AVX-512", {"avx512f"}), ("AVX512_BF16", {"avx512_bf16"}), ("AVX512_VNNI", {"avx512_vnni"}),
             ("AVX2", {"avx2"}), ("AMX", {"amx_tile"}), ("NEON", {"asimd", "neon"}), ("SVE", {"sve"})]


def cpu_features(flags: set[str] | None = None) -> list[str]:
    """The named features this CPU has, e.g. ["AVX-512", "AVX512_BF16", "AVX2"]; Apple silicon
    (no /proc/cpuinfo) is NEON by definition."""
    flags = _cpuinfo_flags() if flags is None else flags
    found = [name for name, shows in _FEATURES if flags & shows]
    if not flags and platform.machine() in ("arm64", "aarch64"):
        found.append("NEON")
    return found


def git_commit(folder: Path | str | None = None) -> str | None:
    """HEAD of the git checkout holding `folder` (default: this quickdraft's source), with
    "+dirty" when tracked files differ from it; None outside a checkout or without git."""
    import subprocess

    folder = Path(folder) if folder is not None else Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def provenance(device: torch.device | str | None = None, threads: int | list[int] | None = None,
               argv: list[str] | None = None, load_before: list[float] | None = None) -> dict:
    """Where a result came from: commit, date, the exact command, the machine (CPU model and
    features, cores, torch, threads, the GPU when one was used) and the machine's load before
    and now. Every benchmark result file carries this record ("provenance" in JSON, a
    provenance_line in text). device: the one measured (default: cuda when torch was asked to
    initialise it); threads: torch's CPU threads used, or the list a run went through (default:
    torch's current count);
    load_before: a loadavg() taken before the work (default: when this module was imported)."""
    import datetime
    import shlex
    import sys

    if device is None:
        device = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
    device = torch.device(device)
    record = {
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *(sys.argv if argv is None else argv)]),
        "machine": {"cpu": cpu_model(), "cpu_features": cpu_features(), "cores": os.cpu_count(),
                    "torch_cpu_capability": _cpu_capability(), "torch": torch.__version__,
                    "threads": threads if threads is not None else torch.get_num_threads(),
                    "gpu": device_name(device) if device.type in ("cuda", "mps") else None},
        "loadavg_before": load_before if load_before is not None else _LOAD_AT_START,
        "loadavg_after": loadavg(),
    }
    return record


def _cpu_capability() -> str | None:
    """The widest vector ISA torch's own CPU kernels dispatch to (e.g. AVX512), where torch says."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        return None


def provenance_line(record: dict) -> str:
    """The provenance record as one line for markdown or text results."""
    m = record["machine"]
    load = lambda v: "?" if v is None else f"{v[0]:.2f}"  # noqa: E731
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    return (f"Provenance: commit {record['commit'] or 'unknown'}, {record['date']}, "
            f"{m['cpu']} ({'/'.join(m['cpu_features']) or 'no listed features'}, {m['cores']} cores, "
            f"{_threads(m['threads'])} threads){gpu}, torch {m['torch']}, load {load(record['loadavg_before'])} -> "
            f"{load(record['loadavg_after'])}; command: `{record['command']}`")


def _threads(threads: int | list[int]) -> str:
    return "/".join(map(str, threads)) if isinstance(threads, list) else str(threads)


def steady_steps() -> None:
    """For benchmarks: measure the steps asked for. An engine on a fresh cache otherwise builds
    its AOT packages in the background and switches to them mid-run (quickdraft.aot); unless the
    caller set QUICKDRAFT_AOT_BUILD, no background build starts (packages already cached still
    load, and compile="aot" still builds them before timing)."""
    os.environ.setdefault("QUICKDRAFT_AOT_BUILD", "0")
