"""A model of PyTorch's CUDA caching allocator, to predict the reserved bytes of a sequence of tensor
allocations and frees without a GPU (`benchlib fit --device cuda` on a machine that has none).

What an out-of-memory error is about is not the bytes tensors hold but the segments the allocator has
taken from the driver (`torch.cuda.max_memory_reserved`). The model follows the rules of
c10/cuda/CUDACachingAllocator.cpp with its default configuration (one stream, no `max_split_size_mb`,
no expandable segments, no garbage-collection threshold):

- every request is rounded up to a multiple of 512 bytes (at least 512);
- requests up to 1 MiB come from the small pool, larger ones from the large pool;
- a request is served by the smallest cached free block of its pool that holds it (then the lowest
  address); a block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB
  (large pool), otherwise the request gets the whole block;
- where no cached block holds it, a new segment is taken: 2 MiB for a small request, 20 MiB for one
  under 10 MiB, otherwise the request rounded up to 2 MiB;
- a freed block merges with free neighbours of its segment and stays cached: reserved bytes never fall.

Not modelled: the release of cached segments and retry when the device is full (the model's reserved
peak is then an upper bound of the real one), several streams, and allocations that bypass the
allocator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_BLOCK = 512  # every size is rounded to a multiple of this
SMALL_SIZE = 1 << 20  # the largest request served by the small pool
SMALL_SEGMENT = 2 << 20  # small requests are packed into segments of this size
LARGE_SEGMENT = 20 << 20  # requests below MIN_LARGE_ALLOC are packed into segments of this size
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20  # larger requests get a segment of their own, rounded up to this


def round_size(nbytes: int) -> int:
    """The bytes a request of `nbytes` holds in a block."""
    return MIN_BLOCK * max(1, -(-nbytes // MIN_BLOCK))


def segment_size(rounded: int) -> int:
    """The segment the allocator asks the driver for when no cached block holds a request of `rounded` bytes."""
    if rounded <= SMALL_SIZE:
        return SMALL_SEGMENT
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return ROUND_LARGE * -(-rounded // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class CachingAllocatorModel:
    """Replays `malloc(key, nbytes)` and `free(key)` and keeps the counters `torch.cuda.memory_stats` would:
    bytes allocated (as rounded blocks) and reserved (segments), current and peak."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    _free: dict[bool, list[_Block]] = field(default_factory=lambda: {True: [], False: []})
    _live: dict[object, _Block] = field(default_factory=dict)

    def malloc(self, key: object, nbytes: int) -> None:
        """Allocate `nbytes` for `key` (a tensor storage's identity); zero-byte storages take no block, as in torch."""
        if nbytes <= 0:
            return
        if key in self._live:
            raise ValueError(f"{key!r} is already allocated")
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        fitting = [block for block in pool if block.size >= size]
        if fitting:
            block = min(fitting, key=lambda b: (b.size, b.segment, b.offset))
            pool.remove(block)
        else:
            block = _Block(self.segments, 0, segment_size(size), small)
            self.segments += 1
            self.reserved += block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.segment, block.offset + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            pool.append(rest)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        """Free `key`'s block (nothing for a zero-byte storage): it merges with free neighbours and stays cached."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        pool = self._free[block.small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                pool.remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        pool.append(block)
