"""A step's last part: what the model's rows do to the requests, once the scheduler
has the step's progress. Logits rows are sampled (every row of the step in one
call), n>1 requests fork their samples, beams advance, drafted sequences are
verified; scoring chunks score their rows, embedding chunks pool theirs; requests
that ended finish (their pages back through the scheduler)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .beam_search import advance_beams, expansion_sampler, ranked_beams
from .outputs import RequestOutput, TokenEvent
from .pooling.embedding import DecoderPooling
from .sched.request import Request, Sequence
from .sched.scheduler_output import SchedulerOutput
from .scoring import PromptScores
from .worker.sampler import BatchSampler, Sampled, Sampler


@dataclass(slots=True)
class ExecutedStep:
    """One step as the model ran it: the step's sequences by id and their requests (owner,
    and `requests[i]` for item i), the pooled rows for the embedding chunks that asked
    (`hidden[i]`: item i's (first, count), or None), the draft tokens spliced after item i
    (`drafts[i]`), the logits rows; `argmax`: the rows' greedy tokens, computed with the step
    when every row is a plain greedy draw (then a device's logits were not read back). A step
    that scheduled nothing ran nothing: its fields stay empty."""

    seqs: dict[int, Sequence] = field(default_factory=dict)
    owner: dict[int, Request] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    hidden: list | None = None
    drafts: dict[int, list[int]] = field(default_factory=dict)
    logits: np.ndarray | None = None
    rows: np.ndarray | None = None
    argmax: np.ndarray | None = None   # each logits row's argmax, when every row is drawn so


class Postprocessor:
    """Turns a step's rows into token events and finished requests. It is given what it acts
    on: the requests in flight (the engine's table, shared), the scheduler (which keeps the KV
    books: forks, frees, removals), its own batched sampler, the end-of-text ids, forget(request)
    (the engine's parts drop what they hold for an ended request), the block copy that accepted
    draft tokens may need, and, while the engine speculates, its speculator."""

    def __init__(self, requests: dict[str, Request], scheduler, sampler: BatchSampler, eot_ids, forget,
                 copy_blocks):
        self.requests = requests
        self.scheduler = scheduler
        self.sampler = sampler
        self.eot_ids = eot_ids
        self.forget_request = forget
        self.copy_blocks = copy_blocks
        self.speculator = None                # the engine's, when it speculates (verifies drafted rows)
        self.pooling = DecoderPooling()       # embedding requests' pooled states in flight
        self.scores = PromptScores()          # scoring requests' scores in flight
        self.sample_seconds = 0.0             # time in sampling, for /stats
        self.argmax_draws = 0                 # rows drawn from the steps' argmax ids, not the sampler
        self.num_generated_tokens = 0

    def hidden_rows(self, output: SchedulerOutput, requests: list[Request], seqs: dict) -> list | None:
        """The pooled rows each item of the step asks the runner for (None: logits only)."""
        if not any(r.embed is not None for r in requests):
            return None
        return [None if r.embed is None else
                self.pooling.rows_wanted(r.embed.pooling, start, n, len(seqs[seq_id].token_ids))
                for seq_id, r, (_, start, n) in zip(output.seq_ids, requests, output.items)]

    def process(self, output: SchedulerOutput, step: ExecutedStep) -> list[RequestOutput]:
        """Everything the step does to its requests: those the scheduler ended with an error
        reported finished, then the rows' effects. Returns the outputs of the requests that moved."""
        outputs: dict[str, RequestOutput] = {}
        for request_id in output.failed_request_ids:
            request = self.requests.pop(request_id)
            self.forget_request(request)
            outputs[request_id] = self.output(request, finished=True)
        if output.seq_ids:
            if step.hidden is not None:
                self._pool_embeddings(output, step, outputs)
            drafts = {output.seq_ids[i]: d for i, d in step.drafts.items()}   # by sequence from here on
            self._sample(self._logit_rows(output, step, outputs, drafts), step.logits, step.owner, outputs, drafts,
                         step.argmax)
        return list(outputs.values())

    def forget(self, seq_id: int) -> None:
        """An ended request's sequence: drop its pooled rows and scores in flight."""
        self.pooling.forget(seq_id)
        self.scores.forget(seq_id)

    def output(self, request: Request, finished: bool = False) -> RequestOutput:
        return RequestOutput(request.request_id, finished=finished, error=request.error,
                             num_prompt_tokens=len(request.prompt_ids),
                             finish_reasons=[s.finish_reason for s in request.seqs])

    def _logit_rows(self, output: SchedulerOutput, step: ExecutedStep, outputs: dict[str, RequestOutput],
                    drafts: dict) -> list[tuple[Sequence, int]]:
        """Walk the step's logits rows in item order: a scoring chunk has one per token
        (scored here), a chunk that reached its sequence's last placed token one, an
        embedding none; a drafted decode one more per draft token. Returns the (sequence,
        row) pairs to sample: those whose every token is computed."""
        at, finishing = 0, []
        for seq_id, request, (_, start, n) in zip(output.seq_ids, step.requests, output.items):
            seq = step.seqs[seq_id]
            if request.score is not None:
                self._score_chunk(request, seq, start, step.logits[at:at + n], outputs)
                at += n
            elif request.embed is None and seq.kv.num_computed == seq.kv.num_tokens:
                if seq.kv.num_computed == len(seq.token_ids):
                    finishing.append((seq, at))
                at += 1 + len(drafts.get(seq_id, ())) if drafts else 1
        return finishing

    def _score_chunk(self, request: Request, seq: Sequence, start: int, logits: np.ndarray,
                     outputs: dict[str, RequestOutput]) -> None:
        """A scoring chunk's rows scored; the request finishes with them all (pages freed)
        when its last token is computed."""
        self.scores.add(seq.seq_id, seq.token_ids, start, logits, request.score.top_n)
        if seq.kv.num_computed == len(seq.token_ids):
            seq.finish_reason = "stop"
            out = outputs.setdefault(request.request_id, self.output(request))
            out.prompt_logprobs = self.scores.pop(seq.seq_id)
            self._finish(request, out)

    def _sample(self, finishing: list[tuple[Sequence, int]], logits: np.ndarray, owner: dict,
                outputs: dict[str, RequestOutput], drafts: dict, argmax: np.ndarray | None = None) -> None:
        """Sample every (sequence, logits row) that reached its last token in one call;
        append, fork (n>1), advance beams, finish. Drafted sequences (drafts: seq id ->
        tokens) are verified by the speculator instead."""
        ready: dict[str, list[tuple[Sequence, int]]] = {}   # request id -> (sequence, logits row)
        for seq, row in finishing:
            ready.setdefault(owner[seq.seq_id].request_id, []).append((seq, row))
        picks = []   # (request, sequence, row, sampler): every row of this step, drawn in one call
        beams: dict[str, list] = {}
        for request_id, items in ready.items():
            request = self.requests[request_id]
            outputs.setdefault(request_id, self.output(request))
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            if request.is_beam:
                # a beam's row yields its 2 x width likeliest continuations and their log-probabilities
                expand = expansion_sampler(request.params.beam_width)
                beams[request_id] = [(seq, len(picks) + i) for i, (seq, _) in enumerate(items)]
                picks += [(request, seq, row, expand) for seq, row in items]
            else:
                picks += [(r, seq, row, seq.sampler) for r, seq, row in self._samples_of(request, items)
                          if seq.seq_id not in drafts]
        started = time.perf_counter()
        if argmax is not None:   # plain greedy rows: the step's own argmax ids
            drawn = [Sampled(int(argmax[row])) for _, _, row, _ in picks]
            self.argmax_draws += len(picks)
        else:
            drawn = self.sampler.sample(logits, [(row, sampler, seq.token_ids) for _, seq, row, sampler in picks])
        self.sample_seconds += time.perf_counter() - started
        failed = {request.request_id: (request, sampled.error)
                  for (request, _, _, _), sampled in zip(picks, drawn) if sampled.error}
        for request, error in failed.values():   # one request's bad row fails it alone
            self._fail(request, outputs[request.request_id], error)
        for (request, seq, _, _), sampled in zip(picks, drawn):
            if not request.is_beam and request.request_id not in failed:
                self._accept(request, seq, sampled, outputs[request.request_id])
        for request_id, items in beams.items():
            if request_id not in failed:
                live = advance_beams(self.requests[request_id], [(seq, drawn[i].top) for seq, i in items],
                                     self.scheduler, self.eot_ids)
                outputs[request_id].events.extend(TokenEvent(i, s.token_ids[-1]) for i, s in enumerate(live))
        if drafts:
            self._verify_drafts(finishing, drafts, logits, owner, outputs)
        for request_id in ready:
            request = self.requests.get(request_id)
            if request is not None and not request.live_seqs:
                self._finish(request, outputs[request_id])

    def _verify_drafts(self, finishing, drafts: dict, logits: np.ndarray, owner: dict,
                       outputs: dict[str, RequestOutput]) -> None:
        """The drafted sequences' tokens, from their rows (Speculator.verify)."""
        items = [(owner[seq.seq_id], seq, row, drafts[seq.seq_id]) for seq, row in finishing
                 if seq.seq_id in drafts and owner[seq.seq_id].request_id in self.requests]
        started = time.perf_counter()
        self.speculator.verify(
            self.sampler, logits, items,
            lambda r, seq, sampled: self._accept(r, seq, sampled, outputs[r.request_id]),
            lambda r, error: self._fail(r, outputs[r.request_id], error),
            lambda r: r.request_id in self.requests, self.scheduler.kv, self.copy_blocks)
        self.sample_seconds += time.perf_counter() - started

    def _pool_embeddings(self, output: SchedulerOutput, step: ExecutedStep,
                         outputs: dict[str, RequestOutput]) -> None:
        """Embedding chunks returned pooled rows, not logits; a request whose last token is
        computed finishes with its vector (pages freed)."""
        at = 0
        for seq_id, want, (_, start, _) in zip(output.seq_ids, step.hidden, output.items):
            if want is None:
                continue
            seq, request = step.seqs[seq_id], step.owner[seq_id]
            self.pooling.add(seq_id, request.embed.pooling, start, step.rows[at:at + want[1]])
            at += want[1]
            if seq.kv.num_computed == len(seq.token_ids):
                seq.finish_reason = "stop"
                out = outputs.setdefault(request.request_id, self.output(request))
                out.embedding = self.pooling.pop(seq_id)
                self._finish(request, out)

    def _finish(self, request: Request, out: RequestOutput) -> None:
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)
        self.forget_request(request)
        out.finished = True
        out.finish_reasons = [s.finish_reason for s in request.seqs]
        if request.is_beam:
            out.beams = ranked_beams(request)

    def _fail(self, request: Request, out: RequestOutput, error: str) -> None:
        """End one request with an error (its pages freed); the step goes on for the rest."""
        request.error = out.error = error
        self._finish(request, out)

    def _accept(self, request: Request, seq: Sequence, sampled: Sampled, out: RequestOutput) -> None:
        """Append a sampled token, report it, and finish the sequence if it ended."""
        token = sampled.token
        out.events.append(TokenEvent(seq.index, token, sampled.logprob, sampled.top))
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if token in self.eot_ids and not request.params.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= request.max_len:
            seq.finish_reason = "length"
        if seq.is_finished:
            self.scheduler.free_sequence(seq)   # finished sequences give their pages back at once

    def _samples_of(self, request: Request, items) -> list[tuple[Request, Sequence, int]]:
        """The sequences to sample for a request this step; an n>1 request forks its
        samples from the prompt's pages first, before anyone appends."""
        params = request.params
        picks = []
        for seq, row in items:
            if not request.is_forked and params.n > 1:
                request.is_forked = True
                for i in range(1, params.n):
                    child = Sequence(list(seq.token_ids), seq.num_prompt, Sampler(params.for_sample(i)),
                                     kv=self.scheduler.fork_sequence(seq), index=i)
                    request.seqs.append(child)
                    picks.append((request, child, row))
            picks.append((request, seq, row))
        return picks
