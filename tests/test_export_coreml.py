"""Core ML backend: everything a Linux host can check of the package and of its numerics.

Core ML cannot run here (`predict` needs macOS 15+). What is checked instead:
- the package: spec version and opset, functions, their inputs/outputs/states (the same states
  in every function, the drafter's included), op types and compute dtypes per function, one
  int4 constexpr per int4 linear a function uses, one copy of the weights, byte-identical
  re-exports;
- the weights read back from weight.bin: int4 codes, offsets and scales equal to the
  checkpoint's (dequantized: `Int4Weight.dequantize()` exactly), fp16 weights equal to the
  float weights rounded to fp16;
- the numerics: the same Core ML form runs eagerly in torch (`TorchCoreMLRunner`) with the
  weights read back, against the fp32 eager reference along the reference engine's greedy
  decoding (AR and MTP): in fp32 equal up to float rounding and decoding the same tokens on
  their own; in fp16 (what the program computes) within the tolerances stated at `TOL`.
The full package (every method) is built once, for q4_0; quant none and asymmetric W4A16 are
built with the drafter function only (it declares every state and holds int4/fp16 linears),
which keeps this file within a few minutes on two cores.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from oracle_drafts import greedy

from edgemtp.errors import EdgeMTPError
from edgemtp.export import coreml
from edgemtp.export.forms import COREML
from edgemtp.export.weights import attach_int4, int4_of
from edgemtp.model.gemma4 import RMSNorm
from edgemtp.model.static import StaticBundle, StaticShapes
from edgemtp.model.synth import write_preset
from edgemtp.quantize.checkpoint import Settings, quantize_checkpoint
from edgemtp.quantize.load import load_drafter, load_target
from edgemtp.runtime.backends import StaticBackend
from edgemtp.runtime.capabilities import coreml_compute_units
from edgemtp.runtime.generate import generate
from edgemtp.runtime.runners.coreml import (
    INT4_OP,
    SPEC_VERSION_IOS18,
    CoreMLRunner,
    dequantize,
    package_weights,
    validate_mlpackage,
)
from edgemtp.runtime.runners.coreml import function_io as package_io
from edgemtp.runtime.runners.eager import EagerRunner

SHAPES = StaticShapes(max_context=96, max_draft=2, chunk=8)
N_NEW = 32  # tiny's sliding window is 16: decoding runs well past it


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("coreml")
    write_preset("tiny", root / "t", init_std=0.05)
    write_preset("tiny-assistant", root / "a", init_std=0.05)
    out = {"none": (root / "t", root / "a")}
    for scheme, settings in {
        "q4_0": Settings(scheme="q4_0"),
        "w4a16": Settings(scheme="w4a16", symmetric=False),
    }.items():
        quantize_checkpoint(root / "t", root / f"t-{scheme}", settings)
        quantize_checkpoint(root / "a", root / f"a-{scheme}", settings)
        out[scheme] = (root / f"t-{scheme}", root / f"a-{scheme}")
    return out


def _load(pair):
    target = load_target(pair[0])
    drafter = load_drafter(pair[1], target.cfg)
    attach_int4(target.model, target.source, target.names)
    attach_int4(drafter.model, drafter.source, drafter.names)
    return target, drafter


def _lower(pair, out, only=None, delegate="metal"):
    """Lower a bundle of `pair`; returns the pair loaded afresh (lowering puts the bundle's own
    models in the Core ML form), the bundle, what lowering returned."""
    lowered_pair = _load(pair)
    static = StaticBundle.build(lowered_pair[0].model, lowered_pair[1].model, SHAPES)
    target, drafter = _load(pair)
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        lowered = coreml.lower_coreml(static, delegate, out, lambda _msg: None, only=only)
    return target, drafter, static, lowered


@pytest.fixture(scope="module")
def q4(paths, tmp_path_factory):
    """The full q4_0 package (every method), the bundle it came from and its models."""
    out = tmp_path_factory.mktemp("q4")
    target, drafter, static, lowered = _lower(paths["q4_0"], out)
    return target, drafter, static, lowered, out / coreml.PACKAGE


def _prompt(n: int = 21) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def _int4_linears(model, prefix):
    return {
        f"{prefix}_{path}".replace(".", "_"): w
        for path, m in model.named_modules()
        if (w := int4_of(m)) is not None
    }


# --- the package ------------------------------------------------------------------------------


def test_package_structure(q4):
    target, drafter, static, lowered, package = q4
    report = validate_mlpackage(package)
    assert report == lowered.details["package"]
    assert report["specification_version"] == SPEC_VERSION_IOS18
    assert report["opset"] == ["CoreML8"]  # iOS 18 / macOS 15
    names = [n for n in static.methods() if n != "cache_state"]
    assert list(report["functions"]) == names
    assert report["default_function"] == "verify_0"
    assert lowered.program == coreml.PACKAGE
    assert sorted(lowered.files) == [
        "model.mlpackage/Data/com.apple.CoreML/model.mlmodel",
        "model.mlpackage/Data/com.apple.CoreML/weights/weight.bin",
        "model.mlpackage/Manifest.json",
    ]

    cfg, cache = target.cfg, static.cache
    states = {
        f"owner_kvcache_{kv}{i}": {
            "shape": [
                cfg.layers[i].num_kv_heads,
                cache.slots[cfg.layers[i].attention] + 1,
                cfg.layers[i].head_dim,
            ],
            "dtype": "float16",
        }
        for i in cache.owners
        for kv in "kv"
    }
    assert report["shared_states"]
    pos = {f"pos_{k}": {"shape": [n + 1], "dtype": "int32"} for k, n in cache.slots.items()}
    new_pos = {f"new_{k}": v for k, v in pos.items()}
    ple = [cfg.num_layers, cfg.hidden_size_per_layer_input]
    h, vocab = cfg.hidden_size, cfg.vocab_size

    def rows(t):
        return {
            "embeds": {"shape": [t, h], "dtype": "float32"},
            "token_ple": {"shape": [t, *ple], "dtype": "float32"},
            "positions": {"shape": [t], "dtype": "int32"},
            **pos,
        }

    for name, fn in report["functions"].items():
        assert fn["states"] == states, name  # the drafter declares the target's states too
        c = SHAPES.chunk
        if name == "prefill_intermediate":
            assert fn["inputs"] == rows(c)
            assert fn["outputs"] == {"cache_length": {"shape": [1], "dtype": "int32"}, **new_pos}
        elif name == "prefill_final":
            assert fn["inputs"] == rows(c)
            assert fn["outputs"] == {
                "hidden": {"shape": [h], "dtype": "float16"},
                "logits": {"shape": [vocab], "dtype": "float16"},
                **new_pos,
            }
        elif name.startswith("verify_"):
            t = int(name[7:]) + 1
            assert fn["inputs"] == rows(t)
            assert fn["outputs"] == {
                "logits": {"shape": [t, vocab], "dtype": "float16"},
                "hidden": {"shape": [t, h], "dtype": "float16"},
                **new_pos,
            }
        else:
            head = drafter.cfg.centroid_top_k * vocab // drafter.cfg.num_centroids
            assert fn["inputs"] == {
                "token_embed": {"shape": [h], "dtype": "float32"},
                "hidden": {"shape": [h], "dtype": "float32"},
                "position": {"shape": [1], "dtype": "int32"},
                **pos,
            }
            assert fn["outputs"] == {
                "next_hidden": {"shape": [h], "dtype": "float16"},
                "token_ids": {"shape": [head], "dtype": "int32"},
                "logits": {"shape": [head], "dtype": "float16"},
            }
        # Every function writes every K/V state (the drafter only its trash slots).
        assert fn["ops"]["write_state"] == len(states), name
        assert fn["ops"]["read_state"] == len(states), name
    assert lowered.method_io == coreml.declared_io(static)
    assert package_io(package) == coreml.declared_io(static)  # what CoreMLRunner feeds


def test_int4_op_count_per_function(q4):
    """One constexpr per int4 linear a function uses, counted from the model structure."""
    target, drafter, _, _, package = q4
    report = validate_mlpackage(package)
    cfg = target.cfg
    t4 = _int4_linears(target.model, "target")
    d4 = _int4_linears(drafter.model, "drafter")
    # An intermediate prefill chunk needs only the K/V of the owning layers: of the last one
    # before the KV-shared block, only k_proj/v_proj are live (coremltools drops the rest).
    last = cfg.first_shared_layer - 1
    live = [
        k
        for k in t4
        if k.startswith("target_layers_")
        and (
            int(k.split("_")[2]) < last
            or k.endswith(("_k_proj", "_v_proj"))
            and int(k.split("_")[2]) == last
        )
    ]
    expected = {
        "prefill_intermediate": len(live) + ("target_per_layer_model_projection" in t4),
        "prefill_final": len(t4),
        **{f"verify_{k}": len(t4) for k in SHAPES.verify_depths},
        "draft_step": len(d4),
    }
    got = {n: f["ops"].get(INT4_OP, 0) for n, f in report["functions"].items()}
    assert got == expected


def test_int4_weights_read_back_exactly(q4):
    target, drafter, _, lowered, package = q4
    stored = package_weights(package)
    expected = {**_int4_linears(target.model, "target"), **_int4_linears(drafter.model, "drafter")}
    assert lowered.details["int4_linears"] == len(expected) > 0
    for name, w in expected.items():
        entry = stored[name]
        assert w.symmetric and entry["offset"] is None  # Q4_0: signed int4, no offset
        assert entry["scale"].dtype == np.float16
        np.testing.assert_array_equal(entry["scale"].astype(np.float32), w.scales.numpy())
        np.testing.assert_array_equal(entry["data"], w.signed_codes().numpy())
        np.testing.assert_array_equal(dequantize(entry), w.dequantize().numpy())
    # Linears without a 4-bit form (tiny's per_layer_projection: in-dim 16) are fp16.
    for path, m in target.model.named_modules():
        key = f"target_{path}".replace(".", "_")
        if isinstance(m, torch.nn.Linear) and int4_of(m) is None:
            np.testing.assert_array_equal(stored[key]["value"], m.weight.half().numpy())
    report = lowered.details["package"]
    assert report["weight_blobs"]["int4"] == len(expected)  # one blob per weight, not per use
    # No float weight is stored in fp32; the only fp32 blobs are RoPE inverse frequencies.
    assert report["weight_blobs"].get("fp32", 0) <= len(target.cfg.rope)


def test_package_holds_one_copy_of_the_weights(q4):
    target, drafter, _, lowered, package = q4
    one_copy = 0
    uses = 0
    for model in (target.model, drafter.model):
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                w = int4_of(m)
                one_copy += (
                    m.weight.numel() // 2 + w.scales.numel() * 2 if w else m.weight.numel() * 2
                )
    report = lowered.details["package"]
    for fn in report["functions"].values():
        uses += fn["ops"].get(INT4_OP, 0)
    size = (package / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size
    assert size == report["weight_bytes"]
    # One copy (measured +7%: 64-byte blob headers and alignment, norm weights, small consts;
    # tiny's weights are small), not one per function (~3x).
    assert one_copy < size < 1.15 * one_copy
    assert uses > 2.5 * report["weight_blobs"]["int4"]  # each weight stored once, used ~3x


def test_deployment_and_compute_units(q4):
    _, _, _, lowered, package = q4
    assert lowered.details["compute_units"] == "CPU_AND_GPU"
    assert coreml_compute_units("npu") == "CPU_AND_NE"
    assert coreml_compute_units("cpu") == "CPU_ONLY"
    with pytest.raises(EdgeMTPError, match="no Qualcomm delegate.*--delegate htp"):
        coreml_compute_units("htp")
    with pytest.raises(EdgeMTPError, match="no Qualcomm delegate"):
        coreml.lower_coreml(q4[2], "htp", package.parent / "htp", print)
    assert not (package.parent / "htp").exists()
    n = lowered.numerics
    assert "int4" in n["weights"] and "q4_0 group 32" in n["weights"]
    assert n["activations"].startswith("fp16") and n["cache"].startswith("K/V fp16")
    # The program's compute dtypes: fp16 everywhere but the RoPE angles and their sin/cos.
    for name, fn in lowered.details["package"]["functions"].items():
        dtypes = fn["dtypes"]
        assert dtypes["sin"] == dtypes["cos"] == ["fp32"], name
        for op in ("linear", "softmax", "rsqrt", "reduce_mean", "gelu", "matmul"):
            assert dtypes[op] == ["fp16"], (name, op)
        assert dtypes[INT4_OP] == ["fp16"], name


@pytest.mark.skipif(platform.system() == "Darwin", reason="Core ML runs on macOS")
def test_runner_needs_macos(q4):
    *_, package = q4
    with pytest.raises(EdgeMTPError, match=r"needs macOS 15\+ \(this host is Linux\)"):
        CoreMLRunner(package, SHAPES)


# --- numerics ---------------------------------------------------------------------------------

# fp32: the Core ML forms (int4 op, cache writes, host-owned positions, drafter step, norm) are
# the reference's maths: float rounding only. fp16: activations, K/V and weights in fp16 through
# 10 random layers move tiny's logits (|logit| < ~2) by up to ~0.17 and the final hidden states
# (unit RMS) by up to ~0.4 (measured, all three schemes); a random network this small amplifies
# a 5e-4 relative input perturbation ~35x. Argmax must agree wherever the reference's top-2
# margin exceeds twice the logit tolerance, and on at least 80% of all rows.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (0.3, 0.6)}  # (logits, hidden)


class TeacherForced:
    """Runs every call on the fp32 eager reference and on the tested runner with the same
    inputs, checks the outputs, and returns the reference's (the reference drives)."""

    def __init__(self, reference, tested, dtype):
        self.reference, self.tested, self.shapes = reference, tested, tested.shapes
        self.methods = tested.methods
        self.tol_logits, self.tol_hidden = TOL[dtype]
        self.worst = {"logits": 0.0, "hidden": 0.0}
        self.rows = self.agree = 0

    def _argmax(self, ref_logits, got_logits, ref_ids=None, got_ids=None):
        top = ref_logits.topk(2, dim=-1).values
        margin = top[..., 0] - top[..., 1]
        a, b = ref_logits.argmax(-1), got_logits.argmax(-1)
        if ref_ids is not None:
            a, b = ref_ids[a], got_ids[b]
        same = a == b
        assert bool(same[margin > 2 * self.tol_logits].all())
        self.rows += same.numel()
        self.agree += int(same.sum())

    def call(self, method, *inputs):
        ref = self.reference.call(method, *inputs)
        got = self.tested.call(method, *inputs)
        assert [r.shape for r in ref] == [g.shape for g in got]
        if method == "prefill_intermediate":
            assert torch.equal(ref[0], got[0])
            return ref
        if method == "draft_step":  # the kept clusters may differ at near-ties: compare tokens
            hidden = (ref[0], got[0])
            self._argmax(ref[2], got[2], ref[1], got[1])
        else:
            i, j = (1, 0) if method == "prefill_final" else (0, 1)
            hidden = (ref[j], got[j])
            self.worst["logits"] = max(self.worst["logits"], float((ref[i] - got[i]).abs().max()))
            self._argmax(ref[i], got[i])
        self.worst["hidden"] = max(self.worst["hidden"], float((hidden[0] - hidden[1]).abs().max()))
        return ref


