"""The package's import graph: no cycles, and every arrow points down the
layers (server/CLI -> Python API -> engine -> GGUF/tokenizer -> native). The
engine is one layer from outside (its front door, engine/__init__.py) and a
one-way graph of districts inside."""

import ast
import functools
from pathlib import Path

import pyllama_paged

PACKAGE = Path(pyllama_paged.__file__).resolve().parent

# Bottom first; a module may import from its own layer or any layer below.
LAYERS = [
    ["errors", "_version"],
    ["flags"],   # settings that are command-line options: below everything that has some
    ["_native.library"],
    ["_native.status", "_native.ggml_log", "_native.handle", "_native.tensors"],
    ["_native"],   # the binding's facade (_native/__init__.py) re-exports its modules
    ["gguf.config"],
    ["gguf.reader"],
    ["gguf.split"],   # a split GGUF's parts read as one
    # images for vision models: decoding (Pillow), a projector file's encoder, encoded images by hash
    ["vision.preprocess"],
    ["vision.projector", "vision.image_cache"],
    ["vision.prompt_images"],
    # model downloads: below everything that loads models, and needing none of it
    ["models.refs", "models.download", "models.progress", "models.egress", "models.store_files",
     "models.embedded"],
    ["models.store", "models.hub_guard"],
    ["models.hub", "models.ollama_registry"],
    ["models.pull"],
    ["convert.safetensors_file"],
    ["convert.bert_gguf"],
    ["tokenizer.vocab", "tokenizer.render_budget", "tokenizer.template_sandbox", "tokenizer.render_pool"],
    ["tokenizer.spm"],
    ["tokenizer.bpe", "tokenizer.wordpiece", "tokenizer.special", "tokenizer.gemma4_bpe"],
    ["tokenizer.tokenizer", "tokenizer.chat_template"],
    ["constrain.digits", "constrain.thinking_budget"],
    ["constrain.vocab"],
    ["constrain.grammar"],
    ["constrain.masks", "constrain.formats"],
    ["engine"],   # the engine: its districts below (ENGINE), reached from outside only through its front door
    ["tools.gemma4", "tools.call_scan"],
    ["calls.text_stream", "calls.sampling_options", "tools.calls", "tools.messages", "tools.reasoning", "calls.embeddings"],
    ["tools.prompt", "tools.harmony", "calls.rerank_inputs", "calls.rerank_head"],
    ["calls.chat_call"],
    ["api.llama_compat", "api.llama_grammar", "api.llama_pretrained", "api.llama_chat", "api.llama_completion",
     "api.llama_eval", "api.llama_speculative",
     "calls.rerank"],
    ["api.llama_chat_format"],
    ["api.llama"],
    ["server.metrics", "server.dashboard", "server.state", "server.routing.kv_events", "server.api_keys",
     "server.routing.router_contract"],
    ["server.config"],
    ["server.registry"],
    ["server.generation"],
    # what the dialects share: the model lookup, keep_alive, the one chat path, SSE, error bodies
    ["server.lookup", "server.keep_alive", "server.chat", "server.sse", "server.error_bodies", "server.tool_schema",
     "server.openai_token_arrays"],
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
    ["testing.reference.numpy_model", "testing.reference.tiny_gguf", "testing.reference.tiny_gpt_oss",
     "testing.reference.delta_net", "testing.reference.hybrid_model", "testing.reference.tiny_qwen35",
     "testing.reference.sampling_reference",
     "testing.reference.bert_reference", "testing.reference.tiny_bert", "testing.reference.tiny_reranker",
     "testing.reference.tiny_mmproj", "testing.reference.vision_reference",
     "testing.agreement", "testing.invariance", "testing.attention_harness", "testing.cuda_harness", "testing.serving", "testing.loop_control",
     "testing.embedding_sentences", "testing.gguf_mutate", "testing.gguf_fuzz", "testing.synthetic_gguf",
     "testing.synthetic_blocks", "testing.synthetic_bpe", "testing.synthetic_presets", "testing.vocab_metadata",
     "testing.device_checks", "testing.model_sources", "testing.scripted_gguf",
     "testing.ray_cluster", "testing.engine_runs", "testing.routed_logits", "testing.deltas",
     "testing.cuda_graph_replay", "testing.reference.tiny_lora", "testing.split_gguf",
     "testing.reference.gemma4_reference", "testing.reference.loader", "testing.reference.tiny_gemma4",
     "testing.synthetic_gemma4", "testing.chat_replies"],
    ["cli"],
    ["__init__"],   # the public facade re-exports from every layer
    # llama-cpp-python's submodule names (llama_cpp.llama_speculative, ...) over ours
    ["llama_speculative", "llama_chat_format", "llama_grammar", "llama_cpp"],
]

