"""A deterministic mixed-text corpus for tokenizer comparisons.

Every line is generated here from a seed, except the Python lines, which are windows of this
interpreter's standard-library sources (PSF-2.0). The prose, C code and Unicode phrases are written
for this file. The committed fixtures store the lines themselves, so a different interpreter
changes only what a regenerated fixture holds, never what a test compares.
"""

from __future__ import annotations

import random
import sysconfig
import unicodedata
from collections.abc import Callable
from pathlib import Path

_SUBJECTS = [
    "The engineer",
    "A small robot",
    "My neighbour",
    "The old ferry",
    "Every parser",
    "Our team",
    "She",
    "The cache",
    "This scheduler",
    "A quiet river",
    "Nobody",
    "I",
]
_VERBS = [
    "quietly rebuilt",
    "never finished",
    "counted",
    "carried",
    "didn't notice",
    "measured",
    "won't forget",
    "shared",
    "re-read",
    "painted",
    "can't explain",
    "evicted",
]
_OBJECTS = [
    "the bridge",
    "three hundred lanterns",
    "every page of the manual",
    "a blue kettle",
    "the last block",
    "its own shadow",
    "the prefix tree",
    "forty-two apples",
    "the morning train",
    "what we'd planned",
    "the Kalman filter",
    "an UPPERCASE NOTICE",
]
_ENDINGS = [".", "!", "?", "...", ";", " -- really.", " (again).", ", didn't it?", ":", "!!"]
_OPENERS = [
    "",
    "",
    "Yesterday, ",
    "In 2026 ",
    "Honestly, ",
    '"Well," she said, ',
    "However ",
    "At 07:45 ",
    "If it's late, ",
    "O'Brien's note: ",
    "They'll say ",
    "WE'VE seen ",
]

_C_SNIPPETS = [
    "int main(int argc, char **argv) {\n    return argc > 1 ? atoi(argv[1]) : 0;\n}",
    "for (size_t i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}",
    "#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))",
    "static inline uint32_t rotl(uint32_t x, int k) { return (x << k) | (x >> (32 - k)); }",
    'if (ptr == NULL && errno != 0) { perror("malloc"); exit(EXIT_FAILURE); }',
    "struct node { struct node *next; void *data; };",
    "while (*s != '\\0') s++;  /* find the end */",
    'printf("%d items, %.2f%% done\\n", count, 100.0 * done / total);',
    "x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33;",
    "switch (c) {\n  case 'a': case 'b':\n    break;\n  default:\n    return -1;\n}",
]

_UNICODE = [
    "Crème brûlée à la française, naïve café résumé.",
    "Ça va? Où êtes-vous? Élodie répond.",
    "Ñandú, pingüino, señor, año.",
    "Straße, Größe, Übermut, ÄÖÜ.",
    "我们今天去公园散步。",
    "東京でラーメンを食べました。",
    "カタカナとひらがな、漢字。",
    "안녕하세요, 반갑습니다.",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם, מה שלומך?",
    "Привет, как дела? Всё хорошо.",
    "Καλημέρα κόσμε.",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "สวัสดีครับ ยินดีต้อนรับ",
    "Tiếng Việt có dấu: Hà Nội, Đà Nẵng.",
    "👩‍👩‍👧‍👦 family, 🇫🇷 flag, 👍🏽 thumbs, 😀🎉🚀 party",
    "∑ x² ≤ ∞, ∀ε>0 ∃δ, √2 ≈ 1.414",
    "e\u0301 vs é, a\u0300\u0301\u0302\u0303 stacked, Z\u0336a\u0337l\u0338g\u0335o",
    "mixed: English العربية English עברית 123",
    "½ ¾ ™ © ® § ¶ † ‡ • … ‰ € £ ¥ ₹",
    "\u200b zero\u200dwidth \ufeff bom \u00a0nbsp \u3000ideographic",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𐍈 𓀀 🜁",
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３",
]

