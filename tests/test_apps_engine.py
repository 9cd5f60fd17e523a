"""The apps' engine (`apps/core`: tables.cpp, engine.cpp) against the Python runtime.

- Tables: `tables_dump` prints the rows the C++ `TokenTables` gathers from a tables.safetensors
  as float bits; they must equal, bit for bit, the rows of the Python runtime's `TokenTables`
  (export.bundle.open_tables) for every table format export writes (f32, f16, bf16, q4_0,
  q8_0, int8_row), each table built here with the repository's quantizers and written with
  export.bundle.write_tables. Truncated or corrupt files and files that disagree with the
  manifest are refused with one line naming the file and the fix.
- Engine: `engine_run` (built only where ExecuTorch's C++ runtime is: the executorch wheel's
  CMake package) runs the Engine over the embedded demo pair's ExecuTorch bundle
  (cli.demo's cached bundle). Greedy tokens, stop reasons and each round's drafted/accepted
  counts must equal `Session.from_bundle(...).generate` at depths 0-3; adaptive depth (whose
  choices follow timing) must give the tokens greedy decoding gives; the text must be the
  Python tokenizer's decode of the tokens, and the text streamed piece by piece the same; a
  chat's second turn must reuse the first turn's cache and give Python's tokens; a seeded
  sampled run must repeat. With one set of memory arenas per method (as ExecuTorch's Java
  Module loads them) the methods no longer share the cache, and the tokens go wrong silently:
  the reason the apps run ExecuTorch in C++.
- Host-side protocols: `engine_pipe` runs the Engine with a runner that asks this process, which
  executes the methods in Python: an ONNX bundle's with ONNX Runtime (the engine keeping the
  cache arrays and writing back the returned rows, as OnnxRunner) and a Core ML bundle's forms
  in torch (the engine owning the slot positions, as CoreMLRunner). Every call the engine makes
  (method, inputs, cache arrays / slot positions) must equal, bit for bit, the call the Python
  runtime makes, and the tokens and rounds must be the same, across chunked prefill, every draft
  depth, decoding past the sliding ring, and chat turns that reuse and truncate the cache.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from edgemtp.export.bundle import write_tables
from edgemtp.model.tables import TokenTables
from edgemtp.quantize.gguf_import import Q8_0Rows
from edgemtp.quantize.q4_0 import pack_q4_0, quantize_q4_0
from edgemtp.quantize.tables import Int8Rows, Q4_0Rows, quantize_int8_rows
from edgemtp.runtime.bundle import open_tables

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "apps" / "core"
FORMATS = ("f32", "f16", "bf16", "q4_0", "q8_0", "int8_row")
VOCAB, HIDDEN, LAYERS, PLE_DIM = 40, 96, 3, 32  # sqrt(96), sqrt(32): not exact in fp16/bf16
IDS = [0, 1, 2, 7, 7, 39, 21]
TOKENS = 64
ET_LOG = re.compile(r"^[IWEDF] \d\d:\d\d:\d\d\.\d+ executorch:")


# --- tables ------------------------------------------------------------------------------------


def _table(fmt: str, w: torch.Tensor) -> Any:
    """`w` [rows, cols] stored as `fmt`, as a checkpoint or GGUF import would hold it."""
    if fmt == "f32":
        return w.float()
    if fmt == "f16":
        return w.half()
    if fmt == "bf16":
        return w.bfloat16()
    if fmt == "q4_0":
        return Q4_0Rows(pack_q4_0(quantize_q4_0(w)), w.shape[1])
    if fmt == "q8_0":
        import gguf

        raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
        return Q8_0Rows(raw, w.shape[1])
    return Int8Rows(*quantize_int8_rows(w))


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random rows, with a tiny row (fp16 subnormal values and block scales) and a zero row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.7
    w[1] = torch.randn(cols, generator=g) * 3e-6
    w[2] = 0.0
    return w


def _write(folder: Path, token_fmt: str, ple_fmt: str | None) -> dict[str, Any]:
    """tables.safetensors and a manifest.json with the fields the engine reads from it."""
    folder.mkdir(parents=True)
    tokens = _table(token_fmt, _weights(VOCAB, HIDDEN, 1))
    per_layer = _table(ple_fmt, _weights(VOCAB, LAYERS * PLE_DIM, 2)) if ple_fmt else None
    tables = TokenTables(tokens, per_layer, LAYERS, PLE_DIM if ple_fmt else 0)
    description = write_tables(tables, folder, lambda _: None)
    manifest = {
        "model": {"hidden_size": HIDDEN, "vocab_size": VOCAB, "num_layers": LAYERS},
        "tables": description,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def _python_rows(folder: Path, manifest: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """The Python runtime's rows (the memory-mapped tables, as Session.from_bundle opens them)."""
    description = manifest["tables"]
    ple_dim = description["ple"]["shape"][1] // LAYERS if "ple" in description else 0
    cfg = SimpleNamespace(num_layers=LAYERS, hidden_size_per_layer_input=ple_dim)
    tables = open_tables(folder, cfg, description)  # type: ignore[arg-type]
    ids = torch.tensor(IDS)
    embed = tables.embed(ids).numpy()
    ple = tables.per_layer_inputs(ids)
    return embed, None if ple is None else ple.reshape(len(IDS), -1).numpy()


