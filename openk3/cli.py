"""`openk3 serve | generate | plan | bench | train | train-mtp | train-eagle3 | distill | sandbox | quantize | rollout`: one entry point,
each sub-command owned by its package.

A package contributes a sub-command through `register(subparsers)` in its own `cli.py`; importing it here (lazily, inside
`build_parser`) keeps `openk3 plan` and `openk3 sandbox` free of torch imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command modules, in the order `openk3 --help` lists them; a module that is not installed yet is skipped
COMMAND_MODULES = (
    "openk3.llm_cli",
    "openk3.launch.cli",
    "openk3.api.cli",
    "openk3.planner.cli",
    "openk3.train.cli",
    "openk3.train.distill_cli",
    "openk3.train.mtp_cli",
    "openk3.train.eagle3_cli",
    "openk3.sandbox.cli",
    "openk3.model.cli",
    "openk3.rl.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openk3", description="openk3: the Kimi K3 system, runnable")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
