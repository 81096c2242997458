"""Prints the GPU attention planner's choice for each case on the command
line (`tests/gpu/test_attention_plan.py`): each case is thirteen integers,
`batch kv_heads group prefill_rows max_new max_context multiprocessors
decode_blocks decode_tile prefill_blocks prefill_tile fixed_splits
decode_heads_per_block`, and its line `decode tokens_per_tile query_tiles
splits`."""

from std.sys import argv

from mokv_kernels.gpu.attention.plan import BatchBounds, KernelFit, plan_attention

comptime FIELDS = 13


def main() raises:
    var args = argv()
    var numbers = List[Int]()
    for i in range(1, len(args)):
        numbers.append(Int(args[i]))
    if len(numbers) % FIELDS != 0:
        raise Error(t"{len(numbers)} numbers: cases take {FIELDS} each")
    for c in range(len(numbers) // FIELDS):
        var n = numbers[c * FIELDS : (c + 1) * FIELDS]
        var plan = plan_attention(
            n[0],
            n[1],
            n[2],
            BatchBounds(n[4], n[5]),
            n[6],
            KernelFit(n[7], n[8], n[12]),
            KernelFit(n[9], n[10], query_rows=n[3]),
            n[11],
        )
        print(Int(plan.decode), plan.tokens_per_tile, plan.query_tiles, plan.splits)
