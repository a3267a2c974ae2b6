"""Text corpus -> tokenizer -> packed token shards on disk -> deterministic, resumable batches.

The corpus is a sorted list of text files (by default this Python's own standard-library source). Each
file is one document (each line of a JSON Lines file, .jsonl, is one: its "text" field, or its "prompt" and
"completion", whose prompt tokens count in no loss: a mask shard beside the token shards marks them); documents are
tokenized, joined with an end-of-text token after each, and the stream is written once as raw shards plus a
manifest under a cache folder named by a hash of (corpus content, tokenizer, shard size).
Later runs memory-map the shards and never tokenize again.

Samples are fixed windows of that stream: sample i of a split is its tokens [i*L, i*L + L + 1) with
L = seq_len, so inputs are the first L tokens and targets the last L. Neighbouring samples share one token
(the last target of one is the first input of the next), and windows may cross shard files. Validation is
the tail of the stream, training the head; no token belongs to both.

The loader is a pure function of (seed, epoch, step): every optimizer step reads one contiguous run of a
per-epoch permutation, and data-parallel ranks cut that run into equal contiguous slices. Its position is
therefore two integers (epoch, step in it), and any layout with the same global batch can resume from it; its
state also holds the seed, the global batch and the sample count, which a resume checks.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from shardwise.config import ConfigError, DataConfig, JobConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shardwise.data")

FORMAT_VERSION = 1
"""Bumped whenever the cache layout or the packing rule changes, so old caches are not trusted."""
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>")
"""End-of-text tokens looked up, in this order, in a tokenizer.json."""
TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".jsonl"})
"""File endings read from folders in data.paths (plus files with no ending that hold no NUL byte)."""
JSONL_SUFFIX = ".jsonl"
"""A file with this ending holds one JSON object per line, each a document (torchtune's and `datasets`' JSON Lines)."""
JSONL_FIELD = "text"
"""The field of a JSON Lines record that holds its text."""
PROMPT_FIELDS = ("prompt", "completion")
"""The fields of a JSON Lines record that is a prompt and its completion (TRL's prompt-completion format): the loss
counts the completion's tokens and the end-of-text after it, not the prompt's (torchtune's train_on_input = False)."""
IGNORE_INDEX = -100
"""The target of a token the loss does not count (a prompt's): F.cross_entropy's ignore_index."""
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
"""Folders of the standard library left out of the default corpus: tests and tools, not library text."""
STDLIB_MAX_FILE_BYTES = 1 << 20
MB = 1 << 20
"""data.max_corpus_mb counts MiB of file bytes."""
DOCS_PER_ENCODE_BATCH = 64


# ---------------------------------------------------------------------------------------------------
# Corpus: which files, in which order


def corpus_files(cfg: DataConfig) -> list[Path]:
    """The corpus as a deterministic list of files, cut to data.max_corpus_mb (whole files, in order).

    Empty data.paths means the standard library's *.py files (tests, idlelib, lib2to3, site-packages and
    files over 1 MiB left out) sorted by path relative to the stdlib folder. Otherwise data.paths are taken
    in the order given: a file is read whatever its ending; a folder is walked recursively, skipping hidden
    names, for files ending in .txt .md .rst .py .jsonl or with no ending and no NUL byte in their first 8 KiB,
    sorted by relative path. A .jsonl file is one document per line (its "text" field, or its "prompt" and
    "completion"), any other file one.
    """
    files = _user_files(cfg.paths) if cfg.paths else _stdlib_files()
    if not files:
        raise ConfigError("data.paths", "no text files found",
                          "point data.paths at .txt/.md/.rst/.py/.jsonl files or folders")
    kept = _within_budget(files, cfg.max_corpus_mb)
    if not kept:
        raise ConfigError(
            "data.max_corpus_mb", f"{cfg.max_corpus_mb} MiB is smaller than the first file {files[0]}",
            "raise data.max_corpus_mb, or 0 for no limit",
        )
    return kept


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for rel in _walk_sorted(root, STDLIB_SKIP_DIRS):
        path = root / rel
        if rel.endswith(".py") and path.stat().st_size <= STDLIB_MAX_FILE_BYTES:
            found.append(path)
    return found


def _user_files(paths: Sequence[str]) -> list[Path]:
    found: dict[Path, None] = {}  # ordered set: a file named twice is read once
    for entry in paths:
        path = Path(entry).expanduser()
        if path.is_file():
            found[path] = None
        elif path.is_dir():
            for rel in _walk_sorted(path, frozenset()):
                if _is_text_file(path / rel):
                    found[path / rel] = None
        else:
            raise ConfigError("data.paths", f"{entry} does not exist", "point data.paths at existing files or folders")
    return list(found)


def _walk_sorted(root: Path, skip_dirs: frozenset[str]) -> list[str]:
    """Relative POSIX paths of the non-hidden files under root, sorted as strings (same on every OS)."""
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip_dirs and not d.startswith(".")]
        rel_folder = Path(folder).relative_to(root)
        out += [(rel_folder / n).as_posix() for n in names if not n.startswith(".")]
    return sorted(out)


def _is_text_file(path: Path) -> bool:
    if path.suffix in TEXT_SUFFIXES:
        return True
    if path.suffix:
        return False
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)  # README, LICENSE... but not a stray binary


