"""Tests for shardwise.data: corpus, tokenizers, packed shards, samples and the deterministic loader.

Expected token streams are computed another way than the code under test: raw file bytes for the byte
tokenizer, the `tokenizers` library called per document for BPE, and plain slicing of the whole stream.
"""

from __future__ import annotations

import collections
import json
import logging
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers

from shardwise import data
from shardwise.config import ConfigError, DataConfig

SEQ = 8


def write_corpus(folder: Path, lines: int = 60) -> Path:
    """A few small documents, one with non-ASCII text, in nested folders plus files that must be skipped."""
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("".join(f"line {i}: the quick brown fox jumps {i * i}\n" for i in range(lines)))
    (folder / "b.md").write_text("# Überschrift\n\nnaïve café, 日本語, emoji \u2713 and more text.\n" * 5)
    (folder / "sub" / "c.py").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(lines)))
    (folder / "README").write_text("a file with no extension is text too\n")
    (folder / "blob").write_bytes(b"\x00\x01binary")  # no extension but binary: skipped
    (folder / "image.png").write_bytes(b"\x89PNG")  # not a text ending: skipped
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "x.txt").write_text("hidden\n")
    return folder


def make_cfg(corpus: Path, cache: Path, **overrides) -> DataConfig:
    fields = dict(paths=[str(corpus)], seq_len=SEQ, val_fraction=0.1, max_corpus_mb=0, cache_dir=str(cache))
    return DataConfig(**{**fields, **overrides})


def stream_on_disk(ds: data.TokenDataset) -> np.ndarray:
    """The packed stream read straight from the shard files named in the manifest."""
    m = ds.manifest
    return np.concatenate([np.fromfile(ds.folder / s["file"], dtype=m["dtype"]) for s in m["shards"]])


def byte_stream(files: list[Path]) -> np.ndarray:
    return np.concatenate([np.append(np.frombuffer(f.read_bytes(), np.uint8).astype(np.int64), 256) for f in files])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def bpe_json(corpus, tmp_path_factory) -> Path:
    """A BPE trained once by build_tokenizer; its cached tokenizer.json."""
    cache = tmp_path_factory.mktemp("bpe_cache")
    data.build_tokenizer(make_cfg(corpus, cache, tokenizer="bpe", bpe_vocab_size=300), cache)
    (path,) = (cache / "tokenizers").glob("*.json")
    return path


@pytest.fixture(scope="module")
def dataset(corpus, tmp_path_factory) -> data.TokenDataset:
    cache = tmp_path_factory.mktemp("ds_cache")
    return data.TokenDataset.build(make_cfg(corpus, cache), data.ByteTokenizer())


# ---------------------------------------------------------------------------------------------------
# Corpus


def test_default_corpus_is_sorted_stdlib_source():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = data.corpus_files(DataConfig(max_corpus_mb=0))
    rel = [f.relative_to(root).as_posix() for f in files]
    assert {"os.py", "json/decoder.py", "pydoc_data/topics.py"} <= set(rel)
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    skipped = {"test", "tests", "idlelib", "lib2to3", "site-packages"}
    assert not any(skipped & set(r.split("/")[:-1]) for r in rel)
    assert all(f.stat().st_size <= 1 << 20 for f in files)
    assert "def makedirs" in (root / "os.py").read_text()
    assert data.corpus_files(DataConfig(max_corpus_mb=0)) == files  # deterministic

    small = data.corpus_files(DataConfig(max_corpus_mb=0.5))
    used = sum(f.stat().st_size for f in small)
    assert small == files[: len(small)]
    assert used <= 0.5 * 2**20 < used + files[len(small)].stat().st_size  # stops at the first file that does not fit


def test_default_corpus_packs_with_byte_tokenizer(tmp_path):
    cfg = DataConfig()
    ds = data.TokenDataset.build(cfg, data.ByteTokenizer(), tmp_path)
    files = data.corpus_files(cfg)
    assert ds.num_tokens == sum(f.stat().st_size for f in files) + len(files)
    assert ds.manifest["dtype"] == "uint16" and ds.num_samples("train") > 1000


def test_user_paths_text_file_rule(corpus):
    got = [f.relative_to(corpus).as_posix() for f in data.corpus_files(DataConfig(paths=[str(corpus)]))]
    assert got == ["README", "a.txt", "b.md", "sub/c.py"]
    # A file named explicitly is read whatever its ending; order follows data.paths; duplicates read once.
    named = data.corpus_files(DataConfig(paths=[str(corpus / "image.png"), str(corpus), str(corpus / "a.txt")]))
    assert [f.name for f in named] == ["image.png", "README", "a.txt", "b.md", "c.py"]
    with pytest.raises(ConfigError, match="data.paths"):
        data.corpus_files(DataConfig(paths=[str(corpus / "missing")]))
    with pytest.raises(ConfigError, match="data.max_corpus_mb"):
        data.corpus_files(DataConfig(paths=[str(corpus)], max_corpus_mb=1e-6))


