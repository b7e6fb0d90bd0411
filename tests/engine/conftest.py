"""The `model` of the engine modules that do not load their own: a tiny random-weight Gemma 3
(Q8_0; 6 layers, 5 of them with a window of 16 tokens), loaded once per module; and the float64
`reference` of each file of a module's `tiny` (weight type -> path)."""

import pytest

from pyllama_paged.engine import Model
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf", "gemma3", weight_type="q8_0")
    with Model(path) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def reference(tiny):
    return {wt: ReferenceModel.from_gguf(path) for wt, path in tiny.items()}
