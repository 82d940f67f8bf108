"""The per-step host work of generation at 32 busy slots: route one step's tokens to
their generations (stop checks, wake-ups), Cython against its pure-Python twin."""

from __future__ import annotations

import numpy as np
import pytest

from pxrt import _slots_py

try:
    from pxrt import _slots as _slots_c
except ImportError:  # not built
    _slots_c = None

SLOTS = 32
IMPLS = [pytest.param(_slots_py, id="python")]
if _slots_c is not None:
    IMPLS.insert(0, pytest.param(_slots_c, id="cython"))


@pytest.mark.parametrize("impl", IMPLS)
def test_route_one_step_32_slots(benchmark, impl):
    benchmark.group = f"route one decode step, {SLOTS} busy slots"
    table = impl.SlotTable(SLOTS)
    gens = [impl.Generation(1 << 40, frozenset({257})) for _ in range(SLOTS)]
    for g in gens:
        table.assign(g)
    tokens = np.arange(SLOTS, dtype=np.int32)

    def step():
        owners = table.dispatch()
        woken: list = []
        finished: list = []
        table.route(tokens, owners, 0.0, woken, finished)
        for g in woken:
            g.woken = False
        return woken

    assert len(benchmark(step)) == SLOTS
    assert len(gens[0].tokens) > 0
