"""bench/engine/graph_replay.py end to end on a tiny model: every workload's row, steady decode
replaying all but its first two steps while no key bucket fills, a chat trace's changing batches
caught as changes of the first node."""

import json

from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model


def test_every_workload_gets_its_row(bench, tmp_path):
    graph_replay = bench("bench.engine.graph_replay")
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", weight_type="q8_0", context_length=2048)
    # keys 41..60 stay in the first 64-key bucket
    assert graph_replay.main(["--model", str(model), "--npl", "1", "3", "--npp", "40", "--ntg", "20",
                              "--long-ctx", "200", "--long-npl", "3", "--chat-requests", "4", "--chat-gap", "2",
                              "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "graph_replay.json").read_text())["table"]
    assert [(r["workload"], r["setting"]) for r in rows] == [
        ("decode", "npl 1, 40 + 20"), ("decode", "npl 3, 40 + 20"), ("decode", "npl 3, 200 + 20"),
        ("chat", "4 requests, one per 2 steps")]
    for r in rows[:2]:
        assert (r["steps"], r["eager"], r["captured"], r["replayed"]) == (20, 1, 1, 18)
    chat = rows[3]
    assert chat["eager"] > 1 and "node 0 " in chat["first node changed (steps not replayed)"]
    assert chat["replayed"] + chat["captured"] + chat["eager"] == chat["steps"]
