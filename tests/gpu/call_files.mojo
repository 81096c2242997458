"""A call's files, as the test harness binaries (`emulator.mojo`,
`warp_steps_on_gpu.mojo`) read and write them: `DIR/meta.txt` (`key value`
lines) and raw little-endian arrays `DIR/<name>.bin` written by
`tests/support/emulation.py`."""

from std.sys import size_of

from mokv_kernels.gpu.warp import WARP


struct Call:
    """One call's directory and its `meta.txt`."""

    var dir: String
    var meta: Dict[String, String]

    def __init__(out self, dir: String) raises:
        self.dir = dir
        self.meta = Dict[String, String]()
        var text: String
        with open(dir + "/meta.txt", "r") as f:
            text = f.read()
        for line in text.splitlines():
            var parts = line.split(" ")
            if len(parts) == 2:
                self.meta[String(parts[0])] = String(parts[1])

    def int(self, key: String) raises -> Int:
        return Int(self.meta[key])

    def text(self, key: String) raises -> String:
        return self.meta[key]

    def read(self, name: String) raises -> List[UInt8]:
        with open(self.dir + "/" + name + ".bin", "r") as f:
            return f.read_bytes()

    def write(self, name: String, data: List[UInt8]) raises:
        with open(self.dir + "/" + name + ".bin", "w") as f:
            f.write_bytes(Span(data))


def bytes_ptr[dtype: DType](mut bytes: List[UInt8]) -> Pointer[Scalar[dtype], MutUntrackedOrigin]:
    """`bytes` seen as elements of `dtype`."""
    return (
        bytes.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[Scalar[dtype]]()
    )


def lane_values[
    dtype: DType, width: Int
](mut bytes: List[UInt8]) -> Array[SIMD[dtype, width], WARP]:
    """Every lane's `width` values, lane-major."""
    var values = Array[SIMD[dtype, width], WARP](fill=0)
    var p = bytes_ptr[dtype](bytes)
    for l in range(WARP):
        values[l] = p.unsafe_load[width=width](l * width)
    return values^


def write_lane_values[
    dtype: DType, width: Int
](call: Call, values: Array[SIMD[dtype, width], WARP]) raises:
    """Every lane's `width` values, lane-major, as the call's `out.bin`."""
    var out = List[UInt8](length=WARP * width * size_of[Scalar[dtype]](), fill=0)
    var p = bytes_ptr[dtype](out)
    for l in range(WARP):
        p.unsafe_store(l * width, values[l])
    call.write("out", out)
