"""ONNX backend: the lowered methods against the eager reference on tiny checkpoints.

Oracles: `runtime.generate.generate` (greedy tokens), the eager static wrappers on the same
dequantized weights (logits), `Int4Weight.dequantize()` (the 4-bit weights, bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from oracle_drafts import OracleDrafts, greedy

from edgemtp.errors import EdgeMTPError
from edgemtp.export.onnx import FOLDER, MATMUL_NODES, VIEW_NODES, lower_onnx
from edgemtp.export.onnx.graph import WEIGHTS
from edgemtp.export.onnx.int4 import qdq_weight_tensors
from edgemtp.export.weights import attach_int4, int4_of
from edgemtp.model.cache import KVCache
from edgemtp.model.forward import prefill
from edgemtp.model.static import StaticBundle, StaticShapes
from edgemtp.model.synth import write_preset
from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.backends import StaticBackend
from edgemtp.runtime.generate import generate
from edgemtp.runtime.runners.eager import EagerRunner
from edgemtp.runtime.runners.onnx import OnnxRunner, flush_denormals

SHAPES = StaticShapes(max_context=96, max_draft=2, chunk=8)
N_NEW = 40  # tiny's window is 16: decoding runs well past it
SCHEMES = {
    "none": None,
    "q4_0": Settings(scheme="q4_0"),
    "w4a16": Settings(scheme="w4a16"),
    "w4a16-asym": Settings(scheme="w4a16", symmetric=False),
}
# fp32 everywhere (MatMulNBits dequantizes to fp32 at accuracy_level 0): only the order of
# float operations differs from the eager wrappers; measured max |diff| ~1e-5.
ATOL = RTOL = 1e-4


def _quiet(msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx_ckpt")
    write_preset("tiny", root / "none" / "t", init_std=0.05)
    write_preset("tiny-assistant", root / "none" / "a", init_std=0.05)
    for scheme, settings in SCHEMES.items():
        if settings is not None:
            for part in ("t", "a"):
                quantize_checkpoint(root / "none" / part, root / scheme / part, settings)
    return root


def _load(checkpoints: Path, scheme: str, int4: bool = True, float_4bit: bool = True):
    target = load_target(checkpoints / scheme / "t", float_4bit=float_4bit)
    drafter = load_drafter(checkpoints / scheme / "a", target.cfg)
    if int4:
        attach_int4(target.model, target.source, target.names)
        attach_int4(drafter.model, drafter.source, drafter.names)
    return target, drafter


def _lower(checkpoints: Path, scheme: str, out: Path, delegate: str = "cpu", float_4bit=True, **kw):
    target, drafter = _load(checkpoints, scheme, float_4bit=float_4bit)
    static = StaticBundle.build(target.model, drafter.model, SHAPES)
    lowered = lower_onnx(static, delegate, out, _quiet, tables=target.tables, **kw)
    return target, static, lowered


class Exported:
    """One scheme lowered for the CPU EP, its runner, and the reference models."""

    def __init__(self, checkpoints: Path, scheme: str, out: Path):
        self.checkpoints = checkpoints
        self.scheme = scheme
        # fp32 activations: the reference engine's numerics, so tokens and logits compare exactly
        self.target, self.static, self.lowered = _lower(
            checkpoints, scheme, out, activations="fp32"
        )
        self.folder = out / self.lowered.program
        self.runner = OnnxRunner(self.folder, SHAPES)
        self.reference = _load(checkpoints, scheme, int4=False)

    def eager(self) -> StaticBackend:
        """The eager static wrappers on the same (dequantized) weights."""
        target, drafter = _load(self.checkpoints, self.scheme, int4=False)
        bundle = StaticBundle.build(target.model, drafter.model, SHAPES)
        return StaticBackend(EagerRunner(bundle), target.tables, target.cfg)


@pytest.fixture(scope="module", params=list(SCHEMES))
def exported(request, checkpoints, tmp_path_factory):
    return Exported(checkpoints, request.param, tmp_path_factory.mktemp(f"onnx_{request.param}"))


def _prompt(n: int = 21, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache_value(runner: OnnxRunner, method: str, name: str):
    """The OrtValue `method` reads as cache input `name`."""
    assert name in runner.methods[method].spec["cache_inputs"], f"{method} does not read {name}"
    return runner.values[name]


def test_lowered_without_float_weights_writes_the_same_files(exported, tmp_path):
    """Loaded as exports load it (4-bit linears hold no floats: the trace runs them on zero
    stand-ins), the model lowers to the same graphs and weights, byte for byte."""
    _, _, lowered = _lower(
        exported.checkpoints, exported.scheme, tmp_path, activations="fp32", float_4bit=False
    )
    assert lowered.files == exported.lowered.files
    for name in lowered.files:
        want = (exported.folder.parent / name).read_bytes()
        assert (tmp_path / name).read_bytes() == want, name


@pytest.mark.parametrize("depth", [0, 2])
def test_tokens_match_reference(exported, depth):
    target, drafter = exported.reference
    ref = generate(target, _prompt(), N_NEW, drafter=drafter, mtp_depth=depth, prefill_chunk=8)
    onnx = StaticBackend(exported.runner, exported.target.tables, exported.target.cfg)
    got = greedy(onnx, _prompt(), N_NEW, depth)
    assert got.tokens == ref.tokens
    assert got.calls["prefill_intermediate"] == 2 and got.calls["prefill_final"] == 1
    if depth:
        assert got.drafted == ref.metrics()["drafted"]
        assert got.accepted == ref.metrics()["accepted"]


def test_logits_match_eager(exported):
    """A padded prefill against the reference engine; then a verify of 3 rows and a draft
    step on top of it, every output against the eager static wrappers."""
    onnx_driver = StaticBackend(exported.runner, exported.target.tables, exported.target.cfg)
    eager_driver = exported.eager()
    prompt = _prompt(13, seed=1)
    h_onnx, l_onnx = onnx_driver.prefill(prompt, 0)
    h_eager, l_eager = eager_driver.prefill(prompt, 0)
    target = exported.reference[0]
    cache = KVCache(target.cfg, SHAPES.max_context, SHAPES.max_draft)
    h_ref, l_ref = prefill(target, cache, torch.tensor(prompt), chunk=SHAPES.chunk)
    torch.testing.assert_close(l_onnx, l_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(h_onnx, h_ref, atol=ATOL, rtol=RTOL)
    ids = torch.tensor([int(l_eager.argmax()), 7, 9])
    outs = []
    for driver in (onnx_driver, eager_driver):
        logits, hidden = driver.runner.call("verify_2", *driver._padded(ids.tolist(), 13, 3))
        embed = driver.tables.embed(ids[:1])[0]
        draft = driver.runner.call("draft_step", embed, hidden[0], torch.tensor([14]))
        outs.append((logits, hidden, *draft))
    got, want = outs
    for name, a, b in zip(
        ("logits", "hidden", "draft hidden", "ids", "draft logits"), got, want, strict=True
    ):
        if name == "ids":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize("exported", ["q4_0"], indirect=True)  # cache logic: any scheme
def test_partial_acceptance_rollback_past_window(exported):
    ar = generate(exported.reference[0], _prompt(), N_NEW).tokens
    driver = OracleDrafts(
        exported.runner,
        exported.target.tables,
        exported.target.cfg,
        ar_tokens=ar,
        prompt_len=len(_prompt()),
    )
    got = greedy(driver, _prompt(), N_NEW, depth=2)
    assert got.tokens == ar
    assert 0 < got.accepted < got.drafted


@pytest.mark.parametrize("exported", ["q4_0"], indirect=True)
def test_drafter_reads_the_target_cache_in_place(exported):
    """Every cache input of draft_step is bound to the very OrtValue the target methods read
    and write, and that OrtValue wraps the host array itself: no copy anywhere."""
    runner = exported.runner
    draft_inputs = runner.methods["draft_step"].spec["cache_inputs"]
    assert draft_inputs and all(n.startswith("cache.") for n in draft_inputs)
    for name in draft_inputs:
        value = _cache_value(runner, "draft_step", name)
        assert value is _cache_value(runner, "verify_0", name)
        assert value is _cache_value(runner, "prefill_final", name)
        assert value.data_ptr() == runner.arrays[name].ctypes.data
    # and it sees what the target wrote: a prefill fills the arrays the drafter reads
    driver = StaticBackend(runner, exported.target.tables, exported.target.cfg)
    hidden, _ = driver.prefill(_prompt(), 0)
    before = {n: runner.arrays[n].copy() for n in draft_inputs}
    out = runner.call(
        "draft_step",
        driver.tables.embed(torch.tensor([5]))[0],
        hidden,
        torch.tensor([len(_prompt())]),
    )
    assert all(np.array_equal(before[n], runner.arrays[n]) for n in draft_inputs)  # read only
    assert torch.isfinite(out[2]).all()


@pytest.mark.parametrize("exported", ["q4_0"], indirect=True)
def test_outputs_a_caller_holds_survive_the_next_call(exported):
    """Inputs and outputs are bound once per method; a call returns copies, so what one call
    returned is untouched by the next, and an input of the wrong shape is refused by name."""
    runner = OnnxRunner(exported.folder, SHAPES)
    driver = StaticBackend(runner, exported.target.tables, exported.target.cfg)
    hidden, _ = driver.prefill(_prompt(), 0)
    embed = driver.tables.embed(torch.tensor([5, 9]))
    first = runner.call("draft_step", embed[0], hidden, torch.tensor([len(_prompt())]))
    kept = [t.clone() for t in first]
    second = runner.call("draft_step", embed[1], hidden * 2, torch.tensor([len(_prompt()) + 1]))
    assert all(torch.equal(a, b) for a, b in zip(first, kept, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    name = runner.methods["draft_step"].spec["inputs"][1]["name"]
    with pytest.raises(ValueError, match=f"draft_step: input {name} has shape"):
        runner.call("draft_step", embed[0], hidden[:0], torch.tensor([len(_prompt())]))


def _initializers(folder: Path, file: str) -> dict[str, np.ndarray]:
    model = onnx.load(str(folder / file))  # external data resolved next to the file
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _run_node(
    node: onnx.NodeProto,
    inits: dict[str, np.ndarray],
    x: np.ndarray,
    n_out: int,
) -> np.ndarray:
    """One node of the bundle alone on input x (named as the node's first input)."""
    tensors = [numpy_helper.from_array(inits[i], i) for i in node.input[1:] if i]
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info(node.input[0], TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, [x.shape[0], n_out])],
        tensors,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {node.input[0]: x})[0]


