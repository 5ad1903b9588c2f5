"""`PolicyOverrides`: per-layer policies chosen by layer name, with one matching rule for every framework."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from typing import TypeAlias

from polyamp._src.errors import InvalidPolicyError, PolyampTypeError, describe
from polyamp._src.policy import Policy, PolicyLike

__all__ = ["OverridesLike", "PolicyOverrides"]

_GLOB_CHARS = frozenset("*?[")


class PolicyOverrides(Mapping[str, Policy]):
    """Policies for chosen layers, by name or glob pattern, in the order given.

    A key is a layer's full path (``"encoder.layers.0.norm"`` for a PyTorch module name,
    ``"encoder/norm"`` for a Keras layer path) or a glob pattern over it (``*`` matches any text, separators
    included; ``?`` one character; ``[...]`` a set). The policy of a layer is found by `resolve`:

    1. its own path: an exact key wins, otherwise the first pattern (in insertion order) that matches;
    2. if nothing matches, the same for its parent, grandparent, ... — a layer inside an overridden block
       runs under that block's policy unless it has an override of its own.

    Typical use keeps numerically sensitive layers in float32 under a float16 policy:

    >>> overrides = PolicyOverrides({"head": "float32", "*norm*": "float32"})
    >>> overrides.resolve("encoder.layers.0.layer_norm").name
    'float32'
    >>> overrides.resolve("head.dense").name          # inherited from "head"
    'float32'
    >>> overrides.resolve("encoder.layers.0.attn") is None
    True

    Args:
        overrides: A mapping (or iterable of pairs) from path or pattern to a `Policy`, policy name or spec.

    Raises:
        PolyampTypeError: a key is not a non-empty string, or ``overrides`` is not a mapping or pairs.
        InvalidPolicyError: a value is not a valid policy (the message names the key).
    """

    __slots__ = ("_exact", "_items", "_patterns")
    _items: dict[str, Policy]
    _exact: dict[str, Policy]
    _patterns: list[tuple[str, Policy]]

    def __init__(self, overrides: OverridesLike | None = None) -> None:
        if overrides is None:
            pairs: Iterable[tuple[object, object]] = ()
        elif isinstance(overrides, PolicyOverrides):
            pairs = overrides._items.items()
        elif isinstance(overrides, Mapping):
            pairs = overrides.items()
        elif isinstance(overrides, (str, bytes)) or not isinstance(overrides, Iterable):
            raise PolyampTypeError(
                "`overrides` must be a mapping from layer name or glob pattern to policy, e.g. "
                f"{{'*norm*': 'float32'}}. Received: {describe(overrides)}."
            )
        else:
            pairs = overrides
        items: dict[str, Policy] = {}
        for pair in pairs:
            try:
                if isinstance(pair, (str, bytes)):
                    raise ValueError  # "ab" would unpack to ("a", "b")
                key, value = pair
            except (TypeError, ValueError):
                raise PolyampTypeError(
                    f"`overrides` pairs must be (name_or_pattern, policy). Received: {describe(pair)}."
                ) from None
            if not isinstance(key, str) or not key:
                raise PolyampTypeError(
                    f"An override key must be a non-empty layer name or glob pattern. Received: {describe(key)}."
                )
            try:
                if value is None:  # Policy() alone would mean float32; an override must say which
                    raise InvalidPolicyError(
                        f"The override for {key!r} is None. Give a policy, e.g. {{{key!r}: 'float32'}}."
                    )
                items[key] = Policy(value)  # type: ignore[arg-type]
            except (InvalidPolicyError, PolyampTypeError) as exc:
                raise type(exc)(f"Override for {key!r}: {exc}") from exc
        object.__setattr__(self, "_items", items)
        object.__setattr__(self, "_exact", {k: v for k, v in items.items() if not _GLOB_CHARS & set(k)})
        object.__setattr__(self, "_patterns", [(k, v) for k, v in items.items() if _GLOB_CHARS & set(k)])

    def match(self, path: str) -> Policy | None:
        """The override for ``path`` itself (exact key first, then the first matching pattern), or None."""
        if not isinstance(path, str):
            raise PolyampTypeError(f"A layer path is a string such as 'encoder.norm'. Received: {describe(path)}.")
        exact = self._exact.get(path)
        if exact is not None:
            return exact
        for pattern, policy in self._patterns:
            if fnmatch.fnmatchcase(path, pattern):
                return policy
        return None

    def resolve(self, path: str, separators: str = "./") -> Policy | None:
        """The override for ``path`` or, failing that, for its nearest ancestor; None if there is none.

        Args:
            path: The layer's full path.
            separators: The characters that separate path components.
        """
        if not isinstance(path, str) or not isinstance(separators, str) or not separators:
            raise PolyampTypeError(
                "resolve() takes a layer path and separator characters, both strings, e.g. "
                f"resolve('encoder/norm', separators='/'). Received: {describe(path)}, {describe(separators)}."
            )
        candidate = path
        while candidate:
            policy = self.match(candidate)
            if policy is not None:
                return policy
            cut = max(candidate.rfind(sep) for sep in separators)
            candidate = candidate[:cut] if cut > 0 else ""
        return None

    def __getitem__(self, key: str) -> Policy:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PolicyOverrides is immutable; build a new one instead.")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PolicyOverrides):
            return list(self._items.items()) == list(other._items.items())
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __repr__(self) -> str:
        body = ", ".join(f"{k!r}: {v.name!r}" for k, v in self._items.items())
        return f"PolicyOverrides({{{body}}})"

    def __reduce__(self) -> tuple[type[PolicyOverrides], tuple[list[tuple[str, str]]]]:
        return (PolicyOverrides, ([(k, v.name) for k, v in self._items.items()],))


#: What functions taking overrides accept.
OverridesLike: TypeAlias = PolicyOverrides | Mapping[str, PolicyLike] | Iterable[tuple[str, PolicyLike]]
