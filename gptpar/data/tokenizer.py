"""The tokenizer interface shared by the tools and the trainer: encode, decode, vocab_size, eod, pad.

Two backends: a SentencePiece `.model` (what tools/train_tokenizer.py writes; EOD is SentencePiece's EOS
id, as in Megatron's GPTSentencePieceTokenizer) and, where the `tokenizers` package is installed, a
Hugging Face `tokenizer.json`.
"""
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

    def encode(self, text):
        return self._sp.encode(text)

    def decode(self, ids):
        return self._sp.decode(list(map(int, ids)))


class HFTokenizer:
    def __init__(self, path):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise DataError(f"{path}: loading a tokenizer.json needs the 'tokenizers' package") from e
        self.path = path
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as e:  # the Rust backend raises a bare Exception subclass
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({e})") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eod = next((vocab[t] for t in HF_EOD_TOKENS if t in vocab), None)
        if eod is None:
            raise DataError(f"{path}: no end-of-document token (looked for {', '.join(HF_EOD_TOKENS)}); "
                            f"add one to the tokenizer")
        self.eod = eod
        self.pad = next((vocab[t] for t in HF_PAD_TOKENS if t in vocab), None)

    def encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)


def load_tokenizer(path):
    """A SentencePiece `.model`, or a Hugging Face `.json` (needs `tokenizers`), behind one interface."""
    if not os.path.exists(path):
        raise DataError(f"{path}: tokenizer file not found (train one with tools/train_tokenizer.py)")
    if path.endswith(".json"):
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)
