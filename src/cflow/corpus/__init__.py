"""Story corpora distilled from a chat model: the recipe, the batched distillation, the
shard directory it writes, and the build that turns raw answers into a deduplicated corpus.

    recipe    the TinyStories recipe: a seed -> its prompt (word lists shipped in words/); cleaning
    shards    a story directory: JSONL shards + manifest, append-only, crash- and Ctrl-C-safe
    distill   the teacher's batched decode into a story directory; resumable
    build     cleaning, exact and near-duplicate removal (MinHash LSH), the stable split, the corpus file

No torch here: distilling needs the runtime only; building needs datasketch (the `data` extra).
"""
