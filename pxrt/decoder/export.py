"""Export an autoregressive decoder to an artifact directory, and read one back.

The user writes the model math only, as two pure JAX functions over a KV cache:

- ``prefill(params, tokens, lengths) -> (rows, logits)``: ``tokens`` int32 ``[b, seq]``
  (prompts padded to the bucket length ``seq``), ``lengths`` int32 ``[b]`` (each prompt's
  true length); ``rows`` is the cache for those prompts, ``seq`` positions long, and
  ``logits`` ``[b, vocab]`` the next-token logits after each prompt's last token.
- ``decode(params, cache, tokens, positions) -> (cache, logits)``: one step for every
  slot: ``tokens`` int32 ``[slots]`` at ``positions`` int32 ``[slots]``; it writes their
  keys and values into ``cache`` at those positions and returns the updated cache and
  ``[slots, vocab]`` logits. Slots are independent of each other (pxrt steps each
  device's slots on their own, ``shard_map``: nothing may mix slots, such as batch-wide
  statistics or a capacity shared by the batch); a slot attends to its own positions
  ``<= position`` only (stale entries beyond are masked, never cleared).
- ``extend(params, cache, tokens, positions) -> (cache, logits)``, optional: ``k`` new
  tokens for every row, ``tokens`` int32 ``[rows, k]``, token ``j`` of a row at position
  ``positions[row] + j`` (int32 ``[rows]``), attending to the row's cache up to itself;
  ``logits`` ``[rows, k, vocab]``. Decode is its ``k = 1``. With it pxrt prefills a
  prompt longer than the largest prefill length in chunks between decode steps, and a
  prompt whose start is in the prefix cache from where the cached part ends.

The cache is described per slot by a pytree of ``TensorSpec`` whose shapes name the
sequence axis ``"length"`` (``{"k": TensorSpec((layers, "length", heads, hd),
"float32"), ...}``): ``prefill`` returns it with ``b`` rows and ``length = seq``, and
``decode`` takes and returns it with ``slots`` rows and ``length = max_length``. Both
programs are exported with those dimensions symbolic, so slot count, cache length and
prefill buckets are chosen again at load (``pxrt.load``), up to the bounds the programs
know (``seq <= `` the largest prefill length, ``length <= max_length`` unless
``bounds`` says otherwise: ``pxrt.shapes``). Everything else (inserting a
prefilled prompt into a free slot, sampling, stop conditions, the loop) is pxrt's:
``pxrt.generate``.

The directory holds ``prefill.jaxexport``, ``decode.jaxexport`` (and ``extend.jaxexport``),
``params.npz`` and a
``manifest.json`` of kind ``"decoder"`` (format version 4), bound to both programs by the
names they are exported under, as for one-shot artifacts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import export as jax_export

from .. import _xla
from .. import shapes as _shapes
from ..artifact import (
    BATCH_AXIS,
    CONCRETE,
    SYMBOLIC,
    deserialize,
    on_leaves,
    param_entries,
    read_manifest,
    read_params,
    verify_files,
    write_directory,
    x64_noted,
    x64_of,
)
from ..manifest import (
    CONCRETE_FORMAT_VERSION,
    DECODER_FORMAT_VERSION,
    FORMAT,
    MANIFEST,
    PARAMS_FILE,
    ArtifactError,
    check_bounds,
    check_common,
    check_jax_version,
    check_params,
    is_concrete,
    is_int,
    needs,
)
from ..specs import DTYPES, MAX_BUCKET, TensorSpec
from ..tokenizer import BYTES, FILES, artifact_files

KIND = "decoder"
PREFILL_FILE = "prefill.jaxexport"
DECODE_FILE = "decode.jaxexport"
EXTEND_FILE = "extend.jaxexport"
CHUNK_DIM = "chunk"  # extend's new tokens per row
LENGTH_DIM = "length"  # the cache's sequence axis, as its spec names it
TOKEN_DTYPE = np.dtype(np.int32)
# The fields the programs are bound to (their exported names hash them).
SIGNATURE_KEYS = ("params", "x64", "vocab", "cache")


@dataclasses.dataclass(frozen=True)
class DecoderArtifact:
    """A verified decoder artifact directory, read into memory."""

    path: str
    manifest: dict
    prefill: jax_export.Exported
    decode: jax_export.Exported
    params: Any  # the params pytree, numpy leaves
    cache: Any  # the cache's pytree of per-slot TensorSpecs
    #: A concrete-shape decoder's prefill programs by (batch, length); None: the one
    #: symbolic ``prefill`` runs every size.
    prefills: dict[tuple[int, int], jax_export.Exported] | None = None
    #: The optional multi-token step (None: prompts are not chunked or resumed); a
    #: concrete-shape decoder's by (rows, chunk) in ``extends``.
    extend: jax_export.Exported | None = None
    extends: dict[tuple[int, int], jax_export.Exported] | None = None

    def prefill_for(self, b: int, n: int) -> jax_export.Exported:
        """The prefill program for ``b`` prompts of ``n`` tokens."""
        return self.prefill if self.prefills is None else self.prefills[(b, n)]

    def extend_for(self, rows: int, k: int) -> jax_export.Exported:
        """The extend program for ``rows`` rows of ``k`` new tokens."""
        if self.extends is not None:
            return self.extends[(rows, k)]
        assert self.extend is not None
        return self.extend

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def x64(self) -> bool:
        return bool(self.manifest["x64"])

    @property
    def bounds(self) -> dict[str, int]:
        """``"seq"`` (prompt bucket) and ``"length"`` (cache) -> the bound the programs
        were exported with; absent: unbounded."""
        return dict(self.manifest.get("bounds", {}))

    @property
    def chunked(self) -> bool:
        """It has an ``extend`` program (``chunk_lengths`` in its config)."""
        return "chunk_lengths" in self.manifest["decoder"]

    @property
    def config(self) -> dict:
        """The ``decoder`` section: vocab, max_length, slots, prefill buckets, stop ids."""
        return self.manifest["decoder"]


def program_names(manifest: Mapping[str, Any]) -> tuple[str, str, str]:
    """The names the prefill, decode and extend programs are exported under: a hash of
    what the programs depend on (params, x64, vocabulary, cache layout)."""
    sig = {"params": manifest["params"], "x64": manifest["x64"]}
    sig |= {k: manifest["decoder"][k] for k in ("vocab", "cache")}
    text = json.dumps(sig, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:40]
    return f"pxrt_prefill_{digest}", f"pxrt_decode_{digest}", f"pxrt_extend_{digest}"


def cache_entries(cache: Any) -> list[dict]:
    """The manifest's ``cache`` entries: per leaf its path, dtype and per-slot shape."""
    flat = jax.tree_util.tree_flatten_with_path(cache, is_leaf=is_spec)[0]
    if not flat:
        raise ValueError("cache must be a pytree of pxrt.TensorSpec with at least one leaf")
    entries = []
    for keypath, spec in flat:
        where = f"cache{jax.tree_util.keystr(keypath)}"
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"{where}: expected a pxrt.TensorSpec, got {type(spec).__name__}")
        if any(d != LENGTH_DIM for d in spec.dims) or spec.dims.count(LENGTH_DIM) > 1:
            raise ValueError(
                f"{where}: shape {spec.shape} may name one dimension, {LENGTH_DIM!r} (the "
                "sequence axis), and no other"
            )
        entries.append(
            {"path": jax.tree_util.keystr(keypath), "dtype": spec.dtype.name, "shape": spec.shape}
        )
    return entries


