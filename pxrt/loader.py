"""``pxrt.load``: the front door. It reads an artifact's manifest and hands the artifact
to the loader of its kind: a model (``pxrt.executable``), a decoder
(``pxrt.decoder.load``) or one process of a multi-host group (``pxrt.multihost``). Each
loader builds on the shared compiling pieces in ``pxrt.compiling``; none imports
another's private names, and none imports this module. (Named ``loader``: a submodule
``pxrt.load`` would replace the function ``pxrt.load`` once imported.)
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from . import artifact


def load(
    path: str | os.PathLike,
    *,
    devices: Sequence | None = None,
    buckets: Sequence[int] | Sequence[tuple[int, ...]] | None = None,
    dim_buckets: Mapping[str, Sequence[int]] | None = None,
    progress: bool | None = None,
    compilation_cache: bool | str | os.PathLike = True,
    fast_path: bool = True,
    zero_copy: bool = True,
    staging_depth: int = 3,
    max_routes: int = 256,
    compile_workers: int | None = None,
    placement: str | None = None,
    instances: int | None = None,
    devices_per_instance: int | None = None,
    distributed: Any = None,
    **decoder_options: Any,
) -> Any:
    """Load an artifact directory and compile every bucket; returns a ``Model``, or for
    a decoder artifact (``pxrt.export_decoder``) a ``pxrt.generate.Decoder``, loaded by
    ``pxrt.decoder.load.load_decoder`` with ``devices``, ``progress``,
    ``compilation_cache`` and ``decoder_options`` (``slots``, ``max_length``,
    ``prefill_lengths``, ``prefill_batches``, ``chunk_lengths``, ``chunk_batches``,
    ``chunk_tokens``, ``prefix_cache_tokens``, ``prefix_block``, ``step_slots``,
    ``speculative_tokens``, ``sampling_controls``, ``max_waiting``, ``itl_bound_ms``,
    ``overlap_prefill``, ``multi_step``).

    A model with named dimensions is compiled on a grid: every batch bucket at every
    combination of the named dimensions' lengths (a cell each).

    Args:
      path: a directory written by ``pxrt.export``. Its hashes, format version and jax
        version are checked first.
      devices: the devices of the 1-D data mesh (default: all local devices). The batch
        is sharded over them; params are replicated on each.
      buckets: batch sizes to compile (default: the artifact's). Each is rounded up to a
        multiple of the device count so it splits evenly. For named dimensions, cells
        may be listed instead: ``(batch, length, ...)`` tuples, a length per named
        dimension in order, to compile part of the grid.
      dim_buckets: named dimension -> lengths to compile (default: the artifact's); the
        largest is the longest input served.
      progress: show a progress bar while compiling (default: when stderr is a terminal).
      compilation_cache: keep jax's persistent compilation cache (compiled native code)
        so a second load of the same program on this machine is faster: True uses a
        per-user directory (``$PXRT_CACHE_DIR``, else ``$XDG_CACHE_HOME/pxrt/xla`` or
        ``~/.cache/pxrt/xla``), a path uses that directory, False none. Never inside
        the artifact: only this host writes the native code it runs, and a directory
        that others can write to is not used.
      fast_path: allow the raw execution path (each bucket is still checked against
        ``Compiled.__call__`` and falls back to it if they differ).
      zero_copy: let device buffers alias the staging slots instead of copying them
        (a slot is refilled only after its batch's outputs were fetched).
      staging_depth: staging slots per bucket (batches of one bucket in flight at once).
      max_routes: bound of the request-signature route cache.
      compile_workers: threads compiling cells at once (default: one per CPU core; XLA's
        compile releases the GIL).
      placement: how the model uses ``devices``. ``"sharded"``: one program with the
        batch split over all of them. ``"replicated"``: ``instances`` copies of the
        model, each on its own ``devices_per_instance`` devices (default: one per
        device), each running whole batches; a batch goes to the instance that will
        finish it first. ``"auto"`` (the default; ``$PXRT_PLACEMENT`` sets another):
        measures at load the one program against instances (one per device, and
        halving counts down to one; just ``instances`` when given), the same rows in
        flight on each, and keeps the fastest; the choice is stored with the
        executables, and ``placement_reason`` says why.
      instances, devices_per_instance: for ``"replicated"`` and ``"auto"``; either one
        gives the other.
      distributed: a ``pxrt.multihost.Distributed`` (coordinator, num_processes,
        process_id): load as one process of a multi-host group, the batch sharded over
        every process's devices. Process 0 gets the ``Model`` (its batches run in
        lockstep on the whole group); the others get a ``pxrt.multihost.Follower``,
        whose ``follow()`` runs them (``docs/multihost.md``).
    """
    if artifact.kind(artifact.read_manifest(os.fspath(path))) == "decoder":
        from .decoder.load import load_decoder

        if placement is not None or instances or devices_per_instance:
            warnings.warn(
                f"pxrt: {path}: a decoder runs one program over its devices; "
                f"placement={placement!r}, instances and devices_per_instance are ignored",
                RuntimeWarning,
                stacklevel=2,
            )

        return load_decoder(
            path,
            devices=devices,
            progress=progress,
            compilation_cache=compilation_cache,
            distributed=distributed,
            **decoder_options,
        )
    if decoder_options:
        raise TypeError(
            f"load() got options {sorted(decoder_options)} that only decoder artifacts take"
        )
    if distributed is not None:
        from . import multihost

        if devices is not None or placement is not None or instances or devices_per_instance:
            raise ValueError(
                "distributed: a multi-host load runs one program over every process's "
                "devices; devices, placement, instances and devices_per_instance do not apply"
            )
        return multihost.load(
            path,
            distributed,
            buckets=buckets,
            dim_buckets=dim_buckets,
            progress=progress,
            compilation_cache=compilation_cache,
            staging_depth=staging_depth,
            max_routes=max_routes,
            compile_workers=compile_workers,
        )
    from .executable import load_model

    return load_model(
        path,
        devices=devices,
        buckets=buckets,
        dim_buckets=dim_buckets,
        progress=progress,
        compilation_cache=compilation_cache,
        fast_path=fast_path,
        zero_copy=zero_copy,
        staging_depth=staging_depth,
        max_routes=max_routes,
        compile_workers=compile_workers,
        placement=placement,
        instances=instances,
        devices_per_instance=devices_per_instance,
    )
