"""Proof that attention behaves: a-priori error bounds, certified output bounds, bounded-latency
streaming and a fuzz campaign; ``python -m keyfold verify`` reports each guarantee with its evidence.

Submodules: :mod:`.bounds` (forward error bound), :mod:`.certify` (interval and linear-relaxation
output bounds), :mod:`.fuzz` (robustness campaign), :mod:`.report` (the command). Docs:
``docs/error_bounds.md`` and ``docs/verify.md``.
"""
from keyfold._extras import require as _require

_require("verify", "keyfold.apps.verify")

