"""Write a random-weight Hugging Face checkpoint in a real model's shape, for speed work.

    python scripts/make_random_checkpoint.py --shape llama-3.2-1b --out /tmp/llama-1b
    python scripts/make_random_checkpoint.py --shape llama-3.1-70b --config-only --out /tmp/70b

Shapes: Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B, Qwen3-0.6B, Qwen2.5-0.5B, Gemma-3-1B, and
the mixtures of experts Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral-8x7B, gpt-oss-20b and
gpt-oss-120b (bfloat16, gpt-oss's experts too, as the engine holds them once it dequantized
the published MXFP4; the MoE ones are 61, 470, 93, 42 and 234 GB of weights: make them
--config-only). --config-only writes config.json
and the tokenizer and no weights, for the engine's --load-format dummy (random weights made on
the GPUs at start-up).
Throughput does not depend on the weights' values; the tokenizer maps every id to a word, the
last ones to the printable ASCII characters (so that structured outputs can spell JSON).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tandem.testing.random_checkpoint import SHAPES, save_random_config, save_random_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--config-only", action="store_true", help="no weights: for --load-format dummy"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.config_only:
        save_random_config(args.out, args.shape)
    else:
        save_random_model(args.out, args.shape, torch.bfloat16)
    print(f"wrote {args.shape}{' (config only)' if args.config_only else ''} to {args.out}")


if __name__ == "__main__":
    main()
