"""The data both systems train on, written once; run with the python of an environment that has shardwise.

    python prep_data.py ASSETS CONFIG [--set KEY=VALUE ...]

1. Under ASSETS (torchtitan's `tests/assets`, which its debug model reads relative to the working directory),
   if not there yet:
   - tokenizer/{tokenizer.json, tokenizer_config.json}: a byte-level BPE, vocab 2048 (with <|endoftext|> and
     <|begin_of_text|>, the end and start tokens torchtitan's tokenizer looks for), trained on shardwise's default
     corpus (this Python's standard-library *.py files, 16 MiB, `shardwise.data.corpus_files`);
   - c4_test/data.json: torchtitan's c4_test dataset replaced by that same corpus, one {"text": file} per line.
   shardwise reads the same tokenizer.json (data.tokenizer) and its default corpus, in the same file order.
2. Tokenizes the corpus into shardwise's token cache for CONFIG with the overrides (data.cache_dir among them),
   so that no timed run pays for it.
"""

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardwise.config import DataConfig, load_config
from shardwise.data import TokenDataset, _read_text, build_tokenizer, corpus_files

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|begin_of_text|>"]


def write_assets(assets: Path) -> None:
    tokenizer_dir, corpus_dir = assets / "tokenizer", assets / "c4_test"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    files = corpus_files(DataConfig())  # the default corpus, in the order shardwise packs it
    texts = [_read_text(f) for f in files]
    print(f"corpus: {len(files)} files, {sum(map(len, texts)) / 1e6:.1f} M characters")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>", "add_bos_token": True, "add_eos_token": True,
    }, indent=1))
    # written last: its presence means the assets are complete
    with open(corpus_dir / "data.json", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    print(f"wrote {tokenizer_dir} (vocab {tokenizer.get_vocab_size(with_added_tokens=True)}) and {corpus_dir}")


def warm_token_cache(config: str, overrides: list[str]) -> None:
    data = load_config(config, overrides).data
    TokenDataset.build(data, build_tokenizer(data, Path(data.cache_dir)), Path(data.cache_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("assets", type=Path)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if not (args.assets / "c4_test" / "data.json").is_file():
        write_assets(args.assets)
    warm_token_cache(args.config, args.overrides)


if __name__ == "__main__":
    main()
