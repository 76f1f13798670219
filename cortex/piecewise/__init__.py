"""Segment-wise tokenization: encode the text between a tokenizer's added tokens piece by piece, with a cache.

Why it is exact. `tokenizers` first cuts its input at every added token that is matched on the raw text
(`normalized: false`; leftmost-longest over all of them, special or not), and only then normalizes,
pre-tokenizes and runs the model on each remaining piece by itself. So

    ids(p0 + T1 + p1 + T2 + p2) == ids(p0) + [id(T1)] + ids(p1) + [id(T2)] + ids(p2)

as long as nothing in a piece's encoding depends on what lies outside it. Chat templates put such tokens
(`<|im_start|>`, `<|eot_id|>`, ...) between messages, so a repeated system prompt and a conversation's earlier
turns come back as the same pieces, and a bounded LRU cache of their ids turns them into lookups: only the
new tail is tokenized.

What can break the equivalence, and what is done about it:
  * a pre-tokenizer that treats the piece at offset 0 differently (Metaspace `prepend_scheme: first`): every
    later piece is encoded behind one boundary token, whose id is then dropped ("anchored" mode), which is
    exactly the position it has in the whole text;
  * added tokens with lstrip / rstrip / single_word reach into the text around them: Cortex never cuts at
    them (they stay inside their piece, where the library sees the same neighbours), but still matches them
    so overlapping tokens resolve as the library resolves them; single_word can still see a different
    neighbour at a piece edge, which the self-check catches;
  * `encode_special_tokens` (special tokens encoded as text): special tokens are not cut at;
  * truncation or padding configured in tokenizer.json: whole-text encoding only;
  * anything else, unforeseen: each tokenizer is checked at load over a set of probe texts (its own added
    tokens in many textual surroundings, plus conversations rendered with its chat template); a tokenizer
    that fails in both modes is encoded whole-text, and `reason` says why.

The per-request path does no tokenizer introspection: one precompiled regex split, dictionary lookups, one
encode call per piece not cached, and a list assembly. Pieces are encoded by tiktoken where cortex/fast_bpe.py
proved at load that it gives the library's ids (`backend`, `backend_reason` say which and why), else by one
batched `encode_batch_fast` call (no offsets computed; TOKENIZERS_PARALLELISM=false keeps it to one core).
Not thread-safe: one encoder per event loop (extproc is single-threaded per process).

One module per part, each importing only the ones above it:

    piece_cache.py       the text cut at boundary tokens, and the pieces' ids in a bounded LRU cache (PieceCache)
    token_cursor.py      the walk: a text's ids piece by piece, only as far as they are asked for (TokenCursor)
    probes.py            the texts the load-time self-check encodes both ways
    segment_encoder.py   the boundary rules, proven at load: which tokens to cut at, anchored or plain, which
                         library encodes the pieces (SegmentEncoder); one encoder per tokenizer (EncoderSet)
"""
