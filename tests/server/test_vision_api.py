"""Images on every API this slice serves, with the unmodified ollama and openai clients against a
real server: a tiny Gemma 3 served with a tiny projector (--mmproj) answers about an image on
Ollama's /api/chat and /api/generate (`images`, base64) and OpenAI's chat completions (an
`image_url` data URL); /api/show says "vision"; the image's tokens count in the prompt; the same
image again is encoded once (the cache) and its pages come from the prefix cache; bad images get
a clear 400 and the server keeps serving; a text-only model keeps its 400."""

import base64
import io

import httpx
import numpy as np
import ollama
import openai
import pytest
from PIL import Image

from pyllama_paged.server.app import create_app
from pyllama_paged.testing.serving import Running, tiny_registry, tiny_vision_registry

N_IMAGE_TOKENS = 16   # the tiny projector's image: 8 x 8 patches pooled 2 x 2


def png(seed: int, size: int = 40) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (size, size, 3)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    served = tiny_vision_registry(tmp_path_factory.mktemp("vision"))
    yield served
    served.close()


@pytest.fixture(scope="module")
def vision(registry):
    return registry.get("tiny-vision").vision


def test_show_says_vision(oll):
    assert "vision" in oll.show("tiny-vision").capabilities


def test_ollama_chat_with_an_image(oll, vision):
    before = vision.encoder.n_encoded
    plain = oll.chat(model="tiny-vision", options={"num_predict": 4, "temperature": 0},
                     messages=[{"role": "user", "content": "What is in the picture?"}])
    r = oll.chat(model="tiny-vision", options={"num_predict": 4, "temperature": 0},
                 messages=[{"role": "user", "content": "What is in the picture?", "images": [png(1)]}])
    assert r.done and r.message.role == "assistant"
    # the image's rows, its begin and end tokens are prompt tokens like text
    assert r.prompt_eval_count == plain.prompt_eval_count + N_IMAGE_TOKENS + 2
    assert vision.encoder.n_encoded == before + 1
    again = oll.chat(model="tiny-vision", options={"num_predict": 4, "temperature": 0},
                     messages=[{"role": "user", "content": "What is in the picture?", "images": [png(1)]}])
    assert vision.encoder.n_encoded == before + 1   # the same content is not encoded again
    assert again.message.content == r.message.content


def test_ollama_generate_with_an_image(oll, vision):
    r = oll.generate(model="tiny-vision", prompt="Describe this.", images=[png(2)],
                     options={"num_predict": 3, "temperature": 0})
    plain = oll.generate(model="tiny-vision", prompt="Describe this.", options={"num_predict": 3, "temperature": 0})
    assert r.done and r.prompt_eval_count == plain.prompt_eval_count + N_IMAGE_TOKENS + 2


def test_openai_chat_with_an_image_url(oai, vision):
    before = vision.encoder.n_encoded
    r = oai.chat.completions.create(model="tiny-vision", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": data_url(png(3))}}]}])
    plain = oai.chat.completions.create(model="tiny-vision", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}]}])
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens + N_IMAGE_TOKENS + 2
    assert vision.encoder.n_encoded == before + 1


def test_different_images_give_different_answers(oai):
    """The image reaches the model: two pictures, same words, other logits (greedy, 8 tokens)."""
    def answer(seed):
        r = oai.chat.completions.create(model="tiny-vision", max_tokens=8, temperature=0, logprobs=True,
                                        messages=[{"role": "user", "content": [
                                            {"type": "image_url", "image_url": {"url": data_url(png(seed))}},
                                            {"type": "text", "text": "What?"}]}])
        return [t.logprob for t in r.choices[0].logprobs.content]
    assert answer(10) != answer(11)


@pytest.mark.parametrize("image, message", [
    (base64.b64encode(b"plain text, no picture").decode(), "not an image"),
    (base64.b64encode(png(4)[:60]).decode(), "truncated or corrupt"),
    ("***not base64***", "not valid base64"),
])
def test_bad_images_get_a_400_and_the_server_keeps_serving(server, oll, oai, image, message):
    # raw HTTP for Ollama: its client refuses to send text that is not base64
    r = httpx.post(f"{server.url}/api/chat", json={"model": "tiny-vision", "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [image]}]})
    assert r.status_code == 400 and message in r.json()["error"]
    with pytest.raises(openai.BadRequestError, match=message):
        oai.chat.completions.create(model="tiny-vision", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}]}])
    assert oll.chat(model="tiny-vision", options={"num_predict": 2},
                    messages=[{"role": "user", "content": "still there?"}]).done


def test_remote_image_urls_are_not_fetched(oai):
    with pytest.raises(openai.BadRequestError, match="image URLs are not fetched"):
        oai.chat.completions.create(model="tiny-vision", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}])


def test_a_text_only_model_keeps_its_400(tmp_path):
    registry = tiny_registry(tmp_path)
    running = Running(create_app(registry))
    try:
        client = ollama.Client(host=running.url)
        assert "vision" not in client.show("tiny").capabilities
        with pytest.raises(ollama.ResponseError, match="images are not supported by this model"):
            client.chat(model="tiny", messages=[{"role": "user", "content": "hi", "images": [png(5)]}])
        with pytest.raises(ollama.ResponseError, match="images are not supported by this model"):
            client.generate(model="tiny", prompt="hi", images=[png(5)])
    finally:
        running.close()
        registry.close()


def test_responses_input_image(oai, vision):
    before = vision.encoder.n_encoded
    r = oai.responses.create(model="tiny-vision", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": data_url(png(6))}]}])
    plain = oai.responses.create(model="tiny-vision", max_output_tokens=4, temperature=0, input="What is this?")
    assert r.output and r.usage.output_tokens == 4   # max_output_tokens reached: "incomplete"
    assert r.usage.input_tokens == plain.usage.input_tokens + N_IMAGE_TOKENS + 2
    assert vision.encoder.n_encoded == before + 1


def test_anthropic_image_block(server, vision):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(7)).decode()}
    r = client.messages.create(model="tiny-vision", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "What?"}]}])
    plain = client.messages.create(model="tiny-vision", max_tokens=4,
                                   messages=[{"role": "user", "content": "What?"}])
    assert r.usage.input_tokens == plain.usage.input_tokens + N_IMAGE_TOKENS + 2
    with pytest.raises(anthropic.BadRequestError, match="not valid base64"):
        client.messages.create(model="tiny-vision", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {**source, "data": "***"}}]}])