# The engine's districts, bottom first: a module imports its own district or a lower row,
# never a sibling on its row; the engine's own files (one step, its config, the loop, the
# builder) are the top, and the front door re-exports what the rest of the package uses.
ENGINE = [
    ["engine.params", "engine.outputs"],
    ["engine.kv"],
    ["engine.worker"],
    ["engine.spec_decode", "engine.sched", "engine.pooling"],
    ["engine"],
]
DISTRICT_ROW = {district: i for i, row in enumerate(ENGINE) for district in row}
# who outside the engine may import past its front door: the test harnesses drive a ModelRunner
MAY_ENTER_THE_ENGINE = ("testing.",)


def district_of(module: str) -> str | None:
    """The engine district a module belongs to (None: outside the engine)."""
    if module != "engine" and not module.startswith("engine."):
        return None
    parts = module.split(".")
    return ".".join(parts[:2]) if ".".join(parts[:2]) in DISTRICT_ROW else "engine"


def layer_of(module: str) -> int:
    return LAYER["engine"] if district_of(module) else LAYER[module]


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
                found.add(candidate if candidate in MODULES else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pyllama_paged."):
                    found.add(alias.name[len("pyllama_paged") + 1:])
    found.discard("")
    return found


MODULES = {module_name(path) for path in PACKAGE.rglob("*.py")}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Each module's imports of the package's modules (the files are read once per run)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if path.name == "__init__.py" and path.parent != PACKAGE and name not in LAYER and name != "engine":
            continue   # subpackage docstrings: nothing to import (a facade that re-exports is a layer)
        modules[name] = {m for m in imports_of(path) if m != name}
    return modules


def test_every_module_has_a_layer():
    outside = {m for m in graph() if not district_of(m)}
    assert outside | {"engine"} == set(LAYER), "add new modules to LAYERS"


def test_imports_point_down_the_layers():
    upward = [(m, dep) for m, deps in graph().items() for dep in deps if layer_of(dep) > layer_of(m)]
    assert not upward, f"imports against the layering: {upward}"


def test_engine_districts_import_only_lower_ones():
    wrong = [(m, dep) for m, deps in graph().items() if district_of(m) for dep in deps
             if district_of(dep) and district_of(dep) != district_of(m)
             and DISTRICT_ROW[district_of(dep)] >= DISTRICT_ROW[district_of(m)]]
    assert not wrong, f"an engine district imports its own row or above: {wrong}"


def test_engine_districts_each_have_a_row():
    folders = {".".join(p.parent.relative_to(PACKAGE).parts) for p in (PACKAGE / "engine").rglob("__init__.py")}
    files = {f"engine.{p.stem}" for p in (PACKAGE / "engine").glob("*.py")} & set(DISTRICT_ROW)
    assert folders | files == set(DISTRICT_ROW)


def test_outside_reaches_the_engine_only_through_its_front_door():
    g = graph()
    inside = [(m, dep) for m, deps in g.items() if not district_of(m) and not m.startswith(MAY_ENTER_THE_ENGINE)
              for dep in deps if district_of(dep) and dep != "engine"]
    assert not inside, f"engine internals imported from outside the engine: {inside}"
    # and nothing inside goes out through its own front door (it imports everything)
    assert not [m for m, deps in g.items() if district_of(m) and m != "engine" and "engine" in deps]


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
        assert module in graph(), module
        reached = set()
        todo = [module]
        while todo:
            for dep in graph()[todo.pop()]:
                if dep not in reached:
                    reached.add(dep)
                    todo.append(dep)
        assert not reached & {"engine.worker.model_runner", "engine.worker.model", "engine.llm_engine"}, module


# The package's folders (ARCHITECTURE.md has a row for each). The server's dialect folders
# share only what the server's top level and the layers below hold: a new dialect is a
# protocol file and a renderer, never an import of another dialect.
FOLDERS = ["_native", "gguf", "models", "convert", "tokenizer", "constrain", "vision",
           "engine", "engine/kv", "engine/sched", "engine/worker", "engine/spec_decode", "engine/pooling",
           "tools", "calls", "api",
           "server", "server/openai", "server/anthropic", "server/ollama", "server/pooling", "server/routing",
           "server/scale_out",
           "testing", "testing/reference"]
DIALECTS = ["server.openai", "server.anthropic", "server.ollama", "server.pooling", "server.scale_out"]


def folder_of(module: str) -> str:
    parts = module.split(".")
    return module if (PACKAGE / Path(*parts)).is_dir() else ".".join(parts[:-1])


def test_folders_are_the_listed_ones_and_each_has_its_row():
    found = sorted(str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    assert found == sorted(FOLDERS)
    architecture = (Path(__file__).resolve().parents[2] / "ARCHITECTURE.md").read_text()   # the checkout's
    missing = [f for f in FOLDERS if f"`{f}/`" not in architecture and f"`pyllama_paged/{f}/`" not in architecture
               and f"`{f.split('/')[-1]}/`" not in architecture]
    assert not missing, f"ARCHITECTURE.md has no row for {missing}"


def test_no_module_imports_across_dialect_folders():
    crossing = [(m, dep) for m, deps in graph().items() for dep in deps
                if folder_of(m) in DIALECTS and folder_of(dep) in DIALECTS and folder_of(m) != folder_of(dep)]
    assert not crossing, f"a dialect imports another: {crossing}"
