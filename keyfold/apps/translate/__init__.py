"""Models built only on keyfold's attention: the Transformer of "Attention Is All You Need"."""
from keyfold._extras import require as _require

_require("translate", "keyfold.apps.translate")

