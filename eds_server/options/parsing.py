"""The command line's machinery, shared by every area's options: value types (addresses,
durations, counts), the EDS_ variable behind each flag and the help text that shows it, and the
parser that names where a bad value came from. The standard library only: `--help` stays quick.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn


def host_port(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or `:PORT` (all interfaces)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:18000, [::1]:18000, :18000)")
    if not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: port {port} is out of range (0-65535)")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host or "0.0.0.0", int(port))


def optional_address(value: str) -> tuple[str, int] | None:
    return None if value.lower() in ("", "off", "none") else host_port(value)


def optional_duration(value: str) -> float | None:
    return None if value.lower() in ("", "off", "none") else duration(value)


def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return int(value)


def duration(value: str) -> float:
    """A number with a unit, in seconds: `10s`, `500ms`, `2m`. A bare number is refused (is `10`
    seconds or milliseconds?), except `0`."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    for unit in ("ms", "s", "m"):
        if value.endswith(unit):
            number, scale = value[: -len(unit)], units[unit]
            break
    else:
        number, scale = value, 0.0
    try:
        seconds = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration (units: ms, s, m; e.g. 10s, 500ms)") from None
    if not scale and float(number) != 0:
        raise argparse.ArgumentTypeError(f"{value!r} has no unit: write {value}s or {value}ms (units: ms, s, m)")
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative")
    return seconds


BUILT_IN: dict[str, str | None] = {}  # environment variable -> built-in default, for the help text


def env(name: str, default: str | None) -> str | None:
    BUILT_IN[name] = default
    return os.environ.get(name, default)


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("", "0", "false", "no", "off")
BAD_BOOLEANS: dict[str, str] = {}  # variable -> value that is neither (`maybe`, `ture`): refused by `serve`


def flag(name: str) -> bool:
    """An on/off variable: 1, true, yes, on, or 0, false, no, off, empty (any case). Anything else
    is refused rather than read as off: `EDS_DOCKER=ture` must not start a server without Docker."""
    BUILT_IN[name] = "off"
    value = os.environ.get(name, "")
    if value.strip().lower() in TRUE_WORDS:
        return True
    if value.strip().lower() not in FALSE_WORDS:
        BAD_BOOLEANS[name] = value
    return False


# Read by eds-server without a flag of their own (the rest: each flag's EDS_ variable, in BUILT_IN).
OTHER_VARIABLES = ("EDS_ETCD_PASSWORD",)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each EDS_ variable that is none of ours but close to one (`EDS_UPSTREMS`):
    read as nothing, it would leave the server running without what the user meant to set."""
    known = [*BUILT_IN, *OTHER_VARIABLES]
    found = []
    for name in sorted(environ):
        if name.startswith("EDS_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            if close:
                found.append(f"{name} is not a variable eds-server reads (ignored): did you mean {close[0]}?")
    return found


def env_var(flag: str) -> str:
    """The environment variable of a flag: --max-names is EDS_MAX_NAMES."""
    return "EDS_" + flag.lstrip("-").upper().replace("-", "_")


class HelpFormatter(argparse.HelpFormatter):
    """Ends every option's help with its environment variable and built-in default, in one form:
    `[EDS_X] (default Y)`. The variable is EDS_ plus the flag's name; a help text may give its own
    `(default ...)` wording, and `[-]` for an option without a variable."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest in ("help", "version"):
            return text.replace(" [-]", "")
        env: str | None = env_var(action.option_strings[-1])
        if "[-]" in text or env not in BUILT_IN:
            env, text = None, text.replace("[-]", "")
        text = re.sub(r"\s*\[EDS_[A-Z_]+(=1)?\]", "", text)
        own = re.search(r"\s*\(default:? ([^)]*)\)", text)
        if own:
            default, text = own.group(1), text[: own.start()] + text[own.end() :]
        else:
            built_in = BUILT_IN.get(env) if env else action.default
            default = "none" if built_in is None else "off" if built_in is False else str(built_in)
        flag = "=1" if isinstance(action, argparse._StoreTrueAction) else ""
        variable = f" [{env}{flag}]" if env else ""
        return f"{text.strip()}{variable} (default {default.replace('%', '%%')})"


