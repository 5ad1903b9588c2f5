"""polyamp_torch.autocast and apply_policy: which dtype each op and module runs in."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import threading
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import polyamp  # noqa: E402
import polyamp_torch  # noqa: E402
from polyamp import InvalidPolicyError, PolyampTypeError, PolyampValueError  # noqa: E402

COMPUTE = {"mixed_float16": torch.float16, "mixed_bfloat16": torch.bfloat16, "float16": torch.float16}


def op_dtypes() -> dict[str, torch.dtype]:
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    image = torch.randn(2, 3, 8, 8)
    kernel = torch.randn(4, 3, 3, 3)
    target = torch.randint(0, 8, (4,))
    return {
        "matmul": (x @ w).dtype,
        "linear": F.linear(x, w).dtype,
        "conv2d": F.conv2d(image, kernel).dtype,
        "softmax": torch.softmax(x @ w, dim=-1).dtype,
        "log_softmax": torch.log_softmax(x @ w, dim=-1).dtype,
        "cross_entropy": F.cross_entropy(x @ w, target).dtype,
        "mse_loss": F.mse_loss(x @ w, x @ w).dtype,
    }


LOW = ("matmul", "linear", "conv2d")
FULL = ("softmax", "log_softmax", "cross_entropy", "mse_loss")


@pytest.mark.parametrize("policy", list(COMPUTE))
def test_ops_run_in_the_compute_dtype_and_sensitive_ops_in_float32(policy: str) -> None:
    with polyamp_torch.autocast(policy, device_type="cpu"):
        dtypes = op_dtypes()
    for op in LOW:
        assert dtypes[op] == COMPUTE[policy], f"{op}: {dtypes[op]} but should be {COMPUTE[policy]} [{policy}]"
    for op in FULL:
        assert dtypes[op] == torch.float32, f"{op}: {dtypes[op]} but should be float32 [{policy}]"


def test_cpu_regions_follow_torch_where_it_agrees_with_cuda_and_cuda_where_it_does_not() -> None:
    for policy, dtype in COMPUTE.items():
        with torch.autocast("cpu", dtype=dtype):
            native = op_dtypes()
        with polyamp_torch.autocast(policy, device_type="cpu"):
            ours = op_dtypes()
        for op in (*LOW, "cross_entropy", "mse_loss"):  # torch's CPU lists already match CUDA's here
            assert ours[op] == native[op]
        # CPU autocast leaves these in the low dtype; CUDA autocast (and polyamp everywhere) uses float32.
        assert native["softmax"] == native["log_softmax"] == dtype
        assert ours["softmax"] == ours["log_softmax"] == torch.float32


@pytest.mark.parametrize(
    ("op", "call"),
    [
        ("layer_norm", lambda h: torch.nn.functional.layer_norm(h, (8,))),
        ("group_norm", lambda h: torch.nn.functional.group_norm(h.view(4, 8, 1), 2)),
        ("sum", lambda h: h.sum()),
        ("torch.sum", lambda h: torch.sum(h, dim=0)),
        ("cumsum", lambda h: h.cumsum(0)),
        ("logsumexp", lambda h: torch.logsumexp(h, 0)),
        ("exp", lambda h: h.exp()),
        ("pow", lambda h: h**2),
        ("vector_norm", lambda h: torch.linalg.vector_norm(h)),
        ("nn.LayerNorm", lambda h: torch.nn.LayerNorm(8)(h)),
        ("nn.Softmax", lambda h: torch.nn.Softmax(-1)(h)),
    ],
)
def test_cuda_float32_ops_run_in_float32_on_cpu(op: str, call: Any) -> None:
    with polyamp_torch.autocast("mixed_float16", device_type="cpu"):
        hidden = torch.randn(4, 8) @ torch.randn(8, 8)
        assert hidden.dtype == torch.float16
        assert call(hidden).dtype == torch.float32, op
        assert (hidden + 1).dtype == torch.float16  # other ops keep their autocast behaviour


def test_cpu_float32_ops_can_be_turned_off() -> None:
    with polyamp_torch.autocast("mixed_float16", device_type="cpu", cpu_float32_ops=False):
        assert op_dtypes()["softmax"] == torch.float16
    with pytest.raises(PolyampTypeError, match="cpu_float32_ops"):
        polyamp_torch.autocast(cpu_float32_ops=None)  # type: ignore[arg-type]


def test_float32_op_mode_stays_inside_polyamp_regions() -> None:
    low = torch.randn(4, 8).half()
    with polyamp_torch.autocast("mixed_float16", device_type="cpu"):
        assert low.softmax(-1, dtype=torch.float16).dtype == torch.float16  # an explicit dtype is kept
        with polyamp_torch.autocast(enabled=False, device_type="cpu"):
            assert low.sum().dtype == torch.float16  # float32 region: nothing is cast
        with torch.autocast("cpu", enabled=False):
            assert low.sum().dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.float16):  # native regions are untouched
        assert low.sum().dtype == torch.float16
    assert low.sum().dtype == torch.float16


def test_float32_policy_means_autocast_off() -> None:
    with polyamp_torch.autocast("float32", device_type="cpu"):
        assert set(op_dtypes().values()) == {torch.float32}
        assert not torch.is_autocast_enabled("cpu")


def test_the_global_policy_is_read_at_entry() -> None:
    region = polyamp_torch.autocast(device_type="cpu")
    polyamp.set_policy("mixed_bfloat16")
    with region:
        assert op_dtypes()["linear"] == torch.bfloat16
    polyamp.set_policy("mixed_float16")
    with region:
        assert op_dtypes()["linear"] == torch.float16
    polyamp.set_policy("float32")
    with region:
        assert op_dtypes()["linear"] == torch.float32


def test_nested_disabled_region_is_float32_and_outer_resumes() -> None:
    with polyamp_torch.autocast("mixed_float16", device_type="cpu"):
        with polyamp_torch.autocast(enabled=False, device_type="cpu"):
            assert op_dtypes()["linear"] == torch.float32
        assert op_dtypes()["linear"] == torch.float16
        with polyamp_torch.autocast("float32", device_type="cpu"):
            assert op_dtypes()["linear"] == torch.float32
    assert not torch.is_autocast_enabled("cpu")


def test_works_as_a_decorator_reentrantly_and_across_threads() -> None:
    @polyamp_torch.autocast("mixed_bfloat16", device_type="cpu")
    def linear_dtype(depth: int = 0) -> torch.dtype:
        if depth:
            return linear_dtype(depth - 1)
        return op_dtypes()["linear"]

    assert linear_dtype(3) == torch.bfloat16
    results: list[torch.dtype] = []
    threads = [threading.Thread(target=lambda: results.append(linear_dtype(1))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [torch.bfloat16] * 4
    assert not torch.is_autocast_enabled("cpu")


def test_exceptions_leave_autocast_off() -> None:
    with pytest.raises(ZeroDivisionError), polyamp_torch.autocast("mixed_float16", device_type="cpu"):
        1 / 0  # noqa: B018
    assert not torch.is_autocast_enabled("cpu")


def test_default_device_and_torch_device_argument() -> None:
    region = polyamp_torch.autocast(device_type=torch.device("cpu"))
    assert (region.device_type, region.device_types) == ("cpu", ("cpu",))
    default = polyamp_torch.autocast()
    if torch.cuda.is_available():
        assert (default.device_type, default.device_types) == ("cuda", ("cuda", "cpu"))
    else:
        assert default.device_type == default.device_types[0]
        assert default.device_types[-1] == "cpu"


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_region_given_no_device_type_also_autocasts_the_cpu_on_a_gpu_machine(monkeypatch: Any) -> None:
    """On a machine with an accelerator, autocast() covers it and the CPU: a model left on the CPU computes
    under the policy, eagerly and compiled, instead of silently in float32. (Simulated: the accelerator is
    named "cuda" whether or not torch can use it; torch disables a CUDA region it cannot run.)"""
    monkeypatch.setattr(polyamp_torch._autocast, "_default_device_types", [("cuda", "cpu")])
    torch.manual_seed(0)
    linear, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    x = torch.randn(2, 4)

    def forward(x: Any) -> tuple[Any, Any]:
        with polyamp_torch.autocast("mixed_bfloat16"):
            hidden = linear(x)
            return hidden, norm(hidden)

    region = polyamp_torch.autocast()
    assert (region.device_type, region.device_types) == ("cuda", ("cuda", "cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = linear(x)
    eager = forward(x)
    assert [t.dtype for t in eager] == [torch.bfloat16, torch.float32]  # CUDA's float32 list on the CPU too
    assert torch.equal(eager[0], native)
    assert not torch.is_autocast_enabled("cpu")
    assert torch._dynamo.explain(forward)(x).graph_break_count == 0
    compiled = torch.compile(forward, backend="eager")(x)
    assert [t.dtype for t in compiled] == [torch.bfloat16, torch.float32]
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"policy": "mixed_float61"}, InvalidPolicyError, "Did you mean 'mixed_float16'"),
        ({"policy": 16}, PolyampTypeError, "`spec` must be"),
        ({"enabled": "yes"}, PolyampTypeError, "`enabled` must be a bool"),
        ({"device_type": 3}, PolyampTypeError, "`device_type` must be"),
        ({"device_type": "tpu9"}, PolyampValueError, "does not support device_type='tpu9'"),
        ({"cache_enabled": 1}, PolyampTypeError, "`cache_enabled` must be None or a bool"),
    ],
)
def test_autocast_argument_errors(kwargs: dict[str, Any], error: type, fragment: str) -> None:
    with pytest.raises(error) as info:
        polyamp_torch.autocast(**kwargs)
    assert fragment in str(info.value)


def test_arguments_seen_before_are_still_checked_in_full() -> None:
    """Regions made per step take the policy names and device types seen before without parsing them again;
    every other spelling still goes through the checks, on the first call and on later ones."""
    polyamp_torch.autocast("mixed_float16", device_type="cpu")
    for _ in range(2):
        with pytest.raises(PolyampTypeError, match="takes a policy or a dtype, not both"):
            polyamp_torch.autocast("mixed_float16", dtype=torch.float16)
        with pytest.raises(PolyampValueError, match="does not support device_type='tpu9'"):
            polyamp_torch.autocast("mixed_float16", device_type="tpu9")
    region = polyamp_torch.autocast("mixed_float16", device_type="cpu:0")
    assert (region.device_type, region.policy.name) == ("cpu", "mixed_float16")
    assert polyamp_torch.autocast(dtype=torch.bfloat16).policy.compute_dtype == "bfloat16"


# -- apply_policy -----------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.proj(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(4, 8)
        self.block = Block()
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        hidden = self.block(self.embed(x))
        return {"logits": self.head(hidden), "hidden": (hidden,), "steps": torch.tensor(3)}


def record_output_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    for name, sub in model.named_modules():
        if name and isinstance(sub, torch.nn.Linear):
            sub.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    return seen


def test_outputs_are_cast_to_the_output_dtype() -> None:
    model = polyamp_torch.apply_policy(Net(), "mixed_float16")
    seen = record_output_dtypes(model)
    out = model(torch.randn(2, 4))
    assert out["logits"].dtype == torch.float32 and out["hidden"][0].dtype == torch.float32
    assert out["steps"].dtype == torch.int64  # only floating tensors are cast
    assert seen == {"embed": torch.float16, "block.proj": torch.float16, "head": torch.float16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    "keep", [["head"], ["he*"], "head", "policy-instance"], ids=["name", "pattern", "single", "instance"]
)
def test_keep_float32_runs_a_submodule_in_float32(keep: Any) -> None:
    model = Net()
    if keep == "policy-instance":
        keep = [model.head]
    polyamp_torch.apply_policy(model, "mixed_bfloat16", keep_float32=keep)
    seen = record_output_dtypes(model)
    model(torch.randn(2, 4))
    assert seen == {"embed": torch.bfloat16, "block.proj": torch.bfloat16, "head": torch.float32}
    assert polyamp_torch.module_policy(model.head) == polyamp.Policy("float32")
    assert polyamp_torch.module_policy(model.embed) is None


def test_pure_low_precision_policy_casts_parameters_except_float32_islands() -> None:
    model = polyamp_torch.apply_policy(Net(), "bfloat16", keep_float32=["*norm"])
    assert model.embed.weight.dtype == torch.bfloat16 and model.head.bias.dtype == torch.bfloat16
    assert model.block.norm.weight.dtype == torch.float32
    out = model(torch.randn(2, 4, dtype=torch.bfloat16))
    assert out["logits"].dtype == torch.bfloat16


def test_global_overrides_apply_and_children_inherit() -> None:
    polyamp.set_policy("mixed_float16", overrides={"block": "float32"})
    model = polyamp_torch.apply_policy(Net())
    seen = record_output_dtypes(model)
    model(torch.randn(2, 4))
    assert seen == {"embed": torch.float16, "block.proj": torch.float32, "head": torch.float16}


def test_keep_float32_outputs_match_a_float32_module() -> None:
    model = Net()
    reference = copy.deepcopy(model.head)
    polyamp_torch.apply_policy(model, "mixed_float16", keep_float32=["head"])
    hidden = torch.randn(2, 8, dtype=torch.float16)
    with polyamp_torch.autocast("mixed_float16", device_type="cpu"):
        kept = model.head(hidden)
    assert kept.dtype == torch.float32
    assert torch.equal(kept, reference(hidden.float()))


def test_state_dict_pickling_and_deepcopy_are_unaffected() -> None:
    plain = Net()
    model = polyamp_torch.apply_policy(Net(), "mixed_float16", keep_float32=["head"])
    assert list(model.state_dict()) == list(plain.state_dict())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    clone = copy.deepcopy(model)
    x = torch.randn(2, 4)
    for other in (loaded, clone):
        assert torch.equal(other(x)["logits"], model(x)["logits"])
        assert polyamp_torch.module_policy(other.head) == polyamp.Policy("float32")
        assert other.head.forward.module is other.head  # the copy's wrapper drives the copy


class Keywords(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, scale: float = 1.0
    ) -> torch.Tensor:
        return self.proj(input_ids) * scale


def test_the_wrapped_forward_keeps_the_modules_signature() -> None:
    plain = Keywords()
    expected = inspect.signature(plain.forward)
    assert list(expected.parameters) == ["input_ids", "attention_mask", "scale"]
    model = polyamp_torch.apply_policy(Keywords(), "mixed_float16", keep_float32=["proj"])
    assert "forward" in model.__dict__
    assert inspect.signature(model.forward) == expected
    assert inspect.signature(model.proj.forward) == inspect.signature(torch.nn.Linear(4, 4).forward)
    unwrapped = inspect.unwrap(model.forward)
    assert unwrapped.__func__ is Keywords.forward and unwrapped.__self__ is model
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert inspect.signature(other.forward) == expected
        assert inspect.unwrap(other.forward).__self__ is other


def test_a_forward_installed_before_keeps_its_signature() -> None:
    model = Keywords()

    def patched(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return Keywords.forward(model, input_ids) + labels

    model.forward = patched
    polyamp_torch.apply_policy(model, "mixed_bfloat16")
    assert inspect.signature(model.forward) == inspect.signature(patched)
    assert inspect.unwrap(model.forward) is patched
    polyamp_torch.remove_policy(model)
    assert model.forward is patched


def test_apply_again_replaces_and_remove_restores() -> None:
    model = polyamp_torch.apply_policy(Net(), "mixed_float16", keep_float32=["head"])
    polyamp_torch.apply_policy(model, "mixed_bfloat16")
    assert polyamp_torch.module_policy(model) == polyamp.Policy("mixed_bfloat16")
    assert polyamp_torch.module_policy(model.head) is None
    polyamp_torch.remove_policy(model)
    assert "forward" not in model.__dict__
    assert model(torch.randn(2, 4))["logits"].dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"keep_float32": ["heda"]}, PolyampValueError, "matches no submodule"),
        ({"keep_float32": [torch.nn.Linear(2, 2)]}, PolyampValueError, "not a submodule"),
        ({"keep_float32": [3]}, PolyampTypeError, "takes submodule names"),
        ({"policy": "fp16"}, InvalidPolicyError, "Unknown policy"),
        ({"overrides": "head"}, PolyampTypeError, "must be a mapping"),
    ],
)
def test_apply_policy_errors_leave_the_model_untouched(kwargs: dict[str, Any], error: type, fragment: str) -> None:
    model = Net()
    with pytest.raises(error) as info:
        polyamp_torch.apply_policy(model, **kwargs)
    assert fragment in str(info.value)
    assert "forward" not in model.__dict__ and "forward" not in model.head.__dict__


def test_apply_policy_needs_a_module() -> None:
    with pytest.raises(PolyampTypeError, match=r"takes a torch\.nn\.Module"):
        polyamp_torch.apply_policy(lambda x: x)  # type: ignore[arg-type]


def _autocast_state(device_type: str = "cpu") -> tuple[bool, torch.dtype, bool, int]:
    """The thread's autocast state for ``device_type``: enabled, dtype, cast cache enabled, nesting depth."""
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
        depth,
    )


