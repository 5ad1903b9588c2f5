"""The loss-scaling state machine, written once in pure Python.

This module is the reference: every backend keeps the same state on its device and is tested step by
step against :meth:`LossScaleConfig.next_state`. The scale is held in float32, as on the devices, and every
multiplication rounds the way torch's ``_amp_update_scale_`` kernel does (double product, then float32), so
the reference reproduces ``torch.amp.GradScaler`` bit for bit for any growth/backoff factors.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypedDict

from polyamp._src.errors import InvalidConfigError, PolyampTypeError, describe

__all__ = [
    "INT32_MAX",
    "NOT_GIVEN",
    "RECIPROCAL_CEILING",
    "LossScaleConfig",
    "LossScaleSettings",
    "LossScaleState",
    "NotGiven",
    "OverflowPattern",
    "to_float32",
]

_F32: Final = struct.Struct("<f")
#: Growth counters and hysteresis live in int32 on the devices.
INT32_MAX: Final = 2**31 - 1

#: An overflow pattern: a string of ``F`` (all grads finite) and ``O`` (overflow), or booleans
#: (``True`` = a non-finite gradient was found).
OverflowPattern: TypeAlias = str | Iterable[bool]


def to_float32(value: float) -> float:
    """Round a Python float to the nearest float32, as a C ``(float)`` cast does (overflow gives inf)."""
    try:
        return float(_F32.unpack(_F32.pack(value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


#: float32's smallest normal number. Scales below it would be subnormal, which some kernels flush to zero.
FLOAT32_TINY: Final = 2.0**-126
#: The largest power of two whose float32 reciprocal (2**-126) is a normal number. A backend that unscales by
#: multiplying with the float32 reciprocal of the scale on a device that flushes subnormal numbers to zero
#: (XLA on CPU) gets a reciprocal of 0 above it, and every unscaled gradient with it: its scale never grows
#: past this (`LossScaleConfig.with_ceiling`).
RECIPROCAL_CEILING: Final = 2.0**126


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PolyampTypeError(f"`{name}` must be a real number. Received: {name}={describe(value)}.")
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range, e.g. 10**400
        raise InvalidConfigError(
            f"`{name}` must be a finite number. Received: {name}={describe(value)}, which is beyond float's range."
        ) from None


def _positive_int(name: str, value: object, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PolyampTypeError(f"`{name}` must be an int. Received: {name}={describe(value)}.")
    number = int(value)
    if not 1 <= number <= INT32_MAX:
        raise InvalidConfigError(
            f"`{name}` must be an int in [1, {INT32_MAX}] (it is kept in int32 on the device), "
            f"e.g. {example}. Received: {name}={number}."
        )
    return number


def _scale_bound(name: str, value: object) -> float | None:
    if value is None:
        return None
    number = _real(name, value)
    if not (math.isfinite(number) and FLOAT32_TINY <= number and math.isfinite(to_float32(number))):
        raise InvalidConfigError(
            f"`{name}` must be None or a positive number representable in float32, from 2**-126 (float32's "
            f"smallest normal number) to 3.4e38, e.g. {name}=1.0. Received: {name}={number!r}."
        )
    return number


class NotGiven:
    """The type of `NOT_GIVEN`: marks a setting the caller did not pass, so its default (or the current
    value) applies. A sentinel, never a comparison with the default value, tells "not given" apart from
    "given, equal to the default"."""

    _instance: NotGiven | None = None

    def __new__(cls) -> NotGiven:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_GIVEN"

    def __reduce__(self) -> str:
        return "NOT_GIVEN"


#: The one `NotGiven` instance.
NOT_GIVEN: Final = NotGiven()


class LossScaleSettings(TypedDict, total=False):
    """The loss-scaling settings as keyword arguments (``LossScaler(**settings)``); see `LossScaleConfig`."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float | None
    max_scale: float | None
    dynamic: bool


