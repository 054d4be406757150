"""Property test of dynamic=True: a random data-parallel train step, mesh and list of
batch sizes; one symbolic program (one compile) serves every size, each step equal to
one device. A step whose sizes cannot stay symbolic must say so (the INFO fallback) and
then compile per shape, still equal to one device.

Example counts scale with the hypothesis profile (conftest.py), as in test_properties.py.
"""

from __future__ import annotations

import logging
import os

import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing import strategies as sst

SCALE = float(os.environ.get("SPMD_HYPOTHESIS_SCALE", "1.0"))


def n(count: int) -> int:
    return max(5, int(count * SCALE))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@settings(max_examples=n(10), deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(sst.dp_programs(), st.integers(2, 4), st.lists(st.integers(1, 33), min_size=3, max_size=3), st.integers(0, 2**16))
def test_one_symbolic_program_serves_random_steps_and_sizes(prog, ranks, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    batches = [prog.batch(b, g) for b in sizes]
    torch.manual_seed(seed)
    model = prog.model()
    logger = logging.getLogger("spmd_compiler.driver.dynamic")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        res = assert_training_matches(prog.step, model, lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                      fake_mesh((ranks,), ("dp",)), dynamic=True, atol=1e-10, rtol=1e-10)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    sim = res.sim
    fallback = getattr(sim.traced, "dynamic_fallback", None)
    if fallback is None:
        assert not records.messages, records.messages
        assert sim.compiles == 1, (prog, sizes, sim.reasons)
        assert sim.expansions[(0,)].size_symbols and sim.last_sizes == [sizes[-1]]
    else:  # the step cannot stay symbolic: said at every (per-shape) compile, one program per batch shape
        assert len(records.messages) == sim.compiles and fallback in records.messages[-1], records.messages
        assert all("cannot stay symbolic" in m for m in records.messages), records.messages
        changes = 1 + sum(a != b for a, b in zip(sizes, sizes[1:]))
        assert sim.compiles == changes and not sim.expansions[(0,)].size_symbols, (prog, sizes, sim.reasons)