_OUTER_STATES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "none": contextlib.nullcontext,
    "bfloat16, no cast cache": lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
    "autocast off": lambda: torch.autocast("cpu", enabled=False),
}


@pytest.mark.parametrize("outer", list(_OUTER_STATES))
@pytest.mark.parametrize(
    ("region_kwargs", "torch_kwargs"),
    [
        ({"policy": "mixed_float16"}, {"dtype": torch.float16}),
        ({"policy": "mixed_bfloat16", "cache_enabled": False}, {"dtype": torch.bfloat16, "cache_enabled": False}),
        ({"policy": "mixed_bfloat16", "cache_enabled": True}, {"dtype": torch.bfloat16, "cache_enabled": True}),
        ({"policy": "float32"}, {"enabled": False}),
        ({"policy": "mixed_float16", "enabled": False}, {"enabled": False}),
    ],
)
def test_a_region_sets_and_restores_what_torch_autocast_does(
    outer: str, region_kwargs: dict[str, Any], torch_kwargs: dict[str, Any]
) -> None:
    """A region enters through torch's autocast setters directly (cheaper than torch.autocast's Python methods):
    inside, and after it, the thread's autocast state (enabled, dtype, cast cache, nesting) is exactly what
    the same torch.autocast gives, from any enclosing state, nested and after an exception."""
    before = _autocast_state()
    with _OUTER_STATES[outer]():
        with torch.autocast("cpu", **torch_kwargs):
            expected_inside = _autocast_state()
        expected_after = _autocast_state()
        with polyamp_torch.autocast(device_type="cpu", **region_kwargs):
            assert _autocast_state() == expected_inside
            with polyamp_torch.autocast(device_type="cpu", **region_kwargs):
                assert _autocast_state()[:3] == expected_inside[:3]
                assert _autocast_state()[3] == expected_inside[3] + 1
            assert _autocast_state() == expected_inside
        assert _autocast_state() == expected_after
        with pytest.raises(KeyError), polyamp_torch.autocast(device_type="cpu", **region_kwargs):
            raise KeyError("inside")
        assert _autocast_state() == expected_after
    assert _autocast_state() == before


