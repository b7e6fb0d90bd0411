"""qwen3moe (routed experts: our expert panels where the CPU runs them, else GGML's
ggml_mul_mat_id; test_expert_panels.py compares the two) against the float64 NumPy reference: logits
on every attention path and KV layout, forks, preemption, the Llama API and the HTTP
server on a tiny model; and the errors of a broken expert file."""

import itertools
from pathlib import Path

import numpy as np
import pytest

from pyllama_paged._native import ffi, lib
from pyllama_paged.api.llama import Llama
from pyllama_paged.engine import EngineConfig, Model, SamplingParams
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.errors import ModelLoadError
from pyllama_paged.testing import gguf_mutate, synthetic_gguf
from pyllama_paged.testing.agreement import (assert_forked_samples_agree, assert_greedy_agree,
                                              assert_preempted_answers_agree, reference_next_logits,
                                              small_engine)
from pyllama_paged.testing.routed_logits import TOLERANCE, assert_one_step_routes_as_alone, relative_error
from pyllama_paged.testing.routed_logits import assert_routed_logits_match as assert_logits_match
from pyllama_paged.testing.routed_logits import file_logits as engine_logits
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.serving import assert_served_completion
from pyllama_paged.testing.engine_runs import prompt_logits

EOT = {2}   # the tiny vocabulary's </s>
PROMPT = [int(x) for x in np.random.default_rng(1).integers(4, 200, size=40)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny qwen3moe (8 experts, 2 per token) with Q8_0 weights, one with Q4_K weights, and
    one with F16 weights for the greedy answers: their logits are the reference's to a few 1e-4
    of the spread, so a greedy answer parts from the reference's only at an exact tie."""
    root = tmp_path_factory.mktemp("moe")
    return {wt: Path(write_tiny_model(root / f"qwen3moe-{wt}.gguf", "qwen3moe", weight_type=wt, strict=True))
            for wt in ("q8_0", "q4_k", "f16")}


@pytest.fixture(scope="module")
def model(tiny):
    with Model(tiny["f16"]) as loaded:
        yield loaded


@pytest.mark.parametrize("weights", ["q8_0", "q4_k"])
@pytest.mark.parametrize("kv_cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("paged,attention", [(True, "kernel"), (True, "gather"), (False, "kernel")])
def test_logits_match_reference(tiny, reference, weights, kv_cache_type, paged, attention):
    """Our paged operator, the gathered pages through GGML's flash attention and the slab
    baseline all give the reference's logits, with Q8_0 and Q4_K experts."""
    ref = reference[weights]
    want = ref.forward(PROMPT)
    got = engine_logits(tiny[weights], PROMPT, paged=paged, kv_cache_type=kv_cache_type, attention=attention)
    assert_logits_match(got, want, ref.last_router_margin, TOLERANCE[kv_cache_type])


def test_the_router_decides(tiny, reference):
    """Routing matters: the same weights with every token sent to its two least probable experts
    (the router negated) give other logits, so a wrong top-k could not pass the test above."""
    flipped = write_tiny_model(tiny["f16"].parent / "flipped.gguf", "qwen3moe", weight_type="f16",
                               strict=True, tensor_hook=lambda name, d: -d if "ffn_gate_inp" in name else d)
    want = reference["f16"].forward(PROMPT)
    flipped_ref = ReferenceModel.from_gguf(flipped)
    other = flipped_ref.forward(PROMPT)
    assert relative_error(other, want) > 5 * TOLERANCE["f16"]
    got = engine_logits(flipped, PROMPT, paged=True, kv_cache_type="f16")
    assert_logits_match(got, other, flipped_ref.last_router_margin, TOLERANCE["f16"])


def test_tokens_of_many_sequences_in_one_step_route_as_alone(model):
    """A step's tokens from several sequences go through the experts together (one product
    per expert matrix, grouped by expert): each sequence's logits are those it gets alone."""
    prompts = [[int(x) for x in np.random.default_rng(10 + i).integers(4, 200, size=n)]
               for i, n in enumerate([3, 9, 17, 1, 30])]
    assert_one_step_routes_as_alone(model, prompts)


@pytest.mark.parametrize("paged,attention", [(True, "kernel"), (True, "gather")])
def test_a_deep_model_routing_eight_experts_fits_the_graph(tmp_path, paged, attention):
    """Qwen3-30B-A3B's depth and routing (48 layers, 8 experts per token) add about 35 nodes per
    layer for the experts; with 64 sequences of one token each on the gather path (its own nodes
    per sequence and layer) the step still fits the graph, and each row is what it is alone."""
    path = write_tiny_model(tmp_path / "deep.gguf", "qwen3moe", weight_type="q8_0", n_layer=48, n_embd=64,
                            n_head=4, n_head_kv=1, head_dim=16, n_expert=16, n_expert_used=8, n_ff_exp=32)
    model = Model(path)
    n = 64
    runner = ModelRunner(model, EngineConfig(paged=paged, n_ctx=8, n_seq_max=n + 1, n_threads=2, n_batch=n,
                                             block_size=8, num_blocks=(n + 1) * 2, attention=attention))
    try:
        seqs = [runner.add_sequence([5 + i]) for i in range(n)]
        together = runner.step([(s, 1) for s in seqs]).copy()
        alone = runner.step([(runner.add_sequence([5 + 9]), 1)])
        assert together.shape[0] == n and np.isfinite(together).all()
        assert relative_error(together[9], alone[0]) < 1e-3
    finally:
        runner.close()
        model.close()


def test_the_qwen3_30b_a3b_preset_shrinks_and_takes_shape_flags(tmp_path):
    """synthetic_gguf's qwen3-30b-a3b preset, shrunk (--small) and reshaped by its flags, is a
    qwen3moe file of those shapes that the engine loads and runs."""
    out = tmp_path / "qwen3moe.gguf"
    assert synthetic_gguf.main(["--preset", "qwen3-30b-a3b", "--small", "--n-embd", "256", "--n-expert", "16",
                                "--n-expert-used", "4", "--out", str(out)]) == 0
    model = Model(str(out))
    try:
        cfg = model.config
        assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.head_dim, cfg.n_vocab, cfg.n_ctx_train) == \
               ("qwen3moe", 2, 256, 128, 151936, 40960)
        assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == (16, 4, 256)
        logits = prompt_logits(model, range(100, 120))
        assert logits.shape == (151936,) and np.isfinite(logits).all() and logits.std() > 0.5
    finally:
        model.close()


PROMPTS = [[int(x) for x in np.random.default_rng(20 + i).integers(4, 300, size=n)]
           for i, n in enumerate([5, 17, 33, 48, 9, 60])]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def reference_answers(reference):
    ref = reference["f16"]
    return [ref.generate_greedy(p, GREEDY.max_tokens) for p in PROMPTS]


def test_parallel_samples_fork_and_copy_on_write_keep_the_reference_answer(model, reference):
    """n=3 greedy samples share the prompt's pages, copy the partial last block on their first
    write, and each continues as the reference does."""
    with small_engine(model, EOT) as llm:   # 2 full blocks and a partial one
        assert_forked_samples_agree(llm, PROMPTS[2], reference["f16"], EOT)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_reference_answers(model, reference, reference_answers, mode):
    llm = small_engine(model, EOT, num_blocks=12, mode=mode)
    try:
        assert_preempted_answers_agree(llm, PROMPTS, GREEDY, reference["f16"], reference_answers, EOT)
    finally:
        llm.runner.close()


def test_llama_api_and_http_server_answer_as_the_reference(tiny, reference):
    """Llama.generate gives the reference's greedy continuation of a prompt, and its text comes
    back from Llama.create_completion, /v1/completions (the real openai client) and /api/generate."""
    path = tiny["f16"]
    prompt = "The capital of France is"
    llm = Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False)
    try:
        ids = llm.tokenize(prompt)
        got = list(itertools.islice(llm.generate(ids, temp=0), 8))
        ref = reference["f16"]
        assert_greedy_agree(ids, ref.generate_greedy(ids, 8), got, reference_next_logits(ref))
        answer = list(itertools.takewhile(lambda t: t not in EOT, got))
        text = llm.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
        assert text == llm.detokenize(answer, prev_tokens=ids).decode("utf-8", "replace")
    finally:
        llm.close()
    assert_served_completion(path, prompt, text)


