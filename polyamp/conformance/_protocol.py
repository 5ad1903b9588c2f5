"""What a backend's conformance harness provides: the only way the cases touch a framework."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from polyamp._src.op_classes import OpClass, op_class

if TYPE_CHECKING:
    import numpy as np

    from polyamp import Float8Recipe, LossScaler, Policy

__all__ = ["CAPABILITIES", "OPS", "Harness", "HarnessUnavailable", "Loop", "Trainer", "capabilities_of"]

#: Ops whose output dtype the cases check, by their names in polyamp's op-class table
#: (`polyamp.backend_api.policies.OP_CLASSES`).
OPS = ("matmul", "dense", "conv", "softmax", "log_softmax", "cross_entropy", "layer_norm", "sum")
#: Those the table runs in the compute dtype; the others run in float32.
COMPUTE_OPS = frozenset(op for op in OPS if op_class(op, strict=True) is OpClass.COMPUTE)


#: What a harness may offer, and what each capability means. Harness methods named here count as offered
#: when present; the others are declared in ``Harness.capabilities``. A case that needs a capability a
#: harness lacks is skipped with the reason, never failed.
CAPABILITIES: Final = {
    "op_dtype": "Harness.op_dtype: run one op class under a policy",
    "model_dtypes": "Harness.model_dtypes: build the tiny model under a policy",
    "trainer": "Harness.trainer: train the tiny model through a LossScaler",
    "loop": "Harness.loop: drive an iteration call by call, with two optimizers",
    "tiny_gradient": "Harness.tiny_gradient: one gradient through the scaler",
    "passes_loss_through": "Harness.passes_loss_through: check a disabled scaler's scale()",
    "functional": "Harness.functional_trainer: train through the backend's functional (stateless) form",
    "low_precision": "computes in float16/bfloat16 when the policy says so (declared)",
    "guard": "the trainer's scaler guards steps without scaling and keeps records() naming the non-finite "
    "gradients, and the trainer names the parameter step(overflow=True) plants into (`planted`) (declared)",
    "float8_linear": "Harness.float8_linear: one FP8 linear layer's forward and backward under a dynamic recipe",
    "float8_delayed": "Harness.float8_delayed: steps of one delayed-scaling FP8 linear layer from a state dict in "
    "the form every backend reads (polyamp.backend_api.state_dicts.pack_float8_state)",
    "precision": "trainer() follows a policy's training-state plan (master, state, rounding) through the backend's "
    "precision optimizer, its optimizer_state() includes the master copies and compensation buffers, and "
    "params() are the stored (bfloat16) weights as float32 (declared)",
}


def capabilities_of(harness: object) -> frozenset[str]:
    """The capabilities ``harness`` offers: its declared ``capabilities`` and the protocol methods it has."""
    declared = frozenset(getattr(harness, "capabilities", ()))
    methods = {name for name in CAPABILITIES if callable(getattr(harness, name, None))}
    if callable(getattr(harness, "functional_trainer", None)):
        methods.add("functional")
    return declared | methods


class HarnessUnavailable(Exception):
    """Raised by a harness constructor when its framework or device is not available here."""


@runtime_checkable
class Trainer(Protocol):
    """A tiny classifier (8 inputs, 16 hidden ReLU units, 4 classes, cross-entropy) and its optimizer."""

    scaler: LossScaler | None

    def step(self, x: np.ndarray, y: np.ndarray, *, overflow: bool = False) -> float:
        """One iteration; ``overflow`` plants an inf in one (scaled) gradient after backward. Returns the loss."""
        ...

    def params(self) -> list[np.ndarray]:
        """The parameters, as NumPy arrays (float32)."""
        ...

    def optimizer_state(self) -> list[np.ndarray]:
        """The optimizer's slots and step counters, as NumPy arrays."""
        ...

    def step_skipped(self) -> bool:
        """Whether the last step was skipped for non-finite gradients (False without a scaler)."""
        ...


@runtime_checkable
class Loop(Protocol):
    """One training iteration driven call by call: a two-layer model whose first layer belongs to optimizer 0
    and second layer to optimizer 1 (SGD with momentum 0.9, lr 0.1), and the `polyamp.LossScaler` in use.

    The loop's calls map to the backend's loop style: PyTorch's ``unscale_(opt)`` / ``step(opt)``,
    TensorFlow's ``unscale(grads)`` / ``step(opt, zip(grads, vars))``; ``update()`` on both.
    """

    scaler: LossScaler
    #: The two optimizers (for ``scaler.step_skipped(optimizer)``).
    optimizers: Sequence[Any]

    def backward(self, overflow: Collection[int] = ()) -> None:
        """Forward a batch, scale the loss, backpropagate; plant an inf in a (scaled) gradient of each listed
        optimizer."""
        ...

    def unscale(self, index: int) -> None:
        """Unscale optimizer ``index``'s gradients through the scaler."""
        ...

    def step(self, index: int) -> None:
        """Step optimizer ``index`` through the scaler (one step, no update)."""
        ...

    def update(self) -> None:
        """End the iteration (``scaler.update()``)."""
        ...

    def params(self, index: int) -> list[np.ndarray]:
        """Optimizer ``index``'s parameters as NumPy arrays."""
        ...

    def optimizer_state(self, index: int) -> list[np.ndarray]:
        """Optimizer ``index``'s slots and counters as NumPy arrays."""
        ...


