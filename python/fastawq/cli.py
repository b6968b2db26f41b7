"""`fastawq` command line: quantize | generate | ppl | demo | bench | env."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Each is a module fastawq.commands.<name> with add_parser(subparsers) that sets func=<callable(args) -> int>.
COMMANDS = ("demo", "quantize", "generate", "ppl", "bench", "env")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastawq", description="4-bit AWQ quantization and fast W4A16 inference")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"fastawq.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"fastawq.commands.{name}":
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if argv is not None:  # called from Python: errors stay exceptions
        return int(args.func(args) or 0)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("fastawq: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        if args.verbose:
            raise
        # On the command line a user error is one line naming what is wrong; -v shows the traceback.
        print(f"fastawq {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
