"""What a user porting a torch.amp script meets first: the drop-in scaler, policies from torch's own objects,
models that follow the policy in effect, schedulers that frameworks accept."""

from __future__ import annotations

import math
import pickle
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import polyamp  # noqa: E402
import polyamp_torch  # noqa: E402
from polyamp import InvalidPolicyError, PolyampTypeError  # noqa: E402


def _model_and_data(seed: int = 0) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.randn(32, 8), torch.randint(0, 4, (32,))


# -- TorchLossScaler as torch.amp.GradScaler ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [(("cpu",), {}), ((), {"device": "cpu"}), (("cpu", 1024.0, 3.0, 0.25, 7), {}), ((torch.device("cpu"),), {})],
)
def test_takes_grad_scalers_arguments_in_grad_scalers_order(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    ours = polyamp_torch.TorchLossScaler(*args, **kwargs)
    native = torch.amp.GradScaler(*[a.type if isinstance(a, torch.device) else a for a in args], **kwargs)
    assert ours.is_enabled() and native.is_enabled()
    assert (ours.get_scale(), ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (
        native.get_scale(),
        native.get_growth_factor(),
        native.get_backoff_factor(),
        native.get_growth_interval(),
    )
    assert ours.device == "cpu"


def test_enabled_by_default_like_grad_scaler_even_under_the_float32_policy() -> None:
    """Replacing GradScaler() and keeping one's own torch.autocast(float16) must keep scaling."""
    assert polyamp.get_policy().name == "float32"
    runs = []
    for scaler in (torch.amp.GradScaler("cpu", growth_interval=2), polyamp_torch.TorchLossScaler(growth_interval=2)):
        model, x, y = _model_and_data()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scales = []
        for step in range(5):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            if step == 2:
                model[0].weight.grad[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((scales, [p.detach().clone() for p in model.parameters()]))
    (native_scales, native_params), (our_scales, our_params) = runs
    assert our_scales == native_scales == [65536.0, 131072.0, 65536.0, 65536.0, 131072.0]
    assert all(torch.equal(a, b) for a, b in zip(our_params, native_params))


def test_cuda_without_cuda_disables_with_a_warning_as_grad_scaler_does() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.warns(UserWarning, match=r"CUDA is not available\. Disabling"):
        scaler = polyamp_torch.TorchLossScaler("cuda")
    assert not scaler.is_enabled()
    with pytest.warns(UserWarning, match="CUDA is not available"):
        assert not torch.amp.GradScaler("cuda").is_enabled()


def _step(scaler: Any, param: torch.nn.Parameter, opt: torch.optim.Optimizer, bad: float | None) -> None:
    """One scaled step of ``opt`` on ``param.sum()``; ``bad``, when given, replaces the first gradient entry."""
    opt.zero_grad()
    scaler.scale(param.sum()).backward()
    if bad is not None:
        param.grad[0] = bad
    scaler.step(opt)
    scaler.update()


def test_setters_change_the_rule_as_grad_scalers_do() -> None:
    scaler = polyamp_torch.TorchLossScaler("cpu", growth_interval=1)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(2)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.125, 2)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scales = []
    for bad in (None, None, math.nan):
        _step(scaler, param, opt, bad)
        scales.append(scaler.get_scale())
    assert scales == [65536.0, 262144.0, 32768.0]
    with pytest.raises(polyamp.InvalidConfigError, match="growth_factor"):
        scaler.set_growth_factor(0.5)
    assert scaler.get_growth_factor() == 4.0


def test_legacy_optimizers_get_the_scaler_and_a_future_warning() -> None:
    seen: list[Any] = []

    class Legacy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure: Any = None, *, grad_scaler: Any = None) -> Any:
            seen.append(grad_scaler)
            grad_scaler.unscale_(self)  # what such an optimizer does with the scaler's public API
            return super().step()

    param = torch.nn.Parameter(torch.ones(2))
    opt = Legacy([param], lr=0.5)
    scaler = polyamp_torch.TorchLossScaler("cpu")
    scaler.scale(param.sum()).backward()
    with pytest.warns(FutureWarning, match="stop passing itself"):
        scaler.step(opt)
    scaler.update()
    assert seen == [scaler]
    assert torch.equal(param.detach(), torch.full((2,), 0.5))


# -- policies from torch's own objects --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "region",
    [
        lambda: polyamp_torch.autocast(dtype=torch.bfloat16, device_type="cpu"),
        lambda: polyamp_torch.autocast(torch.bfloat16, device_type="cpu"),
    ],
    ids=["dtype_keyword", "dtype_positional"],
)
def test_autocast_takes_torch_autocasts_dtype(region: Any) -> None:
    with region() as entered:
        assert entered.policy == polyamp.Policy("mixed_bfloat16")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_autocast_refuses_a_policy_and_a_dtype() -> None:
    with pytest.raises(PolyampTypeError, match="a policy or a dtype, not both"):
        polyamp_torch.autocast("mixed_float16", dtype=torch.float16)


