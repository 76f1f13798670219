"""The texts SegmentEncoder's load-time self-check encodes both piece by piece and whole: the tokenizer's added
tokens in many textual surroundings, and conversations rendered with the model's chat template."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cortex.model_bundle import ModelBundle

# Text fragments placed around tokens in the self-check: whitespace runs (prefix-space and `\s+(?!\S)`
# rules), combining marks (NFC), CJK, emoji, digits, contractions, CRLF, punctuation that starts tokens.
FRAGMENTS = (
    "", " ", "  ", "\n", "\n\n", " \n ", "\t", "x", " x", "x ", "Hello world", " Hello", "héllo wörld",
    "e\u0301", "\u0301x", "日本語のテキスト", "😀 emoji", "12345 678", "don't", "\r\n", "\u00a0nbsp", "<", ">",
    "|", "'s", "  indented\n    code()", "▁x", "ab\u200dcd",
)
_AROUND = (("", ""), ("x", "y"), (" ", " "), ("Hello ", "\nworld"), ("\n", "\n"), ("héllo", "e\u0301"),
           ("don't ", " 12345"), ("  ", "x"), ("x", "  "), ("日本", "語"), ("\u0301", "\u0301"))
_TOKEN_SAMPLE = 48
# Conversations rendered with the model's chat template as probes: roles, whitespace edges, empty content.
_PROBE_CHATS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("system", "You are a helpful assistant."), ("user", "Hi there!"), ("assistant", "Hello! How can I help?"),
     ("user", "Tell me a joke.")),
    (("user", "  leading and trailing spaces  "), ("assistant", "\n\nnewlines\n"), ("user", " ")),
    (("system", ""), ("user", "日本語 😀 e\u0301 don't 12345")),
    (("user", "x"),),
)


def probe_texts(boundary: list[str], complex_tokens: list[str], extra: list[str]) -> list[str]:
    """Texts that put the tokenizer's added tokens in the surroundings where per-piece encoding could differ."""
    if len(boundary) > _TOKEN_SAMPLE:
        # The lowest ids (the ones templates use: BOS/EOS, role markers) plus an even spread of the rest.
        head = boundary[: _TOKEN_SAMPLE // 2]
        rest = boundary[_TOKEN_SAMPLE // 2:]
        step = max(1, len(rest) // (_TOKEN_SAMPLE // 2))
        sample = head + rest[::step]
    else:
        sample = list(boundary)
    # Tokens a template or the caller's probes actually use are always included.
    used = [t for t in boundary if t not in sample and any(t in p for p in extra)]
    sample += used
    probes: list[str] = list(FRAGMENTS)
    probes.append("".join(FRAGMENTS))
    n_frag = len(FRAGMENTS)
    for i, t in enumerate(sample + complex_tokens):
        for a, b in _AROUND:
            probes.append(a + t + b)
        probes.append(FRAGMENTS[i % n_frag] + t + FRAGMENTS[(i * 7 + 3) % n_frag])
        probes.append(t + t + " " + t)
    for t1, t2 in zip(sample, sample[1:] + sample[:1], strict=True):
        probes += [t1 + t2, t1 + " x " + t2 + "y", "a" + t1 + "\n" + t2 + "\n\nb", t1 + "\u0301" + t2]
    for c in complex_tokens:
        for t in sample[:16]:
            probes += [t + c, c + t, t + " " + c + " " + t, "x" + c + "y" + t + "  " + c, t + "ab" + c + "cd" + t]
    probes += extra
    return probes


def template_probes(bundle: ModelBundle) -> list[str]:
    """Conversations rendered with the bundle's chat template (skipped when it has none or refuses one)."""
    from cortex.model_bundle import TemplateError

    if not bundle.has_chat_template:
        return []
    try:
        tokens = [a.content for a in bundle.tokenizer.get_added_tokens_decoder().values() if a.content]
    except Exception:  # a tokenizer without added tokens needs no token-in-content probes
        tokens = []
    chats: list[list[dict[str, Any]]] = [[{"role": r, "content": c} for r, c in chat] for chat in _PROBE_CHATS]
    # Users type special-token strings; the template renders them verbatim into the prompt.
    chats.append([{"role": "user", "content": " ".join(tokens[:32]) + " and " + "".join(tokens[:8])}])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    out: list[str] = []
    for chat in chats:
        for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False}, {"tools": tools}):
            try:
                out.append(bundle.render_chat(chat, **kwargs))
            except TemplateError:
                continue
    return out
