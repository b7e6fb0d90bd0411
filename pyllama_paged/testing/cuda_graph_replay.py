"""Would GGML's CUDA backend replay our step graphs? GGML 0.20.2's rule for CUDA graphs, written
here from its description (ggml-cuda.cu: ggml_backend_cuda_graph_compute,
ggml_cuda_graph_update_required), applied to the graphs a ModelRunner's context really built.

The rule, per graph GGML is asked to compute (one per scheduler split on a device):
- The captured CUDA graph is looked up by the address of the graph's first node (its key).
- The graph's properties are each node's whole tensor struct and, for each source, its data
  pointer, ne and nb. They are compared with the last call's under that key ("changed") unless
  the graph carries the same non-zero uid as that call: GGML's scheduler gives a split a new uid
  each time it splits a graph (ggml_backend_sched_alloc_graph), so a graph computed again
  without being split again is unchanged by definition.
- Warm-up: a key runs eagerly (node by node) until a call finds nothing changed; that call is
  captured and launched; later unchanged calls launch (replay) the captured graph; a changed
  call runs eagerly again and restarts the warm-up.
- Graphs with a MUL_MAT_ID that needs a stream sync on the device are never captured
  (ggml_cuda_graph_check_compability); whether one does depends on the device and shapes, so
  such graphs are reported, not judged. Graphs unused for 10 s are evicted (not modelled: a
  decode loop calls every few milliseconds).

Our context keeps a step's graph, allocated, for the next step of the same shape and splits it
only when it builds a new one (native/src/model/context.c), so the number of graphs it has built
stands in for the split's uid. Everything else is read from the real graph: on the CPU the graph
is the device's graph without the scheduler's split (the token-embedding lookup, which stays on
the CPU on a device, is one more node here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._native import check, ffi, lib

EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"
# The fields of pp_graph_node that the rule compares, in the order a difference is reported.
_FIELDS = ("op", "name", "type", "flags", "ne", "nb", "op_params", "data", "buffer", "view_src", "view_offs",
           "extra", "src", "src_data", "src_ne", "src_nb")


@dataclass
class StepGraph:
    """One step's graph as the rule reads it: each node's properties hash, and the nodes."""

    nodes: object                # cffi pp_graph_node[n]
    hashes: np.ndarray           # uint64 per node
    uid: int                     # changes whenever the context built (and split) a new graph

    @property
    def key(self) -> int:
        """The captured graph's key: the first node's address."""
        return int(self.nodes[0].self) if len(self.hashes) else 0

    def node(self, i: int) -> dict:
        """Node i's fields (the ones the rule compares), as Python values."""
        n = self.nodes[i]
        out = {}
        for f in _FIELDS:
            v = getattr(n, f)
            if f in ("op", "name"):
                out[f] = ffi.string(v).decode("utf-8", "replace")
            elif f in ("ne", "nb", "op_params", "src", "src_data"):
                out[f] = list(v)
            elif f in ("src_ne", "src_nb"):
                out[f] = [list(row) for row in v]
            else:
                out[f] = int(v)
        return out

    def count(self, op: str) -> int:
        """How many nodes run op (ggml_op_desc's name, e.g. 'FLASH_ATTN_EXT')."""
        return sum(ffi.string(self.nodes[i].op).decode() == op for i in range(len(self.hashes)))


def read_step_graph(runner) -> StepGraph:
    """The graph the runner's last step ran (ModelRunner), with the uid GGML's scheduler would
    have given it."""
    stats = runner.step_stats()
    n = stats["nodes"]
    nodes = ffi.new("pp_graph_node[]", max(n, 1))
    got = ffi.new("int32_t *")
    check(lib.pp_context_graph_nodes(runner._ctx, nodes, n, got), "graph nodes")
    hashes = np.array([nodes[i].props_hash for i in range(got[0])], dtype=np.uint64)
    return StepGraph(nodes, hashes, uid=stats["builds"])


# Fields that say what a node computes (its shape), beside where its data lives.
_SHAPE_FIELDS = ("op", "type", "ne", "nb", "op_params", "src_ne", "src_nb")


def _field_change(a: dict, b: dict, fields) -> str | None:
    for f in fields:
        if a[f] != b[f]:
            if f in ("src_ne", "src_nb", "src_data", "src"):
                j = next(j for j in range(len(a[f])) if a[f][j] != b[f][j])
                return f"{f}[{j}] {a[f][j]} -> {b[f][j]}"
            return f"{f} {a[f]} -> {b[f]}"
    return None


