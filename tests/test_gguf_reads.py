"""A GGUF file is parsed once per process while unchanged
(lm_eval_headloc.intervention.gguf_reads)."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from lm_eval_headloc.intervention.gguf_reads import cached_gguf_reads, parses


def write_gguf(path, value: int) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.add_tensor("weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def value_of(reader) -> int:
    field = reader.fields["test.value"]
    return int(field.parts[field.data[0]][0])


def test_an_unchanged_file_is_parsed_once_and_a_changed_one_again(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, 1)
    original = gguf.GGUFReader
    before = parses()
    with cached_gguf_reads():
        first = gguf.GGUFReader(path)
        with cached_gguf_reads():  # nested: the same cache
            again = gguf.GGUFReader(str(path))
        assert again is first and parses() == before + 1
        assert value_of(first) == 1
        assert np.array_equal(first.tensors[0].data, np.arange(8, dtype=np.float32))
        assert isinstance(first, original)
        # Rewritten (another size or time): parsed again, the new content read.
        write_gguf(path, 2)
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        changed = gguf.GGUFReader(path)
        assert changed is not first and value_of(changed) == 2
        assert parses() == before + 2
        # A writable map is never shared.
        assert gguf.GGUFReader(path, "r+") is not changed
    assert gguf.GGUFReader is original  # put back on leaving
    assert gguf.GGUFReader(path) is not changed


def test_an_error_inside_puts_the_reader_back(tmp_path):
    original = gguf.GGUFReader
    with pytest.raises(RuntimeError, match="boom"), cached_gguf_reads():
        assert gguf.GGUFReader is not original
        raise RuntimeError("boom")
    assert gguf.GGUFReader is original


def test_transformers_metadata_parse_is_made_once_and_handed_out_as_copies(tmp_path,
                                                                           monkeypatch):
    from transformers import modeling_gguf_pytorch_utils as loading

    path = tmp_path / "model.gguf"
    write_gguf(path, 1)
    calls = []

    def fake_load(checkpoint, return_tensors=False, **kwargs):
        calls.append((str(checkpoint), return_tensors))
        return {"config": {"layers": [1, 2]}, "tokenizer": {"tokens": ["a", "b"]}}

    monkeypatch.setattr(loading, "load_gguf_checkpoint", fake_load)
    with cached_gguf_reads():
        first = loading.load_gguf_checkpoint(path)  # transformers' config read
        first["config"]["layers"].append(3)  # a caller changing what it was given
        second = loading.load_gguf_checkpoint(str(path), return_tensors=False)  # tokenizer
        assert second == {"config": {"layers": [1, 2]}, "tokenizer": {"tokens": ["a", "b"]}}
        assert calls == [(str(path), False)]
        loading.load_gguf_checkpoint(path, return_tensors=True)  # the weights: read anew
        assert calls[-1] == (str(path), True) and len(calls) == 2
        write_gguf(path, 2)  # rewritten: parsed again
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        loading.load_gguf_checkpoint(path)
        assert len(calls) == 3
    assert loading.load_gguf_checkpoint is fake_load  # put back on leaving


def test_the_tensor_name_map_is_built_once_per_architecture_and_depth():
    original = gguf.get_tensor_name_map
    plain = original(gguf.MODEL_ARCH.LLAMA, 2)
    with cached_gguf_reads():
        once = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is once
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not once
        # The same map as a fresh build: every name mapped alike.
        assert once.mapping == plain.mapping
        assert once.get_name("model.layers.1.self_attn.o_proj") == \
            plain.get_name("model.layers.1.self_attn.o_proj") == "blk.1.attn_output"
    assert gguf.get_tensor_name_map is original
