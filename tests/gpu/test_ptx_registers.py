"""`tools/ptx_registers.py --check`'s register budget of producer-fed kernels:
`setmaxnreg.inc` waits until the block's pool holds the registers it asks,
and the pool holds only what `setmaxnreg.dec` released, so a budget that
asks more hangs every block on the GPU while compiling cleanly."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import ptx_registers


def producer_fed(launch: int, consumers: int, producer: int) -> ptx_registers.Kernel:
    """A block of two consumer warpgroups and a producer one, as ptxas and
    the PTX describe it."""
    return ptx_registers.Kernel(
        name="prefill_wgmma_tma d128 16-bit",
        entry="entry",
        registers=launch,
        spill_bytes=0,
        stack=0,
        barriers=1,
        threads=384,
        shared=160 * 1024,
        min_blocks=1,
        tensor_cores=True,
        counts={"wgmma": 24, "tma": 32, "fence": 1, "local": 0},
        serialized=[],
        register_targets={"inc": consumers, "dec": producer},
    )


def test_a_budget_the_producer_pays_for_passes():
    kernel = producer_fed(168, 224, 56)
    assert kernel.register_shortfall() == 0
    assert kernel.problems() == []


def test_consumers_asking_more_than_the_producer_releases_fail():
    kernel = producer_fed(168, 232, 48)
    assert kernel.register_shortfall() == 8
    assert kernel.problems() == [
        "setmaxnreg asks 8 registers a thread more than the producer releases from the launch's 168"
        " (the block would hang)"
    ]


def test_the_budget_is_counted_from_ptxas_launch_count():
    # The same instructions under a launch of fewer registers release less.
    assert producer_fed(160, 224, 56).register_shortfall() == 24


def test_kernels_without_setmaxnreg_have_no_budget():
    kernel = producer_fed(168, 0, 0)
    kernel.register_targets = {}
    assert kernel.register_shortfall() == 0
