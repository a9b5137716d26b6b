"""Where a decoding token's time goes: the operators of a deployed model's greedy decode, per token.

Loads a directory (a 2:4 one packed with ``load_pretrained``, or a dense one with ``from_pretrained``),
compiles it (``backend="nmsparse"`` for 2:4, Inductor for dense), decodes once to compile, then
profiles a call that makes one token (the prefill) and one that makes ``--new-tokens`` more, and
prints each operator's self CPU time per decoded token (the difference of the two, per token),
largest first, with the share of the token it takes.

    python benchmarks/models/decode_profile.py /work/models/llama-1b-24 --packed --dtype bf16
    python benchmarks/models/decode_profile.py /work/models/llama-1b --dtype bf16
    python benchmarks/models/decode_profile.py /work/models/llama-1b-24 --packed --bits 4   # pack_weights(bits=4)
"""

from __future__ import annotations

import argparse
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir")
    parser.add_argument("--packed", action="store_true", help="a deployed 2:4 directory, loaded packed")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--bits", type=int, choices=(8, 4), help="--packed: then pack_weights(model, bits=...), "
                        "int8 activations")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    if args.packed:
        from nmcompile.deploy import load_pretrained

        model = load_pretrained(args.dir, packed=True, dtype=dtype)
        if args.bits:
            from nmcompile.deploy import pack_weights

            pack_weights(model, bits=args.bits, activations="int8")
        model.forward = torch.compile(model.forward, backend="nmsparse")
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=dtype).eval()
        model.forward = torch.compile(model.forward)
    ids = torch.randint(0, 700, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    def profiled(new_tokens: int):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            seconds = time.perf_counter() - start
        return seconds, {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}

    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.new_tokens + 1, do_sample=False)  # compiles
        first_s, first = profiled(1)  # the prefill and its token
        whole_s, whole = profiled(args.new_tokens + 1)
    n = args.new_tokens
    token_ms = (whole_s - first_s) / n * 1e3
    # each operator's decode share: the whole call's time less the prefill call's, per decoded token
    rows = sorted(((k, (s - first.get(k, (0.0, 0))[0]) / n * 1e3, (c - first.get(k, (0.0, 0))[1]) / n)
                   for k, (s, c) in whole.items()), key=lambda r: r[1], reverse=True)
    print(f"{args.dir} ({'2:4 packed' + (f', {args.bits}-bit' if args.bits else '') if args.packed else 'dense'}, {args.dtype}, {args.threads} threads): "
          f"{token_ms:.1f} ms a decoded token ({n} tokens, the profiler on; self CPU time of each operator "
          "per decoded token, the prefill's call subtracted)")
    for key, ms, calls in rows[:args.top]:
        print(f"  {key[:72]:72} {ms:8.2f} ms  {calls:6.1f} calls  {ms / token_ms:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