def _within_budget(files: list[Path], max_mb: float) -> list[Path]:
    if max_mb == 0:
        return files
    budget, total, kept = int(max_mb * MB), 0, []
    for path in files:
        total += path.stat().st_size
        if total > budget:
            break  # stop at the first file that does not fit, so the corpus is a prefix of the sorted list
        kept.append(path)
    return kept


def corpus_identity(files: list[Path]) -> list[tuple[str, int, str]]:
    """(path relative to the files' common folder, size, sha256) per file: the cache key of the corpus.

    Hashing the content (not mtimes) means a changed file never reuses a stale cache, and the same corpus
    at another location or on another machine hits the same cache. ~16 MiB hash in well under a second.
    """
    base = Path(os.path.commonpath([p.parent for p in files]))
    identity = []
    for path in files:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            identity.append((path.relative_to(base).as_posix(), os.fstat(f.fileno()).st_size, digest))
    return identity


def _read_text(path: Path) -> str:
    """A corpus file's text, as UTF-8. Bytes that are not UTF-8 are read as U+FFFD (three bytes each in the byte
    tokenizer's stream), with a warning naming the file and the first such byte, once per file and process: a
    latin-1 corpus was rewritten so without a word (Hugging Face `datasets` and torchtune refuse such a file)."""
    return _utf8(path.read_bytes(), path)