def _check_numerics(pair, package, depth, dtype):
    """The Core ML form in `dtype`, with the package's weights, against the fp32 eager
    reference along the reference engine's greedy decoding (AR or MTP)."""
    target, drafter = _load(pair)  # the reference engine
    fresh = _load(pair)
    reference = StaticBundle.build(fresh[0].model, fresh[1].model, SHAPES)  # fp32, eager
    ref = generate(target, _prompt(), N_NEW, drafter=drafter, mtp_depth=depth, prefill_chunk=8)
    tested = _load(pair)
    static = StaticBundle.build(tested[0].model, tested[1].model, SHAPES)
    runner = coreml.TorchCoreMLRunner(static, package, dtype)
    assert runner.loaded > 0 or dtype == torch.float32  # fp16 weights load in fp16 only
    check = TeacherForced(EagerRunner(reference), runner, dtype)
    got = greedy(StaticBackend(check, target.tables, target.cfg), _prompt(), N_NEW, depth)
    assert got.tokens == ref.tokens  # the reference drove: same inputs all along
    assert check.worst["logits"] <= check.tol_logits, check.worst
    assert check.worst["hidden"] <= check.tol_hidden, check.worst
    assert check.agree >= 0.8 * check.rows, (check.agree, check.rows)
    if dtype == torch.float32:  # free-running: the forms alone decode the same tokens
        runner.reset()
        alone = greedy(StaticBackend(runner, target.tables, target.cfg), _prompt(), N_NEW, depth)
        assert alone.tokens == ref.tokens
        assert check.agree == check.rows
    return check


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("depth", [0, 2])
def test_q4_0_numerics(paths, q4, depth, dtype):
    _, _, static, lowered, package = q4
    _check_numerics(paths["q4_0"], package, depth, dtype)


