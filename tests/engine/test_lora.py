"""LoRA adapters (GGUF as llama.cpp's converter writes them) against the float64 reference
W + scale * alpha / rank * B A: alone, at several scales, and with other adapters and plain
sequences in the same prefill and decode steps; the prefix cache keyed by adapter and scale;
clear refusals of adapters that do not fit the model."""

import gguf
import numpy as np
import pytest

from pyllama_paged.engine import EngineConfig, LLMEngine, LoraRequest, Model, SamplingParams, SchedulerConfig
from pyllama_paged.errors import RequestError
from pyllama_paged.engine.worker.lora import LoraAdapter
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.gguf.config import ModelLoadError
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_lora import write_tiny_lora, with_lora

TOLERANCE = 3e-2   # f16 KV, Q8_0 weights, relative to the logits' spread (as test_engine_reference)
PROMPT = [int(x) for x in np.random.default_rng(1).integers(4, 200, size=20)]


@pytest.fixture(scope="module", params=[("gemma3", "q8_0"), ("llama", "q4_k")], ids=lambda p: p[0])
def setup(request, tmp_path_factory):
    arch, wt = request.param
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_model(root / "base.gguf", arch, weight_type=wt)
    paths = {"all": write_tiny_lora(root / "all.gguf", base, seed=1),
             "some": write_tiny_lora(root / "some.gguf", base, seed=2, targets=("attn_q", "attn_v", "ffn_down"),
                                     alpha=None, rank=8, dtype="f16")}
    model = Model(base)
    adapters = {name: LoraAdapter(model, path) for name, path in paths.items()}
    runner = ModelRunner(model, EngineConfig(n_ctx=64, n_threads=2, n_batch=128, block_size=16, num_blocks=64))
    yield runner, adapters, ReferenceModel.from_gguf(base)
    runner.close()
    for a in adapters.values():
        a.close()
    model.close()


def write_adapter(path, arch, tensors):
    """A LoRA adapter file holding exactly these tensors (name -> numpy array)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def relative_error(got, want):
    return np.abs(got - want).max() / (want.max() - want.min())


def reference_last(ref, lora, tokens):
    return (ref if lora is None else with_lora(ref, lora[0].path, lora[1])).forward(tokens)[-1]


def test_one_adapter_matches_the_reference(setup):
    runner, adapters, ref = setup
    plain = ref.forward(PROMPT)[-1]
    for lora in ((adapters["all"], 1.0), (adapters["all"], 0.5), (adapters["some"], 2.0)):
        want = reference_last(ref, lora, PROMPT)
        assert np.abs(want - plain).max() > 10 * TOLERANCE * (want.max() - want.min())   # the adapter matters
        seq = runner.add_sequence_uncached(PROMPT, lora)
        got = runner.prefill(seq)
        runner.free(seq)
        assert relative_error(got, want) < TOLERANCE, lora


def test_different_adapters_and_none_in_one_step(setup):
    """Prefill then decode steps over 2 adapters (one at two scales) and a plain sequence:
    each row is its own reference's."""
    runner, adapters, ref = setup
    loras = [(adapters["all"], 1.0), None, (adapters["some"], 2.0), (adapters["all"], 0.5)]
    lengths = [20, 15, 18, 12]
    seqs = [runner.add_sequence_uncached(PROMPT[:n], lora) for n, lora in zip(lengths, loras)]
    tokens = [PROMPT[:n] for n in lengths]
    logits = runner.step([(s, s.num_tokens) for s in seqs])
    for step in range(3):
        for i, lora in enumerate(loras):
            assert relative_error(logits[i], reference_last(ref, lora, tokens[i])) < TOLERANCE, (step, i)
        nxt = [int(t) for t in logits.argmax(-1)]
        for s, t, toks in zip(seqs, nxt, tokens):
            runner.append_tokens(s, [t])
            toks.append(t)
        logits = runner.step([(s, 1) for s in seqs])
    fork = runner.fork(seqs[2])   # a fork runs its parent's adapter
    assert runner.kv.loras.of[fork.handle] == loras[2]
    for s in seqs + [fork]:
        runner.free(s)
    assert not runner.kv.loras.of


