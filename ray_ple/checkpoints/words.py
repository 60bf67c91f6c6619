"""The word-level tokenizer of the embedded models and the geometry checkpoints (`w<i>` for id
i): tokenizers and transformers only, so a checkpoint writer needs nothing else of ray-ple."""

from __future__ import annotations

from pathlib import Path


def word_tokenizer(vocab_size: int, out: Path, media: dict[int, str] | None = None,
                   special: dict[str, str] | None = None, template: str | None = None) -> None:
    """A word-level tokenizer (`w<i>`); `media`: ids spelled otherwise, matched before the
    split on whitespace (newlines included); `special`: the names the processor reads
    (`tokenizer.image_token`, ...)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(4, vocab_size)]
    for i, spelling in (media or {}).items():
        words[i] = spelling
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(w, normalized=False) for w in (media or {}).values()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>",
                                   **({"extra_special_tokens": special} if special else {}))
    fast.chat_template = template or (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w4{% endif %}")
    fast.save_pretrained(out)
