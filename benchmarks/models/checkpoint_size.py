"""Checkpoint bytes: finalized 2:4 model saved dense vs with packed 2:4 weights (nmcompile.deploy.pack_state_dict).

Model: a GPT-2-medium-shaped stack of transformer blocks (d=1024, MLP 4096, random init; no
embeddings, which stay dense anyway), every linear weight annotated ``ste:2:4`` and finalized.
Saved with ``torch.save`` in fp16, bf16 and fp32; the packed files are loaded back, unpacked and
compared with the dense state dict (must be equal).

    python benchmarks/models/checkpoint_size.py [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch import nn

import nmcompile


def model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True) for _ in range(layers)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    net = model(args.layers)
    nmcompile.annotate(net, "ste:2:4")
    nmcompile.finalize(net)
    print(f"{args.layers} blocks, {sum(p.numel() for p in net.parameters()) / 1e6:.1f} M parameters")
    print("| dtype | dense bytes | packed bytes | packed / dense | round trip |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in net.state_dict().items()}
            dense, packed = os.path.join(tmp, "dense.pt"), os.path.join(tmp, "packed.pt")
            torch.save(state, dense)
            torch.save(nmcompile.deploy.pack_state_dict(state), packed)
            restored = nmcompile.deploy.unpack_state_dict(torch.load(packed, weights_only=True))
            exact = restored.keys() == state.keys() and all(torch.equal(restored[k], state[k]) for k in state)
            a, b = os.path.getsize(dense), os.path.getsize(packed)
            print(f"| {str(dtype).removeprefix('torch.')} | {a:,} | {b:,} | {b / a:.4f} | {'exact' if exact else 'MISMATCH'} |")


if __name__ == "__main__":
    main()
