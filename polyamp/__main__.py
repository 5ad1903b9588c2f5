"""``python -m polyamp <command>``: ``doctor`` (this machine, the recommended policy, checkpoint hazards) and
``conformance`` (the same as ``python -m polyamp.conformance``)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m polyamp <command> [options]

commands:
  doctor       frameworks, devices and the recommended policy for this machine; --check PATH for hazards
  conformance  the conformance suite (the same as python -m polyamp.conformance)

python -m polyamp <command> --help describes a command's options."""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand; exit status 2 for an unknown or missing one."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "doctor":
        from polyamp._src.doctor_cli import main as doctor

        return doctor(rest)
    if command == "conformance":
        from polyamp.conformance.__main__ import main as conformance

        return conformance(rest)
    print(f"{USAGE}\n\npython -m polyamp: unknown command {command!r}; choose doctor or conformance.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
