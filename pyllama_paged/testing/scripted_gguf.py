"""A tiny real GGUF (qwen3 architecture) whose greedy reply is a script we choose, so that
end-to-end tests can watch a model think (``<think>...</think>``, or gpt-oss's harmony
channels), answer and call tools through the real engine, tokenizer, chat template and server.

How the weights make the script: every layer's ``attn_output`` and ``ffn_down`` are zero, so
each layer adds nothing to the residual stream and the final hidden state is
RMSNorm(token_embd[current token]) (``output_norm`` is all ones). The chain's tokens (the
prompt's last token, the reply's, then ``<|im_end|>``) get orthogonal embeddings of RMS 1, and
the untied output head's row for a chain token is ``SCRIPT_LOGIT / n_embd`` times the
embedding of the token before it; every other row is zero. From a chain token the next one's
logit is then SCRIPT_LOGIT and every other logit is 0, so the script is followed at any
ordinary temperature, whatever came earlier in the prompt. The next token depends on the
current one only, so no token may occur twice in the chain: a reply piece may be any string
(it becomes one token of its own), which keeps scripts free of repeats; a piece of the format's
markup may repeat, since the vocabulary then holds a copy of it for each use (a second special
token of the same text: readers that go by token ids and their types see the same marker).

The vocabulary is the tiny SentencePiece one (reference/tiny_gguf.build_vocab) with Qwen3's
markup typed as llama.cpp types it in Qwen3's files: ``<|im_start|>``/``<|im_end|>`` control
tokens (``<|im_end|>`` the EOS), ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``
user-defined; plus single tokens for "\\n" and "\\n\\n" (Qwen's BPE has both), so that a
generation prompt ending in ``</think>\\n\\n`` ends on a token of its own. No BOS and no space
prefix, as with Qwen3.

THINKING_TEMPLATE, OPEN_THINK_TEMPLATE and QWEN35_TEMPLATE are ChatML templates written here
(the last in Qwen3.5's shape: an open think block, XML calls); all render
``tools`` in the system turn and assistant ``tool_calls`` in the history, so the server's tool
path hands tools to them (tools.prompt.knows_tools) and reads calls back as Hermes-style
``<tool_call>`` blocks.

HARMONY_TEMPLATE is a template in the spirit of gpt-oss's, written here, for a vocabulary with
HARMONY_MARKUP: harmony's special tokens typed as gpt-oss's GGUF types them (all control;
``<|return|>`` the EOS). The reply is harmony (tools.harmony), read by its marker tokens: a
reply piece that holds markup in its text (``"assistant<|channel|>"``) is an ordinary token,
text that only spells markers, as an attacker's would.

GEMMA4_MARKUP types Gemma 4's tokens as its GGUF does, for a reply in its format under the tiny
gemma4 file's template (reference/tiny_gemma4.GEMMA4_TEMPLATE); since Gemma 4 goes on after a
tool's result inside its own turn, ``after`` starts a script at a piece other than the generation
prompt's last token (``<tool_response|>``). ``arch="gemma4"`` writes the script into tiny_gemma4's
dense shape instead (the same vocabulary, read as SentencePiece): its layers add nothing either
(``attn_output``, ``ffn_down`` and the per-layer embeddings' ``proj`` zero; the output scales only
scale what the final RMSNorm divides out), and its soft-cap of 30 leaves the script's logit at 23.7.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from ..tokenizer.chat_template import ChatTemplate
from ..tokenizer.spm import SPACE_MARK
from ..tokenizer.tokenizer import Tokenizer
from .reference.tiny_gemma4 import CONTROL_PIECES as GEMMA4_CONTROL
from .reference.tiny_gemma4 import END_OF_TURN as GEMMA4_END_OF_TURN
from .reference.tiny_gemma4 import USER_DEFINED_PIECES as GEMMA4_USER_DEFINED
from .reference.tiny_gemma4 import write_tiny_gemma4
from .reference.tiny_gguf import build_vocab, write_tiny_model

ARCH = "qwen3"
END_OF_TURN = "<|im_end|>"
CONTROL_PIECES = ("<|im_start|>", END_OF_TURN)
USER_DEFINED_PIECES = ("<think>", "</think>", "<tool_call>", "</tool_call>")
NEWLINE_PIECES = ("\n", "\n\n")
# Logit of the script's next token (every other logit is 0): e^-32 per rival token leaves
# greedy and sampled replies alike on the script.
SCRIPT_LOGIT = 32.0
# A message to render when finding where the generation prompt ends.
PROBE_MESSAGES = ({"role": "user", "content": "Hello"},)


@dataclass(frozen=True)
class Markup:
    """A chat format's special pieces as its GGUF types them, and the piece that is the EOS."""

    control: tuple[str, ...]
    user_defined: tuple[str, ...]
    eos: str
    plain: tuple[str, ...] = NEWLINE_PIECES   # ordinary pieces the format needs whole


