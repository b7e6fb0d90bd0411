"""TextAssembler: turns a request's token events into text deltas per
sample, with stop strings applied; shared by the Python API and the server."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import RequestOutput, TokenEvent
from ..tokenizer.tokenizer import IncrementalDecoder, Tokenizer


class StopStrings:
    """The stop strings as one Aho-Corasick automaton, built once per request and shared
    by its samples: a piece of text costs the same whatever the number of stops, where
    searching for each stop in turn cost (stops x longest stop) per token."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        # Node 0 is the root; a node is a distinct prefix of some stop. Transitions live in
        # one dict keyed by (node << 21 | code point): one small dict per node would take
        # several times the memory for thousands of long stops.
        next_: dict[int, int] = {}
        # per node: its depth, parent, last character, and the length of the stop it is (or 0)
        depth, parent, code, ends = [0], [0], [0], [0]
        for stop in self.stops:
            node, i = 0, 0
            while i < len(stop) and (child := next_.get(node << 21 | ord(stop[i]))) is not None:
                node, i = child, i + 1
            if i < len(stop):
                # the rest of the stop is a fresh chain of nodes: added in bulk, since
                # that is most of the build for long stops
                first, codes = len(depth), [ord(c) for c in stop[i:]]
                ids = range(first, first + len(codes))
                parents = [node, *ids[:-1]]
                next_.update(zip([p << 21 | c for p, c in zip(parents, codes)], ids))
                depth.extend(range(depth[node] + 1, depth[node] + 1 + len(codes)))
                parent += parents
                code += codes
                ends += [0] * len(codes)
                node = ids[-1]
            ends[node] = len(stop)
        fail = [0] * len(depth)
        # longest stop that is a suffix of this node's text (0: none): found by the
        # failure links, so a match is seen at the character that completes it
        match = ends[:]
        # by depth: a node's failure link goes to a shallower node, already linked
        for node in sorted(range(1, len(depth)), key=depth.__getitem__):
            up = parent[node]
            if up:
                f, c = fail[up], code[node]
                while (child := next_.get(f << 21 | c)) is None and f:
                    f = fail[f]
                fail[node] = f = child or 0
                if not match[node]:
                    match[node] = match[f]
        self._next, self._fail, self._match, self._depth = next_, fail, match, depth

    def scan(self, node: int, text: str) -> tuple[int, int, int]:
        """(node after text, index in text just past the first completed stop or -1, that
        stop's length: the longest of those completing there)."""
        next_, fail, match = self._next, self._fail, self._match
        for i, ch in enumerate(text):
            code = ord(ch)
            while True:
                child = next_.get(node << 21 | code)
                if child is not None:
                    node = child
                    break
                if node == 0:
                    break
                node = fail[node]
            if match[node]:
                return node, i + 1, match[node]
        return node, -1, 0

    def held(self, node: int) -> int:
        """How many trailing characters may still begin a stop (held back, not emitted)."""
        return self._depth[node]


class StopMatcher:
    """Cuts generated text at the first stop string to complete, holding back a possible
    partial match. Among stops completing at the same character the longest wins, so the
    text is the same however it was split into pieces."""

    def __init__(self, stops):
        self.strings = stops if isinstance(stops, StopStrings) else StopStrings(stops)
        self.stops = self.strings.stops
        self.pending = ""
        self._node = 0
        self.matched: str | None = None   # the stop string that cut the text (APIs that name it)

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        if not self.stops:
            return text, False
        # Only the new text is scanned: the automaton's node already stands for the
        # pending text, which cannot hold a whole stop (it would have matched).
        self._node, end, length = self.strings.scan(self._node, text)
        pending = self.pending + text
        if end >= 0:
            cut = len(self.pending) + end - length
            self.matched = pending[cut:cut + length]
            self.pending, self._node = "", 0
            return pending[:cut], True
        cut = len(pending) - self.strings.held(self._node)
        out, self.pending = pending[:cut], pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back text, at the end of the answer."""
        out, self.pending, self._node = self.pending, "", 0
        return out


@dataclass
class TextDelta:
    index: int                       # sample (or beam) index
    text: str
    finish_reason: str | None = None
    event: TokenEvent | None = None  # the token behind this text, when there is one
    stop: str | None = None          # with finish_reason "stop": the stop string that ended it, if one did


class TextAssembler:
    """Per-sample incremental detokenization and stop-string handling."""

    def __init__(self, tokenizer: Tokenizer, stops=()):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self._stop_strings = StopStrings(self.stops)   # built once, shared by the samples
        self._decoders: dict[int, IncrementalDecoder] = {}
        self._stoppers: dict[int, StopMatcher] = {}
        self.stopped: set[int] = set()
        self.num_tokens: dict[int, int] = {}

    def _pair(self, index: int):
        if index not in self._decoders:
            self._decoders[index] = IncrementalDecoder(self.tokenizer, skip_special=True)
            self._stoppers[index] = StopMatcher(self._stop_strings)
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
                deltas.append(TextDelta(ev.seq_index, "", "stop", stop=stopper.matched))
        if out.finished:
            for j, reason in enumerate(out.finish_reasons):
                if j in self.stopped:
                    continue
                decoder, stopper = self._pair(j)
                text, hit = stopper.feed(decoder.flush())
                if not hit:
                    text += stopper.flush()
                self.stopped.add(j)
                deltas.append(TextDelta(j, text, "stop" if hit else (reason or "length"),
                                        stop=stopper.matched if hit else None))
        return deltas

    def all_stopped(self, n: int) -> bool:
        """Whether every one of n samples has ended (so the request can be aborted)."""
        return all(j in self.stopped for j in range(n))
