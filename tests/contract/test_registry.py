"""register_adapter, canonical_name, detection order and caching."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import wrapkit
from wrapkit import _registry
from wrapkit.cli._models import tiny_llama


class Boxed(torch.nn.Module):
    """A third-party wrapper that keeps its model under an unusual attribute."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.payload = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.payload(*args, **kwargs)


class BoxedAdapter(wrapkit.Adapter):
    name = "boxed"

    @classmethod
    def matches(cls, obj: object) -> bool:
        return isinstance(obj, Boxed)

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        assert isinstance(obj, Boxed)
        return obj.payload


@pytest.fixture
def clean_registry() -> Iterator[None]:
    saved = list(_registry._registered)
    yield
    _registry._registered[:] = saved
    _registry._cache.clear()


def test_register_third_party_adapter(clean_registry: None) -> None:
    model = tiny_llama()
    box = Boxed(model)
    assert wrapkit.adapt(box).backend == "plain"  # unknown, but not wrapper-shaped: a plain model
    wrapkit.register_adapter(BoxedAdapter)
    wm = wrapkit.adapt(box)
    assert wm.backend == "boxed" and wm.stack == ("boxed", "LlamaForCausalLM")
    assert wm.unwrap() is model and wm.config is model.config
    assert wm.num_parameters() == sum(p.numel() for p in model.parameters())
    assert "boxed" in [a.name for a in wrapkit.registered_adapters()]


def test_duplicate_names_refused(clean_registry: None) -> None:
    wrapkit.register_adapter(BoxedAdapter)

    class Again(BoxedAdapter):
        pass

    with pytest.raises(wrapkit.AdapterRegistrationError, match="already registered"):
        wrapkit.register_adapter(Again)

    class Shadow(wrapkit.Adapter):
        name = "ddp"

        @classmethod
        def matches(cls, obj: object) -> bool:
            return False

    with pytest.raises(wrapkit.AdapterRegistrationError, match="'ddp'"):
        wrapkit.register_adapter(Shadow)
    wrapkit.register_adapter(Again, override=True)
    assert [a for a in wrapkit.registered_adapters() if a.name == "boxed"] == [Again]


