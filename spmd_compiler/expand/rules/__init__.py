"""Per-op expansion rules, grouped by op family. Importing this package registers them."""

from . import attention, batchnorm, concat, factory, indexing, losses, matmul, optimizers, partial_inputs, random, scalars, shape, views  # noqa: F401
