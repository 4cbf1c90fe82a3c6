"""Paged KV-cache bookkeeping: which physical pages and which slot each sequence owns.

The device tensors themselves belong to the model (only its attention layers have KV caches, and a hybrid model
also keeps recurrent state per slot); this module hands out page ids and slot ids and keeps the block table —
``block_tables[slot, i]`` is the physical page holding tokens ``[i*page_size, (i+1)*page_size)`` of that slot's
sequence — mirrored on the device for the kernels. With async scheduling the host allocates or frees pages while
the step that copies the table may not have run yet, so every write to the host table first waits for the last
asynchronous copy from it to have executed (required were the table pinned; a cheap guarantee either way).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.engine.step_inputs import wait_event


class PagePool:
    """Free lists of KV pages and sequence slots, plus the block table."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_model_len: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pages_of_slot: dict[int, list[int]] = {}
        self.block_tables_host = np.zeros((num_slots, self.max_pages_per_seq), dtype=np.int32)
        self.block_tables = cuda.to_device(self.block_tables_host)
        self._dirty = False
        self._copied = cuda.event(timing=False) if not SIMULATOR else None
        self._copy_pending = False   # a copy from block_tables_host was enqueued and may not have run yet

    def _before_host_write(self) -> None:
        if self._copy_pending:
            wait_event(self._copied)
            self._copy_pending = False

    # -------------------------------------------------------------------------------------------- accounting
    @property
    def pages_used(self) -> int:
        return self.num_pages - len(self._free_pages)

    @property
    def slots_used(self) -> int:
        return self.num_slots - len(self._free_slots)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_admit(self, num_tokens: int) -> bool:
        return bool(self._free_slots) and self.pages_needed(num_tokens) <= len(self._free_pages)

    # -------------------------------------------------------------------------------------------- slots, pages
    def acquire_slot(self) -> int:
        slot = self._free_slots.pop()
        self._pages_of_slot[slot] = []
        return slot

    def ensure_capacity(self, slot: int, num_tokens: int) -> bool:
        """Give ``slot`` enough pages for ``num_tokens`` tokens. False when the pool is out of pages."""
        pages = self._pages_of_slot[slot]
        need = self.pages_needed(num_tokens) - len(pages)
        if need <= 0:
            return True
        if need > len(self._free_pages) or len(pages) + need > self.max_pages_per_seq:
            return False
        self._before_host_write()
        for _ in range(need):
            page = self._free_pages.pop()
            self.block_tables_host[slot, len(pages)] = page
            pages.append(page)
        self._dirty = True
        return True

    def release(self, slot: int) -> None:
        """Return a slot and all its pages to the pool."""
        self._before_host_write()
        pages = self._pages_of_slot.pop(slot, [])
        self._free_pages.extend(reversed(pages))
        self.block_tables_host[slot, :] = 0
        self._free_slots.append(slot)
        self._dirty = True

    def sync(self, stream=0) -> None:
        """Copy the block table to the device if it changed (before a step is launched)."""
        if self._dirty:
            self.block_tables.copy_to_device(self.block_tables_host, stream=stream)
            self._dirty = False
            if self._copied is not None:
                self._copied.record(stream)
                self._copy_pending = True
