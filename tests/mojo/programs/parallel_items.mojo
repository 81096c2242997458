"""Checks `parallel.run_items`: prints one line per case, `<case> ok` or what went wrong."""

from std.atomic import Atomic
from std.ffi import external_call
from std.memory.alloc import unsafe_alloc

from max.runtime.asyncrt import parallelism_level

from mokv_weights.parallel import Job, run_items


@fieldwise_init
struct CountRuns(Job):
    """Counts how often each item ran, and spins a little so helpers get a share."""

    var runs: Pointer[Atomic[Int64], MutUntrackedOrigin]
    var spin: Int
    var threads: Pointer[Int, MutUntrackedOrigin]
    """Where each item writes the id of the thread that ran it."""

    def run(self, item: Int):
        self.threads[unsafe_offset=item] = external_call["pthread_self", Int]()
        var x = Float64(item)
        for _ in range(self.spin):
            x = x * 0.999 + 1.0
        if x < 0:  # never: keeps the loop
            print(x)
        _ = self.runs[unsafe_offset=item].fetch_add(1)


@fieldwise_init
struct Nested(Job):
    """Each item runs a whole `CountRuns` of its own: run_items called from a
    helper as well as from the caller."""

    var runs: Pointer[Atomic[Int64], MutUntrackedOrigin]
    var inner: Int
    var threads: Pointer[Int, MutUntrackedOrigin]

    def run(self, item: Int):
        var start = item * self.inner
        run_items(
            CountRuns(self.runs.unsafe_offset(start), 200, self.threads.unsafe_offset(start)),
            self.inner,
        )


def check(
    name: String,
    runs: Pointer[Atomic[Int64], MutUntrackedOrigin],
    threads: Pointer[Int, MutUntrackedOrigin],
    items: Int,
    helpers_expected: Bool,
):
    """Every item ran exactly once; with `helpers_expected`, on more than one thread."""
    var wrong = 0
    var other_thread = False
    for i in range(items):
        if Int(runs[unsafe_offset=i].load()) != 1:
            wrong += 1
        other_thread = other_thread or threads[unsafe_offset=i] != threads[unsafe_offset=0]
    if wrong != 0:
        print(name, "failed:", wrong, "of", items, "items did not run exactly once")
    elif helpers_expected and parallelism_level(None) > 1 and not other_thread:
        print(name, "failed: every item ran on one thread, with", parallelism_level(None), "workers")
    else:
        print(name, "ok")


def main():
    comptime MOST = 64 * 1000
    var runs = unsafe_alloc[Atomic[Int64]](MOST)
    var threads = unsafe_alloc[Int](MOST)
    # (name, items, spin per item, whether helpers must have joined)
    var cases: List[Tuple[String, Int, Int, Bool]] = [
        ("no items", 0, 0, False),
        ("one item", 1, 0, False),
        ("two items", 2, 10_000, False),
        ("many short items", 50_000, 0, False),
        ("many long items", 1000, 20_000, True),
    ]
    for c in cases:
        for i in range(MOST):
            runs[unsafe_offset=i] = Atomic[Int64](0)
        run_items(CountRuns(runs, c[2], threads), c[1])
        check(c[0], runs, threads, c[1], c[3])
    for i in range(MOST):
        runs[unsafe_offset=i] = Atomic[Int64](0)
    run_items(Nested(runs, 1000, threads), 64)
    check("nested", runs, threads, MOST, True)
    runs.unsafe_free()
    threads.unsafe_free()
