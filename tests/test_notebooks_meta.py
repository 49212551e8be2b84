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
CHAPTER = {"model": 0, "tokenizer": 0, "engine": 0, "checks": 0, "memory": 0,
           "requests": 1, "kv_cache": 1, "scheduler": 1, "batch": 1, "decode_keys": 1, "sampling": 1, "sync_loop": 1,
           "timeline": 1, "device": 2, "device_base": 2, "cpu_device": 2, "thread_device": 2, "process_settings": 2,
           "device_process": 2, "device_names": 2, "cuda_device": 2, "slots": 4, "step": 4,
           "carry_over": 5,
           "async_loop": 6, "bench": 7, "floors": 7, "triton_decode": 7, "siblings": 7, "attention": 0}
# the notebooks built from a source; copies of them (my_00.ipynb, 00_welcome-Copy1.ipynb) are not tests
NOTEBOOKS = sorted(ROOT / "notebooks" / f"{src.stem}.ipynb" for src in (ROOT / "notebooks" / "src").glob("*.py"))


def code_of(nb_path):
    return [("".join(c["source"]), c) for c in json.loads(nb_path.read_text())["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


def _edited_message(nb: Path, src: Path) -> str:
    n = nb.stem[:2]
    return (f"notebooks/{nb.name} differs from notebooks/src/{src.name}, so its cells were skipped under nbval.\n"
            f"* If you saved your own work in it (an exercise, an edited cell): keep it in a file of your own and "
            f"restore the original:\n"
            f"      cp notebooks/{nb.name} notebooks/my_{n}.ipynb && git checkout notebooks/{nb.name}\n"
            f"  Your copy is not a test: pytest runs only the notebooks that have a source in notebooks/src/.\n"
            f"* If you edited notebooks/src/{src.name}: python scripts/build_notebooks.py {n}")


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_matches_its_source(nb):
    cells = json.loads(nb.read_text())["cells"]
    src = ROOT / "notebooks" / "src" / (nb.stem + ".py")
    assert [(c["cell_type"], "".join(c["source"])) for c in cells] == parse(src), _edited_message(nb, src)


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
    assert counts == list(range(1, len(counts) + 1)), (
        f"{nb.name}: cells were not run in order (saved after running cells by hand?). Keep your copy "
        f"(cp notebooks/{nb.name} notebooks/my_{nb.stem[:2]}.ipynb) and restore the original: "
        f"git checkout notebooks/{nb.name}")


def test_every_module_has_a_chapter():
    modules = {p.stem for p in (ROOT / "minibatch").glob("*.py")} - {"__init__", "__main__"}
    assert modules <= set(CHAPTER), f"no chapter for {modules - set(CHAPTER)}"


def test_every_figure_the_docs_name_is_committed():
    """README, BENCHMARKS and the notebooks' prose name figures/...png files: they must be in the
    repository, since running the notebooks writes figures under out/figures/, not figures/."""
    texts = [(ROOT / name).read_text() for name in ("README.md", "BENCHMARKS.md")]
    texts += [text for src in (ROOT / "notebooks" / "src").glob("*.py")
              for kind, text in parse(src) if kind == "markdown"]
    named = {m for text in texts for m in re.findall(r"figures/[\w.-]+\.png", text)}
    assert named, "no figure found: has the link syntax changed?"
    missing = sorted(f for f in named if not (ROOT / f).exists())
    assert not missing, f"named but not committed: {missing} (python scripts/build_notebooks.py NN --figures)"
