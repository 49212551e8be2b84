"""The docs point at files that exist, and speak of the project, not of how it was developed."""

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# BENCHMARKS.md links the history of its earlier runs (notes/benchmarks_history_*.md): checked alike
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "notes").glob("benchmarks_history_*.md")),
        *sorted((ROOT / "notebooks" / "src").glob("*.py"))]


def expand(pattern: str) -> list[str]:
    """'a_{x,y}_b.json' -> ['a_x_b.json', 'a_y_b.json'] (the brace lists the docs use); a brace without
    a comma is an f-string's field in a notebook source and matches anything."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [(p.split(",") if "," in p else ["*"]) if i % 2 else [p] for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def test_every_data_file_and_figure_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for ref in re.findall(r"figures/(?:data/)?[A-Za-z0-9_.{},*\-]+\.(?:json|txt|log|png)", text):
            for path in expand(ref):
                if not list(ROOT.glob(path)):
                    missing.append(f"{doc.name}: {path}")
    assert not missing, "the docs name files that do not exist: " + "; ".join(sorted(set(missing)))


def test_no_tracked_file_speaks_of_how_the_project_was_developed():
    # each word written with one letter in brackets: the pattern matches the words, this line does not
    words = (r"\bs[e]ssions?\b|workpl[a]ce|device t[o]ol|foundation r[u]n|next p[e]riod|work p[e]riod|\bl[e]ase\b|"
             r"\bi[s]sue #?[0-9]")
    out = subprocess.run(["git", "grep", "-n", "-i", "-E", words, "--", "."], cwd=ROOT, capture_output=True,
                         text=True).stdout.splitlines()
    hits = [line for line in out if 'scope="session"' not in line]
    assert not hits, "\n".join(hits[:10])


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def test_readme_fences_say_what_runs_where():
    """```python blocks run as written on a CPU; commands are ```bash (or ```console / ```shell for a GPU or
    a server); a block without a language would be neither run nor said."""
    fences = re.findall(r"^```(\w*)$", (ROOT / "README.md").read_text(), flags=re.M)
    openings = fences[::2]
    assert set(openings) <= {"python", "bash", "console", "shell"}, openings
    assert readme_blocks("python"), "no python block found: has the fence syntax changed?"


@pytest.mark.parametrize("block", readme_blocks("python"), ids=lambda b: b.splitlines()[0][:40])
def test_readme_python_block_runs_as_written(block, tmp_path):
    """Each ```python block of the README, in a fresh interpreter on the CPU, using this checkout's package."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"README block failed:\n{block}\n--- stderr ---\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), "the block printed nothing: its output should show the decoded text"


def test_readme_reading_times_are_the_notebooks():
    table = dict(re.findall(r"^\| \d\d \| `(\d\d)_\w+` \|.*?\| (\d+) min \|", (ROOT / "README.md").read_text(), flags=re.M))
    said = {src.name[:2]: re.search(r"\*\*Time:\*\* about (\d+) minutes", src.read_text()).group(1)
            for src in sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))}
    assert table == said, f"README's reading times {table} differ from the notebooks' {said}"


def test_benchmarks_holds_todays_results_only():
    """BENCHMARKS.md is read whole: today's result of each topic, at most 400 lines. Runs it replaces
    move to a dated history file it links (notes/benchmarks_history_*.md), which it must name."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    lines = text.count("\n")
    assert lines <= 400, f"BENCHMARKS.md has {lines} lines (at most 400): move replaced runs to its history"
    histories = sorted(p.name for p in (ROOT / "notes").glob("benchmarks_history_*.md"))
    assert histories and all(f"notes/{name}" in text for name in histories), histories
