"""Checks of command-line option values that need no file, model or device.

Every failure is a :class:`pdflash.PdflashError` with exit code 2 (bad usage), raised before
anything is loaded. Values that are well-formed but do not fit the model, files or machine are
found later and exit 1.
"""

from __future__ import annotations

import math
import re

from pdflash import PdflashError

USAGE = 2
SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
CPU_THREADS_MAX = 256  # PF_CPU_MAX_THREADS of native/pf_cpu.h (a test keeps them equal)
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def usage(message: str) -> PdflashError:
    return PdflashError(message, exit_code=USAGE)


def finite(flag: str, value: float | None, *, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> None:
    """``value`` (when given) is a finite number within [low, high] (``low_open``: above low)."""
    if value is None:
        return
    if not math.isfinite(value):
        raise usage(f"{flag} must be a finite number, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        what = f"above {low:g}" if low_open else f"at least {low:g}"
        raise usage(f"{flag} must be {what}, got {value:g}")
    if high is not None and value > high:
        raise usage(f"{flag} must be at most {high:g}, got {value:g}")


def at_least(flag: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise usage(f"{flag} must be at least {low}, got {value}")


def link_gbps(value: float | None) -> None:
    from pdflash.offload.runtime import LINK_GBPS_MAX, LINK_GBPS_MIN

    if value is None:
        return
    if not math.isfinite(value) or not LINK_GBPS_MIN <= value <= LINK_GBPS_MAX:
        raise usage(f"--link-gbps must be between {LINK_GBPS_MIN:g} and {LINK_GBPS_MAX:g} (GB/s), got {value:g}")


def seed(value: int) -> None:
    if not 0 <= value <= SEED_MAX:
        raise usage(f"--seed must be between 0 and 2**63-1, got {value}")


def device(value: str, allow_auto: bool = True) -> None:
    if not DEVICE_RE.match(value) or (value == "auto" and not allow_auto):
        choices = "auto, cpu, cuda or cuda:N" if allow_auto else "cpu, cuda or cuda:N"
        raise usage(f"--device must be {choices}, got {value!r}")


def cpu_threads(value: int | None) -> None:
    if value is not None and not 1 <= value <= CPU_THREADS_MAX:
        raise usage(f"--cpu-threads must be between 1 and {CPU_THREADS_MAX}, got {value}")


def choice(flag: str, value: str | None, choices) -> None:
    if value is not None and value not in choices:
        raise usage(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