def _dump(core: Path, manifest: Path, ids: list[int]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(core / "tables_dump"), str(manifest), ",".join(map(str, ids))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _bits(rows: Any) -> np.ndarray:
    return np.asarray(rows, dtype=np.uint32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_table_rows_equal_python_bit_for_bit(core_build, tmp_path, fmt):
    folder = tmp_path / fmt
    manifest = _write(folder, fmt, fmt)
    done = _dump(core_build, folder / "manifest.json", IDS)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["formats"] == {"token": fmt, "ple": fmt}
    embed, ple = _python_rows(folder, manifest)
    assert ple is not None
    np.testing.assert_array_equal(_bits(out["embed"]), embed.view(np.uint32))
    np.testing.assert_array_equal(_bits(out["per_layer"]), ple.view(np.uint32))
    # The comparison can tell a scale rounded to the table's dtype from a float32 one.
    if fmt in ("f16", "bf16"):
        dtype = torch.float16 if fmt == "f16" else torch.bfloat16
        rounded = torch.tensor(math.sqrt(HIDDEN), dtype=dtype).float()
        assert rounded != torch.tensor(math.sqrt(HIDDEN), dtype=torch.float32)


def test_tables_of_two_formats_and_without_per_layer_rows(core_build, tmp_path):
    mixed = _write(tmp_path / "mixed", "q4_0", "int8_row")  # what export writes from Q4_0
    done = _dump(core_build, tmp_path / "mixed" / "manifest.json", IDS)
    assert done.returncode == 0, done.stderr
    embed, ple = _python_rows(tmp_path / "mixed", mixed)
    np.testing.assert_array_equal(_bits(json.loads(done.stdout)["embed"]), embed.view(np.uint32))
    np.testing.assert_array_equal(_bits(json.loads(done.stdout)["per_layer"]), ple.view(np.uint32))

    plain = _write(tmp_path / "plain", "bf16", None)
    done = _dump(core_build, tmp_path / "plain" / "manifest.json", IDS)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    embed, ple = _python_rows(tmp_path / "plain", plain)
    assert ple is None and out["per_layer"] is None and out["formats"] == {"token": "bf16"}
    np.testing.assert_array_equal(_bits(out["embed"]), embed.view(np.uint32))


def _one_line_refusal(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = [x for x in done.stderr.splitlines() if not ET_LOG.match(x)]
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def q4_0_tables(tmp_path) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path / "bundle"
    return folder, _write(folder, "q4_0", "int8_row")


def test_truncated_or_corrupt_tables_are_refused_in_one_line(core_build, q4_0_tables):
    folder, _ = q4_0_tables
    path = folder / "tables.safetensors"
    good = path.read_bytes()
    manifest = folder / "manifest.json"
    fix = "copy the bundle again or export it again"

    path.write_bytes(good[:-100])  # a copy cut short
    _one_line_refusal(_dump(core_build, manifest, [0]), str(path), "truncated or corrupt", fix)
    path.write_bytes(good[:5])
    _one_line_refusal(_dump(core_build, manifest, [0]), str(path), "no safetensors header", fix)
    path.write_bytes((2**40).to_bytes(8, "little") + good[8:])  # header length garbage
    _one_line_refusal(_dump(core_build, manifest, [0]), str(path), "header declares", fix)
    header_len = int.from_bytes(good[:8], "little")
    path.write_bytes(good[:8] + b"{" * header_len + good[8 + header_len :])
    _one_line_refusal(_dump(core_build, manifest, [0]), str(path), "not valid JSON", fix)
    path.unlink()
    _one_line_refusal(_dump(core_build, manifest, [0]), str(path), "cannot open")


def test_tables_that_disagree_with_the_manifest_are_refused(core_build, q4_0_tables, tmp_path):
    folder, manifest = q4_0_tables
    path = folder / "manifest.json"
    fix = "export the bundle again"

    def refused(change: Any, *needles: str) -> None:
        edited = json.loads(json.dumps(manifest))
        change(edited)
        path.write_text(json.dumps(edited))
        _one_line_refusal(_dump(core_build, path, [0]), str(folder / "tables.safetensors"),
                          fix, *needles)  # fmt: skip

    other = _write(tmp_path / "other", "bf16", "f16")["tables"]  # another export's description
    refused(lambda m: m["tables"].update(token=other["token"]), "token.weight")
    refused(lambda m: m["tables"]["ple"].update(format="q8_0"), "tables.ple.tensors")
    refused(lambda m: m["tables"]["token"].update(format="q5_k"), "'q5_k'")
    refused(lambda m: m["tables"]["token"].update(shape=[VOCAB + 1, HIDDEN]), "token.q4_0")
    refused(lambda m: m["model"].update(vocab_size=VOCAB + 1), "vocabulary")
    refused(lambda m: m["model"].update(num_layers=5), "5 layers")
    refused(lambda m: m["tables"]["ple"].update(tensors=["ple.int8"]), "tables.ple.tensors")
    refused(lambda m: m["tables"].pop("token"), "tables.token is missing")
    # An id the table does not have.
    path.write_text(json.dumps(manifest))
    _one_line_refusal(_dump(core_build, path, [VOCAB]), "outside the token embedding table")


# --- the engine over ExecuTorch ----------------------------------------------------------------


def _executorch_package() -> Path | None:
    try:
        import executorch
    except ImportError:
        return None
    return Path(next(iter(executorch.__path__)))


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory) -> Path:
    """apps/core configured with the executorch wheel's CMake package, only engine_run built."""
    package = _executorch_package()
    if package is None or not (package / "lib" / "cmake" / "executorch").is_dir():
        pytest.skip("the executorch wheel (its C++ runtime and CMake package) is not installed")
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed: the C++ engine cannot be built here")
    build = tmp_path_factory.mktemp("engine-build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = subprocess.run(
        ["cmake", "-S", str(CORE), "-B", str(build), *generator,
         f"-DEDGEMTP_EXECUTORCH_DIR={package}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert configure.returncode == 0, configure.stdout + configure.stderr
    if "engine_run: ExecuTorch's CMake package not found" in configure.stdout:
        pytest.skip(f"ExecuTorch's C++ runtime is unusable here: {configure.stdout[-400:]}")
    done = subprocess.run(
        ["cmake", "--build", str(build), "--target", "engine_run", "-j2"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return build / "engine_run"


@pytest.fixture(scope="module")
def demo_bundle(demo_first_run) -> Path:
    """The embedded pair's Q4_0 ExecuTorch bundle (context 512, chunk 64, depth 3), exported
    once per test session by `edgemtp demo`."""
    return demo_first_run.bundle


@pytest.fixture(scope="module")
def session(demo_bundle):
    from edgemtp.runtime.session import Session

    return Session.from_bundle(demo_bundle)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    from edgemtp.model.embedded import PROMPTS

    texts = json.loads(PROMPTS.read_text())
    return [texts[0], texts[1]]  # 93 tokens (two prefill chunks, decodes past the ring), 46


def _run(binary: Path, bundle: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "--bundle", str(bundle), *args], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def _engine(binary: Path, bundle: Path, *args: str) -> dict[str, Any]:
    done = _run(binary, bundle, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _python(session, prompt: list[int], depth: int | str, tokens: int = TOKENS):
    session.reset()
    return session.generate(prompt, tokens, mtp=depth, interruptible=False)


def _rounds(result) -> list[list[int]]:
    return [[s.drafted, s.accepted] for s in result.steps if s.kind == "decode"]


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_greedy_tokens_and_rounds_equal_python(engine_run, demo_bundle, session, prompts, depth):
    for text in prompts:
        ids = session.tokenizer.encode_prompt(text)
        expected = _python(session, ids, depth)
        out = _engine(engine_run, demo_bundle, "--prompt", text, "--depth", str(depth),
                      "--tokens", str(TOKENS))  # fmt: skip
        assert out["prompt_tokens"] == len(ids) and out["reused_tokens"] == 0
        assert out["tokens"] == expected.tokens
        assert out["stop_reason"] == expected.stop_reason
        # The drafter's proposals decide what each round accepts: equal counts mean the engine
        # drafted from the same hidden states and embeddings as the Python runtime.
        assert out["stats"]["rounds"] == _rounds(expected)
        assert out["text"] == session.tokenizer.decode(expected.tokens)
        assert out["streamed"] == out["text"]
        stats = out["stats"]
        assert stats["ttft_s"] > 0 and stats["decode_s"] > 0
        assert set(stats["seconds_by_phase"]) == {"embed", "target", "drafter", "host"}
        assert (stats["seconds_by_phase"]["drafter"] > 0) == (depth > 0)


def test_separate_memory_arenas_decode_wrong_tokens_silently(
    engine_run, demo_bundle, session, prompts
):
    """The runner as a Module built without share_memory_arenas (the stock ExecuTorch AAR's
    Java Module) runs it: each method gets its own copy of the cache, so decode steps never see
    what prefill wrote. Nothing fails; the tokens are wrong. Every other test here runs the
    runner as the app builds it (shared arenas) and gets Python's tokens."""
    ids = session.tokenizer.encode_prompt(prompts[1])
    expected = _python(session, ids, 0).tokens
    shared = _engine(engine_run, demo_bundle, "--prompt", prompts[1], "--depth", "0",
                     "--tokens", "16")  # fmt: skip
    separate = _engine(engine_run, demo_bundle, "--separate-arenas", "--prompt", prompts[1],
                       "--depth", "0", "--tokens", "16")  # fmt: skip
    assert shared["tokens"] == expected[:16]
    assert len(separate["tokens"]) == 16 and separate["tokens"] != shared["tokens"]


def test_adaptive_depth_gives_greedy_tokens(engine_run, demo_bundle, session, prompts):
    for text in prompts:
        ids = session.tokenizer.encode_prompt(text)
        fixed = {d: _python(session, ids, d).tokens for d in range(4)}
        # Each verify method rounds a little differently; on these prompts no near-tie flips a
        # token, so any mix of depths must give the same tokens.
        assert all(tokens == fixed[0] for tokens in fixed.values())
        assert _python(session, ids, "auto").tokens == fixed[0]
        out = _engine(engine_run, demo_bundle, "--prompt", text, "--tokens", str(TOKENS))
        assert out["tokens"] == fixed[0]
        depths = {drafted for drafted, _ in out["stats"]["rounds"]}
        assert {0, 1} <= depths  # the policy's warm-up: AR and one-draft rounds


def test_chat_turns_reuse_the_cache_like_the_session(engine_run, demo_bundle, session, prompts):
    text = prompts[1]
    first = session.tokenizer.encode_prompt(text, chat=True)
    more = session.tokenizer.tokenizer.encode("\n    return x\n", add_special_tokens=False).ids
    session.reset()
    turn1 = session.generate(first, 24, mtp=2, interruptible=False)
    second = [*first, *turn1.tokens, *more]
    turn2 = session.generate(second, 24, mtp=2, interruptible=False)
    # A third prompt that diverges inside the cached tokens: truncated to the common prefix.
    third = [*first, *turn1.tokens[:5], *more]
    turn3 = session.generate(third, 24, mtp=2, interruptible=False)
    assert turn2.reused == len(first) + len(turn1.tokens) - 1
    assert turn3.reused == len(first) + 5

    out = _engine(engine_run, demo_bundle, "--prompt", text, "--chat", "--depth", "2",
                  "--tokens", "24", "--then", "\n    return x\n",
                  "--next-ids", ",".join(map(str, third)))  # fmt: skip
    turns = out["turns"]
    assert [t["tokens"] for t in turns] == [turn1.tokens, turn2.tokens, turn3.tokens]
    assert [t["reused_tokens"] for t in turns] == [0, turn2.reused, turn3.reused]
    assert [t["prompt_tokens"] for t in turns] == [len(first), len(second), len(third)]
    assert [t["stats"]["rounds"] for t in turns] == [_rounds(turn1), _rounds(turn2), _rounds(turn3)]
    assert [t["stop_reason"] for t in turns] == [turn1.stop_reason, turn2.stop_reason,
                                                 turn3.stop_reason]  # fmt: skip


def test_seeded_sampling_repeats(engine_run, demo_bundle, prompts):
    def sampled(seed: int) -> dict[str, Any]:
        return _engine(engine_run, demo_bundle, "--prompt", prompts[1], "--depth", "2",
                       "--tokens", "32", "--temperature", "0.8", "--top-k", "40",
                       "--seed", str(seed), "--no-stop")  # fmt: skip

    first, again = sampled(11), sampled(11)
    assert first["tokens"] == again["tokens"] and len(first["tokens"]) == 32
    assert first["stats"]["rounds"] == again["stats"]["rounds"]
    assert first["streamed"] == first["text"]
    assert any(sampled(seed)["tokens"] != first["tokens"] for seed in (12, 13))


def test_engine_refusals_are_one_line(engine_run, demo_bundle, tmp_path):
    _one_line_refusal(_run(engine_run, demo_bundle, "--ids", "2,5", "--depth", "4"),
                      "at most 3 drafts")  # fmt: skip
    _one_line_refusal(_run(engine_run, demo_bundle, "--ids", "2,99999"), "outside the vocabulary")
    copy = tmp_path / "bundle"
    shutil.copytree(demo_bundle, copy)
    tables = copy / "tables.safetensors"
    tables.write_bytes(tables.read_bytes()[:-4096])
    _one_line_refusal(_run(engine_run, copy, "--ids", "2,5"), str(tables), "truncated or corrupt")


# --- host-side protocols (ONNX cache arrays, Core ML slot positions) over a pipe ----------------

Call = tuple[str, list[np.ndarray]]
Answer = Callable[[str, list[tuple[str, np.ndarray]]], list[tuple[str, np.ndarray]]]


def _serve(command: list[str], answer: Answer) -> tuple[dict[str, Any], list[Call]]:
    """Runs engine_pipe, answering its method calls with `answer`; returns its JSON line and
    every call it made (method, input arrays in the order it sent them)."""
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    calls: list[Call] = []
    result = b""
    while line := proc.stdout.readline():
        if not line.startswith(b"CALL "):
            result += line
            continue
        request = json.loads(line[5:])
        inputs = []
        for spec in request["inputs"]:
            n = math.prod(spec["shape"])
            raw = proc.stdout.read(n * np.dtype(spec["dtype"]).itemsize)
            inputs.append((spec["name"], np.frombuffer(raw, spec["dtype"]).reshape(spec["shape"])))
        calls.append((request["method"], [x for _, x in inputs]))
        outputs = answer(request["method"], inputs)
        header = [{"name": n, "dtype": str(x.dtype), "shape": list(x.shape)} for n, x in outputs]
        proc.stdin.write(json.dumps({"outputs": header}).encode() + b"\n")
        for _, x in outputs:
            proc.stdin.write(np.ascontiguousarray(x).tobytes())
        proc.stdin.flush()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, stderr
    return json.loads(result), calls


def _typed(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32 if x.dtype.kind == "f" else np.int64)


def _assert_same_calls(engine: list[Call], python: list[Call]) -> None:
    assert [m for m, _ in engine] == [m for m, _ in python]
    for i, ((method, got), (_, want)) in enumerate(zip(engine, python, strict=True)):
        assert len(got) == len(want), (i, method)
        for j, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.shape == b.shape and np.array_equal(a, b), (i, method, j)


def _random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# A prompt of 21 ids (three prefill chunks of 8), decoding past the tiny model's sliding ring
# (window 16 + 2 drafts + 1 slots); then a chat turn on top of it (the cache reused), one that
# diverges far back (the ring lost what it needs: prefilled afresh) and one that diverges a few
# tokens back (truncated, the rest reused).
PIPE_TOKENS = 30


def _check_pipe_bundle(core: Path, bundle: Path, python_session, python_calls: list[Call],
                       answer: Answer, depth: int) -> None:  # fmt: skip
    vocab = json.loads((bundle / "manifest.json").read_text())["model"]["vocab_size"]
    prompts = [_random_prompt(21, vocab)]
    python_calls.clear()
    python_session.reset()
    expected = []
    for turn in range(4):
        expected.append(python_session.generate(prompts[-1], PIPE_TOKENS, mtp=depth,
                                                stop_ids=(), interruptible=False))  # fmt: skip
        last, tokens = prompts[-1], expected[-1].tokens
        prompts.append(
            [[*last, *tokens, 7, 8, 9], [*prompts[0], *tokens[:4], 10, 11],
             [*last, *tokens[:-3], 12]][min(turn, 2)]
        )  # fmt: skip
    n = [len(p) for p in prompts]
    assert [g.reused for g in expected] == [0, n[1] - 4, 0, n[2] + PIPE_TOKENS - 3]

    next_ids = [arg for p in prompts[1:4] for arg in ("--next-ids", ",".join(map(str, p)))]
    out, calls = _serve(
        [str(core / "engine_pipe"), "--bundle", str(bundle),
         "--ids", ",".join(map(str, prompts[0])), *next_ids, "--depth", str(depth),
         "--tokens", str(PIPE_TOKENS), "--no-stop"],
        answer,
    )  # fmt: skip
    _assert_same_calls(calls, python_calls)
    turns = out["turns"]
    assert [t["tokens"] for t in turns] == [g.tokens for g in expected]
    assert [t["reused_tokens"] for t in turns] == [g.reused for g in expected]
    assert [t["stats"]["rounds"] for t in turns] == [_rounds(g) for g in expected]


@pytest.fixture(scope="module")
def tiny_kernel_bundle(tiny_q4_0_pair, tmp_path_factory) -> Path:
    """The tiny pair as an ExecuTorch cpu bundle whose decode, verify and draft methods call
    edgemtp's kernels (`--kernels edgemtp`, the default there): attention, Q4_0 linears, norms."""
    from edgemtp.cli import main

    target, drafter = tiny_q4_0_pair
    out = tmp_path_factory.mktemp("executorch-kernel") / "bundle"
    assert main(
        ["export", "--model", str(target), "--drafter", str(drafter), "--backend", "executorch",
         "--delegate", "cpu", "--max-context", "96", "--draft-depth", "2", "--prefill-chunk", "8",
         "--out", str(out)]
    ) == 0  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend_details"]["kernels"] == [
        "edgemtp::add_rms_norm.out",
        "edgemtp::cache_attention_rows.out",
        "edgemtp::head_norm_rope.out",
        "edgemtp::q4_0_gated_linear.out",
        "edgemtp::q4_0_linear.out",
        "edgemtp::ring_positions.out",
        "edgemtp::rms_norm.out",
        "edgemtp::truncate_positions.out",
    ]
    return out


@pytest.mark.parametrize("depth", [0, 2])
def test_engine_runs_a_kernel_bundle_like_python(engine_run, tiny_kernel_bundle, depth):
    """engine_run compiles edgemtp's kernels into itself (apps/core/tests/executorch.cmake): over
    a bundle that calls it, the C++ engine decodes the Python runtime's tokens, round by round,
    past the tiny model's sliding ring."""
    from edgemtp.runtime.session import Session

    session = Session.from_bundle(tiny_kernel_bundle)
    prompt = _random_prompt(21, session.backend.vocab_size)
    expected = session.generate(prompt, PIPE_TOKENS, mtp=depth, stop_ids=(), interruptible=False)
    out = _engine(engine_run, tiny_kernel_bundle, "--ids", ",".join(map(str, prompt)),
                  "--depth", str(depth), "--tokens", str(PIPE_TOKENS), "--no-stop")  # fmt: skip
    assert out["tokens"] == expected.tokens
    assert out["stats"]["rounds"] == _rounds(expected)
    assert (out["stats"]["seconds_by_phase"]["drafter"] > 0) == (depth > 0)


@pytest.fixture(scope="module")
def tiny_onnx(tiny_q4_0_pair, tmp_path_factory) -> Path:
    from edgemtp.cli import main

    target, drafter = tiny_q4_0_pair
    out = tmp_path_factory.mktemp("onnx") / "bundle"
    assert main(
        ["export", "--model", str(target), "--drafter", str(drafter), "--backend", "onnx",
         "--max-context", "96", "--draft-depth", "2", "--prefill-chunk", "8", "--out", str(out)]
    ) == 0  # fmt: skip
    return out


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_onnx_cache_arrays_match_the_onnx_runner(core_build, tiny_onnx, depth):
    """The engine keeps the cache arrays and writes back each method's rows and positions: it
    must feed every call exactly what OnnxRunner feeds."""
    from edgemtp.model.checkpoint import target_config
    from edgemtp.model.static import StaticShapes
    from edgemtp.runtime.backends import StaticBackend
    from edgemtp.runtime.bundle import open_tables
    from edgemtp.runtime.runners.onnx import OnnxRunner
    from edgemtp.runtime.session import Session

    manifest = json.loads((tiny_onnx / "manifest.json").read_text())
    shapes = StaticShapes(**manifest["shapes"])
    cfg = target_config(json.loads((tiny_onnx / "config.json").read_text()), "tiny")
    tables = open_tables(tiny_onnx, cfg, manifest["tables"])
    program = tiny_onnx / manifest["program"]

    calls: list[Call] = []
    runner = OnnxRunner(program, shapes)

    class Recording:  # the Python runtime's calls, with the cache arrays each one reads
        shapes, methods = runner.shapes, runner.methods

        def call(self, method, *inputs):
            cache = [runner.arrays[n].copy() for n in runner.methods[method].spec["cache_inputs"]]
            calls.append((method, [x.numpy().copy() for x in inputs] + cache))
            return runner.call(method, *inputs)

    session = Session(StaticBackend(Recording(), tables, cfg, name="onnx"))
    served = OnnxRunner(program, shapes)  # runs the engine's calls: its own arrays stay unused

    def answer(method, inputs):
        spec = served.methods[method].spec
        names = [io["name"] for io in spec["outputs"] + spec["cache_outputs"]]
        outs = served.methods[method].session.run(names, dict(inputs))
        return [(n, _typed(x)) for n, x in zip(names, outs, strict=True)]

    _check_pipe_bundle(core_build, tiny_onnx, session, calls, answer, depth)


@pytest.mark.parametrize("depth", [0, 2])
def test_coreml_slot_positions_match_the_coreml_runner(core_build, tiny_coreml_bundle,
                                                       tiny_q4_0_pair, depth):  # fmt: skip
    """The engine owns the Core ML package's slot positions (pos_<kind> in, new_pos_<kind>
    out): every function call must get exactly what CoreMLRunner's protocol feeds. The
    functions run as their Core ML forms in torch (fp32), Core ML itself needing macOS."""
    from edgemtp.export.coreml import TorchCoreMLRunner
    from edgemtp.export.weights import attach_int4
    from edgemtp.model.static import StaticBundle, StaticShapes
    from edgemtp.quantize.load import load_drafter, load_target
    from edgemtp.runtime.backends import StaticBackend
    from edgemtp.runtime.bundle import open_tables
    from edgemtp.runtime.session import Session

    bundle = tiny_coreml_bundle
    manifest = json.loads((bundle / "manifest.json").read_text())
    shapes = StaticShapes(**manifest["shapes"])

    def runner() -> TorchCoreMLRunner:
        target = load_target(tiny_q4_0_pair[0])
        drafter = load_drafter(tiny_q4_0_pair[1], target.cfg)
        attach_int4(target.model, target.source, target.names)
        attach_int4(drafter.model, drafter.source, drafter.names)
        static = StaticBundle.build(target.model, drafter.model, shapes)
        return TorchCoreMLRunner(static, None, torch.float32)

    calls: list[Call] = []
    python_runner, served = runner(), runner()
    run = python_runner._run

    def recorded(method, feeds):
        names = python_runner.io[method]["inputs"]
        calls.append((method, [np.asarray(feeds[n]).copy() for n in names]))
        return run(method, feeds)

    python_runner._run = recorded  # type: ignore[method-assign]
    cfg = load_target(tiny_q4_0_pair[0]).cfg
    tables = open_tables(bundle, cfg, manifest["tables"])
    session = Session(StaticBackend(python_runner, tables, cfg, name="coreml"))

    def answer(method, inputs):
        out = served._run(method, {n: x.copy() for n, x in inputs})
        return [(n, _typed(out[n])) for n in served.io[method]["outputs"]]

    _check_pipe_bundle(core_build, bundle, session, calls, answer, depth)
