"""The distillation corpus: existing open-licence text as token ids, kept in git.

The head learns from the target's distribution over text the target merely reads (one teacher-forced pass), so
its data needs no generation: documentation, source code, docstrings turned into dialogues, and prose shipped by
packages on this machine. Each document (or piece of one) becomes one chat exchange in the target's template:
a templated user request, the text as the assistant's reply; exchanges are packed back to back into sequences of
exactly ``seq_len`` tokens (a piece that does not fit continues in the next sequence as a new exchange), so a
teacher pass has no padding. The reply spans are stored beside the ids: anchors are drawn inside them only.

On disk, per source, under ``root/<source>/``:
  ``shard_NNNN.npz.xz``: an lzma-compressed ``.npz`` of ``ids`` [n, seq_len] uint16 and ``spans`` [m, 3] int32
  (row, first reply token, the reply's end-of-turn token, inclusive);
  ``heldout.npz.xz``: the same, sequences never trained on (the learning curve reads them);
  ``manifest.json``: source, licence, description, tokenizer, sha256 and token counts of every file.
Documents sharing a 13-word span with ``benchmarks/data/`` are dropped before packing.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import json
import lzma
import random
import re
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

from dspark.jsonl import read_jsonl
from dspark.training.dataset import _ngrams

SEQ_LEN = 512
SHARD_SEQUENCES = 2048  # 1M tokens a shard, about 1.4 MB compressed
HELDOUT_SEQUENCES = 8
MAX_PIECE_TOKENS = 1536  # a longer document is cut into pieces, each its own exchange
MAX_PROMPT_CHARS = 600  # a longer request is cut (with ' ...')


@dataclass(frozen=True)
class Document:
    prompt: str  # the user's turn
    text: str  # the assistant's reply: the text itself
    # already tokenized (the target's own responses): the prompt in the chat template, ready for the reply, and the
    # reply's ids as the target wrote them (no end of turn); prompt / text are then their decoded forms
    ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclass(frozen=True)
class Source:
    name: str
    licence: str
    description: str
    kind: str  # code / docs / prose / chat / maths
    documents: Callable[[random.Random], Iterator[Document]] = field(repr=False)


# ---------------------------------------------------------------------------------------------- document sources

_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip", "pydoc_data",
                "__pycache__", "config-3.11-x86_64-linux-gnu", "tkinter"}

_CODE_PROMPTS = ["Show me the source code of the Python module `{module}`.",
                 "Write the Python module `{module}`.",
                 "Can you print the implementation of `{module}`?",
                 "I need the code of `{module}` from {package}. Please write it out.",
                 "Write the file `{path}` of {package}."]
_DOC_PROMPTS = ["Explain {topic}.", "Write documentation for {topic}.", "Tell me about {topic}.",
                "Give me an overview of {topic}.", "What should I know about {topic}?",
                "Write the README for {topic}."]
_CONTINUE = "Continue."


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _python_files(root: Path, skip: set[str]) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & skip))


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or root.name


def stdlib_code(rng: random.Random) -> Iterator[Document]:
    root = _stdlib_dir()
    for path in _python_files(root, _STDLIB_SKIP):
        text = path.read_text(errors="replace")
        if text.strip():
            module = _module_name(root, path)
            prompt = rng.choice(_CODE_PROMPTS).format(module=module, package="the Python standard library",
                                                      path=str(path.relative_to(root)))
            yield Document(prompt, f"```python\n{text.strip()}\n```")


def _docstring_dialogues(root: Path, files: list[Path], package: str, rng: random.Random) -> Iterator[Document]:
    """Functions and classes with a docstring as dialogues: what does it do (the docstring), write it (the code)."""
    for path in files:
        try:
            text = path.read_text(errors="replace")
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        module = _module_name(root, path)
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 80:
                continue
            name = f"{module}.{node.name}"
            if rng.random() < 0.5:
                summary = doc.strip().split("\n\n")[0].replace("\n", " ")
                source = "\n".join(lines[node.lineno - 1 - len(node.decorator_list): node.end_lineno])
                yield Document(f"Write `{node.name}` ({package}, module `{module}`): {summary}",
                               f"Here is an implementation:\n\n```python\n{source}\n```")
            else:
                question = rng.choice(["What does `{n}` do?", "Explain `{n}` from {p}.",
                                       "How do I use `{n}`?", "Describe the {k} `{n}`."])
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                yield Document(question.format(n=name, p=package, k=kind),
                               f"`{name}` is a {kind} in {package}.\n\n{doc.strip()}")


def stdlib_docstrings(rng: random.Random) -> Iterator[Document]:
    root = _stdlib_dir()
    yield from _docstring_dialogues(root, _python_files(root, _STDLIB_SKIP), "the Python standard library", rng)


def _dist_licence(dist: metadata.Distribution) -> str:
    meta = dist.metadata
    expr = meta.get("License-Expression")
    if expr:
        return expr
    classifiers = [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or [])
                   if c.startswith("License ::")]
    if classifiers:
        return " / ".join(classifiers)
    raw = (meta.get("License") or "").strip().splitlines()
    return raw[0][:60] if raw else "unknown"


_PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC|Zlib|Unlicense|MPL|HPND|0BSD)\b",
                         re.IGNORECASE)


def _distributions() -> list[metadata.Distribution]:
    seen, out = set(), []
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name and name not in seen and name not in ("dspark-ray",):
            seen.add(name)
            out.append(dist)
    return sorted(out, key=lambda d: d.metadata["Name"].lower())


def package_docs(rng: random.Random) -> Iterator[Document]:
    """Installed packages' READMEs (the long description in their metadata) and the Markdown / reStructuredText
    files they ship, for permissively licensed packages only."""
    for dist in _distributions():
        if not _PERMISSIVE.search(_dist_licence(dist)):
            continue
        name = dist.metadata["Name"]
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if len(body) > 400:
            yield Document(rng.choice(_DOC_PROMPTS).format(topic=f"the Python package {name}"), body.strip())
        for file in dist.files or ():
            if file.suffix in (".md", ".rst") and "license" not in file.name.lower():
                try:
                    text = Path(file.locate()).read_text(errors="replace")
                except OSError:
                    continue
                if len(text) > 400:
                    topic = f"{file.stem.replace('_', ' ')} in {name}"
                    yield Document(rng.choice(_DOC_PROMPTS).format(topic=topic), text.strip())


CODE_PACKAGES = ("numpy", "sympy", "networkx", "mpmath", "jinja2", "click", "pydantic", "fastapi", "starlette",
                 "httpx", "attrs", "transformers", "torch", "requests", "rich", "tqdm", "yaml", "jsonschema",
                 "matplotlib", "aiohttp")


def _package_roots() -> list[tuple[str, Path, str]]:
    """(import name, folder, licence) of the permissively licensed ``CODE_PACKAGES`` installed here."""
    site = Path(sysconfig.get_paths()["purelib"])
    out = []
    for dist in _distributions():
        licence = _dist_licence(dist)
        top = (dist.read_text("top_level.txt") or "").split() or [dist.metadata["Name"].replace("-", "_")]
        for name in top:
            if name.lower() in CODE_PACKAGES and (site / name).is_dir() and _PERMISSIVE.search(licence):
                out.append((name, site / name, licence))
    return out


def package_code(rng: random.Random) -> Iterator[Document]:
    for name, root, _ in _package_roots():
        for path in _python_files(root, {"tests", "test", "testing", "_vendor", "benchmarks", "__pycache__"}):
            text = path.read_text(errors="replace")
            if 200 < len(text) < 200_000:
                module = f"{name}.{_module_name(root, path)}" if path.name != "__init__.py" or \
                    path.parent != root else name
                prompt = rng.choice(_CODE_PROMPTS).format(module=module, package=name,
                                                          path=str(path.relative_to(root.parent)))
                yield Document(prompt, f"```python\n{text.strip()}\n```")


def package_docstrings(rng: random.Random) -> Iterator[Document]:
    for name, root, _ in _package_roots():
        files = _python_files(root, {"tests", "test", "testing", "_vendor", "__pycache__"})
        yield from _docstring_dialogues(root, files, name, rng)


def package_licences() -> str:
    return "; ".join(sorted({f"{name}: {licence}" for name, _, licence in _package_roots()}))


def debian_package(package: str) -> Path:
    """The files of Debian package ``package``, unpacked (not installed) under the cache: ``apt-get download`` then
    ``dpkg -x`` (no root, no dependencies; run ``apt-get update`` once on a fresh machine)."""
    import os
    import subprocess
    import tempfile

    root = Path(os.path.expandvars(os.environ.get("DSPARK_CACHE", "~/.cache/dspark"))).expanduser()
    out = root / "debian" / package
    if not (out / ".unpacked").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            got = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)
            debs = list(Path(tmp).glob("*.deb"))
            if got.returncode != 0 or not debs:
                raise RuntimeError(f"apt-get download {package} failed ({got.stderr.strip()[-300:]}); run "
                                   "`apt-get update` once and retry")
            out.mkdir(parents=True, exist_ok=True)
            subprocess.run(["dpkg", "-x", str(debs[0]), str(out)], check=True)
        (out / ".unpacked").write_text(package + "\n")
    return out


def _rst_title(text: str, fallback: str) -> str:
    lines = [line.strip() for line in text.splitlines()[:12]]
    for i, line in enumerate(lines[:-1]):
        if line and lines[i + 1] and set(lines[i + 1]) <= set("=-~*#^") and len(lines[i + 1]) >= len(line) - 2 \
                and not set(line) <= set("=-~*#^"):
            return line.strip("`:*")
    return fallback


def python_docs(rng: random.Random) -> Iterator[Document]:
    """Python 3.11's documentation (tutorial, library reference, HOWTOs, FAQ) in its reStructuredText sources."""
    root = debian_package("python3.11-doc") / "usr/share/doc/python3.11/html/_sources"
    for path in sorted(root.rglob("*.rst.txt")):
        text = path.read_text(errors="replace")
        if len(text) > 400:
            topic = _rst_title(text, path.name.removesuffix(".rst.txt").replace("_", " "))
            yield Document(rng.choice(_DOC_PROMPTS).format(topic=f"{topic} (Python documentation)"), text.strip())


