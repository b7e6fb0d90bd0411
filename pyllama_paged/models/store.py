"""The local model store: what `pull` fetched, found again by name.

Layout under the store's root ($PYLLAMA_PAGED_MODELS; else $XDG_CACHE_HOME/pyllama-paged/models,
else ~/.cache/pyllama-paged/models):

    blobs/sha256-<hex>              a registry layer, complete and verified (shared by tags)
    blobs/sha256-<hex>.partial      a download in progress; the next pull resumes it
    manifests/<host>/<namespace>/<name>/<tag>.json   one per pulled name

A manifest names the GGUF ("model": path, digest, size), the extra layers kept beside it
("files": template, params, system, license) and a few GGUF facts for listings. Hugging Face
files stay in Hugging Face's cache (shared with other tools); their manifest points there.
Manifests are written last and atomically: a name exists only once its files are complete.
manifests/index.json maps each name (lower case) to its manifest, so a name that is not
there costs one stat, not a walk over every manifest; any process that writes or deletes a
manifest rewrites it.

The store's folders are made 0700 and its files 0600 (models.store_files); a delete removes
only files under the store's root, and of Hugging Face's cache only the files this store
downloaded there, never one a server is serving."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..gguf.reader import read_metadata
from .refs import ModelRef, parse_reference
from .store_files import folder_problem, private_folder, remove_entry, sweep_stale, write_new

STORE_ENV = "PYLLAMA_PAGED_MODELS"
INDEX_NAME = "index.json"
log = logging.getLogger("pyllama_paged.models")


def hub_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Hugging Face's cache folder: cache_dir, HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub
    (read now: huggingface_hub reads it once, at import)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home).expanduser() / "hub"


def _inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether path, every link resolved, lies under root (resolved too)."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real != top and real.startswith(top.rstrip(os.sep) + os.sep)


def store_root() -> Path:
    """The store's directory for this environment (read at each call)."""
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pyllama-paged" / "models"


@dataclass
class StoredModel:
    """A pulled model: its name, GGUF path, sha256 digest and what listings show."""

    name: str
    path: str
    digest: str
    size: int
    source: str
    pulled_at: float
    manifest: Path
    details: dict = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    owned: bool = True   # the store fetched the GGUF itself (a Hub file may have been in the cache before)


def gguf_details(path: str | os.PathLike) -> dict:
    """Ollama's "details" of a GGUF from its metadata ({} when it cannot be read)."""
    try:
        meta = read_metadata(str(path))
    except Exception as e:   # a listing must not fail for one odd file
        log.warning("cannot read the GGUF metadata of %s: %s", path, e)
        return {}
    arch = str(meta.get("general.architecture", ""))
    return {"format": "gguf", "family": arch, "families": [arch] if arch else [],
            "parameter_size": str(meta.get("general.size_label", "")),
            "file_type": meta.get("general.file_type")}