def is_spec(x: Any) -> bool:
    """A leaf of a cache spec (``jax.tree``'s ``is_leaf``: a TensorSpec is a leaf)."""
    return isinstance(x, TensorSpec)


def export_decoder(
    prefill: Callable,
    decode: Callable,
    params: Any,
    path: str | os.PathLike,
    *,
    cache: Any,
    extend: Callable | None = None,
    chunk_lengths: Sequence[int] | None = None,
    chunk_batches: Sequence[int] | None = None,
    max_length: int,
    slots: int = 8,
    prefill_lengths: Sequence[int] = (16, 32, 64, 128),
    prefill_batches: Sequence[int] = (1, 4),
    eos_id: int | None = None,
    stop_ids: Sequence[int] = (),
    tokenizer: str | os.PathLike | None = None,
    start_ids: Sequence[int] = (),
    chat_template: str | None = None,
    name: str | None = None,
    version: str = "1",
    x64: bool | None = None,
    bounds: Mapping[str, int | None] | None = None,
    constraints: Sequence[str] = (),
    shapes: str = "symbolic",
    num_devices: int = 1,
    overwrite: bool = False,
) -> str:
    """Export a decoder (``prefill``, ``decode`` and optionally ``extend``, see the
    module docstring) and its params to the artifact directory ``path``; ``pxrt.load``
    serves it with ``generate``.

    Args:
      prefill, decode: the model's two pure functions.
      extend: its multi-token step (optional): with it, prompts up to the cache's length
        are taken (prefilled in chunks between decode steps) and the prefix cache
        reuses the cached start of a prompt.
      chunk_lengths: the new-token counts ``extend`` is compiled at (default:
        ``prefill_lengths``); a long prompt is prefilled ``max(chunk_lengths)`` tokens
        at a time, the rest of one whose start is cached at the smallest that holds it.
      chunk_batches: rows ``extend`` runs at once (default: ``prefill_batches``).
      params: a pytree of arrays, stored as plain arrays and passed to both.
      cache: the per-slot cache as a pytree of ``pxrt.TensorSpec``, its sequence axis
        named ``"length"``.
      max_length: cache positions per slot: a prompt and its generated tokens together
        (the default at load).
      slots: sequences decoded at once (the default at load).
      prefill_lengths: the prompt lengths prefill is compiled at; a prompt runs at the
        smallest that holds it; one longer than the largest is chunked (with ``extend``)
        or refused.
      prefill_batches: prompts prefilled together (batch buckets of prefill).
      eos_id: the end-of-sequence token: generation stops after emitting it.
      stop_ids: more tokens that stop every generation (requests may add their own).
      tokenizer: ``"bytes"`` (built in: token i < 256 is byte i), the path of a
        ``tokenizer.json`` for the ``tokenizers`` library, or of a SentencePiece
        ``.model`` (copied into the artifact): what ``pxrt serve`` turns text into tokens
        and back with. None: token ids only. Its tokens must be within the model's
        vocabulary (checked against the logits).
      start_ids: token ids put before every text prompt that does not begin with them:
        the start token a model was trained to see first (keras-hub's
        ``add_start_token``). Never put before a prompt given as token ids.
      chat_template: a Jinja template (as Hugging Face's ``chat_template``) that renders
        ``messages`` (and ``add_generation_prompt``) to the prompt's text:
        ``/v1/chat/completions`` needs it (and a tokenizer).
      bounds: the largest prompt bucket (``"seq"``) and cache length (``"length"``)
        the programs will ever run at (None: unbounded); default: the largest of
        ``prefill_lengths`` and ``max_length``. A decoder with a position table of N
        rows needs ``length <= N``, which the default gives when ``max_length <= N``.
        Load refuses sizes beyond them.
      constraints: more of jax's symbolic constraints, each over one program's
        dimensions (prefill: ``b``, ``seq``; decode: ``slots``, ``length``; extend:
        ``rows``, ``chunk``, ``length``).
      shapes: ``"symbolic"`` (a prefill and a decode program for any sizes) or
        ``"concrete"``: a prefill program per prefill batch and length, and decode at
        ``slots / num_devices`` slots of ``max_length``, each traced at its own sizes,
        for code that needs Python ints (``len(tokens)``). It loads with those sizes
        only, on ``num_devices`` devices.
      num_devices: with ``shapes="concrete"``, the devices it will load on.
      name, version, x64, overwrite: as for ``pxrt.export``.

    The vocabulary size is read from the logits. Returns the artifact path.
    """
    path = os.fspath(path)
    entries = cache_entries(cache)
    lengths, batches, max_length, slots, chunks, chunk_rows, bound = _export_sizes(
        prefill_lengths, prefill_batches, max_length, slots, extend, chunk_lengths,
        chunk_batches, bounds, shapes, constraints, num_devices,
    )  # fmt: skip
    leaves, param_meta = param_entries(params)
    treedef = jax.tree.structure(params)
    functions = {"prefill": on_leaves(prefill, treedef), "decode": on_leaves(decode, treedef)}
    if extend is not None:
        functions["extend"] = on_leaves(extend, treedef)
    x64, why = x64_of(x64, param_meta, None, "pxrt.export_decoder")
    stops = sorted({int(t) for t in stop_ids} | ({int(eos_id)} if eos_id is not None else set()))
    files, tok_config, tok_vocab = artifact_files(tokenizer, chat_template, start_ids)
    dims = _dims(bound, extend is not None)
    with _xla.export_scope(x64), x64_noted(why):
        param_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves]
        if shapes == SYMBOLIC:
            constraints = _shapes.check_constraints(constraints, [list(d) for d in dims.values()])
        plan = _trace_plan(
            shapes, bound, constraints, extend is not None, slots, num_devices, batches,
            lengths, chunk_rows, chunks, max_length,
        )  # fmt: skip
        traced, vocab = _trace(plan, functions, param_specs, cache, shapes, dims)
        _check_stops(stops, vocab)
        _check_tokenizer(tokenizer, tok_vocab, tok_config, vocab)
        manifest = _manifest(
            name or os.path.basename(os.path.normpath(path)), version, x64, param_meta, bound,
            constraints, shapes, num_devices, plan,
            {
                "vocab": vocab,
                "cache": entries,
                "max_length": max_length,
                "slots": slots,
                "prefill_lengths": list(lengths),
                "prefill_batches": list(batches),
                "stop_ids": stops,
                "eos_id": None if eos_id is None else int(eos_id),
                "tokenizer": tok_config,
                "chat_template": chat_template,
            }
            | ({"chunk_lengths": list(chunks), "chunk_batches": list(chunk_rows)}
               if extend is not None else {}),
        )  # fmt: skip
        programs, ccv = _export_traced(traced, functions, manifest, shapes, dims)

    manifest |= {"jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__}
    manifest |= {"calling_convention_version": ccv, "files": {}}
    write_directory(path, manifest, programs | files, leaves, overwrite)
    return path


def _manifest(
    name: str,
    version: str,
    x64: bool,
    param_meta: Any,
    bound: dict,
    constraints: Sequence[str],
    shapes: str,
    num_devices: int,
    plan: list[tuple[str, str, tuple[Any, ...]]],
    decoder: dict[str, Any],
) -> dict[str, Any]:
    """A decoder artifact's manifest (but the versions and files ``export_decoder``
    adds once the programs are exported)."""
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": DECODER_FORMAT_VERSION,
        "kind": KIND,
        "name": name,
        "version": str(version),
        "x64": bool(x64),
        "params": param_meta,
        "bounds": bound,
        "constraints": list(constraints),
        "mesh": {"axes": [BATCH_AXIS], "cache": BATCH_AXIS, "params": "replicated"},
        "decoder": decoder,
    }
    if shapes == CONCRETE:
        manifest["format_version"] = CONCRETE_FORMAT_VERSION
        manifest["shapes"] = CONCRETE
        manifest["bounds"] = {}
        manifest["decoder"]["num_devices"] = num_devices
        manifest["programs"] = [
            {"program": what, "cell": _cell(what, dims_), "file": fname}
            for fname, what, dims_ in plan
        ]
    return manifest


