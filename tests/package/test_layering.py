"""The package's import graph: no cycles, and every arrow points down the
layers (server/CLI -> Python API -> engine -> GGUF/tokenizer -> native)."""

import ast
from pathlib import Path

import pyllama_paged

PACKAGE = Path(pyllama_paged.__file__).resolve().parent

# Bottom first; a module may import from its own layer or any layer below.
LAYERS = [
    ["errors", "_version"],
    ["_native.library"],
    ["_native.status", "_native.ggml_log", "_native.handle"],
    ["_native"],   # the binding's facade (_native/__init__.py) re-exports its modules
    ["gguf.config"],
    ["gguf.reader"],
    # model downloads: below everything that loads models, and needing none of it
    ["models.refs", "models.download", "models.progress", "models.egress", "models.store_files"],
    ["models.store", "models.hub_guard"],
    ["models.hub", "models.ollama_registry"],
    ["models.pull"],
    ["convert.safetensors_file"],
    ["convert.bert_gguf"],
    ["tokenizer.vocab", "tokenizer.render_budget"],
    ["tokenizer.spm"],
    ["tokenizer.bpe", "tokenizer.wordpiece", "tokenizer.special"],
    ["tokenizer.tokenizer", "tokenizer.chat_template"],
    ["constrain.vocab"],
    ["constrain.grammar"],
    ["constrain.masks", "constrain.formats"],
    ["engine.pooling.embedding"],
    ["engine.kv.block_pool", "engine.kv.events", "engine.kv.block_store", "engine.worker.thread_policy"],
    ["engine.worker.step_batch", "engine.kv.groups", "engine.spec.draft", "engine.spec.batch", "engine.kv.prefix_tiers",
     "engine.spec.length"],
    ["engine.kv.manager"],
    ["engine.worker.devices"],
    ["engine.worker.model"],
    ["engine.worker.model_runner"],
    ["engine.worker.sampler"],
    ["engine.scoring", "engine.outputs"],
    ["engine.sched.request"],
    ["engine.sched.scheduler_output"],
    ["engine.sched.preemption", "engine.beam_search", "engine.spec.verify", "engine.spec.draft_model"],
    ["engine.sched.step_cost"],
    ["engine.sched.scheduler"],
    ["engine.config"],
    ["engine.llm_engine", "engine.prompt_logprobs"],
    ["engine.loop", "engine.pooling.encoder", "engine.shared_steps", "engine.pooling.rerank_head"],
    ["engine.builder"],
    ["api.text_stream", "api.sampling_options", "tools.calls", "tools.messages", "tools.reasoning", "api.embeddings"],
    ["tools.prompt", "api.rerank_inputs"],
    ["api.llama_compat", "api.llama_grammar", "api.llama_pretrained", "api.llama_chat", "api.llama_completion",
     "api.llama_eval", "api.llama_speculative",
     "api.rerank"],
    ["api.llama_chat_format"],
    ["api.llama"],
    ["server.metrics", "server.dashboard", "server.openai.tokens", "server.scale_out.kv_events", "server.scale_out.router_contract"],
    ["server.registry"],
    ["server.generation"],
    ["server.openai.schemas", "server.openai.logprobs", "server.ollama.pull", "server.ollama.manage",
     "server.anthropic.schemas"],
    ["server.anthropic.messages"],
    ["server.anthropic.stream"],
    ["server.openai.responses_store", "server.openai.responses_items", "server.openai.responses_schemas",
     "server.openai.responses_stream"],
    ["server.ollama.api", "server.openai.api", "server.pooling.embeddings", "server.anthropic.api"],
    ["server.openai.responses", "server.pooling.rerank"],
    ["server.app"],
    # scale out on Ray Serve (optional: only these import ray)
    ["server.scale_out.ray_routing"],
    ["server.scale_out.ray_app"],
    # what tests and benchmarks share (oracles, harnesses, a server runner): above all it checks
    ["testing.reference.numpy_model", "testing.reference.tiny_gguf", "testing.reference.sampling_reference",
     "testing.reference.bert_reference", "testing.reference.tiny_bert", "testing.reference.tiny_reranker",
     "testing.agreement", "testing.attention_harness", "testing.cuda_harness", "testing.serving", "testing.loop_control",
     "testing.embedding_sentences", "testing.gguf_mutate", "testing.gguf_fuzz", "testing.synthetic_gguf", "testing.scripted_gguf",
     "testing.synthetic_blocks", "testing.synthetic_bpe", "testing.synthetic_presets", "testing.vocab_metadata",
     "testing.device_checks", "testing.model_sources",
     "testing.ray_cluster", "testing.engine_runs"],
    ["cli"],
    ["__init__"],   # the public facade re-exports from every layer
    # llama-cpp-python's submodule names (llama_cpp.llama_speculative, ...) over ours
    ["llama_speculative", "llama_chat_format", "llama_grammar", "llama_cpp"],
]
LAYER = {module: i for i, layer in enumerate(LAYERS) for module in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Modules of the package that path imports (anywhere in the file)."""
    package = list(path.relative_to(PACKAGE).parent.parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("pyllama_paged"):
                target = node.module[len("pyllama_paged") + 1:]
            else:
                continue
            for alias in node.names:   # `from . import x` may name a module
                candidate = f"{target}.{alias.name}" if target else alias.name
                found.add(candidate if candidate in LAYER else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pyllama_paged."):
                    found.add(alias.name[len("pyllama_paged") + 1:])
    found.discard("")
    return found


def graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if path.name == "__init__.py" and path.parent != PACKAGE and name not in LAYER:
            continue   # subpackage docstrings: nothing to import (a facade that re-exports is a layer)
        modules[name] = {m for m in imports_of(path) if m != name}
    return modules


def test_every_module_has_a_layer():
    assert set(graph()) == set(LAYER), "add new modules to LAYERS"


def test_imports_point_down_the_layers():
    upward = [(m, dep) for m, deps in graph().items() for dep in deps if LAYER[dep] > LAYER[m]]
    assert not upward, f"imports against the layering: {upward}"


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError(f"import cycle: {' -> '.join(path + [m])}")
        if state.get(m) == 2:
            return
        state[m] = 1
        for dep in g[m]:
            visit(dep, path + [m])
        state[m] = 2

    for m in g:
        visit(m, [])


def test_the_scheduler_keeps_books_and_never_reaches_the_model():
    # it decides a SchedulerOutput over the KV manager; the engine moves KV data and runs the model
    for module in ("engine.sched.scheduler", "engine.sched.preemption", "engine.sched.scheduler_output"):
        reached = set()
        todo = [module]
        while todo:
            for dep in graph()[todo.pop()]:
                if dep not in reached:
                    reached.add(dep)
                    todo.append(dep)
        assert not reached & {"engine.worker.model_runner", "engine.worker.model", "engine.llm_engine"}, module
