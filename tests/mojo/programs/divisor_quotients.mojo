"""Prints `Divisor`'s quotient and remainder of each (dividend, divisor) pair
on the command line, one `n d q r` line per pair, for the test to hold
against Python's integer division; `refused d` for a divisor it refuses."""

from std.sys import argv

from mokv_kernels.cache.divisor import Divisor


def main() raises:
    var args = argv()
    for i in range(1, len(args), 2):
        var n = Int(args[i])
        var d = Int(args[i + 1])
        try:
            var divisor = Divisor.of(d)
            print(n, d, divisor.quotient(n), divisor.remainder(n))
        except:
            print("refused", d)
