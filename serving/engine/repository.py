"""A model repository: a directory of ``<model>/<version>/`` artifact directories (Triton's
layout), and which of them a ``serving.Server`` serves.

- A model's name is its directory's name; a version is a subdirectory named by a positive
  integer that holds a ``manifest.json`` (other entries are ignored).
- A version policy per model picks the versions to serve: ``latest:N`` (the N highest,
  default ``latest:1``), ``all``, or ``specific:1,3``.
- Control modes, as Triton's: ``none`` serves what the policies pick at start and never
  changes; ``explicit`` serves nothing until ``load(name)`` (``--load-model`` at start);
  ``poll`` serves what the policies pick and rescans every ``poll_s``: new versions are
  loaded, removed ones unloaded.

Loading a version compiles it while everything else keeps serving (``Server.load_model``);
a version that fails to load is reported (``index``) and changes nothing served. So is a
new version whose inputs or outputs (names, dtypes, shapes) differ from those of the
version unversioned requests reach now, unless the model is allowed to change them
(``allow_signature_change``): its clients would break without having changed anything.

``load`` of a version served already reloads it when its files changed since it loaded
(Triton's reload; its fingerprint: the files' names, sizes and times, and the manifest's
hash, which holds every file's): the new files compile while the old ones' model serves,
which answers what it accepted once the new one takes over. Unchanged: a no-op.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import RepositoryError, UnknownModel
from ..logs import printable
from ..options import BatchingOptions

if TYPE_CHECKING:
    from .server import Server


log = logging.getLogger("pxrt.repository")

MODES = ("none", "explicit", "poll")


def check_name(name: str) -> str:
    """``name`` if it can be a model of a repository: one directory name (no ``/``,
    ``\\``, NUL, no leading ``.``, at most 255 characters). Names come from clients
    (the load and unload APIs): anything else could reach outside the repository."""
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 255
        or name.startswith(".")
        or any(c in name for c in "/\\\0")
    ):
        shown = name[:80] if isinstance(name, str) else name
        raise RepositoryError(
            f"model name {shown!r}: a model is named by one directory of the repository "
            "(no '/', '\\', NUL or leading '.')"
        )
    return name


def _inside(path: str, root: str) -> bool:
    """Whether ``path``, symlinks resolved, lies under ``root`` (resolved)."""
    return os.path.commonpath([os.path.realpath(path), root]) == root


def _signature(manifest: dict) -> dict[str, dict[str, str]]:
    """A manifest's inputs and outputs as clients see them: kind -> name -> dtype and
    shape."""
    return {
        kind: {t["name"]: f"{t['dtype']}{list(t['shape'])}" for t in manifest[kind + "s"]}
        for kind in ("input", "output")
    }


def parse_policy(text: str) -> tuple[str, Any]:
    """``"latest:N"``, ``"all"`` or ``"specific:V,V"`` -> (kind, argument)."""
    kind, _, arg = str(text).partition(":")
    try:
        if kind == "all" and not arg:
            return "all", None
        if kind == "latest":
            n = int(arg or "1")
            if n >= 1:
                return "latest", n
        if kind == "specific":
            versions = [int(v) for v in arg.split(",")]
            if versions and all(v >= 1 for v in versions):
                return "specific", sorted(set(versions))
    except ValueError:
        pass
    raise ValueError(f"version policy {text!r}: expected latest:N, all or specific:V[,V...]")


class Repository:
    """The models of the directory ``root`` served by ``server``.

    Args:
      policies: model name -> version policy text (default ``latest:1``).
      defaults: the batching options of every model of the directory (also of models
        added to it later): ``BatchingOptions``, or a mapping of them.
      options: model name -> its own options (a mapping is taken over ``defaults``).
      mode: ``none``, ``explicit`` or ``poll``.
      allow_signature_change: names of the models whose new versions may change their
        inputs or outputs (``"*"``: every model); a new version of any other is refused.
    """

    def __init__(
        self,
        root: str,
        server: Server,
        *,
        mode: str = "none",
        policies: dict[str, str] | None = None,
        defaults: BatchingOptions | Mapping[str, Any] | None = None,
        options: Mapping[str, BatchingOptions | Mapping[str, Any]] | None = None,
        load_options: dict | None = None,
        model_load_options: Mapping[str, dict] | None = None,
        allow_signature_change: Collection[str] = (),
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"model control mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not os.path.isdir(root):
            raise FileNotFoundError(f"model repository {root!r} is not a directory")
        self.root = root
        self._real_root = os.path.realpath(root)
        self.server = server
        self.mode = mode
        self.policies = {k: parse_policy(v) for k, v in (policies or {}).items()}
        if not isinstance(defaults, BatchingOptions):
            defaults = BatchingOptions.from_mapping(defaults or {})
        self.defaults = defaults
        self.options = {
            name: o if isinstance(o, BatchingOptions) else BatchingOptions.from_mapping(o, defaults)
            for name, o in (options or {}).items()
        }
        self.load_options = load_options or {}
        #: name -> its own options of ``pxrt.load`` (placement), instead of load_options.
        self.model_load_options = dict(model_load_options or {})
        self.allow_signature_change = frozenset(allow_signature_change)
        # (name, version) -> (state, reason) of versions loading, failed or unloading.
        self._states: dict[tuple[str, str], tuple[str, str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Models this repository has loaded: the only ones it unloads when their
        # directory goes (the server may serve others, given it by other means).
        self._ours: set[str] = set()
        # Versions that failed to load or were refused, and their directory's state
        # then: a poll tries (and warns) again only once the directory changes.
        self._failed: dict[tuple[str, str], tuple | None] = {}
        # Versions this repository serves, and their directory's fingerprint when their
        # load began: ``load`` reloads one whose files changed since.
        self._loaded: dict[tuple[str, str], tuple | None] = {}

    # ------------------------------------------------------------------ the directory

    def scan(self) -> dict[str, list[str]]:
        """Model name -> its version directories (ascending), as the directory is now."""
        out: dict[str, list[str]] = {}
        for name in sorted(os.listdir(self.root)):
            versions = self.scan_model(name)
            if versions is not None:
                out[name] = versions
        return out

    def scan_model(self, name: str) -> list[str] | None:
        """The version directories of model ``name`` (ascending); None when the
        repository has no such model. Only what lies inside the repository counts: a
        name that is not one directory name, or a model or version directory that is a
        symlink leaving the repository, is no model or version."""
        try:
            check_name(name)
        except RepositoryError:
            return None
        path = os.path.join(self.root, name)
        if not os.path.isdir(path) or not _inside(path, self._real_root):
            return None
        versions = [
            v
            for v in os.listdir(path)
            if v.isascii()
            and v.isdigit()
            and int(v) >= 1
            and os.path.isfile(os.path.join(path, v, "manifest.json"))
            and _inside(os.path.join(path, v), self._real_root)
        ]
        return sorted(versions, key=int)

    def wanted(self, name: str, available: list[str]) -> list[str]:
        """The versions of ``name`` its policy picks from ``available``."""
        kind, arg = self.policies.get(name, ("latest", 1))
        if kind == "all":
            return list(available)
        if kind == "specific":
            return [v for v in available if int(v) in arg]
        return available[-arg:]

    # ------------------------------------------------------------------ actions

    def _lock(self, name: str) -> asyncio.Lock:
        """One lock per model: its loads and unloads go one at a time."""
        return self._locks.setdefault(name, asyncio.Lock())

    def _served(self, name: str) -> list[str]:
        if self.server.is_decoder(name):
            return [self.server.decoder(name).version]
        try:
            return self.server.versions(name)
        except UnknownModel:
            return []

    def _decoder_dir(self, name: str, version: str) -> bool:
        """Whether that version directory holds a decoder (generation) artifact."""
        try:
            with open(os.path.join(self.root, name, version, "manifest.json")) as f:
                return json.load(f).get("kind") == "decoder"
        except (OSError, ValueError, AttributeError):
            return False  # the load reports what is wrong with it

    async def start(self, load: list[str] | None = None) -> None:
        """What the mode serves at start: every model (none, poll), or ``load`` only."""
        names = list(self.scan()) if self.mode != "explicit" else list(load or [])
        for name in names:
            await self.sync(name)

    async def sync(
        self, name: str, retry_failed: bool = True, reload_changed: bool = False
    ) -> list[str]:
        """Serve the versions of ``name`` its policy picks now: load the new ones (a
        failure is recorded and leaves the rest alone; without ``retry_failed``, one
        that failed is tried again only once its directory changes), then unload the
        others. ``reload_changed``: also reload the versions served whose files changed
        since they loaded (one that fails raises ``RepositoryError`` once the rest is
        done; it still serves as it loaded). Returns the versions served after."""
        check_name(name)
        async with self._lock(name):
            available = self.scan_model(name)
            if available is None:
                if not self._served(name):
                    self._forget(name, [])
                    raise RepositoryError(f"no model {name!r} in the repository {self.root}")
                available = []
            self._forget(name, available)
            want = self.wanted(name, available)
            if len(want) > 1 and self._decoder_dir(name, want[-1]):
                # A decoder serves one version (a load replaces it): its newest wanted.
                want = want[-1:]
            reload_failed = []
            for version in want:
                key = (name, version)
                if version in self._served(name):
                    if reload_changed and self._changed(name, version):
                        why = await self._load(name, version, replace=True)
                        if why is not None:
                            reload_failed.append(f"version {version}: its changed files {why}")
                    continue
                if not retry_failed and key in self._failed:
                    if self._failed[key] == self._stamp(name, version):
                        continue  # as it was when it failed: the same failure, once told
                await self._load(name, version)
            for version in self._served(name):
                if version not in want and self._loaded_ok(name, want):
                    await self._unload(name, version)
            served = self._served(name)
            for key in [k for k in self._loaded if k[0] == name and k[1] not in served]:
                del self._loaded[key]  # (a decoder's version replaced by a newer one)
            if reload_failed:
                raise RepositoryError(
                    f"model {name!r}: {'; '.join(reload_failed)} (it serves as it loaded)"
                )
            return served

    def _forget(self, name: str, available: list[str]) -> None:
        """What is known of versions of ``name`` whose directory is gone (a failure, a
        refusal): they leave the index with it."""
        for key in [k for k in self._states if k[0] == name and k[1] not in available]:
            if self._states[key][0] == "UNAVAILABLE":
                del self._states[key]
        for key in [k for k in self._failed if k[0] == name and k[1] not in available]:
            del self._failed[key]

    def _stamp(self, name: str, version: str) -> tuple | None:
        """The state of a version directory (its files' names, sizes and times): when it
        changes, a version that failed may load now."""
        try:
            with os.scandir(os.path.join(self.root, name, version)) as entries:
                return tuple(
                    sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries)
                )
        except OSError:
            return None

    def _fingerprint(self, name: str, version: str) -> tuple | None:
        """What says whether a version directory's files changed: ``_stamp`` (names,
        sizes, times) and the manifest's hash (it holds each file's sha256: files written
        again within the times' resolution, with the same sizes, differ there)."""
        stamp = self._stamp(name, version)
        try:
            with open(os.path.join(self.root, name, version, "manifest.json"), "rb") as f:
                manifest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return None
        return stamp, manifest

    def _changed(self, name: str, version: str) -> bool:
        """Whether a version served, loaded by this repository, has changed files since
        its load began (one served by other means is not this repository's to reload)."""
        key = (name, version)
        return key in self._loaded and self._loaded[key] != self._fingerprint(name, version)

    def _loaded_ok(self, name: str, want: list[str]) -> bool:
        # Old versions go only once a wanted one serves: never nothing served by a reload.
        return not want or any(v in self._served(name) for v in want)

    def _signature_change(self, name: str, path: str) -> str | None:
        """Why the version at ``path`` may not be served: its inputs or outputs differ
        from those of the version of ``name`` served now (None: they do not, nothing is
        served, or the model may change them)."""
        if name in self.allow_signature_change or "*" in self.allow_signature_change:
            return None
        try:
            served = self.server.model(name)
        except UnknownModel:
            return None
        try:
            with open(os.path.join(path, "manifest.json")) as f:
                new = _signature(json.load(f))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None  # the load reports what is wrong with it
        old = _signature(served.artifact.manifest)
        if new == old:
            return None
        changed = sorted(
            f"{kind} {n!r}: {old[kind].get(n, 'none')} -> {new[kind].get(n, 'none')}"
            for kind in ("input", "output")
            for n in set(old[kind]) | set(new[kind])
            if old[kind].get(n) != new[kind].get(n)
        )
        return (
            f"its inputs or outputs differ from version {served.version}'s, which clients "
            f"use now ({'; '.join(changed)}); allow it with allow_signature_change "
            "(--allow-signature-change, or the model's config section)"
        )

    async def _load(self, name: str, version: str, replace: bool = False) -> str | None:
        """Load a version (``replace``: reload one served); None, or why it was not.
        A reload that fails is not in the index: the version served is still READY."""
        key = (name, version)
        path = os.path.join(self.root, name, version)
        fingerprint = self._fingerprint(name, version)  # before the load reads the files
        if not replace:
            self._failed[key] = self._stamp(name, version)  # (until it loads)
        refused = self._signature_change(name, path)
        if refused is not None:
            if not replace:
                self._states[key] = ("UNAVAILABLE", refused)
            log.warning("pxrt: %r version %s not loaded: %s", name, version, printable(refused))
            return f"were not loaded: {refused}"
        if not replace:
            self._states[key] = ("LOADING", "")
        try:
            model = await self.server.load_model(
                name,
                path,
                load_options=self.model_load_options.get(name, self.load_options),
                version=version,
                options=self.options.get(name, self.defaults),
                replace=replace,
            )
        except Exception as exc:  # noqa: BLE001 - reported, and nothing served changes
            reason = f"{type(exc).__name__}: {exc}"
            if not replace:
                self._states[key] = ("UNAVAILABLE", reason)
            log.warning("pxrt: %r version %s failed to load: %s", name, version, printable(reason))
            return f"failed to load: {reason}"
        self._states.pop(key, None)
        self._failed.pop(key, None)
        self._loaded[key] = fingerprint
        self._ours.add(name)
        summary = getattr(model, "load_summary", None)  # (a decoder has programs, not cells)
        log.info(
            "pxrt: %r version %s ready: %s",
            name,
            version,
            summary() if summary else f"loaded in {model.load_s:.2f} s",
        )
        return None

    async def _unload(self, name: str, version: str) -> None:
        key = (name, version)
        self._states[key] = ("UNLOADING", "")
        try:
            await self.server.unload_model(name, version)
        except UnknownModel:
            pass  # already gone (unloaded by other means meanwhile)
        finally:
            self._states.pop(key, None)
            self._loaded.pop(key, None)

    async def load(self, name: str) -> list[str]:
        """``load`` of the repository API: (re)serve ``name`` as its policy says now."""
        if self.mode == "none":
            raise RepositoryError(
                "the model control mode is none: models cannot be loaded or unloaded "
                "(start pxrt serve with --model-control-mode explicit or poll)"
            )
        served = await self.sync(name, reload_changed=True)
        failed = [r for (n, _), (s, r) in self._states.items() if n == name and s == "UNAVAILABLE"]
        if not served and failed:
            raise RepositoryError(f"model {name!r} failed to load: {failed[-1]}")
        if not served:
            raise RepositoryError(
                f"model {name!r} has no version to serve: no <version>/manifest.json "
                "its version policy picks"
            )
        return served

    async def unload(self, name: str) -> None:
        """``unload`` of the repository API: stop serving every version of ``name``
        (every request they accepted is answered first)."""
        if self.mode == "none":
            raise RepositoryError(
                "the model control mode is none: models cannot be loaded or unloaded "
                "(start pxrt serve with --model-control-mode explicit or poll)"
            )
        check_name(name)
        if not self._served(name):
            raise RepositoryError(f"model {name!r} is not loaded")
        await self.unload_all(name)

    async def unload_all(self, name: str) -> None:
        """Stop serving every version of ``name`` (a no-op when none is served)."""
        async with self._lock(name):
            for version in self._served(name):
                await self._unload(name, version)
            self._ours.discard(name)

    async def poll_once(self) -> None:
        """One scan: every model of the directory served as its policy says; models
        this repository loaded whose directory is gone are unloaded. A failure is logged
        and the rest goes on."""
        try:
            present = self.scan()
        except OSError:
            log.exception("pxrt: repository scan of %s failed", self.root)
            return
        for name in sorted(set(present) | self._ours | {n for n, _ in self._failed}):
            try:
                if name in present:
                    await self.sync(name, retry_failed=False)
                else:
                    self._forget(name, [])
                    if name in self._ours:
                        await self.unload_all(name)
            except Exception:  # noqa: BLE001 - the next scan tries again
                log.exception("pxrt: repository poll of %r failed", name)

    async def poll_forever(self, period_s: float) -> None:
        """``poll_once`` every ``period_s``."""
        while True:
            await asyncio.sleep(period_s)
            await self.poll_once()

    def index(self) -> list[dict]:
        """Every model version of the directory and of the server: name, version, state
        (READY, LOADING, UNLOADING, UNAVAILABLE) and, when not ready, why."""
        rows: dict[tuple[str, str], dict] = {}
        for name, versions in self.scan().items():
            for version in versions:
                rows[(name, version)] = {
                    "name": name,
                    "version": version,
                    "state": "UNAVAILABLE",
                    "reason": "not loaded",
                }
        for name in [*self.server.models, *self.server.decoders]:
            for version in self._served(name):
                rows[(name, version)] = {
                    "name": name,
                    "version": version,
                    "state": "READY",
                    "reason": "",
                }
        for (name, version), (state, reason) in self._states.items():
            rows[(name, version)] = {
                "name": name,
                "version": version,
                "state": state,
                "reason": reason,
            }
        return [
            rows[k] for k in sorted(rows, key=lambda k: (k[0], int(k[1]) if k[1].isdigit() else 0))
        ]