@pytest.mark.parametrize("exported", ["q4_0", "w4a16", "w4a16-asym"], indirect=True)
def test_matmulnbits_weights_equal_dequantize_exactly(exported):
    """Each MatMulNBits node of verify_0, run alone on the identity, returns W^T exactly as
    `Int4Weight.dequantize()` gives W (no zero-point input when every zero is 8)."""
    model = onnx.load(str(exported.folder / "verify_0.onnx"), load_external_data=False)
    inits = _initializers(exported.folder, "verify_0.onnx")
    linears = {f"target.{n}.weight": m for n, m in exported.static.target.target.named_modules()}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == sum(int4_of(m) is not None for m in linears.values())
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        q = int4_of(linears[node.input[1].removesuffix(".B")])
        assert attrs["accuracy_level"] == 0 and attrs["bits"] == 4
        assert attrs["block_size"] == q.group and (attrs["N"], attrs["K"]) == q.shape
        assert (len(node.input) == 4) == (not q.symmetric)  # zero points only when not 8
        eye = np.eye(attrs["K"], dtype=np.float32)
        got = _run_node(node, inits, eye, attrs["N"])
        assert np.array_equal(got, q.dequantize().numpy().T), node.input[1]


def test_weights_are_stored_once(exported):
    """One weights.bin for every method; each initializer in it once; the .onnx files small."""
    folder = exported.folder
    details = exported.lowered.details
    size = (folder / WEIGHTS).stat().st_size
    assert size == details["weights_bytes"] < details["weights_referenced_bytes"]
    locations: dict[str, tuple[str, str]] = {}
    for file in sorted(folder.glob("*.onnx")):
        model = onnx.load(str(file), load_external_data=False)
        for t in model.graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                kv = {e.key: e.value for e in t.external_data}
                assert kv["location"] == WEIGHTS
                where = (kv["offset"], kv["length"])
                assert locations.setdefault(t.name, where) == where  # same bytes for everyone
        assert file.stat().st_size < 0.2 * size + 200_000
    unique = sum(int(length) for _, length in locations.values())
    assert unique <= size <= unique + 64 * len(locations)
    assert sorted(exported.lowered.files) == sorted(f"{FOLDER}/{p.name}" for p in folder.iterdir())


