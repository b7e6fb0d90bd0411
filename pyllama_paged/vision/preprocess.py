"""Images from bytes to a vision tower's input: decoded and checked with Pillow (clear errors for
data that is not an image, truncated data, and images past a pixel cap, before their pixels are
decoded), converted to RGB, resized to the tower's square side (bilinear, as llama.cpp does for
Gemma 3) and normalised with the projector file's mean and standard deviation."""

from __future__ import annotations

import hashlib
import io
import warnings

import numpy as np

from ..errors import RequestError

# An image may have at most this many pixels (width x height) by default: a decompression
# bomb (a small file of a huge image) is refused before its pixels are decoded.
DEFAULT_MAX_PIXELS = 50_000_000


class ImageError(RequestError):
    """An image that cannot be read: not an image, truncated, or too large (a 400)."""


def image_hash(data: bytes) -> str:
    """The content hash an encoded image is known by (sha256 of its bytes, hex)."""
    return hashlib.sha256(data).hexdigest()


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS):
    """A fully decoded RGB Pillow image of data; ImageError if it is none, is cut short, or has
    more than max_pixels pixels."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("the image is empty")
    try:
        with warnings.catch_warnings():
            # Pillow warns (DecompressionBombWarning) below its own cap; ours is the one that counts
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            width, height = img.size
            if width < 1 or height < 1 or width * height > max_pixels:
                raise ImageError(f"the image is {width}x{height} pixels; at most {max_pixels} pixels are accepted")
            img.load()
    except UnidentifiedImageError:
        raise ImageError("the data is not an image in a format Pillow reads (PNG, JPEG, GIF, WebP, BMP, ...)") \
            from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"the image is too large; at most {max_pixels} pixels are accepted ({e})") from None
    except (OSError, SyntaxError, ValueError) as e:   # truncated or corrupt data
        raise ImageError(f"the image data is truncated or corrupt: {e}") from None
    return img.convert("RGB")


def to_pixels(img, size: int, mean, std) -> np.ndarray:
    """An RGB image resized to size x size, as the tower's normalised input [3, size, size] float32."""
    from PIL import Image

    resized = img.resize((size, size), Image.Resampling.BILINEAR)
    x = np.asarray(resized, dtype=np.float32) / 255.0
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def preprocess(data: bytes, size: int, mean, std, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Image bytes to a tower's input [3, size, size] (see decode_image for the errors)."""
    return to_pixels(decode_image(data, max_pixels), size, mean, std)
