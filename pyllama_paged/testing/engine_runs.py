"""Driving an engine to the end in tests: Gemma chat prompts, and requests run
together until the engine has no work left (speculative decoding's tests)."""

from __future__ import annotations


def chat_ids(llm, text: str) -> list[int]:
    """A one-turn Gemma chat prompt of text, as token ids of llm (a Llama)."""
    return llm.tokenize(f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n".encode(),
                        special=True)


def run_together(engine, requests) -> list[list[list[int]]]:
    """Run [(prompt ids, SamplingParams)] in one engine to the end; each request's
    samples' output ids. Fails on any request's error."""
    added = [engine.add_request(prompt, params) for prompt, params in requests]
    while engine.has_work():
        engine.step()
    assert all(r.error is None for r in added), [r.error for r in added]
    return [[s.output_ids for s in r.seqs] for r in added]


def digit_answers(llm, engine, prompt, max_tokens: int) -> list[list[int]]:
    """Greedy answers of prompt constrained to digits and spaces, without and with
    speculative decoding (each checked against the grammar)."""
    from ..constrain.grammar import compile_constraint
    from ..engine import SamplingParams

    answers = []
    for speculative in (False, True):
        constraint = compile_constraint(llm._tokenizer, "regex", r"[0-9]{1,30}( [0-9]{1,30}){0,6}")
        params = SamplingParams(max_tokens=max_tokens, temperature=0, constraint=constraint,
                                speculative=speculative)
        [[ids]] = run_together(engine, [(prompt, params)])
        text = llm.detokenize(ids).decode()
        assert all(c.isdigit() or c == " " for c in text), text
        answers.append(ids)
    return answers


def greedy_with_and_without(engine, prompt, max_tokens: int, **params) -> tuple[list[int], list[int]]:
    """prompt's greedy answer without speculative decoding, then with it (params: more
    SamplingParams fields)."""
    from ..engine import SamplingParams

    [[plain]] = run_together(engine, [(prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                               speculative=False, **params))])
    [[fast]] = run_together(engine, [(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **params))])
    return plain, fast


def chunked_logits(runner, prompt, chunks=(23, 1, 16)):
    """All-position logits of prompt as one new sequence of runner, computed in prefill chunks
    then single-token steps (what the reference checks compare with the float64 model)."""
    import numpy as np

    seq = runner.add_sequence(prompt)
    state = runner.state_slots_of(seq)   # a hybrid's recurrent state slot
    rows, done = [], 0
    for n in list(chunks) + [1] * (len(prompt) - sum(chunks)):
        slots, tables = runner.kv.batch_arrays(seq.handle, done, n)
        rows.append(runner.forward(prompt[done:done + n], list(range(done, done + n)), slots, [0] * n, tables,
                                   list(range(n)), state_slots=state))
        done += n
    return np.concatenate(rows)


def prompt_logits(model, prompt):
    """The logits after prompt, prefilled on a fresh 64-token runner of model (closed after)."""
    from ..engine import EngineConfig
    from ..engine.worker.model_runner import ModelRunner

    runner = ModelRunner(model, EngineConfig(n_ctx=64, n_threads=2, n_batch=64, block_size=16))
    try:
        return runner.prefill(runner.add_sequence(list(prompt)))
    finally:
        runner.close()
