"""The package version, in one place: pyproject.toml reads it (scikit-build-core's
regex provider) and CMakeLists.txt compiles it into the native library's
pp_version(), which pyllama_paged._native checks at import. Keep the
`__version__ = "..."` line in this form: both read it with a regular expression."""

__version__ = "0.1.0"
