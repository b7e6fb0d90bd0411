"""OpenAI token-array inputs. OpenAI's embedding endpoint takes token ids of its own
tokenizer (cl100k_base), and that is what clients send: langchain-openai's
OpenAIEmbeddings tokenizes with tiktoken and posts the ids (unless
check_embedding_ctx_length=False). Ids of another vocabulary mean nothing to our
models, so such input is decoded back to text with tiktoken's cl100k_base, then
tokenized for the model. tiktoken and its cl100k_base file must be on the machine
(tiktoken reads TIKTOKEN_CACHE_DIR; nothing is fetched for this): without them,
token arrays are refused with the reason, and text input works as ever."""

from __future__ import annotations

import os
import tempfile
import threading

from ..errors import PagedError

_lock = threading.Lock()
_encoding = None   # loaded once; a failure is looked at again next time (the file may appear)


# The file name tiktoken caches cl100k_base under (the SHA-1 of its download address).
_CL100K_CACHE_NAME = "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"


def _cache_file() -> str:
    """Where tiktoken looks for its cached cl100k_base (its own rule for the folder)."""
    folder = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or \
        os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return os.path.join(folder, _CL100K_CACHE_NAME)


def _cl100k():
    global _encoding
    with _lock:
        failure = None
        if _encoding is None:
            try:
                import tiktoken
            except ImportError:
                failure = "tiktoken is not installed"
            else:
                if not os.path.exists(_cache_file()):
                    failure = (f"tiktoken's cl100k_base is not at {_cache_file()} (set TIKTOKEN_CACHE_DIR; "
                                "nothing is downloaded at run time)")
                else:
                    try:
                        _encoding = tiktoken.get_encoding("cl100k_base")
                    except Exception as e:  # a damaged cache file
                        failure = f"cl100k_base could not be loaded ({type(e).__name__}: {e})"
        if _encoding is None:
            raise PagedError(f"token-id input is read as OpenAI cl100k_base tokens, but {failure}; send text")
        return _encoding


def decode_openai_tokens(ids: list[int]) -> str:
    """The text an OpenAI (cl100k_base) token array stands for."""
    encoding = _cl100k()
    if any(not 0 <= t < encoding.n_vocab for t in ids):
        raise PagedError(f"token id outside cl100k_base's {encoding.n_vocab}")
    return encoding.decode(ids)
