"""Fork-join for the CPU kernels: the calling thread works through the items
itself, and the runtime's other workers join in as they wake up.

`max.algorithm.sync_parallelize` (26.7) enqueues every item on the CPU
device's stream, which starts none of them before `synchronize()`, and then
waits for all of them: inside a graph op the items start late, the call
returns well after the last item ends, and even empty items cost far more
than taking them from a counter, on a path that a decode step takes for
every product.

Here the caller takes items from a shared counter from the first
nanosecond; each helper queued on the runtime (`KGEN_CompilerRT_AsyncRT_Execute`,
the C entry point the runtime's own task groups use) takes items from the
same counter once it runs, so a helper that wakes late takes fewer, and one
that wakes after the last item takes none. The state lives on the heap and
the last of the caller and its helpers to leave frees it, so the caller waits
only for items a helper has taken, never for a helper to start or to leave:
when MAX runs independent ops at once on its workers, a helper may find no
worker free until the ops are done, and waiting for helpers to leave, even
briefly, slowed independent products down where a chain of them was not.

So a helper may still be queued when `run_items` returns (it then takes no
item and frees only the shared state), and the code that queued it must stay
loaded until it has run: a graph's kernels stay loaded with their model, and
the tests build their Mojo programs rather than JIT-run them (`mojo run` frees
a program's code when `main` returns, and a late helper crashed there).
"""

from std.atomic import Atomic
from std.ffi import external_call
from std.memory.alloc import unsafe_alloc
from std.sys import llvm_intrinsic
from std.sys.info import CompilationTarget

from max.runtime.asyncrt import parallelism_level


trait Job(ImplicitlyCopyable & Deinitable):
    """Work cut into numbered items that may run on any thread, in any order."""

    def run(self, item: Int):
        """Does item `item`."""
        ...


struct _Team[J: Job](Movable):
    """What the caller and its helpers share: the job, the next item to take,
    the items finished, and how many of them have not left yet."""

    var job: Self.J
    var items: Int
    var next: Atomic[Int64]
    var finished: Atomic[Int64]
    var present: Atomic[Int64]

    def __init__(out self, job: Self.J, items: Int, members: Int):
        self.job = job
        self.items = items
        self.next = Atomic[Int64](0)
        self.finished = Atomic[Int64](0)
        self.present = Atomic[Int64](Int64(members))


comptime _TeamPtr[J: Job] = Pointer[_Team[J], MutUntrackedOrigin]


def _take_items[J: Job](team: _TeamPtr[J]):
    while True:
        var item = Int(team[].next.fetch_add(1))
        if item >= team[].items:
            return
        team[].job.run(item)
        _ = team[].finished.fetch_add(1)


def _leave[J: Job](team: _TeamPtr[J]):
    if team[].present.fetch_sub(1) == 1:
        team.unsafe_free()


def _helper[J: Job](state: Pointer[Int8, MutUntrackedOrigin]):
    """A helper's task on the runtime: take items until none are left, then leave."""
    var team = state.unsafe_bitcast[_Team[J]]()
    _take_items(team)
    _leave(team)


@always_inline
def _pause():
    comptime if CompilationTarget.is_x86():
        llvm_intrinsic["llvm.x86.sse2.pause", NoneType]()


def run_items[J: Job](job: J, items: Int, max_helpers: Int = Int.MAX):
    """Runs `job.run(i)` for every `i` in `range(items)` and returns when all are
    done: on the calling thread, joined by up to `max_helpers` of the runtime's
    workers (`parallelism_level() - 1` at most: the caller is the other core).
    Keep items at a few microseconds or more, so that taking one costs little
    beside it."""
    var helpers = min(parallelism_level(None) - 1, items - 1, max_helpers)
    if helpers <= 0:
        for item in range(items):
            job.run(item)
        return
    comptime assert _Team[J].__del__is_trivial, "a Job's fields must need no destructor"
    var team = unsafe_alloc[_Team[J]](1)  # freed, never destroyed: see the assert
    team.unsafe_write(_Team[J](job, items, helpers + 1))
    for _ in range(helpers):
        external_call["KGEN_CompilerRT_AsyncRT_Execute", NoneType](
            _helper[J], team.unsafe_bitcast[Int8](), Int(-1)
        )
    _take_items(team)
    while Int(team[].finished.load()) < items:
        _pause()
    _leave(team)
