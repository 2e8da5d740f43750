"""`fairserve`: one command for the whole stack and each service.

    fairserve run [flags]                the stack on this machine (as `make run`)
    fairserve gateway|scheduler|worker|kvcache [flags]   one service (compose, Kubernetes)
    fairserve config [SERVICE] [flags]   the effective settings, secrets masked
    fairserve version

Every setting is a flag and an environment variable (flags.py); `--config FILE` reads the same
settings from YAML. A bad value stops the command with an error naming the setting.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from common.settings.env import SettingsError
from fairserve.cli import schemas as registry
from fairserve.cli.flags import add_setting_flags, config_file_values, flag_of, layered, variables_of
from common.version import package_version

EPILOG = ("Precedence: flags, then environment variables, then --config, then defaults. "
          "Every setting is documented in docs/config.md.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairserve", description="Fair, observable, cache-aware LLM serving.", epilog=EPILOG)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in ("run", *registry.SERVICES):
        sub = commands.add_parser(command, help=registry.SUMMARIES[command],
                                  usage=f"fairserve {command} [--config FILE] [--SETTING VALUE ...]",
                                  description=registry.SUMMARIES[command], epilog=EPILOG)
        _add_config_option(sub)
        add_setting_flags(sub, registry.schemas_for(command))
    config = commands.add_parser("config", help="print the effective settings (secrets masked)",
                                 usage="fairserve config [SERVICE] [--config FILE] [--SETTING VALUE ...]",
                                 description="The settings each service would start with, as "
                                 "VARIABLE=value lines; secrets masked.", epilog=EPILOG)
    config.add_argument("service", nargs="?", choices=[*registry.SERVICES, "run"],
                        help="one service (default: every service and the launcher)")
    _add_config_option(config)
    add_setting_flags(config, registry.schemas_for("run"))
    commands.add_parser("version", help="print the version")
    return parser


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML file of settings (variable or flag "
                        "names as keys), under the environment and the flags")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        print(f"fairserve {package_version()}")
        return 0
    command = "run" if args.command == "config" and args.service is None else (
        args.service if args.command == "config" else args.command)
    schemas = registry.schemas_for(command)
    known = variables_of(registry.schemas_for("run") if args.command == "config" else schemas)
    flags = {variable: getattr(args, variable, None) for variable in known}
    try:
        file_values = config_file_values(args.config, known) if args.config else {}
        env = layered(flags, os.environ, file_values)
        checked = [schema.read(env) for schema in schemas]
    except SettingsError as error:
        parser.exit(2, f"fairserve {args.command}: invalid setting: {_with_flag(str(error))}\n")
    if args.command == "config":
        _print_config(checked)
        return 0
    os.environ.update(env)
    result = registry.entry_point(command)()
    return result if isinstance(result, int) else 0


def _with_flag(message: str) -> str:
    """`KV_CACHE_NUM_BLOCKS='x' is invalid: ...` -> the same, naming the flag too."""
    variable = message.split("=", 1)[0]
    if variable.isupper() and variable.replace("_", "").isalnum():
        return f"{message} (flag {flag_of(variable)})"
    return message


def _print_config(checked: list) -> None:
    for values in checked:
        print(f"# {values.service}")
        for variable, value in values.effective().items():
            shown = str(value).lower() if isinstance(value, bool) else value
            print(f"{variable}={shown}")
        print()


if __name__ == "__main__":
    sys.exit(main())
