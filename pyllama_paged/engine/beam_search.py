"""Beam search over paged sequences: each step every live beam's 2 x width likeliest
next tokens are scored, the width best continuations are kept, a parent's first
continuation reuses its pages and the others fork them (shared pages, copy-on-write),
pruned beams give their pages back, and finished hypotheses are ranked by length-
penalized log-probability."""

from __future__ import annotations

from .sched.request import Request, Sequence
from .params import SamplingParams
from .worker.sampler import Sampler


def expansion_sampler(width: int) -> Sampler:
    """The sampler of a beam's row: greedy, with its 2 x width likeliest tokens' log-probabilities
    (past the bound a request's logprobs are checked against: the native result holds them)."""
    params = SamplingParams(temperature=0.0)
    params.logprobs = 2 * width
    return Sampler(params)


def advance_beams(request: Request, items, scheduler, eot_ids) -> list[Sequence]:
    """Keep the beam_width best continuations; forked beams share pages. items: (beam,
    its 2 x width likeliest next tokens -> log-probability); the scheduler keeps the KV
    books (fork_sequence, free_sequence). Returns the live beams, in the order their new
    tokens are reported."""
    width = request.params.beam_width
    candidates = []
    for seq, top in items:
        for tok, lp in top.items():
            candidates.append((seq.cumulative_logprob + lp, seq, tok))
    candidates.sort(key=lambda c: -c[0])
    chosen = []
    for score, parent, tok in candidates:
        if len(chosen) == width:
            break
        if tok in eot_ids:
            done = Sequence(parent.token_ids + [tok], parent.num_prompt, parent.sampler,
                            cumulative_logprob=score, finish_reason="stop")
            request.finished_beams.append(done)
            continue
        chosen.append((score, parent, tok))
    # assign: a parent's first continuation reuses it, the others fork it
    used: set[int] = set()
    new_seqs = []
    for score, parent, tok in chosen:
        if parent.seq_id in used:
            seq = Sequence(list(parent.token_ids), parent.num_prompt, parent.sampler,
                           kv=scheduler.fork_sequence(parent))
        else:
            seq = parent
            used.add(parent.seq_id)
        new_seqs.append((seq, score, tok))
    # parents are forked before any of them grows, so copies see the old tokens
    for seq, score, tok in new_seqs:
        seq.token_ids.append(tok)
        seq.cumulative_logprob = score
    for seq, _ in items:
        if seq.seq_id not in used and seq.kv is not None:
            scheduler.free_sequence(seq)
            seq.finish_reason = "pruned"
    live = [s for s, _, _ in new_seqs]
    request.seqs = live + [s for s in request.seqs if s.is_finished and s not in live]
    length_done = live and len(live[0].token_ids) >= request.max_len
    penalty = request.params.length_penalty
    best_live = max((s.cumulative_logprob / len(s.output_ids) ** penalty for s in live), default=None)
    enough = len(request.finished_beams) >= width and request.params.early_stopping
    if best_live is not None and len(request.finished_beams) >= width and not enough:
        worst_kept = sorted((b.cumulative_logprob / len(b.output_ids) ** penalty
                             for b in request.finished_beams), reverse=True)[width - 1]
        enough = best_live < worst_kept
    if length_done or enough or not live:
        for s in live:
            if length_done:
                request.finished_beams.append(s)
            s.finish_reason = s.finish_reason or "length"
            scheduler.free_sequence(s)
    return live


def ranked_beams(request: Request) -> list[tuple[list[int], float]]:
    """The finished hypotheses (output ids, length-penalized score), best first, at most beam_width."""
    penalty = request.params.length_penalty
    scored = [(s.output_ids, s.cumulative_logprob / max(len(s.output_ids), 1) ** penalty)
              for s in request.finished_beams]
    return sorted(scored, key=lambda b: -b[1])[:request.params.beam_width]