def test_a_region_over_two_device_types_sets_and_restores_both_as_torch_autocast_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A region given no device type covers the accelerator and the CPU: it enters both as two nested
    torch.autocast regions would (here "xpu", whose autocast state a CPU build of torch keeps too)."""
    from polyamp_torch import _autocast

    monkeypatch.setattr(_autocast, "_default_device_types", [("xpu", "cpu")])
    monkeypatch.setattr(_autocast, "_PLANS", {})

    def both() -> tuple[tuple[bool, torch.dtype, bool, int], tuple[bool, torch.dtype, bool, int]]:
        return _autocast_state("xpu"), _autocast_state("cpu")

    before = both()
    with (
        torch.autocast("xpu", dtype=torch.bfloat16, cache_enabled=False),
        torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
    ):
        expected = both()
    region = polyamp_torch.autocast("mixed_bfloat16", cache_enabled=False)
    assert region.device_types == ("xpu", "cpu")
    with region:
        assert both() == expected
        assert isinstance(region._entered[-1][0], list) and len(region._entered[-1][0]) == 2
    assert both() == before


def test_leaving_the_outermost_region_drops_the_cast_cache_as_torch_autocast_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.autocast clears its cache of weight casts when the outermost autocast region exits, not an inner
    one; so does a region, inside torch.autocast or around it."""
    from polyamp_torch import _autocast

    cleared: list[int] = []
    monkeypatch.setattr(_autocast, "_clear_cache", lambda: cleared.append(_autocast_state()[3]))
    region = polyamp_torch.autocast("mixed_float16", device_type="cpu")
    with region:
        with region:
            pass
        assert cleared == []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with region:
                pass
        assert cleared == []
    assert cleared == [0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with region:
            pass
    assert cleared == [0]  # torch.autocast's own exit cleared it


def test_regions_are_per_thread_and_each_exit_restores_its_entry() -> None:
    """Nested regions of other policies and of the same one, each restoring the state its entry found; a thread
    started inside sees autocast off (torch's autocast state is per thread)."""

    def state() -> tuple[bool, torch.dtype]:
        enabled, dtype, _, _ = _autocast_state()
        return enabled, dtype

    before = state()
    outer = polyamp_torch.autocast("mixed_float16", device_type="cpu")
    inner = polyamp_torch.autocast("mixed_bfloat16", device_type="cpu")
    seen: list[tuple[bool, torch.dtype]] = []
    with outer:
        assert state() == (True, torch.float16)
        with inner:
            assert state() == (True, torch.bfloat16)
            with outer:  # the same region object entered again
                assert state() == (True, torch.float16)
                thread = threading.Thread(target=lambda: seen.append(state()))
                thread.start()
                thread.join()
            assert state() == (True, torch.bfloat16)
        assert state() == (True, torch.float16)
    assert state() == before
    assert [enabled for enabled, _ in seen] == [False]


def test_under_a_torch_function_mode_a_region_enters_torch_autocast_itself() -> None:
    """torch.autocast tells an active torch function mode (torch.export's pre-dispatch tracing among them) of its
    entry and exit; a region entered under one goes through torch.autocast, so torch.export keeps it."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with polyamp_torch.autocast("mixed_bfloat16", device_type="cpu", cpu_float32_ops=False):
                return self.linear(x)  # type: ignore[no-any-return]

    exported = torch.export.export(Net(), (torch.randn(2, 4),))
    targets = [type(node.target).__name__ for node in exported.graph.nodes if node.op == "call_function"]
    assert "WrapWithAutocast" in targets
    assert exported.module()(torch.randn(2, 4)).dtype == torch.bfloat16

    class Watching(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    before = _autocast_state()
    with Watching():
        with torch.autocast("cpu", dtype=torch.float16):
            expected = _autocast_state()
        with polyamp_torch.autocast("mixed_float16", device_type="cpu") as region:
            assert _autocast_state() == expected
            assert isinstance(region._entered[-1][0][0], torch.autocast)
    assert _autocast_state() == before
