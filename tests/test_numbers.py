"""Numbers the prose quotes come from one place: figures/data/headline.json, derived from the runs.

A number in README.md or in a notebook's prose followed by `<!-- from figures/data/headline.json:
section.key -->` (several keys, comma-separated, for the numbers just before the marker, in order)
must be that headline value, rounded the way it is written. The marker is an HTML comment, so it
renders as nothing in Jupyter and on GitHub.
"""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
import recorded_numbers as recorded  # noqa: E402
from build_notebooks import parse  # noqa: E402

MARKER = re.compile(r"<!-- from (figures/data/[\w./-]+\.json): ?([\w., ]+?) ?-->")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def prose() -> list[tuple[str, str]]:
    """(where, text) for the README and every notebook's markdown cells."""
    texts = [("README.md", (ROOT / "README.md").read_text())]
    for src in sorted((ROOT / "notebooks" / "src").glob("*.py")):
        texts += [(f"notebooks/src/{src.name}", text) for kind, text in parse(src) if kind == "markdown"]
    return texts


def quoted(text: str) -> list[tuple[str, str, str]]:
    """(written number, data file, section.key) for every marked number in `text`."""
    out, end = [], 0
    for m in MARKER.finditer(text):
        keys = [k.strip() for k in m.group(2).split(",") if k.strip()]
        before = NUMBER.findall(text[end:m.start()])
        assert len(before) >= len(keys), f"marker {m.group(0)!r} names more keys than numbers precede it"
        out += [(w, m.group(1), k) for w, k in zip(before[len(before) - len(keys):], keys)]
        end = m.end()
    return out


def agrees(written: str, value: float) -> bool:
    digits = len(written.split(".")[1]) if "." in written else 0
    return abs(float(written) - value) <= 0.5 * 10 ** -digits + 1e-9


def test_headline_file_is_what_the_recorded_runs_say():
    stored = json.loads((ROOT / "figures" / "data" / "headline.json").read_text())
    assert stored == recorded.derive(), "figures/data/headline.json is stale: python tests/recorded_numbers.py rewrites it"
    for section in stored.values():
        for path in section["sources"]:
            assert (ROOT / path).exists(), path


def test_the_prose_marks_its_numbers():
    marked = {where for where, text in prose() if quoted(text)}
    for where in ("README.md", "notebooks/src/03_cuda_events.py", "notebooks/src/07_does_it_work.py"):
        assert where in marked, f"{where} quotes no marked number: has the marker syntax changed?"


@pytest.mark.parametrize("where,text", prose(), ids=lambda x: x if x.endswith((".md", ".py")) else "")
def test_every_marked_number_is_in_the_data_it_names(where, text):
    for written, path, key in quoted(text):
        data = json.loads((ROOT / path).read_text())
        section, _, field = key.partition(".")
        assert section in data and field in data[section], f"{where}: {path} has no {key}"
        value = data[section][field]
        assert agrees(written, value), f"{where} says {written} where {path} {key} is {value}"


def test_a_drifted_number_fails():
    text = "the step took 15.5 <!-- from figures/data/headline.json: decode_step.first_graphed_ms --> ms"
    [(written, path, key)] = quoted(text)
    assert agrees(written, 15.49) and not agrees("16.2", 15.49) and not agrees("15.4", 15.49)
    with pytest.raises(AssertionError):
        quoted("no number <!-- from figures/data/headline.json: a.b, a.c -->")
