"""``pxrt serve``'s configuration: its flags, its TOML file, and what they make.

Per-model batching options come from flags (defaults for every model) or a TOML file,
each checked by ``BatchingOptions``; the HTTP limits' flags make an ``HttpLimits``::

    [defaults]
    max_delay_us = 2000

    [models.mlp]
    path = "models/mlp"
    max_batch_size = 64

    [models.encoder]
    path = "models/encoder"
    cell_policy = "cost"     # models with named dimensions: "cost" or "oldest"

    [models.ranker]          # a model of --model-repository: options and version policy
    version_policy = "latest:2"

Bad values stop ``pxrt serve`` at start-up with a message naming the option, instead of
failing every request.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from typing import Any

from .options import (
    BatchingOptions,
    DecoderLoad,
    GenerationLimits,
    GrpcLimits,
    HttpLimits,
    OptionError,
    Placement,
    number,
)

MB = 1 << 20
KB = 1 << 10

# The batching options a flag or a TOML section may set (``copy`` is for embedding:
# a served answer is serialized anyway).
SERVE_OPTIONS = tuple(k for k in BatchingOptions.CHECKS if k != "copy")


# What the on/off batching options do, for --help.
_FLAG_HELP = {
    "response_cache": "answer a request equal to one answered before from the server's "
    "response cache (deterministic models only; --response-cache-mb sizes it)",
}


def _arg(check: Any) -> Any:
    """An argparse type from an option check: argparse names the flag in its error."""

    def parse(text: str) -> Any:
        try:
            return check(text)
        except OptionError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not {exc}") from None

    parse.__name__ = "value"
    return parse


# HTTP limit flags: (flag, HttpLimits field, unit in bytes or 1, help).
HTTP_FLAGS = (
    ("--max-body-mb", "max_body_bytes", MB, "larger bodies get 413"),
    ("--max-json-mb", "max_json_bytes", MB,
     "larger JSON parts get 413 (send large tensors as binary data)"),
    ("--max-pending-body-mb", "max_pending_body_bytes", MB,
     "request bodies held at once, over all requests; more get 503"),
    ("--max-header-kb", "max_header_bytes", KB, "a request's URL and headers; more get 431"),
    ("--header-timeout-s", "header_timeout_s", 1,
     "time to send the headers, from connecting or the request's start (408); "
     "for gRPC, to send the HTTP/2 settings after connecting"),
    ("--body-timeout-s", "body_timeout_s", 1, "a body's longest pause (408)"),
    ("--request-timeout-s", "request_timeout_s", 1, "time to send a whole request (408)"),
)  # fmt: skip


GENERATION_FLAGS = {
    "max_request_kb": "a request's body over HTTP, in KiB (413 beyond)",
    "max_stop_strings": "stop strings in one request",
    "max_stop_bytes": "UTF-8 bytes of one stop string",
    "max_stop_ids": "stop token ids in one request",
    "max_choices": "completions of one OpenAI request (n times its prompts)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    positive = _arg(number(float, 0, inclusive=False))
    port = _arg(number(int, 0))
    p.add_argument("model_dirs", nargs="*", help="artifact directories (default: the demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument(
        "--grpc-port",
        type=port,
        default=None,
        help="also serve KServe v2 over gRPC on this port (default: HTTP only)",
    )
    p.add_argument(
        "--workers", type=_arg(number(int, 1)), default=1,
        help="front-end processes: each accepts, parses and decodes HTTP and gRPC; this "
        "process keeps the models, the batching and the devices, and the requests' "
        "tensors cross by shared memory. Raise it when one process's front end is the "
        "bottleneck (many clients, small models, large JSON bodies) and cores are free "
        "(default 1: one process does everything)",
    )  # fmt: skip
    p.add_argument("--config", metavar="TOML", help="per-model options (see pxrt serve --help)")
    p.add_argument(
        "--model-repository",
        metavar="DIR",
        help="serve the models of DIR/<model>/<version>/ (artifact directories)",
    )
    p.add_argument(
        "--model-control-mode",
        choices=("none", "explicit", "poll"),
        default="none",
        help="none: the repository's models at start, no changes; explicit: only what "
        "--load-model names and the load/unload API asks; poll: rescan for new and "
        "removed versions (default none)",
    )
    p.add_argument(
        "--load-model", action="append", default=[], metavar="NAME",
        help="explicit mode: load this repository model at start (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--repository-poll-secs", type=positive, default=15.0,
        help="poll mode: seconds between scans of the repository (default 15)",
    )  # fmt: skip
    ray = p.add_argument_group("Ray Serve (the ray extra)")
    ray.add_argument(
        "--ray", action="store_true",
        help="serve the model as a Ray Serve application of --replicas pxrt replicas, "
        "KServe v2 HTTP on Ray's proxy at --host/--port",
    )  # fmt: skip
    ray.add_argument("--replicas", type=_arg(number(int, 1)), default=1, help="default 1")
    ray.add_argument(
        "--ray-address", default=None,
        help="a running Ray cluster (default: RAY_ADDRESS, else the cluster last started on "
        "this machine, else a new local one)",
    )  # fmt: skip
    cpus = _arg(number(float, 0))
    ray.add_argument("--replica-cpus", type=cpus, default=1.0, help="default 1")
    ray.add_argument("--replica-gpus", type=cpus, default=0.0, help="default 0")
    batching = p.add_argument_group("batching (every model; a TOML file sets them per model)")
    for key in SERVE_OPTIONS:
        check = BatchingOptions.CHECKS[key]
        if isinstance(default := getattr(BatchingOptions(), key), bool):
            batching.add_argument(
                "--" + key.replace("_", "-"), action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{_FLAG_HELP.get(key, key)} (default {'on' if default else 'off'})",
            )  # fmt: skip
            continue
        batching.add_argument(
            "--" + key.replace("_", "-"), type=_arg(check), default=None,
            help=f"{check.expects} (default {getattr(BatchingOptions(), key)})",
        )  # fmt: skip
    batching.add_argument(
        "--response-cache-mb", type=_arg(number(float, 0)), default=256.0,
        help="the response cache's budget, MiB of answers kept for the models that set "
        "response_cache (least recently used out first; default 256)",
    )  # fmt: skip
    place = p.add_argument_group(
        "placement (every model; a TOML file sets them per model, Triton's instance_group "
        "spelling too)"
    )
    place.add_argument(
        "--placement", type=_arg(Placement.CHECKS["placement"]), default=None,
        help="sharded: one program with each batch split over all devices; replicated: "
        "an instance of the model on each device (group), each running whole batches; "
        "auto: whichever runs faster, measured at load (default auto, or "
        "$PXRT_PLACEMENT)",
    )  # fmt: skip
    for key in ("instances", "devices_per_instance"):
        place.add_argument(
            "--" + key.replace("_", "-"), type=_arg(Placement.CHECKS[key]), default=None,
            help="replicated / auto: " + ("instances of the model" if key == "instances"
                                          else "devices of each instance")
            + " (default: from the other, else one device each)",
        )  # fmt: skip
    limits = HttpLimits()
    http = p.add_argument_group("limits on clients")
    for flag, field, unit, text in HTTP_FLAGS:
        default = getattr(limits, field) / unit
        http.add_argument(
            flag, type=positive, default=default, help=f"{text} (default {default:g})"
        )
    http.add_argument(
        "--max-connections", type=_arg(number(int, 2)), default=None,
        help="open connections over every listener (HTTP and gRPC); new ones beyond a "
        "listener's share are answered 503 + Retry-After and closed (default: 8192, or the "
        "file descriptor limit less 128)",
    )  # fmt: skip
    http.add_argument(
        "--max-grpc-connections", type=_arg(number(int, 1)), default=None,
        help="gRPC's share of --max-connections (default a quarter: gRPC clients "
        "multiplex calls on one connection); HTTP gets the rest",
    )  # fmt: skip
    http.add_argument(
        "--native-http", action=argparse.BooleanOptionalAction, default=True,
        help="answer inference and health requests straight from the HTTP parser, "
        "without the ASGI stack (same answers, a fraction of the CPU); --no-native-http "
        "sends every request through the Starlette app (default on)",
    )  # fmt: skip
    http.add_argument(
        "--native-grpc", action=argparse.BooleanOptionalAction, default=True,
        help="serve gRPC on pxrt's own HTTP/2 (the same service and answers at a fraction "
        "of grpcio's CPU); --no-native-grpc serves it with grpcio's asyncio server "
        "(default on)",
    )  # fmt: skip
    generation = p.add_argument_group(
        "generation (every decoder, every protocol: a request over one is a 400 naming it)"
    )
    for key, what in GENERATION_FLAGS.items():
        generation.add_argument(
            "--" + key.replace("_", "-"), type=_arg(GenerationLimits.CHECKS[key]),
            default=getattr(GenerationLimits(), key),
            help=f"{what} (default {getattr(GenerationLimits(), key)})",
        )  # fmt: skip
    inflight = GrpcLimits().max_stream_inflight
    p.add_argument(
        "--max-stream-inflight", type=_arg(GrpcLimits.CHECKS["max_stream_inflight"]),
        default=inflight,
        help="requests of one gRPC stream read and not yet answered; over it the stream "
        f"is not read (HTTP/2 flow control holds the client) (default {inflight})",
    )  # fmt: skip
    tracing = p.add_argument_group("tracing (OpenTelemetry: pip install 'pxrt[trace]')")
    tracing.add_argument(
        "--trace-rate", type=_arg(number(int, 0)), default=None, metavar="N",
        help="trace one inference request in N (Triton's trace_rate; 0: none until "
        "/v2/trace/setting turns it on): its spans (decode, queue, assemble, execute, "
        "split, encode) go to an OTLP collector, continuing a caller's W3C traceparent "
        "(default: no tracing)",
    )  # fmt: skip
    tracing.add_argument(
        "--trace-otlp-endpoint", default=None, metavar="URL",
        help="the collector's OTLP/HTTP traces endpoint (default: "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else http://localhost:4318/v1/traces)",
    )  # fmt: skip
    access = p.add_argument_group("access (HTTP and gRPC alike)")
    access.add_argument(
        "--restricted-api", action="append", default=[], metavar="GROUPS:HEADER=VALUE",
        help="answer the API groups (comma-separated: health, metadata, inference, "
        "statistics, model-repository, trace, shared-memory) only with this header and "
        "value: 403 / PERMISSION_DENIED without (repeat for other groups and keys)",
    )  # fmt: skip
    access.add_argument(
        "--allow-client-shm", action="store_true",
        help="serve Triton's system shared memory extension (/v2/systemsharedmemory, gRPC "
        "SystemSharedMemory*): local clients register POSIX shared memory and name it in "
        "requests; only for clients you trust with the process (Triton's flag; default off)",
    )  # fmt: skip
    access.add_argument(
        "--allow-remote-shm", action="store_true",
        help="with --allow-client-shm: take shared memory registrations from clients on "
        "other hosts too (default: from loopback only; a remote client cannot use this "
        "host's memory, only reach into it)",
    )  # fmt: skip
    access.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS and gRPC over TLS "
                        "with this certificate (chain) and --tls-key")  # fmt: skip
    access.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    access.add_argument("--tls-ca", metavar="PEM", help="with --tls-cert: require client "
                        "certificates signed by these CAs (mutual TLS)")  # fmt: skip
    p.add_argument(
        "--allow-signature-change", action="store_true",
        help="repository: serve a new version whose inputs or outputs differ from the "
        "served version's (default: refused, the old version keeps serving; per model: "
        "allow_signature_change = true in its [models.NAME] section)",
    )  # fmt: skip
    group = p.add_argument_group(
        "multi-host (one program over several processes' devices: docs/multihost.md)"
    )
    group.add_argument(
        "--coordinator", metavar="HOST:PORT",
        help="jax's coordination service, run by process 0 (the leader, which serves); "
        "every process of the group gives the same one",
    )  # fmt: skip
    group.add_argument("--num-processes", type=_arg(number(int, 1)), help="processes in the group")
    group.add_argument(
        "--process-id", type=_arg(number(int, 0)),
        help="this process's index: 0 leads and serves; the others follow it and answer "
        "only /v2/health/* on --port",
    )  # fmt: skip
    group.add_argument(
        "--control-port", type=port,
        help="the leader's lockstep port on the coordinator's host (default: its port + 1)",
    )  # fmt: skip
    group.add_argument(
        "--step-timeout-s", type=positive, default=30.0,
        help="a follower that does not answer a batch in this time breaks the group "
        "(default 30)",
    )  # fmt: skip
    group.add_argument(
        "--group-secret-file", metavar="FILE",
        help="the group's shared secret (the same file's content in every process, at "
        "least 16 characters: `openssl rand -hex 32 > FILE`); the leader and its "
        "followers prove to each other they hold it when they join (default: "
        "$PXRT_GROUP_SECRET)",
    )  # fmt: skip
    p.add_argument("--log-level", default="warning")


def distributed_config(args: argparse.Namespace, models: int) -> Any:
    """The ``pxrt.multihost.Distributed`` the multi-host flags ask for (None without
    them), checked against the rest of the command line (``models``: how many models
    it serves)."""
    given = [
        f for f in ("coordinator", "num_processes", "process_id") if getattr(args, f) is not None
    ]
    if not given:
        for flag in ("control_port", "group_secret_file"):
            if getattr(args, flag) is not None:
                raise OptionError(
                    f"--{flag.replace('_', '-')} is for a multi-host group (--coordinator ...)"
                )
        return None
    if len(given) < 3:
        raise OptionError(
            "a multi-host group needs --coordinator, --num-processes and --process-id"
        )
    for flag, on in (
        ("--workers", args.workers > 1),
        ("--ray", args.ray),
        ("--model-repository", bool(args.model_repository)),
        ("--placement", args.placement is not None),
        ("--instances", args.instances is not None),
        ("--devices-per-instance", args.devices_per_instance is not None),
    ):
        if on:
            raise OptionError(f"{flag} does not go with a multi-host group (--coordinator)")
    if models != 1:
        raise OptionError(f"a multi-host group serves one model; {models} given")
    from pxrt.multihost import Distributed

    secret = None
    if args.group_secret_file is not None:
        try:
            with open(args.group_secret_file) as f:
                secret = f.read()
        except OSError as exc:
            raise OptionError(f"--group-secret-file: {exc}") from None
    try:
        return Distributed(
            args.coordinator,
            args.num_processes,
            args.process_id,
            control_port=args.control_port,
            step_timeout_s=args.step_timeout_s,
            secret=secret,
        )
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def raise_fd_limit(want: int = 65536) -> None:
    """Raise this process's soft file descriptor limit towards its hard limit (to
    ``want``), as servers do: the default soft limit (often 1024) would cap the
    connections below what the defaults promise."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(hard, want)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, OSError, ValueError):  # pragma: no cover - not on this platform
        pass


