"""The tests, grouped by the layer they test (native/, engine/, files/, api/, server/, and
package/ for the import graph and the oracles' self-checks); tests/data/ holds their fixtures.
The package under test is always the installed one (pytest's importlib mode keeps the source
tree off sys.path); what tests and benchmarks share lives in pyllama_paged.testing."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _no_real_model_store(tmp_path_factory):
    """Every test's pulls go to an empty local registry and an empty store: a server under
    test (fuzzed /api/pull and /api/delete included) never reaches the network or ~/.cache."""
    from pyllama_paged.testing.model_sources import ModelSources

    with ModelSources() as registry, pytest.MonkeyPatch.context() as env:
        env.setenv("PYLLAMA_PAGED_MODELS", str(tmp_path_factory.mktemp("model-store")))
        env.setenv("PYLLAMA_PAGED_REGISTRY", registry.url)
        yield


@pytest.fixture(scope="session")
def tiny_gguf_bytes(tmp_path_factory) -> bytes:
    """A tiny random-weight Gemma 3 GGUF, as a model source serves it."""
    from pathlib import Path

    from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
    return Path(write_tiny_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "gemma3")).read_bytes()


@pytest.fixture
def model_sources(tmp_path, monkeypatch):
    """A local Hugging Face Hub and Ollama registry (ModelSources) that pulls go to, with HOME,
    Hugging Face's cache and the store in tmp_path."""
    from pyllama_paged.testing.model_sources import ModelSources

    with ModelSources() as sources:
        values = {"HOME": tmp_path / "home", "HF_HOME": tmp_path / "hf", "PYLLAMA_PAGED_MODELS": tmp_path / "store",
                  "PYLLAMA_PAGED_REGISTRY": sources.url, "HF_ENDPOINT": sources.url}
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))
        for key in ("HF_HUB_CACHE", "XDG_CACHE_HOME"):
            monkeypatch.delenv(key, raising=False)
        yield sources


@pytest.fixture(scope="session")
def bench():
    """import_module for the checkout's bench package (bench.common.*, its scripts), imported
    as `python -m bench...` imports it from the checkout's root, but by its path: the root
    itself stays off sys.path, where its source tree would shadow the installed package."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "bench"
    if "bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["bench"] = package
        spec.loader.exec_module(package)
    return importlib.import_module
