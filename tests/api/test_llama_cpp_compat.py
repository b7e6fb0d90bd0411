"""llama-cpp-python's own usage snippets (its README and docstrings), run as
written but for the import line and the model's path (the embedded default
model), then checked for the shapes its users index into (issue 15, item 3)."""

import json

import pytest

from pyllama_paged import Llama  # was: from llama_cpp import Llama
from pyllama_paged.engine import default_model_path

MODEL_PATH = default_model_path()


def test_readme_completion():
    llm = Llama(
          model_path=MODEL_PATH,
          # n_gpu_layers=-1, # Uncomment to use GPU acceleration
          # seed=1337, # Uncomment to set a specific seed
          # n_ctx=2048, # Uncomment to increase the context window
    )
    output = llm(
          "Q: Name the planets in the solar system? A: ", # Prompt
          max_tokens=32, # Generate up to 32 tokens, set to None to generate up to the end of the context window
          stop=["Q:", "\n"], # Stop generating just before the model would generate a new question
          echo=True # Echo the prompt back in the output
    ) # Generate a completion, can also call create_completion
    print(output)

    assert output["object"] == "text_completion" and output["id"].startswith("cmpl-")
    choice = output["choices"][0]
    assert choice["text"].startswith("Q: Name the planets in the solar system? A: ")
    assert "\n" not in choice["text"] and choice["finish_reason"] in ("stop", "length")
    assert choice["logprobs"] is None and choice["index"] == 0
    assert output["usage"]["total_tokens"] == output["usage"]["prompt_tokens"] + output["usage"]["completion_tokens"]
    llm.close()


def test_readme_gpu_and_seed_arguments_are_accepted():
    with pytest.warns(UserWarning, match="n_gpu_layers"):
        llm = Llama(
              model_path=MODEL_PATH,
              n_gpu_layers=-1, # Uncomment to use GPU acceleration
              seed=1337, # Uncomment to set a specific seed
              n_ctx=2048, # Uncomment to increase the context window
        )
    a = llm("Once upon a time", max_tokens=8)["choices"][0]["text"]
    b = llm("Once upon a time", max_tokens=8)["choices"][0]["text"]
    assert a == b   # the model's seed applies to every call that names none
    assert llm.n_ctx() == 2048
    llm.close()


