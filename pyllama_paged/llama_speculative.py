"""llama-cpp-python's llama_cpp.llama_speculative under this package's name: the module is
pyllama_paged.api.llama_speculative (importing either gives the same module object)."""

import sys

from .api import llama_speculative

sys.modules[__name__] = llama_speculative
