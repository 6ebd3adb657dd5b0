"""What machine a measurement ran on: the one helper every benchmark and bench command records.

    from pdflash.machine import machine_info
    result["machine"] = machine_info("cuda")

Keys: python, platform, processor, cpu (model name), cpus (cores this process may use),
torch, torch_threads, transformers, host_memory_gib, gpu / gpu_memory_gib / cuda (of ``device``
when it is a CUDA device that is visible, else gpu None), pdflash (version), pdflash_path,
commit (git HEAD of the source tree, when it is a checkout) and loadavg_start. A value that
cannot be read is None; nothing here raises.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def machine_info(device: str | None = None) -> dict:
    """See the module docstring. ``device``: "cpu", "cuda", "cuda:N" or None (no GPU fields read)."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpus": usable_cpus(),
        "host_memory_gib": _host_memory_gib(),
        "loadavg_start": _loadavg(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        torch = None
        info["torch"] = info["torch_threads"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    info["gpu"] = None
    if torch is not None and device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    import pdflash

    root = Path(pdflash.__file__).resolve().parent
    info["pdflash"] = getattr(pdflash, "__version__", None)
    info["pdflash_path"] = str(root)
    info["commit"] = git_commit(root)
    return info


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def git_commit(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _host_memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            kb = int(next(line for line in fh if line.startswith("MemTotal:")).split()[1])
        return kb / 2**20
    except (OSError, StopIteration, ValueError):
        return None


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None
