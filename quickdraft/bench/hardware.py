"""Name the hardware a benchmark ran on, so committed results say where they came from."""

from __future__ import annotations

import platform
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
