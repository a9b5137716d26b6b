"""Peak resident memory of ``nmcompile.deploy.load_pretrained(DIR, packed=True)`` on Llama-3-8B-shaped layers.

Builds a Llama with the 8B shapes (hidden 4096, MLP 14336, 32 heads, 8 KV heads) but ``--layers`` blocks and a
``--vocab`` vocabulary (defaults 2 and 32000: 1.4 GB dense in bf16, so that it fits a small machine), prunes every
linear weight but the head to 2:4 by magnitude, and saves it with ``nmcompile.deploy.save_pretrained``. Then, in a
fresh process: the baseline (resident memory after the imports and a warm-up load of a tiny model), the packed
load (its peak over the baseline against the packed model's bytes, and its seconds), and a greedy decode of
``--tokens`` tokens (the peak again). The 8B model (32 blocks, vocabulary 128256) is extrapolated: its packed
bytes from the measured bytes per block plus its embedding and head, plus what this load peaked above its own
packed bytes (chunk temporaries, independent of the model's size) and the baseline.

    python benchmarks/models/load_packed_memory.py [--layers 2] [--vocab 32000] [--tokens 16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import ROOT, peak_mb, reset_peak, resident_mb  # noqa: E402

GiB = 2**30


def _resident(model) -> int:
    from nmcompile.deploy import PackedLinearWeight

    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        for part in (t.values, t.bits) if isinstance(t, PackedLinearWeight) else (t,):
            storages[part.untyped_storage().data_ptr()] = part.untyped_storage().nbytes()
    return sum(storages.values())


def child(tiny: str, path: str, tokens: int) -> None:
    from nmcompile.deploy import load_pretrained

    load_pretrained(tiny, packed=True)
    gc.collect()
    reset_peak()  # the peak counts again from here
    baseline = int(resident_mb() * 2**20)
    start = time.perf_counter()
    model = load_pretrained(path, packed=True)
    seconds = time.perf_counter() - start
    load_peak = int(peak_mb() * 2**20)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    decode_seconds = time.perf_counter() - start
    print(json.dumps({"baseline": baseline, "load_peak": load_peak, "decode_peak": int(peak_mb() * 2**20),
                      "packed": _resident(model), "seconds": seconds, "decode_seconds": decode_seconds,
                      "tokens": out.shape[1] - ids.shape[1], "threads": torch.get_num_threads()}))


def build(path: str, layers: int, vocab: int, hidden=4096, intermediate=14336, heads=32, kv_heads=8) -> None:
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from models import magnitude_2_4
    from nmcompile.deploy import save_pretrained

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    magnitude_2_4(model)
    save_pretrained(model, path, packed=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--dir", default=None, help="where to write the models (default: a temporary folder)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.tokens)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tiny, big = os.path.join(tmp, "tiny"), os.path.join(tmp, "big")
        build(tiny, 1, 256, hidden=64, intermediate=128, heads=4, kv_heads=2)
        build(big, args.layers, args.vocab)
        dense = os.path.getsize(os.path.join(big, "model.safetensors"))
        done = subprocess.run([sys.executable, __file__, "--child", tiny, big, "--tokens", str(args.tokens)],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        m = json.loads(done.stdout.strip().splitlines()[-1])
    grown, packed = m["load_peak"] - m["baseline"], m["packed"]
    embed = 2 * args.vocab * 4096 * 2 + 4096 * 2  # embedding, head and final norm (bf16)
    per_block = (packed - embed) / args.layers
    packed_8b = 32 * per_block + 2 * 128256 * 4096 * 2 + 4096 * 2
    extra = grown - packed
    print(f"{args.layers} blocks of Llama-3-8B shape, vocabulary {args.vocab}, bf16; {m['threads']} threads")
    print(f"  safetensors file {dense / GiB:.3f} GiB; packed model {packed / GiB:.3f} GiB ({per_block / 2**20:.1f} MiB "
          "per block)")
    print(f"  load: {m['seconds']:.1f} s, peak {grown / GiB:.3f} GiB over the baseline ({m['baseline'] / GiB:.3f} GiB) "
          f"= {grown / packed:.3f}x the packed bytes")
    print(f"  decode of {m['tokens']} tokens: {m['decode_seconds']:.1f} s, peak "
          f"{(m['decode_peak'] - m['baseline']) / GiB:.3f} GiB over the baseline")
    print(f"  8B extrapolated: packed {packed_8b / GiB:.2f} GiB; load peak {(m['baseline'] + packed_8b + extra) / GiB:.2f}"
          f" GiB resident (baseline included); load time {m['seconds'] * 32 / args.layers:.0f} s at most")


if __name__ == "__main__":
    main()