QWEN3_MARKUP = Markup(CONTROL_PIECES, USER_DEFINED_PIECES, END_OF_TURN)
# gpt-oss's (o200k_harmony's) special tokens; the tokenizer makes <|end|> and the header
# tokens user-defined and <|return|> and <|call|> the ends of generation, as llama.cpp does
HARMONY_MARKUP = Markup(("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                         "<|call|>"), (), "<|return|>")
# Gemma 4's (testing/reference/tiny_gemma4.py): <turn|> ends a turn (the EOS); <|tool_response>,
# where a call's result goes, ends the reply too (the tokenizer makes it an end of generation)
GEMMA4_MARKUP = Markup(GEMMA4_CONTROL, GEMMA4_USER_DEFINED, GEMMA4_END_OF_TURN)

# Where an assistant turn ends, and the tool results' and the other turns after it (every
# template here but harmony's)
_LATER_TURNS_END = (
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# The turns, shared by both templates: the system turn carries the tools; earlier assistant
# turns keep only what follows their think block (Qwen3 drops old thinking the same way).
_TURNS = (
    "{%- set ns = namespace(first=0) -%}"
    "{%- if tools or messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] -}}{%- set ns.first = 1 -%}"
    "{%- if tools -%}{{- '\n\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- 'These functions can be called:\n<tools>\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}"
    "{{- '</tools>\nTo call one, write its name and arguments as JSON between tags:\n'"
    " + '<tool_call>\n{\"name\": \"the name\", \"arguments\": {\"argument\": \"value\"}}\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.first:] -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set answer = m['content'].split('</think>')[-1] | trim -%}"
    "{{- '<|im_start|>assistant\n' + answer -}}"
    "{%- for call in m.get('tool_calls') or [] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{%- if answer or not loop.first -%}{{- '\n' -}}{%- endif -%}"
    "{{- '<tool_call>\n{\"name\": ' -}}{{- f['name'] | tojson -}}"
    "{{- ', \"arguments\": ' -}}{{- f['arguments'] | tojson -}}{{- '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
) + _LATER_TURNS_END

# Qwen3's switch: enable_thinking=false gives the reply an empty think block up front.
THINKING_TEMPLATE = _TURNS + (
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\n\n</think>\n\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# DeepSeek-R1's distills' way: the prompt opens the think block, the model only closes it.
OPEN_THINK_TEMPLATE = _TURNS + (
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n<think>\n' -}}"
    "{%- endif -%}"
)

# Qwen3.5's shape (written here after its format): the tools as JSON lines in the system turn
# and calls asked for as XML, <function=NAME> with a <parameter=KEY> block per argument inside
# <tool_call>; earlier calls rendered the same way from their arguments (a mapping); tool
# results in a user turn; the generation prompt opens the think block (enable_thinking=false:
# an empty one).
QWEN35_TEMPLATE = (
    "{%- set ns = namespace(first=0) -%}"
    "{%- if tools or messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if tools -%}"
    "{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nTo call a function reply with:\n\n<tool_call>\n<function=the_name>\n'"
    " + '<parameter=the_parameter>\nits value\n</parameter>\n</function>\n</tool_call>' -}}"
    "{%- endif -%}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}{{- '\n\n' -}}{%- endif -%}"
    "{{- messages[0]['content'] -}}{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.first:] -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set answer = (m['content'] or '').split('</think>')[-1] | trim -%}"
    "{{- '<|im_start|>assistant\n' + answer -}}"
    "{%- for call in m.get('tool_calls') or [] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{%- if answer or not loop.first -%}{{- '\n\n' -}}{%- endif -%}"
    "{{- '<tool_call>\n<function=' + f['name'] + '>\n' -}}"
    "{%- for key, value in f['arguments'] | items -%}"
    "{{- '<parameter=' + key + '>\n' -}}"
    "{%- if value is mapping or (value is sequence and value is not string) -%}{{- value | tojson -}}"
    "{%- else -%}{{- value | string -}}{%- endif -%}"
    "{{- '\n</parameter>\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
) + _LATER_TURNS_END + (
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\n\n</think>\n\n' -}}"
    "{%- else -%}"
    "{{- '<think>\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# gpt-oss's shape: a system message with the effort, a developer message with the instructions
# and the tools as a namespace, earlier answers as final messages (their analysis dropped), a
# call addressed to functions.NAME in the header, its result from functions.NAME as JSON text.
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are a scripted model.\nReasoning: ' -}}"
    "{{- reasoning_effort if reasoning_effort is defined else 'medium' -}}"
    "{{- '\n\n# Valid channels: analysis, commentary, final.' -}}"
    "{%- if tools -%}{{- \"\nCalls to these tools must go to the commentary channel: 'functions'.\" -}}{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- set ns = namespace(first=0, called='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.first = 1 -%}{%- endif -%}"
    "{%- if ns.first or tools -%}"
    "{{- '<|start|>developer<|message|>' -}}"
    "{%- if ns.first -%}{{- '# Instructions\n\n' + messages[0]['content'] + '\n\n' -}}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set f = tool['function'] -%}"
    "{{- '// ' + (f['description'] or '') + '\ntype ' + f['name'] + ' = (_: ' -}}"
    "{{- f['parameters'] | tojson -}}{{- ') => any;\n\n' -}}"
    "{%- endfor -%}"
    "{{- '} // namespace functions' -}}"
    "{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.first:] -%}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') -%}"
    "{%- set f = m['tool_calls'][0]['function'] -%}"
    "{{- '<|start|>assistant to=functions.' + f['name'] + '<|channel|>commentary json<|message|>' -}}"
    "{{- f['arguments'] | tojson -}}{{- '<|call|>' -}}"
    "{%- set ns.called = f['name'] -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<|start|>functions.' + (ns.called or m.get('name') or '') -}}"
    "{{- ' to=assistant<|channel|>commentary<|message|>' + m['content'] | tojson + '<|end|>' -}}"
    "{%- else -%}"
    "{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)


def _vocab_piece(text: str) -> str:
    """How a piece of text is spelled in the SentencePiece vocabulary."""
    return text.replace(" ", SPACE_MARK)


def _extra_pieces(reply: Sequence[str], markup: Markup) -> list[str]:
    # once each (build_vocab gives a piece listed twice two tokens), but for markup the reply
    # uses again: a copy for each further use
    special = markup.control + markup.user_defined
    pieces = list(dict.fromkeys(special + markup.plain + tuple(_vocab_piece(p) for p in reply)))
    return pieces + [p for p in special for _ in range(list(reply).count(p) - 1)]


def _mark_up(vocab: dict, chat_template: str, markup: Markup) -> None:
    """Type the format's markup, make its EOS piece the EOS and add the template (the vocab_hook)."""
    copies = _copies(vocab["tokens"], markup)
    for piece in markup.control:
        for i in copies[piece]:
            vocab["types"][i] = int(gguf.TokenType.CONTROL)
    for piece in markup.user_defined:
        for i in copies[piece]:
            vocab["types"][i] = int(gguf.TokenType.USER_DEFINED)
    vocab.update(eos=copies[markup.eos][-1], add_bos=False, add_eos=False, add_space_prefix=False,
                 chat_template=chat_template)


def _copies(tokens: Sequence[str], markup: Markup) -> dict[str, list[int]]:
    """Each markup piece's token ids, in vocabulary order."""
    special = set(markup.control + markup.user_defined)
    copies: dict[str, list[int]] = {p: [] for p in special}
    for i, t in enumerate(tokens):
        if t in special:
            copies[t].append(i)
    return copies


def scripted_tokenizer(reply: Sequence[str], chat_template: str, markup: Markup = QWEN3_MARKUP) -> Tokenizer:
    """The tokenizer that write_scripted_model's file for reply, chat_template and markup will have."""
    vocab = build_vocab(ARCH, None, _extra_pieces(reply, markup))
    _mark_up(vocab, chat_template, markup)
    return Tokenizer(vocab["tokens"], vocab["scores"], vocab["types"], model="llama", bos_id=vocab["bos"],
                     eos_id=vocab["eos"], unk_id=vocab["unk"], add_bos=vocab["add_bos"],
                     add_eos=vocab["add_eos"], add_space_prefix=vocab["add_space_prefix"])


def script_chain(reply: Sequence[str], chat_template: str, variables: dict | None = None,
                 markup: Markup = QWEN3_MARKUP, end: str | None = None, after: str | None = None) -> list[int]:
    """Token ids of the chain: the rendered generation prompt's last token (or the piece after,
    for prompts that end elsewhere: Gemma 4's after a tool's result), the reply's pieces, then
    end (one of markup's pieces that ends generation; None: the EOS, <|im_end|> for Qwen3).
    Raises ValueError when a token comes twice."""
    tokenizer = scripted_tokenizer(reply, chat_template, markup)
    prompt = ChatTemplate(chat_template).render(list(PROBE_MESSAGES), variables=variables)
    start = tokenizer.encode(prompt, add_special=True, parse_special=True)[-1] if after is None \
        else tokenizer.token_to_id(after)
    last = tokenizer.eos_id if end is None else tokenizer.token_to_id(end)
    if last not in tokenizer.eot_ids:
        raise ValueError(f"the reply must end with a token that ends generation, not {end!r}")
    copies = _copies(tokenizer.tokens, markup)
    uses: dict[str, int] = {}

    def token(piece: str) -> int:
        if piece not in copies:
            return tokenizer.token_to_id(_vocab_piece(piece))
        uses[piece] = uses.get(piece, -1) + 1   # the markup's k-th use: its k-th copy
        return copies[piece][uses[piece]]

    chain = [start] + [token(p) for p in reply] + [last]
    seen: dict[int, int] = {}
    for position, tid in enumerate(chain):
        if tid in seen:
            raise ValueError(f"token {tokenizer.tokens[tid]!r} comes twice in the chain (positions "
                             f"{seen[tid]} and {position}; 0 is the prompt's last token): the next "
                             "token can only depend on the current one")
        seen[tid] = position
    return chain


def write_scripted_model(path: str | os.PathLike, reply: Sequence[str], chat_template: str, *,
                         variables: dict | None = None, markup: Markup = QWEN3_MARKUP, end: str | None = None,
                         after: str | None = None, seed: int = 0, n_embd: int = 256, weight_type: str = "f16",
                         arch: str = ARCH, **options: Any) -> str:
    """Write a qwen3 (or gemma4: arch) GGUF whose reply to chat_template's generation prompt
    (rendered with variables, e.g. {"enable_thinking": False}), or to any prompt ending with the
    piece after, is the pieces of reply, each one token, then end (None: the EOS of markup,
    Qwen3's by default); returns the path. options go to write_tiny_model (n_layer, name, ...),
    for gemma4 to write_tiny_gemma4 (context_length, name, ...; n_embd is its shape's 256)."""
    chain = script_chain(reply, chat_template, variables, markup, end, after)
    if len(chain) > n_embd:
        raise ValueError(f"a chain of {len(chain)} tokens needs n_embd >= {len(chain)} (orthogonal embeddings)")
    rng = np.random.default_rng(seed)
    # orthonormal columns, scaled so that each embedding's RMS (what RMSNorm divides by) is 1
    basis = np.linalg.qr(rng.standard_normal((n_embd, len(chain))))[0].T * np.sqrt(n_embd)

    def tensor_hook(name: str, data: np.ndarray) -> np.ndarray:
        if name == "token_embd.weight":
            data = data.copy()
            data[chain] = basis
            return data
        if name == "output.weight":
            head = np.zeros_like(data)
            head[chain[1:]] = basis[:-1] * (SCRIPT_LOGIT / n_embd)
            return head
        if name == "output_norm.weight":
            return np.ones_like(data)
        if name.endswith((".attn_output.weight", ".ffn_down.weight", ".proj.weight")):
            return np.zeros_like(data)
        return data

    if arch == "gemma4":
        vocab = build_vocab(ARCH, None, _extra_pieces(reply, markup))
        _mark_up(vocab, chat_template, markup)
        return write_tiny_gemma4(path, "dense", weight_type=weight_type, vocab=vocab, tokenizer="llama",
                                 tie_embeddings=False, chat_template=None, seed=seed, tensor_hook=tensor_hook,
                                 **options)
    return write_tiny_model(path, ARCH, weight_type=weight_type, n_embd=n_embd, tie_embeddings=False,
                            seed=seed, extra_pieces=_extra_pieces(reply, markup), tensor_hook=tensor_hook,
                            vocab_hook=lambda vocab: _mark_up(vocab, chat_template, markup),
                            **options)
