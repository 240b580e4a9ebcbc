"""A small multilingual jsonl corpus, generated: what a newcomer's own data looks like (prose in several scripts,
source code, emoji), a few hundred documents, so that the own-data path meets a corpus that cannot fill a
4096-piece vocabulary and characters a tokenizer may not have learned."""
from __future__ import annotations

import json
import random

PROSE = {
    "en": ["The river rose three feet overnight and the bridge was closed.",
           "She opened the window, and the smell of rain filled the room.",
           "Every morning the baker lights the oven before the town wakes up."],
    "de": ["Der Fluss stieg über Nacht um drei Fuß, und die Brücke wurde gesperrt.",
           "Die Straßenbahn fährt bis zur Endhaltestelle am Schloss."],
    "fr": ["La rivière a monté de trois pieds pendant la nuit ; le pont est fermé.",
           "Elle a ouvert la fenêtre et l'odeur de la pluie a rempli la pièce."],
    "es": ["El río creció tres pies durante la noche y cerraron el puente.",
           "Cada mañana el panadero enciende el horno antes de que despierte el pueblo."],
    "el": ["Ο ποταμός ανέβηκε τρία πόδια μέσα στη νύχτα και η γέφυρα έκλεισε.",
           "Κάθε πρωί ο φούρναρης ανάβει τον φούρνο."],
    "ru": ["За ночь река поднялась на три фута, и мост закрыли.",
           "Каждое утро пекарь разжигает печь, пока город спит."],
    "zh": ["河水一夜之间上涨了三英尺，桥被关闭了。", "每天早上，面包师在小镇醒来之前点燃烤炉。"],
    "ja": ["川は一晩で三フィート増水し、橋は閉鎖された。", "毎朝、パン屋は町が目覚める前にオーブンに火を入れる。"],
}

CODE = {
    "python": "def {name}(items):\n    total = 0\n    for x in items:\n        total += x * {k}\n    return total\n",
    "c": "int {name}(const int *v, int n) {{\n\tint s = 0;\n\tfor (int i = 0; i < n; i++)\n\t\ts += v[i] * {k};\n"
         "\treturn s;\n}}\n",
    "javascript": "function {name}(items) {{\n  return items.reduce((s, x) => s + x * {k}, 0);\n}}\n",
    "rust": "fn {name}(v: &[i64]) -> i64 {{\n    v.iter().map(|x| x * {k}).sum()\n}}\n",
}

EMOJI = ["🚀", "🌧️", "🍞", "✅", "🎉", "🌉"]
NAMES = ["weighted_sum", "scale", "accumulate", "fold_values", "tally"]


def document(rng: random.Random, i: int) -> str:
    """Document `i`: code for every third, prose in one language (a few sentences, an emoji) for the others."""
    if i % 3 == 0:
        lang = sorted(CODE)[i // 3 % len(CODE)]
        return f"// {lang}\n" + CODE[lang].format(name=rng.choice(NAMES) + str(i), k=rng.randint(2, 9))
    lang = sorted(PROSE)[i % len(PROSE)]
    sentences = [rng.choice(PROSE[lang]) for _ in range(rng.randint(2, 5))]
    return " ".join(sentences) + " " + rng.choice(EMOJI) + f" ({i})"


def write_corpus(path: str, n_docs: int = 600, seed: int = 0) -> None:
    """`n_docs` documents as jsonl lines `{"text": ...}` at `path`."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n_docs):
            f.write(json.dumps({"text": document(rng, i)}, ensure_ascii=False) + "\n")
