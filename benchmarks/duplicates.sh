#!/usr/bin/env bash
# Repeated code in the product folders of the tree at $1 (default: this checkout): the files git
# tracks outside tests/, benchmarks/, fuzz/ and apps/, copied apart and read by `duplicates`
# (near-duplicate runs of six or more lines, same text or same shape).
set -euo pipefail
src=$(cd "${1:-.}" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$src"
git ls-files '*.py' '*.cpp' '*.h' | grep -v '^tests/\|^benchmarks/\|^fuzz/\|^apps/' |
  while read -r f; do mkdir -p "$tmp/$(dirname "$f")" && cp "$f" "$tmp/$f"; done
cd "$tmp" && duplicates --repo "$tmp" --most 200 --seconds 120
