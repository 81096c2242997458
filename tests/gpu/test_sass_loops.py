"""`tools/sass_loops.py` finds a kernel's tile loop in nvdisasm's listing:
the docs' per-tile instruction counts come from it, so a wrong pick misstates
them (the producer-fed prefills' barrier waits branch back around their whole
consumer part, which holds more products than the tile loop)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import sass_loops

# A consumer part as nvdisasm prints it: the first tile's product, the tile
# loop (a product, a float add, a masking branch over two selects), the last
# tile's product, and a barrier wait's retry branching back to the start.
LISTING = """
.L_x_1:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ ;
.L_x_2:
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*0030*/                   FADD R1, R2, R3 ;
        /*0040*/              @!P2 BRA `(.L_x_3) ;
        /*0050*/                   FSEL R4, R5, R6, P3 ;
        /*0060*/                   FSEL R7, R8, R9, P4 ;
        /*0070*/                   ISETP.GE.AND P3, PT, R1, R2, PT ;
        /*0080*/                   ISETP.GE.AND P4, PT, R1, R3, PT ;
        /*0090*/                   FSEL R4, R5, R6, P3 ;
        /*00a0*/                   FSEL R7, R8, R9, P4 ;
        /*00b0*/                   ISETP.GE.AND P3, PT, R1, R2, PT ;
        /*00c0*/                   ISETP.GE.AND P4, PT, R1, R3, PT ;
        /*00d0*/                   FSEL R4, R5, R6, P3 ;
        /*00e0*/                   FSEL R7, R8, R9, P4 ;
        /*00f0*/                   ISETP.GE.AND P3, PT, R1, R2, PT ;
        /*0100*/                   ISETP.GE.AND P4, PT, R1, R3, PT ;
        /*0110*/                   FSEL R4, R5, R6, P3 ;
        /*0120*/                   FSEL R7, R8, R9, P4 ;
        /*0130*/                   ISETP.GE.AND P3, PT, R1, R2, PT ;
        /*0140*/                   ISETP.GE.AND P4, PT, R1, R3, PT ;
.L_x_3:
        /*0150*/              @!P0 BRA `(.L_x_2) ;
        /*0160*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*0170*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*0180*/              @!P1 BRA `(.L_x_1) ;
"""


def test_the_tile_loop_is_the_innermost_loop_with_products():
    found = sass_loops.loops(LISTING)
    assert sorted((lp.start, lp.end) for lp in found) == [(0x10, 0x180), (0x20, 0x150)]
    tile_loop = sass_loops.tile_loop_first(found)[0]
    assert (tile_loop.start, tile_loop.end) == (0x20, 0x150)
    assert tile_loop.kinds()["mma"] == 1
    assert len(tile_loop.opcodes) == 20


def test_a_tile_loops_masking_branch_is_a_skip():
    tile_loop = sass_loops.tile_loop_first(sass_loops.loops(LISTING))[0]
    assert [(address, len(skipped)) for address, skipped in tile_loop.skips] == [(0x40, 16)]
    assert sass_loops.Loop(0, 0, tile_loop.skips[0][1], []).kinds() == {"float": 8, "int": 8}


def test_without_nested_loops_the_one_with_most_products_comes_first():
    plain = LISTING.replace("@!P1 BRA `(.L_x_1)", "FADD R1, R1, R1")
    found = sass_loops.loops(plain)
    assert [(lp.start, lp.end) for lp in sass_loops.tile_loop_first(found)] == [(0x20, 0x150)]
