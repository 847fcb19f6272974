"""The ops fusionlab knows and their variants: every sub-package here is an op, and importing
this package registers them all (a new op folder needs no edit anywhere else)."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.ispkg:
        importlib.import_module(f"{__name__}.{_module.name}")
