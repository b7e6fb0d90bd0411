"""Images in a chat's prompt: where a message had an image its text carries a marker, a secret of
the process that the model's tokenizer turns into the image's begin token (Gemma 3's
"<start_of_image>"), so a request's own text can never place an image; after tokenizing, each
begin token is followed by the image's placeholder positions and its end token, as llama.cpp's
mtmd lays a Gemma 3 image out, and the image is encoded (or found in the cache) for them."""

from __future__ import annotations

import base64
import binascii
import secrets
from dataclasses import dataclass

from ..errors import ModelLoadError, RequestError
from .image_cache import EncodedImage, ImageEncoder
from .projector import Projector

# At most this many images in one request: each costs an encoding and its rows of context.
MAX_IMAGES_PER_REQUEST = 16

# Each projector type's marker (begin) and end tokens, as llama.cpp's mtmd writes them.
MARKERS = {"gemma3": ("<start_of_image>", "<end_of_image>")}


def image_data(value: str, where: str) -> bytes:
    """An image sent as base64 or as a data URL ("data:image/png;base64,..."), as bytes;
    RequestError for a remote URL (never fetched) or text that is not base64."""
    if value.startswith(("http://", "https://")):
        raise RequestError(f"{where}: image URLs are not fetched; send the image as a data URL or base64")
    if value.startswith("data:"):
        head, _, value = value.partition(",")
        if not head.endswith(";base64"):
            raise RequestError(f"{where}: a data URL's image must be base64 (data:image/...;base64,...)")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the image is not valid base64") from None


@dataclass
class VisionPrompt:
    """A served model's images: the marker its messages carry, its begin and end token ids,
    and the encoder (with its cache)."""

    encoder: ImageEncoder
    marker: str
    begin_id: int
    end_id: int

    @classmethod
    def for_model(cls, encoder: ImageEncoder, n_embd: int, tokenizer) -> "VisionPrompt":
        """The projector's prompt layout for a text model n_embd wide and its tokenizer, which
        from now on makes the layout's marker text the image's begin token; ModelLoadError if
        they do not fit."""
        projector = encoder.projector
        if projector.projection_dim != n_embd:
            raise ModelLoadError(f"{projector.path}: projects images to {projector.projection_dim} wide rows, "
                                 f"but the model's embedding is {n_embd} wide")
        begin, end = MARKERS[projector.projector_type]
        ids = [tokenizer.token_to_id(begin), tokenizer.token_to_id(end)]
        if None in ids:
            raise ModelLoadError(f"{projector.path}: the model's vocabulary has no {begin} and {end} tokens")
        # letters only: templates' trim and tojson leave it as it is, and no vocabulary makes it a control token
        marker = "ppmedia" + secrets.token_hex(16)
        tokenizer.media_marker = (marker, ids[0])
        return cls(encoder, marker, ids[0], ids[1])

    def close(self) -> None:
        """Free the projector's encoder and unmap its file."""
        self.encoder.projector.close()

    def expand(self, ids: list[int], images: list[bytes]) -> tuple[list[int], list[tuple[int, EncodedImage]]]:
        """ids with each marker token followed by its image's placeholder positions and end
        token, and (first position, encoded image) per image. A chat truncated to fit keeps
        its newest turns, so the last images are the ones whose markers remain."""
        n_markers = ids.count(self.begin_id)
        if n_markers > len(images):
            raise RequestError(f"the prompt has {n_markers} image markers ({self.marker}) but {len(images)} images")
        kept = images[len(images) - n_markers:]
        out: list[int] = []
        placed: list[tuple[int, EncodedImage]] = []
        for token in ids:
            out.append(token)
            if token == self.begin_id:
                image = self.encoder.encode(kept[len(placed)])
                placed.append((len(out), image))
                out.extend([0] * image.n_tokens)   # the engine writes the image's own ids here
                out.append(self.end_id)
        return out, placed


def open_vision(path: str, n_embd: int, tokenizer, n_threads: int = 1) -> VisionPrompt:
    """A projector file's encoder (a cache of its own) fitted to a text model n_embd wide and its
    tokenizer (VisionPrompt.for_model); ModelLoadError if it cannot be used."""
    projector = Projector(path, n_threads)
    try:
        return VisionPrompt.for_model(ImageEncoder(projector), n_embd, tokenizer)
    except BaseException:
        projector.close()
        raise
