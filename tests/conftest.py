"""The tests, grouped by the layer they test (native/, engine/, files/, api/, server/, and
package/ for the import graph and the oracles' self-checks); tests/data/ holds their fixtures.
The package under test is always the installed one (pytest's importlib mode keeps the source
tree off sys.path); what tests and benchmarks share lives in pyllama_paged.testing."""