JSONL_RECORDS = [{"text": "first doc\nof two lines", "id": 1}, {"text": "", "id": 2},
                 {"text": "naïve café \u2713 日本語", "meta": {"text": "not this"}}]


def write_jsonl_corpus(folder: Path) -> Path:
    folder.mkdir()
    lines = [json.dumps(r, ensure_ascii=i == 0) for i, r in enumerate(JSONL_RECORDS)]
    (folder / "d.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + lines[2])  # a blank line, no final newline
    (folder / "e.txt").write_text("plain text\n")
    return folder


def test_jsonl_lines_are_documents(tmp_path):
    """A .jsonl file, in a folder or named, is one document per line, its "text" field, without JSON syntax: it
    was packed as one document of raw JSON, and skipped in folders. Expected: the records' texts' bytes + eos."""
    folder = write_jsonl_corpus(tmp_path / "corpus")
    texts = [r["text"] for r in JSONL_RECORDS] + ["plain text\n"]
    expected = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8).astype(np.int64), 256) for t in texts])
    for paths in ([str(folder)], [str(folder / "d.jsonl"), str(folder / "e.txt")]):
        ds = data.TokenDataset.build(make_cfg(folder, tmp_path / "cache", paths=paths), data.ByteTokenizer())
        np.testing.assert_array_equal(stream_on_disk(ds), expected)


def test_jsonl_documents_through_a_bpe(tmp_path, bpe_json):
    """The same through a tokenizer.json (the batched encode) and a BPE trained on the corpus."""
    folder = write_jsonl_corpus(tmp_path / "corpus")
    texts = [r["text"] for r in JSONL_RECORDS] + ["plain text\n"]
    for tokenizer in (str(bpe_json), "bpe"):
        cfg = make_cfg(folder, tmp_path / "cache", tokenizer=tokenizer, bpe_vocab_size=280)
        tok = data.build_tokenizer(cfg, tmp_path / "cache")
        stream = stream_on_disk(data.TokenDataset.build(cfg, tok, tmp_path / "cache")).tolist()
        ends = [i for i, t in enumerate(stream) if t == tok.eos_id]
        assert [tok.decode(stream[a + 1 : b]) for a, b in zip([-1, *ends], ends)] == texts
    trained = json.loads(next((tmp_path / "cache" / "tokenizers").glob("bpe-*.json")).read_text())
    assert not any('"' in token for token in trained["model"]["vocab"] if len(token) > 1)  # no JSON syntax learnt


@pytest.mark.parametrize("line, problem", [("{bad", "is not JSON"), ('{"content": "x"}', 'has no "text" string'),
                                           ('["text"]', 'has no "text" string'), ('{"text": 3}', 'has no "text"'),
                                           ('{"prompt": "x"}', 'has no "text" string and no "prompt"')])
def test_a_bad_jsonl_line_names_the_file_and_the_line(tmp_path, line, problem):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    cfg = make_cfg(tmp_path / "d.jsonl", tmp_path / "cache")
    with pytest.raises(ConfigError) as e:
        data.TokenDataset.build(cfg, data.ByteTokenizer())
    assert e.value.field == "data.paths" and f"d.jsonl line 2 {problem}" in str(e.value) and "\n" not in str(e.value)