_SPECIAL = [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "text <|im_end|> more text",
    "<|im_start|><|im_start|>",
    "partial <|im_start and <|im_end|>>",
    "<<|endoftext|>>",
    " <|endoftext|> ",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>starts with bos",
    "ends with eos<eos>",
    "<pad><pad> padded",
    "<unk> and <mask>",
    "<unused3> reserved",
    "[multimodal] tag",
    "<start_of_image> an image <end_of_image>",
    "<repo_name>kvserve<file_sep>main.py",
    "<filename>x.py\n<gh_stars>10",
    "a\n\n\nb\n\n\n\n\nc",
    "tab\tand\t\ttabs\t\t\t\tend",
    "<im_start> not special",
]


def _prose(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(1, 3)):
        sentence = (
            f"{rng.choice(_OPENERS)}{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
            f"{rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        )
        sentences.append(sentence)
    return " ".join(sentences)


def _whitespace(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(1, 5)):
        run = rng.choice([" ", "\t", "\n", "\r\n", "\u00a0", "  "]) * rng.randint(1, 33)
        pieces.append(run + rng.choice(["word", "x", "", "if", "{", "Zeta", "42", "é"]))
    return "".join(pieces) + rng.choice(["", " ", "\n", "   "])


def _digits(rng: random.Random) -> str:
    forms = [
        lambda: str(rng.randint(0, 10 ** rng.randint(1, 15))),
        lambda: f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 6)}f}",
        lambda: f"{rng.randint(1, 9_999_999):,}",
        lambda: f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        lambda: f"0x{rng.getrandbits(32):08x}",
        lambda: f"+1 ({rng.randint(200, 999)}) {rng.randint(100, 999)}-{rng.randint(0, 9999):04d}",
        lambda: f"v{rng.randint(0, 9)}.{rng.randint(0, 99)}.{rng.randint(0, 999)}",
        lambda: (
            f"{rng.randint(1, 99)}% of {rng.randint(100, 100000)} items cost ${rng.randint(1, 999)}.{rng.randint(0, 99):02d}"
        ),
    ]
    return " ".join(rng.choice(forms)() for _ in range(rng.randint(1, 4)))


def _unicode(rng: random.Random) -> str:
    line = rng.choice(_UNICODE)
    return unicodedata.normalize(rng.choice(["NFC", "NFC", "NFD", "NFKC"]), line)


def _c_code(rng: random.Random) -> str:
    return rng.choice(_C_SNIPPETS)


def _special(rng: random.Random) -> str:
    return rng.choice(_SPECIAL)


def _python_lines(limit_files: int = 12) -> list[str]:
    """Source lines of a fixed list of standard-library modules, blank lines dropped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = [
        "textwrap.py",
        "json/decoder.py",
        "heapq.py",
        "bisect.py",
        "string.py",
        "shlex.py",
        "fnmatch.py",
        "colorsys.py",
        "difflib.py",
        "csv.py",
        "statistics.py",
        "argparse.py",
    ]
    lines: list[str] = []
    for name in names[:limit_files]:
        path = stdlib / name
        if path.exists():
            lines.extend(
                line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
            )
    return lines


def corpus_lines(num_lines: int = 2400, seed: int = 0) -> list[str]:
    """`num_lines` distinct lines mixing prose, code, whitespace, digits, Unicode and special tokens."""
    rng = random.Random(seed)
    python = _python_lines()

    def python_window(rng: random.Random) -> str:
        start = rng.randrange(len(python))
        return "\n".join(python[start : start + rng.randint(1, 4)])

    kinds: list[Callable[[random.Random], str]] = [
        _prose,
        _prose,
        _prose,
        _whitespace,
        _digits,
        _unicode,
        _c_code,
        _special,
    ]
    if python:
        kinds += [python_window, python_window]
    lines: list[str] = []
    seen: set[str] = set()
    while len(lines) < num_lines:
        if rng.random() < 0.25:  # a mixture of kinds in one line
            line = rng.choice([" ", "", "\n", "\t"]).join(rng.choice(kinds)(rng) for _ in range(3))
        else:
            line = rng.choice(kinds)(rng)
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return lines
