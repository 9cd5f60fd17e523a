#!/usr/bin/env bash
# What can be checked of the apps without the Android or iOS SDKs (issue 9, item 4):
#
#   1. the C++ decode core builds (-Werror) and passes its unit tests (ctest),
#   2. the embedded demo pair exports to an ONNX bundle,
#   3. `edgemtp conformance` regenerates its vectors, byte for byte the same twice, for that
#      bundle's manifest,
#   4. the core replays the vectors (conformance_test): every decode decision matches,
#   5. the core accepts the bundle's manifest.json (manifest_test) and reads what it holds,
#   6. the core's tokenizer gives the bundle's tokenizer.json the same ids as `tokenizers` on the
#      demo prompts (plain and as a chat turn),
#   7. the manifest validates against runtime/manifest.schema.json, whose schema version is the
#      one the core reads.
#
# Usage: apps/check.sh            (from anywhere; needs cmake, a C++17 compiler, the edgemtp venv)
# Env:   EDGEMTP_PYTHON  the Python with edgemtp installed (default: .venv/bin/python)
#        CHECK_KEEP=1    keep the temporary folder (build, bundle, vectors) and print it
#        CHECK_JOBS      parallel compile jobs (default 2)
# Prints each check as it runs; exits non-zero at the first failure, naming it.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${EDGEMTP_PYTHON:-$root/.venv/bin/python}"
jobs="${CHECK_JOBS:-2}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tiny models: threads cost more than they save

work="$(mktemp -d "${TMPDIR:-/tmp}/edgemtp-check.XXXXXX")"
step="setup"
finish() {
  local code=$?
  if [[ $code -ne 0 ]]; then
    echo "check.sh: FAILED at: $step (exit $code)" >&2
  fi
  if [[ "${CHECK_KEEP:-}" == 1 ]]; then
    echo "check.sh: kept $work"
  else
    rm -rf "$work"
  fi
}
trap finish EXIT

begin() {
  step="$1"
  echo "== $step"
}

edgemtp() {
  "$python" -c 'import sys; from edgemtp.cli import main; sys.exit(main(sys.argv[1:]))' "$@"
}

begin "tools: cmake, a C++ compiler, edgemtp"
command -v cmake >/dev/null || { echo "cmake is not on PATH" >&2; exit 1; }
command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null \
  || { echo "no C++ compiler (c++, g++ or clang++) on PATH" >&2; exit 1; }
"$python" -c 'import edgemtp, jsonschema' \
  || { echo "$python cannot import edgemtp and jsonschema (set EDGEMTP_PYTHON)" >&2; exit 1; }
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi

begin "build apps/core (C++17, -Wall -Wextra -Wpedantic -Werror) in $work/core"
cmake -S "$root/apps/core" -B "$work/core" "${generator[@]}" >"$work/cmake.log"
cmake --build "$work/core" --parallel "$jobs" >>"$work/cmake.log" \
  || { cat "$work/cmake.log" >&2; exit 1; }

begin "ctest: the core's unit tests"
ctest --test-dir "$work/core" --output-on-failure >"$work/ctest.log" \
  || { cat "$work/ctest.log" >&2; exit 1; }
grep "tests passed" "$work/ctest.log"

begin "export the embedded demo pair to ONNX (q4_0, context 256, depth 3, chunk 32)"
edgemtp export --model "$root/checkpoints/embedded-target" \
  --drafter "$root/checkpoints/embedded-assistant" --quant q4_0 --backend onnx \
  --max-context 256 --draft-depth 3 --prefill-chunk 32 --out "$work/bundle" 2>"$work/export.log" \
  || { cat "$work/export.log" >&2; exit 1; }

begin "edgemtp conformance: regenerate the vectors twice, byte for byte the same"
for run in first second; do
  edgemtp conformance --bundle "$work/bundle" --out "$work/vectors-$run" 2>"$work/conformance.log" \
    || { cat "$work/conformance.log" >&2; exit 1; }
done
cmp "$work/vectors-first/vectors.json" "$work/vectors-second/vectors.json"
"$python" - "$work/bundle/manifest.json" "$work/vectors-first/vectors.json" <<'EOF'
import hashlib
import json
import sys

