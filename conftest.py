"""Repo-wide pytest hooks: per-notebook run time at the end of the test run (nbval runs one cell per item)."""

from collections import defaultdict

_notebook_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    if report.nodeid.split("::")[0].endswith(".ipynb"):
        _notebook_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if _notebook_seconds:
        terminalreporter.section("notebook run times (nbval, all cells)")
        for nb, seconds in sorted(_notebook_seconds.items()):
            terminalreporter.write_line(f"{seconds:7.1f} s  {nb}")