@runtime_checkable
class Harness(Protocol):
    """One backend on one device, as the conformance cases see it.

    Every method is optional: a harness offers what its backend can do (see `CAPABILITIES`), and cases it
    cannot run are skipped with the reason.

    Attributes:
        backend: The backend's name ("torch", "tensorflow", ...).
        device: The device type ("cpu", "cuda").
        devices: (class attribute) The device types the harness can run on; targets are made from them.
        capabilities: (optional) Declared capabilities besides the methods, e.g. ``{"low_precision"}``.
        divergences: Case keys (see `polyamp.conformance.expect_divergence`) where this backend knowingly
            differs from polyamp's semantics, with the reason. Those cases are expected to fail (strictly:
            a passing one is reported, so the table stays true).
    """

    backend: str
    device: str
    divergences: Mapping[str, str]

    def op_dtype(self, op: str, policy: Policy) -> str:
        """Run op class ``op`` (see `OPS`) on low-precision activations under ``policy``; return its output dtype."""
        ...

    def model_dtypes(self, policy: Policy) -> tuple[list[str], str]:
        """Build the tiny model under ``policy``; return its parameter dtypes and its output dtype."""
        ...

    def trainer(
        self,
        policy: Policy,
        *,
        scaler: Mapping[str, Any] | None = None,
        optimizer: str = "sgd",
        clip: float | None = None,
        seed: int = 0,
    ) -> Trainer:
        """A `Trainer` under ``policy``. ``scaler``: keyword arguments for this backend's `polyamp.LossScaler`
        (None: a plain loop without scaler). ``optimizer``: "sgd" (momentum 0.9, lr 0.1) or "adam" (lr 0.01).
        ``clip``: unscale, then clip the global gradient norm to this value. Same ``seed``, same initial
        weights."""
        ...

    def tiny_gradient(
        self, x: np.ndarray, w: np.ndarray, factor: float, policy: Policy, scaler: LossScaler | None
    ) -> np.ndarray:
        """The gradient of ``factor * sum(x @ w)`` w.r.t. ``w`` with the matmul under ``policy``, through
        ``scaler`` (scale, backward, unscale) when given; float32."""
        ...

    def passes_loss_through(self, scaler: LossScaler) -> bool:
        """Whether ``scaler.scale(loss)`` returns the very loss object, for one of this backend's tensors."""
        ...

    def new_scaler(self, **settings: Any) -> Any:
        """(Optional) The backend's scaler made from ``settings``, for backends whose scaler is not a
        `polyamp.LossScaler` (Keras's optimizer wrapper); it offers ``enabled``, ``get_scale()`` and
        ``state_dict()``. Without it, the cases use ``LossScaler(**settings, backend=harness.backend)``."""
        ...

    def float8_linear(
        self, recipe: Float8Recipe, x: np.ndarray, weight: np.ndarray, upstream: np.ndarray
    ) -> dict[str, np.ndarray]:
        """One linear layer ``x @ weight.T`` (no bias, float32 compute) converted by the backend under the
        dynamic ``recipe``, run forward and backward with ``upstream`` as the output's gradient: its
        ``"output"``, ``"grad_input"`` and ``"grad_weight"`` as float32 arrays (``weight`` is (out, in))."""
        ...

    def float8_delayed(
        self,
        recipe: Float8Recipe,
        xs: Sequence[np.ndarray],
        weight: np.ndarray,
        upstreams: Sequence[np.ndarray],
        state: Mapping[str, Any] | None,
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        """Training steps (forward, backward with ``upstreams``; the weight stays) of one linear layer named
        ``"layer"`` under the delayed ``recipe``, from ``state`` (a state dict in the form every backend reads;
        None: a fresh layer): each step's output, and the layer's state dict after."""
        ...

    def loop(self, policy: Policy, *, scaler: Mapping[str, Any], seed: int = 0) -> Loop:
        """A `Loop` under ``policy`` with a `polyamp.LossScaler` made from ``scaler`` (keyword arguments)."""
        ...

    def functional_trainer(self, policy: Policy, *, scaler: Mapping[str, Any], seed: int = 0) -> Trainer:
        """A `Trainer` whose step runs through ``LossScaler(**scaler).functional()`` (state in, state out),
        asking ``fn.spike(state, loss=<the unscaled loss>, grads=<the unscaled gradients>)`` for the spike rule's
        decision and handing it to ``apply_if_finite`` and ``update`` (``scaler`` may hold ``guard`` and
        ``spike``); its ``scaler`` offers ``state_dict()``, ``records()`` and ``skipped_steps()`` of the current
        functional state, and ``step`` returns the unscaled loss as a float."""
        ...
