"""Device expert cache: fixed slots, a (layer, expert) -> slot table, one copy engine.

``slots`` is one uint8 device tensor [n_slots, expert_bytes] allocated once; a
slot holds one packed expert in the host store's layout (host_store.py). Every
byte that enters a slot is copied by the one native Scheduler: misses at band 0
(``request``), prefetches at their band (``prefetch``). A key already queued as a
prefetch is promoted in place, never fetched twice.

Slot states: FREE -> ARRIVING (copy submitted; ``ticket``) -> RESIDENT -> FREE (evicted).

Eviction policies: "lru"; "balanced": the victim comes from a layer holding more than an equal
share of the slots, else from the layer whose next use is furthest (forwards walk the layers in
order: the running layer's unused experts, then the layer just passed, and so on back), so a
forward touching more experts than the cache holds (a verify block: the union of its tokens'
routes) does not push out every layer before the next forward comes back to it, as LRU does with
a cyclic scan larger than itself; "lfu" (decayed use counts); "lookahead" (LRU sparing
``protected`` keys).

Pins. Slots used by the layer being computed are pinned and never evicted.

CUDA ordering invariant: a slot may be overwritten only when no queued GPU work
still reads it. Expert kernels run asynchronously, so after a layer ends its
slots stay pinned ("deferred") until the next ``sync_point()``: the runtime calls
it right after a device->host synchronisation (the router indices of the next
layer are copied to the CPU before any of its misses or prefetches are
submitted), at which time every kernel launched before has finished. Anything
that removes that synchronisation (asynchronous routing) must add a CUDA event
per slot instead. On the CPU, compute is synchronous and pins end with the layer.
Copies are also ordered on the device: each one waits for a fence event recorded
on PyTorch's stream when the first copy after a pin release was submitted (one
event per interval, shared by its copies), and a slot is read only after its
ticket ended DONE, which the scheduler reports once the bytes have landed.

Minimum size: a forward over T tokens may touch min(E, T * top_k) experts of a
layer. The runtime requires at least min(E, block_tokens * top_k) slots, where
block_tokens is the largest decode block (1 for plain decoding), so a decode
step never has to reuse a slot inside a layer. Longer forwards (prefill) that
touch more experts than there are slots run in waves: computed experts are
unpinned (after a device sync on CUDA) and their slots reused.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

import torch

from pdflash import PdflashError
from pdflash.native import Band, Scheduler, WaitStatus, make_key
from pdflash.offload.host_store import HostStore
from pdflash.offload.stats import FetchStats

EVICTION_POLICIES = ("lru", "balanced", "lfu", "lookahead")
DEFAULT_EVICTION = "balanced"


class SlotState(enum.IntEnum):
    FREE = 0
    ARRIVING = 1
    RESIDENT = 2


_STATE_NAMES = {state: state.name.lower() for state in SlotState}  # state_of's answers, built once


@dataclass
class _Slot:
    key: tuple[int, int] | None = None
    state: SlotState = SlotState.FREE
    ticket: int = 0
    band: int = 0  # band when first requested (exposed fetch is split by it)
    cur_band: int = 0  # band now (after promotions)
    prefetched: bool = False  # arrived through a prefetch and no forward used it yet
    freq: float = 0.0  # decayed use count (lfu)
    freq_tick: int = 0


@dataclass
class Fetch:
    """A miss being copied into ``slot``; ``wait`` it before use."""

    layer: int
    expert: int
    slot: int
    band: int  # band when first requested


class ExpertCache:
    """See the module docstring. Not thread-safe: used by the forward pass's thread."""

    def __init__(
        self,
        host: HostStore,
        scheduler: Scheduler,
        device: torch.device,
        n_slots: int,
        policy: str = DEFAULT_EVICTION,
        lfu_decay: float = 0.8,
    ):
        if policy not in EVICTION_POLICIES:
            raise PdflashError(f"unknown eviction policy {policy!r}: choose one of {', '.join(EVICTION_POLICIES)}")
        if n_slots < 1:
            raise PdflashError(f"the expert cache needs at least one slot, got {n_slots}")
        self.host = host
        self.layout = host.layout
        self.sched = scheduler
        self.device = torch.device(device)
        self.n_slots = n_slots  # slots allocated in ``slots``
        self.capacity = n_slots  # slots in use: a limit <= n_slots set by reset(capacity)
        self.policy = policy
        self.lfu_decay = lfu_decay
        self.num_layers, self.num_experts = host.num_layers, host.num_experts
        try:
            self.slots = torch.empty((n_slots, self.layout.expert_bytes), dtype=torch.uint8, device=self.device)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            mib = n_slots * self.layout.expert_bytes / 2**20
            raise PdflashError(f"could not allocate the {mib:.0f} MiB expert cache on {self.device}: {str(exc).splitlines()[0]}; use a smaller --expert-cache-mib") from None
        self._async_device = self.device.type == "cuda"
        self._fence_event = None
        self.protected: set[tuple[int, int]] = set()  # keys predicted for the next layers (lookahead policy)
        self.errors: list[str] = []
        self._clear_state()

    def _clear_state(self) -> None:
        n = self.capacity
        self._slot = [_Slot() for _ in range(n)]
        self._table: dict[tuple[int, int], int] = {}
        self._free = list(range(n - 1, -1, -1))  # pop() hands out slot 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident slots, least recently used first
        self._layer_lru = [OrderedDict() for _ in range(self.num_layers)]  # the same, per layer (balanced)
        self._arriving: set[int] = set()
        self._pinned: set[int] = set()
        self._deferred: set[int] = set()
        self._tick = 0
        self._held = [0] * self.num_layers  # slots (arriving or resident) holding each layer's experts
        self._resident_keys: set[tuple[int, int]] = set()  # (layer, expert) of every resident slot
        self._arriving_keys: set[tuple[int, int]] = set()  # (layer, expert) of every slot on its way
        self._at = 0  # the layer a forward looked up or requested last (balanced eviction)
        self.stats = FetchStats(self.num_layers)
        self.version = getattr(self, "version", 0) + 1  # changes whenever the resident set may have

    # -- inspection ------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        return self.layout.expert_bytes

    def is_resident(self, layer: int, expert: int) -> bool:
        s = self._table.get((layer, expert))
        return s is not None and self._slot[s].state == SlotState.RESIDENT

    def state_of(self, layer: int, expert: int) -> str | None:
        s = self._table.get((layer, expert))
        return None if s is None else _STATE_NAMES[self._slot[s].state]

    def held(self) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """((layer, expert) resident, (layer, expert) on the way) now: the cache's own sets, kept
        as slots change state, for callers that count many experts at once (the block planner,
        with set operations); read them, never change them."""
        return self._resident_keys, self._arriving_keys

    def resident_slots(self) -> list[tuple[int, int, int]]:
        """(layer, expert, slot) of every resident expert (see ``version``)."""
        return [(layer, e, s) for (layer, e), s in self._table.items() if self._slot[s].state == SlotState.RESIDENT]

    def count_hit(self, layer: int, slot: int) -> None:
        """A resident expert computed from its slot outside ``lookup`` (a host step): a hit for the
        statistics and the eviction policy, not pinned."""
        self._at = layer
        self.stats.layers[layer].hits += 1
        self._use(slot)

    def resident(self) -> dict[int, list[int]]:
        """{layer: sorted experts} resident now."""
        out: dict[int, list[int]] = {}
        for (layer, e), s in self._table.items():
            if self._slot[s].state == SlotState.RESIDENT:
                out.setdefault(layer, []).append(e)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def occupancy(self) -> dict:
        return {
            "slots": self.capacity,
            "resident": len(self._lru),
            "arriving": len(self._arriving),
            "free": len(self._free),
            "pinned": len(self._pinned | self._deferred),
        }

    # -- forward side ----------------------------------------------------------------
    def begin_forward(self, tokens: int) -> None:
        """A forward starts: no layer is running, so pins left by an interrupted one end (deferred on CUDA)."""
        if self._async_device:
            self._deferred |= self._pinned
        self._pinned.clear()
        self._tick += 1
        self.stats.forwards += 1
        self.stats.tokens += tokens

    def sync_point(self) -> None:
        """Call right after a device->host sync: queued kernels are done, deferred pins end."""
        self._deferred.clear()
        self._fence_event = None
        self._reconcile()

    def lookup(self, layer: int, expert: int) -> int | None:
        """Slot of a resident expert (counted as a hit and pinned), else None."""
        self._at = layer
        s = self._table.get((layer, expert))
        if s is None:
            return None
        slot = self._slot[s]
        if slot.state == SlotState.ARRIVING:
            if self._poll(slot.ticket) is not WaitStatus.DONE:
                return None
            self._land(s)
        self.stats.layers[layer].hits += 1
        self._use(s)
        self._pinned.add(s)
        return s

    def request(self, layer: int, expert: int) -> Fetch | None:
        """Start (or promote) the copy of a non-resident expert; None if every slot is pinned."""
        key = (layer, expert)
        self._at = layer
        s = self._table.get(key)
        lc = self.stats.layers[layer]
        if s is not None:  # a prefetch is on the way: promote it in place
            slot = self._slot[s]
            if slot.cur_band > Band.ON_DEMAND:
                self.sched.promote(make_key(layer, expert), Band.ON_DEMAND)
                slot.cur_band = Band.ON_DEMAND
            lc.misses += 1
            lc.promoted += 1
            self._pinned.add(s)
            return Fetch(layer, expert, s, slot.band)
        s = self._acquire(for_demand=True, layer=layer)
        if s is None:
            return None
        self._submit(s, key, Band.ON_DEMAND)
        lc.misses += 1
        self.stats.demand_fetches += 1
        self._pinned.add(s)
        return Fetch(layer, expert, s, Band.ON_DEMAND)

    def wait(self, f: Fetch) -> int:
        """Block until the fetch has landed; the blocked time is exposed fetch. Returns the slot."""
        slot = self._slot[f.slot]
        t0 = time.perf_counter()
        while True:
            st = self.sched.wait(slot.ticket)
            if st is WaitStatus.DONE:
                break
            if st in (WaitStatus.CANCELLED, WaitStatus.EXPIRED):  # ended without (known) data: copy again
                self._resubmit(f.slot)
                continue
            if st is WaitStatus.FAILED:
                raise PdflashError(f"copy of layer {f.layer} expert {f.expert} failed: {self.sched.ticket_error(slot.ticket)}")
            raise PdflashError(f"the fetch scheduler stopped while layer {f.layer} expert {f.expert} was awaited ({st.name})")
        self.stats.add_exposed(f.layer, f.band, time.perf_counter() - t0)
        self._land(f.slot)
        self._use(f.slot)
        return f.slot

    def ready(self, f: Fetch) -> bool:
        """True if the fetch has landed (non-blocking)."""
        return self._poll(self._slot[f.slot].ticket) is WaitStatus.DONE

    def release(self, slots: Iterable[int]) -> None:
        """Unpin slots whose readers have finished (the caller synchronised the device if needed)."""
        for s in slots:
            self._pinned.discard(s)
        self._fence_event = None  # their readers were queued after the last fence

    def end_layer(self) -> None:
        """The running layer's pins end now on CPU, at the next sync_point on CUDA."""
        if self._async_device:
            self._deferred |= self._pinned
        self._pinned.clear()

    # -- prefetch side ---------------------------------------------------------------
    def prefetch(self, layer: int, expert: int, band: int) -> bool:
        """Queue a copy at ``band`` if not resident or on the way; True if a copy was submitted."""
        key = (layer, expert)
        s = self._table.get(key)
        if s is not None:
            slot = self._slot[s]
            if slot.state == SlotState.ARRIVING and band < slot.cur_band:
                self.sched.promote(make_key(layer, expert), band)
                slot.cur_band = band
            elif slot.state == SlotState.RESIDENT:
                self._touch(s)  # about to be used: keep it
            self.stats.prefetch_redundant += 1
            return False
        s = self._acquire(for_demand=False, layer=layer)
        if s is None:
            self.stats.prefetch_dropped += 1
            return False
        self._submit(s, key, band)
        self._slot[s].prefetched = True
        self.stats.prefetch_issued[band] = self.stats.prefetch_issued.get(band, 0) + 1
        return True

    def cancel_passed(self, layer: int) -> int:
        """Cancel queued prefetches (band >= 1) of layers below ``layer``; frees their slots."""
        if not self._arriving:  # nothing of this cache on its way: no call into the scheduler
            return 0
        n = self.sched.cancel_below_layer(layer, min_priority=1)
        if n:
            self._reconcile()
        return n

    def fill(self, keys: Iterable[tuple[int, int]]) -> int:
        """Copy experts into the cache (evicting by policy) and wait for them; returns how many landed.

        For preloading: these copies are not prefetches (no prefetch statistics).
        """
        submitted = []
        for key in keys:
            if key in self._table:
                continue
            s = self._acquire(for_demand=False, layer=key[0])
            if s is None:
                break
            self._submit(s, key, Band.BACKGROUND)
            submitted.append(s)
        landed = 0
        for s in submitted:
            if self.sched.wait(self._slot[s].ticket) is WaitStatus.DONE:
                self._land(s)
                landed += 1
            else:
                self._free_slot(s)
        return landed

    def drain(self) -> None:
        """Block until every copy on the way has ended (landed or cancelled) and settle its slot."""
        for s in list(self._arriving):
            self.sched.wait(self._slot[s].ticket)
        self._reconcile()

    def zero_stats(self) -> None:
        self.stats = FetchStats(self.num_layers)

    # -- internals -------------------------------------------------------------------
    def _poll(self, ticket: int) -> WaitStatus:
        """Non-blocking status (PENDING while live). A zero-timeout wait, not query: for an ended
        ticket it also lets the scheduler drop its references to the copy's tensors."""
        st = self.sched.wait(ticket, timeout=0)
        return WaitStatus.PENDING if st is WaitStatus.TIMEOUT else st

    def _copy(self, s: int, key: tuple[int, int], band: int) -> int:
        """Submit the host row of ``key`` -> slot ``s``; returns the ticket.

        Tensors (views), not raw addresses: the scheduler keeps them alive until the ticket
        is waited on, so no copy can land in memory that was freed meanwhile.
        """
        layer, expert = key
        return self.sched.submit(make_key(layer, expert), self.host.row(layer, expert), self.slots[s], priority=band,
                                 after=self._fence())

    def _fence(self):
        """CUDA: the event copies into slots wait for on the device, recorded on PyTorch's stream at
        the first copy since pins were last released, so every kernel that read an unpinned slot
        was queued before it. None on the CPU."""
        if self.sched.backend != "cuda":
            return None
        if self._fence_event is None:
            self._fence_event = torch.cuda.Event()
            self._fence_event.record(torch.cuda.current_stream(self.device))
        return self._fence_event

    def _submit(self, s: int, key: tuple[int, int], band: int) -> None:
        ticket = self._copy(s, key, band)
        slot = self._slot[s]
        slot.key, slot.state, slot.ticket = key, SlotState.ARRIVING, ticket
        slot.band = slot.cur_band = band
        slot.prefetched = False
        self._table[key] = s
        self._held[key[0]] += 1
        self._arriving_keys.add(key)
        self._arriving.add(s)

    def _resubmit(self, s: int) -> None:
        slot = self._slot[s]
        slot.ticket = self._copy(s, slot.key, Band.ON_DEMAND)
        slot.cur_band = Band.ON_DEMAND

    def _land(self, s: int) -> None:
        slot = self._slot[s]
        if slot.state != SlotState.RESIDENT:
            slot.state = SlotState.RESIDENT
            self.version += 1
            self._arriving.discard(s)
            self._arriving_keys.discard(slot.key)
            self._resident_keys.add(slot.key)
            self._lru[s] = None
            self._layer_lru[slot.key[0]][s] = None

    def _use(self, s: int) -> None:
        slot = self._slot[s]
        self._touch(s)
        if slot.prefetched:
            slot.prefetched = False
            self.stats.prefetch_used += 1
        d = self.lfu_decay ** (self._tick - slot.freq_tick)
        slot.freq = slot.freq * d + 1.0
        slot.freq_tick = self._tick

    def _touch(self, s: int) -> None:
        """Most recently used now."""
        self._lru.move_to_end(s)
        key = self._slot[s].key
        if key is not None:
            self._layer_lru[key[0]].move_to_end(s)

    def _free_slot(self, s: int) -> None:
        slot = self._slot[s]
        if slot.state == SlotState.RESIDENT:
            self.version += 1
        self._lru.pop(s, None)
        if slot.key is not None:
            del self._table[slot.key]
            self._held[slot.key[0]] -= 1
            self._layer_lru[slot.key[0]].pop(s, None)
            self._arriving_keys.discard(slot.key)
            self._resident_keys.discard(slot.key)
        self._arriving.discard(s)
        self._slot[s] = _Slot()
        self._free.append(s)

    def _evictable(self, s: int) -> bool:
        return s not in self._pinned and s not in self._deferred

    def _victim(self) -> int | None:
        if self.policy == "balanced":
            return self._balanced_victim()
        if self.policy == "lfu":
            best, best_score = None, None
            for s in self._lru:  # LRU order breaks ties
                if not self._evictable(s):
                    continue
                slot = self._slot[s]
                score = slot.freq * self.lfu_decay ** (self._tick - slot.freq_tick)
                if best_score is None or score < best_score:
                    best, best_score = s, score
            return best
        fallback = None
        for s in self._lru:
            if not self._evictable(s):
                continue
            if self.policy == "lru" or self._slot[s].key not in self.protected:
                return s
            if fallback is None:
                fallback = s
        return fallback

    def _balanced_victim(self) -> int | None:
        """The evictable slot of a layer over its share, else the one whose layer comes back last.

        Forwards walk the layers in order, so a layer's next use is its distance ahead of the
        layer being computed (``_at``), whose own unused experts come back last of all (next
        forward): layers are tried from ``_at`` backwards. Within a layer, least recently used
        first. O(layers) per eviction, not O(slots): a scan of every slot cost 11 ms per forward
        on the gpt-oss-120b shape (600 slots) in Python.
        """
        share = self.capacity / self.num_layers
        n, at = self.num_layers, self._at
        order = [(at - d) % n for d in range(n)]  # furthest next use first
        for over_only in (True, False):
            for layer in order:
                if over_only and self._held[layer] <= share:
                    continue
                for s in self._layer_lru[layer]:
                    if self._evictable(s):
                        return s
        return None

    def _acquire(self, for_demand: bool, layer: int) -> int | None:
        """A free slot: free list, else evict by policy; a demand may take back a prefetch in flight."""
        if self._free:
            return self._free.pop()
        v = self._victim()
        if v is not None:
            if self._slot[v].prefetched:
                self.stats.prefetch_wasted += 1
            self.stats.evictions += 1
            self._free_slot(v)
            return self._free.pop()
        if not for_demand:
            return None
        for s in list(self._arriving):  # every resident slot is pinned: take back a prefetch
            if not self._evictable(s):
                continue
            slot = self._slot[s]
            self.sched.cancel(make_key(*slot.key))
            t0 = time.perf_counter()
            st = self.sched.wait(slot.ticket)  # its chunks in flight must land before reuse
            self.stats.add_exposed(layer, Band.ON_DEMAND, time.perf_counter() - t0)
            if st is WaitStatus.DONE:
                self.stats.prefetch_wasted += 1
                self.stats.evictions += 1
            else:
                self.stats.prefetch_cancelled += 1
            self._free_slot(s)
            return self._free.pop()
        return None

    def _reconcile(self) -> None:
        """Settle prefetches that ended: landed -> resident, cancelled / failed -> slot freed."""
        for s in list(self._arriving):
            if s in self._pinned:
                continue
            slot = self._slot[s]
            st = self._poll(slot.ticket)
            if st is WaitStatus.PENDING:
                continue
            if st is WaitStatus.DONE:
                self._land(s)
                continue
            if st is WaitStatus.FAILED:
                self.errors.append(f"prefetch of layer {slot.key[0]} expert {slot.key[1]}: {self.sched.ticket_error(slot.ticket)}")
            self.stats.prefetch_cancelled += 1
            self._free_slot(s)

    # -- lifecycle -------------------------------------------------------------------
    def reset(self, capacity: int | None = None) -> None:
        """Empty the cache and the scheduler queues, zero statistics; stays usable.

        ``capacity`` (1 .. n_slots) limits the slots used from now on: slots at or above it
        are never handed out. None keeps the current limit.
        """
        if capacity is not None and not 1 <= capacity <= self.n_slots:
            raise PdflashError(f"the expert cache capacity must be between 1 and the {self.n_slots} allocated slots, got {capacity}")
        if self._async_device:
            torch.cuda.synchronize(self.device)  # no queued kernel may still read a slot
        self.sched.reset()  # cancels queued copies, lets chunks in flight land
        if capacity is not None:
            self.capacity = capacity
        self._clear_state()
        self.errors.clear()

    def close(self) -> None:
        self._clear_state()
        self.slots = torch.empty(0, dtype=torch.uint8, device=self.device)