def linux_docs(rng: random.Random) -> Iterator[Document]:
    """The Linux kernel's documentation (English reStructuredText; its translations and HTML copy left out)."""
    import gzip

    root = debian_package("linux-doc-6.1") / "usr/share/doc/linux-doc-6.1/Documentation"
    for path in sorted(root.rglob("*.rst.gz")):
        if {"translations", "html"} & set(path.relative_to(root).parts):
            continue
        text = gzip.decompress(path.read_bytes()).decode(errors="replace")
        if len(text) > 400:
            topic = _rst_title(text, path.name.removesuffix(".rst.gz").replace("-", " "))
            yield Document(rng.choice(_DOC_PROMPTS).format(topic=f"{topic} (Linux kernel)"), text.strip())


def vim_docs(rng: random.Random) -> Iterator[Document]:
    """Vim's user manual and reference (its help files)."""
    root = debian_package("vim-runtime") / "usr/share/vim"
    for path in sorted(root.glob("vim*/doc/*.txt")):
        text = path.read_text(errors="replace")
        if len(text) > 400:
            first = text.splitlines()[0]
            topic = re.sub(r"\*[^*]+\*|For Vim version.*|Last change.*", "", first).strip() or path.stem
            yield Document(rng.choice(_DOC_PROMPTS).format(topic=f"{topic} (Vim help)"), text.strip())


