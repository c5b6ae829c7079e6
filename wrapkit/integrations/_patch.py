"""Swapping a library's helpers for wrapkit's drop-ins by identity, and back: what ``patch_trl`` and
``patch_swift`` share. A binding is replaced only where it holds the very function replaced, so
nothing else a module defines is touched, and undoing restores every binding that holds a drop-in,
also in modules imported since."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType, TracebackType
from typing import Any

__all__ = ["Patch", "MethodPatch", "swap", "swap_methods", "loaded", "globals_of"]

# A module's bindings to look at: ``(name, value)``.
Bindings = Callable[[ModuleType], list[tuple[str, Any]]]


def loaded(package: str) -> list[ModuleType]:
    """``package`` and its submodules imported so far."""
    return [m for key, m in list(sys.modules.items())
            if (key == package or key.startswith(package + ".")) and isinstance(m, ModuleType)]


def globals_of(module: ModuleType) -> list[tuple[str, Any]]:
    return list(vars(module).items())


class Patch:
    """What a ``patch_*`` replaced: ``swaps`` (module, name, original); ``undo()`` (or leaving the
    ``with`` block) puts the originals back, then undoes ``then``, the patch this one was built on."""

    def __init__(self, package: str, pairs: dict[int, tuple[Any, Any]], swaps: list[tuple[ModuleType, str, Any]],
                 bindings: Bindings = globals_of, then: Patch | None = None) -> None:
        self.package = package
        self.pairs = pairs  # id(original) -> (original, drop-in)
        self.swaps = swaps
        self._bindings = bindings
        self._then = then

    @property
    def methods(self) -> list[tuple[type, str, Any]]:
        """Methods replaced on classes (class, name, original), by this patch or the one it was built on."""
        return [] if self._then is None else self._then.methods

    def undo(self) -> None:
        back = {id(ours): original for original, ours in self.pairs.values()}
        for module in loaded(self.package):
            for name, value in self._bindings(module):
                if id(value) in back:
                    setattr(module, name, back[id(value)])
        if self._then is not None:
            self._then.undo()
        self.pairs, self.swaps = {}, []

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.undo()


def swap(package: str, pairs: dict[int, tuple[Any, Any]], bindings: Bindings = globals_of,
         then: Patch | None = None) -> Patch:
    """Replace, in ``package`` and every loaded submodule, each binding to an original of ``pairs``
    (``id(original) -> (original, drop-in)``) by its drop-in."""
    swaps: list[tuple[ModuleType, str, Any]] = []
    for module in loaded(package):
        for name, value in bindings(module):
            pair = pairs.get(id(value))
            if pair is not None and pair[0] is value:
                swaps.append((module, name, value))
                setattr(module, name, pair[1])
    return Patch(package, pairs, swaps, bindings, then)


class MethodPatch(Patch):
    """Methods replaced on a library's classes: ``swaps`` (class, name, original); ``undo()`` puts them back."""

    def __init__(self, swaps: list[tuple[type, str, Any]], then: Patch | None = None) -> None:
        super().__init__("", {}, [], then=then)
        self._methods = swaps

    @property
    def methods(self) -> list[tuple[type, str, Any]]:
        return self._methods + super().methods

    def undo(self) -> None:
        for owner, name, original in reversed(self._methods):  # the patch built on undoes its own below
            setattr(owner, name, original)
        self._methods = []
        super().undo()


def swap_methods(targets: list[tuple[type, str, Any]], then: Patch | None = None) -> MethodPatch:
    """Set each ``(class, name, drop-in)`` of ``targets``, unless the class already holds that drop-in."""
    swaps: list[tuple[type, str, Any]] = []
    for owner, name, ours in targets:
        original = owner.__dict__.get(name)
        if original is not None and original is not ours:
            swaps.append((owner, name, original))
            setattr(owner, name, ours)
    return MethodPatch(swaps, then)