def first_difference(old: StepGraph | None, new: StepGraph) -> str | None:
    """The first node (in execution order, as GGML compares) whose properties differ between two
    graphs, and how: its first shape field that differs, else its first other field; None when
    no node differs."""
    if old is None:
        return "no graph captured under this key yet"
    n = min(len(old.hashes), len(new.hashes))
    diff = np.flatnonzero(old.hashes[:n] != new.hashes[:n])
    if not len(diff):
        return f"node count {len(old.hashes)} -> {len(new.hashes)}" if len(old.hashes) != len(new.hashes) else None
    i = int(diff[0])
    a, b = old.node(i), new.node(i)
    what = _field_change(a, b, _SHAPE_FIELDS) or _field_change(a, b, _FIELDS) or "struct bytes outside the named fields"
    return f"node {i} '{b['name']}' {b['op']}: {what}"


def first_shape_change(old: StepGraph | None, new: StepGraph) -> str | None:
    """The first node whose shape (op, type, ne, nb, op parameters, sources' ne and nb) differs,
    or the node count; None when only addresses differ (or nothing)."""
    if old is None:
        return None
    for i in range(min(len(old.hashes), len(new.hashes))):
        if old.hashes[i] == new.hashes[i]:
            continue
        a, b = old.node(i), new.node(i)
        what = _field_change(a, b, _SHAPE_FIELDS)
        if what:
            return f"node {i} '{b['name']}' {b['op']}: {what}"
    return f"node count {len(old.hashes)} -> {len(new.hashes)}" if len(old.hashes) != len(new.hashes) else None


@dataclass
class _Captured:
    """ggml_cuda_graph's state for one key."""

    last: StepGraph | None = None
    uid: int = 0
    warmup_complete: bool = False
    instance: bool = False


@dataclass
class Outcome:
    """What the CUDA backend would do with one call, and what changed when it would not replay."""

    kind: str                    # EAGER, CAPTURE or REPLAY
    changed: str | None = None   # first_difference's text when the properties changed
    shape: str | None = None     # first_shape_change's then (None: only addresses moved)
    compatible: bool = True      # False: a MUL_MAT_ID the device may have to sync for


@dataclass
class CudaGraphReplay:
    """GGML 0.20.2's CUDA-graph decisions over a sequence of step graphs. uid_shortcut=False
    compares the properties on every call (what the rule does for a graph split again), to check
    that a kept graph really is unchanged."""

    uid_shortcut: bool = True
    graphs: dict = field(default_factory=dict)

    def _update_required(self, g: _Captured, step: StepGraph) -> tuple[str | None, str | None]:
        """(first_difference, first_shape_change) against the last call under the key."""
        if self.uid_shortcut and step.uid != 0 and step.uid == g.uid:
            return None, None
        g.uid = step.uid
        changed = first_difference(g.last, step)
        shape = first_shape_change(g.last, step) if changed else None
        g.last = step
        return changed, shape

    def observe(self, step: StepGraph) -> Outcome:
        """The backend's decision for this call (and its state updated as GGML's is)."""
        g = self.graphs.setdefault(step.key, _Captured())
        if step.count("MUL_MAT_ID"):
            return Outcome(EAGER, "a MUL_MAT_ID graph: captured only where the device needs no sync", False)
        changed, shape = self._update_required(g, step)
        if not g.warmup_complete:
            if changed is None:
                g.warmup_complete = True
                g.instance = True
                return Outcome(CAPTURE)
            return Outcome(EAGER, changed, shape)
        if changed is not None:
            g.warmup_complete = False
            return Outcome(EAGER, changed, shape)
        if not g.instance:
            g.instance = True
            return Outcome(CAPTURE)
        return Outcome(REPLAY)


def replay_summary(outcomes: list[Outcome]) -> dict:
    """Counts of each decision, the share replayed, and the changes that stopped a replay (each
    distinct text with how often it was seen, first seen first)."""
    kinds = [o.kind for o in outcomes]
    changes: dict[str, int] = {}
    for o in outcomes:
        if o.changed:
            text = o.changed + (f" (first shape change: {o.shape})" if o.shape and o.shape != o.changed else "")
            changes[text] = changes.get(text, 0) + 1
    n = len(outcomes)
    return {"steps": n, EAGER: kinds.count(EAGER), CAPTURE: kinds.count(CAPTURE), REPLAY: kinds.count(REPLAY),
            "replay_share": kinds.count(REPLAY) / n if n else None,
            "changes": [{"change": c, "steps": k} for c, k in changes.items()]}
