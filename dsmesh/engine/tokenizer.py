"""Text <-> token ids for DeepSeek checkpoints, without depending on transformers.

``Tokenizer`` reads a checkpoint's ``tokenizer.json`` (with the ``tokenizers`` library), its
``tokenizer_config.json`` and its chat template files, and behaves like transformers 5's
``AutoTokenizer`` on the same folder: same ids, same decoded text, same rendered chat template
(DeepSeek-V3's, tool calls included, is tested token for token).
``IncrementalDetokenizer`` turns a stream of generated ids into text deltas that never split a
UTF-8 character. ``write_byte_level_tokenizer`` writes the tiny tokenizer of dsmesh's default
test model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # more named templates, one <name>.jinja each
DEFAULT_TEMPLATE = "default"
TOOL_USE_TEMPLATE = "tool_use"  # picked over the default when the request has tools

# The named special tokens transformers hands to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning goes by; transformers fills each from the first one set.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REPLACEMENT_CHAR = "\ufffd"


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``), inverted: symbol -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    symbols = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in symbols)
    for n, b in enumerate(shifted):
        symbols[b] = chr(256 + n)
    return {symbol: b for b, symbol in symbols.items()}


_BYTE_LEVEL_DECODER = _byte_level_decoder()


class Tokenizer:
    """A ``tokenizers`` backend plus the special tokens and chat templates of one checkpoint.

    Special tokens on ``encode(..., add_special_tokens=True)`` come from the backend's
    post-processor, exactly as in transformers 5 (which ignores ``add_bos_token`` when
    ``tokenizer.json`` exists; DeepSeek-V3's has ``add_bos_token: false`` and a post-processor
    that adds nothing, so its prompts get BOS from the chat template only). When
    ``tokenizer.json`` has no post-processor, one is built from ``add_bos_token`` /
    ``add_eos_token`` (as Llama-style tokenizers do); transformers 5 would add nothing there.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str | None] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool = False,
        chat_template: str | Mapping[str, str] | None = None,
    ) -> None:
        """Wrap ``backend``, which this object takes ownership of and may modify.

        ``special_tokens`` maps names such as ``"bos_token"`` to token strings (None: unset);
        ``add_bos_token`` defaults to True when a bos token is given. ``chat_template`` is one
        template, or named ones (``"default"``, ``"tool_use"``, ...).
        """
        self._backend = backend
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if chat_template is None or isinstance(chat_template, str):
            self._chat_templates = (
                {} if chat_template is None else {DEFAULT_TEMPLATE: chat_template}
            )
        else:
            self._chat_templates = dict(chat_template)
        self._compiled: dict[str, jinja2.Template] = {}
        self._token_bytes: dict[int, bytes] = {}
        # transformers adds named special tokens missing from the vocab as new special tokens.
        missing = [t for t in self._special_tokens.values() if backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens(
                [
                    tokenizers.AddedToken(t, special=True, normalized=False)
                    for t in dict.fromkeys(missing)
                ]
            )
        if backend.post_processor is None:
            bos, eos = self.bos_token, self.eos_token
            add_bos = (bos is not None) if add_bos_token is None else add_bos_token
            backend.post_processor = _template_processor(
                bos if add_bos else None,
                self.bos_token_id,
                eos if add_eos_token else None,
                self.eos_token_id,
            )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the optional ``tokenizer_config.json`` from ``path``.

        Chat templates, as transformers 5 finds them: ``chat_template.jinja`` (the default) and
        ``additional_chat_templates/<name>.jinja``, when any exists, replace the config's
        ``chat_template`` (one string, or a list of ``{"name", "template"}``).
        """
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in checkpoint folder: {tokenizer_file}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config_file = folder / TOKENIZER_CONFIG_FILE
        config: dict[str, Any] = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        chat_template = _template_files(folder) or _config_templates(config.get("chat_template"))
        add_bos_token = config.get("add_bos_token")
        return cls(
            backend,
            special_tokens={
                name: _token_content(config.get(name)) for name in _NAMED_SPECIAL_TOKENS
            },
            add_bos_token=None if add_bos_token is None else bool(add_bos_token),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=chat_template,
        )

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    @property
    def vocab_size(self) -> int:
        """Size of the full vocabulary, added tokens included (``len()`` of a HF tokenizer)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The default chat template (None when the checkpoint has none)."""
        return self._chat_templates.get(DEFAULT_TEMPLATE)

    @property
    def chat_templates(self) -> dict[str, str]:
        """Every chat template by name; a single template is named ``"default"``."""
        return dict(self._chat_templates)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS/EOS as the checkpoint says."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not form a whole UTF-8 character decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in decoded text (a special token: its text, UTF-8).

        A token that is part of a UTF-8 character (a byte-level BPE symbol, or a byte-fallback
        ``<0xNN>`` token) gives its raw bytes, which ``decode([token_id])`` would turn into
        U+FFFD: OpenAI's logprobs report them so a client can join split characters.
        """
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        text = self._backend.decode([token_id], skip_special_tokens=False)
        raw = text.encode()
        piece = self._backend.id_to_token(token_id)
        if _REPLACEMENT_CHAR in text and piece is not None:
            if all(ch in _BYTE_LEVEL_DECODER for ch in piece):
                raw = bytes(_BYTE_LEVEL_DECODER[ch] for ch in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                raw = bytes([int(piece[3:5], 16)])
        self._token_bytes[token_id] = raw
        return raw

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the checkpoint's chat template, as transformers 5 does.

        The ``"tool_use"`` template when ``tools`` is given and the checkpoint names one, else
        the default. The template sees ``messages`` (keys whose value is None dropped, the
        reasoning under all its names), ``add_generation_prompt``, ``tools``, ``documents``,
        the named special tokens (``bos_token``, ``eos_token``, ...) and every ``extra``
        keyword, with transformers' globals (``raise_exception``, ``strftime_now``) and
        filters (``tojson``). With ``tokenize`` the text is encoded without adding special
        tokens, since the template writes them itself. Template errors raise
        ``jinja2.TemplateError`` (``raise_exception``) or other exceptions from Jinja.
        """
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        variables: dict[str, Any] = dict(self._special_tokens)
        variables.update(extra)
        text = self._compiled_template(self._template_name(tools)).render(
            messages=_template_messages(messages),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_name(self, tools: list[dict[str, Any]] | None) -> str:
        """Which template renders a request (transformers' ``get_chat_template``)."""
        if not self._chat_templates:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json)")
        if tools is not None and TOOL_USE_TEMPLATE in self._chat_templates:
            return TOOL_USE_TEMPLATE
        if DEFAULT_TEMPLATE in self._chat_templates:
            return DEFAULT_TEMPLATE
        raise ValueError(
            f"no {DEFAULT_TEMPLATE!r} chat template among {sorted(self._chat_templates)}"
        )

    def _compiled_template(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            self._compiled[name] = _compile_chat_template(self._chat_templates[name])
        return self._compiled[name]


class IncrementalDetokenizer:
    """Turns generated ids, pushed a few at a time, into text deltas.

    Keeps a window ``ids[prefix:]`` where the first ``read`` ids of the window are text already
    returned (context for the decoder), and decodes only the window, so a push costs the same
    however long the sequence. A push returns the window's new text up to the last complete
    character: U+FFFD at the end of the decoded bytes may be half a UTF-8 character (a byte
    token of a character split over several tokens), so that tail waits for the next ids. Once
    the window decodes with no such tail, the window moves on. Concatenating every return
    value, ``flush()`` included, gives ``decode(all_ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window_ids: list[int] = []  # ids from the prefix offset on
        self._num_read = 0  # leading ids of the window whose text was already returned
        self._num_pending_chars = 0  # characters returned beyond those ids' text

    def push(self, new_ids: Sequence[int]) -> str:
        """Add ``new_ids``; return the text they complete ("" while a character is partial)."""
        self._window_ids.extend(new_ids)
        prefix_text = self._decode(self._window_ids[: self._num_read])
        text = self._decode(self._window_ids)
        shown = len(prefix_text) + self._num_pending_chars
        if text.endswith(_REPLACEMENT_CHAR):
            # Characters before the tail are final: later bytes cannot change them.
            end = len(text.rstrip(_REPLACEMENT_CHAR))
            delta = text[shown:end] if end > shown else ""
            self._num_pending_chars += len(delta)
            return delta
        if len(text) < shown:
            return ""
        self._window_ids = self._window_ids[self._num_read :]
        self._num_read = len(self._window_ids)
        self._num_pending_chars = 0
        return text[shown:]

    def flush(self) -> str:
        """Return all text not yet returned, even a trailing incomplete character, and reset."""
        prefix_text = self._decode(self._window_ids[: self._num_read])
        text = self._decode(self._window_ids)
        shown = len(prefix_text) + self._num_pending_chars
        self._window_ids, self._num_read, self._num_pending_chars = [], 0, 0
        return text[shown:]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


# --- the tiny byte-level tokenizer of dsmesh's default model ------------------------------------

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

# DeepSeek-V3's template, shortened: system prompts joined first, then User/Assistant turns,
# EOS after each assistant turn, and "<｜Assistant｜>" as the generation prompt.
DEFAULT_CHAT_TEMPLATE = (
    "{%- set system_prompt = messages | selectattr('role', 'equalto', 'system')"
    " | map(attribute='content') | join('\\n\\n') -%}"
    "{{ bos_token }}{{ system_prompt }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '" + USER_TOKEN + "' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '" + ASSISTANT_TOKEN + "' + message['content'] + eos_token }}"
    "{%- elif message['role'] != 'system' -%}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '" + ASSISTANT_TOKEN + "' }}{%- endif -%}"
)

_BPE_VOCAB_SIZE = 508  # 256 byte symbols + 252 merges; the 4 special tokens make 512
_TRAINING_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens "
    "and predicts the next one. Tokens are pieces of words: common words such as the, and, "
    "of, to, in, is, that, for, it, with, as, was, on, are, be, this, have, from, or, by, one, "
    "had, not, but, what, all, were, when, we, there, can, an, your, which, their, said, if, do, "
    "will, each, about, how, up, out, them, then, she, many, some, so, these, would, other, into, "
    "has, more, her, two, like, him, see, time, could, no, make, than, first, been, its, who, "
    "now, people, my, made, over, did, down, only, way, find, use, may, water, long, little, "
    "very, after, words, called, just, where, most, know, get, through, back, much, before, go, "
    "good, new, write, our, used, me, man, too, any, day, same, right, look, think, also, "
    "around, another, came, come, work, three, must, because, does, part. Hello, world! "
    "The server splits prefill and decode across machines, moves the key value cache between "
    "them, and routes each expert of the mixture to the device that holds it. Attention, "
    "experts, layers, weights, tensors, requests, streams, and tokens: inference is mostly "
    "moving numbers to where they are needed, then multiplying them together quickly. "
    "What is the capital of France? Paris is the capital of France. Please answer briefly. "
    "Sure, here is a short answer. Thank you for asking. Let me think step by step. "
)


def write_byte_level_tokenizer(out_dir: str | Path, model_max_length: int = 4096) -> int:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` to ``out_dir``; return vocab size.

    A byte-level BPE in the style of DeepSeek-V3: ids 0..255 are the byte symbols in sorted
    order, then merges learnt from a short embedded corpus, then the four DeepSeek special
    tokens. Training is deterministic, so the files are byte-identical on every call.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_TRAINING_CORPUS], trainer=trainer)
    backend.add_special_tokens(
        [tokenizers.AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    backend.post_processor = _template_processor(
        BOS_TOKEN, backend.token_to_id(BOS_TOKEN), None, None
    )
    backend.save(str(out / TOKENIZER_FILE))
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / TOKENIZER_CONFIG_FILE).write_text(text, encoding="utf-8")
    return backend.get_vocab_size(with_added_tokens=True)


# --- helpers ------------------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-style dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"cannot read a special token from {value!r}")


def _config_templates(value: Any) -> str | dict[str, str] | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return {item["name"]: item["template"] for item in value}
    raise ValueError(f"chat_template must be a string or a list of named templates: {value!r}")


def _template_files(folder: Path) -> dict[str, str]:
    """``chat_template.jinja`` (as ``"default"``) and ``additional_chat_templates/*.jinja``."""
    templates: dict[str, str] = {}
    default = folder / CHAT_TEMPLATE_FILE
    if default.is_file():
        templates[DEFAULT_TEMPLATE] = default.read_text(encoding="utf-8")
    more = folder / CHAT_TEMPLATE_DIR
    if more.is_dir():
        for path in sorted(more.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return templates


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers 5 hands them to a template: keys whose value is None dropped
    (templates handle a missing key better than None), and a reasoning given under one of
    its names (``reasoning_content``, ``thinking``, ``reasoning``) given under the others."""
    out = []
    for message in messages:
        plain = {k: v for k, v in message.items() if v is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _template_processor(
    bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None
) -> processors.TemplateProcessing:
    """``[bos] $A [eos]`` (pairs: ``[bos] $A [eos] [bos] $B [eos]``), as transformers builds it."""

    def wrap(sequence: str, type_id: int) -> str:
        head = f"{bos}:{type_id} " if bos is not None else ""
        tail = f" {eos}:{type_id}" if eos is not None else ""
        return f"{head}{sequence}:{type_id}{tail}"

    single = wrap("$A", 0)
    pair = f"{single} {wrap('$B', 1)}"
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None and i is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' templates mark the assistant's
    text with it (for assistant-token masks); rendered here as its body, as transformers does."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
