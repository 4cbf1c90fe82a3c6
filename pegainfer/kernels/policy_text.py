"""A ``LaunchPolicy`` written as text: ``FIELD=VALUE[,FIELD=VALUE...]``, the form of the command line's
``--launch-policy`` and of ``benchmarks/ab_policy.py``'s variants (one parser for both).

Values by field: ``pdl`` -- ``none`` (no launch overlaps), ``all`` (every launch that follows the PDL contract),
``default``, launch names joined by ``+``, or ``default`` / ``none`` followed by ``+NAME`` / ``-NAME`` changes;
``tuning`` -- a tuning file's path, or ``none``; every other field a boolean (``true``/``false``, ``on``/``off``,
``yes``/``no``, ``1``/``0``).
"""
from __future__ import annotations

import dataclasses
import re

from pegainfer.errors import PegainferError

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


class PolicyTextError(PegainferError, ValueError):
    """Text that does not parse as policy fields (the message is one line, naming the problem)."""


def _parse_bool(text: str) -> bool:
    if text.lower() in TRUE:
        return True
    if text.lower() in FALSE:
        return False
    raise PolicyTextError(f"{text!r} is not true or false")


def _parse_pdl(text: str):
    """``none`` → no launch overlaps (an empty set); ``all`` → every launch that follows the PDL contract (None);
    ``default`` → ``PDL_DEFAULT``; names joined by ``+``, or ``default`` / ``none`` followed by ``+NAME`` /
    ``-NAME`` changes."""
    from pegainfer.kernels.policy import PDL_DEFAULT
    if text == "all":
        return None
    parts = re.split(r"([+-])", text)
    head, rest = parts[0], parts[1:]
    names = {"none": set(), "default": set(PDL_DEFAULT)}.get(head)
    if names is None:
        if not NAME.match(head):
            raise PolicyTextError(f"{text!r}: expected none, all, default or launch names joined by +")
        names = {head}
    for sign, name in zip(rest[::2], rest[1::2]):
        if not NAME.match(name):
            raise PolicyTextError(f"{text!r}: {name!r} is not a launch name")
        (names.add if sign == "+" else names.discard)(name)
    return frozenset(names)


def _parse_tuning(text: str):
    if text == "none":
        return ()
    from pegainfer.kernels.policy import load_tuning
    try:
        return load_tuning(text)
    except PegainferError as e:
        raise PolicyTextError(str(e)) from None


PARSERS = {"pdl": _parse_pdl, "tuning": _parse_tuning}
"""Value parsers of the policy fields that are not plain booleans."""


def policy_fields() -> dict:
    """``{name: dataclasses.Field}`` of ``LaunchPolicy``."""
    from pegainfer.kernels.policy import LaunchPolicy
    return {f.name: f for f in dataclasses.fields(LaunchPolicy)}


def parse_fields(text: str) -> dict:
    """``FIELD=VALUE[,FIELD=VALUE...]`` → ``{field: value}`` of ``LaunchPolicy`` field values; raises
    ``PolicyTextError``."""
    known = policy_fields()
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise PolicyTextError(f"{item!r}: expected FIELD=VALUE")
        if name not in known:
            raise PolicyTextError(f"LaunchPolicy has no field {name!r} (its fields: {', '.join(known)})")
        parse = PARSERS.get(name)
        if parse is None:
            if known[name].type not in ("bool", bool):
                raise PolicyTextError(f"field {name!r} cannot be set from the command line")
            parse = _parse_bool
        try:
            out[name] = parse(value.strip())
        except PolicyTextError as e:
            raise PolicyTextError(f"{name}: {e}") from None
    return out


def policy_with(base, fields: dict):
    """``base`` with ``fields`` replaced: a new frozen ``LaunchPolicy``."""
    return dataclasses.replace(base, **fields)
