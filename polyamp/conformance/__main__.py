"""Run polyamp's conformance suite: ``python -m polyamp.conformance --backend torch --device cuda``."""

from __future__ import annotations

import argparse
import sys

from polyamp.conformance._runner import format_table, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m polyamp.conformance",
        description="Check that polyamp backends implement polyamp's mixed-precision semantics. "
        "Prints one row per case and exits non-zero if any case fails.",
    )
    parser.add_argument(
        "--backend",
        action="append",
        help="backend to check (repeatable); default: every backend with a harness",
    )
    parser.add_argument(
        "--device",
        action="append",
        help="device type to check (repeatable); default: every device each harness declares",
    )
    parser.add_argument("-k", "--keyword", help="only cases whose id contains this text")
    parser.add_argument("--verbose", action="store_true", help="print each case as it finishes")
    args = parser.parse_args(argv)

    def progress(result: object) -> None:
        if args.verbose:
            print(result, flush=True)

    results = run(args.backend, args.device, keyword=args.keyword, on_result=progress)
    print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
