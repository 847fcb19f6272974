"""Where fusionlab's sub-packages kernels/ and search/ are found.

They are folders without __init__.py, so a checkout's root on sys.path never hides a real
package of that name (Hugging Face's `kernels`). A wheel installs them inside the fusionlab
package; in a checkout (an editable install) they sit beside it, so the checkout's root is
searched for fusionlab's sub-packages too.
"""

from pathlib import Path

import fusionlab

_PACKAGE = Path(fusionlab.__path__[0])
_CHECKOUT = _PACKAGE.resolve().parent
if not (_PACKAGE / "kernels").is_dir() and (_CHECKOUT / "kernels").is_dir():
    fusionlab.__path__.append(str(_CHECKOUT))