def test_elementwise_elements_are_what_onnx_runtime_computes(exported):
    """The elements each method's non-matmul, non-view nodes write per call, as the manifest
    says, equal the sizes of those nodes' outputs when ONNX Runtime runs the method (every one
    of them made a graph output)."""
    counted = exported.lowered.details["elementwise_elements"]
    probe = exported.folder / "probe.onnx"
    for method in counted:
        model = onnx.load(str(exported.folder / f"{method}.onnx"), load_external_data=False)
        model = onnx.shape_inference.infer_shapes(model)  # types of the untraced values too
        infos = {v.name: v for v in model.graph.value_info}
        outputs = {o.name for o in model.graph.output}
        written = [out for n in model.graph.node if n.op_type not in MATMUL_NODES | VIEW_NODES
                   for out in n.output]  # fmt: skip
        model.graph.output.extend(infos[v] for v in written if v in infos and v not in outputs)
        onnx.save(model, str(probe))
        try:
            session = ort.InferenceSession(str(probe))
            feed = {}
            for i in session.get_inputs():
                dtype = np.int64 if "int64" in i.type else np.float32
                feed[i.name] = np.zeros(i.shape, dtype=dtype)
            names = [o.name for o in session.get_outputs()]
            values = dict(zip(names, session.run(None, feed), strict=True))
        finally:
            probe.unlink()
        assert set(written) <= set(values), method
        assert counted[method] == sum(values[v].size for v in written) > 0, method


