"""Rank 0's bookkeeping of LoRA adapters: which are loaded (by name, their weights on the host), which slot of the
model each resident one holds, and how many unfinished requests run each.

Before a step, `slots_for` makes every adapter the step uses resident: one already in a slot stays there; another
takes a free slot, or the least recently used slot of an adapter this step does not use, and its weights are copied
in then (the only time a swap costs the step). The scheduler admits requests of at most `max_loras` adapters at once,
so a step never needs more slots than there are.

Unloading takes the name away at once (new requests get 404); requests already running with it finish with it, and
its weights (host copy and slot) are let go when the last of them does.
"""

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvserve.engine.lora.peft_adapter import LoraAdapter
from kvserve.kvcache import AdapterTag


@dataclass(frozen=True)
class LoadedAdapter:
    tag: AdapterTag
    adapter: LoraAdapter


class LoraManager:
    def __init__(self, max_loras: int, write_slot: Callable[[int, LoraAdapter], None]) -> None:
        """`write_slot(slot, adapter)` copies an adapter into a slot of the model."""
        self.max_loras = max_loras
        self._write_slot = write_slot
        self._loaded: dict[str, LoadedAdapter] = {}
        self._retired: dict[int, LoadedAdapter] = {}  # unloaded, still run by requests: by adapter id
        self._users: Counter[int] = Counter()
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._free_slots = list(range(max_loras - 1, -1, -1))
        self._ids = itertools.count(1)
        self.num_swaps = 0  # adapters copied into a slot, since start

    def add(self, adapter: LoraAdapter) -> AdapterTag:
        if adapter.name in self._loaded:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        tag = AdapterTag(next(self._ids), adapter.name, adapter.path)
        self._loaded[adapter.name] = LoadedAdapter(tag, adapter)
        return tag

    def remove(self, name: str) -> AdapterTag | None:
        """Unload `name` (None if it is not loaded); its weights go once no request runs it."""
        loaded = self._loaded.pop(name, None)
        if loaded is None:
            return None
        if self.runs(loaded.tag):
            self._retired[loaded.tag.adapter_id] = loaded
        else:
            self._let_go(loaded.tag)
        return loaded.tag

    def tag(self, name: str) -> AdapterTag | None:
        loaded = self._loaded.get(name)
        return loaded.tag if loaded is not None else None

    def adapter_id(self, name: str) -> int | None:
        """The id of the adapter called `name`: the loaded one, else an unloaded one still running."""
        loaded = self._loaded.get(name)
        if loaded is not None:
            return loaded.tag.adapter_id
        return next((retired.tag.adapter_id for retired in self._retired.values() if retired.tag.name == name), None)

    def loaded(self) -> list[AdapterTag]:
        """The loaded adapters, in the order they were loaded."""
        return [loaded.tag for loaded in self._loaded.values()]

    @property
    def host_bytes(self) -> int:
        """Bytes of adapter weights held on the host (loaded ones, and unloaded ones still running)."""
        return sum(loaded.adapter.nbytes for loaded in [*self._loaded.values(), *self._retired.values()])

    def runs(self, tag: AdapterTag) -> bool:
        """Whether an unfinished request runs this adapter."""
        return self._users[tag.adapter_id] > 0

    def acquire(self, tag: AdapterTag) -> None:
        """A request of this adapter was queued."""
        self._users[tag.adapter_id] += 1

    def release(self, tag: AdapterTag) -> bool:
        """A request of this adapter finished; True if that let an unloaded adapter go."""
        self._users[tag.adapter_id] -= 1
        if self._users[tag.adapter_id]:
            return False
        del self._users[tag.adapter_id]
        retired = self._retired.pop(tag.adapter_id, None)
        if retired is None:
            return False
        self._let_go(tag)
        return True

    def slots_for(self, tags: Iterable[AdapterTag | None]) -> list[int]:
        """Each request's slot (-1: the base model), making the adapters resident first."""
        tags = list(tags)
        needed = {tag.adapter_id for tag in tags if tag is not None}
        for tag in tags:
            if tag is not None and tag.adapter_id not in self._slots:
                self._make_resident(tag, needed)
        for adapter_id in needed:
            self._slots.move_to_end(adapter_id)
        return [-1 if tag is None else self._slots[tag.adapter_id] for tag in tags]

    def _make_resident(self, tag: AdapterTag, needed: set[int]) -> None:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((adapter_id for adapter_id in self._slots if adapter_id not in needed), None)
            if victim is None:
                raise RuntimeError(f"a step uses more than max_loras ({self.max_loras}) adapters")
            slot = self._slots.pop(victim)
        self._write_slot(slot, self._adapter(tag))
        self._slots[tag.adapter_id] = slot
        self.num_swaps += 1

    def _adapter(self, tag: AdapterTag) -> LoraAdapter:
        loaded = self._loaded.get(tag.name)
        if loaded is not None and loaded.tag == tag:
            return loaded.adapter
        return self._retired[tag.adapter_id].adapter

    def _let_go(self, tag: AdapterTag) -> None:
        slot = self._slots.pop(tag.adapter_id, None)
        if slot is not None:
            self._free_slots.append(slot)
