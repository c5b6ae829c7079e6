"""Every private field of another library that wrapkit touches is listed in ``adapters/core/internals.py``,
and outside ``adapters/`` no new one appears: the backends' private state belongs to their adapters.

Found statically: ``obj._name`` (read or written) on anything but ``self``/``cls``, for a name wrapkit
does not define itself, and ``getattr``/``hasattr``/``setattr(obj, "_name")`` on anything but ``self``/``cls``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import wrapkit
from wrapkit.adapters.core.internals import PRIVATE_FIELDS

PACKAGE = Path(wrapkit.__file__).resolve().parent

# Private reads outside adapters/ today, each to move into its backend's adapter; the list only shrinks.
OUTSIDE_ADAPTERS = {
    # torch.nn.Module's own dicts, torch's fused foreach and transformers' initialiser: where no public
    # API does the same, in one place that the operations call.
    ("base/module_internals.py", "_buffers"),
    ("base/module_internals.py", "_foreach_add_"),
    ("base/module_internals.py", "_foreach_mul_"),
    ("base/module_internals.py", "_forward_hooks"),
    ("base/module_internals.py", "_forward_pre_hooks"),
    ("base/module_internals.py", "_init_weights"),
    ("base/module_internals.py", "_modules"),
    ("base/module_internals.py", "_non_persistent_buffers_set"),
    ("base/module_internals.py", "_parameters"),
    ("base/module_internals.py", "_weight_conversions"),
    ("base/module_internals.py", "_state_dict_hooks"),
    ("base/module_internals.py", "_load_state_dict_pre_hooks"),
    ("base/module_internals.py", "_version"),
    ("base/module_internals.py", "_from_public_api"),
    ("base/torch_ops.py", "_C"),
    ("base/torch_ops.py", "_nn"),
    ("formats/dcp.py", "_make_wrapper_subclass"),
    ("integrations/swift.py", "_class_to_module"),
    # The models accelerate's prepare() wrapped: trainers hand their vLLM helpers a model from inside the wrapper.
    ("integrations/_trl_sync.py", "_models"),
    ("layers/compile.py", "_orig_mod"),
    ("shutdown.py", "_run_exitfuncs"),
    # Not an operation: the worker group destroys the groups a scenario made, and empties the caches
    # that would hand a later scenario their meshes.
    ("cli/_worker_cleanup.py", "_world"),
    # Not a backend's state: the group an engine in another process opens for weight updates, built with torch's
    # private constructor as the engines build theirs (there is no public one), in one place.
    ("base/process_groups.py", "_new_process_group_helper"),
    ("base/process_groups.py", "_world"),
    ("cli/_worker_cleanup.py", "_clear_sharding_prop_cache"),
    # Not a backend's state: vLLM's layerwise reload, ended by the gloo plugin inside the engine after a failed update
    # (no public way gives a layer its previous tensors back).
    ("integrations/engines/vllm_gloo.py", "_place_kernel_tensors"),
    ("integrations/engines/vllm_gloo.py", "_original_do_torchao_reload"),
    ("integrations/engines/vllm_gloo.py", "_do_torchao_reload"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _own_names(trees: list[ast.Module]) -> set[str]:
    """Names wrapkit defines: functions, classes, module and class attributes, ``self.x = ...``."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                own.add(node.attr)
            if isinstance(node, (ast.Module, ast.ClassDef)):
                for st in node.body:
                    targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(
                        st, ast.AnnAssign) else []
                    own.update(t.id for t in targets if isinstance(t, ast.Name))
    return own


def private_accesses(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """``(path relative to the package, private name)`` for every access to another object's private field."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
    own = _own_names(list(trees.values()))
    found: set[tuple[str, str]] = set()
    for path, tree in trees.items():
        rel = path.relative_to(package).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                if not _is_self(node.value):
                    found.add((rel, node.attr))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value) and not _is_self(node.args[0])):
                found.add((rel, node.args[1].value))
    return found


ACCESSES = private_accesses()


def test_the_scan_sees_private_reads() -> None:
    # Ones known to be there, by each form the scan looks for.
    assert ("adapters/zero/states.py", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition") in ACCESSES
    assert ("adapters/flat/fsdp.py", "_inter_node_pg") in ACCESSES  # getattr(root, "_inter_node_pg", None)
    assert ("adapters/zero/parts.py", "_param_versions") in ACCESSES  # a write


def test_every_private_field_read_is_listed() -> None:
    listed = {name for names in PRIVATE_FIELDS.values() for name in names}
    unlisted = sorted({f"{name} ({path})" for path, name in ACCESSES if name not in listed})
    assert not unlisted, ("private fields read but not listed in adapters/core/internals.py PRIVATE_FIELDS (say whose "
                          f"they are, and check them on adapt() where the object exists then): {unlisted}")


def test_no_new_private_read_outside_the_adapters() -> None:
    outside = {(path, name) for path, name in ACCESSES if not path.startswith("adapters/")}
    new = sorted(outside - OUTSIDE_ADAPTERS)
    assert not new, f"private fields read outside adapters/ (give the adapter a primitive for it instead): {new}"
    gone = sorted(OUTSIDE_ADAPTERS - outside)
    assert not gone, f"no longer read there: take these off OUTSIDE_ADAPTERS in this test: {gone}"


def test_operations_read_no_private_field() -> None:
    """The operation modules and the gathering machinery under them read no other library's private
    field: what a backend keeps privately is its adapter's, torch's module internals are behind
    ``base/module_internals.py``."""
    from tests.project.test_architecture import BACKEND_FREE

    # shutdown() runs Python's own atexit handlers before it ends the process without finalization.
    python_own = {("shutdown.py", "_run_exitfuncs")}
    found = sorted((path, name) for path, name in ACCESSES - python_own
                   if path.removesuffix(".py").split("/")[0] in BACKEND_FREE)
    assert not found, f"private fields read in operation modules: {found}"
