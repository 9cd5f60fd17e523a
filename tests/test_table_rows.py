"""Host table lookups of GGML Q4_0 / Q8_0 rows (quantize/tables.py's `BlockRows`): the C
lookup (quantize/table_rows.cpp) and the numpy form, bit for bit against gguf's own
dequantization times the scale in float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from edgemtp.model.tables import TokenTables
from edgemtp.quantize import tables
from edgemtp.quantize.gguf_import import Q8_0Rows
from edgemtp.quantize.tables import Q4_0Rows, table_rows

FORMATS = {"q4_0": (Q4_0Rows, T.Q4_0, 18), "q8_0": (Q8_0Rows, T.Q8_0, 34)}


def random_blocks(rows: int, cols: int, block_bytes: int, seed: int) -> np.ndarray:
    """Random codes under fp16 scales of every kind a table can hold: normal, subnormal, zero,
    negative, the largest finite."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 32, block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, cols // 32)) * 0.05).astype(np.float16)
    scales.reshape(-1)[:4] = [np.float16(6e-8), np.float16(-3e-6), 0, np.float16(65504)]
    raw[..., :2] = scales.view(np.uint8).reshape(rows, cols // 32, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
def test_rows_match_gguf_times_the_scale(monkeypatch, fmt, native):
    cls, ggml_type, block_bytes = FORMATS[fmt]
    if native:
        assert table_rows() is not None, "the C lookup must build where the tests run"
    else:
        monkeypatch.setattr(tables, "table_rows", lambda: None)
    raw = random_blocks(50, 96, block_bytes, seed=len(fmt))
    rows = cls(raw, 96)
    assert rows._address is not None  # a contiguous byte table: the C lookup reads it in place
    ids = [0, 49, 7, 7, 0]
    expected = torch.from_numpy(quants.dequantize(raw[ids], ggml_type))
    for scale in (1.0, 39.191835884530846, 0.125):  # sqrt(1536) in float32 etc.
        for given in (ids, torch.tensor(ids), torch.tensor(ids, dtype=torch.int32)):
            got = rows.scaled(given, scale)
            assert got.dtype == torch.float32 and got.shape == (5, 96)
            assert torch.equal(got.view(torch.int32), (expected * scale).view(torch.int32))
    assert torch.equal(rows[torch.tensor(ids)], expected)
    strided = cls(np.concatenate([raw, raw], axis=1)[:, : raw.shape[1]], 96)
    assert strided._address is None and torch.equal(strided[ids], expected)  # numpy's form
    assert rows.scaled(torch.tensor([], dtype=torch.long), 2.0).shape == (0, 96)
    out = torch.full((1, 5, 96), float("nan"))  # any contiguous float32 of 5 x 96 values
    assert rows.scaled(ids, 0.125, out=out) is out
    assert torch.equal(out.view(5, 96).view(torch.int32), (expected * 0.125).view(torch.int32))


def test_a_lookup_outside_the_table_raises(monkeypatch):
    rows = Q4_0Rows(random_blocks(8, 64, 18, seed=3), 64)
    for bad in (8, -1):
        for ids in ([1, bad], torch.tensor([1, bad])):
            with pytest.raises(IndexError, match=f"id {bad} is outside the table's 8 rows"):
                rows.scaled(ids, 1.0)


def test_token_tables_scale_rows_as_the_reference_does():
    """`TokenTables` through the one-call lookup equals `table[ids].float() * scale` (what the
    reference model computes), for a quantized and a plain table."""
    raw = random_blocks(20, 64, 18, seed=5)
    plain = torch.randn(20, 2 * 32, dtype=torch.bfloat16)
    t = TokenTables(Q4_0Rows(raw, 64), plain, num_layers=2, ple_dim=32)
    ids = torch.tensor([3, 19, 3])
    assert torch.equal(t.embed(ids), t.tokens[ids].float() * t._token_scale)
    expected = (plain[ids].float() * t._ple_scale).view(3, 2, 32)
    assert torch.equal(t.per_layer_inputs(ids), expected)
    embeds, ple = torch.zeros(3, 64), torch.zeros(3, 2, 32)  # written in place, both table kinds
    assert t.embed(ids.tolist(), out=embeds) is embeds and torch.equal(embeds, t.embed(ids))
    assert t.per_layer_inputs(ids, out=ple) is ple and torch.equal(ple, expected)


@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
def test_a_lookup_into_a_wrong_buffer_raises(monkeypatch, native):
    if not native:
        monkeypatch.setattr(tables, "table_rows", lambda: None)
    rows = Q4_0Rows(random_blocks(8, 64, 18, seed=4), 64)
    for out in (torch.zeros(2, 63), torch.zeros(64, 2).t(), torch.zeros(2, 64, dtype=torch.half)):
        with pytest.raises(ValueError, match="out must be contiguous float32 of 2 x 64 values"):
            rows.scaled([1, 2], 1.0, out=out)


def _host_tables() -> dict[str, object]:
    from edgemtp.model.tables import TensorRows
    from edgemtp.quantize.tables import Int8Rows, quantize_int8_rows

    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    return {
        "q4_0": Q4_0Rows(random_blocks(40, 96, 18, seed=5), 96),
        "q8_0": Q8_0Rows(random_blocks(40, 96, 34, seed=6), 96),
        "int8": Int8Rows(*quantize_int8_rows(w)),
        "bf16": TensorRows(w.bfloat16()),
    }


def test_rows_in_a_program_are_the_host_lookups():
    """`TableInGraph` (a draft chain's token lookup) gives the host lookup's values bit for bit,
    eagerly and as an ExecuTorch program (its ops outside any delegate)."""
    from executorch.extension.pybindings import portable_lib

    from edgemtp.export.executorch_program import (
        backend_config,
        export_method,
        lower_programs,
        xnnpack_partitioner,
    )
    from edgemtp.model.tables import TableInGraph

    ids = torch.tensor([7, 0, 39, 7])
    programs, want = {}, {}
    for name, rows in _host_tables().items():
        scale = 9.797959  # sqrt(96), as a token table scales
        module = TableInGraph.of(rows, scale)
        want[name] = rows.scaled(ids.tolist(), scale)
        assert torch.equal(module(ids), want[name]), name
        programs[name] = export_method(module, (ids,))
    manager = lower_programs(programs, lambda: [xnnpack_partitioner()])
    buffer = manager.to_executorch(backend_config()).buffer  # the loaded program points into it
    loaded = portable_lib._load_for_executorch_from_buffer(buffer)
    for name, values in want.items():
        got = loaded.run_method(name, (ids,))[0]
        assert torch.equal(got, values), name
