"""Where fusionlab's sub-packages kernels/ and search/ are found.

They are folders without __init__.py, so a checkout's root on sys.path never hides a real
package of that name (Hugging Face's `kernels`). A wheel installs them inside the fusionlab
package; in a checkout (an editable install) they sit beside it, so the checkout's root is
searched for fusionlab's sub-packages too.

fusionlab/__init__.py imports this module first; the package it extends is read from
`sys.modules` (it is being initialised), so the bottom floor imports nothing above it.
"""

import sys
from pathlib import Path

_PACKAGE = Path(__file__).parent
_CHECKOUT = _PACKAGE.resolve().parent
if not (_PACKAGE / "kernels").is_dir() and (_CHECKOUT / "kernels").is_dir():
    sys.modules[__package__].__path__.append(str(_CHECKOUT))
