"""Barriers in shared memory (`mbarrier`) between warps of a block that do
different work: one side arrives when it has done its part of a phase, the
other waits for that phase, and neither stops the rest of the block the way
a block barrier does. A barrier counts its arrivals; when all it was
initialised with have come, its phase completes and the next begins. A
waiter names the phase by its parity (even or odd), as the hardware does: a
wait returns once the phase of that parity before the current one is
complete, so a wait for parity 1 on a fresh barrier returns at once (the
phase before the first counts as complete), which is how a producer passes
its first waits for free stages.

A phase may also wait for bytes: a thread that arrives expecting `bytes`
(`arrive_expecting`) adds them to the phase's transaction count, and the
phase completes only once its arrivals have come and asynchronous copies
that name the barrier (`..tensor_map`: Hopper's tensor-map copies) have
landed that many bytes, each copy counting its own off as it lands.

On NVIDIA (sm_80 on) each barrier is the hardware's 8-byte object; arrive
has release and the wait acquire semantics at the block's scope, so what a
thread wrote to shared memory before arriving is seen by the threads whose
wait returns. Under the CPU emulator (`..block`) a barrier is four words in
the same place (arrivals pending, arrivals a phase, phases completed, bytes
pending) and the address of its copies pending (`pending_copy`), and a wait
whose phase is not complete aborts: the emulator runs a block's warps one
after the other between hand-offs (`BlockExecutor.handoff`), so a wait that
would block there is a protocol error a GPU would hang on. An emulated copy
naming the barrier lands only when a thread looks at the barrier (`wait`,
`is_complete`): a thread that reads what the copy brings without waiting
for it reads what was there before, as it could on a GPU, and the kernel's
emulated tests fail."""

from std.memory.alloc import unsafe_alloc
from std.os import abort
from std.sys.info import is_gpu, is_nvidia_gpu
from std.sys._assembly import inlined_assembly

from ..pointers import BytePtr
from .shared_memory import SharedMemory

comptime BARRIER_BYTES = 24
"""Bytes a barrier takes in shared memory: the hardware's 8 (8-byte
aligned), or the emulator's four words and a list's address."""
comptime _PENDING = 16
"""Emulated: bytes from a barrier to the address of its first pending copy."""
comptime _COPY_HEADER = 4
"""Emulated: words before a pending copy's bytes: the next copy's address,
where the bytes land, how many, and one spare (the bytes 16-byte aligned)."""


