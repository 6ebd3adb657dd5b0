"""Counters of the offload runtime (plain Python, cheap to read from another thread).

Exposed fetch is the wall time the forward pass spent blocked waiting for
experts, measured around the blocking waits (never around submits), and split
by the band the awaited expert was in when it was first requested:
band 0 = an on-demand miss, band 1 = a route-ahead prefetch that was promoted,
band 2 = a background prefetch that was promoted (any other band by number).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pdflash.native import Band


def band_name(band: int) -> str:
    try:
        return Band(band).name.lower().replace("_", "-")
    except ValueError:
        return f"band-{band}"


@dataclass
class LayerCounters:
    hits: int = 0  # requested expert already resident
    misses: int = 0  # not resident when requested (fetched on demand or promoted)
    promoted: int = 0  # misses that were already queued or in flight as a prefetch
    exposed_s: float = 0.0  # blocked waiting for this layer's experts
    waits: int = 0
    cpu: int = 0  # not resident, computed on the CPU from host memory instead of fetched


@dataclass
class FetchStats:
    num_layers: int
    layers: list[LayerCounters] = field(default_factory=list)
    exposed_by_band: dict[int, float] = field(default_factory=dict)  # origin band -> seconds blocked
    waits_by_band: dict[int, int] = field(default_factory=dict)
    prefetch_issued: dict[int, int] = field(default_factory=dict)  # band -> prefetch copies submitted
    prefetch_used: int = 0  # prefetched experts a forward then used
    prefetch_wasted: int = 0  # landed, then evicted before any forward used them
    prefetch_cancelled: int = 0  # cancelled before they landed (layer passed, or slot taken back)
    prefetch_dropped: int = 0  # no evictable slot for them
    prefetch_redundant: int = 0  # already resident or on the way
    demand_fetches: int = 0  # copies submitted at band 0 for misses
    evictions: int = 0
    forwards: int = 0
    tokens: int = 0  # tokens processed by forwards (prefill tokens included)
    cpu_seconds: float = 0.0  # wall time of the CPU expert computations (overlapping device work on CUDA)
    # split host steps' route-ahead: the next layer's predicted experts prefetched into its stages
    # (band 1; also in prefetch_issued), then claimed by that layer (promoted to band 0) or cancelled
    route_ahead_sent: int = 0
    route_ahead_used: int = 0
    route_ahead_cancelled: int = 0
    host_steps: int = 0  # forwards run as host steps (every expert on the CPU, one CUDA graph: host_graph.py)
    host_table_syncs: int = 0  # host steps that first copied the cache's slot table (its resident set had changed)
    # host steps' timeline, per mode: {"steps": n, "<part>_s": seconds summed over steps} (HostSteps.finish)
    host_timeline: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.layers:
            self.layers = [LayerCounters() for _ in range(self.num_layers)]

    def add_exposed(self, layer: int, band: int, seconds: float) -> None:
        self.exposed_by_band[band] = self.exposed_by_band.get(band, 0.0) + seconds
        self.waits_by_band[band] = self.waits_by_band.get(band, 0) + 1
        lc = self.layers[layer]
        lc.exposed_s += seconds
        lc.waits += 1

    @property
    def hits(self) -> int:
        return sum(lc.hits for lc in self.layers)

    @property
    def misses(self) -> int:
        return sum(lc.misses for lc in self.layers)

    @property
    def cpu(self) -> int:
        return sum(lc.cpu for lc in self.layers)

    @property
    def exposed_s(self) -> float:
        return sum(self.exposed_by_band.values(), 0.0)

    def add_host_step(self, mode: str, parts: dict[str, float]) -> None:
        """One host step's timeline (seconds by part) added to its mode's sums."""
        sums = self.host_timeline.setdefault(mode, {"steps": 0})
        sums["steps"] += 1
        for name, sec in parts.items():
            sums[name + "_s"] = sums.get(name + "_s", 0.0) + sec

    def host_step_mean_s(self, part: str, modes: tuple[str, ...] | None = None) -> float | None:
        """Seconds per host step spent in ``part`` ("node", "gaps", ...), the mean over every step
        of ``modes`` (None: every mode); None before any such step."""
        sums = [v for m, v in self.host_timeline.items() if modes is None or m in modes]
        steps = sum(v["steps"] for v in sums)
        return sum(v.get(part + "_s", 0.0) for v in sums) / steps if steps else None

    def host_timeline_ms(self) -> dict[str, dict[str, float]]:
        """Per mode: steps, and each part's mean milliseconds per step."""
        out = {}
        for mode, sums in self.host_timeline.items():
            n = sums["steps"]
            out[mode] = {"steps": n, **{k[:-2]: 1e3 * v / n for k, v in sums.items() if k != "steps"}}
        return out

    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("num_layers")
        return d
