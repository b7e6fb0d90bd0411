"""What a request asks of the engine: SamplingParams (a generation), EmbedParams (a
pooled embedding), ScoreParams (the prompt's own log-probabilities), and the bounds and
vocabularies they are checked against. The bottom of the engine: every district reads
these, and they import nothing of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .._native import lib
from ..errors import PagedError, RequestError

# The native result holds PP_SAMPLE_MAX_TOP top entries per row: a request may ask for
# OpenAI's 20 top log-probabilities, and beam search asks for 2 x beam_width.
MAX_LOGPROBS = min(20, lib.PP_SAMPLE_MAX_TOP)
MAX_BEAM_WIDTH = lib.PP_SAMPLE_MAX_TOP // 2


@dataclass(frozen=True)
class LoraRequest:
    """Which LoRA adapter a request runs, by the name the engine loaded it under
    (LLMEngine.add_lora), and the user scale its B (A x) is multiplied by (llama.cpp's
    adapter scale: the file's alpha / rank is applied too)."""

    name: str
    scale: float = 1.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise RequestError(f"a LoRA adapter's name must be a non-empty string, got {self.name!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale):
            raise RequestError(f"LoRA adapter {self.name!r}: scale {self.scale!r} must be a finite number")


@dataclass
class SamplingParams:
    """What a generation asks of the engine: how each token is drawn and when it stops."""

    max_tokens: int = 16
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = True
    ignore_eos: bool = False    # keep generating past end-of-text tokens (to max_tokens)
    constraint: Any = None      # a constrain.grammar.Constraint: each step samples within its token mask
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling
    # the Python API's hook (llama-cpp-python's LogitsProcessor): called as
    # f(token ids so far, the row's float32 logits) -> logits, on the engine's thread
    logits_processor: Any = None
    speculative: bool = True    # False: this request never speculates, even when the engine does
    lora: LoraRequest | None = None   # the LoRA adapter it runs (None: the engine's default, if any)
    # a constrain.thinking_budget.ThinkingBudget: a think block's close forced once its tokens are spent
    thinking_budget: Any = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise RequestError naming the first invalid field (construction checks; call it
        again after changing a field)."""
        finite = math.isfinite
        checks = [
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 0, "must be >= 0"),
            # 64-bit seeds, signed or not (read modulo 2**64, as llama.cpp casts them)
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**64, "must fit in 64 bits"),
            ("temperature", finite(self.temperature), "must be finite"),
            ("repeat_penalty", finite(self.repeat_penalty), "must be finite"),
            ("presence_penalty", finite(self.presence_penalty), "must be finite"),
            ("frequency_penalty", finite(self.frequency_penalty), "must be finite"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = disabled)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repeat_penalty", self.repeat_penalty > 0, "must be > 0"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("n", 1 <= self.n <= 64, "must be in [1, 64]"),
            ("beam_width", 1 <= self.beam_width <= MAX_BEAM_WIDTH, f"must be in [1, {MAX_BEAM_WIDTH}]"),
            ("beam_width", self.beam_width == 1 or self.constraint is None,
             "must be 1 with a grammar or response format"),
            ("logit_bias", self.logit_bias is None or all(
                isinstance(k, int) and k >= 0 and isinstance(v, (int, float)) and finite(v)
                for k, v in self.logit_bias.items()), "must map token ids (ints >= 0) to finite numbers"),
            ("logits_processor", self.logits_processor is None or callable(self.logits_processor),
             "must be callable"),
            ("beam_width", self.beam_width == 1 or (self.logit_bias is None and self.logits_processor is None),
             "must be 1 with logit_bias or a logits processor"),
            ("speculative", isinstance(self.speculative, bool), "must be true or false"),
            ("lora", self.lora is None or isinstance(self.lora, LoraRequest), "must be a LoraRequest or None"),
            ("beam_width", self.beam_width == 1 or self.thinking_budget is None, "must be 1 with a thinking budget"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise RequestError(f"sampling parameter '{name}' = {getattr(self, name)!r} {why}")

    def for_sample(self, index: int) -> "SamplingParams":
        """Parameters of the index-th of n samples: its own seed so samples differ."""
        if index == 0:
            return self
        # modulo 2**64, as the sampler reads a seed: the last 64-bit seed's next sample wraps
        return replace(self, seed=None if self.seed is None else (self.seed + index) % 2**64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


POOLINGS = ("mean", "cls", "last")
# not a pooling the APIs offer: every token's state, unpooled (llama.cpp's pooling NONE), for
# llama-cpp-python's Llama.embed on a model that does not pool; decoders only
TOKEN_STATES = "none"


@dataclass(slots=True)
class EmbedParams:
    """What an embedding request asks of the engine: how token states are pooled and, for a
    text pair on an encoder (a cross-encoder's query and document), each token's segment."""

    pooling: str = "mean"
    token_types: tuple[int, ...] | None = None   # one per token (encoders only); None: all 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """PagedError naming the field when the pooling is not one we run."""
        if self.pooling not in POOLINGS and self.pooling != TOKEN_STATES:
            raise PagedError(f"pooling '{self.pooling}' is not supported (choose one of {', '.join(POOLINGS)})")


def default_pooling(config) -> str:
    """The model's <arch>.pooling_type when it is one we run, else mean."""
    return config.pooling if config.pooling in POOLINGS else "mean"


MAX_SCORE_ROWS = 32          # positions per step: 32 x 262,144 floats is 32 MiB of logits


@dataclass(slots=True)
class ScoreParams:
    """What a scoring request asks of the engine: its prompt's own log-probabilities and,
    at each position, the top_n likeliest tokens."""

    top_n: int = 0
    lora: LoraRequest | None = None   # the LoRA adapter the prompt is scored under (None: the engine's default)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """PagedError naming the field when top_n is out of range."""
        if not 0 <= self.top_n <= MAX_LOGPROBS:
            raise PagedError(f"logprobs (top_n) must be in [0, {MAX_LOGPROBS}], got {self.top_n}")