def _dims(bound: dict, extend: bool) -> dict[str, dict]:
    """The programs' dimensions (symbols: their bounds, None for none), by program."""
    dims = {
        "prefill": {"b": None, "seq": bound.get("seq")},
        "decode": {"slots": None, LENGTH_DIM: bound.get(LENGTH_DIM)},
    }
    if extend:
        dims["extend"] = {
            "rows": None,
            CHUNK_DIM: bound.get(CHUNK_DIM),
            LENGTH_DIM: bound.get(LENGTH_DIM),
        }
    return dims


def _check_stops(stops: list[int], vocab: int) -> None:
    bad = [t for t in stops if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop token ids {bad} are outside the vocabulary [0, {vocab})")


def _export_sizes(
    prefill_lengths: Sequence[int],
    prefill_batches: Sequence[int],
    max_length: int,
    slots: int,
    extend: Callable | None,
    chunk_lengths: Sequence[int] | None,
    chunk_batches: Sequence[int] | None,
    bounds: Mapping[str, int | None] | None,
    shapes: str,
    constraints: Sequence[str],
    num_devices: int,
) -> tuple[
    tuple[int, ...], tuple[int, ...], int, int, tuple[int, ...], tuple[int, ...], dict
]:  # fmt: skip
    """``export_decoder``'s sizes checked: (prefill lengths, prefill batches,
    max_length, slots, chunk lengths, chunk rows, the bounds)."""
    lengths = sizes("prefill_lengths", prefill_lengths)
    batches = sizes("prefill_batches", prefill_batches)
    max_length, slots = _positive("max_length", max_length), _positive("slots", slots)
    if lengths[-1] >= max_length:
        raise ValueError(
            f"prefill_lengths go up to {lengths[-1]} but max_length is {max_length}: a prompt "
            "needs room for at least one generated token"
        )
    compiled: dict[str, Sequence[int]] = {"seq": lengths, LENGTH_DIM: (max_length,)}
    chunks: tuple[int, ...] = ()
    chunk_rows: tuple[int, ...] = ()
    if extend is not None:
        chunks = sizes("chunk_lengths", lengths if chunk_lengths is None else chunk_lengths)
        chunk_rows = sizes("chunk_batches", batches if chunk_batches is None else chunk_batches)
        if chunks[-1] > max_length:
            raise ValueError(f"chunk_lengths go up to {chunks[-1]}, over max_length {max_length}")
        compiled[CHUNK_DIM] = chunks
    elif chunk_lengths is not None or chunk_batches is not None:
        raise ValueError("chunk_lengths and chunk_batches are extend's sizes: give extend too")
    bound = _shapes.bounds_for(compiled, bounds)
    if shapes not in (SYMBOLIC, CONCRETE):
        raise ValueError(f"shapes must be {SYMBOLIC!r} or {CONCRETE!r}, got {shapes!r}")
    if shapes == CONCRETE:
        if bounds or constraints:
            raise ValueError("bounds and constraints are for symbolic shapes, not concrete")
        _per_device(slots, num_devices)
    return lengths, batches, max_length, slots, chunks, chunk_rows, bound


def _check_tokenizer(tokenizer: Any, size: int, config: dict | None, vocab: int) -> None:
    """The tokenizer's ids, and the start ids, within the model's vocabulary."""
    if config is None:
        return
    if size > vocab:
        raise ValueError(
            f"tokenizer {os.fspath(tokenizer)!r} has {size} tokens, more than the model's "
            f"vocabulary of {vocab} (its logits): a text prompt could give ids the model "
            "has no embedding for"
        )
    bad = [t for t in config.get("start_ids", ()) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"start_ids {bad} are outside the model's vocabulary of {vocab}")


def _trace_plan(
    shapes: str,
    bound: dict,
    constraints: Sequence[str],
    extend: bool,
    slots: int,
    num_devices: int,
    batches: Sequence[int],
    lengths: Sequence[int],
    chunk_rows: Sequence[int],
    chunks: Sequence[int],
    max_length: int,
) -> list[tuple[str, str, tuple[Any, ...]]]:
    """The programs to trace: (file, "prefill", "decode" or "extend", (rows, sequence
    length, new tokens per row: extend's only)). Symbolic: one of each over symbols
    (in the export scope); concrete: a prefill per (batch, length), decode at each
    device's share of the slots, an extend per (rows, chunk)."""
    plan: list[tuple[str, str, tuple[Any, ...]]]
    if shapes == SYMBOLIC:
        b, seq = _shapes.symbols(["b", "seq"], bound, constraints).values()
        n_slots, length = _shapes.symbols(["slots", LENGTH_DIM], bound, constraints).values()
        plan = [(PREFILL_FILE, "prefill", (b, seq)), (DECODE_FILE, "decode", (n_slots, length))]
        if extend:
            # A chunk always fits in the cache (pxrt starts it early enough); library
            # code that compares the two needs to know.
            rows, chunk, length = _shapes.symbols(
                ["rows", CHUNK_DIM, LENGTH_DIM],
                bound,
                [*constraints, f"{CHUNK_DIM} <= {LENGTH_DIM}"],
            ).values()
            plan.append((EXTEND_FILE, "extend", (rows, length, chunk)))
        return plan
    per_device = _per_device(slots, num_devices)
    plan = [(prefill_file(b, n), "prefill", (b, n)) for b in batches for n in lengths]
    plan.append((DECODE_FILE, "decode", (per_device, max_length)))
    plan += [(extend_file(r, k), "extend", (r, max_length, k)) for r in chunk_rows for k in chunks]
    return plan


def _trace(
    plan: list[tuple[str, str, tuple[Any, ...]]],
    functions: dict[str, Callable],
    param_specs: list,
    cache: Any,
    shapes: str,
    dims: dict[str, dict],
) -> tuple[list[tuple[str, str, str, tuple]], int]:
    """Each program of ``plan`` traced (``eval_shape``) and its outputs checked:
    ((file, program, where, its argument specs) each, the vocabulary)."""
    cache_tree = jax.tree.structure(cache, is_leaf=is_spec)
    specs = jax.tree.leaves(cache, is_leaf=is_spec)
    traced = []
    vocab = None
    for fname, what, (rows_dim, seq_dim, *new) in plan:
        fn = functions[what]
        step = jax.ShapeDtypeStruct((rows_dim,), TOKEN_DTYPE)
        args: tuple[Any, ...]
        if what == "prefill":
            args = (param_specs, jax.ShapeDtypeStruct((rows_dim, seq_dim), TOKEN_DTYPE), step)
        else:
            tokens = jax.ShapeDtypeStruct((rows_dim, *new), TOKEN_DTYPE)
            args = (
                param_specs,
                _cache_shapes(cache_tree, specs, rows_dim, seq_dim),
                tokens,
                step,
            )
        where = (
            what
            if shapes == SYMBOLIC
            else f"{what} at {' x '.join(map(str, (rows_dim, *new, seq_dim)))}"
        )
        with _shapes.explained(where, dims[what]) if shapes == SYMBOLIC else _noted(where):
            out_cache, logits = _pair(jax.eval_shape(fn, *args), what)
        want = _cache_shapes(cache_tree, specs, rows_dim, seq_dim)
        _check_cache(what, "rows" if what == "prefill" else "cache", out_cache, want)
        got = _check_logits(what, logits, (rows_dim, *new))
        if vocab is not None and got != vocab:
            raise ValueError(f"{what}'s logits have {got} entries, prefill's {vocab}")
        vocab = got
        traced.append((fname, what, where, args))
    assert vocab is not None
    return traced, vocab


def _export_traced(
    traced: list[tuple[str, str, str, tuple]],
    functions: dict[str, Callable],
    manifest: dict[str, Any],
    shapes: str,
    dims: dict[str, dict],
) -> tuple[dict[str, bytes], int]:
    """Each traced program exported under the name the manifest binds it by:
    (file -> serialized program, the calling convention version)."""
    fun_names = dict(zip(("prefill", "decode", "extend"), program_names(manifest)))
    programs, ccv = {}, 0
    for fname, what, where, args in traced:

        def named(*a, _fn=functions[what]):
            return _fn(*a)

        named.__name__ = fun_names[what]
        with _shapes.explained(where, dims[what]) if shapes == SYMBOLIC else _noted(where):
            exported = jax_export.export(jax.jit(named))(*args)
        programs[fname] = bytes(exported.serialize())
        ccv = exported.calling_convention_version
    return programs, ccv


def prefill_file(b: int, n: int) -> str:
    """A concrete-shape decoder's prefill program for ``b`` prompts of ``n`` tokens."""
    return f"prefill.{b}x{n}.jaxexport"


def extend_file(rows: int, k: int) -> str:
    """A concrete-shape decoder's extend program for ``rows`` rows of ``k`` tokens."""
    return f"extend.{rows}x{k}.jaxexport"


def _cell(what: str, dims: tuple) -> list:
    """A concrete program's cell in the manifest: prefill (batch, length), decode
    (slots, length), extend (rows, new tokens)."""
    return [dims[0], dims[2]] if what == "extend" else [dims[0], dims[1]]


def _per_device(slots: int, num_devices: int) -> int:
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    if slots % num_devices:
        raise ValueError(
            f"slots={slots} do not split evenly over num_devices={num_devices}: with "
            "shapes='concrete' decode is traced at each device's share of the slots"
        )
    return slots // num_devices


@contextlib.contextmanager
def _noted(where: str) -> Iterator[None]:
    """An error while tracing a concrete-shape program says which one."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"pxrt: tracing {where}")
        raise


def sizes(name: str, values: Any) -> tuple[int, ...]:
    """``values`` as sorted distinct positive ints (bucket sizes), or a ValueError."""
    try:
        out = tuple(sorted({_positive(name, v) for v in values}))
    except TypeError:
        out = ()
    if not out:
        raise ValueError(f"{name} must be a non-empty list of positive ints, got {values!r}")
    return out


def _positive(name: str, value: Any) -> int:
    if not is_int(value, 1) or value > MAX_BUCKET:
        raise ValueError(f"{name} must be an int from 1 to {MAX_BUCKET}, got {value!r}")
    return int(value)


def _pair(out: Any, fn: str) -> tuple[Any, Any]:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"{fn} must return a pair (cache, logits), got {type(out).__name__}")
    return out[0], out[1]


def _cache_shapes(tree: Any, specs: list[TensorSpec], rows: Any, length: Any) -> Any:
    return jax.tree.unflatten(
        tree,
        [jax.ShapeDtypeStruct((rows,) + s.at({LENGTH_DIM: length}), s.dtype) for s in specs],
    )


def _check_cache(fn: str, what: str, got: Any, want: Any) -> None:
    got_tree: Any = jax.tree.structure(got)
    if got_tree != jax.tree.structure(want):
        raise ValueError(
            f"{fn} returns its {what} as {jax.tree.structure(got)}, but the cache spec is "
            f"{jax.tree.structure(want)}"
        )
    for (keypath, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        if tuple(map(str, g.shape)) != tuple(map(str, w.shape)) or g.dtype != w.dtype:
            raise ValueError(
                f"{fn} returns {what}{jax.tree_util.keystr(keypath)} as "
                f"{np.dtype(g.dtype).name}{tuple(map(str, g.shape))}, the cache spec says "
                f"{np.dtype(w.dtype).name}{tuple(map(str, w.shape))}"
            )


def _check_logits(fn: str, logits: Any, lead: tuple) -> int:
    """``logits`` are floating point ``[*lead, vocab]``; returns the vocabulary size."""
    shape = getattr(logits, "shape", None)
    if (
        shape is None
        or len(shape) != len(lead) + 1
        or tuple(map(str, shape[:-1])) != tuple(map(str, lead))
        or not isinstance(shape[-1], int)
        or not jnp.issubdtype(logits.dtype, jnp.floating)
    ):
        want = ", ".join(map(str, lead))
        raise ValueError(
            f"{fn} must return logits of shape [{want}, vocab] (floating point), got "
            f"{getattr(logits, 'dtype', type(logits).__name__)}{tuple(map(str, shape or ()))}"
        )
    return int(shape[-1])


# --------------------------------------------------------------------------- read


def check_decoder_manifest(m: dict[str, Any], where: str) -> None:
    """A decoder manifest's structure, field by field (values are untrusted JSON)."""
    need = needs(where)
    check_common(m, where)
    check_params(m, where)
    check_bounds(m, where, ("seq", LENGTH_DIM, CHUNK_DIM))
    d: Any = m.get("decoder")
    need(isinstance(d, dict), "'decoder'", "must be an object")
    for key in ("vocab", "max_length", "slots"):
        need(
            is_int(d.get(key), 1) and d[key] <= MAX_BUCKET,
            f"decoder.{key}",
            "must be a positive int",
        )
    chunked = "chunk_lengths" in d or "chunk_batches" in d
    for key in ("prefill_lengths", "prefill_batches") + (
        ("chunk_lengths", "chunk_batches") if chunked else ()
    ):
        v = d.get(key)
        need(
            isinstance(v, list) and bool(v) and all(is_int(x, 1) and x <= MAX_BUCKET for x in v),
            f"decoder.{key}",
            "must be a non-empty list of positive ints",
        )
    stops = d.get("stop_ids")
    need(
        isinstance(stops, list) and all(is_int(t) and t < d["vocab"] for t in stops),
        "decoder.stop_ids",
        "must be a list of token ids inside the vocabulary",
    )
    eos = d.get("eos_id")
    need(eos is None or (is_int(eos) and eos < d["vocab"]), "decoder.eos_id", "must be a token id")
    chat = d.get("chat_template")
    need(chat is None or isinstance(chat, str), "decoder.chat_template", "must be null or a string")
    tok = d.get("tokenizer")
    need(
        tok is None
        or tok == {"kind": BYTES}
        or (
            isinstance(tok, dict)
            and set(tok) <= {"kind", "start_ids"}
            and tok.get("kind") in FILES
            and FILES[tok["kind"]] in (m.get("files") or {})
        )
        or (isinstance(tok, dict) and set(tok) == {"kind", "start_ids"} and tok["kind"] == BYTES),
        "decoder.tokenizer",
        f'must be null, {{"kind": "{BYTES}"}}, or a kind of {sorted(FILES)} whose file '
        f"({', '.join(FILES.values())}) is among the files (with start_ids, maybe)",
    )
    start = (tok or {}).get("start_ids") if isinstance(tok, dict) else None
    need(
        start is None
        or (isinstance(start, list) and all(is_int(t) and t < d["vocab"] for t in start)),
        "decoder.tokenizer.start_ids",
        "must be a list of token ids inside the vocabulary",
    )
    if is_concrete(m):
        _check_concrete(m, d, need, chunked)
    cache: Any = d.get("cache")
    need(isinstance(cache, list) and bool(cache), "decoder.cache", "must be a non-empty list")
    for i, e in enumerate(cache):
        field = f"decoder.cache[{i}]"
        need(isinstance(e, dict) and isinstance(e.get("path"), str), field, "needs a string 'path'")
        need(e.get("dtype") in DTYPES, f"{field}.dtype", f"must be one of {', '.join(DTYPES)}")
        shape = e.get("shape")
        need(
            isinstance(shape, list)
            and all(is_int(x) or x == LENGTH_DIM for x in shape)
            and shape.count(LENGTH_DIM) <= 1,
            f"{field}.shape",
            f"must be a list of non-negative ints and at most one {LENGTH_DIM!r}",
        )


def _check_concrete(m: dict[str, Any], d: Any, need: Any, chunked: bool) -> None:
    """A concrete-shape decoder manifest's devices and programs: one per cell traced."""
    need(is_int(d.get("num_devices"), 1), "decoder.num_devices", "must be a positive int")
    need(d["slots"] % d["num_devices"] == 0, "decoder.slots", "must split over num_devices")
    programs: Any = m.get("programs")
    want = [
        {"program": "prefill", "cell": [b, n], "file": prefill_file(b, n)}
        for b in d["prefill_batches"]
        for n in d["prefill_lengths"]
    ]
    want.append(
        {
            "program": "decode",
            "cell": [d["slots"] // d["num_devices"], d["max_length"]],
            "file": DECODE_FILE,
        }
    )
    if chunked:
        want += [
            {"program": "extend", "cell": [r, k], "file": extend_file(r, k)}
            for r in d["chunk_batches"]
            for k in d["chunk_lengths"]
        ]
    need(
        programs == want,
        "'programs'",
        "must list a prefill per batch and length, then decode (then extend per rows and chunk)",
    )


def read(path: str | os.PathLike) -> DecoderArtifact:
    """Read and verify a decoder artifact directory (hashes, format, jax version, both
    programs against the manifest)."""
    path = os.fspath(path)
    manifest = read_manifest(path)
    where = os.path.join(path, MANIFEST)
    if manifest.get("kind") != KIND:
        raise ArtifactError(f"{path} is not a decoder artifact; load it with pxrt.load")
    check_decoder_manifest(manifest, where)
    concrete = is_concrete(manifest)
    chunked = "chunk_lengths" in manifest["decoder"]
    files = (
        [p["file"] for p in manifest["programs"]]
        if concrete
        else [PREFILL_FILE, DECODE_FILE] + ([EXTEND_FILE] if chunked else [])
    )
    verify_files(path, manifest, [*files, PARAMS_FILE])
    check_jax_version(path, manifest)
    prefills = extends = extend = None
    if concrete:

        def each(program: str) -> dict[tuple[int, int], jax_export.Exported]:
            return {
                (p["cell"][0], p["cell"][1]): deserialize(path, p["file"])
                for p in manifest["programs"]
                if p["program"] == program
            }

        prefills = each("prefill")
        prefill = next(iter(prefills.values()))
        if chunked:
            extends = each("extend")
            extend = next(iter(extends.values()))
    else:
        prefill = deserialize(path, PREFILL_FILE)
        if chunked:
            extend = deserialize(path, EXTEND_FILE)
    decode = deserialize(path, DECODE_FILE)
    prefill_name, decode_name, extend_name = program_names(manifest)
    every_prefill = [prefill, *(prefills or {}).values()]
    every_extend = [extend, *(extends or {}).values()] if chunked else []
    if (
        decode.fun_name != decode_name
        or any(p.fun_name != prefill_name for p in every_prefill)
        or any(p is None or p.fun_name != extend_name for p in every_extend)
    ):
        raise ArtifactError(
            f"{path}: the manifest does not match the programs: its params, x64 flag, "
            "vocabulary or cache are not the ones they were exported with (they were "
            "edited); re-export the model"
        )
    params = read_params(path, prefill, manifest["params"])
    args_tree = jax.tree_util.treedef_children(decode.in_tree)[0]
    cache_tree: Any = jax.tree_util.treedef_children(args_tree)[1]  # jaxlib: untyped
    entries = manifest["decoder"]["cache"]
    if cache_tree.num_leaves != len(entries):
        raise ArtifactError(
            f"{path}: the decode program's cache has {cache_tree.num_leaves} arrays, the "
            f"manifest lists {len(entries)}; re-export the model"
        )
    cache = jax.tree.unflatten(cache_tree, [TensorSpec(e["shape"], e["dtype"]) for e in entries])
    return DecoderArtifact(
        path, manifest, prefill, decode, params, cache, prefills, extend, extends
    )
