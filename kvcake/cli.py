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

# command -> the module that registers it. Only the module of the command being run is
# imported (the engine's pulls in torch, the server's uvicorn), so `kvcake store` starts fast.
_COMMANDS = {
    "generate": "kvcake.engine.cli",
    "simulate": "kvcake.sim.cli",
    "reproduce": "kvcake.sim.cli",
    "trace": "kvcake.sim.cli",
    "store": "kvcake.store.cli",
    "serve": "kvcake.server.cli.serve",
    "worker": "kvcake.server.cli.worker",
    "profile": "kvcake.server.cli.worker",
    "bench": "kvcake.bench.cli",
}


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors are one line on stderr (what to change) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (given a known `command`) one that holds only that command's module."""
    parser = _OneLineParser(
        prog="kvcake",
        description="KVCache-centric disaggregated LLM serving (MOONCAKE in Python)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND",
                                       parser_class=_OneLineParser)
    subparsers.required = True
    modules = [_COMMANDS[command]] if command in _COMMANDS else list(dict.fromkeys(_COMMANDS.values()))
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
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