#: One line of documentation per setting, in field order; every docstring that lists the settings is made
#: from this table, so a setting is documented once.
SETTING_DOCS: Final = {
    "init_scale": "Starting scale, held in float32; torch's default (Keras 3 starts at 2**15).",
    "growth_factor": "Multiplier after ``growth_interval`` consecutive finite steps; > 1.",
    "backoff_factor": "Multiplier after an overflow (once ``hysteresis`` overflows accumulate); in (0, 1).",
    "growth_interval": "Consecutive finite steps before the scale grows; >= 1.",
    "hysteresis": "Overflows needed before the scale backs off; >= 1 (1 backs off on every overflow).",
    "min_scale": "Floor for the scale after backoff (>= 2**-126); None: 1.0, or init_scale if lower (see below).",
    "max_scale": "Cap for the scale after growth, or None for none (growth still never reaches inf).",
    "dynamic": "False keeps the scale at ``init_scale`` forever; non-finite steps are still skipped.",
}


@dataclass(frozen=True)
class LossScaleState:
    """The mutable part of a loss scaler, as a value.

    Attributes:
        scale: The current loss scale, a float32 value.
        growth_tracker: Consecutive finite steps since the scale last changed (``_growth_tracker`` in
            torch's state dict); always below ``growth_interval``.
        hysteresis_left: Overflows still tolerated before the next backoff; between 1 and ``hysteresis``.
    """

    scale: float
    growth_tracker: int = 0
    hysteresis_left: int = 1


