"""Deferred BatchNorm statistics across micro-batches.

With micro-batches, a training-mode BatchNorm would update its running mean and
variance once per micro-batch, from micro-batch statistics: not what one step on the
whole batch does. This rewrite of the traced step makes each micro-batch's forward
normalize with its own statistics (as it must) but *not* touch the running buffers;
it returns the micro-batch's mean and mean of squares, which the pipeline runtime
averages over the (equal-size) micro-batches, and the update of the running statistics
(and ``num_batches_tracked``) moves to the optimizer part, once per step, from the
full-batch mean and unbiased variance. The running stats then equal a full-batch step.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["defer_batchnorm_stats"]

aten = torch.ops.aten


def _add(g: fx.Graph, target, args, phase: str, meta_from: fx.Node) -> fx.Node:
    n = g.call_function(target, args)
    n.meta["spmd_phase"] = phase
    n.meta["seq_nr"] = meta_from.meta.get("seq_nr", -1)
    return n


def defer_batchnorm_stats(gm: fx.GraphModule, chunks: int) -> int:
    """Rewrite ``gm`` in place for ``chunks`` micro-batches; returns how many BatchNorms."""
    if chunks <= 1:
        return 0
    g = gm.graph
    output = next(n for n in g.nodes if n.op == "output")
    count = 0
    for bn in list(g.nodes):
        if bn.target is not aten._native_batch_norm_legit.default or bn.meta.get("spmd_phase") != "forward":
            continue
        x, w, b, rm, rv, training, momentum, eps = bn.args
        if not training:
            continue
        count += 1
        with g.inserting_before(bn):
            new = g.call_function(aten._native_batch_norm_legit.no_stats, (x, w, b, True, momentum, eps))
        new.meta.update({k: v for k, v in bn.meta.items() if k != "val"})
        bn.replace_all_uses_with(new)
        g.erase_node(bn)
        getitems = {u.args[1]: u for u in new.users if u.target is operator.getitem}
        order = {n: i for i, n in enumerate(g.nodes)}
        anchor = max(getitems.values(), key=order.__getitem__) if getitems else new
        # ``inserting_before(anchor.next)`` keeps the new nodes in creation order
        with g.inserting_before(anchor.next):
            mean = getitems.get(1) or _add(g, operator.getitem, (new, 1), "forward", new)
            invstd = getitems.get(2) or _add(g, operator.getitem, (new, 2), "forward", new)
            # micro-batch statistics the runtime averages: E[x] and E[x^2] per channel
            sq = _add(g, aten.mul.Tensor, (invstd, invstd), "forward", new)
            var = _add(g, aten.sub.Tensor, (_add(g, aten.reciprocal.default, (sq,), "forward", new), eps), "forward", new)
            ex2 = _add(g, aten.add.Tensor, (var, _add(g, aten.mul.Tensor, (mean, mean), "forward", new)), "forward", new)
        n_per_channel = 1
        shape = x.meta["val"].shape
        for i, s in enumerate(shape):
            if i != 1:
                n_per_channel *= int(s)
        total = n_per_channel * chunks
        with g.inserting_before(output):
            full_var = _add(g, aten.sub.Tensor, (ex2, _add(g, aten.mul.Tensor, (mean, mean), "optimizer", new)), "optimizer", new)
            unbiased = _add(g, aten.mul.Tensor, (full_var, total / max(1, total - 1)), "optimizer", new)
            _add(g, aten.lerp_.Scalar, (rm, mean, momentum), "optimizer", new)
            _add(g, aten.lerp_.Scalar, (rv, unbiased, momentum), "optimizer", new)
    # num_batches_tracked += 1 once per step
    for n in g.nodes:
        if n.target is aten.add_.Tensor and n.meta.get("spmd_phase") == "forward":
            inp = n.args[0].meta.get("spmd_input") if isinstance(n.args[0], fx.Node) else None
            if inp is not None and inp.kind == "buffer" and inp.name.endswith("num_batches_tracked") and count:
                n.meta["spmd_phase"] = "optimizer"
                output.prepend(n)
    g.lint()
    gm.recompile()
    return count
