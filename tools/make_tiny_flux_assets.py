"""Write tiny, random, local stand-ins for everything TorchTitan 0.3's FLUX configs download.

    python tools/make_tiny_flux_assets.py DIR [--images 16] [--image-size 64] [--seed 0]

TorchTitan's ``flux_debugmodel`` names a T5 tokenizer and encoder (``google/t5-v1_1-xxl``), a
CLIP tokenizer and text model (``openai/clip-vit-large-patch14``), the FLUX.1 autoencoder
(``assets/hf/FLUX.1-dev/ae.safetensors``) and the ``cc12m-test`` webdataset tars of a TorchTitan
git checkout; the wheel ships none of them and the hub versions are gigabytes. This script writes,
with nothing downloaded:

* ``t5/``: a ``T5EncoderModel`` of 1 layer (``save_pretrained``) whose width is the XXL's 4,096,
  which the FLUX model's ``txt_in`` expects, and a ``T5Tokenizer`` (a Unigram model over the
  captions' words and their letters, built with ``tokenizers``);
* ``clip/``: a ``CLIPTextModel`` of 1 layer, width 768 (CLIP-L's pooled width, the model's
  ``vector_in``), and a ``CLIPTokenizer`` (byte-level BPE over the same words);
* ``ae.safetensors``: TorchTitan's own ``AutoEncoder`` (FLUX.1's shapes, 84 M parameters; with
  ``--autoencoder-channels 32`` the narrower one of ``tests/torchtitan_configs.flux_debug_small``)
  with PyTorch's default random initialization, in the file format and key names ``load_ae`` reads;
* ``cc12m_test/shard-00000.tar``: webdataset members ``NNNNNN.jpg`` (a generated picture: a
  colored shape on a gradient) and ``NNNNNN.txt`` (a caption naming that shape and color).

The directory names matter: TorchTitan tells CLIP from T5 by ``"clip"`` in the path. Pass them as

    --tokenizer.t5_tokenizer_path DIR/t5 --tokenizer.clip_tokenizer_path DIR/clip
    --encoder.t5_encoder DIR/t5 --encoder.clip_encoder DIR/clip --encoder.autoencoder_path DIR/ae.safetensors
    --dataloader.dataset_path DIR/cc12m_test --dataloader.img_size 64

It prints the paths as JSON. Needs TorchTitan (for the autoencoder's shapes), transformers,
tokenizers, safetensors and Pillow: the TorchTitan venv of ``tools/torchtitan_env.sh``.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tarfile
from pathlib import Path

_SHAPES = ["circle", "square", "triangle", "cross", "stripe", "ring"]
_COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
           "white": (245, 245, 245), "black": (15, 15, 15)}
_PLACES = ["on a gray field", "over the sea", "in the morning", "at night", "near a wall", "on paper"]
_SIZES = ["small", "large", "tiny", "big"]


def _caption(rng: random.Random) -> tuple[str, str, str]:
    shape, color = rng.choice(_SHAPES), rng.choice(list(_COLORS))
    return f"a {rng.choice(_SIZES)} {color} {shape} {rng.choice(_PLACES)}", shape, color


def _words() -> list[str]:
    words = {"a", *_SHAPES, *_COLORS, *_SIZES}
    for place in _PLACES:
        words.update(place.split())
    return sorted(words)


def _t5_tokenizer(directory: Path):
    """A T5Tokenizer (Unigram, T5's special-token layout) over the captions' words and letters."""
    from transformers import T5Tokenizer

    words = _words()
    letters = sorted({c for w in words for c in w})
    # T5's layout: <pad>=0, </s>=1, <unk>=2, then pieces (longer words score higher), then extra ids.
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in words] + [(c, -5.0) for c in letters]
    extra = 8
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(extra - 1, -1, -1)]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=extra)
    tokenizer.save_pretrained(directory)
    return tokenizer


def _byte_alphabet() -> list[str]:
    """The 256 printable characters byte-level BPE (GPT-2's, CLIP's) stands for the bytes with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _clip_tokenizer(directory: Path):
    """A CLIPTokenizer: CLIP's byte-level alphabet with end-of-word pieces, and BPE merges that
    spell each caption word."""
    from transformers import CLIPTokenizer

    alphabet = _byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges = []
    for word in _words():
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merge = (pieces[0], pieces[1])
            merged = pieces[0] + pieces[1]
            if merge not in merges:
                merges.append(merge)
            if merged not in tokens:
                tokens.append(merged)
            pieces = [merged, *pieces[2:]]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tokenizer.save_pretrained(directory)
    return tokenizer


def _t5_encoder(directory: Path, vocab_size: int) -> None:
    from transformers import T5Config, T5EncoderModel

    # t5-v1_1: gated GELU feed-forward, no tied embeddings; width 4,096 as the XXL's (FLUX's txt_in)
    config = T5Config(vocab_size=vocab_size, d_model=4096, d_kv=16, num_heads=2, d_ff=64, num_layers=1,
                      num_decoder_layers=0, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    T5EncoderModel(config).save_pretrained(directory)


def _clip_encoder(directory: Path, tokenizer) -> None:
    from transformers import CLIPTextConfig, CLIPTextModel

    # width 768 as CLIP-L's pooled output (FLUX's vector_in); 77 positions as CLIP's
    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=768, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
                            attention_dropout=0.0, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    CLIPTextModel(config).save_pretrained(directory)


def _autoencoder(path: Path, channels: int) -> int:
    """TorchTitan's FLUX.1 AutoEncoder, randomly initialized, saved as load_ae reads it."""
    from safetensors.torch import save_file
    from torchtitan.models.flux.model.autoencoder import AutoEncoder

    model = AutoEncoder.Config(ch=channels).build()  # the registered settings: ch=128
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path))
    return sum(v.numel() for v in state.values())


