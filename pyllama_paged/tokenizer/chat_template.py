"""Chat prompts: the GGUF's own Jinja template when it has one, else a
built-in template for the architecture (the default Gemma 3 file has none)."""

from __future__ import annotations

import jinja2
import jinja2.sandbox

from ..errors import ModelLoadError, PagedError

# Literal text is emitted through {{ '...' }} so whitespace control never eats newlines.
# Gemma: system text is folded into the first user turn; the assistant role is "model".
GEMMA_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if role == 'user' and ns.system -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

CHATML_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

LLAMA3_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
)

LLAMA2_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = '<<SYS>>\n' + m['content'] + '\n<</SYS>>\n\n' -%}"
    "{%- elif m['role'] == 'user' -%}{{ '[INST] ' + ns.system + (m['content'] | trim) + ' [/INST]' }}"
    "{%- set ns.system = '' -%}"
    "{%- else -%}{{ ' ' + (m['content'] | trim) + ' </s>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def builtin_template(arch: str, tokens: list[str] | None) -> str:
    """The built-in template for an architecture (and vocabulary) without one."""
    vocab = set(tokens or ())
    if arch == "gemma3" or "<start_of_turn>" in vocab:
        return GEMMA_TEMPLATE
    if "<|im_start|>" in vocab:
        return CHATML_TEMPLATE
    if "<|start_header_id|>" in vocab:
        return LLAMA3_TEMPLATE
    return LLAMA2_TEMPLATE


class ChatTemplate:
    """Renders a message list to the prompt text the model was trained on."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        self.source = source
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @staticmethod
    def _raise(message: str):
        raise PagedError(f"chat template: {message}")

    @classmethod
    def for_model(cls, metadata: dict, arch: str) -> "ChatTemplate":
        """The file's template, or the built-in one for its architecture."""
        tokens = metadata.get("tokenizer.ggml.tokens")
        source = metadata.get("tokenizer.chat_template")
        if source is not None and not isinstance(source, str):
            raise ModelLoadError("metadata field 'tokenizer.chat_template' must be a string")
        if not source:
            return cls(builtin_template(arch, tokens if isinstance(tokens, list) else None))
        try:
            return cls(source)
        except jinja2.TemplateError as e:  # a syntax error: the file's template cannot be used
            raise ModelLoadError(f"metadata field 'tokenizer.chat_template' does not parse: {e}") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """Prompt text for messages (the tokenizer adds BOS itself); tools, when given, are
        passed to the template as transformers passes them."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise PagedError(f"messages[{i}] must be an object with 'role' and 'content'")
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise PagedError(f"messages[{i}].role '{m['role']}' is not one of system, user, assistant, tool")
            if not isinstance(m["content"], str):
                raise PagedError(f"messages[{i}].content must be a string")
        extra = {"tools": tools} if tools else {}
        try:
            text = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token="", eos_token=self.eos_token, **extra)
        except jinja2.TemplateError as e:
            raise PagedError(f"chat template failed to render: {e}") from e
        return text
