"""The float64 reference of any file the references model: gemma4 files to gemma4_reference.py,
the others to numpy_model.py (which knows nothing of the architectures with modules of their own)."""

from __future__ import annotations

import os

from .gemma4_reference import Gemma4Reference
from .numpy_model import ReferenceModel, read_gguf

# architectures whose reference lives in a module of its own
OWN_MODULES = {"gemma4": Gemma4Reference}


def load_reference(path: str | os.PathLike) -> ReferenceModel:
    """The reference model of the GGUF at path (ValueError for an architecture none models)."""
    meta, infos, mm = read_gguf(path)
    own = OWN_MODULES.get(meta.get("general.architecture"))
    return own.from_file_parts(meta, infos, mm) if own else ReferenceModel.from_gguf(path)