def test_prompt_completion_records_count_only_the_completion_and_its_end_of_text(tmp_path):
    """A "prompt"/"completion" record is one document whose prompt tokens count in no loss (their targets are
    IGNORE_INDEX); its completion and the eos after it count, as every token of a "text" record and of a text file
    does. Expected, with bytes as tokens: the stream and, per token as a target, whether it counts."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    records = [{"text": "ab"}, {"prompt": "Q?", "completion": "yes"}, {"prompt": "", "completion": "z"}]
    (folder / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (folder / "b.txt").write_text("hi")
    stream, counts = [], []
    for text, prompt in (("ab", ""), ("Q?yes", "Q?"), ("z", ""), ("hi", "")):
        stream += [*text.encode(), 256]
        counts += [False] * len(prompt) + [True] * (len(text) - len(prompt) + 1)
    cfg = make_cfg(folder, tmp_path / "cache", seq_len=4, val_fraction=0.0)
    ds = data.TokenDataset.build(cfg, data.ByteTokenizer())
    np.testing.assert_array_equal(stream_on_disk(ds), stream)
    assert ds.masked and ds.num_samples("train") == 3
    for i in range(3):
        np.testing.assert_array_equal(ds.counted("train", i), counts[4 * i + 1 : 4 * i + 5])
    batch = data.DataLoader(ds, micro_batch=1, grad_accum=3).next_step()
    for b in batch:
        i = b.sample_ids[0]
        expected = [t if c else data.IGNORE_INDEX for t, c in zip(stream[4 * i + 1 : 4 * i + 5],
                                                                  counts[4 * i + 1 : 4 * i + 5])]
        assert b.targets[0].tolist() == expected and b.masked
        assert b.step_targets == sum(counts[1:13])  # the whole step's counted targets, on every micro-batch
    text_only = data.TokenDataset.build(make_cfg(folder / "b.txt", tmp_path / "cache", seq_len=2, val_fraction=0.0),
                                      data.ByteTokenizer())
    assert not text_only.masked and not text_only.manifest["masks"]  # no mask files for a corpus without prompts
    assert data.DataLoader(text_only, micro_batch=1, grad_accum=1).next_step()[0].step_targets is None


def test_prompt_completion_records_through_a_bpe_are_encoded_apart(tmp_path, bpe_json):
    """A prompt and its completion that meet between words: the same ids encoded apart or as one text (the
    byte-level BPE starts a word at its space), the prompt's tokens masked."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    record = {"prompt": "def f(x):\n    return", "completion": " x + 1\n"}
    (folder / "a.jsonl").write_text(json.dumps(record) + "\n")
    cfg = make_cfg(folder, tmp_path / "cache", tokenizer=str(bpe_json), seq_len=2, val_fraction=0.0)
    tok = data.build_tokenizer(cfg, tmp_path / "cache")
    ds = data.TokenDataset.build(cfg, tok, tmp_path / "cache")
    prompt, completion = tok.encode(record["prompt"]), tok.encode(record["completion"])
    assert stream_on_disk(ds).tolist() == [*prompt, *completion, tok.eos_id]
    counted = np.concatenate([ds.counted("train", i) for i in range(ds.num_samples("train"))])
    expected = [False] * (len(prompt) - 1) + [True] * (len(completion) + 1)  # targets: the stream from token 1
    assert counted.tolist() == expected[: len(counted)]


