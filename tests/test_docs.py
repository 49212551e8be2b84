"""The docs point at files that exist, and speak of the project, not of how it was developed."""

import itertools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "notebooks" / "src").glob("*.py"))]


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
