"""Are the answers of window_capacity.py's conversations intact when 20 run at
once in llama-server's 84 MiB? Each of the 24 greedy conversations is run alone
and all together on the engine (same pool bytes); an answer that differs must
part only where the two best logits are within a near-tie (pyllama_paged/testing/agreement.py),
as batch shapes round differently. Writes bench/results/window_answers.{json,md}.

    python -m bench.engine.window_answers
"""

from __future__ import annotations

import argparse

from bench.common.conversations import make_conversations
from bench.common.report import write_results
from pyllama_paged.engine import EngineConfig, LLMEngine, Model, SamplingParams, SchedulerConfig
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.testing.agreement import assert_greedy_agree, engine_logits
from pyllama_paged.tokenizer.tokenizer import Tokenizer

P = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
# llama-server -c 8192 -np 4's KV buffers for the default model: 84 MiB
KV_BYTES = 88080384


def run(m, tok, prompts, kv_bytes):
    """Greedy answers of prompts run together in one engine of kv_bytes; (answers, most running at once)."""
    llm = LLMEngine.from_config(EngineConfig(n_ctx=2048, n_threads=2, n_batch=512, block_size=32, kv_bytes=kv_bytes,
                                             scheduler=SchedulerConfig(max_num_batched_tokens=512)),
                                model=m, eot_ids=tok.eot_ids)
    reqs = [llm.add_request(p, P) for p in prompts]
    outs = {q.request_id: [] for q in reqs}
    peak = 0
    while llm.has_work():
        for o in llm.step():
            outs[o.request_id] += [e.token_id for e in o.events]
        peak = max(peak, llm.stats()["running_seqs"])
    llm.close()
    return [outs[q.request_id] for q in reqs], peak


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    m = Model(None)
    tok = Tokenizer.from_metadata(m.metadata)
    convs = make_conversations(tok, 24, 300, 32, 0)
    prompts = [tok.encode(c["prompt"], add_special=True) for c in convs]
    together, peak = run(m, tok, prompts, KV_BYTES)
    alone = [run(m, tok, [p], KV_BYTES)[0][0] for p in prompts]
    same = sum(a == b for a, b in zip(alone, together))
    r = ModelRunner(m, EngineConfig(n_ctx=2048, n_threads=2, n_batch=512, block_size=32))
    logits_of = engine_logits(r)
    near = 0
    for p, a, b in zip(prompts, alone, together):
        if a != b:
            assert_greedy_agree(p, a, b, logits_of, tok.eot_ids)
            near += 1
    row = {"conversations": 24, "KV MiB": 84, "most running at once": peak, "identical to alone": same,
           "parted at a near-tie": near}
    write_results("window_answers", row, [row], title="Conversations in 84 MiB: answers together vs alone",
                  notes="Greedy, 32 tokens each, the window_capacity.py conversations (seed 0). Every answer that "
                        "differs from the same conversation run alone parts where both tokens are within 0.5 "
                        "logit of the best (checked by pyllama_paged/testing/agreement.py's assert_greedy_agree).")
    print(row)


if __name__ == "__main__":
    main()
