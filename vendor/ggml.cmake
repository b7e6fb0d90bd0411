# Find GGML as installed by the pinned PyPI package `libggml-python`.
# scikit-build-core adds the package's prefix through its `cmake.prefix`
# entry point; when configuring by hand we ask the Python in use instead.
find_package(ggml CONFIG QUIET)
if(NOT ggml_FOUND)
  find_package(Python COMPONENTS Interpreter REQUIRED)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import libggml, os; print(os.path.dirname(libggml.__file__))"
    OUTPUT_VARIABLE PP_LIBGGML_DIR
    OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE PP_LIBGGML_RESULT)
  if(NOT PP_LIBGGML_RESULT EQUAL 0)
    message(FATAL_ERROR
      "GGML not found: install the pinned `libggml-python` (see vendor/README.md) "
      "or set ggml_DIR to <libggml package>/lib64/cmake/ggml")
  endif()
  find_package(ggml CONFIG REQUIRED PATHS "${PP_LIBGGML_DIR}/lib64/cmake/ggml" NO_DEFAULT_PATH)
endif()
message(STATUS "pyllama-paged: GGML ${ggml_VERSION} from ${ggml_DIR}")