def fd_budget() -> int:
    """Connections this process can hold with file descriptors to spare."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not on this platform
        return 1000
    # 64 to spare for the process's own files, 64 for refused connections that linger
    # (serving.http.limits.linger_allowance).
    return max(16, soft - 128) if soft != resource.RLIM_INFINITY else 1000


def connection_shares(args: argparse.Namespace) -> tuple[int, int]:
    """(HTTP's, gRPC's) connections: one budget, ``--max-connections``, over every
    listener, so that together they never exhaust the file descriptors (a flood of
    sockets on one port cannot take the other down). gRPC's share is 0 without it.
    Raises this process's fd limit first (``raise_fd_limit``): the default budget is
    sized from it."""
    raise_fd_limit()
    budget = fd_budget()
    total = args.max_connections or min(HttpLimits().max_connections, budget)
    if total > budget:
        raise SystemExit(
            f"pxrt serve: error: --max-connections {total} is over what the file "
            f"descriptor limit allows ({budget}, ulimit -n less 128 to spare); raise the "
            "limit or lower --max-connections"
        )
    if args.grpc_port is None:
        return total, 0
    grpc = args.max_grpc_connections or max(1, total // 4)
    if grpc >= total:
        raise SystemExit(
            f"pxrt serve: error: --max-grpc-connections {grpc} leaves no connection of "
            f"--max-connections {total} to HTTP"
        )
    return total - grpc, grpc


def grpc_limits(args: argparse.Namespace, max_connections: int) -> GrpcLimits:
    """The gRPC limits the flags set (``max_connections``: gRPC's share)."""
    return GrpcLimits(
        max_connections=max_connections,
        handshake_timeout_s=args.header_timeout_s,
        max_stream_inflight=args.max_stream_inflight,
    )


def tracing(args: argparse.Namespace) -> Any:
    """The ``serving.Tracing`` the flags set up, or None (no ``--trace-rate``)."""
    if args.trace_rate is None:
        return None
    from .tracing import otlp_tracing

    fixed = None
    if args.workers > 1:
        fixed = (
            "pxrt serve --workers: each worker traces its own requests at the --trace-rate "
            "it started with; the settings do not change at run time"
        )
    try:
        return otlp_tracing(args.trace_rate, args.trace_otlp_endpoint, fixed)
    except ImportError as exc:
        raise SystemExit(f"pxrt serve: --trace-rate: {exc}") from None


def generation_limits(args: argparse.Namespace) -> GenerationLimits:
    """The generation limits the flags set."""
    return GenerationLimits(**{k: getattr(args, k) for k in GenerationLimits.CHECKS})


def http_limits(args: argparse.Namespace, max_connections: int) -> HttpLimits:
    """The HTTP limits the flags set (``max_connections``: HTTP's share)."""
    values = {field: getattr(args, flag[2:].replace("-", "_")) * unit
              for flag, field, unit, _ in HTTP_FLAGS}  # fmt: skip
    for field in ("max_body_bytes", "max_json_bytes", "max_pending_body_bytes",
                  "max_header_bytes"):  # fmt: skip
        values[field] = int(values[field])
    return HttpLimits(max_connections=max_connections, **values)


# --------------------------------------------------------------------------- models


def model_specs(
    args: argparse.Namespace, demo_dir: str
) -> list[tuple[str | None, str, BatchingOptions, Placement]]:
    """(name or None for the manifest's, path, options, placement) per model to serve."""
    defaults, place, sections = _config(args)
    specs: list[tuple[str | None, str, BatchingOptions, Placement]] = []
    for name, section in sections.items():
        where = f"[models.{name}]"
        if "path" not in section:
            if args.model_repository:
                continue  # a repository model's options: see repository_config
            raise SystemExit(f"pxrt serve: {args.config}: {where} needs a path")
        if not isinstance(section["path"], str):
            raise SystemExit(
                f"pxrt serve: {args.config}: {where} path: {section['path']!r} is not a "
                "string (the artifact directory)"
            )
        if "version_policy" in section:
            raise SystemExit(
                f"pxrt serve: {args.config}: {where} version_policy: for models of the "
                "--model-repository (this one has a path)"
            )
        extra = {k: v for k, v in section.items() if k != "path"}
        specs.append((name, section["path"], *_options(extra, args.config, where, defaults, place)))
    specs += [(None, path, defaults, place) for path in args.model_dirs]
    if not specs and not args.model_repository:
        from pxrt import demo

        specs.append((None, demo.export_demo(os.path.join(demo_dir, "mlp")), defaults, place))
    return specs


def repository_config(
    args: argparse.Namespace,
) -> tuple[
    BatchingOptions, dict[str, BatchingOptions], dict[str, str], set[str], dict[str, Placement]
]:
    """(the options of every repository model, name -> its own options, name -> its
    version policy, the models whose new versions may change their inputs or outputs
    (``"*"``: all), name -> its placement (``""``: every model's)), from the flags and
    the TOML's ``[defaults]`` and path-less ``[models.NAME]`` sections."""
    from .engine.repository import parse_policy

    defaults, place, sections = _config(args)
    placements: dict[str, Placement] = {"": place}
    options: dict[str, BatchingOptions] = {}
    policies: dict[str, str] = {}
    may_change = {"*"} if args.allow_signature_change else set()
    for name, section in sections.items():
        if "path" in section:
            continue
        where = f"[models.{name}]"
        own = ("version_policy", "allow_signature_change")
        extra = {k: v for k, v in section.items() if k not in own}
        options[name], placements[name] = _options(extra, args.config, where, defaults, place)
        if "version_policy" in section:
            policy = section["version_policy"]
            try:
                if not isinstance(policy, str):
                    raise ValueError(f"{policy!r} is not a string: latest:N, all or specific:V")
                parse_policy(policy)
            except ValueError as exc:
                raise SystemExit(
                    f"pxrt serve: {args.config}: {where} version_policy: {exc}"
                ) from None
            policies[name] = policy
        allow = section.get("allow_signature_change", False)
        if not isinstance(allow, bool):
            raise SystemExit(
                f"pxrt serve: {args.config}: {where} allow_signature_change: {allow!r} is "
                "not true or false"
            )
        if allow:
            may_change.add(name)
    return defaults, options, policies, may_change, placements


def _config(args: argparse.Namespace) -> tuple[BatchingOptions, Placement, dict]:
    """(the options and placement every model gets: the flags, then the TOML's
    ``[defaults]``; the TOML's ``[models.NAME]`` sections)."""
    flags = {k: getattr(args, k) for k in SERVE_OPTIONS if getattr(args, k) is not None}
    defaults = BatchingOptions(**flags)
    place = Placement(
        **_implied(
            {k: getattr(args, k) for k in Placement.CHECKS if getattr(args, k, None) is not None}
        )
    )
    if not args.config:
        return defaults, place, {}
    conf = _read_toml(args.config)
    defaults, place = _options(conf["defaults"], args.config, "[defaults]", defaults, place)
    return defaults, place, conf["models"]


# The tables of pxrt serve's TOML file.
TOML_TABLES = ("defaults", "models")


def _read_toml(path: str) -> dict:
    """``path``'s TOML, its shape checked: a ``[defaults]`` table and a table of
    ``[models.NAME]`` tables (each present, maybe empty), no other; any error a
    SystemExit naming the file (and where in it)."""
    try:
        with open(path, "rb") as f:
            conf = tomllib.load(f)
    except OSError as exc:
        raise SystemExit(f"pxrt serve: --config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:  # (its message says the line and column)
        raise SystemExit(f"pxrt serve: {path}: not valid TOML: {exc}") from None
    unknown = sorted(set(conf) - set(TOML_TABLES))
    if unknown:
        raise SystemExit(
            f"pxrt serve: {path}: unknown table(s) or key(s) {unknown} at the top; known: "
            "[defaults] and [models.NAME]"
        )
    conf.setdefault("defaults", {})
    models = conf.setdefault("models", {})
    tables = {"[defaults]": conf["defaults"], "models": models}
    tables |= {f"[models.{name}]": section for name, section in models.items()}
    for where, table in tables.items():
        if not isinstance(table, dict):
            raise SystemExit(
                f"pxrt serve: {path}: {where} must be a table of options, got {table!r:.80}"
            )
    return conf


TOML_KEYS = (
    *SERVE_OPTIONS, *Placement.CHECKS, *DecoderLoad.CHECKS, "instance_group", "dynamic_batching"
)  # fmt: skip


def _options(
    section: dict, path: str, where: str, base: BatchingOptions, place: Placement
) -> tuple[BatchingOptions, Placement]:
    """``base`` and ``place`` with a TOML section's options over them (``where`` in the
    file ``path``), each checked, of its own type (TOML's values are typed: ``"8"`` is
    not 8), ``instance_group`` and ``dynamic_batching`` in Triton's spelling, where they
    map."""
    unknown = sorted(set(section) - set(TOML_KEYS))
    if unknown:
        raise SystemExit(
            f"pxrt serve: {path}: unknown option(s) {unknown} in {where}; known: "
            f"{', '.join(TOML_KEYS)}"
        )
    checked, placed, decoder = {}, {}, {}
    for key, value in section.items():
        try:
            if key in DecoderLoad.CHECKS:
                if where == "[defaults]":
                    raise OptionError("a decoder's load option goes in its [models.NAME] section")
                decoder[key] = DecoderLoad.check(key, value, typed=True)
            elif key == "instance_group":
                placed.update(Placement.from_instance_group(value, typed=True))
            elif key == "dynamic_batching":
                checked.update(BatchingOptions.from_dynamic_batching(value, typed=True))
            elif key in Placement.CHECKS:
                placed[key] = Placement.check(key, value, typed=True)
            else:
                checked[key] = BatchingOptions.check(key, value, typed=True)
        except OptionError as exc:
            raise SystemExit(f"pxrt serve: {path}: {where} {key}: {exc}") from None
    try:  # (the checks across options: a default level over the levels, say)
        if decoder:
            placed["decoder"] = place.decoder.replace(**decoder)
        return base.replace(**checked), place.replace(**_implied(placed))
    except OptionError as exc:
        raise SystemExit(f"pxrt serve: {path}: {where}: {exc}") from None


def _implied(placed: dict) -> dict:
    """Instances without a placement mean ``replicated``."""
    if "placement" not in placed and placed.keys() & {"instances", "devices_per_instance"}:
        return {**placed, "placement": "replicated"}
    return placed


__all__ = [
    "add_arguments",
    "connection_shares",
    "distributed_config",
    "fd_budget",
    "generation_limits",
    "grpc_limits",
    "http_limits",
    "model_specs",
    "repository_config",
]
