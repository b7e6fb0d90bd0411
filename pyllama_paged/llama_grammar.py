"""llama-cpp-python's llama_cpp.llama_grammar under this package's name: the module is
pyllama_paged.api.llama_grammar (importing either gives the same module object)."""

import sys

from .api import llama_grammar

sys.modules[__name__] = llama_grammar
