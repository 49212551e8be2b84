"""Notebook hygiene: each .ipynb equals its source, runs clean, and imports only what its chapter has met."""

import ast
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from build_notebooks import parse  # noqa: E402

# the first chapter that introduces each module, by its import path (README's notebook map says the same);
# a package's own name stands for what its __init__ exports
CHAPTER = {
    "minibatch": 0, "minibatch.core.args": 0,
    "minibatch.model": 0, "minibatch.model.model": 0, "minibatch.model.tokenizer": 0, "minibatch.model.attention": 0,
    "minibatch.model.checks": 0,
    "minibatch.core": 0, "minibatch.core.engine": 0, "minibatch.core.checks": 0, "minibatch.core.memory": 0,
    "minibatch.core.requests": 1, "minibatch.core.kv_cache": 1,
    "minibatch.core.scheduler": 1, "minibatch.core.batch": 1, "minibatch.core.decode_keys": 1,
    "minibatch.core.sampling": 1, "minibatch.core.penalties": 8, "minibatch.core.prefix_cache": 8, "minibatch.core.sync_loop": 1, "minibatch.core.timeline": 1,
    "minibatch.devices": 2, "minibatch.core.device": 2, "minibatch.devices.cpu": 2, "minibatch.devices.cpu_channel": 2, "minibatch.devices.cpu_process": 2,
    "minibatch.devices.names": 2, "minibatch.devices.settings": 2, "minibatch.devices.threads": 2, "minibatch.devices.thread_streams": 2,
    "minibatch.devices.cuda": 2, "minibatch.devices.lifecycle": 2, "minibatch.devices.limits": 2,
    "minibatch.core.slots": 4, "minibatch.core.buckets": 4, "minibatch.core.launch": 4,
    "minibatch.core.graphs": 4, "minibatch.speed": 7, "minibatch.speed.compiled": 7,
    "minibatch.core.carry_over": 5, "minibatch.devices.compat": 2, "minibatch.speed.compat": 7,
    "minibatch.core.async_loop": 6,
    "minibatch.tools": 7, "minibatch.tools.bench": 7, "minibatch.tools.floors": 7, "minibatch.tools.cli": 7,
    "minibatch.tools.cli_args": 7, "minibatch.tools.cli_serving": 8,
    "minibatch.model.triton_decode": 7, "minibatch.model.fresh": 7, "minibatch.model.triton_fresh": 7, "minibatch.speed.siblings": 7, "minibatch.speed.fx_edits": 7, "minibatch.speed.skinny": 7, "minibatch.speed.gated": 7, "minibatch.speed.early": 7, "minibatch.speed.wide_argmax": 7,
    "minibatch.speed.startup_graphs": 8,
    "minibatch.core.compat": 7, "minibatch.core.config": 0,
    "minibatch.serving.loop": 8, "minibatch.serving.service": 8, "minibatch.serving.stream": 8, "minibatch.tools.online": 8,
    "minibatch.serving": 8, "minibatch.serving.server": 8, "minibatch.serving.protocol": 8,
    "minibatch.serving.bench_serve": 8, "minibatch.serving.bench_report": 8, "minibatch.serving.diagnostics": 8,
    "minibatch.serving.guard": 8, "minibatch.serving.handlers": 8, "minibatch.serving.metrics": 8,
    "minibatch.serving.replies": 8, "minibatch.serving.startup": 8, "minibatch.serving.chat": 8,
}
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


def imported(source: str) -> list[str]:
    """The minibatch modules a cell imports, read with ast: `import minibatch.x.y` gives minibatch.x.y,
    `from minibatch.x import y` gives minibatch.x.y when y is a module, else minibatch.x."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]  # IPython magics
    names = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in CHAPTER else node.module
                      for a in node.names]
    return [n for n in names if n == "minibatch" or n.startswith("minibatch.")]


def test_imports_are_read_with_ast():
    cell = "import minibatch.devices.cpu\nfrom minibatch.core import scheduler\nfrom minibatch.tools.bench import run_mode\n" \
           "def f():\n    from minibatch.speed import siblings\n# from minibatch.serving import x\nimport torch"
    assert imported(cell) == ["minibatch.devices.cpu", "minibatch.core.scheduler", "minibatch.tools.bench",
                              "minibatch.speed.siblings"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_imports_only_earlier_chapters(nb):
    chapter = int(nb.name[:2])
    for source, _ in code_of(nb):
        for mod in imported(source):
            assert mod in CHAPTER, f"{nb.name} imports {mod}, which has no chapter in CHAPTER"
            assert CHAPTER[mod] <= chapter, f"{nb.name} imports {mod}, introduced in chapter {CHAPTER[mod]}"


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
    modules = set()
    for path in (ROOT / "minibatch").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] != "__main__":
            modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    assert modules <= set(CHAPTER), f"no chapter for {sorted(modules - set(CHAPTER))}"
    assert set(CHAPTER) <= modules, f"CHAPTER names modules that are gone: {sorted(set(CHAPTER) - modules)}"


def test_every_figure_the_docs_name_is_committed():
    """README, BENCHMARKS (and the history it links) and the notebooks' prose name figures/...png files:
    they must be in the repository, since running the notebooks writes figures under out/figures/, not
    figures/."""
    texts = [(ROOT / name).read_text() for name in ("README.md", "BENCHMARKS.md")]
    texts += [path.read_text() for path in sorted((ROOT / "notes").glob("benchmarks_history_*.md"))]
    texts += [text for src in (ROOT / "notebooks" / "src").glob("*.py")
              for kind, text in parse(src) if kind == "markdown"]
    named = {m for text in texts for m in re.findall(r"figures/[\w.-]+\.png", text)}
    assert named, "no figure found: has the link syntax changed?"
    missing = sorted(f for f in named if not (ROOT / f).exists())
    assert not missing, f"named but not committed: {missing} (python scripts/build_notebooks.py NN --figures)"
