"""Images through the Python API and the CLI: Llama(mmproj=...) (or llama-cpp-python's
clip_model_path) takes image_url parts in create_chat_completion, its image's rows counted in the
prompt; `pyllama-paged run --image FILE --mmproj FILE` answers about a picture file; without a
projector an image is refused as before."""

import base64
import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from pyllama_paged.api.llama import Llama
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_mmproj import write_tiny_mmproj
from pyllama_paged.testing.serving import _image_tokens
from pyllama_paged.tools.messages import MessageError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-vision")
    model = write_tiny_model(root / "tiny.gguf", "gemma3", weight_type="q8_0", n_layer=2, vocab_hook=_image_tokens)
    picture = root / "picture.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 36, 3)).astype(np.uint8)).save(picture)
    return model, write_tiny_mmproj(root / "mmproj.gguf", projection_dim=256), picture


def turn(picture, text="What is it?"):
    url = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.mark.parametrize("argument", ["mmproj", "clip_model_path"])
def test_chat_completion_with_an_image(files, argument):
    model, mmproj, picture = files
    with Llama(model, n_ctx=256, n_threads=2, **{argument: mmproj}) as llm:
        r = llm.create_chat_completion(turn(picture), max_tokens=3, temperature=0)
        plain = llm.create_chat_completion([{"role": "user", "content": "What is it?"}], max_tokens=3,
                                           temperature=0)
        assert r["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 16 + 2
        assert llm.llm_engine.stats()["blocks_used"] == 0


def test_without_a_projector_an_image_is_refused(files):
    model, _, picture = files
    with Llama(model, n_ctx=256, n_threads=2) as llm:
        with pytest.raises(MessageError, match="images are not supported by this model"):
            llm.create_chat_completion(turn(picture), max_tokens=2)


def test_run_answers_about_an_image_file(files):
    model, mmproj, picture = files
    cmd = [sys.executable, "-m", "pyllama_paged.cli", "run", "-m", model, "-n", "3", "-t", "2"]
    ok = subprocess.run(cmd + ["--mmproj", mmproj, "--image", str(picture), "Describe"], capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "[3 tokens in" in ok.stderr
    missing = subprocess.run(cmd + ["--image", str(picture), "Describe"], capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "--image needs a vision projector" in missing.stderr