def test_fp16_rmsnorm_does_not_overflow():
    """fp16 squares overflow past 256; the Core ML form scales by 1/max|x| first."""
    norm = RMSNorm(256, 1e-6)
    norm.weight.data = torch.rand(256) + 0.5
    x = torch.randn(3, 256) * torch.tensor([[1e-3], [1.0], [3e3]])
    x[:, 0] = torch.tensor([0.0, 5.0, 6e4])  # one large outlier channel, then zeros
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    ops = COREML.step
    got = ops.norm(norm.half(), x.half()).float()
    torch.testing.assert_close(got, ref, atol=2e-3 * ref.abs().max().item(), rtol=4e-3)
    zero = ops.norm(norm, torch.zeros(2, 256, dtype=torch.float16))  # padding rows stay finite
    assert torch.equal(zero, torch.zeros_like(zero))


# --- quant none and asymmetric w4a16: the drafter function only (it declares every state) ---


@pytest.fixture(scope="module")
def none_pkg(paths, tmp_path_factory):
    out = tmp_path_factory.mktemp("none")
    target, drafter, static, lowered = _lower(
        paths["none"], out, only=("draft_step",), delegate="npu"
    )
    return target, drafter, static, lowered, out / coreml.PACKAGE


def test_quant_none_is_fp16(paths, none_pkg):
    target, drafter, static, lowered, package = none_pkg
    report = lowered.details["package"]
    assert list(report["functions"]) == ["draft_step"]
    assert lowered.details["compute_units"] == "CPU_AND_NE"
    assert INT4_OP not in report["functions"]["draft_step"]["ops"]
    assert "int4" not in report["weight_blobs"] and lowered.details["int4_linears"] == 0
    assert lowered.numerics["weights"].startswith("fp16")
    stored = package_weights(package)
    linears = [(p, m) for p, m in drafter.model.named_modules() if isinstance(m, torch.nn.Linear)]
    for path, m in linears:
        key = f"drafter_{path}".replace(".", "_")
        np.testing.assert_array_equal(stored[key]["value"], m.weight.half().numpy())
    _check_numerics(paths["none"], package, 2, torch.float16)