def test_streaming_completion_and_chat():
    llm = Llama(model_path=MODEL_PATH, chat_format="gemma")
    text = ""
    for output in llm("Q: Name the planets in the solar system? A: ", max_tokens=32, stream=True):
        text += output["choices"][0]["text"]
    assert text
    pieces = []
    for chunk in llm.create_chat_completion(
        messages=[{"role": "user", "content": "Tell me a joke."}], max_tokens=16, stream=True
    ):
        delta = chunk["choices"][0]["delta"]
        if "content" not in delta:
            continue
        pieces.append(delta["content"])
    assert pieces
    chunks = list(llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["delta"] == {}
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    llm.close()


def test_readme_chat_completion():
    llm = Llama(
          model_path=MODEL_PATH,
          chat_format="llama-2"
    )
    out = llm.create_chat_completion(
          messages = [
              {"role": "system", "content": "You are an assistant who perfectly describes images."},
              {
                  "role": "user",
                  "content": "Describe this image in detail please."
              }
          ],
          max_tokens=16,
    )
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(out["choices"][0]["message"]["content"], str)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    llm.close()


# the README's JSON-mode messages
WORLD_SERIES = [
    {
        "role": "system",
        "content": "You are a helpful assistant that outputs in JSON.",
    },
    {"role": "user", "content": "Who won the world series in 2020"},
]


def test_readme_json_mode_and_json_schema():
    # as the README writes it: a free json_object from a base model may run to the context (512)
    llm = Llama(model_path=MODEL_PATH, chat_format="chatml")
    out = llm.create_chat_completion(
        messages=WORLD_SERIES,
        response_format={
            "type": "json_object",
        },
        temperature=0.7,
    )
    content = out["choices"][0]["message"]["content"]
    assert content.startswith("{")
    if out["choices"][0]["finish_reason"] == "stop":   # a free object may fill the context; ended, it parses
        assert isinstance(json.loads(content), dict)
    out = llm.create_chat_completion(
        messages=WORLD_SERIES,
        response_format={
            "type": "json_object",
            "schema": {
                "type": "object",
                "properties": {"team_name": {"type": "string", "maxLength": 20}},
                "required": ["team_name"],
            },
        },
        temperature=0.7,
    )
    assert isinstance(json.loads(out["choices"][0]["message"]["content"])["team_name"], str)
    llm.close()


def test_readme_function_calling():
    with pytest.warns(UserWarning, match="chatml-function-calling"):
        llm = Llama(model_path=MODEL_PATH, chat_format="chatml-function-calling")
    out = llm.create_chat_completion(
          messages = [
            {
              "role": "system",
              "content": "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, detailed, and polite answers to the user's questions. The assistant calls functions with appropriate input when necessary"

            },
            {
              "role": "user",
              "content": "Extract Jason is 25 years old"
            }
          ],
          tools=[{
            "type": "function",
            "function": {
              "name": "UserDetail",
              "parameters": {
                "type": "object",
                "title": "UserDetail",
                "properties": {
                  "name": {
                    "title": "Name",
                    "type": "string"
                  },
                  "age": {
                    "title": "Age",
                    "type": "integer"
                  }
                },
                "required": [ "name", "age" ]
              }
            }
          }],
          tool_choice={
            "type": "function",
            "function": {
              "name": "UserDetail"
            }
          }
    )
    call = out["choices"][0]["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "UserDetail"
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args["name"], str) and isinstance(args["age"], int)
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    llm.close()


@pytest.mark.skipif(not hasattr(Llama, "create_embedding"),
                    reason="Llama.create_embedding lands with issue 15's embeddings work")
def test_readme_embeddings():
    import pyllama_paged as llama_cpp  # was: import llama_cpp

    llm = llama_cpp.Llama(model_path=MODEL_PATH, embedding=True)

    embeddings = llm.create_embedding("Hello, world!")

    # or create multiple embeddings at once

    embeddings = llm.create_embedding(["Hello, world!", "Goodbye, world!"])
    assert [e["index"] for e in embeddings["data"]] == [0, 1]
    assert len(embeddings["data"][0]["embedding"]) == llm.n_embd()
    llm.close()


def test_tokenize_detokenize_and_generate():
    llama = Llama(MODEL_PATH, n_ctx=32)
    tokens = llama.tokenize(b"Hello, world!")
    seen = []
    for token in llama.generate(tokens, top_k=40, top_p=0.95, temp=1.0, repeat_penalty=1.0):
        print(llama.detokenize([token]))
        seen.append(token)
    # as llama-cpp-python's: ids, past end-of-text, until the context is full
    assert tokens[0] == llama.token_bos() and len(tokens) + len(seen) == 32
    assert all(isinstance(t, int) for t in seen)
    assert llama.detokenize(tokens) == b"Hello, world!"
    assert llama.detokenize(tokens[3:], tokens[:3]) == llama.detokenize(tokens[3:])   # prev_tokens positional
    assert llama.tokenizer().decode(llama.tokenizer().encode("Hello, world!", add_bos=False)) == "Hello, world!"
    llama.close()


def test_from_pretrained_finds_installed_packages_before_downloading(monkeypatch):
    from pyllama_paged.testing.model_sources import ModelSources

    with ModelSources() as hub:   # a local Hub: anything asked of it would be seen
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        llm = Llama.from_pretrained(
            repo_id="ggml-org/gemma-3-270m-GGUF",
            filename="*q4_k_m.gguf",
            verbose=False
        )
        assert llm.model_path == MODEL_PATH and hub.seen() == []
        llm.close()
        with pytest.raises(ValueError, match="not found"):
            Llama.from_pretrained(repo_id="Qwen/Qwen2-0.5B-Instruct-GGUF", filename="*q8_0.gguf", verbose=False)