def test_a_completion_is_encoded_as_the_prompt_s_continuation_by_a_tokenizer_that_marks_its_start(tmp_path):
    """Llama 2's tokenizer.json puts "▁" before what it encodes: encoded alone, the completion " blue" was
    "▁▁blue", a space the text never had before it, which the model then learnt to write. Expected: the
    tokenizers library's ids of prompt + completion as one text, its prompt's ids masked (TRL's rule); where a
    token would span the two (a completion that goes on the prompt's last word), the two encoded apart."""
    from tokenizers import normalizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.train_from_iterator(["the sky is blue", "Q: the sky? A: blue"] * 20, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    records = [{"prompt": "Q: the sky? A:", "completion": " blue"}, {"prompt": "Q: bl", "completion": "ue"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = make_cfg(tmp_path / "a.jsonl", tmp_path / "cache", tokenizer=str(tmp_path / "tokenizer.json"), seq_len=2,
                   val_fraction=0.0)
    ds = data.TokenDataset.build(cfg, data.build_tokenizer(cfg, tmp_path / "cache"), tmp_path / "cache")
    ids = [tok.encode(text, add_special_tokens=False).ids for r in records for text in r.values()]
    joint = tok.encode("Q: the sky? A: blue", add_special_tokens=False).ids
    assert joint[: len(ids[0])] == ids[0] and joint[len(ids[0]):] != ids[1]  # apart, " blue" was another encoding
    assert tok.encode("Q: blue", add_special_tokens=False).ids[: len(ids[2])] != ids[2]  # "blue" spans the two
    eos = tok.token_to_id("</s>")
    stream = [*joint, eos, *ids[2], *ids[3], eos]
    counts = [False] * len(ids[0]) + [True] * (len(joint) - len(ids[0]) + 1) + [False] * len(ids[2]) + \
        [True] * (len(ids[3]) + 1)
    np.testing.assert_array_equal(stream_on_disk(ds), stream)
    counted = np.concatenate([ds.counted("train", i) for i in range(ds.num_samples("train"))])
    assert counted.tolist() == counts[1 : len(counted) + 1]


def test_bytes_that_are_not_utf8_are_replaced_with_a_warning_naming_the_file(tmp_path, caplog):
    """A latin-1 file's bytes become U+FFFD in the stream, as before, but no longer without a word: one warning per
    file naming it and the first bad byte (the BPE's training and the packing both read it)."""
    (tmp_path / "ok.txt").write_text("fine\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    for tokenizer in ("byte", "bpe"):
        cfg = make_cfg(tmp_path, tmp_path / f"cache-{tokenizer}", tokenizer=tokenizer, bpe_vocab_size=280)
        with caplog.at_level(logging.WARNING, logger="shardwise.data"):
            tok = data.build_tokenizer(cfg, tmp_path / f"cache-{tokenizer}")
            stream = stream_on_disk(data.TokenDataset.build(cfg, tok, tmp_path / f"cache-{tokenizer}")).tolist()
        assert tok.decode(stream[: stream.index(tok.eos_id)]) == "caf\ufffd au lait\n"
    warned = [r.getMessage() for r in caplog.records if r.name == "shardwise.data"]
    assert len(warned) == 1 and "latin1.txt is not UTF-8 from byte 3 on" in warned[0]
    # a JSON Lines file's the same way, per line (it stopped the run as "not JSON", with a fix about its fields)
    (tmp_path / "latin1.txt").unlink()
    (tmp_path / "l.jsonl").write_bytes(b'{"text": "ok"}\n{"prompt": "caf\xe9?", "completion": " oui"}\n')
    caplog.clear()
    cfg = make_cfg(tmp_path / "l.jsonl", tmp_path / "cache-jsonl", seq_len=2, val_fraction=0.0)
    with caplog.at_level(logging.WARNING, logger="shardwise.data"):
        stream = stream_on_disk(data.TokenDataset.build(cfg, data.ByteTokenizer(), tmp_path / "cache-jsonl"))
    assert stream.tolist() == [*b"ok", 256, *"caf\ufffd? oui".encode(), 256]
    warned = [r.getMessage() for r in caplog.records if r.name == "shardwise.data"]
    assert len(warned) == 1 and "l.jsonl is not UTF-8 from line 2 byte 15 on" in warned[0], warned


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "env"))
    assert data.resolve_cache_root(DataConfig(cache_dir=str(tmp_path / "cfg"))) == tmp_path / "cfg"
    assert data.resolve_cache_root(DataConfig()) == tmp_path / "env"
    monkeypatch.delenv("SHARDWISE_CACHE")
    assert data.resolve_cache_root(DataConfig()) == Path.home() / ".cache" / "shardwise"


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_a_cache_folder_that_cannot_be_made_names_the_field(corpus, tmp_path, monkeypatch, tokenizer):
    """A file where the cache folder goes (here through $SHARDWISE_CACHE, which the config does not see) is one
    line naming data.cache_dir when the shards or the trained BPE are first written, not an OSError."""
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "file" / "cache"))
    cfg = make_cfg(corpus, "", tokenizer=tokenizer, bpe_vocab_size=300)
    with pytest.raises(ConfigError) as e:
        tok = data.build_tokenizer(cfg, data.resolve_cache_root(cfg))
        data.TokenDataset.build(cfg, tok)
    assert e.value.field == "data.cache_dir" and str(tmp_path / "file") in str(e.value)


# ---------------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    text = "héllo wörld ✓ 日本語\n\ttabs"
    ids = tok.encode(text)
    assert list(ids) == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(np.append(ids, tok.eos_id)) == text  # eos is not text
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "byte")


def test_bpe_round_trips_and_is_cached(corpus, tmp_path, monkeypatch):
    cfg = make_cfg(corpus, tmp_path, tokenizer="bpe", bpe_vocab_size=300)
    tok = data.build_tokenizer(cfg, tmp_path)
    text = "line 7: the quick brown fox — naïve café 日本語 ✓\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges were learned
    assert tok.name.startswith("bpe-") and tok.vocab_size <= 300
    (trained,) = (tmp_path / "tokenizers").glob("*.json")
    assert tok.eos_id == tokenizers.Tokenizer.from_file(str(trained)).token_to_id("<|endoftext|>")
    assert tok.eos_id not in tok.encode("text with <|endoftext|> inside")  # a literal is text, not a boundary

    def no_training(*args):
        raise AssertionError("retrained although the tokenizer is cached")

    monkeypatch.setattr(data, "_train_bpe", no_training)
    assert data.build_tokenizer(cfg, tmp_path).name == tok.name


