"""The light core install: `import keyfold` needs only torch and numpy; every command's --help
works without any extra; a missing extra names the exact pip line (issue #17)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from keyfold._extras import EXTRAS, OPTIONAL
from keyfold.__main__ import COMMANDS

# Run a snippet in a fresh interpreter where every optional package fails to import, as on a
# machine with `pip install keyfold` and no extras.
_BLOCK = textwrap.dedent(f"""
    import importlib.abc, sys
    BLOCKED = {sorted(OPTIONAL)!r}
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, _Block())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_import_keyfold_pulls_in_no_optional_package():
    r = _run("""
        import keyfold, keyfold.nn, keyfold.caches, keyfold.distributed, keyfold.kernels
        loaded = sorted({m.split('.')[0] for m in sys.modules} & set(BLOCKED))
        print('LOADED', loaded)
    """)
    assert r.returncode == 0, r.stderr
    assert "LOADED []" in r.stdout


def test_every_command_help_works_without_extras():
    words = [list(w) for w in COMMANDS]
    r = _run(f"""
        import contextlib, io
        from keyfold.__main__ import main
        for words in {words!r}:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    rc = main(words + ['--help'])
                except SystemExit as e:
                    rc = e.code
            assert rc == 0, (words, rc)
            assert 'usage' in out.getvalue().lower(), (words, out.getvalue()[:200])
            print('HELP-OK', ' '.join(words))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("HELP-OK") == len(COMMANDS)


@pytest.mark.parametrize("extra", ["translate", "toolbox", "verify", "control"])
def test_missing_extra_names_the_install_line(extra):
    r = _run(f"""
        try:
            import keyfold.apps.{extra}
        except ImportError as e:
            print('ERR', e)
        else:
            print('IMPORTED')
    """)
    assert f"pip install 'keyfold[{extra}]'" in r.stdout, r.stdout + r.stderr


def test_command_without_its_extra_prints_the_install_line_and_fails():
    r = _run("""
        from keyfold.__main__ import main
        sys.exit(main(['control', 'bench']))
    """)
    assert r.returncode == 1
    assert "pip install 'keyfold[control]'" in r.stderr


def test_extras_table_matches_pyproject():
    import pathlib
    import tomllib
    root = pathlib.Path(__file__).parents[2]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert extra in declared, extra
        names = {d.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip() for d in declared[extra]}
        assert set(modules) <= names, (extra, modules, names)
