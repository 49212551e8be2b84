"""Build the notebooks from their sources and execute them (run after editing notebooks/src/*.py).

    python scripts/build_notebooks.py            # all notebooks
    python scripts/build_notebooks.py 01         # only those whose name starts with 01

Sources are plain Python in "percent" format: `# %%` starts a code cell, `# %% [markdown]` a
markdown cell whose lines start with "# ". Keeping sources as .py makes reviews and diffs readable;
the .ipynb files (with outputs) are what students open and what nbval checks.
tests/test_notebooks_meta.py checks that each .ipynb's cells equal its source.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SRC, NB = ROOT / "notebooks" / "src", ROOT / "notebooks"


def parse(path: Path) -> list[tuple[str, str]]:
    """Source file -> [(cell_type, text)]."""
    cells: list[tuple[str, list[str]]] = []
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line)
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines]
        text = "\n".join(lines).strip("\n")
        if text:
            out.append((kind, text))
    return out


def build(src: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    for kind, text in parse(src):
        cell = nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text)
        cell.pop("id", None)
        nb.cells.append(cell)
    nb.nbformat_minor = 4  # no cell ids: stable diffs
    out = NB / (src.stem + ".ipynb")
    t0 = time.time()
    from nbclient import NotebookClient  # only needed to execute; parse() works without it

    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NB)}}).execute()
    for cell in nb.cells:  # strip volatile metadata
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in ("tags",)}
        for o in cell.get("outputs", []):
            o.get("metadata", {}).clear() if "metadata" in o else None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, out)
    print(f"{out.relative_to(ROOT)}: {time.time() - t0:.1f} s")
    return out


if __name__ == "__main__":
    prefix = sys.argv[1] if len(sys.argv) > 1 else ""
    for src in sorted(SRC.glob(f"{prefix}*.py")):
        build(src)