# ---- broken files -----------------------------------------------------------------------

def mutated(tmp_path, source, ops):
    doc = gguf_mutate.parse(source.read_bytes())
    out = tmp_path / "broken.gguf"
    out.write_bytes(gguf_mutate.build(doc, ops))
    return str(out)


@pytest.mark.parametrize("ops,message", [
    gguf_mutate.missing_tensor_case("blk.1.ffn_up_exps.weight"),
    gguf_mutate.missing_tensor_case("blk.0.ffn_gate_inp.weight"),
    ([["kv", "qwen3moe.expert_used_count", gguf_mutate.U32, 9]],
     r"'qwen3moe\.expert_used_count' is 9, more than the 8 experts of 'qwen3moe\.expert_count'"),
    ([["kv", "qwen3moe.expert_count", gguf_mutate.U32, 0]], r"'qwen3moe\.expert_count' is 0, outside \[1, 1024\]"),
    ([["kv_drop", "qwen3moe.expert_count"]], r"missing metadata field 'qwen3moe\.expert_count'"),
    ([["kv", "qwen3moe.expert_count", gguf_mutate.U32, 4]],
     r"tensor 'blk\.0\.ffn_gate_inp\.weight': shape \[256, 8\] but the hyper-parameters need \[256, 4\]"),
    ([["kv", "qwen3moe.expert_feed_forward_length", gguf_mutate.U32, 128]],
     r"tensor 'blk\.0\.ffn_gate_exps\.weight': shape \[256, 256, 8\] but the hyper-parameters need "
     r"\[256, 128, 8\] \(one matrix per expert\)"),
])
def test_a_broken_expert_file_is_refused_precisely(tmp_path, tiny, ops, message):
    path = mutated(tmp_path, tiny["q8_0"], ops)
    with pytest.raises(ModelLoadError, match=message):
        Model(path)


