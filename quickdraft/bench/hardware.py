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
