"""The options of serving, each declared and checked once.

``BatchingOptions`` (per model: how its requests are batched and queued) and
``HttpLimits`` (per HTTP server: what clients may hold) are frozen dataclasses whose
values are checked when one is made, so a bad value stops whoever made it with a message
naming the option, what it takes and what came. Every front end derives from them: the
keyword arguments of ``Server.add_model``, ``pxrt serve``'s flags and TOML sections, the
model repository's per-model options, Ray's deployments and ``BlockingServer``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pxrt.contracts import PLACEMENTS


class OptionError(ValueError):
    """An option with a value it does not take (or an option that does not exist)."""


# --------------------------------------------------------------------------- checks


def number(kind: type, low: float, inclusive: bool = True, none: bool = False):
    """A check for a number of ``kind`` (int or float) >= ``low`` (or > ``low``; or None
    with ``none``): returns the value converted, or raises ``OptionError`` saying what it
    takes."""
    what = "an integer" if kind is int else "a number"
    text = f"{what} {'>=' if inclusive else '>'} {low:g}" + (" (or none)" if none else "")

    def check(value: Any) -> Any:
        if value is None and none:
            return None
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise OptionError(text)
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise OptionError(text) from None
        if math.isnan(number) or not (number >= low if inclusive else number > low):
            raise OptionError(text)
        return number

    check.expects = text  # type: ignore[attr-defined]
    check.kind = kind  # type: ignore[attr-defined]  # (what ``strict`` holds a value to)
    return check


def strict(check: Any, value: Any) -> None:
    """Refuse a value of the wrong type for ``check`` as a TOML file (or JSON) gives it,
    where the checks themselves convert (``pxrt serve``'s flags are strings): a number
    option takes a number, not ``"8"``; an integer option an integer, a float option an
    integer or a float; neither a bool. (The other checks take only their own types.)"""
    kind = getattr(check, "kind", None)
    if kind is None or value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        try:
            quoted = isinstance(value, str) and kind(value) is not None
        except ValueError:
            quoted = False  # (not a number at all: said as for any other value)
        if quoted:
            raise OptionError(
                f"{value!r} is a string, not {check.expects}: write the number without quotes"
            )
        raise OptionError(f"{value!r} is not {check.expects}")


def choice(*choices: str, none: bool = False):
    text = "one of " + ", ".join(choices) + (" (or none)" if none else "")

    def check(value: Any) -> str | None:
        if value is None and none:
            return None
        if value not in choices:
            raise OptionError(text)
        return value

    check.expects = text  # type: ignore[attr-defined]
    return check


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError("true or false")
    return value


_flag.expects = "true or false"  # type: ignore[attr-defined]


def _cache_flag(value: Any) -> bool:
    """true or false, or Triton's ``{enable = true}``."""
    if isinstance(value, Mapping) and set(value) == {"enable"}:
        value = value["enable"]
    if not isinstance(value, bool):
        raise OptionError(_cache_flag.expects)  # type: ignore[attr-defined]
    return value


_cache_flag.expects = "true or false (or Triton's {enable = true})"  # type: ignore[attr-defined]


def sizes(low: int):
    """A check for a list of integers >= ``low`` (a TOML array; or None): a tuple."""
    text = f"a list of integers >= {low}"

    def check(value: Any) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value
        ):
            raise OptionError(text)
        return tuple(value)

    check.expects = text  # type: ignore[attr-defined]
    return check


def _tiers(value: Any) -> str | None:
    """A decoder's ``length_tiers``: slots x positions per tier, as ``pxrt.load`` takes
    them (checked against the artifact there)."""
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"auto|off|\d+x\d+(\+\d+x\d+)*", value):
        raise OptionError(_tiers.expects)  # type: ignore[attr-defined]
    return value


_tiers.expects = "slots x positions per tier, e.g. '20x128+10x256+2x512', 'auto' or 'off'"  # type: ignore[attr-defined]


def _maybe_flag(value: Any) -> bool | None:
    return None if value is None else _flag(value)


_maybe_flag.expects = "true or false"  # type: ignore[attr-defined]


def _checked(check: Any, value: Any) -> Any:
    try:
        return check(value)
    except OptionError as exc:
        raise OptionError(f"{value!r} is not {exc}") from None