def test_onnx_runtime_runs_with_denormals_flushed_and_the_thread_is_restored():
    # x * 1: a denormal input reads as zero inside (DAZ), and as itself again afterwards
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "one"], ["y"])], "mul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.ones(2, np.float32), "one")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString())
    x = np.array([1e-39, 1.0], dtype=np.float32)  # 1e-39: below float32's smallest normal
    with flush_denormals():
        assert session.run(None, {"x": x})[0].tolist() == [0.0, 1.0]
    assert session.run(None, {"x": x})[0][0] == np.float32(1e-39)


def test_numerics_say_what_is_computed(exported):
    numerics = exported.lowered.numerics
    assert numerics["activations"].startswith("fp32 into the 4-bit linears")
    if exported.scheme == "q4_0":
        assert "Q4_0: group 32, zero-point 8 (exact Q4_0 values)" in numerics["weights"]
    if exported.scheme == "w4a16-asym":
        assert "W4A16: group 32, per-group zero points" in numerics["weights"]
    assert "accuracy_level 0" in numerics["accumulation"]


def test_int8_activations_are_the_default_and_close_to_the_reference(checkpoints, tmp_path):
    target, _, lowered = _lower(checkpoints, "q4_0", tmp_path)
    folder = tmp_path / lowered.program
    levels = {
        a.i
        for f in folder.glob("*.onnx")
        for n in onnx.load(str(f), load_external_data=False).graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "accuracy_level"
    }
    assert levels == {4}
    assert lowered.numerics["activations"].startswith("int8 into the 4-bit linears")
    assert "accuracy_level 4" in lowered.numerics["accumulation"]
    driver = StaticBackend(OnnxRunner(folder, SHAPES), target.tables, target.cfg)
    prompt = _prompt(13, seed=1)
    _, got = driver.prefill(prompt, 0)
    reference = _load(checkpoints, "q4_0", int4=False)[0]
    cache = KVCache(reference.cfg, SHAPES.max_context, SHAPES.max_draft)
    _, want = prefill(reference, cache, torch.tensor(prompt), chunk=SHAPES.chunk)
    error = float((got - want).abs().max() / want.abs().max())
    # int8 activations really there, and no further off than ExecuTorch's 8da4w programs are
    assert 1e-4 < error <= 0.35


@pytest.mark.parametrize("delegate", ["cpu", "htp"])
def test_export_is_deterministic(checkpoints, tmp_path, delegate):
    files = []
    for i in range(2):
        _, _, lowered = _lower(checkpoints, "q4_0", tmp_path / str(i), delegate=delegate)
        files.append({f: (tmp_path / str(i) / f).read_bytes() for f in lowered.files})
    assert files[0] == files[1]


