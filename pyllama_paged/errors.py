"""Exceptions raised by pyllama-paged."""


class PagedError(Exception):
    """Base class of every pyllama-paged error."""


class NativeError(PagedError):
    """A native call failed; the message carries the C library's error text and status
    its code (pp_status: > 0 recoverable, < 0 an error)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ModelLoadError(PagedError, ValueError):
    """A GGUF file cannot be used; the message names the file and the field or tensor.

    Also a ValueError: the tokenizer's GGUF readers raised ValueError for bad files
    before they raised this, and callers may still catch that."""


class RequestError(PagedError, ValueError):
    """A request that cannot run as given: an invalid sampling parameter, a prompt
    longer than the context, a grammar that does not compile, a token id outside
    the vocabulary. Also a ValueError, as llama-cpp-python raises for these."""


class OutOfBlocksError(PagedError):
    """The KV block pool cannot satisfy a request right now (recoverable)."""


class NativeMemoryError(NativeError, MemoryError):
    """The native library could not allocate host memory (nothing was changed)."""


class ComputeError(NativeError):
    """A model step started and failed or was aborted: the KV rows of that step's
    slots are undefined, so its sequences must recompute them (or be failed)."""


class DownloadError(PagedError, OSError):
    """A model could not be fetched: the source could not be reached, answered with an
    error, or sent something that is not what it promised. The message names the
    reference and the URL or file.

    Also an OSError, as huggingface_hub's own errors are (no connection, a file not in the
    offline cache): code written for llama-cpp-python's from_pretrained catches that."""


class ModelNotFoundError(DownloadError, ValueError):
    """The source has no such model, tag, repository or file. Also a ValueError, as
    llama-cpp-python's from_pretrained raises for a file that is not there."""


class IntegrityError(DownloadError):
    """A downloaded file's sha256 is not the one its source published; the file was
    deleted, so nothing half-verified is left behind."""


class ModelsBusyError(ModelLoadError):
    """No room to load a model: as many are loaded as the server keeps, and each is in use.
    A moment's condition, not a broken file (HTTP 503)."""
