"""Build the notebooks from their sources and execute them (run after editing notebooks/src/*.py).

    python scripts/build_notebooks.py            # all notebooks
    python scripts/build_notebooks.py 01         # only those whose name starts with 01
    python scripts/build_notebooks.py 01 --figures   # also rewrite the tracked figures/ (else out/figures)
    python scripts/build_notebooks.py 01 --force     # overwrite a notebook edited by hand (a backup is kept)

Sources are plain Python in "percent" format: `# %%` starts a code cell, `# %% [markdown]` a
markdown cell whose lines start with "# ". Keeping sources as .py makes reviews and diffs readable;
the .ipynb files (with outputs) are what students open and what nbval checks.
tests/test_notebooks_meta.py checks that each .ipynb's cells equal its source.

A notebook someone edited and saved (an exercise done in Jupyter) is never overwritten silently: a
built notebook carries a hash of its cells, and a notebook whose cells no longer match it (or, without
one, that differs from its committed version) is left alone unless --force, which first copies it to
notebooks/backup/ (ignored by git).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
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


def cells_hash(cells: list[tuple[str, str]]) -> str:
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()[:16]


def edited_by_hand(path: Path) -> bool:
    """True if `path` holds changes that a rebuild would lose (see the module docstring)."""
    if not path.exists():
        return False
    nb = nbformat.read(path, as_version=4)
    stamp = nb.metadata.get("minibatch", {}).get("cells_hash")
    if stamp is not None:
        return stamp != cells_hash([(c.cell_type, "".join(c.source)) for c in nb.cells])
    committed = subprocess.run(["git", "show", f"HEAD:{path.relative_to(ROOT).as_posix()}"], cwd=ROOT,
                               capture_output=True, text=True)
    return committed.returncode != 0 or committed.stdout != path.read_text()


def build(src: Path, force: bool = False) -> Path | None:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    for kind, text in parse(src):
        cell = nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text)
        cell.pop("id", None)
        nb.cells.append(cell)
    nb.nbformat_minor = 4  # no cell ids: stable diffs
    nb.metadata["minibatch"] = {"cells_hash": cells_hash(parse(src))}
    out = NB / (src.stem + ".ipynb")
    if edited_by_hand(out):
        if not force:
            print(f"{out.relative_to(ROOT)} was edited and saved by hand: not rebuilt, your work is in it.\n"
                  f"  Keep a copy of your own (cp {out.relative_to(ROOT)} notebooks/my_{src.stem[:2]}.ipynb), then\n"
                  f"  rebuild with --force (which also copies it to notebooks/backup/ first).", file=sys.stderr)
            return None
        backup = NB / "backup" / f"{src.stem}-{time.strftime('%Y%m%d-%H%M%S')}.ipynb"
        backup.parent.mkdir(exist_ok=True)
        shutil.copy2(out, backup)
        print(f"{out.relative_to(ROOT)}: edited by hand, copied to {backup.relative_to(ROOT)}")
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("prefix", nargs="?", default="", help="build the notebooks whose name starts with this")
    p.add_argument("--figures", action="store_true", help="write figures to the tracked figures/ (default out/figures)")
    p.add_argument("--force", action="store_true", help="overwrite notebooks edited by hand (after a backup)")
    args = p.parse_args()
    if args.figures:
        os.environ["MINIBATCH_FIGURES"] = str(ROOT / "figures")  # the kernel inherits it
    skipped = [src for src in sorted(SRC.glob(f"{args.prefix}*.py")) if build(src, args.force) is None]
    sys.exit(1 if skipped else 0)
