"""Split GGUF files (llama.cpp's gguf-split layout: NAME-00001-of-0000N.gguf with split.no,
split.count and split.tensors.count): the embedded default model split into 3 parts loads and
gives the same logits as the whole file; a missing part, a part of another split and a path
that is not the first part are refused with errors that say so."""

import os
import shutil

import gguf
import numpy as np
import pytest

from pyllama_paged.engine import EngineConfig, Model, default_model_path
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.gguf.config import ModelLoadError
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.split_gguf import write_split

PROMPT = [2, 651, 6037, 529, 9405, 563, 496, 3207, 529]


def last_logits(path):
    with Model(path) as model:
        runner = ModelRunner(model, EngineConfig(n_ctx=64, n_threads=2, n_batch=64, block_size=16))
        try:
            return runner.prefill(runner.add_sequence(PROMPT))
        finally:
            runner.close()


def test_a_three_part_split_of_the_default_model_gives_the_same_logits(tmp_path):
    whole = default_model_path()
    parts = write_split(whole, str(tmp_path / "gemma3-270m"), 3)
    assert [os.path.basename(p) for p in parts] == [f"gemma3-270m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert sum(os.path.getsize(p) for p in parts) > 0.95 * os.path.getsize(whole)
    with Model(parts[0]) as split:
        assert split.gguf.parts[1].tensors and split.gguf.parts[2].tensors   # every part holds tensors
    np.testing.assert_array_equal(last_logits(parts[0]), last_logits(whole))


def test_parts_read_as_llama_cpp_writes_them(tmp_path):
    """gguf-py (llama.cpp's own reader) sees each part's split keys and its share of tensors."""
    base = write_tiny_model(tmp_path / "tiny.gguf", "llama", weight_type="q8_0")
    parts = write_split(base, str(tmp_path / "tiny"), 3)
    n_tensors = len(gguf.GGUFReader(base).tensors)
    seen = 0
    for i, part in enumerate(parts):
        reader = gguf.GGUFReader(part)
        assert reader.fields["split.no"].contents() == i
        assert reader.fields["split.count"].contents() == 3
        assert reader.fields["split.tensors.count"].contents() == n_tensors
        assert ("general.architecture" in reader.fields) == (i == 0)
        seen += len(reader.tensors)
    assert seen == n_tensors


def test_broken_splits_are_refused(tmp_path):
    base = write_tiny_model(tmp_path / "tiny.gguf", "llama", weight_type="q8_0")
    os.makedirs(tmp_path / "a")
    parts = write_split(base, str(tmp_path / "a" / "tiny"), 3)
    with pytest.raises(ModelLoadError, match="part 2 of 3 of a split GGUF; load its first part"):
        Model(parts[1])
    other = write_split(base, str(tmp_path / "b"), 2)
    shutil.copy(parts[1], tmp_path / "kept")
    shutil.copy(other[1], parts[1])   # part 2 of a 2-part split where part 2 of 3 belongs
    with pytest.raises(ModelLoadError, match="says it is part 2 of 2, but it is named part 2 of 3"):
        Model(parts[0])
    shutil.copy(tmp_path / "kept", parts[1])
    os.remove(parts[2])
    with pytest.raises(ModelLoadError, match=r"part 3 of 3 of this split GGUF is missing \(.*tiny-00003-of-00003"):
        Model(parts[0])
    renamed = tmp_path / "tiny-first.gguf"
    shutil.copy(parts[0], renamed)   # the first part under a name that does not say where the others are
    with pytest.raises(ModelLoadError, match="PREFIX-00001-of-00003.gguf"):
        Model(str(renamed))
