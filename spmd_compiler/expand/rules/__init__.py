"""Per-op expansion rules, grouped by op family. Importing this package registers them."""

from . import attention, batchnorm, concat, factory, losses, matmul, mean, optimizers, partial_inputs, random, scalars, shape  # noqa: F401
