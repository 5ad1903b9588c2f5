"""`watch_forward`: which module first produced an inf or NaN in a forward pass, through forward hooks.

Every module of the model (from ``named_modules()``, the model itself included) gets a forward pre-hook and
a forward hook (``with_kwargs=True``). A call of the model is one forward pass; in a watched one:

* each floating tensor a module receives or returns is checked once on its device with ``torch.aminmax``
  (one reduction kernel, no host sync; a tensor already checked, unchanged since, is not checked again, so
  in a ``Sequential`` each activation is checked once);
* when the model's call returns, the checks are stacked and read with **one host sync** (per device);
* only when one of them is non-finite are the outputs counted (inf, -inf, NaN) and the calls handed to
  ``polyamp.backend_api.forward_watch.forward_report``, which decides who produced the value and who propagated it.

The watch keeps the checked tensors referenced until the model's call returns; in training autograd keeps
most of them anyway, under ``torch.no_grad`` this holds one forward's activations at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from polyamp import ForwardReport, PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.forward_watch import ForwardPass, ForwardWatchBase
from polyamp_torch._gradients import non_finite_counts

__all__ = ["ForwardWatch", "watch_forward"]


def _float_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The real floating, non-empty, strided tensors in ``value`` (nested tuples, lists and dict values)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.layout == torch.strided and value.numel() > 0:
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _float_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _float_tensors(item)


def _version(tensor: torch.Tensor) -> int:
    # Inference tensors have no version counter; treat them as unchanged.
    return -1 if tensor.is_inference() else tensor._version


def _check(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor's finiteness check on its device: its min and max (one kernel, no host read)."""
    with torch.no_grad():
        return torch.aminmax(tensor.detach())


def _finite(checks: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """Each check's result: one host read per device (all True on the fast path)."""
    by_device: dict[torch.device, list[int]] = {}
    for index, (low, _) in enumerate(checks):
        by_device.setdefault(low.device, []).append(index)
    finite = [True] * len(checks)
    for indices in by_device.values():
        values = torch.isfinite(torch.stack([v for i in indices for v in checks[i]]))
        if bool(values.all()):
            continue
        for i, ok in zip(indices, values.view(-1, 2).all(dim=1).tolist(), strict=True):
            finite[i] = bool(ok)
    return finite


class ForwardWatch(ForwardWatchBase):
    """A forward watch on a model (see `watch_forward`): hooks in place until `remove` or the ``with`` exits."""

    def __init__(self, model: torch.nn.Module, every: int = 1) -> None:
        if not isinstance(model, torch.nn.Module):
            raise PolyampTypeError(
                f"watch_forward expects a torch.nn.Module; received {describe(model)}. Pass the model whose "
                "forward passes to watch (for a Keras model use polyamp_keras.watch_forward)."
            )
        super().__init__(model, every)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for path, module in model.named_modules():
            root = module is model
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(path, root), with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(self._hook(root), with_kwargs=True, always_call=True, prepend=True)
            )

    _check = staticmethod(_check)
    _version = staticmethod(_version)

    def _read(self, forward: ForwardPass) -> ForwardReport | None:
        return forward.report(
            _finite(forward.checks),
            size=lambda t: t.numel(),
            dtype=lambda t: str(t.dtype).removeprefix("torch."),
            counts=lambda t: non_finite_counts(t.detach()).tolist(),
        )

    def _pre_hook(self, path: str, root: bool) -> Any:
        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._enter_call(module, path, root, _float_tensors((args, kwargs)))

        return pre_hook

    def _hook(self, root: bool) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            self._exit_call(module, root, self._forward, _float_tensors(output))

        return hook

    def _installed(self) -> bool:
        return bool(self._handles)

    def _uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def watch_forward(model: torch.nn.Module, *, every: int = 1) -> ForwardWatch:
    """Watch ``model``'s forward passes for the module that first produces an inf or NaN.

    Returns a `ForwardWatch`, hooked at once; use it as a context manager or call ``remove()``. A call of
    ``model`` is one forward pass; with ``every=N`` one pass in N is watched (the first, then every Nth).
    After each watched pass, ``watch.report()`` is None when every module output was finite, else a
    ``polyamp.ForwardReport`` naming the *producer* (the first module whose inputs were all finite and whose
    output was not), the modules that only propagated the value, and each output's inf / -inf / NaN counts;
    the report is also logged as a WARNING through ``logging.getLogger("polyamp")``.

    Cost per watched pass: one ``torch.aminmax`` per checked tensor (each module's output, and inputs not
    produced by a watched module), queued on the tensor's device, and one host sync when the model's call
    returns; counting happens only in a pass that had a non-finite output. Outputs are unchanged (the hooks
    return nothing). Modules added after the watch began, and submodules called outside the model's call
    (an activation-checkpoint recomputation during backward), are not watched. Eager mode: under
    ``torch.compile`` the hooks' bookkeeping is not traced.

    >>> import torch, polyamp_torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> with polyamp_torch.watch_forward(model) as watch:
    ...     _ = model(torch.ones(1, 2))
    >>> watch.report() is None
    True
    """
    return ForwardWatch(model, every=every)
