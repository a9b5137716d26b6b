"""Llama-shaped Hugging Face model directories of real size, made here: random weights, nothing downloaded.

    python benchmarks/models/make_models.py --shape 1b --out /work/models/llama-1b
    python benchmarks/models/make_models.py --shape tiny --out /tmp/llama-tiny

Shapes (from the published configs; ``--shape tiny`` is a 2-layer model for tests):

    1b   Llama-3.2-1B    16 layers, width 2048, MLP 8192,  32/8 heads, vocab 128256, tied output head
    3b   Llama-3.2-3B    28 layers, width 3072, MLP 8192,  24/8 heads, vocab 128256, tied output head
    8b   Llama-3.1-8B    32 layers, width 4096, MLP 14336, 32/8 heads, vocab 128256, untied output head

What is written is what ``save_pretrained`` writes, so that the loading code the benchmarks run is
the real one (``transformers.AutoModelForCausalLM.from_pretrained(dir)``):

- ``config.json`` from ``transformers.LlamaConfig(...).save_pretrained`` (rope theta 500000 with the
  Llama-3 frequency scaling, ``max_position_embeddings`` 131072 as published, or ``--max-positions``),
  and ``generation_config.json`` (greedy);
- the weights in bf16 as safetensors shards ``model-0000i-of-0000N.safetensors`` of at most
  ``--max-shard-size`` (default 2GB) each with ``model.safetensors.index.json`` (one shard:
  ``model.safetensors`` and no index, as ``save_pretrained`` does), under Hugging Face's parameter
  names (``model.embed_tokens.weight``, ``model.layers.N.self_attn.q_proj.weight``, ...,
  ``model.norm.weight``, ``lm_head.weight`` when the head is untied);
- a byte-level BPE tokenizer trained here on a short built-in text (``tokenizers``), wrapped in
  ``transformers.PreTrainedTokenizerFast``; its vocabulary (``--tokenizer-vocab``, default 2048) is
  smaller than the model's, so its ids are all in range.

Weights: normal with std 0.02 (norm weights 1.0), each tensor from its own generator seeded with
``--seed`` and the tensor's name (:func:`tensor_for` gives any one back). Written shard by shard and
tensor by tensor: one shard is in memory at a time (about ``--max-shard-size``), never the model. The
directory is written under a temporary name and renamed at the end (whole or absent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import peak_mb  # noqa: E402

VOCAB = 128256


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = VOCAB
    tied: bool = True
    rope_factor: float = 32.0  # Llama 3.2: 32, Llama 3.1: 8

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "tiny": Shape(layers=2, hidden=64, intermediate=256, heads=4, kv_heads=2, vocab=1024),
    "1b": Shape(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8),
    "3b": Shape(layers=28, hidden=3072, intermediate=8192, heads=24, kv_heads=8),
    "8b": Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, tied=False, rope_factor=8.0),
}

STD = 0.02
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

#: the text the tokenizer is trained on (written for this file; any text would do)
TEXT = """\
A language model reads a sequence of tokens and predicts the next one. Each layer of a transformer
mixes the tokens through attention and then transforms each token on its own through a small
network of two or three matrices. Decoding one token at a time reads every weight of the model once,
so on a processor whose memory is slower than its arithmetic the time of a token is the time it
takes to stream the weights from memory. A weight matrix in which two of every four consecutive
values are zero can be stored as the two values that remain and the positions they came from, a
little more than half of the bytes, and a kernel that reads the packed form and expands it in its
registers streams fewer bytes for the same product. The output head and the embedding stay dense.
The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs; how vexingly
quick daft zebras jump. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096 8192 14336 128256.
The river ran past the mill and under the old stone bridge, where the children stood in the evening
to watch the water turn gold and then grey as the light went out of the sky over the hills.
In the morning the market opened early: bread, cheese, apples and pears, fish from the coast, wool,
rope, nails, and a man who mended clocks and sold the ones nobody came back for.
def forward(self, x):\n    return self.down(self.act(self.gate(x)) * self.up(x))\n
{"name": "config", "layers": 16, "width": 2048, "heads": [32, 8], "tied": true}
"""


def config_for(shape: Shape, max_positions: int = 131072):
    """The ``transformers.LlamaConfig`` of a shape (bos/eos: the tokenizer's first two ids)."""
    import transformers

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": shape.rope_factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, hidden_act="silu", max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=shape.tied, bos_token_id=0, eos_token_id=1,
        attention_bias=False, mlp_bias=False, initializer_range=STD)
    config.dtype = torch.bfloat16
    config.architectures = ["LlamaForCausalLM"]  # as a from_pretrained model's save_pretrained writes it
    return config


def tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor the directory holds, in module order, under HF's names."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    out = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (shape.heads * shape.head_dim, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, shape.heads * shape.head_dim)),
                (p + "mlp.gate_proj.weight", (shape.intermediate, h)),
                (p + "mlp.up_proj.weight", (shape.intermediate, h)),
                (p + "mlp.down_proj.weight", (h, shape.intermediate)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not shape.tied:
        out.append(("lm_head.weight", (shape.vocab, h)))
    return out


def tensor_for(name: str, size: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The tensor ``name`` of a model written with ``seed``: norm weights 1.0, the others N(0, 0.02)."""
    if len(size) == 1:
        return torch.ones(size, dtype=dtype)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    out = torch.empty(size, dtype=dtype)
    return out.normal_(0.0, STD, generator=g)


def shards(entries, max_bytes: int, element: int = 2) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors split into shards in order, a new shard when the next tensor would pass ``max_bytes``
    (a tensor larger than that alone in its shard), as ``save_pretrained`` splits a state dict."""
    out, size = [[]], 0
    for name, dims in entries:
        nbytes = element
        for d in dims:
            nbytes *= d
        if out[-1] and size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append((name, dims))
        size += nbytes
    return out


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    upper = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)


def make_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on :data:`TEXT`, as a ``PreTrainedTokenizerFast``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT.splitlines() * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                                 model_max_length=1 << 20)


