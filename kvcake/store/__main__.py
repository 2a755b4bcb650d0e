"""`python -m kvcake.store master|node ...`: the `kvcake store` command without loading the other
subcommands (and their heavy imports, e.g. torch), for fast-starting store processes."""

from __future__ import annotations

import argparse
import sys

from kvcake.store.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcake")
    subparsers = parser.add_subparsers(dest="command")
    register(subparsers)
    args = parser.parse_args(["store", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvcake store: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