def test_prefix_cache_is_keyed_by_adapter_and_scale(setup):
    runner, adapters, _ = setup
    prompt = [t + 1 for t in PROMPT * 2]   # 40 tokens no other test ran: two full blocks to reuse
    first = runner.add_sequence(prompt, (adapters["all"], 1.0))
    runner.prefill(first)
    runner.free(first)
    for lora, hits in ((None, 0), ((adapters["all"], 0.5), 0), ((adapters["some"], 1.0), 0),
                       ((adapters["all"], 1.0), 32)):
        seq = runner.add_sequence(prompt, lora)
        assert seq.num_computed == hits, lora
        runner.free(seq)


def test_adapters_that_do_not_fit_are_refused(setup, tmp_path):
    runner, adapters, _ = setup
    model = runner.model
    other = write_tiny_model(tmp_path / "other.gguf", model.config.arch, weight_type="q8_0", n_ff=768, n_layer=2)
    cases = {
        "wrong shapes": (write_tiny_lora(tmp_path / "shapes.gguf", other, targets=("ffn_up",)), "does not fit"),
        "a model, not an adapter": (other, "not an adapter"),
        "another kind": (write_tiny_lora(tmp_path / "cv.gguf", model.path, extra_metadata={"adapter.type": "x"}),
                         "adapter.type"),
    }
    for what, (path, words) in cases.items():
        with pytest.raises(ModelLoadError, match=words):
            LoraAdapter(model, path)
    a = np.zeros((4, model.config.n_embd), np.float32)
    half = write_adapter(tmp_path / "half.gguf", model.config.arch, {"blk.0.attn_q.weight.lora_a": a})
    with pytest.raises(ModelLoadError, match="lacks its lora_b"):
        LoraAdapter(model, half)
    # a projection slot past the dense FFN's (a delta-net layer's) has no name an adapter may use
    ssm = write_adapter(tmp_path / "ssm.gguf", model.config.arch, {"blk.0.ssm_out.weight.lora_a": a})
    with pytest.raises(ModelLoadError, match="not an attention or dense FFN projection"):
        LoraAdapter(model, ssm)
    seq = runner.add_sequence_uncached(PROMPT, (adapters["all"], 1.0))   # the runner still serves
    assert np.isfinite(runner.prefill(seq)).all()
    runner.free(seq)


def test_engine_requests_pick_adapters_by_name(setup):
    """Requests naming an adapter, another at scale 2, none, and an unknown one through the
    scheduler: each step's logits row is its own reference's; the unknown name is refused."""
    runner, adapters, ref = setup
    engine = LLMEngine(runner, set(), SchedulerConfig(max_num_batched_tokens=64))
    engine.loras = dict(adapters)   # loaded by the fixture; the engine adds through add_lora otherwise
    try:
        with pytest.raises(RequestError, match="no LoRA adapter named 'nope'"):
            engine.add_request(PROMPT, SamplingParams(max_tokens=3, lora=LoraRequest("nope")))
        asks = {"all": LoraRequest("all"), "none": None, "some": LoraRequest("some", 2.0)}
        rows = {name: [] for name in asks}
        tokens = {name: [] for name in asks}

        def keeper(name):
            def keep(_history, row):
                rows[name].append(row.copy())
                return row
            return keep

        ids = {engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, lora=lora,
                                                         logits_processor=keeper(name))).request_id: name
               for name, lora in asks.items()}
        with pytest.raises(RequestError, match="in use"):
            engine.remove_lora("all")
        while engine.has_work():
            for out in engine.step():
                tokens[ids[out.request_id]] += [e.token_id for e in out.events]
        for name, lora in asks.items():
            r = ref if lora is None else with_lora(ref, adapters[lora.name].path, lora.scale)
            assert len(rows[name]) == 3
            for i, row in enumerate(rows[name]):
                want = r.forward(PROMPT + tokens[name][:i])[-1]
                assert relative_error(row, want) < TOLERANCE, (name, i)
    finally:
        engine.loras = {}   # the fixture closes them
