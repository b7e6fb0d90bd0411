"""Llama.from_pretrained's file lookup: local directories, the Hugging Face
cache already on disk, and installed model packages. NOTE(pretrained):
nothing is downloaded at run time; a file found nowhere is a ValueError that
says where we looked and how to get it."""

from __future__ import annotations

import fnmatch
import importlib
import importlib.metadata
import os
from pathlib import Path

from ..errors import RequestError


def _matches(names: list[str], pattern: str) -> list[str]:
    return sorted(n for n in names if fnmatch.fnmatch(n.lower(), pattern.lower())
                  or fnmatch.fnmatch(Path(n).name.lower(), pattern.lower()))


def _in_directory(root: Path, pattern: str) -> list[str]:
    """Files under root whose relative path (or name) matches the glob."""
    if not root.is_dir():
        return []
    names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()]
    return [str(root / n) for n in _matches(names, pattern)]


def _hf_cache_dirs(repo_id: str, cache_dir: str | os.PathLike | None) -> list[Path]:
    """The snapshot folders of repo_id in the Hugging Face cache (as huggingface_hub lays it out)."""
    if cache_dir is not None:
        hubs = [Path(cache_dir)]
    elif os.environ.get("HF_HUB_CACHE"):
        hubs = [Path(os.environ["HF_HUB_CACHE"])]
    else:
        home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
        hubs = [Path(home) / "hub"]
    folder = "models--" + repo_id.replace("/", "--")
    return [s for hub in hubs for s in sorted((hub / folder / "snapshots").glob("*")) if s.is_dir()]


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
        if named or (_matches([file], pattern) and stem and stem in file.lower()):
            out.append((file, module))
    return out


def find_pretrained(repo_id: str, filename: str | None, local_dir=None, cache_dir=None) -> str:
    """The path of the one local file for (repo_id, filename glob); ValueError otherwise."""
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
    raise RequestError(
        f"no local file matches {repo_id} / {pattern!r}: looked in {', '.join(label for label, _ in places) or 'no directory'} "
        f"and in installed model packages ({packages}). pyllama-paged does not download models: fetch the "
        f"file first (e.g. `huggingface-cli download {repo_id} --include '{pattern}'`) and pass its path "
        "as model_path, or a local directory as repo_id")