def _utf8(raw: bytes, path: Path, line: int = 0) -> str:
    """`raw`, the whole of `path` or its `line`, read as _read_text says."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if path not in _NOT_UTF8_WARNED:
            _NOT_UTF8_WARNED.add(path)
            where = f"line {line} byte {e.start}" if line else f"byte {e.start}"
            log.warning("data.paths: %s is not UTF-8 from %s on (%s); its invalid bytes are read as U+FFFD. "
                        "To keep them, convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)", path, where,
                        e.reason)
        return raw.decode("utf-8", errors="replace")


_NOT_UTF8_WARNED: set[Path] = set()
"""Files `_read_text` has warned about in this process (the BPE's training and the packing both read them)."""


Document = str | tuple[str, str]
"""A document's text, or a prompt and its completion."""


def _file_documents(path: Path) -> Iterator[Document]:
    """The documents of one corpus file: its whole text, or for a .jsonl file each line's "text" field, or its
    "prompt" and "completion" (blank lines skipped). Until 2026-12-01 a .jsonl file was read as one document of JSON
    syntax, and skipped in folders."""
    if path.suffix != JSONL_SUFFIX:
        yield _read_text(path)
        return
    fix = (f'give every line a "{JSONL_FIELD}" string, or "{PROMPT_FIELDS[0]}" and "{PROMPT_FIELDS[1]}" strings, or '
           "take the file out of data.paths")
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:  # a line's bytes that are not UTF-8 are read as a text file's are (they were "not JSON")
                record = json.loads(_utf8(line, path, n))
            except ValueError as e:
                raise ConfigError("data.paths", f"{path} line {n} is not JSON ({e})", fix) from None
            record = record if isinstance(record, dict) else {}
            pair = tuple(record.get(key) for key in PROMPT_FIELDS)
            if isinstance(record.get(JSONL_FIELD), str):
                yield record[JSONL_FIELD]
            elif all(isinstance(x, str) for x in pair):
                yield pair
            else:
                raise ConfigError("data.paths", f'{path} line {n} has no "{JSONL_FIELD}" string and no '
                                  f'"{PROMPT_FIELDS[0]}" and "{PROMPT_FIELDS[1]}" strings', fix)


def _documents(files: list[Path]) -> Iterator[Document]:
    for path in files:
        yield from _file_documents(path)


def _texts(files: list[Path]) -> Iterator[str]:
    """Every document's text (a prompt and its completion as the one text they make): what a BPE learns from."""
    for document in _documents(files):
        yield document if isinstance(document, str) else "".join(document)


def _packing_rule(files: list[Path]) -> dict:
    """Part of the cache keys: how files become documents, where it is not one file, one document (so a .jsonl
    file's cache from before its lines were documents is not reused; other corpora keep their keys)."""
    # "prompt": how a prompt and its completion are encoded (see _encoded_documents); caches of "apart" are not this
    return {"jsonl_field": JSONL_FIELD, "prompt": "joint"} if any(p.suffix == JSONL_SUFFIX for p in files) else {}


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer(Protocol):
    vocab_size: int
    """Ids are in [0, vocab_size)."""
    eos_id: int
    """End-of-text id written after every document."""
    name: str
    """Stable identity used in cache keys."""

    def encode(self, text: str) -> list[int] | np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes and 256 is end-of-text: no training, no unknown tokens."""

    vocab_size = 257
    eos_id = 256
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Bytes back to text; end-of-text ids are dropped and broken UTF-8 becomes U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64)
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json (Hugging Face `tokenizers`) behind the Tokenizer protocol."""

    def __init__(self, path: Path, kind: str):
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a file it cannot parse
            raise ConfigError("data.tokenizer", f"{path} is not a tokenizer the `tokenizers` library reads ({e})",
                              "pass a Hugging Face tokenizer.json") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ConfigError("data.tokenizer", f"{path} has an empty vocabulary", "pass a trained tokenizer.json")
        # A literal "<|endoftext|>" written inside a document stays text: only packing inserts eos.
        self._tok.encode_special_tokens = True
        self.eos_id, declared = _find_eos(self._tok, Path(path))
        self.vocab_size = max(vocab.values()) + 1
        self.name = f"{kind}-{hashlib.sha256(Path(path).read_bytes()).hexdigest()}"
        if declared:  # the id comes from beside the file: a cache of another end-of-text id is not this one's
            self.name += f"-eos{self.eos_id}"

    def encode(self, text: str) -> list[int]:
        # No post-processor tokens (e.g. Llama's BOS): the packed stream is documents and eos, nothing else.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """`text` with its special tokens' text as their ids (a chat template's "<|eot_id|>"), as transformers
        encodes a rendered chat; `encode` keeps such text as text."""
        self._tok.encode_special_tokens = False
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = True

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents at once on the library's thread pool; the packing path uses this."""
        # encode_batch_fast (tokenizers >= 0.21) skips computing offsets, which packing never uses.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _find_eos(tok: tokenizers.Tokenizer, path: Path) -> tuple[int, bool]:
    """The end-of-text id packing puts between documents: the first of EOS_NAMES the tokenizer has, else the
    `eos_token` that a tokenizer_config.json beside it declares (a Hugging Face model folder's, as Gemma's `<eos>`);
    and whether it came from that declaration. Until 2026-12-02 only EOS_NAMES were looked up."""
    for name in EOS_NAMES:
        eos = tok.token_to_id(name)
        if eos is not None:
            return eos, False
    declared = _declared_eos(path.parent / "tokenizer_config.json")
    eos = tok.token_to_id(declared) if declared else None
    if eos is not None:
        return eos, True
    raise ConfigError(
        "data.tokenizer", f"the tokenizer.json has none of the end-of-text tokens {', '.join(EOS_NAMES)}"
        + (f", and tokenizer_config.json's eos_token {declared!r} is not in it" if declared else
           ", and no tokenizer_config.json beside it names its eos_token"),
        "put the model's tokenizer_config.json (naming its eos_token) beside the tokenizer.json, or use a tokenizer "
        "that defines one of them",
    )


def _declared_eos(path: Path) -> str | None:
    """tokenizer_config.json's eos_token (a string, or transformers' {"content": ...} form); None without one."""
    try:
        eos = json.loads(path.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) and eos else None


def build_tokenizer(cfg: DataConfig, cache_root: Path) -> Tokenizer:
    """'byte', a BPE trained on the corpus (cached under cache_root/tokenizers), or a tokenizer.json path."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        return HFTokenizer(_trained_bpe(cfg, Path(cache_root)), "bpe")
    path = Path(cfg.tokenizer).expanduser()
    if not path.is_file():
        raise ConfigError("data.tokenizer", f"{cfg.tokenizer!r} is neither 'byte', 'bpe' nor a file",
                          "use 'byte', 'bpe' or the path of a tokenizer.json")
    return HFTokenizer(path, "file")


TOKENIZER_PROBE = ("def f(x):\n    return x ** 2  # the quick brown fox, 1234567890\n\tClass Über_naïve "
                   "{'a': [1, 2]} <tag/> \u4e16\u754c \U0001f600\n")
"""A text that tells tokenizers apart: code, digits, accents, CJK, an emoji (bytes outside any small vocabulary)."""


def check_hf_tokenizer(tokenizer: Tokenizer, data_tokenizer: str, folder: str | os.PathLike) -> None:
    """Refuse a run whose tokenizer gives other ids than the tokenizer.json of its checkpoint.init_from_hf folder:
    the folder's embeddings and head are indexed by that tokenizer's ids. Until 2026-11-28 the default
    data.tokenizer = 'byte' fine-tuned a Hugging Face model on byte ids without a word."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():  # nothing to compare with (a folder saved without its tokenizer)
        return
    theirs = tokenizers.Tokenizer.from_file(str(path))
    vocab = max(theirs.get_vocab(with_added_tokens=True).values()) + 1
    ours = [int(i) for i in tokenizer.encode(TOKENIZER_PROBE)]
    if ours != theirs.encode(TOKENIZER_PROBE, add_special_tokens=False).ids or vocab != tokenizer.vocab_size:
        raise ConfigError("data.tokenizer", f"{data_tokenizer!r} is not the tokenizer of checkpoint.init_from_hf "
                          f"(other ids for the same text), and the folder's embeddings are indexed by its ids",
                          f"set data.tokenizer = '{path}'")


def tokenizer_json(cfg: DataConfig, cache_root: Path) -> str:
    """The run's tokenizer as a Hugging Face tokenizer.json, the same ids for every text: the file itself for
    'bpe' and a path, and for 'byte' a byte-level BPE without merges whose token for byte b has id b, with
    "<|endoftext|>" as 256 (an exported model folder then carries its tokenizer, as `generate --hf` and
    transformers' AutoTokenizer expect)."""
    if cfg.tokenizer != "byte":
        path = _trained_bpe(cfg, Path(cache_root)) if cfg.tokenizer == "bpe" else Path(cfg.tokenizer).expanduser()
        return path.read_text()
    # GPT-2's printable stand-in for each byte (its bytes_to_unicode), which the ByteLevel pre-tokenizer emits
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tok = tokenizers.Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_NAMES[0]])
    return tok.to_str()


