"""Scratch memory of a work item: float32 pieces carved out of one arena."""

from std.math import ceildiv

from ..pointers import F32Ptr


struct Arena(Movable):
    """Float32 scratch of one work item, carved into zero-filled pieces. A
    List underneath, so it frees itself; pieces must not outlive it."""

    var storage: List[Float32]
    var used: Int

    def __init__(out self, capacity: Int):
        self.storage = List[Float32](length=capacity, fill=0)
        self.used = 0

    def take(mut self, count: Int, fill: Float32 = 0) -> F32Ptr:
        var p = (
            self.storage.unsafe_ptr()
            .unsafe_origin_cast[MutUntrackedOrigin]()
            .unsafe_offset(self.used)
        )
        for i in range(count):
            p[unsafe_offset=i] = fill
        self.used += count
        return p


def _round_up(n: Int, multiple: Int) -> Int:
    return ceildiv(n, multiple) * multiple
