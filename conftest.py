"""Repo-wide pytest hooks: which notebooks are tests, and per-notebook run time at the end of the run.

Only the numbered notebooks built from a source in notebooks/src/ are tests. A participant's own
copies (notebooks/my_00.ipynb, "00_welcome-Copy1.ipynb", notebooks/backup/) are never collected, and a
numbered notebook whose cells someone edited is reported once, by tests/test_notebooks_meta.py, with
what to do, instead of failing cell by cell under nbval.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
NOTEBOOKS, SOURCES = ROOT / "notebooks", ROOT / "notebooks" / "src"
_notebook_seconds: dict[str, float] = defaultdict(float)


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix == ".ipynb":
        if collection_path.parent != NOTEBOOKS or not (SOURCES / f"{collection_path.stem}.py").exists():
            return True
    return None


def _edited(nb_path: Path) -> bool:
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_notebooks import parse

    cells = json.loads(nb_path.read_text())["cells"]
    return [(c["cell_type"], "".join(c["source"])) for c in cells] != parse(SOURCES / f"{nb_path.stem}.py")


def pytest_collection_modifyitems(config, items):
    edited: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            if path not in edited:
                edited[path] = _edited(path)
            if edited[path]:
                item.add_marker(pytest.mark.skip(reason=f"{path.name} was edited: see test_notebook_matches_its_source"))


def pytest_report_header(config):
    # a failure that only the newest releases show is read against these (CI installs afresh each run)
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    names = ("torch", "transformers", "nbval", "jupyterlab", "ipykernel", "fastapi", "openai")
    return f"python {sys.executable}: " + ", ".join(f"{n} {v(n)}" for n in names)


def pytest_runtest_logreport(report):
    if report.nodeid.split("::")[0].endswith(".ipynb"):
        _notebook_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if _notebook_seconds:
        terminalreporter.section("notebook run times (nbval, all cells)")
        for nb, seconds in sorted(_notebook_seconds.items()):
            terminalreporter.write_line(f"{seconds:7.1f} s  {nb}")
