"""A Rich live table of the fetch scheduler's bands, refreshed from a background thread.

    with LiveBandTable(rt.scheduler, status=lambda: [("tok/s", "12.3")], enabled=True):
        ...  # generation runs here

Per band (on-demand, route-ahead, background): queue depth, in flight, completed,
stall seconds (callers blocked in wait on that band), queue wait seconds (submit
to first chunk, summed). Below the table, the ``status`` callback's fields (cache
hit rate, tokens/s, ...). Reading Scheduler.stats() is one cheap native call, so
the ~10 Hz refresh costs the run nothing measurable. Drawn on stderr; when
disabled (``--no-live``, ``--json``, stderr not a terminal) nothing is started.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdflash.native import Band, Scheduler


def live_enabled(requested: bool, json_out: bool) -> bool:
    """The live table is drawn only when asked for, not in JSON mode, and on a terminal."""
    return requested and not json_out and sys.stderr.isatty()


class LiveBandTable:
    """See the module docstring. A context manager; ``stop()`` is idempotent."""

    def __init__(
        self,
        scheduler: Scheduler,
        status: Callable[[], list[tuple[str, str]]] = lambda: [],
        enabled: bool = True,
        title: str = "expert fetch bands",
        refresh_hz: float = 10.0,
        console: Console | None = None,
    ):
        self.scheduler = scheduler
        self.status = status
        self.enabled = enabled
        self.title = title
        self.period = 1.0 / refresh_hz
        self.console = console or Console(stderr=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Live | None = None

    def render(self) -> Group:
        table = Table(title=self.title, title_justify="left", expand=False)
        for col in ("band", "queue", "in flight", "completed", "stall s", "queue wait s"):
            table.add_column(col, justify="left" if col == "band" else "right")
        levels = self.scheduler.stats()["levels"]
        for b in Band:
            lv = levels[b]
            table.add_row(
                b.name.lower().replace("_", "-"),
                str(lv["queue_depth"]),
                str(lv["in_flight"]),
                str(lv["completed"]),
                f"{lv['stall_s']:.3f}",
                f"{lv['queue_wait_s']:.3f}",
            )
        line = Text("  ".join(f"{k} {v}" for k, v in self.status()))
        return Group(table, line)

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._live.update(self.render(), refresh=True)
            except Exception:  # the scheduler closed under us: stop drawing
                return

    def start(self) -> "LiveBandTable":
        if not self.enabled or self._thread is not None:
            return self
        self._live = Live(self.render(), console=self.console, auto_refresh=False, transient=False)
        self._live.start()
        self._thread = threading.Thread(target=self._loop, name="pdflash-live", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self._live.update(self.render(), refresh=True)  # final state
        except Exception:
            pass
        self._live.stop()

    def __enter__(self) -> "LiveBandTable":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
