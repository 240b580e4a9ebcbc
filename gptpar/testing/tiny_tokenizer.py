"""A small Hugging Face fast tokenizer trained here on gptpar's own sources (byte-level BPE, nothing downloaded),
saved as the directory `PreTrainedTokenizerFast.save_pretrained` writes: the tests' stand-in for BLOOM's or
GPT-2's tokenizer."""
import glob
import os

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gptpar/
SPECIAL_TOKENS = ["<pad>", "</s>", "<end>"]  # "<end>" is the declared eos: not a spelling gptpar guesses


def source_texts(limit=12):
    """Python sources of the package, a few kB of text with code's whitespace."""
    return [open(p).read() for p in sorted(glob.glob(os.path.join(PACKAGE, "*", "*.py")))[:limit]]


def train_hf_tokenizer(out_dir, vocab_size=300, texts=None):
    """Train a byte-level BPE of `vocab_size` tokens and save it as a transformers tokenizer directory with
    eos_token "<end>" and pad_token "<pad>"; returns out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts or source_texts(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end>", pad_token="<pad>").save_pretrained(out_dir)
    return str(out_dir)
