"""llama-cpp-python's llama_speculative names: LlamaPromptLookupDecoding, given as
Llama(draft_model=...), becomes the engine's own prompt-lookup speculative decoding
(engine/spec_decode/draft.py), which drafts inside the scheduler's steps for every request."""

from __future__ import annotations

import warnings

import numpy as np

from ..engine import PromptLookupDrafter, SpeculativeConfig
from ..errors import RequestError

_MAX_DRAFT = 32   # SpeculativeConfig's bound on num_draft_tokens


class LlamaDraftModel:
    """llama-cpp-python's draft model interface: called with the ids so far, returns draft ids."""

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        raise NotImplementedError

    def speculative_config(self) -> SpeculativeConfig:
        """The engine's speculative decoding that stands for this draft model."""
        raise RequestError(f"draft_model={type(self).__name__}(): a drafter written in Python cannot run "
                           "inside the engine's steps; use LlamaPromptLookupDecoding, or a draft GGUF with "
                           "speculative={'method': 'draft_model', 'draft_model': path}")


class LlamaPromptLookupDecoding(LlamaDraftModel):
    """Drafts the tokens that followed the latest earlier occurrence of the last n-gram
    (n from max_ngram_size down to 1); num_pred_tokens at most per step."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10):
        if max_ngram_size < 1 or num_pred_tokens < 1:
            raise RequestError(f"LlamaPromptLookupDecoding needs max_ngram_size >= 1 and num_pred_tokens >= 1, "
                               f"got {max_ngram_size} and {num_pred_tokens}")
        self.max_ngram_size = max_ngram_size
        self.num_pred_tokens = num_pred_tokens

    def speculative_config(self) -> SpeculativeConfig:
        """Prompt lookup with these sizes; more than the engine drafts per step is capped, with a warning."""
        if self.num_pred_tokens > _MAX_DRAFT:
            warnings.warn(f"LlamaPromptLookupDecoding(num_pred_tokens={self.num_pred_tokens}): the engine drafts "
                          f"at most {_MAX_DRAFT} tokens per step; using {_MAX_DRAFT}", UserWarning, stacklevel=4)
        return SpeculativeConfig(method="prompt_lookup", num_draft_tokens=min(self.num_pred_tokens, _MAX_DRAFT),
                                 max_ngram=self.max_ngram_size, min_ngram=1)

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        """The draft after input_ids (empty when no earlier n-gram matches), as np.intc."""
        config = SpeculativeConfig(method="prompt_lookup", num_draft_tokens=min(self.num_pred_tokens, _MAX_DRAFT),
                                   max_ngram=self.max_ngram_size)
        draft = PromptLookupDrafter(config).propose(np.asarray(input_ids).tolist(), self.num_pred_tokens)
        return np.asarray(draft, dtype=np.intc)


def speculative_of(draft_model, speculative):
    """Llama's speculative argument once draft_model is folded in: a draft model and
    speculative= together are refused (which should win is not clear)."""
    if draft_model is None:
        return speculative
    if speculative not in (None, False):
        raise RequestError("give draft_model or speculative, not both (they both set speculative decoding)")
    if isinstance(draft_model, LlamaDraftModel):
        return draft_model.speculative_config()
    # llama-cpp-python's own instance (their package installed beside ours) carries the same two fields
    if type(draft_model).__name__ == "LlamaPromptLookupDecoding" and hasattr(draft_model, "num_pred_tokens"):
        return LlamaPromptLookupDecoding(getattr(draft_model, "max_ngram_size", 2),
                                         draft_model.num_pred_tokens).speculative_config()
    if isinstance(draft_model, str):
        raise RequestError("draft_model takes a LlamaPromptLookupDecoding; a draft GGUF's path goes in "
                           f"speculative={{'method': 'draft_model', 'draft_model': {draft_model!r}}}")
    return LlamaDraftModel.speculative_config(draft_model)
