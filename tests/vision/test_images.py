"""Image bytes to the tower's input (Pillow): formats decode, an image of the tower's size is
normalised exactly as the reference does, and bad data gets a clear ImageError; encoded images
are cached by content hash in a bounded LRU."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from pyllama_paged.testing.reference.tiny_mmproj import write_tiny_mmproj
from pyllama_paged.testing.reference.vision_reference import VisionReference
from pyllama_paged.vision.image_cache import EncodedImage, ImageCache, ImageEncoder
from pyllama_paged.vision.preprocess import ImageError, decode_image, preprocess
from pyllama_paged.vision.projector import Projector


def image_bytes(rgb: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt)
    return buf.getvalue()


def random_rgb(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3)).astype(np.uint8)


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    return write_tiny_mmproj(tmp_path_factory.mktemp("vision") / "mmproj.gguf", projection_dim=64)


def test_an_image_of_the_towers_size_is_normalised_as_the_reference_does(mmproj):
    ref = VisionReference.from_gguf(mmproj)
    rgb = random_rgb(32)
    got = preprocess(image_bytes(rgb), 32, ref.image_mean, ref.image_std)
    assert got.shape == (3, 32, 32) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref.normalise(rgb), atol=1e-6)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF"])
def test_formats_decode_and_resize(fmt):
    data = image_bytes(random_rgb(50, seed=1), fmt)
    got = preprocess(data, 32, (0.5,) * 3, (0.5,) * 3)
    assert got.shape == (3, 32, 32) and np.all(np.abs(got) <= 1.0 + 1e-6)


def test_alpha_and_grey_images_become_rgb():
    rgba = Image.new("RGBA", (40, 20), (10, 200, 30, 128))
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    assert decode_image(buf.getvalue()).mode == "RGB"
    grey = Image.new("L", (8, 8), 77)
    buf = io.BytesIO()
    grey.save(buf, format="PNG")
    assert decode_image(buf.getvalue()).getpixel((0, 0)) == (77, 77, 77)


def _png_claiming(width: int, height: int) -> bytes:
    """A real 1x1 PNG whose header says width x height (the CRC fixed): a decompression bomb's shape."""
    png = bytearray(image_bytes(random_rgb(1)))
    ihdr = png.index(b"IHDR")
    png[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(png[ihdr:ihdr + 17]))
    png[ihdr + 17:ihdr + 21] = struct.pack(">I", crc)
    return bytes(png)


def test_bad_data_gets_a_clear_error():
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"certainly not a picture" * 10)
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"")
    whole = image_bytes(random_rgb(64, seed=2))
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(whole[: len(whole) // 2])
    with pytest.raises(ImageError, match="10000x9000 pixels; at most 50000000 pixels"):
        decode_image(_png_claiming(10_000, 9_000))
    with pytest.raises(ImageError, match="too large; at most 50000000 pixels"):   # past Pillow's own cap too
        decode_image(_png_claiming(100_000, 100_000))
    with pytest.raises(ImageError, match="at most 1000 pixels"):
        decode_image(whole, max_pixels=1000)


def test_the_encoder_encodes_each_content_once(mmproj):
    with Projector(mmproj) as projector:
        enc = ImageEncoder(projector)
        a, b = image_bytes(random_rgb(32, 3)), image_bytes(random_rgb(32, 4))
        first = enc.encode(a)
        again = enc.encode(a)
        other = enc.encode(b)
        assert again is first and enc.n_encoded == 2 and first.n_tokens == 16
        assert first.hash != other.hash
        assert not np.allclose(first.embeddings, other.embeddings)
        with pytest.raises(ImageError):
            enc.encode(b"nope")


def test_the_cache_is_a_bounded_lru():
    rows = np.zeros((4, 8), np.float32)   # 128 bytes each
    cache = ImageCache(max_bytes=3 * rows.nbytes)
    for k in "abc":
        cache.put(EncodedImage(k, rows.copy()))
    assert cache.get("a") is not None     # a is now the most recent: b goes first
    cache.put(EncodedImage("d", rows.copy()))
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 3
    cache.put(EncodedImage("huge", np.zeros((100, 8), np.float32)))
    assert cache.get("huge") is None and len(cache) == 3