class ModelStore:
    """The store at root (default: store_root() now)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else store_root()
        self._index: dict[str, str] = {}
        self._index_stamp: tuple | None = None
        self._unsafe_warned = False

    def blob_path(self, digest: str) -> Path:
        """Where a layer with this "sha256:<hex>" digest lives."""
        return self.root / "blobs" / digest.replace(":", "-")

    def manifest_path(self, ref: ModelRef) -> Path:
        """The manifest file of a reference (parts are path-safe: refs checks them)."""
        return self.root / "manifests" / ref.host / ref.namespace / ref.name / f"{ref.tag or 'latest'}.json"

    def prepare(self) -> None:
        """Check (or make) the store's folders and remove what hung-up pulls left long ago;
        UnsafeStoreError for a folder another account could write into."""
        for folder in (self.root, self.root / "blobs", self.root / "manifests"):
            private_folder(folder)
        sweep_stale(self.root / "blobs")

    def _safe(self) -> bool:
        """Whether the store may be read (a root another account could write into is not)."""
        problem = folder_problem(self.root)
        if problem and not self._unsafe_warned:
            log.warning("ignoring the model store: %s", problem)
            self._unsafe_warned = True
        return problem is None

    def write(self, ref: ModelRef, model: dict, files: dict[str, dict], origin: dict) -> StoredModel:
        """Record a pulled model (model: path, digest, size; files: role -> path, digest)."""
        record = {"schema": 1, "name": ref.display(), "source": ref.source, "model": model, "files": files,
                  "origin": origin, "details": gguf_details(self._absolute(model["path"])),
                  "pulled_at": time.time()}
        self.prepare()
        path = self.manifest_path(ref)
        folder = self.root / "manifests"
        for part in path.parent.relative_to(folder).parts:
            folder = private_folder(folder / part)
        write_new(path, json.dumps(record, indent=1).encode())
        self._write_index()
        return self._stored(path, record)

    def _absolute(self, path: str) -> str:
        # registry blobs are recorded relative to the root, so a moved store still works
        return str(self.root / path) if not os.path.isabs(path) else path

    def _stored(self, manifest: Path, record: dict) -> StoredModel:
        model = record["model"]
        return StoredModel(name=record["name"], path=self._absolute(model["path"]), digest=model["digest"],
                           size=int(model["size"]), source=record["source"], pulled_at=float(record["pulled_at"]),
                           manifest=manifest, details=record.get("details") or {},
                           files={role: self._absolute(f["path"]) for role, f in (record.get("files") or {}).items()},
                           owned=record["source"] != "hf" or model.get("downloaded_here") is True)

    def _read(self, manifest: Path) -> StoredModel | None:
        try:
            return self._stored(manifest, json.loads(manifest.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the unreadable model manifest %s: %s", manifest, e)
            return None

    def _manifests(self) -> list[Path]:
        if not self._safe():
            return []
        return sorted((self.root / "manifests").glob("*/*/*/*.json"))

    def _scan(self) -> dict[str, str]:
        """key (lower case) -> manifest path relative to manifests/, from the files themselves."""
        index = {}
        for manifest in self._manifests():
            host, namespace, name = manifest.parts[-4:-1]
            index[f"{host}/{namespace}/{name}:{manifest.stem}".lower()] = "/".join(manifest.parts[-4:])
        return index

    def _write_index(self) -> None:
        self._index = self._scan()
        write_new(self.root / "manifests" / INDEX_NAME, json.dumps(self._index).encode())
        self._index_stamp = None   # read back (its stamp) at the next lookup

    def _lookup(self, key: str) -> Path | None:
        """The manifest of a key through the index (read again only when a writer changed it)."""
        index_file = self.root / "manifests" / INDEX_NAME
        try:
            st = os.stat(index_file)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._index_stamp or stamp is None:
            index = None
            if stamp is not None:
                try:
                    loaded = json.loads(index_file.read_text())
                    index = loaded if isinstance(loaded, dict) else None
                except (OSError, ValueError):
                    index = None
            if index is None:   # a store from before the index, or an unreadable one: once
                if not (self.root / "manifests").is_dir():
                    return None
                index = self._scan()
                if self._safe():
                    try:
                        write_new(index_file, json.dumps(index).encode())
                        st = os.stat(index_file)
                        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                    except OSError as e:
                        log.warning("cannot write the manifest index %s: %s", index_file, e)
            self._index, self._index_stamp = index, stamp
        relative = self._index.get(key)
        if not isinstance(relative, str) or ".." in relative.split("/"):
            return None
        return self.root / "manifests" / relative

    def find(self, ref: ModelRef) -> StoredModel | None:
        """The stored model of a reference, its name compared without case."""
        if not self._safe():
            return None
        exact = self.manifest_path(ref)
        if exact.is_file():
            return self._read(exact)
        found = self._lookup(ref.key())
        return self._read(found) if found is not None and found.is_file() else None

    def find_name(self, name: str) -> StoredModel | None:
        """The stored model a user-typed name means, or None (also for what is no reference)."""
        try:
            return self.find(parse_reference(name))
        except ValueError:
            return None

    def list(self, limit: int | None = None) -> list[StoredModel]:
        """Every stored model whose manifest reads (and whose GGUF is still there), in name
        order; the first limit of them only when limit is given (the rest are not read)."""
        out = []
        for manifest in self._manifests():
            if limit is not None and len(out) >= limit:
                break
            model = self._read(manifest)
            if model is not None and os.path.exists(model.path):
                out.append(model)
        return out

    def count(self) -> int:
        """How many manifests the store holds (none is read)."""
        return len(self._manifests())

    def removable(self, model: StoredModel, path: str, protected: set[str]) -> bool:
        """Whether a delete of model may unlink path: a file under the store's root (or, for
        a Hub model this store downloaded, its file in Hugging Face's cache), never one in
        protected (real paths a server is serving)."""
        if os.path.realpath(path) in protected:
            return False
        if _inside(path, self.root):
            return True
        return model.source == "hf" and _hub_gguf(model, path) and model.owned and _inside(path, hub_cache_dir())

    def delete(self, model: StoredModel, protected: set[str] | frozenset = frozenset()) -> list[str]:
        """Forget a stored model: its manifest, then the files no other manifest uses and that
        it may remove (removable); returns the paths it kept for that reason."""
        if not _inside(model.manifest, self.root / "manifests"):
            raise ValueError(f"{model.manifest} is not a manifest of the store at {self.root}")
        remove_entry(model.manifest)
        for parent in list(model.manifest.parents)[:3]:   # empty name/namespace/host folders
            try:
                parent.rmdir()
            except OSError:
                break
        self._write_index()
        still_used = {p for m in self.list() for p in [m.path, *m.files.values()]}
        kept = []
        for path in [model.path, *model.files.values()]:
            if path in still_used:
                continue
            if not self.removable(model, path, set(protected)):
                kept.append(path)
                log.warning("delete of %s: keeping %s (outside the store, not downloaded by it, or served)",
                            model.name, path)
                continue
            if model.source == "hf" and _hub_gguf(model, path):
                remove_hub_file(Path(path))
            else:
                remove_entry(Path(path))
        return kept


def _hub_gguf(model: StoredModel, path: str) -> bool:
    """Whether path is a Hub model's GGUF: its file, or a later part of its split (files "split-*")."""
    return path == model.path or any(role.startswith("split-") and p == path for role, p in model.files.items())


def remove_hub_file(link: Path) -> None:
    """Remove a file from Hugging Face's cache: the snapshot's link, and its blob once no
    other snapshot of the repository links to it."""
    if not link.is_symlink():
        link.unlink(missing_ok=True)
        return
    blob = _link_target(link)
    link.unlink()
    if not _inside(blob, hub_cache_dir()):
        return   # a link out of the cache: the file it names is not the cache's to remove
    repo = blob.parent.parent   # models--USER--REPO/blobs/<etag>
    others = [p for p in (repo / "snapshots").rglob("*") if p.is_symlink() and _link_target(p) == blob]
    if not others:
        # the blob itself, never what it may link to (huggingface_hub's store shared across repositories)
        blob.unlink(missing_ok=True)


def _link_target(link: Path) -> Path:
    """Where a symbolic link points, one level deep."""
    return Path(os.path.normpath(link.parent / os.readlink(link)))