def test_tokenizer_json_path(bpe_json, corpus, tmp_path):
    copy = tmp_path / "tokenizer.json"
    shutil.copy(bpe_json, copy)
    tok = data.build_tokenizer(DataConfig(tokenizer=str(copy)), tmp_path)
    ref = tokenizers.Tokenizer.from_file(str(bpe_json))
    text = (corpus / "b.md").read_text()
    assert list(tok.encode(text)) == ref.encode(text).ids and tok.decode(tok.encode(text)) == text
    assert tok.eos_id == ref.token_to_id("<|endoftext|>")


def test_tokenizer_json_without_eos_errors(tmp_path):
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tok.json"))
    with pytest.raises(ConfigError, match="data.tokenizer"):
        data.build_tokenizer(DataConfig(tokenizer=str(tmp_path / "tok.json")), tmp_path)


# ---------------------------------------------------------------------------------------------------
# Packing and the cache


def test_byte_packing_reproduces_documents(corpus, dataset):
    files = data.corpus_files(make_cfg(corpus, Path("unused")))
    assert np.array_equal(stream_on_disk(dataset).astype(np.int64), byte_stream(files))


def test_bpe_packing_reproduces_documents(corpus, bpe_json, tmp_path):
    cfg = make_cfg(corpus, tmp_path, tokenizer=str(bpe_json), shard_tokens=64)
    ds = data.TokenDataset.build(cfg, data.build_tokenizer(cfg, tmp_path))
    ref = tokenizers.Tokenizer.from_file(str(bpe_json))
    eos = ref.token_to_id("<|endoftext|>")
    expected = [t for f in data.corpus_files(cfg) for t in ref.encode(f.read_text()).ids + [eos]]
    assert stream_on_disk(ds).tolist() == expected


def test_multi_shard_gives_same_samples(corpus, dataset, tmp_path):
    small = data.TokenDataset.build(make_cfg(corpus, tmp_path, shard_tokens=50), data.ByteTokenizer())
    counts = [s["tokens"] for s in small.manifest["shards"]]
    assert len(counts) > 10 and set(counts[:-1]) == {50} and small.num_tokens == dataset.num_tokens
    for split in ("train", "val"):
        assert small.num_samples(split) == dataset.num_samples(split)
        for i in range(small.num_samples(split)):  # stride 8 vs shard 50: many samples straddle two files
            assert np.array_equal(small.sample(split, i), dataset.sample(split, i))