def test_unsupported_delegates_name_the_alternative(checkpoints, tmp_path):
    target, drafter = _load(checkpoints, "q4_0")
    static = StaticBundle.build(target.model, drafter.model, SHAPES)
    for delegate in ("metal", "npu"):
        with pytest.raises(EdgeMTPError, match="--backend coreml"):
            lower_onnx(static, delegate, tmp_path, _quiet)
    with pytest.raises(EdgeMTPError, match="choose cpu or htp"):
        lower_onnx(static, "gpu", tmp_path, _quiet)
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def htp(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx_htp")
    target, static, lowered = _lower(
        checkpoints, "q4_0", out, delegate="htp", calibration_prompt=_prompt()
    )
    return target, static, lowered, out / lowered.program


def test_htp_bundle_is_qdq_with_exact_int4_weights(htp):
    target, static, lowered, folder = htp
    model = onnx.load(str(folder / "verify_0.onnx"), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert "MatMulNBits" not in ops and {"QuantizeLinear", "DequantizeLinear"} <= ops
    inits = _initializers(folder, "verify_0.onnx")
    types = {t.name: t.data_type for t in model.graph.initializer}
    linears = {f"target.{n}.weight": m for n, m in static.target.target.named_modules()}
    weight_dq = [
        n
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0].endswith(".qdq.codes")
    ]
    assert len(weight_dq) == sum(int4_of(m) is not None for m in linears.values())
    for node in weight_dq:
        assert types[node.input[0]] == TensorProto.INT4  # symmetric: signed codes, no zero point
        q = int4_of(linears[node.input[0].removesuffix(".qdq.codes")])
        graph = helper.make_graph(
            [node],
            "dq",
            [],
            [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)],
            [numpy_helper.from_array(inits[i], i) for i in node.input],
        )
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        m.ir_version = 10
        got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {}
        )[0]
        assert np.array_equal(got, q.dequantize().numpy().T)
    # every activation Q/DQ is uint16
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear":
            assert types[node.input[2]] == TensorProto.UINT16
    assert lowered.details["qdq"]["verify_0"]["quantized"] > 50


# uint16 rounding at every activation is amplified ~80x by this random tiny model (measured:
# 1e-5 of noise on the embeddings moves its logits by ~8e-4), so the bound is loose; on the
# calibration prompt itself the measured max |diff| is ~0.03 against logits of magnitude ~1.3.
QDQ_ATOL = 0.1


def test_htp_bundle_on_the_cpu_ep_is_close_to_the_reference(htp, checkpoints):
    target, _, _, folder = htp
    runner = OnnxRunner(folder, SHAPES, provider="cpu")
    got = StaticBackend(runner, target.tables, target.cfg).prefill(_prompt(), 0)
    ref_t, ref_d = _load(checkpoints, "q4_0", int4=False)
    eager = StaticBackend(
        EagerRunner(StaticBundle.build(ref_t.model, ref_d.model, SHAPES)), ref_t.tables, ref_t.cfg
    )
    want = eager.prefill(_prompt(), 0)
    torch.testing.assert_close(got[1], want[1], atol=QDQ_ATOL, rtol=0)
    # greedy choice: the reference's top token or one within the tolerance of it (a near tie)
    assert want[1][int(got[1].argmax())] >= want[1].max() - 2 * QDQ_ATOL
    # every method (verify_k, draft_step) runs in its QDQ form
    gen = greedy(StaticBackend(runner, target.tables, target.cfg), _prompt(), 12, depth=2)
    assert len(gen.tokens) == 12 and gen.calls["draft_step"] > 0


def test_qdq_weights_with_zero_points_are_exact(checkpoints):
    """Asymmetric W4A16 as DequantizeLinear(uint4 codes, scales, uint4 zero points, block)."""
    target, _ = _load(checkpoints, "w4a16-asym")
    q = int4_of(target.model.layers[0].mlp.down_proj)
    assert q is not None and not q.symmetric
    tensors = qdq_weight_tensors(q)
    inits = []
    for key in ("codes", "scales", "zero_points"):
        value = tensors[key]
        if isinstance(value, np.ndarray):
            inits.append(numpy_helper.from_array(value, key))
        else:
            inits.append(
                TensorProto(
                    name=key, data_type=value.elem_type, dims=list(value.dims), raw_data=value.raw
                )
            )
    node = helper.make_node(
        "DequantizeLinear", ["codes", "scales", "zero_points"], ["w"], axis=0, block_size=q.group
    )
    out = helper.make_tensor_value_info("w", TensorProto.FLOAT, None)
    model = helper.make_model(
        helper.make_graph([node], "dq", [], [out], inits),
        opset_imports=[helper.make_opsetid("", 21)],
    )
    model.ir_version = 10
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {}
    )[0]
    assert np.array_equal(got, q.dequantize().numpy().T)


def test_htp_runner_needs_the_qnn_ep(htp):
    if "QNNExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the QNN EP")
    with pytest.raises(EdgeMTPError, match="onnxruntime-qnn"):
        OnnxRunner(htp[3], SHAPES)