RUN_TOKENIZER = "tokenizer.json"
"""A run folder's copy of its tokenizer, written when the run starts: `generate --run` and `export` read it, so that
neither depends on the corpus a 'bpe' was trained on, or a tokenizer.json path, staying as it was. Until 2026-12-01
they rebuilt the tokenizer: a corpus changed since was a BPE of other ids (the text came out as garbage, and the
export carried it), a corpus gone a refusal naming data.paths."""


def _saved_run_tokenizer(cfg: DataConfig, run_dir: str | os.PathLike) -> Path | None:
    """The run's saved tokenizer.json, where it has one and its ids can differ from what cfg builds now (not 'byte')."""
    path = Path(run_dir) / RUN_TOKENIZER
    return path if cfg.tokenizer != "byte" and path.is_file() else None


def run_tokenizer_json(cfg: DataConfig, run_dir: str | os.PathLike) -> str:
    """The tokenizer.json of the run in run_dir: its saved copy, else (a run saved before there was one, or 'byte',
    whose ids never change) the one cfg builds now."""
    saved = _saved_run_tokenizer(cfg, run_dir)
    return saved.read_text() if saved else tokenizer_json(cfg, resolve_cache_root(cfg))


def run_tokenizer(cfg: DataConfig, run_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer the run in run_dir trained with (see run_tokenizer_json)."""
    saved = _saved_run_tokenizer(cfg, run_dir)
    if saved:
        return HFTokenizer(saved, cfg.tokenizer if cfg.tokenizer == "bpe" else "file")
    return build_tokenizer(cfg, resolve_cache_root(cfg))


def keep_run_tokenizer(cfg: DataConfig, run_dir: str | os.PathLike, resumed: bool, write: bool) -> None:
    """At a run's start: write its tokenizer.json into run_dir (when `write`: one rank, which alone builds it here,
    so that a 'bpe' is trained once: the others read it from the cache later); a resume whose tokenizer gives other
    ids than the saved one (a 'bpe' retrained on a corpus that changed since) is refused, on every rank, since the
    checkpoint's embeddings are indexed by the saved one's ids."""
    path = Path(run_dir) / RUN_TOKENIZER
    if resumed and path.is_file():
        # whatever data.tokenizer says now: a 'bpe' run resumed as 'byte' went unchecked (a byte run's ids never
        # change, but the saved ones need not be a byte run's)
        if not _same_ids(tokenizers.Tokenizer.from_file(str(path)),
                         tokenizers.Tokenizer.from_str(tokenizer_json(cfg, resolve_cache_root(cfg)))):
            why = " (a BPE trained on data.paths as they are now)" if cfg.tokenizer == "bpe" else ""
            raise ConfigError("data.tokenizer", f"{cfg.tokenizer!r}{why} gives other ids than {path}, the tokenizer "
                              "this run trained with", f"restore the run's data, set data.tokenizer = '{path}', or "
                              "start another run")
        return
    if write:
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        tmp.write_text(tokenizer_json(cfg, resolve_cache_root(cfg)))
        os.replace(tmp, path)  # a reader sees the old file or the new one


def _same_ids(a: tokenizers.Tokenizer, b: tokenizers.Tokenizer) -> bool:
    """The same id for every token of both vocabularies, and the same ids for a probe text (the merges)."""
    probe = [t.encode(TOKENIZER_PROBE, add_special_tokens=False).ids for t in (a, b)]
    return a.get_vocab(with_added_tokens=True) == b.get_vocab(with_added_tokens=True) and probe[0] == probe[1]


def _trained_bpe(cfg: DataConfig, cache_root: Path) -> Path:
    """Path of the tokenizer.json for this corpus and vocab size, training it only on a cache miss."""
    files = corpus_files(cfg)
    key = _digest({"format": FORMAT_VERSION, "corpus": corpus_identity(files), "vocab_size": cfg.bpe_vocab_size,
                   **_packing_rule(files)})
    path = cache_root / "tokenizers" / f"bpe-{key[:24]}.json"
    if not path.is_file():
        _publish_file(path, _train_bpe(files, cfg.bpe_vocab_size).to_str())
    return path


def _train_bpe(files: list[Path], vocab_size: int) -> tokenizers.Tokenizer:
    # Byte-level: every string is encodable (256 base symbols), so decode(encode(text)) == text.
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_NAMES[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_texts(files), trainer=trainer)
    return tok


def _cache_folder_error(folder: Path, e: OSError) -> ConfigError:
    """A cache folder that cannot be made or written (a file in the way, no permission, a read-only disk), found
    only when the cache is first written: one line naming the field, where it was a traceback from every rank."""
    return ConfigError("data.cache_dir", f"cannot write the token cache in {folder} ({e.strerror})",
                       "point data.cache_dir (or $SHARDWISE_CACHE) at a folder you can write to")


def _publish_file(path: Path, text: str) -> None:
    """Write path unless it exists; when several ranks train at once, the first one's file is everyone's."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".tmp-{path.name}-", delete=False)
    except OSError as e:
        raise _cache_folder_error(path.parent, e) from None
    with f:
        f.write(text)
    try:
        os.chmod(f.name, 0o644)
        os.link(f.name, path)  # atomic and never overwrites: readers see no file or the whole file
    except FileExistsError:
        pass
    finally:
        os.unlink(f.name)


