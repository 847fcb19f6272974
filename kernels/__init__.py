"""The ops fusionlab knows and their variants; importing this package registers them."""

from fusionlab.kernels import rmsnorm  # noqa: F401
