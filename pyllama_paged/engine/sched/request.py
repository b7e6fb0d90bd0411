"""Requests and their sequences as the scheduler sees them."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from ..kv.manager import SeqState
from ..params import MAX_SCORE_ROWS, EmbedParams, SamplingParams, ScoreParams
from ..worker.sampler import Sampler


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass
class Sequence:
    """One generated sample (or beam) of a request."""

    token_ids: list[int]                 # prompt + generated so far
    num_prompt: int
    sampler: Sampler
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    kv: SeqState | None = None           # None while waiting / preempted
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    swapped_pages: set[tuple[int, int]] | None = None   # (group, table index) with a host copy, when swapped
    swapped_num_computed: int = 0
    swapped_tokens: list[int] | None = None   # the tokens whose KV the host copy holds
    index: int = 0                       # which of its request's n samples it is

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed."""
        return len(self.token_ids) - (self.kv.num_computed if self.kv else 0)


@dataclass
class Request:
    """A prompt with its sampling parameters; holds n samples or beam_width beams."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    seqs: list[Sequence] = field(default_factory=list)
    finished_beams: list[Sequence] = field(default_factory=list)
    error: str | None = None
    num_preemptions: int = 0
    swapped_bytes: int = 0               # host memory its swapped-out KV holds (0 unless swapped)
    is_forked: bool = False              # n>1 / beams created from the prompt sequence
    first_token_time: float | None = None
    embed: EmbedParams | None = None     # an embedding: prefilled, pooled, never sampled
    score: ScoreParams | None = None     # prompt scoring: prefilled, every position's logits scored, never sampled
    # the most tokens a sequence of it holds, prompt included: the prompt plus max_tokens within
    # the engine's context (LLMEngine.add_request resolves it once; a sequence this long ends)
    max_len: int | None = None
    # the (LoraAdapter, scale) its sequences run (LLMEngine resolves params.lora), or None
    lora: tuple | None = None
    # images in the prompt: (first position, embedding rows [n, n_embd]) each, in order; their
    # positions hold the images' negative token ids (LLMEngine.add_request)
    images: list = field(default_factory=list)

    @property
    def is_prefill_only(self) -> bool:
        """Embeddings and scoring: computed on fresh pages (every position's output is
        wanted, so nothing comes from the prefix cache), never sampled."""
        return self.embed is not None or self.score is not None

    @property
    def max_chunk_tokens(self) -> int | None:
        """The most tokens one step may compute for it (None: the step's budget)."""
        return MAX_SCORE_ROWS if self.score is not None else None

    @property
    def is_beam(self) -> bool:
        return self.params.beam_width > 1

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]