# ---------------------------------------------------------------------------------------------------
# Packing: documents -> shards on disk


def resolve_cache_root(cfg: DataConfig) -> Path:
    """data.cache_dir, else $SHARDWISE_CACHE, else ~/.cache/shardwise."""
    return Path(cfg.cache_dir or os.environ.get("SHARDWISE_CACHE") or "~/.cache/shardwise").expanduser()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _ShardWriter:
    """Cuts the token stream (or its loss mask, `kind` "mask") into files of exactly shard_tokens tokens (the last
    one shorter)."""

    def __init__(self, folder: Path, shard_tokens: int, dtype: np.dtype, kind: str = "shard"):
        self.folder, self.shard_tokens, self.dtype, self.kind = folder, shard_tokens, dtype, kind
        self.counts: list[int] = []
        self._pending: list[np.ndarray] = []
        self._n = 0

    def add(self, ids: np.ndarray) -> None:
        self._pending.append(ids)
        self._n += len(ids)
        if self._n < self.shard_tokens:
            return
        flat = np.concatenate(self._pending)
        full = len(flat) - len(flat) % self.shard_tokens
        for i in range(0, full, self.shard_tokens):
            self._write(flat[i : i + self.shard_tokens])
        self._pending, self._n = [flat[full:]], len(flat) - full

    def close(self) -> None:
        if self._n:
            self._write(np.concatenate(self._pending))

    def _write(self, tokens: np.ndarray) -> None:
        with open(self.folder / _shard_name(len(self.counts), self.kind), "wb") as f:
            tokens.tofile(f)
            f.flush()
            os.fsync(f.fileno())  # the rename that publishes the cache must not outrun the data
        self.counts.append(len(tokens))


def _shard_name(index: int, kind: str = "shard") -> str:
    return f"{kind}_{index:05d}.bin"


def _encoded_documents(tokenizer: Tokenizer, files: list[Path]) -> Iterator[tuple[np.ndarray, int]]:
    """Each document's ids, and how many of them lead it as a prompt (0 for a text).

    A prompt and its completion are encoded as one text where the prompt's own ids lead it (TRL's rule), so that the
    completion's ids are those that follow the prompt at generation; else (a token would span the two) apart, so
    that no token is both. Until 2026-12-02 they were always encoded apart: a tokenizer that marks the start of
    what it encodes (Llama 2's and Mistral's "▁" before the first word) marked every completion's start too, and the
    model learnt a space that the prompt's text never had."""
    encode_batch = getattr(tokenizer, "encode_batch", lambda texts: [tokenizer.encode(t) for t in texts])
    documents = _documents(files)
    while batch := list(itertools.islice(documents, DOCS_PER_ENCODE_BATCH)):
        texts = [text for doc in batch for text in ([doc] if isinstance(doc, str) else [*doc, "".join(doc)])]
        pieces = (np.asarray(ids, dtype=np.int64) for ids in encode_batch(texts))
        for doc in batch:
            ids = next(pieces)
            if isinstance(doc, str):
                yield ids, 0
                continue
            completion, joint = next(pieces), next(pieces)
            joined = np.array_equal(joint[: len(ids)], ids)
            yield (joint if joined else np.concatenate([ids, completion])), len(ids)