DATA_ROOT = Path(__file__).resolve().parents[2] / "training" / "data"
RESPONSES_ARCHIVE = "responses.jsonl.xz"  # in <root>/target-responses/: every reply's ids, kept in git


def responses_file() -> Path:
    """Where ``dspark corpus respond`` writes the target's responses (outside git; the corpus keeps their ids, and
    ``<root>/target-responses/responses.jsonl.xz`` the whole file, so that a fresh machine continues it)."""
    import os

    root = Path(os.path.expandvars(os.environ.get("DSPARK_CACHE", "~/.cache/dspark"))).expanduser()
    return root / "train" / "responses" / "responses.jsonl"


def restore_responses(root: Path = DATA_ROOT) -> bool:
    """On a machine without the responses file (a fresh one), start it from the committed archive: ``respond``
    then skips the prompts answered in earlier sessions and ``build`` packs them all. True if restored."""
    out, archive = responses_file(), root / "target-responses" / RESPONSES_ARCHIVE
    if out.is_file() or not archive.is_file():
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(lzma.decompress(archive.read_bytes()))
    return True


def archive_responses(root: Path = DATA_ROOT) -> dict | None:
    """The responses file, xz-compressed beside the target-responses shards (its sha256 goes in their manifest)."""
    path = responses_file()
    if not path.is_file():
        return None
    data = path.read_bytes()
    data = data[: data.rfind(b"\n") + 1]  # complete rows only
    archive = root / "target-responses" / RESPONSES_ARCHIVE
    archive.parent.mkdir(parents=True, exist_ok=True)
    packed = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
    archive.write_bytes(packed)
    return {"file": RESPONSES_ARCHIVE, "sha256": hashlib.sha256(packed).hexdigest(), "rows": data.count(b"\n")}


