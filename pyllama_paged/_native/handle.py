"""The base of the Python wrappers that own one native object and free it."""

from __future__ import annotations


class Closing:
    """Closes the object on leaving a with block (the object has close())."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NativeHandle(Closing):
    """Owns one native object: ``_handle``, the pointer (None until it is made and once it is
    freed), and ``_destroy``, the lib function that frees it (a ``staticmethod`` of the
    subclass). A subclass sets ``_handle`` only after its create call succeeded, so closing a
    half-made wrapper is safe."""

    _handle = None

    def close(self) -> None:
        """Free the native object; later calls do nothing."""
        if self._handle is not None:
            self._destroy(self._handle)
            self._handle = None

    def __del__(self):
        self.close()
