"""The Hugging Face export inside transformers behaves as the training tokenizer: transformers' text-generation
pipeline (which decodes the continuation alone and appends it to the prompt), `generate` + `decode`, and gptpar's
tools/generate.py with the run's SentencePiece tokenizer give the same text on multilingual prompts, compared after
stripping leading whitespace (a whole-sequence `decode` of the export starts with the dummy prefix's space;
docs/evaluation.md).

A tiny random GPT exported by gptpar's Hugging Face export (`save_hf`, what tools/convert_checkpoint.py --to hf
writes) with the tokenizer the README's own-data block trains on a generated multilingual corpus (byte fallback, the
vocabulary the corpus reaches); in one process, offline."""
import contextlib
import io

import pytest
import torch

from gptpar.testing.corpus import write_corpus
from gptpar.testing.runs import environ_kept

transformers = pytest.importorskip("transformers")

PROMPTS = ["The river rose", "Der Fluss stieg", "Ο ποταμός ανέβηκε", "河水一夜之间", "def weighted_sum(items):",
           "Ωmega naïve café 🚀"]
NEW_TOKENS = 6


def _tool(module, argv):
    buf = io.StringIO()
    with environ_kept(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = module.main(argv)
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(the SentencePiece model, the export folder): a random 2-layer GPT on the corpus's tokenizer, exported."""
    from gptpar.checkpoint.huggingface import save_hf
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel
    from gptpar.tools import train_tokenizer

    d = tmp_path_factory.mktemp("hf_pipeline")
    write_corpus(str(d / "corpus.jsonl"), n_docs=300)
    pieces = train_tokenizer.train([str(d / "corpus.jsonl")], 4096, "bpe", str(d / "tok"), byte_fallback=True,
                                   cap_vocab=True)
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64, vocab_size=pieces)
    torch.manual_seed(0)
    model = GPTModel(config)
    save_hf(model.state_dict(), config, str(d / "hf"), str(d / "tok.model"), log=lambda line: None)
    return str(d / "tok.model"), str(d / "hf")


def test_a_continuation_decoded_alone_keeps_its_space(export):
    """The decoder property the pipeline needs: the prompt decoded, then the rest decoded alone, is the text (with
    the one leading space of the dummy prefix), for every split point of multilingual text."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(export[1])
    for text in ["The river rose three feet overnight.", "Die Straßenbahn fährt 🚀 bis zur Endhaltestelle"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for cut in range(1, len(ids)):
            assert tokenizer.decode(ids[:cut]) + tokenizer.decode(ids[cut:]) == " " + text, (text, cut)


def test_pipeline_generate_and_gptpar_give_the_same_text(export):
    from gptpar.tools import generate

    sp_model, hf = export
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    spaced = 0  # continuations that start with a "▁" piece: the case the pipeline used to glue to the prompt
    for prompt in PROMPTS:
        kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        piped = pipe(prompt, **kw)[0]["generated_text"]
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, **kw)
        decoded = tokenizer.decode(out[0], skip_special_tokens=True)
        first_new = tokenizer.convert_ids_to_tokens(out[0][inputs["input_ids"].shape[1]:].tolist())[0]
        spaced += first_new.startswith("▁")
        rc, ours = _tool(generate, ["--load", hf, "--tokenizer", sp_model, "--prompt", prompt,
                                    "--max-new-tokens", str(NEW_TOKENS), "--greedy"])
        assert rc == 0, ours
        ours = ours.rstrip("\n")
        assert piped.lstrip() == decoded.lstrip() == ours.lstrip(), (prompt, piped, decoded, ours)
    assert spaced, "no continuation started with a '▁' piece: this test would not see a lost space"
