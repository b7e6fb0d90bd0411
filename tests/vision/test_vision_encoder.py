"""The vision encoder (native/src/vision/) against the float64 reference of the same projector
file: the SigLIP tower and Gemma 3's projector, per weight type, cosine >= 0.999 per row; and the
projector file's bad cases refused with messages that name what is wrong."""

import gguf
import numpy as np
import pytest

from pyllama_paged.errors import ModelLoadError
from pyllama_paged.testing.reference.tiny_mmproj import write_tiny_mmproj
from pyllama_paged.testing.reference.vision_reference import VisionReference
from pyllama_paged.vision.projector import Projector


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def random_pixels(ref: VisionReference, seed: int) -> np.ndarray:
    rgb = np.random.default_rng(seed).integers(0, 256, (ref.image_size, ref.image_size, 3)).astype(np.uint8)
    return ref.normalise(rgb)


@pytest.mark.parametrize("weight_type", ["f32", "f16", "q8_0"])
def test_embeddings_match_the_reference(tmp_path, weight_type):
    path = write_tiny_mmproj(tmp_path / "mmproj.gguf", projection_dim=256, weight_type=weight_type, n_ff=160)
    ref = VisionReference.from_gguf(path)
    with Projector(path, n_threads=2) as projector:
        assert projector.n_tokens == ref.n_tokens == 16
        for seed in range(2):
            pixels = random_pixels(ref, seed)
            want, got = ref.encode(pixels), projector.encode(pixels)
            assert got.shape == (16, 256)
            assert cosines(want, got).min() >= 0.999
            # different images give different rows: the check above cannot pass on a constant
            assert cosines(want, ref.encode(random_pixels(ref, seed + 10))).min() < 0.99


def test_other_shapes_match_the_reference(tmp_path):
    """A larger grid pooled 4 x 4, more heads and layers: nothing depends on the tiny defaults."""
    path = write_tiny_mmproj(tmp_path / "mmproj.gguf", projection_dim=96, image_size=64, patch_size=4,
                             n_embd=48, n_head=3, n_ff=80, n_layer=3, scale_factor=4, seed=3)
    ref = VisionReference.from_gguf(path)
    with Projector(path) as projector:
        pixels = random_pixels(ref, 1)
        assert cosines(ref.encode(pixels), projector.encode(pixels)).min() >= 0.999


def test_pixels_of_the_wrong_shape_are_refused(tmp_path):
    path = write_tiny_mmproj(tmp_path / "mmproj.gguf", projection_dim=64)
    with Projector(path) as projector:
        with pytest.raises(ValueError, match=r"pixels must be \[3, 32, 32\]"):
            projector.encode(np.zeros((3, 16, 16), np.float32))


def _rewrite(src: str, dst, *, drop: str | None = None, meta: dict | None = None, retype: str | None = None) -> str:
    """A copy of a projector file with one tensor dropped, metadata changed or one tensor made q8_0."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "clip")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",) or field.name in (meta or {}):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(field.name, value)
        else:
            w.add_key_value(field.name, value, vtype)
    for key, value in (meta or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
    for t in reader.tensors:
        if t.name == drop:
            continue
        if t.name == retype:
            data = gguf.quants.quantize(t.data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def test_bad_projector_files_are_refused(tmp_path):
    path = write_tiny_mmproj(tmp_path / "mmproj.gguf", projection_dim=64)
    with pytest.raises(ModelLoadError, match="missing tensor 'v.blk.1.ffn_down.weight'"):
        Projector(_rewrite(path, tmp_path / "a.gguf", drop="v.blk.1.ffn_down.weight"))
    with pytest.raises(ModelLoadError, match="projector type 'qwen9' is not supported"):
        Projector(_rewrite(path, tmp_path / "b.gguf", meta={"clip.projector_type": "qwen9"}))
    with pytest.raises(ModelLoadError, match="v.position_embd.weight': dimension 1 is 64, the hyper-parameters need 256"):
        Projector(_rewrite(path, tmp_path / "c.gguf", meta={"clip.vision.image_size": 64}))
    with pytest.raises(ModelLoadError, match="mm.input_projection.weight': type q8_0, but it must be f32 or f16"):
        Projector(_rewrite(path, tmp_path / "d.gguf", retype="mm.input_projection.weight"))
    with pytest.raises(ModelLoadError, match="not a vision projector"):
        from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
        Projector(write_tiny_model(tmp_path / "text.gguf", "gemma3", n_layer=1))
