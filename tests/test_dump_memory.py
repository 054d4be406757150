"""Static memory trace of a per-rank program (spmd_compiler/dump/memory.py)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler.dump import memory_trace
from spmd_compiler.runtime.executor import compile_runner

KB = 1024  # a [16, 16] float32 tensor


def _program(x, w):
    a = torch.mm(x, w)  # +1 KB
    b = a.t()  # view of a: keeps it alive
    c = b + 1  # +1 KB: x, w, a, c alive (the peak)
    c.relu_()  # in place: nothing new
    parts = torch.split(c, 8)  # views of c
    d = parts[0] * 2  # +0.5 KB, a is dead by now
    values, indices = torch.max(d, 0)  # two outputs, two storages
    return values.sum() + indices.sum()


def _gm():
    return make_fx(_program)(torch.randn(16, 16), torch.randn(16, 16))


def test_peak_counts_inputs_and_live_values_views_and_inplace_free():
    gm = _gm()
    trace = memory_trace(gm)
    assert trace.input_bytes == {"input": 2 * KB}
    assert trace.peak_bytes == 4 * KB  # x, w, a (alive through its view b), c
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)[0].name == trace.peak_node
    names = {v.name: v.bytes for v in trace.at_peak}
    assert names["mm"] == KB and names["add"] == KB
    nodes = list(gm.graph.nodes)
    at = {n.name: trace.live[i] for i, n in enumerate(nodes)}
    assert at["relu_"] == 3 * KB  # a died at add (its view b's last use); relu_ allocates nothing
    assert at["mul"] == 3 * KB + KB // 2  # x, w, c (alive through the split views) and d
    assert at["max_1"] == 2 * KB + KB // 2 + 64 + 128  # c is dead; d, values (16 floats), indices (16 int64)


def test_static_peak_matches_the_allocator_under_the_runtime():
    # the same program run by the runtime's executor, measured by torch.profiler: every
    # allocation and free of the CPU allocator, summed in time order
    from torch.profiler import ProfilerActivity, profile

    gm = _gm()
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    run = compile_runner(gm)
    run(x, w)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(x, w)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    total, peak = 0, 0
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    trace = memory_trace(gm)
    # the inputs were allocated before the profiler started; what the trace cannot see is
    # the 0-d tensors the Python number in `b + 1` becomes for the op (8 + 4 bytes)
    assert 0 <= peak - (trace.peak_bytes - trace.total_input_bytes) <= 12