def _picture(rng: random.Random, size: int, shape: str, color: str) -> bytes:
    """A JPEG: a colored shape on a two-color gradient."""
    from PIL import Image, ImageDraw

    top, bottom = (tuple(rng.randrange(60, 200) for _ in range(3)) for _ in range(2))
    img = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(img)
    for y in range(size):
        t = y / (size - 1)
        draw.line([(0, y), (size, y)], fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom)))
    fill = _COLORS[color]
    r = rng.randrange(size // 6, size // 3)
    cx, cy = rng.randrange(r, size - r), rng.randrange(r, size - r)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=max(2, r // 3))
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    elif shape == "cross":
        draw.rectangle((cx - r, cy - r // 4, cx + r, cy + r // 4), fill=fill)
        draw.rectangle((cx - r // 4, cy - r, cx + r // 4, cy + r), fill=fill)
    else:  # stripe
        draw.rectangle((0, cy - r // 3, size, cy + r // 3), fill=fill)
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=95)
    return out.getvalue()


def _shard(path: Path, images: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    with tarfile.open(path, "w") as tar:
        for i in range(images):
            caption, shape, color = _caption(rng)
            for suffix, data in ((".jpg", _picture(rng, size, shape, color)), (".txt", caption.encode())):
                info = tarfile.TarInfo(f"{i:06d}{suffix}")
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))


def write_flux_assets(root: str | Path, images: int = 16, image_size: int = 64, seed: int = 0,
                      autoencoder_channels: int = 128) -> dict[str, str]:
    """Write the tokenizers, encoders, autoencoder and dataset under ``root``; return their paths."""
    import torch

    root = Path(root)
    t5_dir, clip_dir, data_dir, ae_path = root / "t5", root / "clip", root / "cc12m_test", root / "ae.safetensors"
    for d in (t5_dir, clip_dir, data_dir):
        d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    t5_tok = _t5_tokenizer(t5_dir)
    _t5_encoder(t5_dir, len(t5_tok))
    clip_tok = _clip_tokenizer(clip_dir)
    _clip_encoder(clip_dir, clip_tok)
    _autoencoder(ae_path, autoencoder_channels)
    _shard(data_dir / "shard-00000.tar", images, image_size, seed)
    return {"t5": str(t5_dir), "clip": str(clip_dir), "autoencoder": str(ae_path), "dataset": str(data_dir)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--autoencoder-channels", type=int, default=128,
                        help="the autoencoder's base channels (FLUX.1's: 128; a model config with fewer "
                             "needs the same here)")
    args = parser.parse_args(argv)
    print(json.dumps(write_flux_assets(args.directory, args.images, args.image_size, args.seed,
                                       args.autoencoder_channels)))


if __name__ == "__main__":
    main()