def _pack(files: list[Path], tokenizer: Tokenizer, folder: Path, shard_tokens: int) -> tuple[list[int], bool]:
    """Write every document followed by eos into folder's shards; returns tokens per shard, and whether a loss mask
    was written beside them (mask shards, one byte per token, 0 for a prompt's tokens: as targets they count in
    no loss; written once the corpus has its first prompt)."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    writer, masks, written = _ShardWriter(folder, shard_tokens, dtype), None, 0
    for ids, prompt in _encoded_documents(tokenizer, files):
        if prompt and masks is None:
            masks = _ShardWriter(folder, shard_tokens, np.dtype(np.uint8), kind="mask")
            masks.add(np.ones(written, np.uint8))  # the texts before it count whole
        writer.add(ids.astype(dtype, copy=False))
        writer.add(eos)
        if masks is not None:
            masks.add(np.repeat(np.array([0, 1], np.uint8), [prompt, len(ids) - prompt + 1]))  # + its eos
        written += len(ids) + 1
    writer.close()
    if masks is not None:
        masks.close()
    return writer.counts, masks is not None


def _build_cache(folder: Path, files: list[Path], tokenizer: Tokenizer, shard_tokens: int, corpus: list) -> None:
    """Tokenize into a private temp folder and rename it into place only when complete.

    A build that fails or is killed leaves at most a '.tmp-*' folder, which is never read; a damaged
    folder already at the final name (a shard cut short) is replaced.
    """
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    except OSError as e:
        raise _cache_folder_error(folder.parent, e) from None
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache_dir from other users
    try:
        counts, masked = _pack(files, tokenizer, tmp, shard_tokens)
        manifest = {
            "format": FORMAT_VERSION, "dtype": token_dtype(tokenizer.vocab_size).name,
            "shards": [{"file": _shard_name(i), "tokens": n} for i, n in enumerate(counts)],
            "masks": [_shard_name(i, "mask") for i in range(len(counts))] if masked else [],
            "num_tokens": sum(counts), "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id, "shard_tokens": shard_tokens, "corpus": corpus,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _publish(tmp, folder, tokenizer.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, folder: Path, tokenizer_name: str) -> None:
    try:
        os.rename(tmp, folder)
        return
    except OSError:
        pass  # the folder exists: published by another process (another rank), or damaged
    if _load_manifest(folder, tokenizer_name) is not None:
        shutil.rmtree(tmp)  # same key, so the same content: keep theirs
        return
    stale = folder.parent / f".stale-{folder.name}-{os.getpid()}-{os.urandom(4).hex()}"
    os.rename(folder, stale)
    shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, folder)


def _load_manifest(folder: Path, tokenizer_name: str) -> dict | None:
    """The manifest of a complete cache folder, or None when it is missing, foreign or damaged."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    itemsize = np.dtype(manifest.get("dtype", "uint8")).itemsize
    complete = manifest.get("format") == FORMAT_VERSION and manifest.get("tokenizer") == tokenizer_name and all(
        (folder / s["file"]).is_file() and (folder / s["file"]).stat().st_size == s["tokens"] * itemsize
        for s in manifest["shards"]
    ) and all((folder / m).is_file() and (folder / m).stat().st_size == s["tokens"]
              for m, s in zip(manifest.get("masks", []), manifest["shards"]))
    return manifest if complete else None


# ---------------------------------------------------------------------------------------------------
# Dataset: samples from the memory-mapped stream


