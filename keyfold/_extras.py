"""Optional dependencies: which extra brings which packages, and the error that says so.

The library (``import keyfold``) needs only torch and numpy (and tqdm for progress bars).
Each application and tool declares its own extra in ``pyproject.toml``; this table mirrors it.
A missing extra raises :class:`MissingExtra`, an ``ImportError`` whose message is the exact
``pip install`` line to run.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["EXTRAS", "MissingExtra", "require", "missing", "help_stubs"]

#: extra -> the importable modules it provides (keep in step with pyproject.toml)
EXTRAS: dict[str, tuple[str, ...]] = {
    "plot": ("matplotlib",),
    "translate": ("sentencepiece", "sacrebleu", "safetensors", "matplotlib"),
    "toolbox": ("scipy", "statsmodels", "matplotlib"),
    "verify": ("hypothesis", "matplotlib"),
    "control": ("scipy", "osqp", "daqp", "matplotlib"),
    "triton": ("triton",),
    "hf": ("transformers",),
}

OPTIONAL = frozenset(m for mods in EXTRAS.values() for m in mods)


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed; the message is the install line."""


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a broken or blocked install counts as absent
        return True


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [m for m in EXTRAS[extra] if _absent(m)]


def require(extra: str, feature: str | None = None) -> None:
    """Raise :class:`MissingExtra` naming ``pip install 'keyfold[extra]'`` if any module is absent.

    >>> require("plot") is None  # matplotlib is installed where the doctests run
    True
    """
    absent = missing(extra)
    if absent:
        what = feature or f"keyfold's {extra!r} feature"
        err = MissingExtra(f"{what} needs {', '.join(absent)}, which is not installed; "
                           f"run: pip install 'keyfold[{extra}]'")
        err.name = absent[0]
        raise err


class _Inert(types.ModuleType):
    """Stands in for a missing package while a command prints its --help: every attribute is
    another inert object that can be called, subclassed, decorated with and iterated (empty)."""

    def __init__(self, name="inert", *args, **kwargs):
        super().__init__(str(name))
        self.__path__ = []

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Inert(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Inert(self.__name__)

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Inert(spec.name)

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def help_stubs():
    """While a command prints ``--help`` only: missing optional packages import as inert stubs,
    so argument parsing works without any extra installed."""
    absent = {m for m in OPTIONAL if _absent(m)}
    finder = _InertFinder(absent)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in absent]:
            del sys.modules[name]
