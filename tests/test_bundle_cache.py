"""A config reload loads only the tokenizers whose files changed (cortex/model_bundle.py, BundleCache): a load holds
the GIL for ~0.6 s, so loading them all again on every edit stalled extproc's event loop (and its gRPC health
answers) long enough for Envoy to skip Cortex."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from cortex.config import load_config
from cortex.config_watch import ConfigWatcher
from cortex.model_bundle import BundleCache
from extproc.registry import ModelRegistry

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def tokenizer_dir(root: Path, words: list[str], template: str = TEMPLATE) -> Path:
    """A word-level tokenizer with a chat template, as a Hugging Face directory."""
    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return root


def touch_later(path: Path) -> None:
    """A new mtime whatever the file system's clock resolution."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def test_unchanged_files_give_the_same_bundle(tmp_path: Path) -> None:
    d = tokenizer_dir(tmp_path / "t", ["hello", "world"])
    cache = BundleCache()
    first = cache.load("m", d)
    assert cache.load("m", d) is first
    assert first.encode("hello world", add_special_tokens=False) == [1, 2]


def test_an_edited_tokenizer_is_loaded_again(tmp_path: Path) -> None:
    d = tokenizer_dir(tmp_path / "t", ["hello", "world"])
    cache = BundleCache()
    first = cache.load("m", d)
    tokenizer_dir(d, ["world", "hello"])  # same size, other ids
    touch_later(d / "tokenizer.json")
    second = cache.load("m", d)
    assert second is not first
    assert second.encode("hello world", add_special_tokens=False) == [2, 1]


def test_an_edited_chat_template_is_loaded_again(tmp_path: Path) -> None:
    d = tokenizer_dir(tmp_path / "t", ["hello"])
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    cache = BundleCache()
    first = cache.load("m", d, template)
    assert cache.load("m", d, template) is first
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    touch_later(template)
    second = cache.load("m", d, template)
    assert second is not first and second.chat_template is not None and "[" in second.chat_template
    # A file beside the tokenizer counts too (chat_template.jinja wins over tokenizer_config.json's).
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert cache.load("m", d) is not cache.load("m", d, template)


def test_load_all_shares_a_source_and_drops_the_unnamed(tmp_path: Path) -> None:
    a = tokenizer_dir(tmp_path / "a", ["hello"])
    b = tokenizer_dir(tmp_path / "b", ["world"])
    cache = BundleCache()
    both = cache.load_all([("x", a, None), ("y", a, None), ("z", b, None)])
    assert both["x"] is both["y"] and both["z"] is not both["x"]
    only_a = cache.load_all([("x", a, None)])
    assert only_a["x"] is both["x"]
    assert cache.load("z", b) is not both["z"]  # dropped by the last load_all: loaded afresh


def test_an_edit_that_changes_no_model_file_loads_no_tokenizer(tmp_path: Path) -> None:
    d = tokenizer_dir(tmp_path / "t", ["hello", "world"])
    path = tmp_path / "cortex.yaml"
    cfg = {"runtime_dir": str(tmp_path / "rt"),
           "models": [{"name": "m", "engine": "vllm", "tokenizer": str(d)}],
           "workers": [{"id": "w0", "url": "http://127.0.0.1:9", "model": "m", "engine": "vllm"}]}
    path.write_text(yaml.safe_dump(cfg))
    bundles = BundleCache()
    running = ModelRegistry(load_config(path), bundles)
    watcher = ConfigWatcher(path, lambda c: ModelRegistry(c, bundles), bundles)

    def edit(change: dict) -> ModelRegistry | None:
        path.write_text(yaml.safe_dump(cfg | change))
        touch_later(path)
        return asyncio.run(watcher.poll())

    tenants = edit({"tenants": [{"id": "t", "api_keys": ["sha256:" + "0" * 64]}]})
    assert tenants is not None and tenants.bundles["m"] is running.bundles["m"]
    alias = edit({"aliases": [{"name": "chat", "targets": [{"model": "m"}]}]})
    assert alias is not None and alias.bundles["m"] is running.bundles["m"]
    tokenizer_dir(d, ["world", "hello"])
    touch_later(d / "tokenizer.json")
    retrained = edit({})
    assert retrained is not None and retrained.bundles["m"] is not running.bundles["m"]
    assert retrained.bundles["m"].encode("hello", add_special_tokens=False) == [2]