manifest, vectors = sys.argv[1], json.load(open(sys.argv[2]))
sha = hashlib.sha256(open(manifest, "rb").read()).hexdigest()
assert vectors["bundle"]["manifest_sha256"] == sha, "the vectors are not of this bundle"
rounds = sum(len(c["rounds"]) for c in vectors["cases"])
print(f"{len(vectors['cases'])} cases, {rounds} rounds, for manifest sha256 {sha[:12]}")
EOF

begin "conformance_test: the C++ core replays the vectors"
"$work/core/conformance_test" "$work/vectors-first/vectors.json"

begin "manifest_test: the core accepts the bundle's manifest and reads what it holds"
"$work/core/manifest_test" "$work/bundle/manifest.json" >"$work/understood.json"
"$python" - "$work/bundle/manifest.json" "$work/understood.json" <<'EOF'
import json
import sys

from edgemtp.runtime.conformance import manifest_mismatches

manifest, core = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
problems = manifest_mismatches(core, manifest)
assert not problems, "the core read differently from the manifest and StaticShapes: " + "; ".join(
    problems
)
kinds = ", ".join(f"{k} {v['slots']} slots" for k, v in core["cache_kinds"].items())
print(
    f"{core['backend']}/{core['delegate']}: context {core['max_context']}, depth "
    f"{core['max_draft']}, chunk {core['chunk']}, {kinds}; {len(core['rounds'])} rounds' "
    "methods match StaticShapes"
)
EOF

begin "tokenizer_test: the core tokenizes the demo prompts as tokenizers does (the bundle's tokenizer.json)"
"$python" - "$root/checkpoints/embedded-target/demo_prompts.json" "$work/tokenizer-cases.json" <<'EOF'
import json
import sys

prompts = json.load(open(sys.argv[1]))
json.dump({"encode": prompts, "prompts": prompts}, open(sys.argv[2], "w"))
EOF
"$work/core/tokenizer_test" "$work/bundle/tokenizer.json" "$work/tokenizer-cases.json" \
  >"$work/tokenized.json"
"$python" - "$work/bundle/tokenizer.json" "$work/tokenizer-cases.json" "$work/tokenized.json" <<'EOF'
import json
import sys

from tokenizers import Tokenizer

from edgemtp.runtime.tokenizer import PromptTokenizer

oracle = Tokenizer.from_file(sys.argv[1])
prompts = json.load(open(sys.argv[2]))["prompts"]
core = json.load(open(sys.argv[3]))
session = PromptTokenizer(oracle)
for text, encoded, prompt in zip(prompts, core["encode"], core["prompts"], strict=True):
    assert encoded["with"] == oracle.encode(text).ids, f"encode differs on {text[:40]!r}"
    assert encoded["without"] == oracle.encode(text, add_special_tokens=False).ids
    assert prompt["chat"] == session.encode_prompt(text, chat=True)
tokens = sum(len(e["with"]) for e in core["encode"])
print(f"{len(prompts)} prompts, {tokens} tokens: the same ids as tokenizers and PromptTokenizer")
EOF

begin "the manifest validates against runtime/manifest.schema.json (the schema the core reads)"
"$work/core/manifest_test" --reads >"$work/reads.json"
"$python" - "$root/runtime/manifest.schema.json" "$work/bundle/manifest.json" \
  "$work/reads.json" <<'EOF'
import json
import sys

import jsonschema

schema, manifest, reads = (json.load(open(p)) for p in sys.argv[1:])
jsonschema.Draft202012Validator.check_schema(schema)
jsonschema.Draft202012Validator(schema).validate(manifest)
version = schema["properties"]["schema_version"]["const"]
core_version = reads["schema_version"]
assert core_version == version, f"the core reads schema version {core_version}, not {version}"
assert sorted(reads["backends"]) == sorted(schema["properties"]["backend"]["enum"])
print(f"valid; schema version {version} is the core's")
EOF

step="done"
echo "check.sh: all checks passed"
