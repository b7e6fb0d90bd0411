"""Batch invariance (docs/batch-invariance.md): a request's tokens and log-probabilities are
the same bits whether it runs alone on a quiet engine or among many others, whatever the
step's width, chunking, thread count, preemption, prefix hits, forks, beams or drafts.

Each case runs the same workload twice on a tiny model: every request alone (one thread,
one prefill chunk, a roomy pool), then all of them together (random arrival steps, small
chunks, two threads, a pool small enough to preempt). Greedy and seeded sampled requests
are mixed; the comparison is bitwise (pyllama_paged/testing/invariance.py)."""

import pytest

from pyllama_paged.engine import EngineConfig, LLMEngine, Model, SamplingParams, SchedulerConfig, SpeculativeConfig
from pyllama_paged.engine.spec_decode.verify import Speculator
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.testing.invariance import compare, random_workload, run_alone, run_workload
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_gemma4 import write_tiny_gemma4
from pyllama_paged.testing.reference.tiny_gpt_oss import write_tiny_gpt_oss

EOT = {1}
VOCAB = (4, 250)

# (architecture, weight type, writer options): every architecture, the weight types our panel
# GEMMs take (Q8_0, Q4_0, K-quants, F16, BF16) and those GGML's kernels run (Q4_1, Q5_1,
# IQ4_NL, TQ2_0), and an odd GQA group (three query heads on one KV head: a tile pairs rows
# of different tokens); gemma4's dense file (sliding and full layers of different head sizes,
# shared-KV layers, per-layer embeddings) and its MoE one (experts beside the dense FFN)
CASES = [
    ("gemma3", "q8_0", {}),
    ("llama", "q4_1", dict(n_head=3, n_head_kv=1, head_dim=64, n_layer=6)),
    ("llama", "f16", {}),
    ("llama", "bf16", dict(n_head=3, n_head_kv=3, head_dim=64)),
    ("qwen2", "q4_0", {}),
    ("qwen3", "q4_k", {}),
    ("qwen3moe", "q4_k", {}),
    ("llama", "q5_1", {}),
    ("llama", "iq4_nl", {}),
    ("llama", "tq2_0", {}),
    ("gemma4", "q8_0", dict(shape="dense")),
    ("gemma4", "q4_k", dict(shape="moe")),
]


def mixed_params(i: int, max_tokens: int = 10) -> SamplingParams:
    """Even requests greedy, odd ones sampled with their own seed; each token's logprob."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=1000 + i, logprobs=1,
                          ignore_eos=True)


def engine_factory(model, *, threads=1, budget=512, blocks=400, mode="recompute", n_ctx=256, speculative=None):
    def make():
        runner = ModelRunner(model, EngineConfig(n_ctx=n_ctx, n_threads=threads, n_batch=budget, block_size=16,
                                                 num_blocks=blocks))
        engine = LLMEngine(runner, EOT, SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode))
        if speculative is not None:
            engine.use_speculator(Speculator(speculative))
        return engine
    return make


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def model(request, tmp_path_factory):
    arch, weight_type, options = request.param
    path = tmp_path_factory.mktemp("invariance") / f"{arch}-{weight_type}.gguf"
    if arch == "gemma4":
        path = write_tiny_gemma4(path, weight_type=weight_type, **options)
    else:
        path = write_tiny_model(path, arch, weight_type=weight_type, **options)
    m = Model(path)
    yield m
    m.close()


def together(make, workload):
    engine = make()
    try:
        return run_workload(engine, workload), engine.stats()
    finally:
        engine.close()


def test_alone_and_together_are_the_same_bits(model):
    workload = random_workload(24, VOCAB, mixed_params, seed=1)
    alone = run_alone(engine_factory(model), workload)
    # a pool that preempts: two layer groups' blocks for gemma3's and gemma4's sliding windows
    blocks = 40 if model.config.arch in ("gemma3", "gemma4") else 20
    got, stats = together(engine_factory(model, threads=2, budget=37, blocks=blocks), workload)
    assert stats["preemptions"] > 0   # the small pool did preempt
    result = compare(alone, got)
    assert result.bit_identical == result.n, str(result)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    m = Model(write_tiny_model(tmp_path_factory.mktemp("invariance") / "gemma3.gguf", "gemma3", context_length=1024))
    yield m
    m.close()


def test_swapped_requests_are_the_same_bits(gemma3):
    """Preemption that swaps a request's pages to host memory and back."""
    workload = random_workload(24, VOCAB, mixed_params, seed=2)
    alone = run_alone(engine_factory(gemma3), workload)
    got, stats = together(engine_factory(gemma3, threads=2, budget=37, blocks=40, mode="swap"), workload)
    assert stats["preemptions"] > 0
    result = compare(alone, got)
    assert result.bit_identical == result.n, str(result)


