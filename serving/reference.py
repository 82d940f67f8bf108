"""The reference pages' tables, made from what the code declares, so that they cannot
drift from it: every ``pxrt serve`` flag (from its parser), every key of its TOML file
(from the option classes: what each takes, its default, the sections it goes in and the
Triton spelling that maps onto it) and every metric family ``/metrics`` exposes (from the
collector itself, run on stand-in sources). The documentation site's build puts them in
``docs/reference/`` (``docs/hooks.py``); ``tests/test_docs.py`` holds them to the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any

from .config import SERVE_OPTIONS, add_arguments
from .options import BatchingOptions, DecoderLoad, Placement


def _cell(value: Any) -> str:
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return re.sub(r"\s+", " ", text).strip()


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """``rows`` as a Markdown table of ``columns`` (each row's values by column)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- flags


def serve_flags() -> list[dict]:
    """``pxrt serve``'s flags, in its ``--help`` order: the flag, what it takes, its
    default and its help."""
    parser = argparse.ArgumentParser(prog="pxrt serve")
    add_arguments(parser)
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(action.option_strings) or action.dest
        if action.nargs == 0:
            takes = "(a switch)"
        elif action.choices:
            takes = " \\| ".join(map(str, action.choices))
        else:
            takes = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
            if action.nargs in ("*", "+"):
                takes += " ..."
        default = action.default
        shown = "" if default in (None, argparse.SUPPRESS, False, []) else default
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append(
            {
                "flag": f"`{name}`",
                "takes": f"`{takes}`" if takes else "",
                "default": f"`{shown}`" if shown != "" else "",
                "what it does": help_text,
            }
        )
    return rows


# --------------------------------------------------------------------------- TOML


def _attributes(cls: type) -> dict[str, str]:
    """A class docstring's ``Attributes:`` entries, by name."""
    doc = cls.__doc__ or ""
    if "Attributes:" not in doc:
        return {}
    out: dict[str, str] = {}
    name = None
    for line in doc.split("Attributes:", 1)[1].splitlines():
        match = re.match(r"^\s{4,6}(\w+): (.*)$", line)
        if match:
            name = match.group(1)
            out[name] = match.group(2)
        elif name and line.strip():
            out[name] += " " + line.strip()
    return {k: v.replace("``", "`") for k, v in out.items()}


def _default(cls: type, key: str) -> Any:
    field = next(f for f in dataclasses.fields(cls) if f.name == key)
    return field.default


def toml_keys() -> list[dict]:
    """The keys of ``pxrt serve --config FILE``'s sections: each with what it takes (as
    its check says), its default, where it may go and the Triton key mapping onto it."""
    triton = {
        v: f"`dynamic_batching.{k}`" for k, v in BatchingOptions.TRITON_DYNAMIC_BATCHING.items()
    }
    triton["placement"] = "`instance_group` (`KIND_MODEL`: sharded; count 1: replicated)"
    batching = _attributes(BatchingOptions)
    rows = []
    for key in SERVE_OPTIONS:
        rows.append(
            {
                "key": f"`{key}`",
                "takes": BatchingOptions.expects(key),
                "default": f"`{_default(BatchingOptions, key)}`",
                "sections": "`[defaults]`, `[models.NAME]`",
                "Triton": triton.get(key, ""),
                "what it does": batching.get(key, ""),
            }
        )
    for cls, what in ((Placement, "placement"), (DecoderLoad, "decoder")):
        for key in cls.CHECKS:
            rows.append(
                {
                    "key": f"`{key}`",
                    "takes": cls.expects(key),
                    "default": "the artifact's or `pxrt.load`'s",
                    "sections": (
                        "`[defaults]`, `[models.NAME]`"
                        if cls is Placement
                        else "`[models.NAME]` (a decoder's)"
                    ),
                    "Triton": triton.get(key, ""),
                    "what it does": f"`pxrt.load(..., {key}=)`: the model's {what}",
                }
            )
    return rows


# --------------------------------------------------------------------------- metrics


class _Decoder:
    """A stand-in for a decoder and the response cache, for ``metric_families``."""

    counters = dict.fromkeys(
        ("tokens", "steps", "prefills", "chunks", "prompt_tokens", "prefix_hit_tokens"), 0
    )
    outcomes = {"stop": 0}
    slots = 1
    busy_slots = 0
    waiting = 0
    compiles_after_load = 0
    load_s = 0.0
    evictions = 0
    bytes = 0

    def __len__(self) -> int:
        return 0

    def drain_timings(self) -> dict:
        return {}


class _Model:
    """A stand-in for a model served as two instances with the response cache."""

    def outcomes(self) -> dict[str, int]:
        return {"ok": 0}

    def queued_rows(self) -> int:
        return 0

    def cache_counts(self) -> dict[str, float]:
        return {"hits": 0, "misses": 0}

    def compiles(self) -> int:
        return 0

    def load_phases(self) -> dict[str, float]:
        return {"total": 0.0}

    def instance_batches(self) -> list[int]:
        return [0, 0]

    def drain_timings(self) -> None:
        return None


def metric_families() -> list[dict]:
    """Every family ``/metrics`` exposes: its name as scraped, type, help and labels."""
    from .engine.metrics import Metrics

    decoder = _Decoder()
    metrics = Metrics(cache=decoder)
    metrics.add_model("m", _Model(), "1")
    metrics.add_decoder("d", decoder, "1")
    rows = []
    for family in metrics.registry.collect():
        labels: set[str] = set()
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
        suffix = "_total" if family.type == "counter" else ""
        rows.append(
            {
                "metric": f"`{family.name}{suffix}`",
                "type": family.type,
                "labels": ", ".join(f"`{x}`" for x in sorted(labels)),
                "help": family.documentation,
            }
        )
    return rows


def names(rows: Iterable[dict], column: str) -> list[str]:
    """A table's ``column`` without its backticks."""
    return [row[column].strip("`") for row in rows]
