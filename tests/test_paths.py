"""Every repository path that the code, the notebooks' sources, the scripts and the docs name exists.

A path is a token that starts with one of the repository's folders (`minibatch/`, `scripts/`,
`tests/`, `notebooks/`, `figures/`), or a bare module file name (`graphs.py`), which must be some
file of the repository. Braces list alternatives (`gpu_bench_{eager,graphs}.json`) or, in an
f-string, stand for anything; `*` is a glob. Paths that commands write (`out/`, a notebook's backup or
a student's copy `notebooks/my_00.ipynb`) are not in the repository and are not checked.
"""

import itertools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("minibatch", "scripts", "tests", "notebooks", "figures")
PATH = re.compile(r"(?<![\w/.-])(?:%s)/[\w./{},*-]*[\w*}/]" % "|".join(FOLDERS))
MODULE = re.compile(r"(?<![\w/.'\"-])([a-z_][a-z0-9_]*\.py)\b")  # a name in quotes is data: a file a test writes
WRITTEN = ("notebooks/my_", "notebooks/backup", "figures/...")  # a student's copy, a backup; an ellipsis


def named_in() -> list[Path]:
    """The files whose text is checked: tracked code, notebook sources, scripts, tests and docs."""
    tracked = subprocess.run(["git", "ls-files", "minibatch", "scripts", "tests", "notebooks/src",
                              "notebooks/exercises.py", "notebooks/solutions", "README.md", "BENCHMARKS.md",
                              "notes", "figures/data/runs"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    # this file names missing paths on purpose, to show that the check finds them
    return [ROOT / p for p in tracked if p.endswith((".py", ".md", ".sh")) and p != "tests/test_paths.py"]


def expand(pattern: str) -> list[str]:
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [(p.split(",") if "," in p else ["*"]) if i % 2 else [p] for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def exists(path: str) -> bool:
    path = path.rstrip("/.")
    if "{" in path or "}" in path:
        if path.count("{") != path.count("}"):  # cut by the tokenizer: check the part before the brace
            path = path.split("{")[0].rsplit("/", 1)[0]
        return all(exists(p) for p in expand(path))
    return bool(list(ROOT.glob(path))) if "*" in path else (ROOT / path).exists()


def test_every_path_named_exists():
    missing = []
    for doc in named_in():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for path in PATH.findall(line):
                if not path.startswith(WRITTEN) and not exists(path):
                    missing.append(f"{doc.relative_to(ROOT)}:{n}: {path}")
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)


def test_every_module_file_named_exists():
    files = {p.name for p in ROOT.rglob("*.py") if ".git" not in p.parts}
    missing = []
    for doc in named_in():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            missing += [f"{doc.relative_to(ROOT)}:{n}: {m}" for m in MODULE.findall(line) if m not in files]
    assert not missing, "module files named but not in the repository:\n" + "\n".join(missing)


def test_the_check_finds_a_dangling_path(tmp_path):
    assert exists("scripts/gpu/floor_matrix.py") and exists("figures/data/gpu_bench_{eager,graphs}_llama3-8b-shape_b32_256.json")
    assert not exists("scripts/gpu/final2.sh") and not exists("figures/data/gpu_bench_{eager,nothing}_x.json")
    assert PATH.findall("see `scripts/gpu/final2.sh`, and minibatch/core/batch.py.") == [
        "scripts/gpu/final2.sh", "minibatch/core/batch.py"]


def test_every_recorded_run_folder_says_how_it_was_made():
    runs = [d for d in (ROOT / "figures" / "data" / "runs").iterdir() if d.is_dir()]
    assert runs and all((d / "README.md").exists() for d in runs), [d.name for d in runs if not (d / "README.md").exists()]
