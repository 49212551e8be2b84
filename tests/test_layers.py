"""The package's layers, read from its imports: each layer imports only itself and the layers below it,
and no module takes part in an import cycle (README, "The package map").

Imports inside functions count (they run sooner or later); imports under `if TYPE_CHECKING:` do not
(they never run). The package's own `__init__.py` files may re-export from their subpackage.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "minibatch"
# bottom to top: the core, then what plugs into it; a module at the package's top level other than its
# front doors is a failure below
LAYERS = ["core", "devices", "speed", "model", "serving", "tools"]
ENTRY = {"__init__", "__main__"}  # the package's front doors: they may import any layer


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None  # minibatch itself
    if len(parts) == 2 and parts[1] in ENTRY:
        return None
    return parts[1] if parts[1] in LAYERS else "unknown"


def _type_checking_nodes(tree) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports (resolved to modules, not names inside them)."""
    me = module_name(path)
    package = me if path.stem == "__init__" else me.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            while t and t not in modules:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != me:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): imports(p, modules) for p in files}


def test_every_module_sits_in_a_layer():
    unknown = [m for m in graph() if layer_of(m) == "unknown"]
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}"


def test_no_import_runs_up_the_layers():
    bad = []
    for mod, targets in graph().items():
        mine = layer_of(mod)
        if mine is None or mine == "unknown":
            continue
        for t in targets:
            theirs = layer_of(t)
            if theirs is None:
                bad.append(f"{mod} imports the package's front door {t}")
            elif theirs != "unknown" and LAYERS.index(theirs) > LAYERS.index(mine):
                bad.append(f"{mod} ({mine}) imports {t} ({theirs})")
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def test_the_core_imports_nothing_else_of_the_package():
    """The core a reader holds in their head: everything else plugs into it, never the reverse."""
    for mod, targets in graph().items():
        if layer_of(mod) == "core":
            assert all(layer_of(t) == "core" for t in targets), (mod, targets)


def test_the_devices_import_nothing_above_them():
    for mod, targets in graph().items():
        if layer_of(mod) == "devices":
            assert all(layer_of(t) in ("core", "devices") for t in targets), (mod, targets)


def test_no_import_cycle():
    edges = graph()
    # __init__ files that re-export their own subpackage would make every cycle through them look
    # like one; they import only downwards (checked above), so leave them out of the cycle search
    edges = {m: {t for t in ts if not (PKG / Path(*t.split(".")[1:]) / "__init__.py").exists()}
             for m, ts in edges.items()}
    cycles = []
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_layer_test_sees_a_violation(tmp_path):
    """The checks above would pass on a package with no imports at all: make sure they read imports."""
    edges = graph()
    assert "minibatch.core.device" in edges["minibatch.devices.cpu"]
    assert "minibatch.core.launch" in edges["minibatch.core.sync_loop"]
    assert any(t.startswith("minibatch.core") for t in edges["minibatch.core.graphs"])


def _functions():
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(ROOT), node


def test_functions_are_short():
    """A function a reader holds in one sitting: none over 60 lines."""
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _functions() if node.end_lineno - node.lineno + 1 > 60]
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


# A Triton kernel takes every pointer, stride and size as an argument of its own, and its launcher passes
# them on (a custom operator's schema, too, takes each tensor apart); everywhere else a long list of
# parameters is a dataclass waiting to be written
KERNELS = {"minibatch/model/triton_decode.py", "minibatch/model/attention.py", "minibatch/speed/skinny.py",
           "minibatch/model/fresh.py", "minibatch/model/triton_fresh.py"}
# the ones that may: a hot path's private helper and the offline front door (a SamplingParams, an
# EngineConfig and the run's hooks)
MANY_PARAMETERS = {"_pad_rows", "generate"}


def test_few_functions_take_many_parameters():
    """Outside the kernels, at most three functions take 8 or more parameters (`self` apart, `*args` and
    `**options` counted), and they are the ones named above."""
    many = []
    for path, node in _functions():
        a = node.args
        n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
        n -= bool(a.args) and a.args[0].arg in ("self", "cls")
        if n >= 8 and str(path) not in KERNELS:
            many.append(node.name)
    assert len(MANY_PARAMETERS) <= 3 and set(many) <= MANY_PARAMETERS, f"functions with 8+ parameters: {many}"


def test_every_subpackage_opens_with_its_map():
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = {p.name for p in init.parent.glob("*.py")} - {"__init__.py"}
        missing = [m for m in modules if m not in doc]
        assert not missing, f"{init.relative_to(ROOT)}: its docstring map does not name {missing}"


def test_each_class_name_is_defined_once():
    """One meaning per name: a reader who meets `TokenStream` or a device `Stream` knows which it is."""
    where: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"class names defined more than once: {twice}"


def code_lines(path: Path) -> int:
    """Lines of a module that are code: not its docstrings, comments or blank lines."""
    text = path.read_text()
    prose = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            prose.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(text.splitlines(), 1)
               if i not in prose and line.strip() and not line.strip().startswith("#"))


def test_the_core_stays_small():
    """The core a reader holds in their head (core/__init__.py): at most 2,200 lines of code. Its
    docstrings and comments are the teaching and are not counted: a bound on them would push the
    explanations out, not the code."""
    counts = {p.name: code_lines(p) for p in sorted((PKG / "core").glob("*.py"))}
    total = sum(counts.values())
    biggest = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    assert 1000 < total <= 2200, f"minibatch/core has {total} lines of code (at most 2,200); the largest: {biggest}"


def test_modules_are_short():
    """A module a reader takes in one sitting: none over 400 lines (most are under 300)."""
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400]
    assert not long, "modules over 400 lines (split them where they have two jobs):\n" + "\n".join(long)
