"""llama-cpp-python's llama_cpp.llama_chat_format under this package's name: the module is
pyllama_paged.api.llama_chat_format (importing either gives the same module object)."""

import sys

from .api import llama_chat_format

sys.modules[__name__] = llama_chat_format
