"""Images in the prompt, through the engine: a tiny Gemma 3 and a tiny projector. The image's
rows replace its placeholder positions' inputs (unscaled), matching the float64 reference fed the
reference tower's rows, in whole and split prefill chunks; the image's content hash is in the
block hash chain, so the same image hits the prefix cache and another image never does."""

import io

import numpy as np
import pytest
from PIL import Image

from pyllama_paged.engine import EngineConfig, LLMEngine, Model, SamplingParams
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.errors import RequestError
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_mmproj import write_tiny_mmproj
from pyllama_paged.testing.reference.vision_reference import VisionReference
from pyllama_paged.vision.image_cache import ImageEncoder
from pyllama_paged.vision.projector import Projector

START = 5   # the image's first position in the test prompts


def png(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (32, 32, 3)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    text = write_tiny_model(root / "gemma3.gguf", "gemma3", weight_type="q8_0", n_layer=2)
    return text, write_tiny_mmproj(root / "mmproj.gguf", projection_dim=256)


@pytest.fixture(scope="module")
def encoder(files):
    with Projector(files[1], n_threads=2) as projector:
        yield ImageEncoder(projector)


def prompt_with_image(n_after: int) -> list[int]:
    rng = np.random.default_rng(7)
    return [2] + [int(t) for t in rng.integers(4, 200, START - 1)] + [0] * 16 + \
        [int(t) for t in rng.integers(4, 200, n_after)]


def reference_next_logits(files, prompt, image_data) -> np.ndarray:
    """The float64 text model after prompt, the image's positions fed the float64 tower's rows."""
    vision = VisionReference.from_gguf(files[1])
    rgb = np.asarray(Image.open(io.BytesIO(image_data)).convert("RGB"))
    rows = vision.encode(vision.normalise(rgb))
    ref = ReferenceModel.from_gguf(files[0])
    return ref.forward(prompt, embeds={START + i: rows[i] for i in range(len(rows))})[-1]


@pytest.mark.parametrize("chunks", [(None,), (9, 10, 1), (3, 3, 3, 3, 3, 3, 3, 3)])
def test_image_rows_replace_their_positions_inputs(files, encoder, chunks):
    image = encoder.encode(png(1))
    prompt = prompt_with_image(n_after=6)
    tokens = list(prompt)
    tokens[START:START + image.n_tokens] = image.token_ids()
    with Model(files[0]) as model:
        runner = ModelRunner(model, EngineConfig(n_ctx=64, n_threads=2, n_batch=64, block_size=16))
        try:
            seq = runner.add_sequence(tokens)
            done = 0
            for n in chunks:
                n = len(tokens) - done if n is None else min(n, len(tokens) - done)
                logits = runner.step([(seq, n)], images=[[(START, image.embeddings)]])
                done += n
            if done < len(tokens):
                logits = runner.step([(seq, len(tokens) - done)], images=[[(START, image.embeddings)]])
            got = logits[-1].astype(np.float64)
        finally:
            runner.close()
    want = reference_next_logits(files, prompt, png(1))
    spread = want.max() - want.min()
    assert np.abs(got - want).max() / spread < 3e-2
    # the image matters: the same prompt about another image gives other logits
    other = reference_next_logits(files, prompt, png(2))
    assert np.abs(other - want).max() / spread > 0.1


def _computed(engine, prompt, images) -> int:
    before = engine.num_computed_tokens
    request = engine.add_request(list(prompt), SamplingParams(max_tokens=2, temperature=0), images=images)
    while engine.has_work():
        engine.step()
    assert request.error is None, request.error
    return engine.num_computed_tokens - before


def test_the_image_hash_is_in_the_block_hash_chain(files, encoder):
    a, b = encoder.encode(png(3)), encoder.encode(png(4))
    prompt = prompt_with_image(n_after=40)   # 61 tokens: the image lies in the first of 4 blocks
    with Model(files[0]) as model:
        engine = LLMEngine.from_config(EngineConfig(n_ctx=128, n_threads=2, block_size=16), model=model,
                                       eot_ids=[1])
        try:
            cold = _computed(engine, prompt, [(START, a)])
            assert cold >= len(prompt)
            # the same image: every full block comes from the prefix cache
            assert _computed(engine, prompt, [(START, a)]) < cold - 40
            # another image at the same place, the same text: nothing from the image's block on
            assert _computed(engine, prompt, [(START, b)]) >= cold
            with pytest.raises(RequestError, match="overlaps another or leaves the prompt"):
                engine.add_request(list(prompt), SamplingParams(max_tokens=1), images=[(len(prompt) - 3, a)])
        finally:
            engine.close()


def test_malformed_embedding_rows_are_refused(files):
    """The native step checks a batch's embedding rows before computing anything."""
    from pyllama_paged.errors import NativeError

    with Model(files[0]) as model:
        runner = ModelRunner(model, EngineConfig(n_ctx=64, n_threads=2, n_batch=64, block_size=16))
        try:
            seq = runner.add_sequence(list(range(4, 12)))
            slots, tables = runner.kv.batch_arrays(seq.handle, 0, 8)
            arrays = [np.ascontiguousarray(a, dtype=np.int32) for a in
                      (range(4, 12), range(8), slots, [0] * 8, [7])]
            tables = np.ascontiguousarray(tables, dtype=np.int32)
            tables = tables[None] if tables.ndim == 2 else tables
            rows = np.zeros((2, 256), np.float32)
            for bad in ([5, 3], [2, 8], [-1, 2]):
                with pytest.raises(NativeError, match="embedding row"):
                    runner._decode(*arrays[:4], tables, arrays[4], None,
                                   embd=(np.array(bad, dtype=np.int32), rows))
            runner._decode(*arrays[:4], tables, arrays[4], None, embd=(np.array([2, 3], dtype=np.int32), rows))
        finally:
            runner.close()