def is_decoder_linear(name: str) -> bool:
    return ".layers." in name and name.endswith("_proj.weight")


def layout_24(entries, tied: bool):
    """The layout record (nmcompile.json) of a model whose decoder linears are 2:4 along their input."""
    from nmcompile.checkpoint.layout import Layout, LayoutWeight
    from nmcompile.pattern import NMPattern

    layout = Layout()
    for name, dims in entries:
        if is_decoder_linear(name):
            layout.weights[name] = LayoutWeight(NMPattern(2, 4), 1, tuple(dims), "magnitude (make_models.py --nm 2:4)")
        elif len(dims) >= 2:
            layout.dense[name] = "embedding or output head, kept dense"
    if tied:
        layout.tied["lm_head.weight"] = "model.embed_tokens.weight"
    layout.packed = {"file": None, "why": "make_models.py writes safetensors only; load_pretrained(packed=True) packs"}
    return layout


def write_model(out: str, shape: Shape | str, *, seed: int = 0, max_shard_size: int | str = "2GB",
                max_positions: int = 131072, tokenizer_vocab: int = 2048, nm24: bool = False, log=print) -> dict:
    """Write the directory ``out`` (see the module doc); returns what was written (files, bytes, seconds).
    ``nm24``: every decoder linear pruned 2:4 by magnitude along its input, with the layout record
    ``nmcompile.json`` that :func:`nmcompile.deploy.load_pretrained` reads (a stand-in for a pruned model:
    the decode speed does not depend on which weights were kept)."""
    import transformers
    from safetensors.torch import save_file

    shape = SHAPES[shape] if isinstance(shape, str) else shape
    max_bytes = parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    start = time.perf_counter()
    out = os.path.abspath(out)
    if os.path.exists(out):
        raise FileExistsError(f"{out} exists; remove it or choose another --out")
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        tokenizer = make_tokenizer(min(tokenizer_vocab, shape.vocab))
        tokenizer.save_pretrained(tmp)
        bos, eos = tokenizer.convert_tokens_to_ids([BOS, EOS])
        if (bos, eos) != (0, 1) or len(tokenizer) > shape.vocab:
            raise RuntimeError(f"tokenizer: bos/eos ids {bos}/{eos} (expected 0/1), {len(tokenizer)} ids for a model "
                               f"vocabulary of {shape.vocab}")
        config = config_for(shape, max_positions)
        config.save_pretrained(tmp)
        transformers.GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
                                      do_sample=False).save_pretrained(tmp)
        plan = shards(tensors(shape), max_bytes)
        names = (["model.safetensors"] if len(plan) == 1 else
                 [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
        weight_map, total = {}, 0
        umask = os.umask(0)
        os.umask(umask)
        for file, entries in zip(names, plan):
            block = {}
            for name, dims in entries:
                block[name] = tensor_for(name, dims, seed)
                if nm24 and is_decoder_linear(name):
                    from nmcompile import masks

                    block[name] = masks.prune(block[name], 2, 4, 1).contiguous()
                weight_map[name] = file
                total += block[name].numel() * block[name].element_size()
            save_file(block, os.path.join(tmp, file), metadata={"format": "pt"})
            os.chmod(os.path.join(tmp, file), 0o666 & ~umask)  # safetensors writes 0600; the others follow umask
            del block
            log(f"  {file}: {len(entries)} tensors ({time.perf_counter() - start:.0f} s)")
        if nm24:
            from nmcompile.checkpoint.layout import write_layout

            write_layout(tmp, layout_24(tensors(shape), shape.tied))
        if len(plan) > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = sum(_numel(dims) for _, dims in tensors(shape))
    return {"dir": out, "files": names, "bytes": total, "parameters": params, "seconds": time.perf_counter() - start,
            "tokenizer_vocab": len(tokenizer)}


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out", required=True, help="the directory to write (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="2GB", help="bytes per safetensors shard at most (default 2GB)")
    parser.add_argument("--max-positions", type=int, default=131072, help="max_position_embeddings (default "
                        "131072, as published; nothing is allocated from it)")
    parser.add_argument("--tokenizer-vocab", type=int, default=2048)
    parser.add_argument("--untied", action="store_true", help="an untied output head (lm_head.weight) on a tied shape")
    parser.add_argument("--nm", choices=["2:4"], default=None, help="prune every decoder linear 2:4 by magnitude and "
                        "write the layout record (nmcompile.json): a stand-in for a pruned model to load and decode")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.untied:
        shape = replace(shape, tied=False)
    print(f"writing {args.shape} ({shape}) to {args.out}", flush=True)
    try:
        done = write_model(args.out, shape, seed=args.seed, max_shard_size=args.max_shard_size,
                           max_positions=args.max_positions, tokenizer_vocab=args.tokenizer_vocab,
                           nm24=args.nm == "2:4", log=lambda line: print(line, flush=True))
    except (FileExistsError, ValueError) as err:
        print(f"make_models: {err}", file=sys.stderr)
        return 2
    peak = peak_mb()
    print(f"wrote {done['parameters'] / 1e6:.1f} M parameters, {done['bytes'] / 1e6:.1f} MB in {len(done['files'])} "
          f"file(s), tokenizer of {done['tokenizer_vocab']} ids, in {done['seconds']:.1f} s; peak RSS of this "
          f"process {peak:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
