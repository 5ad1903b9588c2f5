"""What ``polyamp.check_hazards`` needs from JAX: name, dtype and max |w| of every array of a pytree or an orbax
checkpoint."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from polyamp import BackendNotInstalledError, CheckpointError, PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.checkpoints import (
    CORRUPT_FILE,
    DEFAULT_MAX_BYTES,
    TensorSummary,
    check_declared_bytes,
    is_array,
    summarize_array,
)

__all__ = ["read_tensors"]


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _path_name(path: tuple[Any, ...]) -> str:
    """A pytree path as ``"params/Dense_0/kernel"``; the ``value`` attribute Flax NNX's variables hold their array
    under is left out."""
    names = [_key_name(key) for key in path]
    if len(names) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
        names.pop()
    return "/".join(names)


def _summary(name: str, leaf: Any) -> TensorSummary:
    if not isinstance(leaf, jax.Array):
        return TensorSummary(*summarize_array(name, leaf))
    dtype = str(leaf.dtype)
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        return TensorSummary(name, dtype, None)
    if leaf.size == 0:
        return TensorSummary(name, dtype, 0.0)
    return TensorSummary(name, dtype, float(jnp.max(jnp.abs(leaf.astype(jnp.float32)))))  # max propagates NaN


def _read_orbax(path: Path, max_bytes: int) -> list[TensorSummary]:
    """An orbax checkpoint: one item's directory (``_METADATA``), or one step's (``_CHECKPOINT_METADATA``), whose
    items are read each, named after the item when there are several. Restored as NumPy arrays, on the host."""
    try:
        import numpy as np
        import orbax.checkpoint as ocp  # type: ignore[import-untyped]
        from etils import epath  # type: ignore[import-untyped]
    except ImportError as exc:
        raise BackendNotInstalledError(
            f"Reading the orbax checkpoint {str(path)!r} needs orbax-checkpoint, which is not installed. Install it "
            "with: pip install orbax-checkpoint; or save the arrays with numpy.savez and check the .npz file."
        ) from exc
    root = path.resolve()  # orbax takes absolute paths only
    if (root / "_METADATA").is_file():
        items = {"": root}
    else:
        items = {child.name: child for child in sorted(root.iterdir()) if (child / "_METADATA").is_file()}
        if not items:
            raise CheckpointError(
                f"Cannot read the checkpoint {str(path)!r}: it holds _CHECKPOINT_METADATA but no item directory "
                f"with _METADATA. {CORRUPT_FILE}"
            )
    found: list[TensorSummary] = []
    declared = 0
    for item, directory in items.items():
        prefix = f"{item}/" if len(items) > 1 else ""
        try:
            metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(directory))
            tree = getattr(metadata, "tree", metadata)
            declared += _declared_bytes(tree)
            check_declared_bytes(path, declared, max_bytes)
            as_numpy = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            restored = ocp.PyTreeCheckpointer().restore(
                str(directory), args=ocp.args.PyTreeRestore(restore_args=as_numpy)
            )
        except (CheckpointError, BackendNotInstalledError):
            raise
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise CheckpointError(
                f"Cannot read the checkpoint {str(path)!r}: orbax could not restore {str(directory)!r} "
                f"({type(exc).__name__}: {first}). {CORRUPT_FILE}"
            ) from exc
        found += [_summary(prefix + name, leaf) for name, leaf in _leaves(restored)]
    return found


def _declared_bytes(tree: Any) -> int:
    """The bytes the arrays of an orbax item's metadata tree declare (before anything is restored)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is not None and dtype is not None:
            total += math.prod(shape) * jnp.dtype(dtype).itemsize
    return total


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    """``(name, array)`` of each array of ``tree``; a Flax NNX variable is one leaf (its array), and a batch
    statistic of NNX's (``nnx.BatchStat``) is named under ``batch_stats/``, as Flax Linen keeps the same
    statistics, so one name rule finds both."""
    nnx = sys.modules.get("flax.nnx")
    variable = getattr(nnx, "Variable", None)
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=None if variable is None else (lambda node: isinstance(node, variable))
    )
    found = []
    for path, leaf in leaves:
        name = _path_name(path)
        if variable is not None and isinstance(leaf, variable):
            if isinstance(leaf, nnx.BatchStat):  # type: ignore[union-attr]
                name = f"batch_stats/{name}"
            leaf = leaf.get_value() if hasattr(leaf, "get_value") else leaf.value  # (Flax < 0.12: .value)
        if is_array(leaf):
            found.append((name, leaf))
    return found


def read_tensors(source: object, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[TensorSummary]:
    """Summaries of the arrays of a pytree (a Flax params dict or NNX state or module, an optax state, nested
    dicts and lists of JAX or NumPy arrays) or of an orbax checkpoint directory.

    Arrays are named by their place in the tree, ``"params/Dense_0/kernel"`` (an NNX variable by its attribute
    path; an ``nnx.BatchStat`` under ``batch_stats/``, as Flax Linen keeps batch statistics); max |w| of a JAX array
    is computed on its device, in float32. An orbax checkpoint is an item's directory (holding ``_METADATA``, as
    ``StandardCheckpointer.save`` writes it) or a step's (holding ``_CHECKPOINT_METADATA``, as a ``CheckpointManager``
    writes it, each item read in turn); its arrays may declare at most ``max_bytes`` (from its metadata, before
    anything is restored).

    Args:
        source: A `pathlib.Path` of an orbax checkpoint directory, or a pytree.
        max_bytes: For a checkpoint, the most bytes its arrays may declare.

    Returns:
        One summary per array.

    Raises:
        CheckpointError: The checkpoint cannot be restored, or declares more than ``max_bytes``.
        BackendNotInstalledError: An orbax checkpoint and no ``orbax-checkpoint`` package.
        PolyampTypeError: ``source`` holds no array.
    """
    if isinstance(source, Path):
        return _read_orbax(source, max_bytes)
    leaves = _leaves(source)
    if not leaves:
        raise PolyampTypeError(
            "polyamp_jax reads a pytree holding arrays (a Flax params dict, an NNX state or module, nested dicts and "
            f"lists of arrays) or an orbax checkpoint directory. Received: {describe(source)}, which holds none."
        )
    return [_summary(name, leaf) for name, leaf in leaves]
