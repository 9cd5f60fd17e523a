"""Writes apps/core/src/unicode_tables.inc: the code point ranges of the Unicode classes the
tokenizer's GPT-2 pre-tokenizer pattern uses (\\p{L}, \\p{N}, \\s), from Python's unicodedata.

    python3 apps/core/tools/gen_unicode_tables.py            # rewrites the committed file

\\s is Oniguruma's Unicode definition (the regex engine of Hugging Face `tokenizers`): U+0009..
U+000D, U+0085 and the Zs, Zl, Zp categories, which is also the White_Space property that
Rust's char::is_whitespace tests (added tokens' lstrip/rstrip).
"""

from __future__ import annotations

import sys
import unicodedata
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "unicode_tables.inc"
CLASSES = {
    "kLetterRanges": lambda c: unicodedata.category(c) in {"Lu", "Ll", "Lt", "Lm", "Lo"},
    "kNumberRanges": lambda c: unicodedata.category(c) in {"Nd", "Nl", "No"},
    "kWhitespaceRanges": lambda c: (
        0x09 <= ord(c) <= 0x0D or ord(c) == 0x85 or unicodedata.category(c) in {"Zs", "Zl", "Zp"}
    ),
}


def ranges(member) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for code in range(sys.maxunicode + 1):
        if not member(chr(code)):
            continue
        if out and out[-1][1] == code - 1:
            out[-1] = (out[-1][0], code)
        else:
            out.append((code, code))
    return out


def render() -> str:
    lines = [
        f"// Generated from Python's unicodedata (Unicode {unicodedata.unidata_version}) by",
        "// apps/core/tools/gen_unicode_tables.py; do not edit. Regenerate with:",
        "//   python3 apps/core/tools/gen_unicode_tables.py",
        "// The tokenizer's \\p{L}, \\p{N} and \\s (Oniguruma's \\s: U+0009..U+000D, U+0085, Zs,",
        "// Zl, Zp) as sorted, disjoint, inclusive code point ranges {first, last}.",
    ]
    for name, member in CLASSES.items():
        spans = ranges(member)
        lines.append("")
        lines.append(f"constexpr CodepointRange {name}[] = {{")
        row = []
        for first, last in spans:
            row.append(f"{{0x{first:X}, 0x{last:X}}},")
            if len(row) == 6:
                lines.append("    " + " ".join(row))
                row = []
        if row:
            lines.append("    " + " ".join(row))
        lines.append("};")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
