"""`PrecisionOptimizer`: any torch optimizer, stepping bfloat16/float16 weights by a policy's training-state plan.

The rules are the core's (`polyamp._src.training_state`); this module translates them to torch:

* The inner optimizer runs unmodified, a chunk of parameters at a time, on float32 working tensors: each
  parameter group's ``"params"`` and the inner optimizer's ``state`` entries are swapped for float32 copies
  (the master copy itself when one is kept) for the call, so for-loop, foreach and fused implementations all
  work within a chunk. Between steps the inner optimizer holds no state: it all lives in
  ``PrecisionOptimizer.state``, the slots in the plan's state dtype.
* Where a working tensor would equal the stored one (float32 weights, float32 slots) it *is* the stored one:
  the default plan over float32 parameters hands the inner optimizer its own tensors (a pass-through).
* A loss scaler hands over ``grad_scale`` and ``found_inf`` as to torch's fused optimizers: a set flag returns
  before anything changes, and each gradient is unscaled in float32 as its working copy is made (a float16
  gradient below float16's range once unscaled keeps its value).
* The write back is the core's `write_update`, in torch ops: one float32 op per step of the reference.
* Conversions, slot write-backs and writes run as foreach ops over a chunk (one kernel per kind of tensor, not
  one per parameter); stochastic rounding draws its random bits per parameter, in order, and rounds the chunk's
  results in one pass.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import polyamp
import polyamp.backend_api
from polyamp import InvalidConfigError, Policy, PolyampTypeError, TrainingStateWarning
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.training_state import (
    KAHAN_KEY,
    MASTER_KEY,
    MeasuredStateBytes,
    is_state_slot,
    unplanned_hazard_message,
)
from polyamp_torch._framework import TORCH_DTYPES, torch
from polyamp_torch._precision_checkpoint import read_checkpoint
from polyamp_torch._precision_layout import state_layout
from polyamp_torch._precision_tensors import copy_all, float32_copies, float32_like, unscale

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MeasuredStateBytes",
    "PrecisionOptimizer",
    "is_moment",
    "is_precision_optimizer",
    "measure_state_bytes",
    "warn_unplanned",
]

#: Default float32 working memory of one chunk of parameters (weights, gradients and slots): 64 MiB.
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024

_OWN_KEYS = (MASTER_KEY, KAHAN_KEY)
_LOW = (torch.bfloat16, torch.float16)
# bfloat16 keeps the high 16 bits of a float32: the mask drops the low ones (0xFFFF0000 as an int32).
_HIGH_BITS = -65536


def is_moment(key: str, value: object, param: torch.Tensor) -> bool:
    """Whether the inner optimizer's state entry ``key`` is a slot kept in the plan's state dtype (the core's
    `polyamp.backend_api.training_state.is_state_slot`): a floating tensor with at least one dimension (exp_avg,
    exp_avg_sq, momentum_buffer, Adafactor's row_var/col_var, ...). Step counters and other scalars stay as the inner
    optimizer keeps them. ``param`` is the parameter the entry belongs to."""
    return isinstance(value, torch.Tensor) and is_state_slot(
        floating=value.is_floating_point(), ndim=value.ndim, key=key, param_ndim=param.ndim
    )


def is_precision_optimizer(optimizer: object) -> bool:
    """Whether ``optimizer`` forms its updates in float32 itself (so float16 gradients may be unscaled in place)."""
    return isinstance(optimizer, PrecisionOptimizer)


#: The optimizers already looked at, by id (each entry leaves with its optimizer).
_WARNED: dict[int, weakref.ref[Any]] = {}
# A plain optimizer writes each update to nearest into the weights it holds: the default plan of any policy.
_PLAIN = Policy()


def warn_unplanned(optimizer: Any, policy: Policy = _PLAIN, *, name: str | None = None, stacklevel: int = 3) -> None:
    """Warn once per optimizer when it steps bfloat16/float16 weights with no master copy and nearest rounding."""
    said = _WARNED.get(id(optimizer))  # (asked at every step: a dict lookup, not a WeakSet's)
    if said is not None and said() is optimizer:
        return
    try:
        key = id(optimizer)
        _WARNED[key] = weakref.ref(optimizer, lambda _, key=key: _WARNED.pop(key, None))  # type: ignore[misc]
    except TypeError:  # not weakly referenceable: say it every time rather than never
        pass
    dtypes = {str(p.dtype).removeprefix("torch.") for group in optimizer.param_groups for p in group["params"]}
    message = unplanned_hazard_message(name or type(optimizer).__name__, dtypes, policy)
    if message is not None:
        warnings.warn(message, TrainingStateWarning, stacklevel=stacklevel + 1)


def _own_keys(plan: Policy) -> frozenset[str]:
    """The keys of the state a `PrecisionOptimizer` keeps itself for each bfloat16/float16 parameter."""
    return frozenset(
        key for key, kept in ((MASTER_KEY, plan.keeps_master), (KAHAN_KEY, plan.rounding == "kahan")) if kept
    )


def _parameter_name(group: dict[str, Any], g: int, i: int) -> str:
    names = group.get("param_names")
    return repr(names[i]) if names is not None and i < len(names) else f"param_groups[{g}]['params'][{i}]"


class PrecisionOptimizer(torch.optim.Optimizer):
    """Any ``torch.optim.Optimizer``, stepping low-precision weights by a policy's training-state plan.

    The update is formed in float32 (the inner optimizer runs on float32 working copies of the weights, or of
    the float32 master copy, the gradients and the moments, a chunk of parameters at a time) and written with
    the plan's rounding: to nearest, stochastically (bfloat16) or with Kahan compensation, the moments stored
    in the plan's state dtype. See `polyamp.Policy` (``master``, ``state``, ``rounding``) and the guide's
    training-state page.

    It is a real optimizer: ``param_groups`` are the inner optimizer's own dicts (LR schedulers,
    ``zero_grad``, ``add_param_group`` work on either), ``state`` maps each parameter to the inner optimizer's
    slots (in the state dtype) and, per the plan, its float32 master copy
    (``polyamp.backend_api.training_state.MASTER_KEY``) and Kahan buffer (``KAHAN_KEY``); `state_dict` /
    `load_state_dict` carry them in their own dtypes. Checkpoint this optimizer, not the inner one, whose ``state``
    stays empty between steps.

    With ``polyamp.LossScaler`` (or ``torch.amp.GradScaler``): it takes the scale and the found-inf flag as
    torch's fused optimizers do (``grad_scale``, ``found_inf``), so ``scaler.step(optimizer)`` hands them over
    and `step` unscales each gradient in float32 as it makes the working copy: a float16 gradient too small for
    float16 once unscaled (below 2**-24) still reaches the update. A step with a non-finite gradient (overflow,
    guard, spike) returns at once, leaving weights, master copies, moments, compensation buffers, step counters
    and the random stream bitwise as they were. Gradients unscaled before the step (``scaler.unscale_``, to
    clip) are unscaled in their own dtype.

    Master copies and compensation buffers are created at construction (and by `add_param_group`), from
    the weights as they are then, so the memory is taken up front and counted by `measure_state_bytes`.

    Args:
        optimizer: The optimizer to run, built over the model's parameters (in the policy's param dtype;
            float32 parameters, e.g. modules ``apply_policy`` keeps in float32, are updated in float32 with
            no master or compensation). Any ``torch.optim`` optimizer in its for-loop, foreach or fused form,
            except those that re-evaluate a closure inside ``step`` (LBFGS).
        policy: The plan (a `polyamp.Policy` or a policy string); None takes ``polyamp.get_policy()`` now.
            A plan over bfloat16/float16 weights with nearest rounding and no master warns once
            (`polyamp.TrainingStateWarning`): updates below half a unit in the last place are lost.
        seed: Seed of the random bits of stochastic rounding (one generator per device, part of the state).
        chunk_bytes: The float32 working memory of one chunk (weights, gradients, two slots) in bytes;
            chunks hold at least one parameter. Results do not depend on it.

    Raises:
        PolyampTypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` (or is LBFGS, or another
            PrecisionOptimizer), ``policy`` is not a policy, ``seed``/``chunk_bytes`` not an int.
        InvalidConfigError: a parameter's dtype is neither the plan's param dtype nor float32 (the message
            names it); ``chunk_bytes`` < 1.

    Examples:
        >>> import torch, polyamp, polyamp_torch
        >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = polyamp_torch.PrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "bfloat16_kahan")
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        >>> state = opt.state[model.weight]
        >>> state["exp_avg"].dtype, state["polyamp_compensation"].dtype
        (torch.bfloat16, torch.bfloat16)
    """

    #: torch's protocol of fused optimizers: a loss scaler (polyamp's or ``torch.amp.GradScaler``) sets
    #: ``grad_scale`` and ``found_inf`` instead of unscaling the gradients, and `step` skips when ``found_inf`` is
    #: set and otherwise unscales each gradient in float32, as it makes the working copy.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        policy: polyamp.backend_api.policies.PolicyLike | None = None,
        *,
        seed: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, PrecisionOptimizer):
            raise PolyampTypeError(
                "PrecisionOptimizer wraps a torch.optim.Optimizer built over the model's parameters, e.g. "
                f"PrecisionOptimizer(torch.optim.AdamW(model.parameters())). Received: {describe(optimizer)}."
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise PolyampTypeError(
                "PrecisionOptimizer cannot wrap LBFGS: it re-evaluates its closure inside step(), on the model's "
                "own parameters, while the update runs on float32 working copies. Use LBFGS on float32 "
                "parameters directly."
            )
        for what, value, low in (("seed", seed, 0), ("chunk_bytes", chunk_bytes, 1)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise PolyampTypeError(f"`{what}` must be an int. Received: {describe(value)}.")
            if value < low:
                raise InvalidConfigError(f"`{what}` must be >= {low}. Received: {value}.")
        plan = polyamp.get_policy() if policy is None else Policy(policy)
        self._check_dtypes(plan, optimizer.param_groups)
        #: The optimizer this one runs on float32 working tensors.
        self.optimizer = optimizer
        #: The training-state plan followed.
        self.policy = plan
        self.seed = seed
        self.chunk_bytes = chunk_bytes
        self._generators: dict[torch.device, torch.Generator] = {}
        #: The keys of the state this optimizer keeps itself for each bfloat16/float16 parameter, by the plan.
        self._own_keys = _own_keys(plan)
        # torch's constructor adds each group through add_param_group; here they are the inner optimizer's own.
        self._adopting = True
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._adopting = False
        self.param_groups = optimizer.param_groups  # the same list: groups added to either appear in both
        for group in self.param_groups:
            self._init_own_state(group["params"])
        if plan.param_dtype != "float32" and not plan.keeps_master and plan.rounding == "nearest":
            warn_unplanned(self, plan, name=f"PrecisionOptimizer({type(optimizer).__name__})", stacklevel=2)

    # -- parameters ----------------------------------------------------------------------------------

    @staticmethod
    def _check_dtypes(plan: Policy, groups: list[dict[str, Any]]) -> None:
        allowed = {TORCH_DTYPES[plan.param_dtype], torch.float32}
        for g, group in enumerate(groups):
            for i, param in enumerate(group["params"]):
                if isinstance(param, torch.Tensor) and param.dtype not in allowed:
                    raise InvalidConfigError(
                        f"Parameter {_parameter_name(group, g, i)} (shape {tuple(param.shape)}) is "
                        f"{str(param.dtype).removeprefix('torch.')}, but the plan {plan.name!r} keeps "
                        f"{plan.param_dtype} parameters (float32 ones are also accepted). Cast the model to the "
                        "policy's param dtype before building the optimizer (polyamp_torch.apply_policy(model, "
                        "policy)), or pass the policy the model was built for."
                    )

    def _low(self, param: torch.Tensor) -> bool:
        return param.dtype in _LOW

    def _init_own_state(self, params: list[torch.Tensor]) -> None:
        plan = self.policy
        state_dtype = TORCH_DTYPES[plan.state_dtype]
        with torch.no_grad():
            for param in params:
                # State the inner optimizer made at construction (Adagrad's sums) moves here, in the state dtype.
                for key, value in self.optimizer.state.pop(param, {}).items():
                    self.state[param][key] = value.to(state_dtype) if is_moment(key, value, param) else value
                if not self._low(param):
                    continue
                state = self.state[param]
                if plan.keeps_master and MASTER_KEY not in state:
                    state[MASTER_KEY] = param.detach().to(torch.float32, copy=True)
                if plan.rounding == "kahan" and KAHAN_KEY not in state:
                    state[KAHAN_KEY] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (with its defaults), creating master copies and compensation
        buffers for its parameters; a parameter of another dtype than the plan's is refused first."""
        if self._adopting:
            self.param_groups.append(param_group)
            return
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if isinstance(params, torch.Tensor):
            params = [params]
        if isinstance(params, (list, tuple)):
            self._check_dtypes(self.policy, [{**param_group, "params": list(params)}])
        self.optimizer.add_param_group(param_group)
        self._init_own_state(self.param_groups[-1]["params"])

    # -- the step ------------------------------------------------------------------------------------

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = generator
        return generator

    def _chunks(self) -> list[list[tuple[int, torch.Tensor]]]:
        """(group index, parameter) pairs with gradients, in order, cut where the float32 working memory
        (weight, gradient, two slots) would pass ``chunk_bytes``.

        On the way, parameters added through the inner optimizer (``optimizer.optimizer.add_param_group``) since
        the last step are found, checked and given their state as `add_param_group` gives it, before anything
        is stepped: their dtype refused if the plan does not take it, the state the inner optimizer made for
        them moved here, master copies and compensation buffers made from the weights as they are now."""
        plan = self.policy
        allowed = (TORCH_DTYPES[plan.param_dtype], torch.float32)
        own = self._own_keys
        inner_state = self.optimizer.state
        added: list[torch.Tensor] = []
        chunks: list[list[tuple[int, torch.Tensor]]] = []
        chunk: list[tuple[int, torch.Tensor]] = []
        size = 0
        for g, group in enumerate(self.param_groups):
            for param in group["params"]:
                if param.dtype not in allowed or param in inner_state:
                    added.append(param)
                elif own and self._low(param) and not own <= self.state.get(param, {}).keys():
                    added.append(param)
                if param.grad is None:
                    continue
                cost = 16 * param.numel()
                if chunk and size + cost > self.chunk_bytes:
                    chunks.append(chunk)
                    chunk, size = [], 0
                chunk.append((g, param))
                size += cost
        if chunk:
            chunks.append(chunk)
        if added:
            self._check_dtypes(plan, self.param_groups)
            self._init_own_state(added)
        return chunks

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter with a gradient, formed in float32 and written by the plan.

        Args:
            closure: Recomputes the loss and gradients; called once, before the update.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.item() > 0):  # the one host read GradScaler also makes
            return loss
        grad_scale = getattr(self, "grad_scale", None)
        inverse = None if grad_scale is None else grad_scale.double().reciprocal().float()  # (as GradScaler forms it)
        for chunk in self._chunks():
            self._step_chunk(chunk, inverse)
        return loss

    def _step_chunk(self, chunk: list[tuple[int, torch.Tensor]], inverse: torch.Tensor | None) -> None:
        plan = self.policy
        inner = self.optimizer
        groups = self.param_groups
        params = [param for _, param in chunk]
        # float32 working tensors: a kept master copy, or the stored tensor itself where it is float32; the
        # others are converted together (one foreach copy per kind rather than one kernel per tensor).
        working: list[torch.Tensor] = []
        to_convert: list[torch.Tensor] = []
        converted: list[torch.Tensor] = []
        slot_lists: list[dict[str, Any]] = []
        # With ``inverse`` (the scale handed over by a loss scaler), the dense gradients unscaled in float32: the
        # float32 copies made here in place, float32 gradients into new tensors (working tensor, gradient).
        copies: list[torch.Tensor] = []
        float32_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        for param in params:
            state = self.state.get(param, {})
            if self._low(param):
                w32 = state[MASTER_KEY] if plan.keeps_master else float32_like(param, to_convert, converted)
            else:
                w32 = param.detach()
            grad = param.grad
            assert grad is not None
            if grad.dtype == torch.float32 and inverse is None:
                w32.grad = grad
            elif grad.is_sparse:  # (foreach copies are for dense tensors)
                w32.grad = grad.float() if inverse is None else grad.float() * inverse.to(grad.device)
            elif grad.dtype == torch.float32:  # unscaled into a tensor of its own: param.grad keeps its values
                float32_grads.append((w32, grad))
            else:
                w32.grad = float32_like(grad, to_convert, converted)
                copies.append(w32.grad)
            slot_lists.append(
                {
                    key: (
                        float32_like(value, to_convert, converted)
                        if is_moment(key, value, param) and value.dtype != torch.float32
                        else value
                    )
                    for key, value in state.items()
                    if key not in _OWN_KEYS
                }
            )
            working.append(w32)
        copy_all(converted, to_convert)
        if inverse is not None:
            unscale(copies, float32_grads, inverse)
        for w32, slots in zip(working, slot_lists, strict=True):
            inner.state[w32] = slots
        saved = [group["params"] for group in groups]
        for group in groups:
            group["params"] = []
        for (g, _), w32 in zip(chunk, working, strict=True):
            groups[g]["params"].append(w32)
        try:
            inner.step()
        finally:
            for group, params_of_group in zip(groups, saved, strict=True):
                group["params"] = params_of_group
            stepped = [inner.state.pop(w32, {}) for w32 in working]
            for w32 in working:
                w32.grad = None
        # Slots back in the plan's state dtype: written into the stored tensors where they exist.
        state_dtype = TORCH_DTYPES[plan.state_dtype]
        into: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for param, slots in zip(params, stepped, strict=True):
            state = self.state[param]
            for key, value in slots.items():
                if not is_moment(key, value, param) or value.dtype == state_dtype:
                    state[key] = value
                    continue
                stored = state.get(key)
                if isinstance(stored, torch.Tensor) and stored.dtype == state_dtype and stored.shape == value.shape:
                    into.append(stored)
                    sources.append(value)
                else:
                    state[key] = value.to(state_dtype)
        copy_all(into, sources)
        self._write(params, working)

    def _write(self, params: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Write the float32 results ``targets`` into ``params`` by the plan
        (`polyamp.backend_api.training_state.write_update`)."""
        pairs = [(param, target) for param, target in zip(params, targets, strict=True) if self._low(param)]
        if not pairs:
            return  # float32 parameters were updated in place
        plan = self.policy
        low = [param for param, _ in pairs]
        results = [target for _, target in pairs]
        if plan.keeps_master or plan.rounding == "nearest":
            copy_all(low, results)  # round to nearest, ties to even (a float32 master keeps the result itself)
            return
        if plan.rounding == "stochastic":
            by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for param, target in pairs:
                by_device.setdefault(param.device, []).append((param, target))
            for device, on_device in by_device.items():
                self._write_stochastic(device, on_device)
            return
        # Kahan: each line one float32 op, in the reference's order (no fused multiply-add).
        compensations = [self.state[param][KAHAN_KEY] for param in low]
        weights = float32_copies(low)
        y = torch._foreach_add(float32_copies(compensations), torch._foreach_sub(results, weights))
        copy_all(low, torch._foreach_add(weights, y))
        copy_all(compensations, torch._foreach_sub(y, torch._foreach_sub(float32_copies(low), weights)))

    def _write_stochastic(self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Stochastic rounding of one device's results, in one pass over them all: 16 random bits per element
        (drawn per parameter, in order, from the device's generator) added below bfloat16's last bit, the low
        bits dropped; NaN stays NaN."""
        sizes = [param.numel() for param, _ in pairs]
        total = sum(sizes)
        flat = torch.cat([target.reshape(-1) for _, target in pairs]) if len(pairs) > 1 else pairs[0][1].reshape(-1)
        random16 = torch.empty(total, dtype=torch.int32, device=device)
        generator = self._generator(device)
        offset = 0
        for (param, _), size in zip(pairs, sizes, strict=True):
            torch.randint(
                0, 65536, param.shape, generator=generator, out=random16[offset : offset + size].view(param.shape)
            )
            offset += size
        bits = (flat.view(torch.int32) + random16) & _HIGH_BITS
        rounded = torch.where(torch.isnan(flat), flat, bits.view(torch.float32))
        pieces = rounded.split(sizes)  # type: ignore[no-untyped-call]
        copy_all(
            [param for param, _ in pairs],
            [piece.view(param.shape) for (param, _), piece in zip(pairs, pieces, strict=True)],
        )

    # -- pickling ------------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle``, ``copy.deepcopy`` and ``torch.save(optimizer)`` keep: torch's entries (``defaults``,
        ``state``, ``param_groups``, the list the inner optimizer shares), the inner optimizer, the plan, the
        seed, the chunk size and the random generators' states."""
        saved = super().__getstate__()
        saved.update(
            optimizer=self.optimizer,
            policy=self.policy,
            seed=self.seed,
            chunk_bytes=self.chunk_bytes,
            generators={str(device): generator.get_state() for device, generator in self._generators.items()},
        )
        return saved

    def __setstate__(self, saved: dict[str, Any]) -> None:
        saved = dict(saved)
        generators = saved.pop("generators", {})
        super().__setstate__(saved)
        self._own_keys = _own_keys(self.policy)
        self._adopting = False
        self.param_groups = self.optimizer.param_groups
        self._generators = {}
        for name, state in generators.items():
            generator = torch.Generator(device=name)
            generator.set_state(state)
            self._generators[torch.device(name)] = generator

    # -- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (``state`` by parameter index, ``param_groups``), each tensor in its own
        dtype (float32 master copies, moments in the state dtype, compensation in the weight dtype), plus
        ``"polyamp"``: the plan's name, the seed and the random generators' states (``{"cpu": ByteTensor}``)."""
        saved = super().state_dict()
        saved["polyamp"] = {
            "policy": self.policy.name,
            "seed": self.seed,
            "generators": {str(device): generator.get_state() for device, generator in self._generators.items()},
        }
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of this optimizer, of one under another plan, or of the plain torch optimizer.

        Each tensor is loaded in the dtype this plan keeps it in (unlike torch's ``Optimizer.load_state_dict``,
        which casts floating state to the parameter dtype). A checkpoint saved under another plan is converted:
        moments to the state dtype, master copies made from the weights (or dropped), compensation buffers
        started at zero (or dropped); what was converted is logged once, as a warning of
        ``logging.getLogger("polyamp")``. The tensors are copied: the checkpoint is not aliased.

        Raises:
            StateDictError: ``state_dict`` is malformed or does not fit these parameter groups; the optimizer
                is left unchanged.
        """
        loaded = read_checkpoint(
            state_dict,
            self.param_groups,
            self.policy,
            is_moment,
            _parameter_name,
            lambda values: state_layout(self.optimizer, self.param_groups, values),
            type(self.optimizer).__name__,
        )
        self.state.clear()
        self.state.update(loaded.state)
        for group, values in zip(self.param_groups, loaded.groups, strict=True):
            group.update(values)
        self._generators.update(loaded.generators)
        if loaded.notes:
            logging.getLogger("polyamp").warning(" ".join(note[0].upper() + note[1:] for note in loaded.notes))


def measure_state_bytes(optimizer: torch.optim.Optimizer) -> MeasuredStateBytes:
    """An optimizer's training state, counted from the tensors it holds (``.per_parameter``: bytes per parameter).

    Weights and gradients are those of ``optimizer.param_groups`` (gradients as they are now: step first),
    master copies and compensation buffers those of a `PrecisionOptimizer`, state its (or a plain optimizer's)
    moments: floating tensors of a parameter's shape. Step counters and other scalars are left out. Compare with
    `polyamp.state_bytes`, the plan's count: AdamW under ``"bfloat16_kahan"`` measures 10 bytes per parameter
    (``measure_state_bytes(optimizer).per_parameter``).

    Raises:
        PolyampTypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise PolyampTypeError(f"measure_state_bytes takes a torch.optim.Optimizer. Received: {describe(optimizer)}.")
    counts = dict.fromkeys(("weights", "gradients", "master", "state", "compensation"), 0)
    parameters = 0
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in seen:
                continue
            seen.add(id(param))
            parameters += param.numel()
            counts["weights"] += param.numel() * param.element_size()
            if param.grad is not None:
                counts["gradients"] += param.grad.numel() * param.grad.element_size()
            for key, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                size = value.numel() * value.element_size()
                if key == MASTER_KEY:
                    counts["master"] += size
                elif key == KAHAN_KEY:
                    counts["compensation"] += size
                elif is_moment(key, value, param):
                    counts["state"] += size
    return MeasuredStateBytes(parameters=parameters, **counts)