class _Checked:
    """Checks each field's value through ``CHECKS`` when an instance is made."""

    CHECKS: ClassVar[dict[str, Any]] = {}

    def __post_init__(self) -> None:
        for key, check in self.CHECKS.items():
            try:
                value = _checked(check, getattr(self, key))
            except OptionError as exc:
                raise OptionError(f"option {key}: {exc}") from None
            object.__setattr__(self, key, value)

    @classmethod
    def check(cls, key: str, value: Any, *, typed: bool = False) -> Any:
        """One option's value, checked (and converted: ``"8"`` -> 8 for an int); an
        ``OptionError`` says ``'<value>' is not <what it takes>``. ``typed``: a value
        from a typed file (TOML), converted from no other type (``strict``)."""
        if key not in cls.CHECKS:
            raise OptionError(f"unknown option {key!r}; known: {', '.join(cls.CHECKS)}")
        if typed:
            strict(cls.CHECKS[key], value)
        return _checked(cls.CHECKS[key], value)

    @classmethod
    def expects(cls, key: str) -> str:
        """What option ``key`` takes, in words."""
        return cls.CHECKS[key].expects

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], base: Self | None = None) -> Self:
        """``base`` (default: the defaults) with ``values`` (option -> value) over it;
        an unknown option is an ``OptionError`` listing the known ones."""
        unknown = sorted(set(values) - set(cls.CHECKS))
        if unknown:
            raise OptionError(f"unknown option(s) {unknown}; known: {', '.join(cls.CHECKS)}")
        return (base if base is not None else cls()).replace(**values)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (checked)."""
        # The subclasses are dataclasses; this base is not.
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


# --------------------------------------------------------------------------- batching

CELL_POLICIES = ("cost", "oldest")


@dataclasses.dataclass(frozen=True)
class BatchingOptions(_Checked):
    """How one model's requests are batched and queued.

    Attributes:
      max_batch_size: the most rows in one batch (None: the largest compiled bucket,
        which also caps it); that many rows waiting close a batch at once.
      max_delay_us: an extra wait for fuller batches: how long the oldest queued request
        may wait for ``max_batch_size`` rows when nothing is in flight. 0 (the default):
        a request goes at once when the pipeline is idle; under load, batches grow by
        themselves while the device is busy.
      max_queue: queued rows beyond which requests are rejected with ``Overloaded``.
      default_timeout_s: deadline of a request that brings none (None: no deadline).
      max_inflight: batches in flight at once: one executes while the next (a full one)
        is assembled and dispatched.
      copy: hand out owned, writeable outputs instead of read-only views.
      cell_policy: for models with named dimensions, how the next cell is chosen:
        ``"cost"`` (from the execution times measured at load: which lane goes and which
        shorter requests ride along in it) or ``"oldest"`` (the oldest request's lane,
        alone).
      priority_levels: Triton's request priorities: a request's ``priority`` parameter
        names a level from 1 (the highest: taken first) to this (1: none, every request
        alike).
      default_priority_level: the level of a request that names none (0: the lowest).
      priority_wait_ms: a request of any level that has waited this long goes before
        the higher levels (oldest first), so a low level never starves.
      response_cache: keep its answers in the server's response cache, so a request
        equal to one answered before (the same tensors) is answered from there, not
        executed: for deterministic models (Triton's ``response_cache {enable: true}``,
        which is taken too).
    """

    max_batch_size: int | None = None
    max_delay_us: float = 0.0
    max_queue: int = 4096
    default_timeout_s: float | None = None
    max_inflight: int = 2
    copy: bool = False
    cell_policy: str = "cost"
    priority_levels: int = 1
    default_priority_level: int = 0
    priority_wait_ms: float = 100.0
    response_cache: bool = False

    CHECKS: ClassVar[dict[str, Any]] = {
        "max_batch_size": number(int, 1, none=True),
        "max_delay_us": number(float, 0),
        "max_queue": number(int, 1),
        "default_timeout_s": number(float, 0, inclusive=False, none=True),
        "max_inflight": number(int, 1),
        "copy": _flag,
        "cell_policy": choice(*CELL_POLICIES),
        "priority_levels": number(int, 1),
        "default_priority_level": number(int, 0),
        "priority_wait_ms": number(float, 0, inclusive=False),
        "response_cache": _cache_flag,
    }

    # Triton's dynamic_batching keys that map onto these options.
    TRITON_DYNAMIC_BATCHING: ClassVar[dict[str, str]] = {
        "priority_levels": "priority_levels",
        "default_priority_level": "default_priority_level",
        "max_queue_delay_microseconds": "max_delay_us",
    }

    @classmethod
    def from_dynamic_batching(cls, table: Any, *, typed: bool = False) -> dict[str, Any]:
        """Triton's ``dynamic_batching`` (``{priority_levels = 2, ...}``) as these
        options' values, each checked (``typed``: as ``check``'s); a key that does not
        map is refused, naming those that do."""
        if not isinstance(table, Mapping):
            raise OptionError(f"dynamic_batching takes a table of Triton's keys, got {table!r}")
        mapped = cls.TRITON_DYNAMIC_BATCHING
        unknown = sorted(set(table) - set(mapped))
        if unknown:
            raise OptionError(f"dynamic_batching: pxrt maps {', '.join(mapped)}, not {unknown}")
        return {mapped[k]: cls.check(mapped[k], v, typed=typed) for k, v in table.items()}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.default_priority_level > self.priority_levels:
            raise OptionError(
                f"option default_priority_level: {self.default_priority_level} is not a level "
                f"of priority_levels {self.priority_levels} (1 to it, or 0 for the lowest)"
            )


# Triton's instance_group kinds: accepted; the devices pxrt.load is given decide.
_TRITON_KINDS = ("KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL")


@dataclasses.dataclass(frozen=True)
class DecoderLoad(_Checked):
    """How a decoder is loaded (``pxrt.load``'s options of the same names, a TOML
    ``[models.NAME]`` section's keys): its slots and cache length, the prefill and
    chunk cells compiled, the prefix cache, the steps over fewer slots, speculative
    decoding, whether the sampling controls' programs are built, the time a turn of
    its loop may spend prefilling beside its step (``itl_bound_ms``) and whether
    prefills run on a thread of their own beside the steps (``overlap_prefill``), and
    the most decode steps one program runs (``multi_step``), and the cache's length
    tiers (``length_tiers``: given, ``"auto"`` or ``"off"``).
    None: the artifact's or ``pxrt.load``'s default."""

    slots: int | None = None
    max_length: int | None = None
    prefill_lengths: tuple[int, ...] | None = None
    prefill_batches: tuple[int, ...] | None = None
    chunk_lengths: tuple[int, ...] | None = None
    chunk_batches: tuple[int, ...] | None = None
    chunk_tokens: int | None = None
    prefix_cache_tokens: int | None = None
    prefix_block: int | None = None
    step_slots: tuple[int, ...] | None = None
    step_lengths: tuple[int, ...] | None = None
    speculative_tokens: int | None = None
    sampling_controls: bool | None = None
    itl_bound_ms: float | None = None
    overlap_prefill: bool | None = None
    multi_step: int | None = None
    length_tiers: str | None = None

    CHECKS: ClassVar[dict[str, Any]] = {
        "slots": number(int, 1, none=True),
        "max_length": number(int, 2, none=True),
        "prefill_lengths": sizes(1),
        "prefill_batches": sizes(1),
        "chunk_lengths": sizes(1),
        "chunk_batches": sizes(1),
        "chunk_tokens": number(int, 1, none=True),
        "prefix_cache_tokens": number(int, 0, none=True),
        "prefix_block": number(int, 1, none=True),
        "step_slots": sizes(1),
        "step_lengths": sizes(1),
        "speculative_tokens": number(int, 0, none=True),
        "sampling_controls": _maybe_flag,
        "itl_bound_ms": number(float, 0, inclusive=False, none=True),
        "overlap_prefill": _maybe_flag,
        "multi_step": number(int, 1, none=True),
        "length_tiers": _tiers,
    }

    def load_options(self) -> dict[str, Any]:
        """Keyword arguments of ``pxrt.load``: the ones set."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Placement(_Checked):
    """How one model is laid out on the devices (``pxrt.load``'s options of the same
    names): one program sharded over all of them, or ``instances`` of it, each on its
    own ``devices_per_instance`` devices, or ``auto``: whichever runs faster, measured
    at load. None: ``pxrt.load``'s default (``auto``, or ``$PXRT_PLACEMENT``). A
    decoder's own load options ride along in ``decoder``."""

    placement: str | None = None
    instances: int | None = None
    devices_per_instance: int | None = None
    decoder: DecoderLoad = DecoderLoad()

    CHECKS: ClassVar[dict[str, Any]] = {
        "placement": choice(*PLACEMENTS, none=True),
        "instances": number(int, 1, none=True),
        "devices_per_instance": number(int, 1, none=True),
    }

    def load_options(self) -> dict[str, Any]:
        """Keyword arguments of ``pxrt.load``: the ones that differ from its defaults."""
        placed = {
            k: getattr(self, k) for k in self.CHECKS if getattr(self, k) != getattr(Placement, k)
        }
        return placed | self.decoder.load_options()

    @staticmethod
    def from_instance_group(groups: Any, *, typed: bool = False) -> dict[str, Any]:
        """Triton's ``instance_group`` (``[{count = 1, kind = "KIND_GPU"}]``) where it
        maps: ``KIND_GPU``, ``KIND_CPU`` or ``KIND_AUTO`` with count 1 is an instance on
        each device (``replicated``); ``KIND_MODEL`` (the model places itself) is one
        program over them all (``sharded``). Triton's count of several instances on one
        device is ``max_inflight`` here; which devices (``gpus``) is what ``pxrt.load``
        is given. ``typed``: its count as ``check``'s."""
        if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], Mapping):
            raise OptionError(
                'instance_group takes one group, [{count = 1, kind = "KIND_GPU"}], '
                f"got {groups!r}"
            )
        group = dict(groups[0])
        unknown = sorted(set(group) - {"count", "kind", "name"})
        if unknown:
            raise OptionError(
                f"instance_group: pxrt maps count and kind, not {unknown} (the devices are "
                "pxrt serve's; devices_per_instance sets the size of each instance)"
            )
        kind = group.get("kind", "KIND_AUTO")
        if kind not in _TRITON_KINDS:
            raise OptionError(
                f"instance_group kind {kind!r} is not one of {', '.join(_TRITON_KINDS)}"
            )
        if kind == "KIND_MODEL":
            return {"placement": "sharded"}
        count_check = number(int, 1)
        if typed:
            strict(count_check, group.get("count", 1))
        count = _checked(count_check, group.get("count", 1))
        if count != 1:
            raise OptionError(
                f"instance_group count {count}: pxrt runs one instance per device (or "
                "device group); more batches at once on each is max_inflight"
            )
        return {"placement": "replicated"}


