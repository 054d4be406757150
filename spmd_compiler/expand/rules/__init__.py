"""Per-op expansion rules, grouped by op family. Importing this package registers them."""

from . import factory, matmul, scalars, shape  # noqa: F401
