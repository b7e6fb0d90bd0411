"""The `model` of the engine modules that do not load their own: a tiny random-weight Gemma 3
(Q8_0; 6 layers, 5 of them with a window of 16 tokens), loaded once per module; and the float64
`reference` of each file of a module's `tiny` (weight type -> path); `tiny_hybrid`: a tiny
Qwen3.5 and a tiny Qwen3.5-MoE (F16), each loaded once per module with its float64 reference
and its end-of-text ids."""

import pytest

from pyllama_paged.engine import Model
from pyllama_paged.testing.reference.hybrid_model import HybridReferenceModel
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_qwen35 import write_tiny_qwen35


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf", "gemma3", weight_type="q8_0")
    with Model(path) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def reference(tiny):
    return {wt: ReferenceModel.from_gguf(path) for wt, path in tiny.items()}


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe"])
def tiny_hybrid(request, tmp_path_factory):
    path = write_tiny_qwen35(tmp_path_factory.mktemp("hybrid") / f"{request.param}.gguf", request.param,
                             weight_type="f16")
    with Model(path) as model:
        ref = HybridReferenceModel.from_gguf(path)
        yield model, ref, {ref.eos_id}