# --------------------------------------------------------------------------- HTTP


@dataclasses.dataclass(frozen=True)
class HttpLimits(_Checked):
    """What HTTP clients may hold of a server.

    The body limits are the app's (``serving.http.app.create_app``); the connection, header
    and timing limits are the protocol's (``serving.http.limits``, which ``pxrt serve``
    runs uvicorn with).

    Attributes:
      max_body_bytes: a request body's size; larger ones get 413 (before being read
        when they say their length).
      max_json_bytes: the JSON part of a request; its parse holds the event loop (~10 ms
        a MB), so large tensors go as binary data. Larger ones get 413.
      max_pending_body_bytes: request bodies held at once, over all requests; uploads
        that would go over get 503 with Retry-After.
      max_connections: connections open at once; new ones beyond are closed at once.
      max_header_bytes: a request's URL and headers; more get 431.
      header_timeout_s: time to send the headers, from connecting or the request's start.
      body_timeout_s: a body's longest pause.
      request_timeout_s: time to send a whole request.
    """

    max_body_bytes: int = 64 << 20
    max_json_bytes: int = 16 << 20
    max_pending_body_bytes: int = 512 << 20
    max_connections: int = 8192
    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    request_timeout_s: float = 120.0

    CHECKS: ClassVar[dict[str, Any]] = {
        "max_body_bytes": number(int, 1),
        "max_json_bytes": number(int, 1),
        "max_pending_body_bytes": number(int, 1),
        "max_connections": number(int, 1),
        "max_header_bytes": number(int, 1),
        "header_timeout_s": number(float, 0, inclusive=False),
        "body_timeout_s": number(float, 0, inclusive=False),
        "request_timeout_s": number(float, 0, inclusive=False),
    }