def ip(value: str) -> str:
    from .. import fields

    try:
        return fields.ip(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class StoreOnce(argparse._StoreAction):
    """A single-valued option given twice is refused: argparse keeps the last one silently, and
    `serve --upstreams a.yaml --upstreams b.yaml` would serve b alone."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given: dict[str, Any] = namespace.__dict__.setdefault("_given_once", {})
        if self.dest in given:
            flag = "/".join(self.option_strings) or self.dest
            hint = (
                ": serve reads one upstreams file; merge them into one (`eds-server check` takes several)"
                if flag == "--upstreams"
                else ": it takes one value"
            )
            both = f" ({given[self.dest]!r}, then {values!r})" if isinstance(values, str) else ""
            parser.error(f"{flag} given twice{both}{hint}")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    """Says when a bad value came from the environment, not the command line: argparse names only
    the flag, and `--debounce` is not what the user wrote in `EDS_DEBOUNCE=10`. Suggests the
    closest command for a misspelt one, and refuses a single-valued option given twice."""

    argv: Sequence[str] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # `--upstream` for `--upstreams` would be taken silently, and would change meaning the day
        # another flag with that prefix is added; subcommands' parsers are made by this class too
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)

    def error(self, message: str) -> NoReturn:
        found = re.match(r"argument (--[\w-]+)", message)
        if found and not any(a == found[1] or a.startswith(found[1] + "=") for a in Parser.argv):
            env = env_var(found[1])
            if env in os.environ:
                message += f" (from {env}={os.environ[env]!r})"
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = re.findall(r"'([^']*)'", choice[2]) or [c.strip() for c in choice[2].split(",")]
            close = difflib.get_close_matches(choice[1], options, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        super().error(message)

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """argparse's "unrecognized arguments", from this (sub)command's parser, so that the usage
        shown is the command's own, with the closest option for each misspelt one."""
        options = [o for a in self._actions for o in a.option_strings]
        hints = []
        for extra in extras:
            flag = extra.split("=", 1)[0]
            if flag.startswith("-") and flag not in options:
                close = difflib.get_close_matches(flag, options, n=1, cutoff=0.7)
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


class Refused(ValueError):
    """Options that cannot work together, or a file they name that cannot be used: `serve` logs the
    message as one line and exits with status 2, before anything starts."""


@dataclass(frozen=True)
class Option:
    """One `serve` flag, declared beside the settings it makes. Its variable is EDS_ plus its name
    (env_var); `default` is the built-in value as a user would write it; `kind`: a value, an on/off
    `switch` (EDS_X=1), or a repeatable `list` (the variable a comma list)."""

    flag: str
    help: str
    default: str | None = None
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: Sequence[str] | None = None
    kind: str = "value"

    def add_to(self, group: Any) -> None:
        """Declare it on a parser or argument group, its default read from the environment now."""
        name = env_var(self.flag)
        if self.kind == "switch":
            group.add_argument(self.flag, action="store_true", default=flag(name), help=self.help)
        elif self.kind == "list":
            values = [n.strip() for n in (env(name, "") or "").split(",") if n.strip()]
            group.add_argument(self.flag, metavar=self.metavar, action="append", default=values, help=self.help)
        else:
            extra: dict[str, Any] = {"choices": self.choices} if self.choices is not None else {}
            group.add_argument(
                self.flag,
                type=self.type,
                metavar=self.metavar,
                default=env(name, self.default),
                help=self.help,
                **extra,
            )


LOGGING = (
    Option("--log-level", "least severe level logged", "info", choices=["debug", "info", "warning", "error"]),
    Option("--log-format", "text, or one JSON object per line", "text", choices=["text", "json"]),
)
