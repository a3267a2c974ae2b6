"""Chat templates: a Hugging Face folder's Jinja template that turns messages into the text an instruction-tuned
model was trained on (its roles, turn markers and generation prompt). No torch here: `shardwise generate` checks
the folder's template before it imports torch."""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.errors import ConfigError


def chat_template(folder: Path) -> str | None:
    """A Hugging Face folder's chat template, where transformers reads it: chat_template.jinja (what
    newer transformers' save_pretrained writes), else tokenizer_config.json's "chat_template" (a string, or a
    list of named templates, of which the one named "default" is used); None if it has none."""
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    config = folder / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens a template sees by name (transformers passes its tokenizer's special_tokens_map)."""


def special_tokens(folder: Path) -> dict[str, str]:
    """The folder's special tokens by name, as text: special_tokens_map.json's, then tokenizer_config.json's (each a
    string, or a dict whose "content" is the text)."""
    found = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        entries = json.loads(file.read_text()) if file.is_file() else {}
        for key in SPECIAL_TOKEN_NAMES:
            value = entries.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found.setdefault(key, value)
    return found


def render_chat(template: str, messages: list[dict[str, str]], special: dict[str, str]) -> str:
    """`template` rendered for `messages`, ready for the assistant's reply, as transformers' apply_chat_template
    renders it (add_generation_prompt=True; transformers/utils/chat_template_utils.py): jinja2's immutable sandbox
    (a template from the Hub is untrusted code), trim_blocks and lstrip_blocks, loop controls, the
    `{% generation %}` tag as a plain block, raise_exception, strftime_now, a tojson that does not escape HTML,
    and the special tokens by name. These few lines are written here because transformers is not a dependency of
    shardwise; tests/test_generate.py holds them to its output. A template that raises is a ConfigError."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (what a reply is, for training masks): its body, as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(messages=messages, tools=None, documents=None,
                                                add_generation_prompt=True, **special)
    except jinja2.exceptions.TemplateError as e:
        raise ConfigError("--chat", f"the folder's chat template refused the conversation: {e}",
                          "check --system and --prompt against what the model's template accepts") from None
