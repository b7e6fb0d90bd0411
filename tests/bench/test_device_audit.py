"""bench/engine/device_audit.py on the real device-path graph: the KV gathers it finds are the
keys the step's key bucket says, at 14 bytes a value (7x the f16 bytes held, which is the figure
the audit reports until KV reaches attention in the pool's type)."""

import pytest

from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def audit(bench):
    return bench("bench.engine.device_audit")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("audit") / "llama.gguf", "llama", weight_type="q8_0"))


@pytest.mark.parametrize("n_seqs, context", [(3, 100), (2, 64), (5, 300)])
def test_the_gathers_are_the_bucketed_keys_at_fourteen_bytes_a_value(audit, tiny, n_seqs, context):
    row = audit.measured(tiny, n_seqs, context)
    keys = context + 1
    # gathered keys per sequence: the bucket of its keys (the padding the mask hides)
    assert row["gathered / held keys"] == pytest.approx(audit.bucket(keys) / keys)
    assert row["bytes per gathered value"] == 14
    assert row["moved / held"] == pytest.approx(7 * audit.bucket(keys) / keys)


def test_the_bucket_steps_by_an_eighth_of_the_next_power_of_two(audit):
    assert [audit.bucket(n) for n in (1, 64, 65, 512, 513, 2048, 2049)] == [64, 64, 128, 512, 640, 2048, 2560]
