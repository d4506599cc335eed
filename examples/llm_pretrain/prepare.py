"""Make the example's data: two JSONL corpora (prose and code, generated here), a byte-level
BPE tokenizer trained on them (nothing is downloaded), and one datapipe token dataset per
corpus (``datapipe.pack_tokens``: Megatron's .bin/.idx with datapipe's checksums).

    python examples/llm_pretrain/prepare.py WORKDIR
"""

from __future__ import annotations

import json
import os
import random
import sys

import datapipe

WORDS = ("the a model token data loss step epoch rank batch learns reads writes shard cache "
         "pipeline gradient layer attention weight small large fast slow every each").split()
CODE = ["def {f}(x):", "    return x + {n}", "for i in range({n}):", "    y = {f}(i) * {n}", "print(y)",
        "class {F}:", "    def __init__(self):", "        self.v = {n}", "import os", "# {w} {w}"]


def prose(rng: random.Random) -> str:
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."
                    for _ in range(rng.randint(1, 8)))


def code(rng: random.Random) -> str:
    return "\n".join(rng.choice(CODE).format(f=rng.choice(["f", "g", "step"]), F=rng.choice(["A", "Net"]),
                                             n=rng.randint(0, 99), w=rng.choice(WORDS))
                     for _ in range(rng.randint(2, 20)))


def main(work: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    os.makedirs(work, exist_ok=True)
    corpora = {"prose": [prose(rng) for _ in range(1500)], "code": [code(rng) for _ in range(1500)]}
    for name, texts in corpora.items():
        with open(os.path.join(work, f"{name}.jsonl"), "w") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpora["prose"] + corpora["code"], trainer=trainer)
    tok.save(os.path.join(work, "tokenizer.json"))
    for name in corpora:
        r = datapipe.pack_tokens(os.path.join(work, f"{name}.jsonl"), os.path.join(work, name),
                                 tokenizer=tok, workers=1, overwrite=True)
        print(f"{name}: {r.documents} documents, {r.tokens} tokens in {r.parts} part(s)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llm-data")