def test_malformed_adapters_refused(clean_registry: None) -> None:
    class NoMatches(wrapkit.Adapter):
        name = "nomatches"

    with pytest.raises(wrapkit.AdapterRegistrationError, match="matches"):
        wrapkit.register_adapter(NoMatches)
    with pytest.raises(wrapkit.AdapterRegistrationError, match="subclass"):
        wrapkit.register_adapter(object)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("module.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("_orig_mod.module.lm_head.weight", "lm_head.weight"),
        ("module._orig_mod.base_model.model.model.norm.weight", "base_model.model.model.norm.weight"),
        ("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight",
         "model.layers.0.mlp.up_proj.weight"),
        ("model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
        # A model's own submodule called `module` deeper down is kept.
        ("encoder.module.weight", "encoder.module.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_canonical_name(raw: str, canonical: str) -> None:
    assert wrapkit.canonical_name(raw) == canonical


def test_canonical_names_match_the_inner_model() -> None:
    model = tiny_llama()
    wrapped = torch.compile(torch.nn.DataParallel(model), backend="eager")
    names = [wrapkit.canonical_name(n) for n, _ in wrapped.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]


def test_detection_is_cached_per_type() -> None:
    model = torch.nn.DataParallel(tiny_llama())
    wrapkit.adapt(model)
    assert _registry._cache[torch.nn.DataParallel].name == "dp"  # type: ignore[union-attr]
    assert _registry._cache[type(model.module)] is None


def test_forward_is_a_direct_call() -> None:
    model = tiny_llama()
    wm = wrapkit.adapt(model)
    x = torch.arange(8).reshape(1, 8)
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        assert torch.equal(wm(x).logits, model(x).logits)
    finally:
        handle.remove()
    assert calls == [1, 1]


def _check_tp_refusal(message: str) -> None:
    assert message.startswith("UnsupportedModelError"), message
    # It names a parameter and its placements, and says what to do.
    assert "self_attn.q_proj.weight" in message and "Shard(" in message and "fully_shard" in message, message


def _check_lora_refusal(message: str) -> None:
    assert message.startswith("UnsupportedModelError") and "PEFT adapters on a tensor-parallel model" in message, \
        message


def test_tensor_parallel_model_adapted_as_tp(group: Any) -> None:
    for obs in group.run("tests.harness.scenarios:tensor_parallel_refused", timeout=120):
        assert obs["tp"] == "adapted as tp, is_sharded=True", obs["tp"]
        _check_lora_refusal(obs["tp+peft"])
        partial = obs["tp+partial"]
        assert partial.startswith("UnsupportedModelError") and "'model.norm.weight'" in partial, partial
        assert "Partial(" in partial and "placements other than Shard and Replicate" in partial, partial


def test_data_parallel_wrappers_over_a_tensor_parallel_mesh(group4: Any) -> None:
    for obs in group4.run("tests.harness.scenarios:tensor_parallel_refused", timeout=120):
        # Tensor parallel over mesh["tp"] alone: each dp slice holds a model of its own.
        assert obs["tp"] == "adapted as tp, is_sharded=True", obs["tp"]
        assert obs["fsdp2+tp"] == "adapted as fsdp2, is_sharded=True", obs["fsdp2+tp"]
        _check_tp_refusal(obs["ddp+tp"])
        _check_lora_refusal(obs["tp+peft"])
        _check_lora_refusal(obs["fsdp2+tp+peft"])


def test_a_sharded_adapter_must_give_its_parts() -> None:
    from wrapkit.adapters.core.primitives import SHARDED_PRIMITIVES

    with pytest.raises(wrapkit.AdapterRegistrationError) as info:
        class HalfDone(wrapkit.ShardedAdapter):  # its topology, but no parts: it would read shards as whole
            name = "halfdone"

            def topology(self) -> Any:
                return None

    message = str(info.value)
    assert "HalfDone" in message and "topology" not in message.split(":")[0]
    for primitive in set(SHARDED_PRIMITIVES) - {"topology"}:
        assert primitive in message, primitive

    class Intermediate(wrapkit.ShardedAdapter, abstract=True):  # a shared base may leave them to its subclasses
        pass

    with pytest.raises(wrapkit.AdapterRegistrationError, match="Leaf derives"):
        class Leaf(Intermediate):
            pass


def test_an_adapter_defining_a_primitive_that_moved_to_the_parts_is_refused() -> None:
    """A third-party adapter written against the members before parts: nothing would call its
    ``gather_many``, so it is refused when defined, naming where the member went."""
    with pytest.raises(wrapkit.AdapterRegistrationError, match=r"gather_many.*gatherer\.many"):
        class Old(wrapkit.Adapter):
            name = "old"

            def gather_many(self, params: Any) -> Any:
                return iter(())


def test_built_in_sharded_backends_define_the_sharded_primitives() -> None:
    from wrapkit.adapters import BUILTIN_ADAPTERS
    from wrapkit.adapters.core.kinds import defined_by as _defined_by
    from wrapkit.adapters.core.primitives import SHARDED_PRIMITIVES, BackendPrimitives

    sharded = {cls.name for cls in BUILTIN_ADAPTERS if issubclass(cls, wrapkit.ShardedAdapter)}
    assert sharded == {"fsdp", "fsdp2", "deepspeed", "megatron"}
    base = (wrapkit.Adapter, wrapkit.ShardedAdapter)
    for cls in BUILTIN_ADAPTERS:
        if issubclass(cls, wrapkit.ShardedAdapter):
            for n in SHARDED_PRIMITIVES:
                assert _defined_by(cls, n) not in base, (cls, n)
    # The parts are part of the documented interface.
    documented = set(BackendPrimitives.__annotations__) | {n for n in vars(BackendPrimitives) if not n.startswith("_")}
    assert {"weights", "gatherer", "placement", "topology"} <= documented


def test_backends_describe_their_groups_once() -> None:
    """``process_group()``, ``replica_groups()`` and ``mesh()`` are parts of ``topology()``: no backend
    defines them beside it, so the three can never disagree."""
    from wrapkit.adapters import BUILTIN_ADAPTERS
    from wrapkit.adapters.core.kinds import defined_by as _defined_by

    for cls in BUILTIN_ADAPTERS:
        for name in ("process_group", "replica_groups", "mesh"):
            assert _defined_by(cls, name) is wrapkit.Adapter, f"{cls.__name__} defines {name} beside topology()"


def test_a_backend_without_likeness_or_states_says_so() -> None:
    """A part a backend lacks is None, and each operation that needs it raises one typed error naming the
    backend and the fix, before anything is built or moved."""
    from wrapkit._registry import as_adapter
    from wrapkit.adapters import Parts
    from wrapkit.adapters.core.whole import whole_parts
    from wrapkit.references.build import build_reference
    from wrapkit.references.wrapping import bare_module, wrap_like
    from wrapkit.sync.sleeping import sleep

    class Bare(wrapkit.ShardedAdapter, abstract=True):  # every other primitive is beside the point here
        name = "bare"

        def parts(self) -> Parts:
            return whole_parts(self).replace(likeness=None, states=None)

    module = torch.nn.Linear(2, 2)
    policy = Bare(module, [("bare", module)], None, module)
    assert policy.likeness is None and policy.states is None
    with pytest.raises(wrapkit.UnsupportedModelError, match="bare backend cannot build a frozen copy"):
        build_reference(policy)
    with pytest.raises(wrapkit.UnsupportedModelError, match="bare backend cannot wrap a reference"):
        wrap_like(policy, as_adapter(torch.nn.Linear(2, 2)), None)  # a plain reference, to be wrapped the policy's way
    # A model wrapped that way is no start for a reference wrapped another way.
    with pytest.raises(wrapkit.ReferenceModelError, match="wrapped in bare but the policy uses ddp"):
        bare_module(policy, "ddp")
    before = [t.clone() for t in module.parameters()]
    with pytest.raises(wrapkit.UnsupportedModelError, match="bare backend cannot move this model's training state"):
        sleep(policy, torch.optim.SGD(module.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_an_adapter_defining_a_member_that_moved_into_parts_is_refused() -> None:
    """Nothing calls the members that became parts: a third-party adapter still defining one would be
    ignored without a word, so its class statement fails, naming the part member that replaced it."""
    with pytest.raises(wrapkit.AdapterRegistrationError, match=r"fresh_copy.*likeness\.copy"):
        class Old(wrapkit.Adapter):  # noqa: F841
            def fresh_copy(self, ds_config: Any) -> torch.nn.Module:
                return torch.nn.Linear(2, 2)
    with pytest.raises(wrapkit.AdapterRegistrationError, match=r"sleep_refusal.*states"):
        class Older(wrapkit.Adapter):  # noqa: F841
            def sleep_refusal(self) -> str | None:
                return None


def test_topology_of_every_four_rank_layout(group4: Any) -> None:
    """One ``topology()`` per backend describes the group, the replicas and the mesh; the readings
    of its parts agree with it, and ``world_size`` is the group's."""
    for obs in group4.run("tests.harness.scenarios:topologies", timeout=180):
        cp = obs.pop("fsdp2/cp")
        # Sharded over all four ranks, two of which split each batch's sequence: two batches.
        assert cp["world_size"] == 4 and cp["data_parallel"][1] == 2 and cp["exact"], cp
        for layout, t in obs.items():
            assert t["parts_agree"], layout
            assert t["world_size"] == t["group"], layout
        want = {"fsdp/hsdp": (2, [2]), "fsdp/hybrid-groups": (2, [2]), "fsdp2/hsdp": (2, [2]),
                "fsdp2/submesh": (2, []), "ddp/subgroup": (2, []), "zero3/flat": (4, []), "fsdp/flat": (4, []),
                "fsdp2/flat": (4, []),
                # One copy over shard x tp: every rank; on the 3-D stand-in, shard (1) x tp (2), two copies.
                "fsdp2/tp": (4, []), "fsdp2/hsdp-tp": (2, [2])}
        assert {k: (t["group"], t["replicas"]) for k, t in obs.items()} == want
        assert obs["fsdp2/hsdp"]["mesh"] == (2, 2) and obs["fsdp2/submesh"]["mesh"] == (2,)
        assert obs["fsdp/hsdp"]["mesh"] == (2, 2)  # the mesh FSDP1 was given
        assert obs["ddp/subgroup"]["mesh"] is None and obs["zero3/flat"]["mesh"] is None
        assert obs["fsdp2/hsdp"]["roles"] == obs["fsdp/hsdp"]["roles"] == ("replicate", "shard")
        assert obs["fsdp2/submesh"]["roles"] == ("shard",)
        assert obs["fsdp2/tp"]["roles"] == ("shard", "tp") and obs["fsdp2/tp"]["mesh"] == (2, 2)
        assert obs["fsdp2/hsdp-tp"]["roles"] == ("replicate", "shard", "tp")
        assert obs["fsdp2/hsdp-tp"]["mesh"] == (2, 1, 2)
        assert all(t["roles_typed"] for t in obs.values())  # each role a Role, equal to its name
        # Every rank of a data-parallel layout takes its own batch: 4 of them, or 2 per model of a sub-group.
        ranks = {k: t["data_parallel"] for k, t in obs.items()}
        for layout in ("fsdp/hsdp", "fsdp/hybrid-groups", "fsdp2/hsdp", "zero3/flat", "fsdp/flat"):
            assert ranks[layout][1] == 4, (layout, ranks[layout])
        assert ranks["fsdp2/submesh"][1] == ranks["ddp/subgroup"][1] == 2
        # The two ranks along tp share a batch: two batches over the four ranks.
        assert ranks["fsdp2/tp"][1] == ranks["fsdp2/hsdp-tp"][1] == 2
        assert "mesh:         replicate=2 replicate, shard=2 shard" in obs["fsdp2/hsdp"]["describe"], \
            obs["fsdp2/hsdp"]["describe"]
        # A mesh dimension without a name is called by its position.
        assert "mesh:         dim0=4 shard" in obs["fsdp2/flat"]["describe"], obs["fsdp2/flat"]["describe"]
    # Four distinct batches over the four ranks of a 2x2 layout.
    results = group4.run("tests.harness.scenarios:topologies", timeout=180)
    assert sorted(r["fsdp2/hsdp"]["data_parallel"][0] for r in results) == [0, 1, 2, 3]
    assert sorted(r["fsdp/hsdp"]["data_parallel"][0] for r in results) == [0, 1, 2, 3]
    for layout in ("fsdp2/tp", "fsdp2/hsdp-tp", "fsdp2/cp"):
        assert [r[layout]["data_parallel"][0] for r in results] == [0, 0, 1, 1], layout


# What a backend's adapter may define itself: what its wrapper is (detection, identity, the layouts it
# refuses, the form a frozen copy keeps), its topology, its parts and its recipe. Private helpers serve these.
_WRAPPER = {"name", "peels", "distributed", "matches", "inner", "claims", "device", "is_sharded", "zero_stage",
            "unsupported_dtensor", "frozen_form", "reads_marks",
            # How its model's names read where the module's own paths are not the whole model's (Megatron numbers
            # each stage's layers from 0), and the Hub layout of a model that is not transformers'.
            "named_live", "hub_layout",
            # The names behind each tensor an optimizer holds, where one stands for several (FSDP1's flat ones).
            "parameter_names"}
_COMPOSED = {"topology", "parts", "recipe"}


def test_backend_adapters_define_only_their_wrapper_topology_parts_and_recipe() -> None:
    from wrapkit.adapters import BUILTIN_ADAPTERS, CONTENT_ADAPTERS, PlainAdapter
    from wrapkit.adapters.core.kinds import ReplicatedAdapter

    allowed = _WRAPPER | _COMPOSED
    for cls in (*BUILTIN_ADAPTERS, *CONTENT_ADAPTERS, PlainAdapter, ReplicatedAdapter, wrapkit.ShardedAdapter):
        public = {n for n in vars(cls) if not n.startswith("_")}
        assert public <= allowed, (f"{cls.__name__} defines {sorted(public - allowed)}: a backend says how it "
                                   "stores, gathers and moves weights through its parts (adapters/core/parts.py)")
    # Every built-in backend has a recipe, and a sharded one gives parts of its own.
    for cls in (*BUILTIN_ADAPTERS, *CONTENT_ADAPTERS, PlainAdapter):
        assert cls.recipe is not None, cls
        if issubclass(cls, wrapkit.ShardedAdapter):
            assert "parts" in vars(cls), cls
