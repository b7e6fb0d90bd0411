"""TextAssembler: turns a request's token events into text deltas per
sample, with stop strings applied; shared by the Python API and the server."""

from __future__ import annotations

from dataclasses import dataclass

from .engine.llm_engine import RequestOutput, TokenEvent
from .tokenizer.tokenizer import IncrementalDecoder, Tokenizer


class StopMatcher:
    """Cuts generated text at the first stop string, holding back a possible partial match."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class TextDelta:
    index: int                       # sample (or beam) index
    text: str
    finish_reason: str | None = None
    event: TokenEvent | None = None  # the token behind this text, when there is one


class TextAssembler:
    """Per-sample incremental detokenization and stop-string handling."""

    def __init__(self, tokenizer: Tokenizer, stops=()):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self._decoders: dict[int, IncrementalDecoder] = {}
        self._stoppers: dict[int, StopMatcher] = {}
        self.stopped: set[int] = set()
        self.num_tokens: dict[int, int] = {}

    def _pair(self, index: int):
        if index not in self._decoders:
            self._decoders[index] = IncrementalDecoder(self.tokenizer, skip_special=True)
            self._stoppers[index] = StopMatcher(self.stops)
        return self._decoders[index], self._stoppers[index]

    def feed(self, out: RequestOutput) -> list[TextDelta]:
        """Text deltas for one step's output (a final delta per sample when it ends)."""
        deltas: list[TextDelta] = []
        if out.beams is not None:
            for j, (ids, _) in enumerate(out.beams):
                eot = bool(ids) and ids[-1] in self.tokenizer.eot_ids
                text = self.tokenizer.decode([t for t in ids if t not in self.tokenizer.eot_ids],
                                             skip_special=True)
                self.num_tokens[j] = len(ids)
                deltas.append(TextDelta(j, text, "stop" if eot else "length"))
            return deltas
        for ev in out.events:
            if ev.seq_index in self.stopped:
                continue
            self.num_tokens[ev.seq_index] = self.num_tokens.get(ev.seq_index, 0) + 1
            decoder, stopper = self._pair(ev.seq_index)
            piece = "" if ev.token_id in self.tokenizer.eot_ids else decoder.add(ev.token_id)
            text, hit = stopper.feed(piece)
            if text or ev is not None:
                deltas.append(TextDelta(ev.seq_index, text, None, ev))
            if hit:
                self.stopped.add(ev.seq_index)
                deltas.append(TextDelta(ev.seq_index, "", "stop"))
        if out.finished:
            for j, reason in enumerate(out.finish_reasons):
                if j in self.stopped:
                    continue
                decoder, stopper = self._pair(j)
                text, hit = stopper.feed(decoder.flush())
                if not hit:
                    text += stopper.flush()
                self.stopped.add(j)
                deltas.append(TextDelta(j, text, "stop" if hit else (reason or "length")))
        return deltas

    def all_stopped(self, n: int) -> bool:
        """Whether every one of n samples has ended (so the request can be aborted)."""
        return all(j in self.stopped for j in range(n))