@fieldwise_init
struct SharedBarrier(TrivialRegisterPassable):
    """The barrier `offset` bytes into the block's `shared` memory."""

    var shared: SharedMemory
    var offset: Int

    @always_inline
    def words(self) -> Pointer[UInt32, MutUntrackedOrigin]:
        """Emulated: the barrier's words (arrivals pending, arrivals a phase,
        phases completed, bytes pending)."""
        return self.shared.generic.unsafe_offset(self.offset).unsafe_bitcast[UInt32]()

    @always_inline
    def init(self, arrivals: Int):
        """Starts the barrier's first phase, which completes after
        `arrivals` arrivals. One thread initialises it, and a block barrier
        separates that from any other use."""
        comptime if is_nvidia_gpu():
            inlined_assembly[
                "mbarrier.init.shared::cta.b64 [$0], $1;",
                NoneType,
                constraints="r,r,~{memory}",
                has_side_effect=True,
            ](self.shared.address + UInt32(self.offset), UInt32(arrivals))
        else:
            var words = self.words()
            words[unsafe_offset=0] = UInt32(arrivals)
            words[unsafe_offset=1] = UInt32(arrivals)
            words[unsafe_offset=2] = 0
            words[unsafe_offset=3] = 0
            self._first_pending()[] = 0

    @always_inline
    def fence_init(self):
        """After `init`, before any copy engine uses the barrier: makes the
        initialisation visible to the asynchronous proxy (tensor-map copies
        complete their bytes on it). Once, by the initialising thread."""
        comptime if is_nvidia_gpu():
            inlined_assembly[
                "fence.mbarrier_init.release.cluster;",
                NoneType,
                constraints="~{memory}",
                has_side_effect=True,
            ]()

    @always_inline
    def arrive[lanes: Int](self):
        """Threads `lanes` (1 on a GPU, a warp's under the emulator) arrive
        once each, their shared-memory writes before it released to the
        waiters."""
        comptime if is_nvidia_gpu():
            comptime assert lanes == 1, "on a GPU a program is one thread"
            inlined_assembly[
                "mbarrier.arrive.shared::cta.b64 _, [$0];",
                NoneType,
                constraints="r,~{memory}",
                has_side_effect=True,
            ](self.shared.address + UInt32(self.offset))
        else:
            self._emulated_arrivals(lanes)

    @always_inline
    def arrive_expecting(self, bytes: Int):
        """One thread arrives and adds `bytes` to the phase's transaction
        count: the phase then also waits for copies naming this barrier to
        land that many bytes (`..tensor_map.start_box`). Before the copies
        it expects, so that no phase completes between them."""
        comptime if is_nvidia_gpu():
            inlined_assembly[
                "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
                NoneType,
                constraints="r,r,~{memory}",
                has_side_effect=True,
            ](self.shared.address + UInt32(self.offset), UInt32(bytes))
        else:
            self.words()[unsafe_offset=3] += UInt32(bytes)
            self._emulated_arrivals(1)

    def pending_copy(self, offset: Int, bytes: Int) -> BytePtr:
        """Emulated: where a copy naming this barrier puts the `bytes` it
        brings to `offset` bytes into shared memory; they land, and count
        off the phase's bytes, when a thread next looks at the barrier (on
        a GPU the copy engine lands and counts them itself)."""
        comptime assert not is_gpu(), "the emulator's copies"
        var copy = unsafe_alloc[Int](_COPY_HEADER + (bytes + 7) // 8)
        copy[unsafe_offset=0] = self._first_pending()[]
        copy[unsafe_offset=1] = offset
        copy[unsafe_offset=2] = bytes
        self._first_pending()[] = Int(copy)
        return copy.unsafe_offset(_COPY_HEADER).unsafe_bitcast[UInt8]()

    def _first_pending(self) -> Pointer[Int, MutUntrackedOrigin]:
        return self.shared.generic.unsafe_offset(self.offset + _PENDING).unsafe_bitcast[Int]()

    def _land(self):
        """Emulated: every pending copy lands, its bytes counted off."""
        comptime if not is_gpu():
            var words = self.words()
            while self._first_pending()[] != 0:
                var copy = Pointer[Int, MutUntrackedOrigin](
                    unsafe_from_address=self._first_pending()[]
                )
                self._first_pending()[] = copy[unsafe_offset=0]
                var bytes = copy[unsafe_offset=2]
                var data = copy.unsafe_offset(_COPY_HEADER).unsafe_bitcast[UInt8]()
                var at = self.shared.generic.unsafe_offset(copy[unsafe_offset=1])
                for i in range(bytes):
                    at[unsafe_offset=i] = data[unsafe_offset=i]
                copy.unsafe_free()
                if words[unsafe_offset=3] < UInt32(bytes):
                    abort("mbarrier: a copy landed more bytes than its phase expects")
                words[unsafe_offset=3] -= UInt32(bytes)
                self._emulated_complete()

    def _emulated_arrivals(self, lanes: Int):
        var words = self.words()
        if words[unsafe_offset=0] < UInt32(lanes):
            abort("mbarrier: more arrivals than its phase counts")
        words[unsafe_offset=0] -= UInt32(lanes)
        self._emulated_complete()

    def _emulated_complete(self):
        """Emulated: the phase completes once no arrival and no byte is
        pending; the next one then expects the same arrivals."""
        var words = self.words()
        if words[unsafe_offset=0] == 0 and words[unsafe_offset=3] == 0:
            words[unsafe_offset=0] = words[unsafe_offset=1]
            words[unsafe_offset=2] += 1

    @always_inline
    def _probe[instruction: StaticString](self, parity: Int) -> Bool:
        """NVIDIA: `mbarrier.<instruction>.parity` (`test_wait`, which
        answers at once, or `try_wait`, which may first wait a while): whether
        the phase of parity `parity` is complete."""
        var done = inlined_assembly[
            "{ .reg .pred p; mbarrier."
            + instruction
            + ".parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }",
            UInt32,
            constraints="=r,r,r,~{memory}",
            has_side_effect=True,
        ](self.shared.address + UInt32(self.offset), UInt32(parity & 1))
        return done != 0

    @always_inline
    def is_complete(self, parity: Int) -> Bool:
        """Whether the phase of parity `parity` is complete, without waiting."""
        comptime if is_nvidia_gpu():
            return self._probe["test_wait"](parity)
        else:
            self._land()
            return Int(self.words()[unsafe_offset=2] & 1) != parity & 1

    @always_inline
    def wait(self, parity: Int):
        """Returns once the phase of parity `parity` is complete (the
        current phase's parity is then the other one)."""
        comptime if is_nvidia_gpu():
            while not self._probe["try_wait"](parity):
                pass
        else:
            if not self.is_complete(parity):
                abort("mbarrier: waited for a phase that has not completed")
