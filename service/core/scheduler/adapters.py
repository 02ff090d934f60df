"""The scheduler's view of the served LoRA adapters: which name holds which slot of the model
runner's adapter stacks, how many requests use each, and which are being unloaded.

Pure Python. The runner holds the weights (service.core.models.lora); the scheduler decides the
slots, as it decides KV block ids: a request names its adapter when it arrives (`acquire`, which
refuses an unknown name or one being unloaded), the row it joins with carries the slot, and the
request gives the adapter back when it ends (`release`). An adapter is unloaded once no waiting
or running request uses it: its slot goes into the next step plan (`take_unloaded`), so the
runner clears it only after every row that used it has left, and only then can a load reuse it.

Each load gets its own prefix-cache namespace (`root`): two requests share KV blocks only if
they use the same adapter, as loaded once (a name unloaded and loaded again is a new load).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from service.core.kv.block_pool import namespace_root

NO_ADAPTER = 0  # the slot of requests without an adapter


class AdapterUnavailableError(LookupError):
    """A request names an adapter that is not served (or is being unloaded)."""


@dataclass(eq=False)
class AdapterEntry:
    name: str
    slot: int
    root: int  # the parent hash of its sequences' first KV block
    users: int = 0  # requests that named it and have not ended
    unloading: bool = False


class AdapterTable:
    def __init__(self) -> None:
        self._entries: dict[str, AdapterEntry] = {}
        self._unloaded: list[int] = []  # slots freed since the last plan (the runner clears them)
        self._loads = itertools.count(1)

    # -- what is served ---------------------------------------------------------------------
    @property
    def served(self) -> list[str]:
        """The names a request may use, by slot."""
        entries = sorted(self._entries.values(), key=lambda e: e.slot)
        return [e.name for e in entries if not e.unloading]

    def get(self, name: str) -> AdapterEntry | None:
        return self._entries.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def describe_served(self) -> str:
        served = self.served
        return ", ".join(served) if served else "none"

    # -- loading and unloading ----------------------------------------------------------------
    def free_slot(self) -> int:
        """The lowest slot neither held nor waiting for the runner to clear it."""
        taken = {e.slot for e in self._entries.values()} | set(self._unloaded)
        return next(s for s in itertools.count(NO_ADAPTER + 1) if s not in taken)

    def add(self, name: str, slot: int) -> AdapterEntry:
        if name in self._entries:
            raise ValueError(f"adapter {name!r} is already loaded")
        if slot == NO_ADAPTER or slot in {e.slot for e in self._entries.values()}:
            raise ValueError(f"adapter slot {slot} is taken")
        entry = AdapterEntry(name, slot, namespace_root(f"{name}#{next(self._loads)}"))
        self._entries[name] = entry
        return entry

    def unload(self, name: str) -> int:
        """Take no new request for `name`; it goes once the requests using it have ended.
        Returns how many still use it."""
        entry = self._entries.get(name)
        if entry is None or entry.unloading:
            raise AdapterUnavailableError(
                f"no adapter named {name!r} is loaded (served: {self.describe_served()})"
            )
        entry.unloading = True
        self._drop_if_unused(entry)
        return entry.users

    def take_unloaded(self) -> list[int]:
        """Slots of adapters unloaded since the last call (the next plan clears them)."""
        slots, self._unloaded = self._unloaded, []
        return slots

    @property
    def unload_pending(self) -> bool:
        return bool(self._unloaded)

    # -- requests -----------------------------------------------------------------------------
    def acquire(self, name: str) -> AdapterEntry:
        """The adapter a new request names, counted as used until `release`."""
        entry = self._entries.get(name)
        if entry is None or entry.unloading:
            state = "is being unloaded" if entry is not None else "is not served"
            raise AdapterUnavailableError(
                f"adapter {name!r} {state}; served adapters: {self.describe_served()}"
            )
        entry.users += 1
        return entry

    def release(self, entry: AdapterEntry) -> None:
        if entry.users <= 0:
            raise ValueError(f"adapter {entry.name!r} released more often than acquired")
        entry.users -= 1
        self._drop_if_unused(entry)

    def _drop_if_unused(self, entry: AdapterEntry) -> None:
        if entry.unloading and entry.users == 0 and self._entries.get(entry.name) is entry:
            del self._entries[entry.name]
            self._unloaded.append(entry.slot)