@pytest.fixture(scope="module")
def w4a16_pkgs(paths, tmp_path_factory):
    """Two exports of the same asymmetric W4A16 bundle into different folders."""
    out = [tmp_path_factory.mktemp("w4a16-a"), tmp_path_factory.mktemp("w4a16-b")]
    first = _lower(paths["w4a16"], out[0], only=("draft_step",))
    _lower(paths["w4a16"], out[1], only=("draft_step",))
    return first, out


def test_exports_are_byte_identical(w4a16_pkgs):
    (_, _, _, lowered), (a, b) = w4a16_pkgs
    for name in lowered.files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    manifest = (a / coreml.PACKAGE / "Manifest.json").read_text()
    assert manifest == (b / coreml.PACKAGE / "Manifest.json").read_text()
    assert sorted(p.name for p in a.iterdir()) == [coreml.PACKAGE]  # no temporary left behind


def test_asymmetric_w4a16_read_back_exactly(paths, w4a16_pkgs):
    (target, drafter, static, lowered), (a, _) = w4a16_pkgs
    stored = package_weights(a / coreml.PACKAGE)
    expected = _int4_linears(drafter.model, "drafter")
    schemes = {w.scheme for w in expected.values()}
    assert "w4a16" in schemes
    asymmetric = 0
    for name, w in expected.items():
        entry = stored[name]
        if w.symmetric:
            assert entry["offset"] is None
            np.testing.assert_array_equal(entry["data"], w.signed_codes().numpy())
        else:  # uint4 codes with uint4 offsets, as stored in the checkpoint
            asymmetric += 1
            np.testing.assert_array_equal(entry["data"], w.codes.numpy())
            np.testing.assert_array_equal(entry["offset"], w.zeros.numpy())
        np.testing.assert_array_equal(entry["scale"].astype(np.float32), w.scales.numpy())
        np.testing.assert_array_equal(dequantize(entry), w.dequantize().numpy())
    assert asymmetric > 0
    assert "uint4" in lowered.details["package"]["weight_blobs"]
    for dtype in (torch.float32, torch.float16):
        _check_numerics(paths["w4a16"], a / coreml.PACKAGE, 0, dtype)


