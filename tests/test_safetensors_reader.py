"""The memory-mapped safetensors reader against the `safetensors` package, and on corrupt input."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from edgemtp.errors import EdgeMTPError
from edgemtp.model.safetensors_file import SafetensorsFile, TensorEntry, write_tensors


def test_reads_what_safetensors_writes(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    for name, t in tensors.items():
        assert torch.equal(f.tensor(name), t)
    assert torch.equal(f.read_rows("a", 1, 3), tensors["a"][1:3])


def test_streaming_writer_output_loads_with_safetensors(tmp_path):
    from safetensors.torch import load_file

    entries = [TensorEntry("w", "F32", (4, 3)), TensorEntry("i", "I8", (5,))]
    data = {"w": torch.randn(4, 3), "i": torch.arange(5, dtype=torch.int8)}
    write_tensors(tmp_path, entries, lambda e: iter([data[e.name].numpy()]))
    loaded = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in data.items())


def _file(tmp_path, header: bytes, body: bytes = b"") -> SafetensorsFile:
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)
    return SafetensorsFile(path)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.binary(max_size=64))
def test_random_bytes_give_edgemtp_errors(tmp_path_factory, header, body):
    tmp = tmp_path_factory.mktemp("fuzz")
    try:
        f = _file(tmp, header, body)
    except EdgeMTPError:
        return
    for name in f.keys():
        f.tensor(name)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=5),
        st.fixed_dictionaries(
            {
                "dtype": st.sampled_from(["F32", "BF16", "I8", "X", 3]),
                "shape": st.one_of(st.lists(st.integers(-2, 2**41), max_size=3), st.none()),
                "data_offsets": st.one_of(
                    st.lists(st.integers(-5, 2**41), min_size=0, max_size=3), st.just("x")
                ),
            }
        ),
        max_size=3,
    ),
    st.integers(0, 64),
)
def test_structured_bad_headers(tmp_path_factory, header, body_len):
    tmp = tmp_path_factory.mktemp("fuzz")
    try:
        f = _file(tmp, json.dumps(header).encode(), bytes(body_len))
    except EdgeMTPError:
        return
    for name in f.keys():  # whatever was accepted must be readable within the file
        assert f.tensor(name).numel() * f.tensor(name).element_size() <= body_len


def test_header_length_past_the_end(tmp_path):
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(EdgeMTPError, match="corrupt or truncated"):
        SafetensorsFile(path)