def test_prefix_hits_are_the_same_bits(gemma3):
    """A shared 40-token prefix: alone each request computes it cold, together most take its
    blocks from the pool's prefix cache."""
    workload = random_workload(16, VOCAB, mixed_params, seed=2, shared_prefix=list(range(10, 50)))
    alone = run_alone(engine_factory(gemma3), workload)
    got, stats = together(engine_factory(gemma3, threads=2, budget=29), workload)
    assert stats["prefix_cache_hits"] > 0
    result = compare(alone, got)
    assert result.bit_identical == result.n, str(result)


def test_long_contexts_split_or_not_are_the_same_bits(gemma3):
    """Past two slices of keys a lone decode splits its keys across the threads (split-K);
    among others it does not: the same bits either way."""
    workload = random_workload(4, VOCAB, lambda i: mixed_params(i, max_tokens=24), seed=3, prompt_len=(560, 700),
                               arrival_steps=3)
    alone = run_alone(engine_factory(gemma3, threads=2, n_ctx=1024, blocks=600), workload)
    got, _ = together(engine_factory(gemma3, threads=1, budget=300, n_ctx=1024, blocks=600), workload)
    result = compare(alone, got)
    assert result.bit_identical == result.n, str(result)


def test_forks_and_beams_are_the_same_bits(gemma3):
    """n=3 samples sharing their prompt's pages, and a beam search, alone and among others."""
    def params(i):
        if i % 3 == 0:
            return SamplingParams(max_tokens=8, temperature=0.8, seed=7 + i, n=3, logprobs=1, ignore_eos=True)
        if i % 3 == 1:
            return SamplingParams(max_tokens=8, temperature=0, beam_width=3, ignore_eos=True)
        return mixed_params(i)
    workload = random_workload(12, VOCAB, params, seed=4)
    alone = run_alone(engine_factory(gemma3), workload)
    got, _ = together(engine_factory(gemma3, threads=2, budget=41, blocks=120), workload)
    result = compare(alone, got)
    assert result.bit_identical == result.n, str(result)


def test_speculative_drafts_are_the_same_bits(gemma3):
    """Prompt-lookup drafts verified in the step (several rows of one sequence at once) give
    the tokens and logprobs of plain decoding, greedy and sampled."""
    repeating = [list(range(20, 32)) * 4 for _ in range(8)]
    workload = random_workload(8, VOCAB, mixed_params, seed=5)
    workload.prompts = [r + p[:5] for r, p in zip(repeating, workload.prompts)]
    alone = run_alone(engine_factory(gemma3), workload)
    engine = engine_factory(gemma3, threads=2, budget=64, speculative=SpeculativeConfig(draft_token_cost=0))()
    try:
        got = run_workload(engine, workload)
        assert engine.speculator.num_draft_tokens > 0
    finally:
        engine.close()
    result = compare(alone, got)
    assert result.bit_identical == result.n, str(result)


def test_attention_sinks_are_the_same_bits(tmp_path):
    """gpt-oss: sinks join every row's softmax once, whichever slice or tile holds its keys."""
    m = Model(write_tiny_gpt_oss(tmp_path / "gpt-oss.gguf"))
    try:
        workload = random_workload(12, VOCAB, mixed_params, seed=6)
        alone = run_alone(engine_factory(m), workload)
        got, _ = together(engine_factory(m, threads=2, budget=37, blocks=40), workload)
    finally:
        m.close()
    result = compare(alone, got)
    assert result.bit_identical == result.n, str(result)