# --------------------------------------------------------------------------- gRPC


@dataclasses.dataclass(frozen=True)
class GrpcLimits(_Checked):
    """What one client may hold of a gRPC listener (grpc core enforces each; checked
    when made, as every option here).

    - ``max_connections``: connections open at once; grpc closes new ones beyond it at
      once (``pxrt serve`` gives gRPC a share of its one connection budget).
    - ``handshake_timeout_s``: from connecting to the client's HTTP/2 settings; a socket
      that sends nothing is closed after it.
    - ``idle_timeout_s``: a connection with no call for this long is sent GOAWAY and
      closed (clients reconnect when they next call).
    - ``keepalive_s``, ``keepalive_timeout_s``: a connection with calls but quiet this
      long is pinged; one whose peer does not answer in the timeout is closed.
    - ``min_client_ping_s``: clients pinging more often than this without data are sent
      GOAWAY after two strikes (grpc's keepalive enforcement; Triton's default too).
    - ``max_stream_inflight``: requests of one ModelStreamInfer stream read and not yet
      answered (answers waiting to be written included); over it the stream is not read
      until an answer is written, so HTTP/2 flow control holds a client that sends
      faster than it reads (pxrt's own, not grpc core's).

    pxrt's own HTTP/2 (``serving.grpc.h2.Connections`` says how each is enforced) also has:

    - ``max_streams``: streams open at once over all connections of the process;
    - ``stream_idle_timeout_s``: a ModelStreamInfer stream with no request in flight
      and nothing received for this long ends UNAVAILABLE (clients open another);
    - ``max_queued_bytes``, ``send_timeout_s``: answers a connection's client has not
      taken (its flow-control windows closed); past the bytes, new calls are refused and
      answers that would wait end RESOURCE_EXHAUSTED; an answer that does not move for
      the timeout is dropped (the call reset);
    - ``max_control_frames``: frames without a request (SETTINGS, WINDOW_UPDATE,
      PRIORITY, RST_STREAM, empty DATA) a client may send per 10 s beyond what its
      calls and answers account for; past it the connection is sent away.
    """

    max_connections: int = 250
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    keepalive_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_client_ping_s: float = 300.0
    max_stream_inflight: int = 512
    max_streams: int = 8192
    stream_idle_timeout_s: float = 600.0
    max_queued_bytes: int = 32 << 20
    send_timeout_s: float = 30.0
    max_control_frames: int = 1000

    CHECKS: ClassVar[dict[str, Any]] = {
        "max_connections": number(int, 1),
        "handshake_timeout_s": number(float, 0, inclusive=False),
        "idle_timeout_s": number(float, 0, inclusive=False),
        "keepalive_s": number(float, 0, inclusive=False),
        "keepalive_timeout_s": number(float, 0, inclusive=False),
        "min_client_ping_s": number(float, 0),
        "max_stream_inflight": number(int, 1),
        "max_streams": number(int, 1),
        "stream_idle_timeout_s": number(float, 0, inclusive=False),
        "max_queued_bytes": number(int, 1),
        "send_timeout_s": number(float, 0, inclusive=False),
        "max_control_frames": number(int, 1),
    }

    def options(self) -> list[tuple[str, int]]:
        """grpc channel arguments enforcing these limits."""
        ms = lambda s: max(1, int(s * 1000))  # noqa: E731
        return [
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_timeout_s)),
            ("grpc.max_connection_idle_ms", ms(self.idle_timeout_s)),
            ("grpc.keepalive_time_ms", ms(self.keepalive_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", ms(self.min_client_ping_s)),
            ("grpc.http2.max_ping_strikes", 2),
        ]


# --------------------------------------------------------------------------- generation


@dataclasses.dataclass(frozen=True)
class GenerationLimits(_Checked):
    """What one generation request may ask of a server, on every protocol (the generate
    extension, OpenAI's endpoints, gRPC's decoupled stream, through workers too). A
    request over one is a 400 / INVALID_ARGUMENT naming it: the text of each token is
    matched against every stop string, so their count and length bound its work.

    Attributes:
      max_request_kb: the body of one request over HTTP (its JSON is parsed on the event
        loop: a megabyte takes milliseconds, and a prompt longer than a decoder's cache
        is refused anyway); larger ones get 413.
      max_stop_strings: stop strings in one request (OpenAI's API allows 4).
      max_stop_bytes: the UTF-8 bytes of one stop string.
      max_stop_ids: stop token ids in one request (beyond the artifact's own).
      max_choices: completions of one OpenAI request (``n`` times its prompts): each is
        a generation in a slot of its own (a prompt's ``n`` share its prefill through
        the prefix cache).
    """

    max_request_kb: int = 1024
    max_stop_strings: int = 16
    max_stop_bytes: int = 256
    max_stop_ids: int = 64
    max_choices: int = 8

    CHECKS: ClassVar[dict[str, Any]] = {
        "max_request_kb": number(int, 1),
        "max_stop_strings": number(int, 0),
        "max_stop_bytes": number(int, 1),
        "max_stop_ids": number(int, 0),
        "max_choices": number(int, 1),
    }


__all__ = [
    "CELL_POLICIES",
    "PLACEMENTS",
    "BatchingOptions",
    "DecoderLoad",
    "GenerationLimits",
    "GrpcLimits",
    "HttpLimits",
    "OptionError",
    "Placement",
]