def test_a_bare_dtype_is_not_a_global_policy_and_the_error_names_both_meanings() -> None:
    with pytest.raises(PolyampTypeError, match=r"'mixed_float16'.*'float16'") as info:
        polyamp.set_policy(torch.float16)  # type: ignore[arg-type]
    assert "torch.float16" in str(info.value)
    assert polyamp.get_policy().name == "float32"


def test_familiar_names_get_a_did_you_mean() -> None:
    with pytest.raises(InvalidPolicyError, match=r"Did you mean 'mixed_float16'"):
        polyamp.set_policy("fp16")
    with pytest.raises(InvalidPolicyError, match=r"Did you mean 'mixed_bfloat16'"):
        polyamp.Policy("bf16-mixed")


def test_an_explicit_float16_region_enables_a_policy_following_scaler() -> None:
    """polyamp.LossScaler() under the global float32 policy, with an explicit float16 region: it scales."""
    model, x, y = _model_and_data()
    scaler = polyamp.LossScaler()
    with polyamp_torch.autocast("mixed_float16", device_type="cpu"):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    assert scaler.scale(loss) is not loss and scaler.enabled
    scaler.update(new_scale=1024.0)  # ends the iteration
    loss = torch.nn.functional.cross_entropy(model(x), y)  # no float16 region since: no scaling
    assert scaler.scale(loss) is loss


@pytest.mark.parametrize(
    ("make", "region", "warns"),
    [
        (polyamp.LossScaler, torch.float16, True),
        (lambda: polyamp_torch.TorchLossScaler(enabled=None), torch.float16, True),
        (polyamp.LossScaler, torch.bfloat16, False),  # bfloat16 needs no scaling
        (polyamp.LossScaler, None, False),  # float32: nothing to say
        (lambda: polyamp.LossScaler(enabled=False), torch.float16, False),  # asked for no scaling
    ],
    ids=["LossScaler-fp16", "TorchLossScaler(None)-fp16", "bf16", "fp32", "enabled=False"],
)
def test_a_policy_following_scaler_says_so_when_torchs_own_float16_autocast_goes_unscaled(
    make: Any, region: Any, warns: bool
) -> None:
    """polyamp's policy is float32 (no scaling), but the loss came from torch.autocast(float16): one warning,
    which names the cause and both remedies; the scaler itself does not change what it does."""
    model, x, y = _model_and_data()
    scaler = make()
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y))  # (float16 regions of earlier tests count here)
    scaler.discard_iteration()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with torch.autocast("cpu", dtype=region or torch.float16, enabled=region is not None):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            assert scaler.scale(loss) is loss and not scaler.enabled
            scaler.update()
    messages = [str(w.message) for w in caught if "does not scale" in str(w.message)]
    if not warns:
        assert messages == []
        return
    assert len(messages) == 1
    assert "computed in float16" in messages[0] and "'float32'" in messages[0]
    assert "set_policy('mixed_float16')" in messages[0] and "enabled=True" in messages[0]


