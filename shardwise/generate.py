"""Sampling text from a trained model: a KV cache, transformers' sampling filters, and `shardwise generate`.

The KV cache is a transform of the model from outside, like context parallelism: it swaps each attention's
`attention_fn` for one that appends the new keys and values to the cache and attends over everything cached.
The model is not copied and its forward is unchanged; the new tokens' rotary rows come from the `positions`
argument the model already takes. Without the cache, each step runs the training forward over the whole
sequence, which is the reference the cached decoding is tested against.

Sampling follows transformers' `generate`: temperature 0 is greedy (argmax); otherwise the logits are divided
by the temperature, then filtered by top-k and top-p (nucleus, Holtzman et al. 2019) in that order, and one
token is drawn with a seeded torch.Generator, so a seed gives the same text again.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.chat import chat_template, render_chat, special_tokens
from shardwise.errors import ConfigError
from shardwise.loss import autocast_context
from shardwise.model import Transformer, causal_attention

# ---------------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Keys and values of every position fed so far, per layer, in buffers sized for `max_len` positions."""

    def __init__(self, model: Transformer, batch: int, max_len: int):
        a = model.args
        self.shape = (a.n_layers, batch, a.n_kv_heads, max_len, a.head_dim)
        # allocated at the first keys, in their dtype: under mixed precision that is autocast's, not the weights'
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.lengths = [0] * a.n_layers
        """Positions cached per layer (equal after each full forward)."""

    @property
    def length(self) -> int:
        return self.lengths[0]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this chunk's k, v at the next positions, then its queries attend over all cached positions."""
        start, end = self.lengths[layer], self.lengths[layer] + q.shape[2]
        if end > self.shape[3]:
            raise ValueError(f"KV cache holds {self.shape[3]} positions; {end} asked for")
        if self.keys is None:
            self.keys = torch.zeros(self.shape, dtype=k.dtype, device=k.device)
            self.values = torch.zeros_like(self.keys)
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        self.lengths[layer] = end
        keys, values = self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        if start == 0:
            return causal_attention(q, keys, values)  # the prompt: exactly the training path's attention
        # query i sits at position start + i and sees positions 0..start + i (SDPA's is_causal would align the
        # mask to the top-left corner, as if the queries started at position 0)
        mask = torch.ones(q.shape[2], end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@contextlib.contextmanager
def kv_cache(model: Transformer, batch: int, max_len: int) -> Iterator[KVCache]:
    """Run `model` with a KV cache inside the block: feed each chunk with `positions` (its absolute positions,
    following the cached ones); the model's own attention comes back on exit."""
    cache = KVCache(model, batch, max_len)
    attentions = [block.attention for block in model.layers.values()]
    saved = [a.attention_fn for a in attentions]
    for i, a in enumerate(attentions):
        a.attention_fn = functools.partial(cache.attend, i)
    try:
        yield cache
    finally:
        for a, fn in zip(attentions, saved):
            a.attention_fn = fn


# ---------------------------------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    """Divides the logits; 0 picks the most likely token (greedy)."""
    top_k: int = 0
    """Keep the k most likely tokens (ties with the k-th kept, as transformers); 0 keeps all."""
    top_p: float = 1.0
    """Keep the most likely tokens whose probabilities sum to top_p (nucleus); 1 keeps all."""
    seed: int = 0
    """Seeds the torch.Generator the tokens are drawn with."""


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """transformers' TopKLogitsWarper then TopPLogitsWarper (min_tokens_to_keep 1): removed logits become -inf."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(logits, descending=False)
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p  # the unlikely tail whose mass is at most 1 - top_p
        drop[..., -1:] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token id from the last position's logits (vocab,)."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(model: Transformer, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_ids: Sequence[int] = (), use_cache: bool = True, precision: str = "fp32") -> list[int]:
    """The new token ids after `prompt` (a stop id, when one is drawn, ends the list and is included).

    `precision` is the run's: its autocast is what the weights were trained (and a LoRA base is stored) for.
    """
    device = model.tok_embeddings.weight.device
    generator = torch.Generator(device).manual_seed(sampling.seed)
    ids = list(prompt)
    budget = len(ids) + max_new_tokens
    with (kv_cache(model, 1, budget) if use_cache else contextlib.nullcontext()) as cache, \
            autocast_context(precision, device):
        for _ in range(max_new_tokens):
            if cache is None:
                logits = model(torch.tensor([ids], device=device))  # the training forward over everything
            else:
                fed = cache.length
                positions = torch.arange(fed, len(ids), device=device)
                logits = model(torch.tensor([ids[fed:]], device=device), positions)
            ids.append(next_token(logits[0, -1].float(), sampling, generator))
            if ids[-1] in stop_ids:
                break
    return ids[len(prompt):]


# ---------------------------------------------------------------------------------------------------
# Where the model and tokenizer come from: a run folder, or a Hugging Face folder


@dataclass
class Loaded:
    model: Transformer
    tokenizer: object
    """shardwise.data.Tokenizer."""
    prefix: list[int]
    """Ids put before the prompt: the run's end-of-text (training saw one before every document), or BOS."""
    stop_ids: list[int]
    precision: str = "fp32"
    """The autocast the model runs under: a run's train.precision."""
    chat: tuple[str, dict[str, str]] | None = None
    """A Hugging Face folder's chat template and its special tokens by name (bos_token, eos_token, ...)."""


def load_run(run_dir: str | Path) -> Loaded:
    """The newest checkpoint of a training run (any layout) in this one process, with the run's tokenizer."""
    from shardwise import data
    from shardwise.config import read_run_record
    from shardwise.layout import Layout
    from shardwise.parallel.runtime import Runtime
    from shardwise.train import model_from_checkpoint

    cfg = read_run_record(run_dir)
    cfg.parallel = Layout()  # one process reads any layout's checkpoint
    cfg.train.compile = False  # every step has another length: compiling would only recompile
    cfg.train.deterministic = False  # a training setting: sampling's CUDA cumsum has no deterministic kernel
    tokenizer = data.run_tokenizer(cfg.data, run_dir)  # the run's copy: the corpus may have changed since
    runtime = Runtime.create(cfg)
    try:
        model, _ = model_from_checkpoint(cfg, runtime)  # one process: the whole model, not pipeline stages
    finally:
        runtime.close()
    return Loaded(model.eval(), tokenizer, [tokenizer.eos_id], [tokenizer.eos_id], cfg.train.precision)


def load_hf(folder: str | Path, adapter: str | Path | None = None) -> Loaded:
    """A Hugging Face Llama folder (config.json, safetensors, tokenizer.json), as transformers would read it; with
    `adapter`, a peft LoRA adapter folder applied on it, as peft's PeftModel.from_pretrained would."""
    from shardwise.config import peft_adapter_lora
    from shardwise.data import HFTokenizer
    from shardwise.hf import import_hf, import_peft
    from shardwise.lora import apply_lora
    from shardwise.model import build_model, materialize
    from shardwise.model_args import args_from_hf_config, hf_biases, hf_rope_scaling

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    try:
        tokenizer = HFTokenizer(folder / "tokenizer.json", "file")
    except ConfigError as e:
        raise ConfigError("--hf", e.problem, "add the model's own tokenizer.json to the folder") from None
    scaling = hf_rope_scaling(config)
    if scaling:
        raise ConfigError("--hf", f"{folder}/config.json asks for {scaling!r} rotary scaling, which the engine's "
                          "rotary embedding does not have (its logits would not be the model's)",
                          "use transformers' generate for this model")
    biases = hf_biases(config)
    if biases:
        raise ConfigError("--hf", f"{folder}/config.json has {biases}: its projections add biases, which the "
                          "engine's Llama does not have (its logits would not be the model's)",
                          "use transformers' generate for this model")
    try:
        args = args_from_hf_config(config)
    except ValueError as e:  # a network the engine cannot express: it was a traceback
        raise ConfigError("--hf", f"{folder}/config.json: {e}", "point it at a Llama or Mixtral folder") from None
    if tokenizer.vocab_size > args.vocab_size:  # its last ids were an IndexError traceback, once a prompt had them
        raise ConfigError("--hf", f"{folder}/tokenizer.json has {tokenizer.vocab_size} ids, more than the model's "
                          f"{args.vocab_size} (config.json's vocab_size): it is not this model's tokenizer",
                          "add the model's own tokenizer.json to the folder")
    lora = peft_adapter_lora(adapter, args, "--adapter") if adapter else None
    model = build_model(args)
    if lora is not None:
        if args.n_experts:
            raise ConfigError("--adapter", "the engine's LoRA adapts dense blocks, and this model is a mixture of "
                              "experts", "apply the adapter with peft")
        apply_lora(model, lora)
    materialize(model, args, "cuda" if torch.cuda.is_available() else "cpu", seed=0, init_values=False)
    try:
        import_hf([model], folder)  # every parameter: nothing of the uninitialised storage is left
    except ValueError as e:  # a missing tensor, another shape, biases: it was a traceback
        raise ConfigError("--hf", str(e).split("; fix: ")[0], "point it at a Llama or Mixtral folder") from None
    if lora is not None:
        import_peft([model], adapter)
    prefix = [config["bos_token_id"]] if config.get("bos_token_id") is not None else []
    template = chat_template(folder)
    return Loaded(model.eval(), tokenizer, prefix, _hf_stop_ids(folder, config, tokenizer.eos_id),
                  chat=(template, special_tokens(folder)) if template else None)


def _hf_stop_ids(folder: Path, config: dict, tokenizer_eos: int) -> list[int]:
    """generation_config.json's eos_token_id, else config.json's, else the tokenizer's (an id or a list)."""
    generation = folder / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    eos = eos if eos is not None else config.get("eos_token_id", tokenizer_eos)
    return list(eos) if isinstance(eos, list) else [eos]


def complete(loaded: Loaded, prompt: str, max_new_tokens: int, sampling: Sampling,
             chat: list[dict[str, str]] | None = None) -> tuple[str, int | None]:
    """The prompt and what the model writes after it, as text (a stop token ends it and is not shown), and how
    many tokens it wrote before a stop token (None: it wrote max_new_tokens without one). With `chat` (messages,
    the last one the user's) the prompt is the folder's chat template rendered for them, and the text is the
    model's reply alone."""
    if chat is not None:
        template, special = loaded.chat
        body = loaded.tokenizer.encode_with_special_tokens(render_chat(template, chat, special))
        ids = [int(i) for i in body]  # the template writes the start token itself
    else:
        body = list(loaded.tokenizer.encode(prompt))
        ids = loaded.prefix + [int(i) for i in body]
    room = loaded.model.args.max_seq_len
    if not body and not loaded.prefix:
        raise ConfigError("--prompt", "it is empty and this model has no start token", "give some text")
    if len(ids) >= room:
        raise ConfigError("--prompt", f"its {len(ids)} tokens fill the model's {room} positions (max_seq_len)",
                          f"give a prompt of fewer than {room} tokens")
    if len(ids) + max_new_tokens > room:
        raise ConfigError("--max-new-tokens", f"the prompt's {len(ids)} tokens + {max_new_tokens} new ones exceed "
                          f"the model's {room} positions (max_seq_len)",
                          f"ask for at most {max(room - len(ids), 0)} new tokens, or give a shorter prompt")
    new = generate_ids(loaded.model, ids, max_new_tokens, sampling, loaded.stop_ids, precision=loaded.precision)
    stopped = None
    if new and new[-1] in loaded.stop_ids:
        new = new[:-1]
        stopped = len(new)
    return loaded.tokenizer.decode(new if chat is not None else body + new), stopped
