"""Per-op expansion rules, grouped by op family. Importing this package registers them."""

from . import (  # noqa: F401
    accumulate, attention, batchnorm, concat, extrema, factory, grouped_mm, indexing, loss_parallel, losses, matmul, mean, norms, optimizers,
    pad, partial_inputs, random, routing, scalars, shape, views,
)