def test_a_scaler_built_before_the_policy_rescues_tiny_gradients() -> None:
    scaler = polyamp.LossScaler()  # built in a setup function, before the policy is chosen
    polyamp.set_policy("mixed_float16")
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.rand(4, 8) + 0.5
    with polyamp_torch.autocast(device_type="cpu"):
        loss = model(x).float().sum() * 1e-8
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    assert bool((model.weight.grad != 0).all())
    scaler.step(opt)
    scaler.update()
    model.zero_grad()
    with polyamp_torch.autocast(device_type="cpu"):
        loss = model(x).float().sum() * 1e-8
    loss.backward()
    assert not bool((model.weight.grad != 0).any())  # what an unscaled run gets: every gradient underflows


# -- apply_policy follows the policy in effect ------------------------------------------------------------------


def test_apply_policy_without_a_policy_follows_the_policy_in_effect() -> None:
    model, x, _ = _model_and_data()
    polyamp_torch.apply_policy(model, device_type="cpu")  # under the float32 policy
    assert model(x).dtype == torch.float32 and model[0](x).dtype == torch.float32
    inner: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, out: inner.append(out.dtype))
    polyamp.set_policy("mixed_bfloat16")
    assert model(x).dtype == torch.float32 and inner[-1] == torch.bfloat16
    with polyamp.policy_scope("mixed_float16"):
        model(x)
        assert inner[-1] == torch.float16
    with polyamp_torch.autocast(enabled=False, device_type="cpu"):
        model(x)
        assert inner[-1] == torch.float32
    with polyamp_torch.autocast("mixed_float16", device_type="cpu"):
        model(x)
        assert inner[-1] == torch.float16
    assert polyamp_torch.module_policy(model) == polyamp.Policy("mixed_bfloat16")


def test_apply_policy_warns_once_when_the_policy_in_effect_wants_other_parameter_dtypes() -> None:
    model, x, _ = _model_and_data()
    polyamp_torch.apply_policy(model, device_type="cpu")
    polyamp.set_policy("bfloat16")
    with pytest.warns(UserWarning, match="keeps bfloat16 parameters.*apply_policy\\(model\\) again"):
        model(x.bfloat16())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x.bfloat16())


def test_a_tied_weight_kept_in_float32_says_so() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.head = torch.nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    model = Tied()
    with pytest.warns(UserWarning, match=r"shared by modules with different parameter dtypes: .*'embed' \(bfloat16\)"):
        polyamp_torch.apply_policy(model, "bfloat16", keep_float32=["head"], device_type="cpu")
    assert model.embed.weight is model.head.weight and model.head.weight.dtype == torch.float32


# -- SchedulerGuard is an LRScheduler -----------------------------------------------------------------------------


def test_scheduler_guard_is_an_lr_scheduler_and_keeps_its_count_across_a_resume() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = polyamp_torch.TorchLossScaler("cpu")
    guard = polyamp_torch.SchedulerGuard(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), scaler)
    assert isinstance(guard, torch.optim.lr_scheduler.LRScheduler)
    for bad in (math.inf, None, math.inf):
        _step(scaler, param, opt, bad)
        guard.step()
    assert guard.held_back == 2 and guard.last_epoch == 1 and guard.get_last_lr() == [0.5]
    saved = pickle.loads(pickle.dumps(guard.state_dict()))
    assert saved["polyamp_held_back"] == 2
    fresh_opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    resumed = polyamp_torch.SchedulerGuard(torch.optim.lr_scheduler.StepLR(fresh_opt, 1, gamma=0.5), scaler)
    resumed.load_state_dict(saved)
    assert resumed.held_back == 2 and resumed.last_epoch == 1
    resumed.load_state_dict(torch.optim.lr_scheduler.StepLR(fresh_opt, 1).state_dict())  # a plain dict loads too
    assert resumed.held_back == 2