def _split_layout(num_tokens: int, seq_len: int, val_fraction: float) -> dict[str, tuple[int, int]]:
    """(first token, number of samples) per split.

    val takes round(val_fraction * num_tokens / seq_len) samples (at least 1 when val_fraction > 0 and the
    stream has room) from the very end of the stream; train takes as many samples as fit before that, so
    up to seq_len - 1 tokens between the two are unused and no token is in both splits.
    """
    room = max(0, (num_tokens - 1) // seq_len)
    n_val = max(1, round(val_fraction * num_tokens / seq_len)) if val_fraction > 0 else 0
    n_val = min(n_val, room)
    val_start = num_tokens - (n_val * seq_len + 1) if n_val else num_tokens
    n_train = max(0, (val_start - 1) // seq_len)
    return {"train": (0, n_train), "val": (val_start, n_val)}


class TokenDataset:
    """The packed token stream of a corpus, memory-mapped, seen as seq_len + 1 token samples per split."""

    def __init__(self, folder: Path, manifest: dict, seq_len: int, val_fraction: float):
        self.folder = folder
        self.manifest = manifest
        self.seq_len = seq_len
        self._shards = [
            np.memmap(folder / s["file"], dtype=manifest["dtype"], mode="r", shape=(s["tokens"],))
            for s in manifest["shards"]
        ]
        self._masks = [np.memmap(folder / m, dtype=np.uint8, mode="r", shape=(s["tokens"],))
                       for m, s in zip(manifest.get("masks", []), manifest["shards"])]
        """Per token, 1 where it counts as a target (empty: every token does)."""
        self._offsets = np.cumsum([0] + [s["tokens"] for s in manifest["shards"]])
        self.num_tokens = int(self._offsets[-1])
        self._splits = _split_layout(self.num_tokens, seq_len, val_fraction)

    @classmethod
    def build(cls, cfg: DataConfig, tokenizer: Tokenizer, cache_root: Path | None = None) -> TokenDataset:
        """Open the cached shards for (corpus, tokenizer, shard size), tokenizing only on a cache miss."""
        root = Path(cache_root) if cache_root is not None else resolve_cache_root(cfg)
        files = corpus_files(cfg)
        corpus = corpus_identity(files)
        key = _digest({"format": FORMAT_VERSION, "corpus": corpus, "tokenizer": tokenizer.name,
                       "shard_tokens": cfg.shard_tokens, **_packing_rule(files)})
        folder = root / "tokens" / key[:24]
        manifest = _load_manifest(folder, tokenizer.name)
        if manifest is None:
            _build_cache(folder, files, tokenizer, cfg.shard_tokens, corpus)
            manifest = _load_manifest(folder, tokenizer.name)
            assert manifest is not None, f"cache {folder} unreadable right after it was written"
        return cls(folder, manifest, cfg.seq_len, cfg.val_fraction)

    def num_samples(self, split: str) -> int:
        return self._split(split)[1]

    def sample(self, split: str, index: int) -> np.ndarray:
        """Tokens [i*L, i*L + L + 1) of the split: L inputs and, shifted by one, L targets."""
        first = self._first(split, index)
        return self._read(self._shards, first, first + self.seq_len + 1)

    @property
    def masked(self) -> bool:
        """Whether some targets count in no loss (the corpus has prompts)."""
        return bool(self._masks)

    def counted(self, split: str, index: int) -> np.ndarray:
        """Which of sample i's L targets count in the loss (bool; all of them where the corpus has no prompt)."""
        first = self._first(split, index)
        if not self._masks:
            return np.ones(self.seq_len, bool)
        return self._read(self._masks, first + 1, first + self.seq_len + 1).astype(bool)

    def _first(self, split: str, index: int) -> int:
        start, n = self._split(split)
        if not 0 <= index < n:
            raise IndexError(f"sample {index} outside the {split} split's {n} samples")
        return start + index * self.seq_len

    def _split(self, split: str) -> tuple[int, int]:
        if split not in self._splits:
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        return self._splits[split]

    def _read(self, shards: list[np.memmap], lo: int, hi: int) -> np.ndarray:
        """Tokens (or mask values) [lo, hi) of the whole stream, copied out of however many shards they span."""
        k = int(np.searchsorted(self._offsets, lo, side="right")) - 1
        parts = []
        while lo < hi:
            end = min(hi, int(self._offsets[k + 1]))
            parts.append(shards[k][lo - self._offsets[k] : end - self._offsets[k]])
            lo, k = end, k + 1
        return np.concatenate(parts)


# ---------------------------------------------------------------------------------------------------
# Batches


@dataclass
class Batch:
    inputs: torch.Tensor
    """(b, seq_len) int64 token ids."""
    targets: torch.Tensor
    """(b, seq_len) int64: inputs shifted left by one."""
    sample_ids: list[int]
    """Index of each row's sample within its split, to check that every sample is read once."""
    step_targets: int | None = None
    """The targets that count in the loss over the whole step (every micro-batch of every data-parallel rank): what
    the summed loss is divided by. None: every target of the step's batches counts."""
    masked: bool = False
    """Whether some targets may be IGNORE_INDEX (the corpus has prompts): the loss must look for them."""


def _make_batch(dataset: TokenDataset, split: str, ids: list[int], step_targets: int | None = None) -> Batch:
    import torch  # here, not at the top: `prepare` runs in the launcher, before torch is needed (see there)

    rows = torch.from_numpy(np.stack([dataset.sample(split, i) for i in ids]).astype(np.int64))
    targets = rows[:, 1:].contiguous()
    if dataset.masked:
        counted = torch.from_numpy(np.stack([dataset.counted(split, i) for i in ids]))
        targets.masked_fill_(~counted, IGNORE_INDEX)
    return Batch(inputs=rows[:, :-1].contiguous(), targets=targets, sample_ids=ids, step_targets=step_targets,
                 masked=dataset.masked)


def counted_targets(targets: torch.Tensor) -> torch.Tensor:
    """How many of `targets` count in the loss (those that are not IGNORE_INDEX)."""
    return (targets != IGNORE_INDEX).sum()


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash rather than seed + epoch, so runs with seeds s and s + 1 do not share shifted orders.
    digest = hashlib.sha256(f"shardwise.data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class DataLoader:
    """This rank's micro-batches, step after step, in an order fixed by (seed, epoch, step) alone.

    Step t of epoch e reads positions [t*G, (t+1)*G) of a permutation of the split drawn from (seed, e),
    G = micro_batch * grad_accum * dp_size. Rank r takes the r-th of dp_size equal contiguous slices of that
    run and cuts it into grad_accum micro-batches, so the ranks together read exactly what a single device
    with grad_accum * dp_size micro-batches reads. The epoch's last n % G samples are skipped.
    """

    def __init__(self, dataset: TokenDataset, *, micro_batch: int, grad_accum: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, split: str = "train"):
        if micro_batch < 1 or grad_accum < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need micro_batch, grad_accum >= 1 and 0 <= dp_rank < dp_size; got "
                             f"{micro_batch}, {grad_accum}, {dp_rank}, {dp_size}")
        self.dataset, self.split, self.seed = dataset, split, seed
        self.micro_batch, self.grad_accum, self.dp_rank, self.dp_size = micro_batch, grad_accum, dp_rank, dp_size
        self.global_batch = micro_batch * grad_accum * dp_size
        self.num_samples = dataset.num_samples(split)
        if self.num_samples < self.global_batch:
            raise ConfigError(
                "train.micro_batch",
                f"the {split} split has {self.num_samples} samples of data.seq_len={dataset.seq_len} tokens, "
                f"fewer than one global batch of {self.global_batch} (micro_batch x grad_accum x dp)",
                "make train.micro_batch, train.grad_accum or data.seq_len smaller, or add data",
            )
        self.steps_per_epoch = self.num_samples // self.global_batch
        self.epoch, self.step_in_epoch = 0, 0
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, permutation), recomputed once per epoch

    def next_step(self) -> list[Batch]:
        """The grad_accum micro-batches this rank feeds into the next optimizer step."""
        share = self.global_batch // self.dp_size
        step = self.step_in_epoch * self.global_batch
        every = self._permutation()[step : step + self.global_batch].tolist()  # every rank's samples of the step
        ids = every[self.dp_rank * share : (self.dp_rank + 1) * share]
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        # with a loss mask, what the step's loss is divided by: its counted targets, the same number on every rank
        counted = int(sum(self.dataset.counted(self.split, i).sum() for i in every)) if self.dataset.masked else None
        mb = self.micro_batch
        return [_make_batch(self.dataset, self.split, ids[i * mb : (i + 1) * mb], counted)
                for i in range(self.grad_accum)]

    def _permutation(self) -> torch.Tensor:
        import torch

        if self._perm is None or self._perm[0] != self.epoch:
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
            self._perm = (self.epoch, torch.randperm(self.num_samples, generator=gen))
        return self._perm[1]

    def state_dict(self) -> dict[str, int]:
        """Where the next step starts, in global-batch units: valid for any layout with the same G."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed,
                "global_batch": self.global_batch, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        expected = self.state_dict()
        if set(state) != set(expected):
            raise ValueError(f"data loader state has keys {sorted(state)}, expected {sorted(expected)}")
        for key in ("seed", "global_batch", "num_samples"):
            if state[key] != expected[key]:
                raise ValueError(
                    f"data loader state was saved with {key}={state[key]} but this loader has {key}={expected[key]}; "
                    "resume with the same train.seed, global batch (micro_batch x grad_accum x dp) and data"
                )
        if state["epoch"] < 0 or not 0 <= state["step_in_epoch"] < self.steps_per_epoch:
            raise ValueError(f"data loader state {state} is out of range ({self.steps_per_epoch} steps per epoch)")
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])


def _val_samples(dataset: TokenDataset) -> int:
    n_val = dataset.num_samples("val")
    if n_val == 0:
        raise ConfigError("data.val_fraction", "the val split has no samples",
                          "raise data.val_fraction, shorten data.seq_len or add data")
    return n_val


def prepare(cfg: JobConfig, dp_size: int) -> TokenDataset:
    """The run's tokenizer and token cache, built (on a cache miss) and checked against the job: the tokenizer's
    ids against model.vocab_size and against checkpoint.init_from_hf's tokenizer, a global batch of
    `dp_size` data-parallel ranks against the train split, and the val split. Every rank's build_data runs it
    (rank 0 first, filling the cache); `shardwise train --nproc` runs it once in the launcher, so that what is wrong
    with the data is one line before any rank starts (it was after torchrun had started them, ~18 s in). This
    module imports torch only where batches are made, so the launcher does not load it for this."""
    tokenizer = build_tokenizer(cfg.data, resolve_cache_root(cfg.data))
    if cfg.checkpoint.init_from_hf:
        # first: the folder fixes model.vocab_size, so a tokenizer of more ids is the wrong tokenizer, and "set
        # model.vocab_size >= N" would only be refused next as another shape than the folder's
        check_hf_tokenizer(tokenizer, cfg.data.tokenizer, cfg.checkpoint.init_from_hf)
        if tokenizer.vocab_size > cfg.model.vocab_size:  # a folder without its own tokenizer.json
            raise ConfigError(
                "data.tokenizer", f"{cfg.data.tokenizer!r} has {tokenizer.vocab_size} ids, more than the "
                f"{cfg.model.vocab_size} rows of checkpoint.init_from_hf's embeddings",
                "set data.tokenizer to the tokenizer.json that model was trained with",
            )
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size", f"{cfg.model.vocab_size} < the tokenizer's {tokenizer.vocab_size} ids",
            f"set model.vocab_size >= {tokenizer.vocab_size}",
        )
    dataset = TokenDataset.build(cfg.data, tokenizer)
    DataLoader(dataset, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum, dp_size=dp_size)
    _val_samples(dataset)
    if cfg.train.val_every and dataset.masked:
        per_batch = cfg.train.micro_batch * cfg.train.grad_accum * dp_size
        _check_val_targets(dataset, cfg.train.val_batches, per_batch)
    return dataset


def _check_val_targets(dataset: TokenDataset, val_batches: int, per_batch: int) -> None:
    """Refuse a validation that reads prompts alone: its val_batches global batches of `per_batch` samples are the
    val split's first samples, and where no target of theirs counts, their mean loss is 0 / 0 (val_loss was nan at
    every evaluation until 2026-12-02). The split's last sample always counts: it ends with a completion's eos."""
    n_val = dataset.num_samples("val")
    first = next((i for i in range(n_val) if dataset.counted("val", i).any()), n_val)
    if first >= val_batches * per_batch:
        raise ConfigError(
            "train.val_batches", f"its {val_batches} batches read the first {val_batches * per_batch} validation "
            "samples, which are all prompt: no target counts in their loss (val_loss would be nan)",
            f"set train.val_batches = {first // per_batch + 1}, or lower data.val_fraction",
        )


def val_batches(dataset: TokenDataset, *, micro_batch: int, n: int, dp_rank: int = 0,
                dp_size: int = 1) -> list[Batch]:
    """This rank's share of the first n * dp_size micro-batches of the val split, in order, no shuffle.

    Micro-batch j holds val samples j*micro_batch ... (j+1)*micro_batch - 1, wrapping around to sample 0
    when the split is shorter, so every rank always gets n full micro-batches and every evaluation sees
    the same samples. Rank r takes micro-batches j with j % dp_size == r.
    """
    n_val = _val_samples(dataset)
    return [
        _make_batch(dataset, "val", [(j * micro_batch + k) % n_val for k in range(micro_batch)])
        for j in range(dp_rank, n * dp_size, dp_size)
    ]
