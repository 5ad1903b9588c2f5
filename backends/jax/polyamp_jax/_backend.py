"""The object polyamp's registry loads for the "jax" backend."""

from __future__ import annotations

from polyamp import LossScaleConfig, LossScaleState, PolyampTypeError
from polyamp_jax._functional import JaxFunctional

__all__ = ["JaxBackend"]


class JaxBackend:
    """polyamp's JAX backend: a functional form only (JAX has no optimizer that owns state to step)."""

    name = "jax"

    def make_device(self, config: LossScaleConfig, state: LossScaleState) -> object:
        raise PolyampTypeError(
            "JAX training steps are pure functions: polyamp.LossScaler's stateful loop methods (scale/step/update, "
            "apply_gradients) have nothing to act on there. Use the optax transformation "
            "polyamp_jax.loss_scaled(optimizer, ...) (tx.scale(opt_state, loss), then tx.update as usual), or the "
            "functional scaler polyamp.LossScaler(...).functional(backend='jax') in a hand-written step."
        )

    def make_functional(self, config: LossScaleConfig) -> JaxFunctional:
        return JaxFunctional(config)
