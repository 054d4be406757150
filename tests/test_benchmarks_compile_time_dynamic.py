"""benchmarks/compile_time_dynamic.py (``compile_time.py --dynamic``) on the 2-D plan at a
tiny size: its loop over batch sizes compiles once, the symbolic program makes the
collectives of the concrete one, and both take the inputs the step-time comparison feeds."""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

from compile_time_dynamic import PLANS, _feeds, collectives, loop, op_differences, program  # noqa: E402

TINY = {"vocab": 16, "seq": 4, "dim": 8, "heads": 2, "layers": 1}


def test_2d_loop_compiles_once_with_the_collectives_of_the_concrete_program():
    assert {"dp", "fsdp", "tp_seq", "2d"} <= set(PLANS)
    dyn = loop("2d", 4, True, sizes=[5, 1, 4], cfg=TINY)  # uneven, fewer rows than ranks, even
    assert dyn["compiles"] == 1, dyn["reasons"]
    sym = dyn["program"]
    assert sym.size_symbols, "dynamic=True made a concrete program"
    conc, _ = program("2d", 4, 4, dynamic=False, cfg=TINY)
    assert not conc.size_symbols
    assert collectives(sym.gm) == collectives(conc.gm), (collectives(sym.gm), collectives(conc.gm))
    assert collectives(conc.gm)["all_reduce"] > 0
    # the step-time feed: the same rank-0 inputs, the symbolic one with the global batch size
    sym_in, conc_in = _feeds(sym, conc, dyn["batch"])
    assert len(sym_in) == len(conc_in) + len(sym.size_symbols) and 4 in sym_in
    out_sym, out_conc = sym.gm(*sym_in), conc.gm(*conc_in)
    loss_sym, loss_conc = (o[0] if isinstance(o, (list, tuple)) else o for o in (out_sym, out_conc))
    torch.testing.assert_close(loss_sym, loss_conc)  # same rank program on the same inputs
    assert all(a != b for _, a, b in op_differences(sym.gm, conc.gm))
