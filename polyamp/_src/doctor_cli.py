"""The ``python -m polyamp doctor`` command line: report, ``--json``, ``--framework``, ``--check``/``--policy``."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from polyamp._src.checkpoints import DEFAULT_MAX_BYTES, MAX_CONFIG_BYTES
from polyamp._src.doctor import FRAMEWORKS, diagnose
from polyamp._src.doctor_fp8 import float8_conversions
from polyamp._src.errors import CheckpointError, PolyampError
from polyamp._src.hazards import find_hazards, read_tensors
from polyamp._src.policy import Policy
from polyamp._src.training_state import state_bytes_table

__all__ = ["main"]

EXIT_OK = 0
EXIT_HAZARD = 1
EXIT_USAGE = 2

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
}
_BYTE_COUNT = re.compile(r"\s*(\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def _byte_count(text: str) -> int:
    """``--max-bytes`` as a number of bytes: an integer, optionally with a binary unit (``64GiB``, ``512M``)."""
    match = _BYTE_COUNT.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of bytes, optionally with a unit K/KiB, M/MiB, G/GiB or T/TiB "
            f"(powers of 1024), such as 68719476736 or 64GiB; received {text!r}"
        )
    return int(match.group(1)) * _UNITS[unit]


_COUNT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmbt]?)\s*", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def _parameter_count(text: str) -> int:
    """``--parameters`` as a count: an integer, or a decimal with K, M, B or T (powers of 1000): 125M, 7B, 1.5B."""
    match = _COUNT.fullmatch(text)
    count = round(float(match.group(1)) * _SCALE[match.group(2).lower()]) if match else 0
    if count <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of parameters, optionally with K, M, B or T (powers of 1000), such as "
            f"124000000, 125M or 1.5B; received {text!r}"
        )
    return count


def _format_state(rows: list[dict[str, Any]], parameters: int | None, slots: int) -> str:
    lines = [
        f"Training state per parameter (an optimizer with {slots} slot{'' if slots == 1 else 's'} per parameter, "
        f"AdamW: 2; polyamp.state_bytes)",
        f"  {'policy':<24} weights  grads  master  slots  compensation  bytes" + ("  total" if parameters else ""),
    ]
    for row in rows:
        total = f"  {row['total'] / 2**30:.2f} GiB" if parameters else ""
        lines.append(
            f"  {row['policy']:<24} {row['weights']:>7}  {row['gradients']:>5}  {row['master']:>6}  {row['state']:>5}"
            f"  {row['compensation']:>12}  {row['per_parameter']:>5}{total}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m polyamp doctor",
        description="Report Python, polyamp, the installed frameworks and their devices, and the precision policy "
        "recommended for this machine (what polyamp.Policy('auto') resolves to). With --check, look for tensors "
        "of a checkpoint that a policy would hurt. Exit status: 0 no hazard, 1 hazards found by --check, "
        "2 usage error or a checkpoint that could not be read (corrupt, truncated, or declaring more than "
        "--max-bytes).",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object with stable keys")
    parser.add_argument(
        "--framework",
        action="append",
        choices=FRAMEWORKS,
        help="import and probe only this framework for devices (repeatable); default: every installed one",
    )
    parser.add_argument(
        "--check",
        metavar="PATH",
        help="checkpoint to check for hazards (.pt/.pth/.bin/.ckpt, .safetensors, .keras, .weights.h5, .npz, or an "
        "orbax checkpoint directory)",
    )
    parser.add_argument(
        "--policy",
        help="policy to check --check against: a name, 'auto' or a spec (default: mixed_float16)",
    )
    parser.add_argument(
        "--parameters",
        type=_parameter_count,
        metavar="N",
        help="also give the training state's total size for a model of N parameters (125M, 7B) under each plan",
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=2,
        choices=range(0, 9),
        metavar="K",
        help="floating optimizer slots per parameter for the training-state table (AdamW: 2, the default; SGD with "
        "momentum: 1)",
    )
    parser.add_argument(
        "--max-bytes",
        type=_byte_count,
        metavar="N",
        help=f"refuse a --check file whose tensors declare more than N bytes in all (a .keras archive: its "
        f"members uncompressed); N may end in K, M, G or T (powers of 1024). Default: 64GiB. A .keras "
        f"config.json may inflate to at most {MAX_CONFIG_BYTES // 2**20} MiB",
    )
    return parser


def _check(path: str, resolved: Policy, max_bytes: int) -> dict[str, Any]:
    tensors = read_tensors(path, max_bytes=max_bytes)
    hazards = find_hazards(tensors, resolved)
    return {
        "path": path,
        "policy": resolved.name,
        "tensors": len(tensors),
        "floating": sum(1 for t in tensors if t.max_abs is not None),
        "hazards": [h.to_dict() for h in hazards],
        "float8": float8_conversions([t.name for t in tensors], resolved),
    }


def _format_check(check: dict[str, Any]) -> str:
    hazards = check["hazards"]
    lines = [
        f"Check {check['path']} under {check['policy']!r}: {check['tensors']} tensors "
        f"({check['floating']} floating), {len(hazards)} hazard{'' if len(hazards) == 1 else 's'}"
    ]
    lines.extend(f"  {h['severity']}: [{h['kind']}] {h['message']}" for h in hazards)
    if not hazards:
        lines.append("  no hazard found")
    lines.extend(f"  FP8: {line}" for line in check["float8"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the doctor; returns the exit status (0 no hazard, 1 hazards found, 2 usage or read error)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for a usage error
        return int(exc.code or 0)
    for given, option in ((args.policy, "--policy"), (args.max_bytes, "--max-bytes")):
        if given is not None and args.check is None:
            parser.print_usage(sys.stderr)
            print(f"python -m polyamp doctor: {option} needs --check PATH.", file=sys.stderr)
            return EXIT_USAGE
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up logs would bury the report
    policy = None
    if args.check is not None:
        try:  # a bad policy is a usage error before anything is imported
            policy = Policy(args.policy or "mixed_float16")
        except PolyampError as exc:
            print(f"python -m polyamp doctor: --policy: {exc}", file=sys.stderr)
            return EXIT_USAGE
    # Probe first: it imports torch before TensorFlow, which a Keras checkpoint could import.
    report = diagnose(args.framework)
    check = None
    if args.check is not None and policy is not None:
        try:
            check = _check(args.check, policy, args.max_bytes or DEFAULT_MAX_BYTES)
        except CheckpointError as exc:  # its message names the file
            print(f"python -m polyamp doctor: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except (PolyampError, OSError) as exc:
            print(f"python -m polyamp doctor: cannot check {args.check!r}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    state = state_bytes_table(args.parameters, slots=args.slots)
    if args.json:
        out = report.to_dict()
        out["check"] = check
        out["training_state"] = state
        print(json.dumps(out, indent=2, allow_nan=False))
    else:
        print(report.format())
        print(_format_state(state, args.parameters, args.slots))
        if check is not None:
            print(_format_check(check))
    found = check is not None and bool(check["hazards"])
    return EXIT_HAZARD if found else EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