@pytest.mark.parametrize("fields,message", [
    ({"n_expert": 0, "n_expert_used": 0}, "expert_count 0 must be between 1 and 1024"),
    ({"n_expert": 8, "n_expert_used": 9}, "expert_used_count 9 must be between 1 and expert_count 8"),
    ({"n_expert": 8, "n_expert_used": 2, "n_ff_exp": 0}, "expert_feed_forward_length 0 must be positive"),
    ({"arch": lib.PP_ARCH_QWEN3, "n_expert": 8, "n_expert_used": 2}, "without experts"),
])
def test_the_native_core_checks_the_expert_counts_itself(fields, message):
    """pp_model_create refuses what config_from_metadata would have refused first."""
    from pyllama_paged._native import last_error
    hp = {"arch": lib.PP_ARCH_QWEN3MOE, "n_layer": 1, "n_embd": 64, "n_head": 2, "n_head_kv": 1, "head_dim": 32,
          "n_ff": 64, "n_vocab": 300, "n_ctx_train": 64, "rope_type": 2, "rope_freq_base": 1e4,
          "rope_freq_scale": 1.0, "rms_eps": 1e-6, "attn_scale": 1.0, "embd_scale": 1.0, "n_ff_exp": 32}
    out = ffi.new("pp_model **")
    assert lib.pp_model_create(ffi.new("pp_model_hparams *", {**hp, **fields}), out) == lib.PP_ERR_INVALID
    assert message in last_error()