@dataclass(frozen=True)
class LossScaleConfig:
    """The settings of a loss scaler, validated, and the reference state machine that uses them.

        Every loss scaler in polyamp (`LossScaler`, the Keras ``LossScaleOptimizer``, the state dicts) takes
        exactly these settings, with these defaults; this class is where they are defined and checked.

        Args:
    {settings}

        Raises:
            InvalidConfigError: (a ``ValueError``) a value is out of range.
            PolyampTypeError: (a ``TypeError``) a value has the wrong type.

        The algorithm, per optimizer step (``found_inf`` = any gradient is inf or NaN):

        * all finite: ``growth_tracker += 1``; when it reaches ``growth_interval``, the scale becomes
          ``min(scale * growth_factor, max_scale)`` unless that is not finite, ``growth_tracker`` resets to 0 and
          ``hysteresis_left`` refills to ``hysteresis``;
        * non-finite: the step is skipped, ``growth_tracker`` resets to 0, ``hysteresis_left -= 1``; when it reaches
          0, the scale becomes ``max(scale * backoff_factor, floor)`` and ``hysteresis_left`` refills.

        The floor is ``min_scale``; without one it is 1.0, or ``init_scale`` when that starts below 1, so a
        backoff never raises the scale (`floor_f32`). jmp's floor is 1 whatever the start, so from 0.5 its first
        backoff gives 1.0; `polyamp_jax.jmp_compat` keeps jmp's. torch's GradScaler and Keras's
        LossScaleOptimizer have no floor; polyamp's torch and Keras paths follow them step for step above it.

        Each product is rounded to float32 from its double-precision value, as torch's kernel does. With the
        defaults (hysteresis 1, no bounds) this is exactly ``torch.amp.GradScaler``'s rule.

        Example: a pattern of finite (F) and overflowing (O) steps at ``growth_interval=3``, and the scale after
        each step's update:

        >>> config = LossScaleConfig(growth_interval=3)
        >>> config.trajectory("FFFOFFOOFFFFFF")  # doctest: +NORMALIZE_WHITESPACE
        [65536.0, 65536.0, 131072.0, 65536.0, 65536.0, 65536.0, 32768.0, 16384.0, 16384.0, 16384.0,
         32768.0, 32768.0, 32768.0, 65536.0]

        With ``hysteresis=2`` a lone overflow is tolerated; a second one before the next growth backs off:

        >>> LossScaleConfig(growth_interval=3, hysteresis=2).trajectory("FOFOOO")
        [65536.0, 65536.0, 65536.0, 32768.0, 32768.0, 16384.0]

        Started below 1 without a ``min_scale``, the scale stays at its start on overflows; with one, it backs
        off to it:

        >>> LossScaleConfig(init_scale=0.5).trajectory("OO")
        [0.5, 0.5]
        >>> LossScaleConfig(init_scale=0.5, min_scale=0.125).trajectory("OOO")
        [0.25, 0.125, 0.125]
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    dynamic: bool = True

    def __post_init__(self) -> None:
        init_scale = _real("init_scale", self.init_scale)
        if not (math.isfinite(init_scale) and FLOAT32_TINY <= init_scale and to_float32(init_scale) < math.inf):
            raise InvalidConfigError(
                "`init_scale` must be a positive number representable in float32, from 2**-126 (float32's "
                f"smallest normal number) to 3.4e38, e.g. init_scale=2.0**16. Received: init_scale={init_scale!r}."
            )
        growth_factor = _real("growth_factor", self.growth_factor)
        if not (math.isfinite(growth_factor) and growth_factor > 1):
            raise InvalidConfigError(
                "`growth_factor` must be a finite number > 1, e.g. growth_factor=2.0. "
                f"Received: growth_factor={growth_factor!r}."
            )
        backoff_factor = _real("backoff_factor", self.backoff_factor)
        if not 0 < backoff_factor < 1:
            raise InvalidConfigError(
                "`backoff_factor` must be in the open interval (0, 1), e.g. backoff_factor=0.5. "
                f"Received: backoff_factor={backoff_factor!r}."
            )
        growth_interval = _positive_int("growth_interval", self.growth_interval, "growth_interval=2000")
        hysteresis = _positive_int("hysteresis", self.hysteresis, "hysteresis=2")
        min_scale = _scale_bound("min_scale", self.min_scale)
        max_scale = _scale_bound("max_scale", self.max_scale)
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise InvalidConfigError(
                f"`min_scale` must not exceed `max_scale`. Received: min_scale={min_scale!r}, max_scale={max_scale!r}."
            )
        if min_scale is not None and init_scale < min_scale:
            raise InvalidConfigError(
                f"`init_scale` must be at least `min_scale`. Received: init_scale={init_scale!r}, "
                f"min_scale={min_scale!r}. Lower min_scale or raise init_scale."
            )
        if max_scale is not None and init_scale > max_scale:
            raise InvalidConfigError(
                f"`init_scale` must be at most `max_scale`. Received: init_scale={init_scale!r}, "
                f"max_scale={max_scale!r}. Raise max_scale or lower init_scale."
            )
        if not isinstance(self.dynamic, bool):
            raise PolyampTypeError(f"`dynamic` must be a bool. Received: dynamic={describe(self.dynamic)}.")
        # Derived values, computed once: they are read every step (and traced by compilers, which cannot
        # trace the struct-based float32 rounding).
        floor = to_float32(min_scale) if min_scale is not None else to_float32(min(1.0, init_scale))
        object.__setattr__(self, "_floor_f32", floor)
        standard = self.dynamic and self.hysteresis == 1 and self.min_scale is None and self.max_scale is None
        object.__setattr__(self, "_standard_rule", standard)  # asked at every update
        object.__setattr__(self, "_checks_unscaled", floor < 1.0)  # asked at every unscale
        object.__setattr__(self, "_min_f32", None if min_scale is None else to_float32(min_scale))
        object.__setattr__(self, "_max_f32", None if max_scale is None else to_float32(max_scale))
        object.__setattr__(self, "_ceiling_f32", None)  # a device's ceiling (`with_ceiling`); none by default
        # Normalise numeric types (numpy scalars, ints) so equality and serialisation are plain Python.
        for name, value in (
            ("init_scale", init_scale),
            ("growth_factor", growth_factor),
            ("backoff_factor", backoff_factor),
            ("growth_interval", growth_interval),
            ("hysteresis", hysteresis),
            ("min_scale", min_scale),
            ("max_scale", max_scale),
        ):
            object.__setattr__(self, name, value)

    # -- float32 views of the bounds, as the devices hold them -------------------------------------------

    @property
    def min_scale_f32(self) -> float | None:
        """``min_scale`` rounded to float32, or None."""
        return self._min_f32  # type: ignore[attr-defined,no-any-return]

    @property
    def max_scale_f32(self) -> float | None:
        """``max_scale`` rounded to float32, or None."""
        return self._max_f32  # type: ignore[attr-defined,no-any-return]

    @property
    def ceiling_f32(self) -> float | None:
        """The device's ceiling this config's rule was given (`with_ceiling`), in float32, or None."""
        return self._ceiling_f32  # type: ignore[attr-defined,no-any-return]

    @property
    def floor_f32(self) -> float:
        """The lowest scale the rule reaches, in float32: ``min_scale``, or else 1.0 (``init_scale`` if that
        starts lower, so that a backoff never raises the scale; jmp's floor is 1 whatever the start).

        At or above 1, 1/scale is at most 1, so an unscaled gradient is never larger than its scaled value:
        checking the scaled gradients (what torch's fused kernels do) is enough, and 1/scale is always
        finite. torch's GradScaler has no floor; after a long run of overflows its scale reaches float32's
        subnormals and 0, where 1/scale is inf and the optimizer applies inf/NaN.
        """
        return self._floor_f32  # type: ignore[attr-defined,no-any-return]

    @property
    def checks_unscaled(self) -> bool:
        """True when the scale may fall below 1 (``min_scale`` or ``init_scale`` below 1): an unscaled gradient
        can then overflow where its scaled value did not, and backends check the unscaled gradients too."""
        return self._checks_unscaled  # type: ignore[attr-defined,no-any-return]

    @property
    def is_standard_rule(self) -> bool:
        """True for the plain dynamic rule: dynamic, hysteresis 1, no bounds.

        That is the rule frameworks' own loss scalers implement (torch's update kernel computes it), so a
        backend may hand such a config to its framework's kernel instead of running the extended rule, then
        keep the scale at `floor_f32`, which those kernels lack.
        """
        return self._standard_rule  # type: ignore[attr-defined,no-any-return]

    def with_ceiling(self, ceiling: float) -> LossScaleConfig:
        """This config's rule on a device whose scale must stay at or below ``ceiling``.

        A growth that would pass ``ceiling`` stops there, and a scale above it is not a state of the result
        (`check_state`); below the ceiling the rule is this config's, step for step (a product that would be
        inf still keeps the scale). polyamp's JAX backend runs its rule this way with `RECIPROCAL_CEILING`:
        it unscales by the float32 reciprocal of the scale, which XLA on CPU flushes to zero above 2**126.
        torch, TensorFlow and Keras keep their frameworks' rule, which grows to float32's limit.

        The ceiling belongs to the device, not to the settings: `settings`, state dicts and equality are this
        config's, so a state dict written under a ceiling loads anywhere.

        Raises:
            InvalidConfigError: ``init_scale`` or ``min_scale`` is above ``ceiling``.
        """
        value = to_float32(_real("ceiling", ceiling))
        for name in ("init_scale", "min_scale"):
            setting = getattr(self, name)
            if setting is not None and to_float32(setting) > value:
                raise InvalidConfigError(
                    f"`{name}` must be at most {value!r} on this backend: its scale never exceeds that, the "
                    "highest scale whose float32 reciprocal (which unscales the gradients) is a normal number "
                    f"rather than 0. Received: {name}={setting!r}. Pass {name} <= {value!r}, e.g. {name}=2.0**16."
                )
        made = dataclasses.replace(self)
        object.__setattr__(made, "_ceiling_f32", value)
        object.__setattr__(made, "_standard_rule", False)  # the frameworks' kernels know no ceiling
        return made

    # -- the settings as data --------------------------------------------------------------------------

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The names of the settings, in order (the first four are `LossScaler`'s positional arguments)."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each setting's default value."""
        return {field.name: field.default for field in dataclasses.fields(cls)}

    def settings(self) -> dict[str, Any]:
        """This config as a plain dict of settings (JSON-serialisable)."""
        return {name: getattr(self, name) for name in self.setting_names()}

    @classmethod
    def from_settings(
        cls, settings: Mapping[str, Any], base: LossScaleConfig | None = None, *, caller: str = "LossScaleConfig()"
    ) -> LossScaleConfig:
        """A config from keyword settings; a setting that is absent or `NOT_GIVEN` keeps ``base``'s value
        (the defaults when ``base`` is None).

        Raises:
            PolyampTypeError: a name is not a setting (the message suggests the closest one).
            InvalidConfigError / PolyampTypeError: a value is invalid (see the class docstring).
        """
        names = cls.setting_names()
        unknown = [key for key in settings if key not in names]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PolyampTypeError(
                f"{caller} got an unknown loss-scaling setting {key!r}.{hint} The settings are: {', '.join(names)}."
            )
        values = base.settings() if base is not None else cls.defaults()
        values.update({key: value for key, value in settings.items() if value is not NOT_GIVEN})
        return cls(**values)

    def replace(self, **changes: Any) -> LossScaleConfig:
        """A copy with some settings changed (validated like a new config)."""
        return self.from_settings(changes, self, caller="LossScaleConfig.replace()")

    # -- the reference state machine ---------------------------------------------------------------------

    def initial_state(self) -> LossScaleState:
        """The state a fresh scaler starts in."""
        return LossScaleState(to_float32(self.init_scale), 0, self.hysteresis)

    def next_state(self, state: LossScaleState, found_inf: bool) -> LossScaleState:
        """Return the state after one update, given whether any gradient was non-finite.

        This is the reference the backends are tested against; see the class docstring for the rule.
        """
        if not self.dynamic:
            return state
        if found_inf:
            hysteresis_left = state.hysteresis_left - 1
            if hysteresis_left > 0:
                return LossScaleState(state.scale, 0, hysteresis_left)
            scale = to_float32(state.scale * self.backoff_factor)
            floor = self.floor_f32
            if scale < floor:
                scale = floor
            return LossScaleState(scale, 0, self.hysteresis)
        tracker = state.growth_tracker + 1
        if tracker < self.growth_interval:
            return LossScaleState(state.scale, tracker, state.hysteresis_left)
        return LossScaleState(self._grown(state.scale), 0, self.hysteresis)

    def _grown(self, scale: float) -> float:
        """The scale after one growth: times ``growth_factor`` in float32, capped at ``max_scale``; kept where
        the product would be inf; then not above the device's ceiling (`with_ceiling`)."""
        grown = to_float32(scale * self.growth_factor)
        cap = self.max_scale_f32
        if cap is not None and grown > cap:
            grown = cap
        if not math.isfinite(grown):
            return scale
        ceiling = self.ceiling_f32
        return ceiling if ceiling is not None and grown > ceiling else grown

    def finite_run(self, state: LossScaleState, steps: int) -> tuple[list[float], LossScaleState]:
        """`next_state` over ``steps`` consecutive finite steps from ``state``: the scale each step was taken
        at, and the state after the last (what the records replay for the iterations that stepped)."""
        if not self.dynamic:
            return [state.scale] * steps, state
        scale, tracker, hysteresis_left = state.scale, state.growth_tracker, state.hysteresis_left
        interval = self.growth_interval
        scales = []
        for _ in range(steps):
            scales.append(scale)
            tracker += 1
            if tracker >= interval:  # as next_state grows
                scale, tracker, hysteresis_left = self._grown(scale), 0, self.hysteresis
        return scales, LossScaleState(scale, tracker, hysteresis_left)

    def after_finite(self, state: LossScaleState, steps: int) -> LossScaleState:
        """The state after ``steps`` consecutive finite steps from ``state`` (`finite_run`'s, without the
        scales along the way): one growth per ``growth_interval`` steps, counted rather than stepped."""
        if not self.dynamic or steps <= 0:
            return state
        growths, tracker = divmod(state.growth_tracker + steps, self.growth_interval)
        if not growths:
            return LossScaleState(state.scale, tracker, state.hysteresis_left)
        scale = state.scale
        for _ in range(growths):  # as next_state grows
            grown = self._grown(scale)
            if grown == scale:
                break  # at the cap or float32's limit: no further growth changes it
            scale = grown
        return LossScaleState(scale, tracker, self.hysteresis)

    def states(self, pattern: OverflowPattern, state: LossScaleState | None = None) -> list[LossScaleState]:
        """Run the reference over an overflow pattern; return the state after each step.

        Args:
            pattern: ``"FFO..."`` (F finite, O overflow) or an iterable of bools (True = overflow).
            state: Starting state; the initial state by default.
        """
        current = self.initial_state() if state is None else state
        result = []
        for found_inf in _overflows(pattern):
            current = self.next_state(current, found_inf)
            result.append(current)
        return result

    def trajectory(self, pattern: OverflowPattern, state: LossScaleState | None = None) -> list[float]:
        """The scale after each step of ``pattern`` (see :meth:`states`)."""
        return [s.scale for s in self.states(pattern, state)]

    def check_state(self, state: LossScaleState) -> None:
        """Raise unless ``state`` is one this config can be in.

        Raises:
            PolyampTypeError: (a ``TypeError``) ``state`` is not a `LossScaleState`, its scale is not a real
                number or a counter not an int.
            InvalidConfigError: (a ``ValueError``) a value is out of range: a scale that is not finite in
                float32, not positive or below the floor (a zero or subnormal scale), above ``max_scale``; a
                counter outside its range.
        """
        if not isinstance(state, LossScaleState):
            raise PolyampTypeError(f"A loss-scale state must be a polyamp.LossScaleState. Received: {describe(state)}.")
        scale = state.scale
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise PolyampTypeError(f"The loss scale must be a real number. Received: scale={describe(scale)}.")
        for name in ("growth_tracker", "hysteresis_left"):
            value = getattr(state, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise PolyampTypeError(f"`{name}` must be an int. Received: {name}={describe(value)}.")
        try:
            finite = math.isfinite(scale) and math.isfinite(to_float32(float(scale)))
        except OverflowError:  # an int beyond float's range
            finite = False
        if not (finite and scale > 0):
            raise InvalidConfigError(
                "The loss scale must be a finite positive number representable in float32. "
                f"Received: scale={describe(scale)}."
            )
        if scale < self.floor_f32:
            floor = f"{self.min_scale!r}" if self.min_scale is not None else f"{self.floor_f32!r} (none set)"
            raise InvalidConfigError(
                f"scale={scale!r} is below min_scale={floor}, the lowest scale this config reaches."
            )
        if self.max_scale_f32 is not None and scale > self.max_scale_f32:
            raise InvalidConfigError(f"scale={scale!r} is above max_scale={self.max_scale!r}.")
        if self.ceiling_f32 is not None and scale > self.ceiling_f32:
            raise InvalidConfigError(
                f"scale={scale!r} is above {self.ceiling_f32!r}, the highest scale this backend holds: above it the "
                "float32 reciprocal that unscales the gradients is subnormal, which XLA on CPU flushes to 0. Lower "
                f"the saved scale to at most {self.ceiling_f32!r} (e.g. saved['scale'] = {self.ceiling_f32!r})."
            )
        if not 0 <= state.growth_tracker < self.growth_interval:
            raise InvalidConfigError(
                f"The growth tracker must be in [0, growth_interval={self.growth_interval}). "
                f"Received: {state.growth_tracker!r}."
            )
        if not 1 <= state.hysteresis_left <= self.hysteresis:
            raise InvalidConfigError(
                f"hysteresis_left must be in [1, hysteresis={self.hysteresis}]. Received: {state.hysteresis_left!r}."
            )


def settings_doc(indent: int = 8) -> str:
    """The settings as an ``Args:`` block (name, default and meaning), for the docstrings that list them."""
    defaults = LossScaleConfig.defaults()
    shown = {"init_scale": "2**16"}
    lines = []
    for name, doc in SETTING_DOCS.items():
        default = shown.get(name, repr(defaults[name]))
        lines.append(f"{' ' * indent}{name}: {doc} Default: {default}.")
    return "\n".join(lines)


assert tuple(SETTING_DOCS) == LossScaleConfig.setting_names() == tuple(LossScaleSettings.__annotations__), (
    "every setting is a LossScaleConfig field, a LossScaleSettings key and a SETTING_DOCS line, in one order"
)
LossScaleConfig.__doc__ = (LossScaleConfig.__doc__ or "").replace("{settings}", settings_doc())


def _overflows(pattern: OverflowPattern) -> list[bool]:
    if isinstance(pattern, str):
        flags = []
        for char in pattern.upper():
            if char not in "FO":
                raise InvalidConfigError(
                    f"An overflow pattern string holds only 'F' (finite) and 'O' (overflow). Received: {pattern!r}."
                )
            flags.append(char == "O")
        return flags
    wrong = PolyampTypeError(
        f"An overflow pattern is a string of 'F'/'O' or an iterable of bools. Received: {describe(pattern)}."
    )
    if not isinstance(pattern, Iterable):
        raise wrong
    try:
        items = iter(pattern)
    except TypeError:  # iterable by type but not by value: a 0-d array
        raise wrong from None
    flags = []
    for flag in items:
        # bools, or scalars of a boolean dtype (numpy's np.True_, a 0-d array); 2.0 or "x" is a mistake, not an
        # overflow, and an array of several flags is one item too many (its truth value is ambiguous)
        is_scalar_bool = (
            getattr(getattr(flag, "dtype", None), "kind", None) == "b" and getattr(flag, "shape", None) == ()
        )
        if not (isinstance(flag, bool) or is_scalar_bool):
            raise PolyampTypeError(
                "An overflow pattern holds bools (True = a non-finite gradient was found). "
                f"Received an item {describe(flag)} in {describe(pattern)}."
            )
        flags.append(bool(flag))
    return flags