def target_responses(rng: random.Random) -> Iterator[Document]:
    """The target's own replies to the training prompt mix (``dspark corpus respond``: vLLM, batched, half greedy
    and half T=1 / top-p 0.95), ids as it wrote them: the served kind of text."""
    from dspark.loader import load_tokenizer
    from dspark.training.dataset import read_rows

    path = responses_file()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: run `dspark corpus respond` first")
    tokenizer = load_tokenizer(_target_dir())
    eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    for row in read_rows(path):
        reply = list(row["response_ids"])
        while reply and reply[-1] in eos:
            reply.pop()
        if reply and len(row["prompt_ids"]) <= SEQ_LEN // 2:  # a longer prompt would crowd its reply out
            yield Document(tokenizer.decode(row["prompt_ids"]), tokenizer.decode(reply),
                           ids=(tuple(row["prompt_ids"]), tuple(reply)))


def _target_dir() -> Path:
    import os

    return Path(os.path.expandvars(os.environ.get("DSPARK_CACHE", "~/.cache/dspark"))).expanduser() / \
        "smollm2-135m-instruct"


SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("python-stdlib-code", "PSF-2.0", "The Python 3.11 standard library's modules (tests, IDLE, tkinter, "
                                           "lib2to3 left out), each as a request for the module and its source.",
           "code", stdlib_code),
    Source("python-stdlib-dialogues", "PSF-2.0", "Functions and classes of the standard library with a docstring: "
                                                "'what does X do' answered by its docstring, 'write X' by its code.",
           "chat", stdlib_docstrings),
    Source("package-docs",
           "each package's own permissive licence (MIT, BSD, Apache-2.0, PSF, ISC or MPL: packages under any other "
           "are skipped)",
           "READMEs and Markdown/reStructuredText files of the permissively licensed Python packages installed by "
           "`make install`.", "docs", package_docs),
    Source("package-code", "BSD-3-Clause / MIT / Apache-2.0 (per package in the manifest)",
           "Modules of numpy, sympy, networkx, mpmath, jinja2, click, pydantic, transformers, torch and other "
           "permissively licensed packages installed by `make install` (tests and vendored code left out).",
           "code", package_code),
    Source("package-dialogues", "BSD-3-Clause / MIT / Apache-2.0 (per package in the manifest)",
           "Docstring dialogues (as python-stdlib-dialogues) over the same packages as package-code.",
           "chat", package_docstrings),
    Source("python-docs", "PSF-2.0", "Python 3.11's documentation: tutorial, library reference, language "
                                     "reference, HOWTOs, FAQ (Debian python3.11-doc, its reStructuredText "
                                     "sources).", "docs", python_docs),
    Source("linux-docs", "GPL-2.0", "The Linux 6.1 kernel's documentation in English (Debian linux-doc-6.1, "
                                    "reStructuredText; translations and the HTML copy left out).", "docs",
           linux_docs),
    Source("target-responses", "Apache-2.0 (SmolLM2-135M-Instruct's outputs; prompts built here from PSF/BSD/MIT "
                               "sources and templates)",
           "The target's own replies (vLLM, batched, half greedy, half T=1 / top-p 0.95) to the decontaminated "
           "training prompt mix of dspark.training.dataset.build_prompts.", "chat", target_responses),
    Source("vim-docs", "Vim licence (charityware, GPL-compatible)", "Vim 9.0's user manual and reference help "
                                                                     "files (Debian vim-runtime).", "docs", vim_docs),
)}


