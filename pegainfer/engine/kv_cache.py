"""Paged KV-cache bookkeeping: which physical pages and which slot each sequence owns, and the prefix cache.

The device tensors themselves belong to the model (only its attention layers have KV caches, and a hybrid model
also keeps recurrent state per slot); this module hands out page ids and slot ids and keeps the block table —
``block_tables[slot, i]`` is the physical page holding tokens ``[i*page_size, (i+1)*page_size)`` of that slot's
sequence — mirrored on the device for the kernels.

Pages are allocated as sequences grow (``ensure_capacity``), from one pool sized from free GPU memory.  A page is
in one of three states:

* **in use**: held by one or more slots (``_refs[page] > 0``); several slots share a page when their prompts
  start with the same tokens (prefix caching);
* **cached**: no slot holds it, but it is full and its tokens' hash is known, so a later prompt with the same
  prefix can take it back instead of recomputing it; kept least-recently-used first and evicted when the free
  list runs dry;
* **free**: nothing of value in it.

Prefix caching (vLLM's scheme): the key of a full page is ``sha256(key of the page before, its token ids)``, so a
key names the whole prefix up to the page's end.  Only full pages are cached and shared, and a sequence never
writes into a page it shares (``match_prefix`` leaves the page of the prompt's last token to be computed), so
sharing needs no copy-on-write.

A hybrid model (Qwen3.5) also needs its recurrent state at the point where the cached pages end: attention layers
read the cached K/V, but a Gated DeltaNet layer carries the whole prefix in one state that K/V pages cannot
rebuild.  ``StateSnapshots`` indexes copies of that state taken at page boundaries, by the key of the page that ends
there; a prompt then reuses its cached pages only up to the longest boundary with a snapshot.

With async scheduling the host allocates or frees pages while the step that copies the table may not have run
yet, so every write to the host table first waits for the last asynchronous copy from it to have executed
(required were the table pinned; a cheap guarantee either way).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.engine.step_inputs import wait_event


def page_key(previous: bytes, token_ids) -> bytes:
    """The prefix-cache key of a full page: a hash of the key of the page before it (b"" for the first page) and
    the page's token ids."""
    return hashlib.sha256(previous + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class PagePool:
    """Free lists of KV pages and sequence slots, the block table, and the prefix cache's index."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_model_len: int,
                 prefix_caching: bool = False):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots
        self.prefix_caching = prefix_caching
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._cached: OrderedDict[int, bytes] = OrderedDict()   # page → key, no holder; least recently used first
        self._page_of_key: dict[bytes, int] = {}
        self._key_of_page: dict[int, bytes] = {}
        self._refs = np.zeros(num_pages, np.int32)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pages_of_slot: dict[int, list[int]] = {}
        self.prefix_queries = 0     # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0        # of those, tokens found
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
        """Pages some slot holds (cached pages that nobody holds do not count: they are reclaimable)."""
        return self.num_pages - len(self._free_pages) - len(self._cached)

    @property
    def pages_available(self) -> int:
        """Pages an allocation can take: free ones, then cached ones (evicted oldest first)."""
        return len(self._free_pages) + len(self._cached)

    @property
    def slots_used(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_held(self, slot: int) -> int:
        return len(self._pages_of_slot[slot])

    # -------------------------------------------------------------------------------------------- slots, pages
    def acquire_slot(self) -> int:
        slot = self._free_slots.pop()
        self._pages_of_slot[slot] = []
        return slot

    def _take_page(self) -> int:
        if self._free_pages:
            return self._free_pages.pop()
        page, key = self._cached.popitem(last=False)       # evict the least recently used cached page
        del self._page_of_key[key]
        del self._key_of_page[page]
        return page

    def ensure_capacity(self, slot: int, num_tokens: int) -> bool:
        """Give ``slot`` enough pages for ``num_tokens`` tokens. False (and nothing taken) when the pool is out of
        pages or the sequence would pass ``max_model_len``."""
        pages = self._pages_of_slot[slot]
        need = self.pages_needed(num_tokens) - len(pages)
        if need <= 0:
            return True
        if need > self.pages_available or len(pages) + need > self.max_pages_per_seq:
            return False
        self._before_host_write()
        for _ in range(need):
            page = self._take_page()
            self._refs[page] = 1
            self.block_tables_host[slot, len(pages)] = page
            pages.append(page)
        self._dirty = True
        return True

    def release(self, slot: int) -> None:
        """Return a slot and its pages: a page nobody else holds becomes free, or cached if it has a key."""
        self._before_host_write()
        for page in reversed(self._pages_of_slot.pop(slot, [])):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                key = self._key_of_page.get(page)
                if key is None:
                    self._free_pages.append(page)
                else:
                    self._cached[page] = key               # most recently used end
        self.block_tables_host[slot, :] = 0
        self._free_slots.append(slot)
        self._dirty = True

    # -------------------------------------------------------------------------------------------- prefix cache
    def match_prefix(self, token_ids, keys: list[bytes]) -> list[int]:
        """The cached pages that hold the longest prefix of ``token_ids`` in whole pages, leaving at least the last
        token to compute (its logits give the next token, and its page may not be shared).  ``keys``: the page
        keys computed so far for these tokens (extended in place, so they are computed once per sequence)."""
        ps = self.page_size
        full = (len(token_ids) - 1) // ps
        while len(keys) < full:
            i = len(keys)
            keys.append(page_key(keys[-1] if keys else b"", token_ids[i * ps:(i + 1) * ps]))
        pages = []
        for key in keys[:full]:
            page = self._page_of_key.get(key)
            if page is None:
                break
            pages.append(page)
        self.prefix_queries += len(token_ids)
        return pages

    def attach(self, slot: int, pages: list[int]) -> None:
        """Make ``pages`` (from ``match_prefix``, or its first ones) the first pages of an empty ``slot``; their
        tokens count as prefix-cache hits."""
        held = self._pages_of_slot[slot]
        assert not held, "attach cached pages to an empty slot only"
        self.prefix_hits += len(pages) * self.page_size
        self._before_host_write()
        for i, page in enumerate(pages):
            if self._refs[page] == 0:
                self._cached.pop(page)
            self._refs[page] += 1
            self.block_tables_host[slot, i] = page
            held.append(page)
        self._dirty = True

    def cache_full_pages(self, slot: int, token_ids, num_computed: int, keys: list[bytes], indexed: int) -> int:
        """Index the full pages of ``slot`` whose K/V are computed (``num_computed`` tokens) from page ``indexed`` on
        under their keys, so later prompts can share them; returns the new count of pages looked at.  A page whose
        key another page already has stays unindexed (freed when released)."""
        ps = self.page_size
        full = min(num_computed // ps, len(self._pages_of_slot[slot]))
        if not self.prefix_caching or full <= indexed:
            return indexed
        pages = self._pages_of_slot[slot]
        while len(keys) < full:
            i = len(keys)
            keys.append(page_key(keys[-1] if keys else b"", token_ids[i * ps:(i + 1) * ps]))
        for i in range(indexed, full):
            page, key = pages[i], keys[i]
            if page in self._key_of_page or key in self._page_of_key:
                continue
            self._page_of_key[key] = page
            self._key_of_page[page] = key
        return full

    # -------------------------------------------------------------------------------------------- device copy
    def sync(self, stream=0) -> None:
        """Copy the block table to the device if it changed (before a step is launched)."""
        if self._dirty:
            self.block_tables.copy_to_device(self.block_tables_host, stream=stream)
            self._dirty = False
            if self._copied is not None:
                self._copied.record(stream)
                self._copy_pending = True


class StateSnapshots:
    """Where a hybrid model's recurrent state was copied at page boundaries, for the prefix cache (module docstring).

    ``count`` snapshots live in the model's state rows ``first_row .. first_row + count - 1`` (rows no sequence
    holds); each is keyed by the prefix-cache key of the page that ends at its boundary, so it holds the state after
    exactly that prefix.  Least recently used first out when a new boundary needs a row.  Only the index lives here:
    the engine asks the model to copy a slot's state into a row (``store``) and a row into a new sequence's slot
    (``longest``)."""

    def __init__(self, count: int, first_row: int):
        self._row_of_key: OrderedDict[bytes, int] = OrderedDict()   # least recently used first
        self._free = list(range(first_row + count - 1, first_row - 1, -1))
        self.count = count

    def longest(self, keys: list[bytes], max_pages: int) -> tuple[int, int | None]:
        """(pages, row): the most of the first ``max_pages`` pages (keys ``keys``) that end at a boundary with a
        snapshot, and its row; (0, None) without one."""
        for pages in range(max_pages, 0, -1):
            row = self._row_of_key.get(keys[pages - 1])
            if row is not None:
                self._row_of_key.move_to_end(keys[pages - 1])
                return pages, row
        return 0, None

    def store(self, key: bytes) -> int | None:
        """The row to copy the state after the prefix ``key`` ends into, evicting the least recently used snapshot
        when every row is taken; None when that prefix already has one."""
        if key in self._row_of_key:
            self._row_of_key.move_to_end(key)
            return None
        row = self._free.pop() if self._free else self._row_of_key.popitem(last=False)[1]
        self._row_of_key[key] = row
        return row

    def __len__(self) -> int:
        return len(self._row_of_key)
