"""The package's import graph: which modules import which (at module level or inside a function;
``if TYPE_CHECKING:`` imports do not run and are left out), and the cycles in it.

No cycle is allowed, and no import (a function-level one included) may reach a layer above the
importing module's: the layers are those drawn in ``docs/architecture.md``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import wrapkit

PACKAGE = Path(wrapkit.__file__).resolve().parent  # the one imported: a checkout or an installed wheel

# Lowest first. A module may import its own layer and the ones below it.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundations", {"_errors", "base", "_names", "_imports", "_results", "_protocol", "_agree", "_gather"}),
    # A format imports no backend and no operation: it lies below both.
    ("formats", {"formats"}),
    ("backends", {"adapters", "layers"}),
    ("detection", {"_registry"}),
    ("operations", {"exchange", "references", "sync", "training", "shutdown"}),
    ("public API", {"", "_wrapped", "_adapt"}),
    ("integrations and cli", {"integrations", "cli", "__main__"}),
]


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    for level, (_, members) in enumerate(LAYERS):
        if top in members or module in members:
            return level
    raise AssertionError(f"{module!r} is in no layer; add it to LAYERS and to docs/architecture.md")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(types: bool = False, extra: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module (relative to the package) -> the package modules it imports (with ``types``, those imported for
    type checking only too). ``extra``: more modules, by name, with their source (none is an ``__init__``)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    sources = {name: path.read_text() for name, path in modules.items()} | (extra or {})
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for name, source in sources.items():
        path = modules.get(name, PACKAGE / "module.py")
        tree = ast.parse(source)
        type_only = {id(n) for node in ast.walk(tree)
                     if not types and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                     for n in ast.walk(node)}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = [p for p in package if p]
        for node in ast.walk(tree):
            if id(node) in type_only or not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join([*base, *([node.module] if node.module else [])])
            # ``from . import sync`` names a module of the package, not the package's ``__init__``; ``from .. import
            # __version__`` names something the package's ``__init__`` holds, and so imports the package itself.
            own = [target] if node.module else []
            named = [f"{target}.{a.name}".lstrip(".") for a in node.names]
            inits = [] if node.module or all(c in graph for c in named) else [target]
            for candidate in (*own, *named, *inits):
                if candidate in graph and candidate != name:
                    graph[name].add(candidate)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_graph_sees_relative_imports() -> None:
    graph = import_graph()
    # An import of a name the package root defines (inside a function too) is an import of the root.
    probe = import_graph(extra={"training._probe": "def f():\n    from .. import __version__\n"})
    assert "" in probe["training._probe"]
    assert "_registry" in graph[""]  # the package itself and "adapters._base" in graph["adapters.ddp"]
    assert "references.placement" in graph["references.view"] and "integrations.trl" in graph["integrations.swift"]


def test_no_cycle() -> None:
    found = cycles(import_graph())
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


def test_no_cycle_through_type_imports() -> None:
    """Imports made for type checking only close no cycle either: a lower module annotates with a protocol it
    owns (``adapters/core/primitives.py``'s ``AdapterView``, ``_agree.Ranks``), not with the class above it."""
    found = cycles(import_graph(types=True))
    assert not found, f"import cycles through TYPE_CHECKING imports: {[sorted(c) for c in found]}"


def test_every_module_has_a_layer() -> None:
    for module in import_graph():
        layer_of(module)


def test_no_import_runs_up_the_layers() -> None:
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


# A storage kind's subpackage holds its backends' adapters and their parts; the machinery they share (core/, and
# stages/, which composes any kind's parts) is beside them. The adapter files at the top of adapters/ are backends of
# the whole-tensor kind (and the pipeline around another kind).
STORAGE_KINDS = ("adapters.flat", "adapters.dtensor", "adapters.zero", "adapters.slices")
SHARED_ADAPTER_MACHINERY = ("adapters.core", "adapters.stages")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_backend(module: str) -> bool:
    """A backend's own module: a storage kind's, or an adapter file at the top of adapters/."""
    if any(_within(module, k) for k in STORAGE_KINDS):
        return True
    parts = module.split(".")
    return len(parts) == 2 and parts[0] == "adapters"


def test_operations_import_no_backend_subpackage() -> None:
    operations = dict(LAYERS)["operations"] | dict(LAYERS)["public API"]
    found = [f"{module} imports {target}" for module, targets in sorted(import_graph().items())
             if module.split(".")[0] in operations for target in sorted(targets) if _is_backend(target)]
    assert not found, "operations reach into a backend (use the adapter's parts or primitives):\n" + "\n".join(found)


def test_a_storage_kind_imports_no_other_kind() -> None:
    found = []
    for module, targets in sorted(import_graph().items()):
        own = next((k for k in STORAGE_KINDS if _within(module, k)), None)
        shared = any(_within(module, s) for s in SHARED_ADAPTER_MACHINERY)
        if own is None and not shared:
            continue
        found += [f"{module} imports {target}" for target in sorted(targets)
                  if _is_backend(target) and not (own and _within(target, own))]
    assert not found, "a backend's subpackage (or the shared machinery) imports another backend:\n" + "\n".join(found)


def test_the_folders_stay_small() -> None:
    """No folder of the package holds more than 12 modules, and no module is over 400 lines."""
    crowded = {str(d.relative_to(PACKAGE)): n for d in [PACKAGE, *PACKAGE.rglob("*/")] if d.name != "__pycache__"
               if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 12}
    assert not crowded, f"folders over 12 modules (give them a subpackage): {crowded}"
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines (split them): {long}"


TESTS = Path(__file__).resolve().parents[1]


def test_the_test_folders_stay_small() -> None:
    """No folder under ``tests/`` holds more than 12 modules either, and each is a package (the workers import
    scenarios as ``tests.<folder>.<module>``)."""
    folders = [TESTS, *(d for d in TESTS.rglob("*/") if d.name != "__pycache__" and any(d.glob("*.py")))]
    crowded = {str(d.relative_to(TESTS)) or ".": n for d in folders
               if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 12}
    assert not crowded, f"test folders over 12 modules (give them a folder by concern): {crowded}"
    loose = [str(d.relative_to(TESTS)) for d in folders if not (d / "__init__.py").exists()]
    assert not loose, f"test folders without an __init__.py: {loose}"


# The operations, and the machinery they share, hold no backend knowledge: what differs per backend
# is an adapter's primitive (adapters/core/primitives.py), never a branch on which backend is below.
BACKEND_FREE = dict(LAYERS)["operations"] | {"_gather"}
BACKEND_LIBRARIES = ("deepspeed", "torch.distributed.fsdp", "torch.distributed.tensor")


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def backend_knowledge() -> list[str]:
    """Backend names as strings, imports of a backend's adapter file or library, in ``BACKEND_FREE`` and the formats."""
    from wrapkit.adapters import BUILTIN_ADAPTERS

    names = {a.name for a in BUILTIN_ADAPTERS}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module.split(".")[0] not in BACKEND_FREE | {"formats"}:
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs:
                found.append(f"{where}: the backend name {node.value!r}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[-1] in names and "adapters" in node.module:
                    found.append(f"{where}: imports the adapter file {node.module}")
                if node.module.startswith(BACKEND_LIBRARIES):
                    found.append(f"{where}: imports {node.module}")
            elif isinstance(node, ast.Import):
                found += [f"{where}: imports {a.name}" for a in node.names if a.name.startswith(BACKEND_LIBRARIES)]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "require"
                  and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "deepspeed"):
                found.append(f"{where}: requires deepspeed")
    return found


def test_operations_hold_no_backend_knowledge() -> None:
    found = backend_knowledge()
    assert not found, "backend knowledge outside adapters/ (give the adapters a primitive for it):\n" + "\n".join(found)


# Walks that name a model's tensors. Operations get names from the primitives instead (``named_live``,
# ``gather_each``, ``param_shapes``), which the PEFT view renames to the base model's.
NAME_WALKS = {"named_parameters", "named_buffers", "state_dict", "live_entries", "named_modules"}


def names_from_unwrap() -> list[str]:
    """Calls in the operation modules that walk ``something.unwrap()`` for names."""
    operations = dict(LAYERS)["operations"]

    def is_unwrap(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "unwrap")

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        # The PEFT view renames on purpose: it is what turns the runtime names into the base model's.
        if module.split(".")[0] not in operations or module == "references.view":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            walk = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if walk not in NAME_WALKS:
                continue
            on = [func.value] if isinstance(func, ast.Attribute) else []
            if any(is_unwrap(n) for n in on + list(node.args)):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_operations_take_names_from_primitives() -> None:
    found = names_from_unwrap()
    assert not found, "operations naming tensors by walking unwrap() (use the named_live primitive):\n" + "\n".join(
        found)


def _lists_caught_error(handler: ast.ExceptHandler) -> list[ast.AST]:
    """Where ``handler`` puts the text of the error it caught into a list (``x.append(str(exc))``,
    ``x += [f"{exc}"]``): such a list is reported with the reporting call's own hint appended."""
    name = handler.name

    def is_text(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str":
            return len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == name
        return (isinstance(node, ast.JoinedStr) and len(node.values) == 1
                and isinstance(node.values[0], ast.FormattedValue) and isinstance(node.values[0].value, ast.Name)
                and node.values[0].value.id == name)

    found: list[ast.AST] = []
    for node in ast.walk(handler):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append":
            found += [node] if node.args and is_text(node.args[0]) else []
        if isinstance(node, ast.AugAssign) and isinstance(node.value, ast.List):
            found += [node] if any(is_text(e) for e in node.value.elts) else []
    return found


def test_a_caught_error_keeps_its_own_hint() -> None:
    """A typed error caught and listed among a collective call's problems is listed as ``Listed(exc)``: it names
    its own cause and fix, and keeps its type; as plain text it would be raised as a StateDictError ending with the
    call's hint, which is about something else (a directory, a size)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.name:
                found += [f"{path.relative_to(PACKAGE)}:{getattr(n, 'lineno', '?')}: {ast.unparse(n)}"
                          for n in _lists_caught_error(node)]
    assert not found, "list Listed(exc), not its text:\n" + "\n".join(found)
