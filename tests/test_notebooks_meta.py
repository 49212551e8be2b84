"""Notebook hygiene: each .ipynb equals its source, runs clean, and imports only what its chapter has met."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from build_notebooks import parse  # noqa: E402

# the first chapter that introduces each module (README's notebook map says the same)
CHAPTER = {"model": 0, "tokenizer": 0, "engine": 0,
           "requests": 1, "kv_cache": 1, "scheduler": 1, "batch": 1, "sampling": 1, "sync_loop": 1,
           "timeline": 1, "device": 2, "device_base": 2, "cpu_device": 2, "thread_device": 2,
           "device_process": 2, "cuda_device": 2, "slots": 4, "step": 4,
           "carry_over": 5,
           "async_loop": 6, "bench": 7, "triton_decode": 7, "attention": 0}
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def code_of(nb_path):
    return [("".join(c["source"]), c) for c in json.loads(nb_path.read_text())["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_matches_its_source(nb):
    cells = json.loads(nb.read_text())["cells"]
    src = ROOT / "notebooks" / "src" / (nb.stem + ".py")
    assert [(c["cell_type"], "".join(c["source"])) for c in cells] == parse(src), \
        f"{nb.name} differs from {src.name}: run python scripts/build_notebooks.py {nb.stem[:2]}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_imports_only_earlier_chapters(nb):
    chapter = int(nb.name[:2])
    for source, _ in code_of(nb):
        for mod in re.findall(r"minibatch\.(\w+)", source):
            if mod in CHAPTER:
                assert CHAPTER[mod] <= chapter, f"{nb.name} uses minibatch.{mod}, introduced in chapter {CHAPTER[mod]}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_was_run_top_to_bottom_without_errors(nb):
    counts = []
    for source, cell in code_of(nb):
        assert cell.get("execution_count") is not None, f"{nb.name}: a cell was not run"
        counts.append(cell["execution_count"])
        assert not [o for o in cell["outputs"] if o["output_type"] == "error"], f"{nb.name}: stored error"
    assert counts == list(range(1, len(counts) + 1)), f"{nb.name}: cells were not run in order"


def test_every_module_has_a_chapter():
    modules = {p.stem for p in (ROOT / "minibatch").glob("*.py")} - {"__init__", "__main__"}
    assert modules <= set(CHAPTER), f"no chapter for {modules - set(CHAPTER)}"