def test_cache_is_reused_and_invalidated_by_content(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = make_cfg(corpus, tmp_path / "cache")
    first = data.TokenDataset.build(cfg, data.ByteTokenizer())
    real_pack, calls = data._pack, []
    monkeypatch.setattr(data, "_pack", lambda *a: calls.append(1) or real_pack(*a))
    again = data.TokenDataset.build(cfg, data.ByteTokenizer())
    assert not calls and again.folder == first.folder
    with open(corpus / "a.txt", "a") as f:
        f.write("one more line\n")
    changed = data.TokenDataset.build(cfg, data.ByteTokenizer())
    assert calls == [1] and changed.folder != first.folder
    assert changed.num_tokens == first.num_tokens + len("one more line\n")


def test_interrupted_build_is_never_trusted(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = make_cfg(corpus, tmp_path / "cache", shard_tokens=100)
    expected = byte_stream(data.corpus_files(cfg))
    real_write, written = data._ShardWriter._write, []

    def failing_write(self, tokens):
        if len(written) == 3:
            raise RuntimeError("killed mid-build")
        written.append(1)
        real_write(self, tokens)

    monkeypatch.setattr(data._ShardWriter, "_write", failing_write)
    with pytest.raises(RuntimeError):
        data.TokenDataset.build(cfg, data.ByteTokenizer())
    assert list((tmp_path / "cache" / "tokens").iterdir()) == []  # the partial temp folder was removed

    # A hard kill cannot clean up: the partial folder stays, under a name that is never read.
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)
    written.clear()
    with pytest.raises(RuntimeError):
        data.TokenDataset.build(cfg, data.ByteTokenizer())
    monkeypatch.undo()
    (leftover,) = (tmp_path / "cache" / "tokens").iterdir()
    assert leftover.name.startswith(".tmp-") and len(list(leftover.glob("*.bin"))) == 3

    ds = data.TokenDataset.build(cfg, data.ByteTokenizer())
    assert np.array_equal(stream_on_disk(ds).astype(np.int64), expected)

    # A damaged published cache (a shard cut short) is rebuilt, not read.
    shard = ds.folder / ds.manifest["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:10])
    rebuilt = data.TokenDataset.build(cfg, data.ByteTokenizer())
    assert np.array_equal(stream_on_disk(rebuilt).astype(np.int64), expected)


# ---------------------------------------------------------------------------------------------------
# Samples and split


def test_samples_and_split(dataset):
    stream = stream_on_disk(dataset)
    n, n_train, n_val = len(stream), dataset.num_samples("train"), dataset.num_samples("val")
    assert n_val == round(0.1 * n / SEQ)
    train_end = n_train * SEQ + 1  # one past the last token any train sample reads
    val_start = n - (n_val * SEQ + 1)  # val is the stream's tail
    assert train_end <= val_start < train_end + SEQ  # disjoint, and at most seq_len - 1 tokens unused
    for i in range(n_train):
        assert np.array_equal(dataset.sample("train", i), stream[i * SEQ : i * SEQ + SEQ + 1])
    for j in range(n_val):
        assert np.array_equal(dataset.sample("val", j), stream[val_start + j * SEQ : val_start + j * SEQ + SEQ + 1])
    assert dataset.sample("train", 3)[-1] == dataset.sample("train", 4)[0]
    with pytest.raises(IndexError):
        dataset.sample("train", n_train)
    with pytest.raises(ValueError):
        dataset.sample("test", 0)


# ---------------------------------------------------------------------------------------------------
# Loader


def loader(ds, **kw) -> data.DataLoader:
    return data.DataLoader(ds, **{"micro_batch": 4, "grad_accum": 2, "seed": 0, **kw})


def ids_of(batches: list[data.Batch]) -> list[int]:
    return [i for b in batches for i in b.sample_ids]


def test_batches_hold_their_samples(dataset):
    (b, _) = loader(dataset).next_step()
    assert b.inputs.shape == b.targets.shape == (4, SEQ) and b.inputs.dtype == b.targets.dtype == torch.int64
    for row, i in enumerate(b.sample_ids):
        s = torch.from_numpy(dataset.sample("train", i).astype(np.int64))
        assert torch.equal(b.inputs[row], s[:-1]) and torch.equal(b.targets[row], s[1:])


def test_loader_is_deterministic(dataset):
    a, b, other = loader(dataset), loader(dataset), loader(dataset, seed=1)
    steps_a = [a.next_step() for _ in range(5)]
    steps_b = [b.next_step() for _ in range(5)]
    for x, y in zip(steps_a, steps_b):
        assert ids_of(x) == ids_of(y)
        assert all(torch.equal(p.inputs, q.inputs) and torch.equal(p.targets, q.targets) for p, q in zip(x, y))
    assert ids_of(steps_a[0]) != ids_of(other.next_step())


def test_dp_ranks_together_read_the_single_device_step(dataset):
    single = loader(dataset, micro_batch=3, grad_accum=2)
    ranks = [loader(dataset, micro_batch=3, grad_accum=1, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(4):
        one = single.next_step()
        split = [b for r in ranks for b in r.next_step()]
        assert collections.Counter(ids_of(one)) == collections.Counter(ids_of(split))
        assert torch.equal(torch.cat([b.inputs for b in one]), torch.cat([b.inputs for b in split]))
        assert torch.equal(torch.cat([b.targets for b in one]), torch.cat([b.targets for b in split]))


def test_every_sample_once_per_epoch(dataset):
    ranks = [loader(dataset, micro_batch=5, grad_accum=3, dp_rank=r, dp_size=2) for r in range(2)]
    n, g, steps = dataset.num_samples("train"), 30, ranks[0].steps_per_epoch
    assert steps == n // g and n % g  # this corpus leaves a remainder to drop
    seen = [i for _ in range(steps) for r in ranks for i in ids_of(r.next_step())]
    assert len(seen) == len(set(seen)) == steps * g and set(seen) <= set(range(n))
    assert ranks[0].state_dict()["epoch"] == 1
    next_epoch = [i for r in ranks for i in ids_of(r.next_step())]
    assert next_epoch != seen[:g]  # a new permutation


@pytest.mark.parametrize("saved_after", [3, 60])  # 60 + 8 steps cross the epoch boundary (63 steps per epoch)
def test_resume_continues_exactly(dataset, saved_after):
    straight, first = loader(dataset), loader(dataset)
    assert straight.steps_per_epoch == dataset.num_samples("train") // 8 == 63
    for _ in range(saved_after):
        straight.next_step()
        first.next_step()
    state = first.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = loader(dataset)
    resumed.load_state_dict(state)
    # Same global batch (8), other layout: two ranks, one micro-batch each.
    ranks = [loader(dataset, grad_accum=1, dp_rank=r, dp_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for _ in range(8):
        want = straight.next_step()
        got = resumed.next_step()
        assert ids_of(got) == ids_of(want)
        assert all(torch.equal(p.inputs, q.inputs) for p, q in zip(got, want))
        assert [i for r in ranks for i in ids_of(r.next_step())] == ids_of(want)


def test_load_state_rejects_mismatches(dataset):
    state = loader(dataset).state_dict()
    with pytest.raises(ValueError, match="seed"):
        loader(dataset, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch"):
        loader(dataset, micro_batch=2).load_state_dict(state)
    with pytest.raises(ValueError, match="keys"):
        loader(dataset).load_state_dict({k: v for k, v in state.items() if k != "epoch"})


def test_too_small_split_names_the_fields(dataset):
    with pytest.raises(ValueError, match="train.micro_batch") as err:
        loader(dataset, micro_batch=dataset.num_samples("train"))
    assert "data.seq_len" in str(err.value)


def test_val_batches(dataset, tmp_path):
    assert dataset.num_samples("val") == 56
    per_rank = [data.val_batches(dataset, micro_batch=8, n=4, dp_rank=r, dp_size=2) for r in range(2)]
    run = lambda first: list(range(first, first + 8))  # noqa: E731
    assert [b.sample_ids for b in per_rank[0]] == [run(0), run(16), run(32), run(48)]  # j = 0, 2, 4, 6
    assert [b.sample_ids for b in per_rank[1]] == [run(8), run(24), run(40), run(0)]  # j = 7 wraps to the start
    single = data.val_batches(dataset, micro_batch=8, n=8)
    assert [b.sample_ids for b in single[0::2]] == [b.sample_ids for b in per_rank[0]]
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(single[1::2], per_rank[1]))
    assert [b.sample_ids for b in data.val_batches(dataset, micro_batch=8, n=8)] == [b.sample_ids for b in single]

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "t.txt").write_text("abc")
    ds = data.TokenDataset.build(make_cfg(tiny, tmp_path / "cache"), data.ByteTokenizer())
    with pytest.raises(ConfigError, match="data.val_fraction"):
        data.val_batches(ds, micro_batch=1, n=1)


def test_the_byte_tokenizer_as_a_tokenizer_json_gives_the_same_ids(tmp_path):
    """What `shardwise export` writes for a byte-tokenizer run: the `tokenizers` library reading it gives the
    byte values as ids, 256 as end-of-text, and the text back, for any text."""
    text = "héllo wörld\n\t日本語 \u2713 <|endoftext|> \x00\x7f\r end"
    path = tmp_path / "tokenizer.json"
    path.write_text(data.tokenizer_json(make_cfg(tmp_path, tmp_path / "cache"), tmp_path / "cache"))
    theirs, ours = data.HFTokenizer(path, "file"), data.ByteTokenizer()
    assert list(theirs.encode(text)) == ours.encode(text).tolist() == list(text.encode("utf-8"))
    assert theirs.eos_id == ours.eos_id == 256 and theirs.vocab_size == ours.vocab_size
    assert theirs.decode(ours.encode(text)) == text


def test_every_layout_of_one_global_batch_validates_on_the_same_samples(tmp_path):
    """train.val_batches counts global batches (as Megatron's --eval-iters): one process, two data-parallel
    ranks and accumulation, with the same global batch of 16, evaluate the same 64 samples. It counted
    micro-batches until a new user found the validation loss of an FSDP 2 run differ from a TP 2 run's."""
    from types import SimpleNamespace

    from shardwise.config import load_config
    from shardwise.train import build_data

    config = str(Path(__file__).parent / "configs" / "parity.toml")
    cache = f"data.cache_dir={str(tmp_path)!r}"
    seen = {}
    for micro, accum, dp in ((16, 1, 1), (8, 2, 1), (8, 1, 2), (4, 2, 2), (2, 1, 8)):
        cfg = load_config(config, [cache, f"train.micro_batch={micro}", f"train.grad_accum={accum}"])
        ids = []
        for rank in range(dp):
            runtime = SimpleNamespace(dp_rank=rank, dp_size=dp, main_first=lambda build: build())
            ids += [i for batch in build_data(cfg, runtime)[2] for i in batch.sample_ids]
        seen[micro, accum, dp] = sorted(ids)
    n_val = build_data(cfg, runtime)[0].num_samples("val")
    expected = sorted(i % n_val for i in range(cfg.train.val_batches * 16))
    assert all(ids == expected for ids in seen.values()), {k: len(v) for k, v in seen.items()}


@pytest.mark.parametrize("text", ["{bad", "[]"])
def test_a_file_the_tokenizers_library_cannot_read_names_the_field(tmp_path, text):
    from shardwise.config import ConfigError
    from shardwise.data import HFTokenizer

    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        HFTokenizer(tmp_path / "tokenizer.json", "file")
    assert e.value.field == "data.tokenizer" and "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["small", "vocab", "eos"])
def test_data_errors_under_nproc_are_one_line_before_any_rank_starts(tmp_path, capsys, monkeypatch, case):
    """A corpus smaller than a global batch, a tokenizer.json with more ids than model.vocab_size, or one without an
    end-of-text token, under `--nproc 2`: the launcher finds it before torchrun starts the ranks (it was the ranks'
    error, ~18 s in)."""
    import shardwise.launch.local
    from shardwise.cli import main

    def launched(*args, **kwargs):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(shardwise.launch.local, "launch_local", launched)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a few words of text\n" * (2 if case == "small" else 200))
    sets = [f"data.paths=['{corpus}']", f"data.cache_dir='{tmp_path / 'cache'}'", f"metrics.out_dir='{tmp_path}'",
            "parallel.dp_shard=2", "parallel.zero_stage=3", "data.seq_len=32", "train.micro_batch=2"]
    if case != "small":  # a word-level tokenizer of 400 ids (the model has 320)
        words = {f"w{i}": i for i in range(400)} | {"a": 400, "few": 401, "words": 402, "of": 403, "text": 404}
        if case == "eos":
            words = {w: i for w, i in words.items() if i < 300}
        else:
            words["<|endoftext|>"] = 405
        tok = tokenizers.Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(tmp_path / "tokenizer.json"))
        sets.append(f"data.tokenizer='{tmp_path / 'tokenizer.json'}'")
    code = main(["train", "--config", "tests/configs/parity.toml", "--nproc", "2", *[f"--set={s}" for s in sets]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    expected = {"small": "train.micro_batch: the train split has",
                "vocab": "model.vocab_size: 320 < the tokenizer's 406",
                "eos": "data.tokenizer: the tokenizer.json has none of the end-of-text tokens"}[case]
    assert err.startswith(f"shardwise: error: {expected}"), err


def test_an_end_of_text_token_declared_by_tokenizer_config_json(tmp_path):
    """A Hugging Face folder whose end-of-text is none of EOS_NAMES (Gemma's `<eos>`) declares it in its
    tokenizer_config.json: packing uses it (it was refused), and the cache key says so; without that file, or with
    a declared token the tokenizer lacks, the refusal names tokenizer_config.json."""
    tok = tokenizers.Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ConfigError, match="no tokenizer_config.json beside it names its eos_token"):
        data.HFTokenizer(path, "file")
    for declared in ("<eos>", {"content": "<eos>", "special": True}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": declared}))
        ours = data.HFTokenizer(path, "file")
        assert ours.eos_id == 1 and ours.name.endswith("-eos1")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</eos>"}))
    with pytest.raises(ConfigError, match="eos_token '</eos>' is not in it"):
        data.HFTokenizer(path, "file")


def test_a_validation_that_reads_prompts_alone_is_refused_naming_the_val_batches_that_reach_a_completion(tmp_path):
    """val_batches read the val split's first samples; where those are all prompt (a long prompt at the end of the
    corpus), no target counts and val_loss was 0 / 0 = nan at every evaluation. Expected from a hand-made stream
    (bytes as tokens): the first val sample with a counted target, and the val_batches that reach it."""
    from shardwise.config import load_config

    records = [{"prompt": "Q?", "completion": "a"}] * 30 + [{"prompt": "x" * 200, "completion": "y"}]
    corpus = tmp_path / "sft.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    counts = []
    for r in records:
        counts += [False] * len(r["prompt"]) + [True] * (len(r["completion"]) + 1)
    n_val = round(0.4 * len(counts) / 8)
    start = len(counts) - (n_val * 8 + 1)
    first = next(i for i in range(n_val) if any(counts[start + 8 * i + 1 : start + 8 * i + 9]))
    assert first > 4  # the first four (val_batches 4 of one sample each) are all prompt
    overrides = ["model.name='debug'", f"data.paths=['{corpus}']", f"data.cache_dir='{tmp_path / 'cache'}'",
                 "data.seq_len=8", "data.val_fraction=0.4", "train.micro_batch=1", "train.val_batches=4"]
    with pytest.raises(ConfigError) as e:
        data.prepare(load_config(None, overrides), dp_size=1)
    assert e.value.field == "train.val_batches" and f"set train.val_batches = {first + 1}" in str(e.value)
    assert "\n" not in str(e.value)
    data.prepare(load_config(None, [*overrides, f"train.val_batches={first + 1}"]), dp_size=1)
    data.prepare(load_config(None, [*overrides, "train.val_every=0"]), dp_size=1)  # no validation: nothing to refuse
