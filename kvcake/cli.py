"""`kvcake` command line: one subcommand family per subpackage.

Each module listed in `_COMMAND_MODULES` exposes `register(subparsers)`, which adds its
subcommands and sets `func(args) -> int` on each. User errors (ValueError, FileNotFoundError)
end the process with exit status 2 and one line on stderr that says what to change.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

_COMMAND_MODULES = (
    "kvcake.engine.cli",  # generate
    "kvcake.sim.cli",  # simulate, reproduce, trace
    "kvcake.store.cli",  # store master | node
    "kvcake.server.cli",  # serve, worker, profile
    "kvcake.server.cluster_cli",
    "kvcake.bench.cli",  # bench
)


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors are one line on stderr (what to change) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="kvcake",
        description="KVCache-centric disaggregated LLM serving (MOONCAKE in Python)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND",
                                       parser_class=_OneLineParser)
    subparsers.required = True
    for name in _COMMAND_MODULES:
        if importlib.util.find_spec(name) is None:  # subpackage not built yet
            continue
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvcake {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
