"""Llama.from_pretrained's file lookup: local directories, the Hugging Face
cache already on disk and installed model packages first; then a download from
the Hub (models.hub) into Hugging Face's cache, or local_dir when given."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from pathlib import Path

from ..errors import DownloadError, ModelNotFoundError, RequestError
from ..models.download import Progress
from ..models.hub import choose_glob, download_file, hub_cache_dir, match_glob, repo_files

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def _in_directory(root: Path, pattern: str) -> list[str]:
    """Files under root whose relative path (or name) matches the glob."""
    if not root.is_dir():
        return []
    names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()]
    return [str(root / n) for n in match_glob(names, pattern)]


def _hf_cache_dirs(repo_id: str, cache_dir: str | os.PathLike | None) -> list[Path]:
    """The snapshot folders of repo_id in the Hugging Face cache (as huggingface_hub lays it out)."""
    folder = "models--" + repo_id.replace("/", "--")
    return [s for s in sorted((hub_cache_dir(cache_dir) / folder / "snapshots").glob("*")) if s.is_dir()]


def model_packages() -> dict[str, object]:
    """Installed model packages (like the default model's): module name -> module, for
    each distribution named *-gguf whose module has MODEL_NAME and assemble()."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if not name.endswith("-gguf"):
            continue
        module_name = name.replace("-", "_")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if isinstance(getattr(module, "MODEL_NAME", None), str) and callable(getattr(module, "assemble", None)):
            found[module_name] = module
    return found


def _from_packages(repo_id: str, pattern: str) -> list[tuple[str, object]]:
    """Packages whose file matches the pattern and whose model is the repo's (the repo
    name, less a -GGUF suffix, is part of the file name), or that are named repo_id."""
    repo = repo_id.rsplit("/", 1)[-1].lower()
    stem = repo[:-5] if repo.endswith("-gguf") else repo
    out = []
    for module_name, module in model_packages().items():
        file = module.MODEL_NAME
        named = repo.replace("-", "_") == module_name
        if named or (match_glob([file], pattern) and stem and stem in file.lower()):
            out.append((file, module))
    return out


def find_pretrained(repo_id: str, filename: str | None, local_dir=None, cache_dir=None,
                    progress: Progress | None = None) -> str:
    """The path of the one file for (repo_id, filename glob): a local one, else downloaded
    from the Hub; ValueError (ModelNotFoundError) when it is nowhere."""
    if not isinstance(repo_id, str) or not repo_id:
        raise RequestError("repo_id must be a non-empty string")
    pattern = filename or "*.gguf"
    places: list[tuple[str, list[str]]] = []
    for where in ([Path(local_dir)] if local_dir is not None else []) + [Path(repo_id).expanduser()]:
        places.append((f"directory {where}", _in_directory(where, pattern)))
    for snapshot in _hf_cache_dirs(repo_id, cache_dir):
        places.append((f"Hugging Face cache {snapshot}", _in_directory(snapshot, pattern)))
    for label, files in places:
        if len(files) > 1:
            raise RequestError(f"several files in {label} match {pattern!r}: {', '.join(files)}")
        if files:
            return files[0]
    packaged = _from_packages(repo_id, pattern)
    if len(packaged) > 1:
        raise RequestError(f"several installed model packages match {repo_id} / {pattern!r}: "
                           f"{', '.join(f for f, _ in packaged)}")
    if packaged:
        return str(packaged[0][1].assemble())
    packages = ", ".join(m.MODEL_NAME for m in model_packages().values()) or "none"
    looked = (f"looked in {', '.join(label for label, _ in places) or 'no directory'} and in installed model "
              f"packages ({packages})")
    if not _REPO_ID.fullmatch(repo_id) or Path(repo_id).expanduser().exists():
        raise ModelNotFoundError(f"no local file matches {repo_id} / {pattern!r}: {looked}; a Hugging Face "
                                 "repo_id (USER/REPO) would be downloaded")
    return _download(repo_id, pattern, local_dir, cache_dir, progress, looked)


def _download(repo_id: str, pattern: str, local_dir, cache_dir, progress, looked: str) -> str:
    """The file from the Hub, into local_dir or Hugging Face's cache; errors say where we looked."""
    try:
        _, files = repo_files(repo_id)
        names = choose_glob(list(files), pattern, repo_id)   # a split GGUF's parts: all, the first opened
        return [download_file(repo_id, files[name], cache_dir=cache_dir, local_dir=local_dir, progress=progress)
                for name in names][0]
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"no local file matches {repo_id} / {pattern!r} ({looked}), and the Hub has "
                                 f"none: {e}") from None
    except DownloadError as e:
        raise type(e)(f"no local file matches {repo_id} / {pattern!r} ({looked}), and downloading it failed: "
                      f"{e}") from None
