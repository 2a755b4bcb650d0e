"""`kvcake generate`: one prompt through one engine instance, printed as text or one JSON object."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvcake.engine.config import EngineConfig
from kvcake.engine.sampling import SamplingParams

_ENGINE = EngineConfig()
_SAMPLING = SamplingParams()


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate from one prompt with the engine")
    p.add_argument("--model", default="tiny", help="preset (tiny, small) or a Hugging Face "
                   "model directory (default: tiny)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    p.add_argument("--max-tokens", type=int, default=_SAMPLING.max_tokens)
    p.add_argument("--temperature", type=float, default=_SAMPLING.temperature,
                   help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=_SAMPLING.top_k)
    p.add_argument("--top-p", type=float, default=_SAMPLING.top_p)
    p.add_argument("--seed", type=int, default=_SAMPLING.seed)
    p.add_argument("--dtype", default=_ENGINE.dtype, help="float32, bfloat16 or float16")
    p.add_argument("--device", default=_ENGINE.device, help="auto, cpu or cuda")
    p.add_argument("--block-size", type=int, default=_ENGINE.block_size)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def parse_prompt_ids(text: str) -> list[int]:
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise ValueError(f"--prompt-ids: {part!r} is not an integer; pass comma-separated "
                             "token ids such as 1,2,3") from None
    return ids


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    from kvcake.engine.llm import LLM  # torch loads only when the command runs

    llm = LLM(args.model, EngineConfig(dtype=args.dtype, device=args.device,
                                       block_size=args.block_size))
    prompt: str | list[int] = args.prompt if args.prompt is not None \
        else parse_prompt_ids(args.prompt_ids)
    [out] = llm.generate([prompt], params)
    if args.json:
        print(json.dumps({
            "model": args.model, "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
            "ttft_s": round(out.ttft_s, 6), "cached_tokens": out.num_cached_tokens}))
    else:
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    return 0