# ------------------------------------------------------------------------------------------------ packing, shards

def banned_spans(benchmarks_dir: Path) -> set[tuple[str, ...]]:
    banned: set[tuple[str, ...]] = set()
    for path in sorted(benchmarks_dir.glob("*.jsonl")):
        for row in read_jsonl(path):
            for turn in row["turns"]:
                banned |= _ngrams(turn)
    return banned


def contaminated(text: str, banned: set[tuple[str, ...]]) -> bool:
    words = re.findall(r"\w+", text.lower())
    return any(tuple(words[i: i + 13]) in banned for i in range(len(words) - 12))


class Packer:
    """Chat exchanges packed back to back into rows of exactly ``seq_len`` tokens."""

    def __init__(self, tokenizer, seq_len: int = SEQ_LEN):
        from dspark.loader import encode_chat

        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.header = functools.lru_cache(maxsize=4096)(
            lambda prompt: tuple(encode_chat(tokenizer, [{"role": "user", "content": prompt}])))
        self.end = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)  # end of turn + newline
        self.rows: list[list[int]] = []
        self.spans: list[tuple[int, int, int]] = []
        self.current: list[int] = []
        self.content_tokens = 0

    def add(self, doc: Document) -> None:
        if doc.ids is not None:
            head, body = list(doc.ids[0]), list(doc.ids[1])
        else:
            prompt = doc.prompt if len(doc.prompt) <= MAX_PROMPT_CHARS else \
                doc.prompt[:MAX_PROMPT_CHARS].rsplit(" ", 1)[0] + " ..."
            head = list(self.header(prompt))
            body = self.tokenizer.encode(doc.text, add_special_tokens=False, split_special_tokens=True)
        for first in range(0, len(body), MAX_PIECE_TOKENS):
            self._add_piece(head if first == 0 else list(self.header(_CONTINUE)), body[first: first + MAX_PIECE_TOKENS])

    def _add_piece(self, head: list[int], body: list[int]) -> None:
        while body:
            room = self.seq_len - len(self.current) - len(head) - len(self.end)
            if room < 16:  # not worth an exchange: the rest of the row is the next exchange's start
                if not self.current:
                    raise ValueError(f"a {len(head)}-token request leaves no room in a {self.seq_len}-token row")
                self._close_row(fill=True)
                continue
            piece, body = body[:room], body[room:]
            start = len(self.current) + len(head)
            self.current += head + piece + self.end
            self.spans.append((len(self.rows), start, start + len(piece)))  # the end-of-turn token, inclusive
            self.content_tokens += len(piece)
            head = list(self.header(_CONTINUE))
            if len(self.current) >= self.seq_len - 16:
                self._close_row(fill=True)

    def _close_row(self, fill: bool) -> None:
        if not self.current:
            return
        if fill and len(self.current) < self.seq_len:  # the few tokens left: a newline run (read, never anchored)
            self.current += self.tokenizer.encode("\n", add_special_tokens=False) * (self.seq_len - len(self.current))
        self.rows.append(self.current[: self.seq_len])
        self.current = []

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``count`` complete rows and their spans (renumbered), removed from the packer."""
        ids = np.asarray(self.rows[:count], dtype=np.uint16).reshape(-1, self.seq_len)
        spans = np.asarray([(r, a, b) for r, a, b in self.spans if r < count], dtype=np.int32).reshape(-1, 3)
        self.rows = self.rows[count:]
        self.spans = [(r - count, a, b) for r, a, b in self.spans if r >= count]
        return ids, spans


def write_shard(path: Path, ids: np.ndarray, spans: np.ndarray) -> dict:
    buffer = io.BytesIO()
    np.savez(buffer, ids=ids, spans=spans)
    data = lzma.compress(buffer.getvalue(), preset=6)
    path.write_bytes(data)
    content = int((spans[:, 2] - spans[:, 1]).sum()) if len(spans) else 0
    return {"file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "sequences": int(len(ids)),
            "tokens": int(ids.size), "reply_tokens": content, "bytes": len(data)}


def read_shard(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(io.BytesIO(lzma.decompress(path.read_bytes()))) as data:
        return data["ids"], data["spans"]


def build_source(source: Source, tokenizer, root: Path, benchmarks_dir: Path, *, seed: int = 0,
                 max_tokens: int | None = None, seq_len: int = SEQ_LEN, shard_sequences: int = SHARD_SEQUENCES,
                 heldout_sequences: int = HELDOUT_SEQUENCES, log=print) -> dict:
    """Write ``root/<source>/``: shuffled documents, decontaminated, packed, sharded; returns the manifest."""
    out = root / source.name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.npz.xz"):
        old.unlink()
    rng = random.Random(f"{seed}-{source.name}")
    documents = list(source.documents(rng))
    rng.shuffle(documents)
    banned = banned_spans(benchmarks_dir)
    packer = Packer(tokenizer, seq_len)
    kept = dropped = 0
    shards: list[dict] = []
    heldout = None
    for doc in documents:
        if contaminated(doc.prompt + "\n" + doc.text, banned):
            dropped += 1
            continue
        packer.add(doc)
        kept += 1
        if heldout is None and len(packer.rows) >= heldout_sequences:
            heldout = write_shard(out / "heldout.npz.xz", *packer.take(heldout_sequences))
        while heldout is not None and len(packer.rows) >= shard_sequences:
            shards.append(write_shard(out / f"shard_{len(shards):04d}.npz.xz", *packer.take(shard_sequences)))
            log(f"[corpus] {source.name}: shard {len(shards)} ({kept} documents)")
        if max_tokens is not None and sum(s["tokens"] for s in shards) >= max_tokens:
            break
    packer._close_row(fill=True)
    if heldout is None:
        heldout = write_shard(out / "heldout.npz.xz", *packer.take(min(heldout_sequences, len(packer.rows) // 2)))
    if packer.rows:
        shards.append(write_shard(out / f"shard_{len(shards):04d}.npz.xz", *packer.take(len(packer.rows))))
    manifest = {"source": source.name, "licence": source.licence, "kind": source.kind,
                "description": source.description, "tokenizer": "SmolLM2-135M-Instruct", "seq_len": seq_len,
                "documents": kept, "dropped_contaminated": dropped, "seed": seed,
                "tokens": sum(s["tokens"] for s in shards), "reply_tokens": sum(s["reply_tokens"] for s in shards),
                "heldout": heldout, "shards": shards}
    if source.name.startswith("package-") and source.name != "package-docs":
        manifest["package_licences"] = package_licences()
    if source.name == "target-responses":  # the replies themselves, for the next machine's respond and build
        manifest["responses"] = archive_responses(root)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"[corpus] {source.name}: {manifest['tokens']} tokens in {len(shards)} shards, {kept} documents, "
        f"{dropped} dropped as contaminated")
    return manifest


def verify(root: Path) -> list[str]:
    """Files whose sha256 differs from their manifest's (empty: all intact)."""
    bad = []
    for manifest_path in sorted(root.glob("*/manifest.json")):
        manifest = json.loads(manifest_path.read_text())
        for entry in [manifest["heldout"], *manifest["shards"], *filter(None, [manifest.get("responses")])]:
            path = manifest_path.parent / entry["file"]
            if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
                bad.append(str(path))
    return bad



