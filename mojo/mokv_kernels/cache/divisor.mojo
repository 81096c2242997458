"""Division by a divisor fixed for a whole op call (`Divisor`): the page size
and the scale-block size, which every located key divides its position by."""


@fieldwise_init
struct Divisor(TrivialRegisterPassable):
    """`n // value` and `n % value` for `n` in [0, 2^31), as a multiply-high
    and a shift by constants found once (Granlund and Montgomery's method,
    as CUTLASS's `FastDivmod` uses it). A GPU has no integer divider: ptxas
    builds each 32-bit division from a float reciprocal and two corrections,
    about fifteen instructions, and the tensor-core kernels divided three
    times per key of every tile (its page, its row in the page, its scale
    row). Here a quotient is three instructions and a remainder one more.

    Exact because `multiplier` is 2^(31 + l) / `value` rounded up, with
    2^l >= `value`: the rounding adds less than n / 2^(31 + l) < 1 / `value`
    to n / `value`, which never reaches the next integer."""

    var value: UInt32
    var multiplier: UInt32
    var shift: UInt32

    @staticmethod
    def of(value: Int) raises -> Self:
        """The divisor `value`, in [1, 2^31)."""
        if value < 1 or value >= 1 << 31:
            raise Error(t"a divisor must be in [1, 2^31), not {value}")
        var log2_up = 0
        while (1 << log2_up) < value:
            log2_up += 1
        var power = UInt64(1) << UInt64(31 + log2_up)
        var multiplier = (power + UInt64(value) - 1) // UInt64(value)
        return Self(UInt32(value), UInt32(multiplier), UInt32(max(log2_up - 1, 0)))

    @staticmethod
    def one() -> Self:
        """The divisor 1 (`of(1)`, without a check to raise)."""
        return Self(1, UInt32(1) << 31, 0)

    @always_inline
    def quotient(self, n: Int) -> Int:
        """`n // value`, for `n` in [0, 2^31)."""
        var high = UInt32((UInt64(UInt32(n)) * UInt64(self.multiplier)) >> 32)
        return Int(UInt32(n) if self.value == 1 else high >> self.shift)

    @always_inline
    def remainder(self, n: Int) -> Int:
        """`n % value`, for `n` in [0, 2^31)."""
        return Int(UInt32(n) - UInt32(self.quotient(n)) * self.value)
