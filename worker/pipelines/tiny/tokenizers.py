"""The tiny pipelines' tokenizers, built in memory so no build or load ever reaches the hub:
CLIP byte-level BPE, T5 unigram, and the Qwen2 / Qwen3 byte-level BPE the Qwen text encoders use.
"""

from __future__ import annotations

import string
from typing import Final

from tokenizers import AddedToken, pre_tokenizers
from transformers import CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer

# Real CLIP and the pipelines' default prompt length; the positional table must cover it.
CLIP_MAX_LENGTH: Final = 77
# StableDiffusion3Pipeline's default max_sequence_length for the T5 prompt.
T5_MAX_LENGTH: Final = 256
# FLUX.1's tokenizer_2 and the Qwen tokenizers record these as their model_max_length.
FLUX_T5_MAX_LENGTH: Final = 512
QWEN_MAX_LENGTH: Final = 131072
# umT5-XXL's prompt length in Wan: WanPipeline pads every prompt to max_sequence_length=512.
UMT5_MAX_LENGTH: Final = 512

# The GPT-2 byte alphabet: each of the 256 bytes as one printable symbol. Sorting by code point
# gives GPT-2's own id order ("!" is 0, "Ġ" (space) is 220), so the ids read like a real vocab's.
_BYTE_SYMBOLS: Final = sorted(pre_tokenizers.ByteLevel.alphabet())


def clip_tokenizer() -> CLIPTokenizer:
    # Real CLIP's vocab layout without merges: the 256 byte-level symbols, the same symbols with
    # the "</w>" end-of-word suffix CLIPTokenizer always applies, then the two specials. Without
    # the suffixed half every word's last byte would become <|endoftext|> (the unk token).
    symbols = [
        *_BYTE_SYMBOLS,
        *(f"{c}</w>" for c in _BYTE_SYMBOLS),
        "<|startoftext|>",
        "<|endoftext|>",
    ]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


_T5_WORDS: Final = """
a an the of and or in on at to with from by for as is are be this that it its his her their
photo photograph picture image painting drawing sketch render illustration portrait landscape
close up wide shot view detailed highly realistic cinematic lighting light dark night day
sunset sunrise morning evening sky cloud clouds sun moon star stars rain snow fog mist storm
city street road house building tower castle bridge river lake sea ocean beach mountain hill
forest tree trees flower flowers garden field grass desert island space planet
man woman person people girl boy child old young face eyes hair hand hands smile
cat cats dog dogs bird birds horse fish dragon robot car ship boat train plane
red orange yellow green blue purple pink black white gray grey brown gold golden silver
big small large tiny little tall long short bright soft sharp blurry beautiful cute
style art artist digital oil watercolor anime cartoon pixel 3d 4k 8k hd quality best
in front behind under over above below next inside outside near far
standing sitting walking running flying holding wearing looking reading playing
"""


def t5_tokenizer(model_max_length: int = T5_MAX_LENGTH) -> T5Tokenizer:
    # T5's id layout (<pad>=0, </s>=1, <unk>=2 are fixed by T5Tokenizer), then pieces whose
    # scores make whole words beat their spellings; unknown characters (emoji, CJK) become <unk>
    # as they do with the real SentencePiece vocab.
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [(c, -8.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [(f"▁{c}", -7.0) for c in string.ascii_lowercase + string.digits]
    known = {p for p, _ in pieces}
    pieces += [(f"▁{w}", -4.0) for w in dict.fromkeys(_T5_WORDS.split()) if f"▁{w}" not in known]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def umt5_tokenizer() -> T5Tokenizer:
    """umT5-XXL's tokenizer (Wan's): a SentencePiece unigram with T5's special ids (<pad>=0,
    </s>=1, as UMT5Config's pad_token_id and eos_token_id), so the tiny T5 vocab serves; only the
    length is umT5's in Wan."""
    return t5_tokenizer(UMT5_MAX_LENGTH)


# The specials every Qwen2 / Qwen3 vocab opens its added tokens with, in the real ids' order.
_QWEN_SPECIALS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-VL's vision markers: the text encoder's config names their ids, so they must exist.
_QWEN_VL_SPECIALS: Final = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen3 marks reasoning with these; they are ordinary (non-special) added tokens there.
_QWEN3_THINK: Final = ("<think>", "</think>")

# The tail of Qwen3's own chat template, which is all the pipelines use: one turn per message,
# then the assistant's opening, with the empty think block Qwen3 adds when thinking is off
# (Flux2KleinPipeline passes enable_thinking=False, ZImagePipeline True).
QWEN3_CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def qwen2_vl_tokenizer() -> Qwen2Tokenizer:
    """Qwen2.5-VL's tokenizer (QwenImagePipeline's): byte-level BPE, no merges, so every byte of
    a prompt is one token and nothing is ever unknown."""
    return _qwen_tokenizer((*_QWEN_SPECIALS, *_QWEN_VL_SPECIALS), plain=(), chat_template=None)


def qwen3_tokenizer() -> Qwen2Tokenizer:
    """Qwen3's tokenizer (Flux2KleinPipeline's and ZImagePipeline's), with its chat template."""
    return _qwen_tokenizer(_QWEN_SPECIALS, plain=_QWEN3_THINK, chat_template=QWEN3_CHAT_TEMPLATE)


def _qwen_tokenizer(
    specials: tuple[str, ...], plain: tuple[str, ...], chat_template: str | None
) -> Qwen2Tokenizer:
    # Qwen2Tokenizer brings the real pre-tokenizer (NFC, Qwen's split regex, byte-level) and the
    # byte-level decoder; only vocab and merges are ours. Eos is <|im_end|> and pad
    # <|endoftext|>, as in the instruct models' tokenizer_config.json.
    vocab = {symbol: i for i, symbol in enumerate((*_BYTE_SYMBOLS, *specials, *plain))}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        # Annotated str, but None is what Qwen's tokenizer_config.json holds: no byte is unknown.
        unk_token=None,  # type: ignore[arg-type]
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[s for s in specials if s not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=QWEN_MAX_LENGTH,
    )
    tokenizer.add_tokens([AddedToken(token, special=False) for token in plain])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def token_id(tokenizer: Qwen2Tokenizer, token: str) -> int:
    """The id of one token of tokenizer's vocab, for the text encoders' configs."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found == tokenizer.unk_token_id:
        raise ValueError(f"token {token!r}: not in the tokenizer's vocab (got {found!r})")
    return found
