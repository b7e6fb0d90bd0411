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
