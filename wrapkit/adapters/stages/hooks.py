"""The model's own state-dict hooks (``formats.hooks``) across pipeline stages.

A stage holds the hooked modules of its own layers only, and a hook runs where its module is. What each
stage's hooks make of its groups (their state-dict names and shapes) is recorded when the model is adapted
(``StagePlan.hook_groups``). An export walks every group on every stage alike: the stage holding a group runs
its hooks on the group's full tensors and broadcasts what they made. Imports exchange nothing: each stage
builds its own layers from the checkpoint through its own hooks, and another stage's groups are only checked
against what that stage recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from ..._errors import UnsupportedModelError
from ...formats.hooks import HookLayout, by_group, group_of
from ...formats.mapped import WholeBuild

__all__ = ["HookGroup", "StageHooks", "own_hook_groups"]

Shape = tuple[int, ...]
Entries = Mapping[str, tuple[Shape, str]]
Groups = dict[str, tuple[list[str], list[tuple[str, Shape]]]]


class HookGroup(NamedTuple):
    """One hooked module of the whole model: the stage holding it, its tensors' runtime names, and the
    state-dict names and shapes its hooks make of them."""

    stage: int
    members: list[str]
    state: list[tuple[str, Shape]]


def own_hook_groups(root: torch.nn.Module, shapes: Mapping[str, Shape]) -> Groups:
    """This stage's hooked groups (``shapes``: the full shape of each of its tensors, by runtime name): prefix ->
    (runtime names, state-dict names and shapes), the hooks run on the meta device."""
    layout = HookLayout.of(root)
    if layout is None:
        return {}
    out: Groups = {}
    for prefix in layout.saving:
        members = [n for n, group in layout.member.items() if group == prefix]
        out[prefix] = (members, list(layout.group_state(prefix, shapes).items()))
    return out


class PlanView(Protocol):
    """What the hooks need of the stage plan (``plan.StagePlan``, which is built on this module)."""

    hook_groups: dict[str, HookGroup]
    shapes: dict[str, Shape]
    buffer_shapes: dict[str, Shape]

    @property
    def stage(self) -> Any: ...

    def global_rank(self, s: int) -> int: ...

    def broadcast(self, owner: int, value: torch.Tensor | None, shape: Shape, dtype: str,
                  device: torch.device) -> torch.Tensor: ...


class StageHooks:
    """``HookLayout``'s conversions for a pipeline stage: ``local`` (this stage's own hooks, or None) for its
    own groups, the plan's record for the other stages'."""

    def __init__(self, plan: PlanView, local: HookLayout | None, device: torch.device) -> None:
        self.plan, self.local, self.device = plan, local, device
        self.groups: dict[str, HookGroup] = plan.hook_groups
        self.member = {n: prefix for prefix, g in self.groups.items() for n in g.members}
        self.me = plan.stage.number

    def _elsewhere(self) -> Iterator[tuple[str, HookGroup]]:
        return ((p, g) for p, g in self.groups.items() if g.stage != self.me)

    # -- runtime -> state dict ----------------------------------------------------------------
    def export(self, entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``HookLayout.export``, on every stage alike (``entries``: the whole model's, in the plan's order):
        a group completes by the plan's record of it, so every stage completes it at the same entry."""
        return by_group(entries, lambda name: group_of(name, self.member, self.groups),
                        lambda prefix, group: set(group) == set(self.groups[prefix].members), self._made)

    def _made(self, prefix: str, values: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """What the hooks of group ``prefix`` make of its full ``values``: run by the stage holding it, its
        names, shapes and dtypes then its tensors broadcast over the pipeline group (a refusal too, so that
        no stage waits for tensors that never come)."""
        owner = self.groups[prefix].stage
        made: dict[str, torch.Tensor] = {}
        spec: Any = None
        if owner == self.me:
            try:
                if self.local is None or prefix not in self.local.saving:
                    raise UnsupportedModelError(f"this stage holds no hooked module at {prefix!r} any more; adapt() "
                                                "the model again after changing its layers")
                made = self.local.saved(prefix, values)
                spec = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in made.items()]
            except Exception as exc:  # the hook's own refusal, raised on every stage alike
                spec = f"the state-dict hooks of {prefix!r} failed: {exc}"
        box = [spec]
        dist.broadcast_object_list(box, src=self.plan.global_rank(owner), group=self.plan.stage.group)
        if isinstance(box[0], str):
            raise UnsupportedModelError(box[0])
        for name, shape, dtype in box[0]:
            yield name, self.plan.broadcast(owner, made.get(name), shape, dtype, self.device)

    # -- state dict -> runtime ----------------------------------------------------------------
    def _made_names(self, g: HookGroup) -> list[str]:
        return [n for n, _ in g.state if n not in g.members]

    def _shape(self, name: str) -> Shape:
        return self.plan.shapes.get(name) or self.plan.buffer_shapes.get(name, ())

    def state_names(self, shapes: Mapping[str, Shape]) -> dict[str, Shape]:
        names = dict(self.local.state_names(shapes)) if self.local is not None else dict(shapes)
        for _, g in self._elsewhere():
            if any(m in names for m in g.members):
                for m in g.members:
                    names.pop(m, None)
                names.update(g.state)
        return names

    def to_runtime(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole state dict under the runtime names: this stage's groups through its hooks; another stage's,
        found whole under their recorded names, stand in as meta tensors of the runtime shapes (a stage
        writes only its own layers)."""
        out = self.local.to_runtime(state) if self.local is not None else dict(state)
        for _, g in self._elsewhere():
            made = self._made_names(g)
            if made and all(n in out for n in made):
                dtype = out[made[0]].dtype
                for n in made:
                    del out[n]
                for m in g.members:
                    out.setdefault(m, torch.empty(self._shape(m), dtype=dtype, device="meta"))
        return out

    def imports(self, entries: Entries, runtime: Iterable[str]) -> tuple[dict[str, str], dict[str, Any]]:
        """As ``HookLayout.imports``: another stage's group, found whole under its recorded names and shapes,
        is built there (here it stands as a build that is never read)."""
        if self.local is not None:
            renamed, converted = self.local.imports(entries, runtime)
        else:
            renamed, converted = {k: k for k in entries}, {}
        wanted = set(runtime)
        for _, g in self._elsewhere():
            made = self._made_names(g)
            shapes = dict(g.state)
            if not made or not all(n in entries and tuple(entries[n][0]) == shapes[n] for n in made):
                continue  # left for the check to report
            for n in made:
                renamed.pop(n, None)
            for m in g.members:
                if m in wanted and m not in shapes:
                    converted[m] = _Elsewhere(made, self._shape(m))
        return renamed, converted

    def optional(self) -> frozenset[str]:
        return frozenset()


class _Elsewhere(WholeBuild):
    """A tensor another stage's hooks build from ``keys``: that stage reads it, this one never does."""

    def full(self, read: Any) -> torch.Tensor:
        raise UnsupportedModelError(f"{self._keys[0]} belongs to a layer another pipeline stage holds")