def test_merged_package_equals_coremltools_merge(paths, tmp_path):
    """`FunctionMerger` (a blob at a time) against coremltools' own `save_multifunction` (every
    function's weights held at once) over the same single-function packages: the same
    functions, descriptions, ops, and every stored tensor equal, in no more bytes."""
    import coremltools as ct
    from coremltools.libmilstoragepython import _BlobStorageReader

    from edgemtp.runtime.runners.coreml import blob_values, read_blob, weight_file

    target, drafter = _load(paths["q4_0"])
    static = StaticBundle.build(target.model, drafter.model, SHAPES)
    coreml._register_converters()
    parts = {}
    with torch.no_grad():
        static.use_form(COREML)
        for name in ("prefill_intermediate", "draft_step"):
            module, inputs = static.methods()[name]
            parts[name] = tmp_path / f"{name}.mlpackage"
            coreml.convert_function(name, module, inputs, static).save(str(parts[name]))
    merger = coreml.FunctionMerger(tmp_path / "ours.mlpackage")
    for name, part in parts.items():
        merger.add(name, part)
    merger.finish()
    descriptor = ct.utils.MultiFunctionDescriptor()
    for name, part in parts.items():
        descriptor.add_function(str(part), "main", name)
    descriptor.default_function_name = "prefill_intermediate"
    with coreml._quiet():
        ct.utils.save_multifunction(descriptor, str(tmp_path / "theirs.mlpackage"))

    def program(package):
        spec = ct.utils.load_spec(str(package))
        reader = _BlobStorageReader(str(weight_file(package)))
        functions = {}
        for fd in spec.description.functions:
            fn = spec.mlProgram.functions[fd.name]
            ops = [
                (op.type, [o.name for o in op.outputs], blob_values([op]))
                for op in fn.block_specializations[fn.opset].operations
            ]
            functions[fd.name] = (
                fd,
                [(t, n, [read_blob(reader, v) for v in vs]) for t, n, vs in ops],
            )
        return spec.description.defaultFunctionName, functions

    ours, theirs = program(tmp_path / "ours.mlpackage"), program(tmp_path / "theirs.mlpackage")
    assert ours[0] == theirs[0] == "prefill_intermediate"
    assert list(ours[1]) == list(theirs[1]) == list(parts)
    blobs = 0
    for name in parts:
        (fd_a, ops_a), (fd_b, ops_b) = ours[1][name], theirs[1][name]
        assert fd_a == fd_b
        for (type_a, names_a, values_a), (type_b, names_b, values_b) in zip(
            ops_a, ops_b, strict=True
        ):
            assert (type_a, names_a) == (type_b, names_b)
            for a, b in zip(values_a, values_b, strict=True):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)
                blobs += 1
    assert blobs > 20
    size = weight_file(tmp_path / "ours.mlpackage").stat().st_size
    assert size <= weight_file(tmp_path / "theirs.mlpackage").stat().st_size
