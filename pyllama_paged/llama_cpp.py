"""llama-cpp-python's low-level ctypes binding (llama_cpp.llama_cpp) is not provided: importing
this says what to use instead."""

from .api.llama_compat import UnsupportedFeatureError, low_level_message

raise UnsupportedFeatureError(low_level_message("llama_cpp.llama_cpp"))
