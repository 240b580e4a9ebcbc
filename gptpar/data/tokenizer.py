"""The tokenizer interface shared by the tools and the trainer: encode, decode (optionally without the special
tokens), vocab_size, eod, pad, bos (a Hugging Face tokenizer's declared bos_token, else None).

Two backends: a SentencePiece `.model` (what tools/train_tokenizer.py writes; EOD is SentencePiece's EOS
id, as in Megatron's GPTSentencePieceTokenizer) and, where the `tokenizers` package is installed, a
Hugging Face fast tokenizer: a `tokenizer.json` file, or a tokenizer directory as
`PreTrainedTokenizerFast.save_pretrained` writes it (BLOOM's and GPT-2's are such directories). A directory
is read with `tokenizers` alone (its tokenizer.json, and the special tokens its tokenizer_config.json or
special_tokens_map.json names), so preprocessing workers never import transformers.
"""
import json
import os

from gptpar.data.indexed import DataError

# Special-token spellings looked up in a Hugging Face tokenizer.json, most specific first.
HF_EOD_TOKENS = ("<|endoftext|>", "<eod>", "</s>", "<eos>", "<|eos|>")
HF_PAD_TOKENS = ("<pad>", "<|padding|>", "[PAD]")


class SentencePieceTokenizer:
    def __init__(self, path):
        import sentencepiece as spm
        self.path = path
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{path}: not a SentencePiece model ({e}); train one with tools/train_tokenizer.py") from e
        self.vocab_size = self._sp.get_piece_size()
        eod = self._sp.eos_id()
        if eod < 0:
            eod = self._sp.piece_to_id("<eod>")
            if eod == self._sp.unk_id():
                raise DataError(f"{path}: the model has neither an EOS id nor an '<eod>' piece; "
                                f"retrain it with tools/train_tokenizer.py, which adds one")
        self.eod = eod
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        self.bos = None  # gptpar's data carries no BOS: documents are separated by EOD
        self.declared_bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None  # the model's own, for an export

    def encode(self, text):
        return self._sp.encode(text)

    def decode(self, ids, skip_special_tokens=False):
        # SentencePiece's decode drops control pieces (EOS, BOS, PAD) either way
        return self._sp.decode(list(map(int, ids)))


class HFTokenizer:
    """A Hugging Face fast tokenizer from a `tokenizer.json` file or a tokenizer directory.

    vocab_size is the largest id + 1 (added tokens included), so "every id < model.vocab_size" is the check
    it feeds. EOD: the directory's declared `eos_token`, else the first of HF_EOD_TOKENS in the vocabulary."""

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise DataError(f"{path}: loading a Hugging Face tokenizer needs the 'tokenizers' package") from e
        self.path = path
        json_path, declared = path, {}
        self.declared = declared  # the special tokens a tokenizer directory declares (filled below)
        if os.path.isdir(path):
            json_path = os.path.join(path, "tokenizer.json")
            declared.update(_declared_special_tokens(path))
            if not os.path.isfile(json_path):
                raise DataError(f"{path}: a tokenizer directory must hold tokenizer.json (a fast tokenizer); "
                                f"write one with transformers' AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
        try:
            self._tok = _HFTokenizer.from_file(json_path)
        except Exception as e:  # the Rust backend raises a bare Exception subclass
            raise DataError(f"{json_path}: not a Hugging Face tokenizer.json ({e})") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.eod = _special_id(vocab, declared.get("eos_token"), HF_EOD_TOKENS)
        if self.eod is None:
            raise DataError(f"{path}: no end-of-document token (looked for the declared eos_token and "
                            f"{', '.join(HF_EOD_TOKENS)}); add one to the tokenizer")
        self.pad = _special_id(vocab, declared.get("pad_token"), HF_PAD_TOKENS)
        self.bos = _special_id(vocab, declared.get("bos_token"), ())  # only a declared one
        self.declared_bos = self.bos

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` itself (an export wraps it for transformers)."""
        return self._tok

    def encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=False):
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)


def _declared_special_tokens(directory):
    """{'eos_token': str, 'pad_token': str, ...} as a transformers tokenizer directory declares them (a token is
    saved as a string or as an AddedToken dict with its 'content')."""
    declared = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins, as in transformers
        file = os.path.join(directory, name)
        if os.path.isfile(file):
            with open(file) as f:
                for key, value in json.load(f).items():
                    if isinstance(value, dict) and "content" in value:
                        value = value["content"]
                    if key.endswith("_token") and isinstance(value, str):
                        declared[key] = value
    return declared


def _special_id(vocab, declared, spellings):
    """The id of the declared special token, else of the first known spelling in the vocabulary (or None)."""
    for token in ((declared,) if declared else ()) + tuple(spellings):
        if token in vocab:
            return vocab[token]
    return None


def load_tokenizer(path):
    """A SentencePiece `.model`, or a Hugging Face `tokenizer.json` or tokenizer directory (needs `tokenizers`),
    behind one interface."""
    if not os.path.exists(path):
        raise DataError(f"{path}: tokenizer not found (a SentencePiece .model from tools/train_tokenizer.py, or a "
                        f"local Hugging Face tokenizer.json or tokenizer directory)")
    if os.path.isdir(path) or path.endswith(".json"):
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)