# Tokens kept of each source (None: all): the code share is capped so docs, dialogues and prose weigh in.
CAPS = {"package-code": 5_000_000, "package-dialogues": 8_000_000}


def main(argv: list[str] | None = None) -> int:
    """``dspark corpus build|verify``: (re)build sources of the corpus, or check every file against its manifest."""
    import argparse

    from dspark.evaluation.prompt_sets import PROMPT_SETS_DIR
    from dspark.loader import load_tokenizer

    ap = argparse.ArgumentParser(prog="dspark corpus", description=main.__doc__)
    ap.add_argument("action", choices=("build", "verify", "respond"),
                    help="respond: the target's replies to the training prompt mix (vLLM), for target-responses")
    ap.add_argument("--prompts", type=int, default=16000, help="respond: prompts in the mix")
    ap.add_argument("--max-tokens", type=int, default=256, help="respond: reply length cap")
    ap.add_argument("--time-budget", type=float, default=None, help="respond: stop after this many seconds "
                                                                    "(resumable: prompts with a row are skipped)")
    ap.add_argument("--root", type=Path, default=DATA_ROOT)
    ap.add_argument("--source", action="append", choices=sorted(SOURCES), help="sources to build (default: all)")
    ap.add_argument("--target", default="${DSPARK_CACHE}/smollm2-135m-instruct", help="whose tokenizer")
    args = ap.parse_args(argv)
    if args.action == "verify":
        bad = verify(args.root)
        print("\n".join(bad) if bad else f"{args.root}: every file matches its manifest")
        return 1 if bad else 0
    building = (args.source or sorted(SOURCES)) if args.action == "build" else []
    if args.action == "respond" or "target-responses" in building:
        restore_responses(args.root)  # a fresh machine: continue from the replies committed before
    if args.action == "respond":
        return respond(args.prompts, args.max_tokens, args.time_budget)
    import os

    target = Path(os.path.expandvars(args.target.replace("${DSPARK_CACHE}", os.environ.get(
        "DSPARK_CACHE", str(Path("~/.cache/dspark").expanduser())))))
    tokenizer = load_tokenizer(target)
    for name in args.source or sorted(SOURCES):
        build_source(SOURCES[name], tokenizer, args.root, PROMPT_SETS_DIR, max_tokens=CAPS.get(name))
    return 0


def respond(prompts: int, max_tokens: int, time_budget_s: float | None, batch: int = 128) -> int:
    """The target's replies (vLLM in the served default's dtype, ``batch`` at a time) to the first ``prompts`` of
    the decontaminated training mix, appended to :func:`responses_file` (resumable)."""
    from dspark.evaluation.prompt_sets import PROMPT_SETS_DIR
    from dspark.loader import load_tokenizer
    from dspark.training.dataset import build_prompts, decontaminate, generate_responses
    from dspark.training.recipe import DataSpec, response_engine, with_machine_dtypes_of

    data = with_machine_dtypes_of(DataSpec(engine="vllm", dtype="auto", cache_dtype="auto", batch=batch))
    tokenizer = load_tokenizer(_target_dir())
    engine = response_engine(data, None, _target_dir(), tokenizer)
    out = responses_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tokens = generate_responses(engine, tokenizer, decontaminate(build_prompts(prompts), PROMPT_SETS_DIR), out,
                                    max_tokens, time_budget_s=time_budget_s)
    finally:
        engine.shutdown()
    print(f"[respond] {tokens} new response tokens -> {out}")
    return 0
